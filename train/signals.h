// How dp_train stops: SIGINT, SIGTERM and SIGHUP turned into a flag the loop reads between steps, with a
// grace deadline after which the process leaves anyway.
#pragma once

#include <csignal>
#include <memory>
#include <string>

namespace dp {

// What the run is doing, for the line the grace deadline prints (a step's own parts are its phases,
// engine/config.h).
enum class Activity { setup, step, evaluation, verify, save, report, trace };

// While alive, SIGINT, SIGTERM and SIGHUP only set a flag that the run reads at its safe points
// (between steps, between its outputs). A second one (but the same signal again within 0.2 s of the
// first: one request delivered twice, as coreutils' timeout and batch schedulers do) exits at once
// with 128 + signal, removing any
// temporary file in flight (remove_temp_files). After the first, a watchdog thread gives the run
// `grace_seconds` to stop on its own; past that it prints what is lost and kept, removes the
// temporary file in flight and _exits with 128 + signal, so a step hung in a library cannot outlast
// `timeout`. The previous handlers come back on destruction. One at a time: the flag is process-wide.
class SignalGuard {
 public:
  explicit SignalGuard(double grace_seconds);
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;
  int pending() const;  // the signal received, 0 for none
  void doing(Activity a);
  // What a forced exit leaves, for the deadline's line: "the last good checkpoint (step 40) in ck is kept".
  void kept(const std::string& what);

 private:
  struct Watchdog;
  std::unique_ptr<Watchdog> watchdog_;
  struct sigaction old_int_ {
  }, old_term_{}, old_hup_{};
};

// The first signal a SignalGuard caught in this process, 0 for none; it stays set after the guard is
// gone, for a front end to see one that landed as the run was returning.
int signal_received();

// "interrupted (SIGINT)", "terminated (SIGTERM)", "hung up (SIGHUP)".
std::string describe_signal(int sig);

// The grace period from DP_GRACE_SECONDS (default 10): a number of seconds in (0, 86400]; anything
// else is a UsageError naming the variable.
double grace_seconds();

}  // namespace dp
