// What dp_train shows while it trains and how it stops: the progress line on a terminal, and
// SIGINT / SIGTERM turned into a flag the loop reads between steps.
#pragma once

#include <csignal>
#include <cstdint>

namespace dp {

// One line on stderr, rewritten in place after every step; nothing when stderr is not a terminal.
class Progress {
 public:
  explicit Progress(bool enabled);
  void update(int epoch, int epochs, int64_t done, int64_t total, double loss);
  void clear();  // before anything else is printed

 private:
  bool tty_;
};

// While alive, SIGINT and SIGTERM only set a flag (a second one exits at once with 128 + signal);
// the previous handlers come back on destruction. One at a time: the flag is process-wide.
class SignalGuard {
 public:
  SignalGuard();
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;
  int pending() const;  // the signal received, 0 for none

 private:
  struct sigaction old_int_ {
  }, old_term_{};
};

}  // namespace dp
