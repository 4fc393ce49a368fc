// Bounded waits. A rank that waits for its peers (at the communicator's barrier, or on a GPU stream
// where NCCL's kernel waits for the peers' halves of an all-reduce) must not wait forever: a peer
// may have failed, or stopped answering. Every such wait has a deadline, the collective timeout
// (dp_train --timeout, default 10 minutes as PyTorch's NCCL process groups), and watches for an
// abort (another rank failed) while it waits, the way ProcessGroupNCCL's watchdog does.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "kernels/error.h"

namespace dp {

// Seconds, dp_train's --timeout default: PyTorch's for NCCL (torch.distributed's 10 minutes).
inline constexpr double kDefaultTimeout = 600;

// A wait that ran past --timeout. The message names what was waited for and the timeout.
struct TimedOut : DeviceError {
  using DeviceError::DeviceError;
};

// When a wait gives up: `at`, set from a timeout of `seconds` (kept for the message).
struct Deadline {
  std::chrono::steady_clock::time_point at;
  double seconds = 0;
  // now + seconds, saturating at the clock's end (a timeout of a century stays a deadline).
  static Deadline after(double seconds);
};

// "<what> did not finish within <seconds> s (--timeout): <why>", the timeout written as %g (600, 0.5).
std::string timeout_message(const std::string& what, double seconds, const std::string& why);

// Returns once done() says true. Between polls it asks aborted(): true makes it throw Aborted; and
// when the deadline passes first it throws TimedOut(device, timeout_message(what(), ...,
// "a peer stopped answering")). done() is asked first, so finished work is never reported as a
// failure. Either predicate may throw an error of its own (an NCCL error, say), which propagates.
// It yields between polls for the first `spin` (1 ms: a GPU wait keeps a latency of microseconds),
// then sleeps 100 µs per poll (a long wait costs no core). MPI's non-blocking collectives move only
// while they are polled, so their waits spin longer (mpi_group.cpp).
void poll_until(const std::function<bool()>& done, const std::function<bool()>& aborted, const Deadline& deadline,
                int device, const std::function<std::string()>& what,
                std::chrono::microseconds spin = std::chrono::milliseconds(1));

}  // namespace dp
