#include "engine/wait.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "engine/error.h"

namespace dp {

Deadline Deadline::after(double seconds) {
  using Clock = std::chrono::steady_clock;
  // At most about 30 years ahead: a larger timeout would overflow the clock's count of nanoseconds
  // (and condition variables have mishandled waits until time_point::max()); the message keeps the
  // timeout as given.
  const double capped = std::min(seconds, 1e9);
  return {Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(capped)), seconds};
}

std::string timeout_message(const std::string& what, double seconds, const std::string& why) {
  char s[32];
  std::snprintf(s, sizeof s, "%g", seconds);
  return what + " did not finish within " + s + " s (--timeout): " + why;
}

void poll_until(const std::function<bool()>& done, const std::function<bool()>& aborted, const Deadline& deadline,
                int device, const std::function<std::string()>& what, std::chrono::microseconds spin) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  for (;;) {
    if (done()) return;
    if (aborted()) throw Aborted();
    const Clock::time_point now = Clock::now();
    if (now >= deadline.at)
      throw TimedOut(device, timeout_message(what(), deadline.seconds, "a peer stopped answering"));
    if (now - start < spin)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace dp
