// The Chrome trace (--trace): trace-event JSON that Perfetto and chrome://tracing open. One process;
// per device a lane of its step phases and evaluations and, when gradients go in buckets, a lane
// right below it of its communication thread's bucket all-reduces, which shows how far they overlap
// backward; last a "host" lane of the trainer's spans (epochs). Across processes (mpirun), one file
// still: every rank's lanes under a process of their own (pid = rank).
#pragma once

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/process_group.h"

namespace dp {

// Complete ("X") events, ts and dur in microseconds since the engine started plus offset_us (so a
// caller can lay several engines on one time origin), sorted by ts after the metadata ("M") events.
// Lanes (tid): device r is r, its communication thread size() + r, the host 2 size(); thread_sort_index
// places each device's communication lane right after it.
nlohmann::json trace_json(Engine& engine, double offset_us = 0);

// Across processes, the amount that moves this process's engine clock onto rank 0's (0 on rank 0).
// Every process's engine clock starts at its own zero (when its Engine was built), so every rank
// reads its clock right after one barrier: that instant is common to all of them, up to how far apart
// the ranks see the barrier complete (one message's latency plus the wait's polling, wait.h: some
// tens of microseconds on one host; a preempted rank adds its delay). Rank 0's reading, broadcast,
// less this rank's is the offset. Call it before the first span is recorded, so that every shifted ts
// stays >= 0. Collective.
double clock_offset_to_rank0(ProcessGroup& g, Engine& engine, double timeout);

// Across processes: every rank's trace_json (offset_us: its clock_offset_to_rank0) gathered on the
// host channel and merged into one trace on rank 0, returned there (null on the other ranks): rank r's
// events under pid r, named by a process_name "rank r (host)" and ordered by rank; its devices' lanes
// named by their job rank (sim:2 is rank 1's device 0 with --devices 2). Every rank receives every
// rank's events (an all-gather), about the size of the file rank 0 writes. Collective.
nlohmann::json job_trace_json(ProcessGroup& g, Engine& engine, double offset_us, double timeout);

}  // namespace dp
