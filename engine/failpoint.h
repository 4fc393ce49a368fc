// Failpoints: the places where a test makes dp fail, stall or signal itself on purpose, as etcd's
// gofail and TiKV's fail-rs put them. Each is a call here. A release binary links
// engine/failpoint/none.cpp, where every call does nothing and nothing reads the environment (a
// shipped dp_train or dp_bench has no DP_TEST_ string in it); the test build's binaries (dp_tests,
// dp_train_failpoints) link tests/failpoint/failpoints.cpp, which arms them from the tests' own calls
// (tests/failpoint/failpoints.h) and from the environment of a dp_train a test starts:
//   DP_TEST_AT=point:action,...      at(): raise SIGINT, SIGTERM or SIGHUP at this process, hang,
//                                    fail (throw IoError, as a refused write) or sleepN (N ms)
//   DP_TEST_STALL=<collective>:<rank> collective(): that rank of every communicator never arrives in its
//                                    first such collective (names as collective_name gives them)
//   DP_TEST_STALL_RANK=<process>     across_processes(): that process stops answering at its first
//                                    all-reduce across processes
//   DP_TEST_VERIFY_OFFSET=<x>        verify_offset(): --verify's reference moved by x
//   DP_TEST_DESYNC=<process>:<step>  recorded_bytes(): that process's first collective of the step is
//                                    recorded 4 bytes larger
//   DP_TEST_SLOW_UPLOADS=<ms>        upload_delay(): every device's uploads ahead wait that long first
//   DP_TEST_NCCL=always              nccl_always(): NCCL for any CUDA devices (one_gpu_nccl below)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "engine/communicator.h"

namespace dp {

class Device;

namespace failpoint {

// A moment of the run (train/): "start", "step" with n the global step it is about to run, "batch" with
// n the 0-based step whose batch the loader hands over, "final-eval", "final-save", "report", "trace",
// "temp-file", "probe", "log" with n the step of the --log record.
void at(const char* point, int64_t n = -1);
// A device's kernel work, where it may throw an injected fault (DeviceError naming the device).
void device_call(const Device& dev, const char* where);
// How long a device's upload ahead waits before it copies (a slow copy engine): a simulated device's
// copy thread sleeps, a CUDA device's copy stream runs a host function that sleeps.
std::chrono::milliseconds upload_delay(const Device& dev);
// How long a simulated device's copy from a peer waits before it reads the peer's buffer (a slow link).
std::chrono::milliseconds peer_copy_delay(const Device& dev);
// How long a device holds a step before its stats are copied out (Device::download_async; a slow
// step): a CUDA device's compute stream runs a host function that sleeps, so the host enqueues the
// next step (--run-ahead) while this one still runs; a simulated device sleeps.
std::chrono::milliseconds step_end_delay(const Device& dev);
// A communicator was built (throws UsageError for a malformed DP_TEST_STALL), and one of its ranks
// enters collective c: where a stall is armed there the rank stops answering until a peer's timeout
// aborts the collective (aborted() turns true) and throws Aborted, or past twice `timeout` TimedOut.
void communicator_built(const Communicator& comm);
void collective(const Communicator& comm, int rank, Collective c, const std::function<bool()>& aborted, double timeout);
// A process's device `rank` is about to all-reduce its chunk across the processes.
void across_processes(const Communicator& comm, int process, int rank, double timeout);
// Whether a process's CUDA devices take NCCL's communicator wherever they are CUDA devices: one GPU
// alone (a one-rank clique, so NCCL's start, its polled waits, abort, --timeout and buckets on the
// communication stream run on a machine with one GPU) or a GPU named twice (NCCL refuses it, and the
// fallback to peer copies runs); across processes, NCCL is asked for a GPU that two processes share.
// False in a release binary: NCCL only for two or more distinct GPUs.
bool nccl_always();
// What --verify adds to its reference's first weight before comparing (0 in a release binary).
double verify_offset();
// The bytes a collective's flight record says (flight_recorder.h): `bytes`, but DP_TEST_DESYNC=<process>:
// <step> makes that process record its first collective of that step 4 bytes larger, once: a process
// that disagrees with the others, for the desync check to find.
int64_t recorded_bytes(int process, int64_t step, int64_t bytes);

}  // namespace failpoint
}  // namespace dp
