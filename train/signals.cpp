// SIGINT, SIGTERM and SIGHUP during a run (signals.h): a flag the run reads at its safe points, a
// second signal's exit at once, and the grace deadline's watchdog.
#include "train/signals.h"

#include <semaphore.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "engine/error.h"
#include "train/output_files.h"
#include "train/parse.h"
#include "train/progress.h"

namespace dp {

namespace {

std::atomic<int> g_signal{0};        // the one process-wide flag: the first signal, set by the handler
std::atomic<int64_t> g_first_ns{0};  // when it came, CLOCK_MONOTONIC
sem_t g_wake;                        // posted by the handler (sem_post is async-signal-safe) to start the watchdog

// The same signal again within this long of the first is the same request delivered twice (coreutils'
// timeout signals the child and then its process group; batch schedulers signal every process of a
// job at once), not a person asking a second time.
constexpr int64_t kRepeatNs = 200'000'000;

int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

extern "C" void on_signal(int sig) {
  const int saved_errno = errno;
  const int64_t now = monotonic_ns();
  int none = 0;
  if (g_signal.compare_exchange_strong(none, sig)) {
    g_first_ns = now;
  } else if (const int64_t first = g_first_ns.load();
             none == sig && (first == 0 || now - first < kRepeatNs)) {  // 0: the first is being recorded
    errno = saved_errno;  // the first one's delivery again: already being handled
    return;
  } else {
    // A second signal: leave at once, but never leave a half-written temporary file behind.
    remove_temp_files();
    clear_line_signal_safe();
    say_signal_safe("dp_train: ");
    say_signal_safe(signal_name(sig));
    say_signal_safe(
        " again: exiting at once; nothing more is saved (a file being written is removed, its previous "
        "version kept)\n");
    _exit(128 + sig);
  }
  sem_post(&g_wake);
  errno = saved_errno;
}

}  // namespace

// The watchdog: asleep on g_wake until the first signal, then waits the grace period for the guard's
// destructor (the run stopped on its own); past it, it ends the process.
struct SignalGuard::Watchdog {
  double grace;
  std::atomic<Activity> activity{Activity::setup};
  std::mutex m;
  std::condition_variable cv;
  bool stop = false;                       // guarded by m
  std::string kept = "nothing was saved";  // guarded by m
  std::thread thread;

  void run();
  [[noreturn]] void expire(int sig);
};

void SignalGuard::Watchdog::run() {
  while (sem_wait(&g_wake) != 0 && errno == EINTR) {
  }
  std::unique_lock<std::mutex> lock(m);
  if (cv.wait_for(lock, std::chrono::duration<double>(grace), [&] { return stop; })) return;
  expire(g_signal.load());
}

void SignalGuard::Watchdog::expire(int sig) {
  // The unfinished work is abandoned, never saved: a write in flight loses its temporary file and
  // leaves its target as it was.
  remove_temp_files();
  static const char* const what[] = {"the run's setup did not finish",         "exiting",
                                     "the current step did not finish",        "exiting without saving it",
                                     "the evaluation did not finish",          "exiting without saving the weights",
                                     "the --verify comparison did not finish", "exiting without saving the weights",
                                     "the checkpoint save did not finish",     "exiting, the unfinished file removed",
                                     "writing the report did not finish",      "exiting, the unfinished file removed",
                                     "writing the trace did not finish",       "exiting, the unfinished file removed"};
  const int p = int(activity.load());
  clear_line_signal_safe();
  std::fprintf(stderr, "dp_train: %s within %g s of %s; %s; %s\n", what[2 * p], grace, signal_name(sig),
               what[2 * p + 1], kept.c_str());
  std::fflush(stderr);
  // Again: the run's thread goes on meanwhile and may have just created one. (A file it creates in
  // the instant between this and _exit would stay; closing that would mean waiting on the thread
  // the deadline is there to give up on.)
  remove_temp_files();
  _exit(128 + sig);
}

SignalGuard::SignalGuard(double grace_seconds) : watchdog_(std::make_unique<Watchdog>()) {
  g_signal = 0;
  watchdog_->grace = grace_seconds;
  sem_init(&g_wake, 0, 0);
  // The watchdog blocks the signals, so they land on threads whose work they stop.
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&block, sig);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  watchdog_->thread = std::thread([w = watchdog_.get()] { w->run(); });
  pthread_sigmask(SIG_SETMASK, &old, nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  // SA_RESTART: the handler only sets a flag, so a read or write on any thread (the signal may land
  // on a device worker) resumes instead of failing with EINTR.
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
  sigaction(SIGHUP, &sa, &old_hup_);
}

SignalGuard::~SignalGuard() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGHUP, &old_hup_, nullptr);
  {
    std::lock_guard<std::mutex> lock(watchdog_->m);
    watchdog_->stop = true;
  }
  watchdog_->cv.notify_all();
  sem_post(&g_wake);  // wakes a watchdog that saw no signal
  watchdog_->thread.join();
  sem_destroy(&g_wake);
}

int SignalGuard::pending() const { return g_signal.load(); }

void SignalGuard::doing(Activity a) { watchdog_->activity = a; }

void SignalGuard::kept(const std::string& what) {
  std::lock_guard<std::mutex> lock(watchdog_->m);
  watchdog_->kept = what;
}

int signal_received() { return g_signal.load(); }

std::string describe_signal(int sig) {
  const char* verb = sig == SIGINT ? "interrupted" : sig == SIGHUP ? "hung up" : "terminated";
  return std::string(verb) + " (" + signal_name(sig) + ")";
}

double grace_seconds() {
  const char* v = std::getenv("DP_GRACE_SECONDS");
  if (!v) return 10;
  char* end = nullptr;
  double s = std::strtod(v, &end);
  // Decimal alone, as the flags' numbers (parse_float): no hexadecimal, no space either side.
  if (end == v || *end != '\0' || !decimal_characters(v) || !std::isfinite(s) || s <= 0 || s > 86400)
    throw UsageError(std::string("DP_GRACE_SECONDS=") + v +
                     ": give the grace period after a signal in seconds, more than 0 and at most 86400 "
                     "(default 10)");
  return s;
}

}  // namespace dp
