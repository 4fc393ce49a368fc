// The Chrome trace (--trace): trace-event JSON that Perfetto and chrome://tracing open. One process;
// per device a lane of its step phases and evaluations and, when gradients go in buckets, a lane
// right below it of its communication thread's bucket all-reduces, which shows how far they overlap
// backward; last a "host" lane of the trainer's spans (epochs).
#pragma once

#include <nlohmann/json.hpp>

#include "engine/engine.h"

namespace dp {

// Complete ("X") events, ts and dur in microseconds since the engine started plus offset_us (so a
// caller can lay several engines on one time origin), sorted by ts after the metadata ("M") events.
// Lanes (tid): device r is r, its communication thread size() + r, the host 2 size(); thread_sort_index
// places each device's communication lane right after it.
nlohmann::json trace_json(Engine& engine, double offset_us = 0);

}  // namespace dp
