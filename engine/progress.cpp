#include "engine/progress.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>

namespace dp {

Progress::Progress(bool enabled) : tty_(enabled && isatty(fileno(stderr))) {}

void Progress::update(int epoch, int epochs, int64_t done, int64_t total, double loss) {
  if (!tty_) return;
  const int width = 30;
  int filled = total > 0 ? int(width * done / total) : width;
  std::fprintf(stderr, "\repoch %d/%d [%s%s] %lld/%lld loss %.4f", epoch, epochs, std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), (long long)done, (long long)total, loss);
  std::fflush(stderr);
}

void Progress::clear() {
  if (tty_) std::fprintf(stderr, "\r%80s\r", "");
}

namespace {

std::atomic<int> g_signal{0};  // the one process-wide flag: set by the handler, read between steps

extern "C" void on_signal(int sig) {
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // a second signal: leave at once
}

}  // namespace

SignalGuard::SignalGuard() {
  g_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  // SA_RESTART: the handler only sets a flag, so a read or write on any thread (the signal may land
  // on a device worker) resumes instead of failing with EINTR.
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

SignalGuard::~SignalGuard() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

int SignalGuard::pending() const { return g_signal.load(); }

}  // namespace dp
