#include "train/progress.h"

#include <pthread.h>
#include <semaphore.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
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
#include <vector>

#include "engine/error.h"
#include "train/paths.h"

namespace dp {
namespace {

// The width of the progress line on the terminal now, 0 when none is shown: process-wide so that
// the signal handler and the watchdog can clear it before their own line.
std::atomic<int> g_line_width{0};

// write(2) of a whole string: async-signal-safe, for the handler and the watchdog's last words.
void say(const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w, n -= size_t(w);
  }
}

// Erase to the end of the line from its start: right whatever width the line had or the terminal has.
void clear_line_signal_safe() {
  if (g_line_width.exchange(0) > 0) say("\r\033[K");
}

// A rate with tqdm's unit scaling: "0.52", "12.5", "912", "3.41k", "1.20M"; "?" when unknown.
std::string format_rate(double r) {
  if (!std::isfinite(r) || r < 0) return "?";
  const char* unit = "";
  for (const char* u : {"k", "M", "G"}) {
    if (r < 999.5) break;
    r /= 1000, unit = u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, r >= 99.95 ? "%.0f%s" : r >= 9.995 ? "%.1f%s" : "%.2f%s", r, unit);
  return buf;
}

std::string bar(int64_t done, int64_t total, int width) {
  const int filled = total > 0 ? int(int64_t(width) * done / total) : 0;
  std::string b(size_t(width) + 2, ' ');
  b.front() = b.back() = '|';
  std::fill_n(b.begin() + 1, filled, '#');
  return b;
}

}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds >= 1e9) return "?";
  const int64_t t = int64_t(seconds);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02d:%02d", (long long)(t / 3600), int(t / 60 % 60), int(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%02d:%02d", int(t / 60), int(t % 60));
  return buf;
}

std::string progress_line(const ProgressState& s, int width) {
  const int64_t done = std::clamp<int64_t>(s.done, 0, std::max<int64_t>(s.total, 0));
  const int64_t timed = done - s.start;  // steps behind `seconds`
  const bool known = timed > 0 && s.seconds > 0 && std::isfinite(s.seconds);
  const std::string elapsed = format_duration(s.seconds);
  const std::string eta = done >= s.total ? "00:00"
                          : known         ? format_duration(double(s.total - done) * s.seconds / double(timed))
                                          : "?";
  const std::string rate = (known ? format_rate(double(s.images) / s.seconds) : "?") + " img/s";
  char pct[64], loss[48];
  std::snprintf(pct, sizeof pct, "epoch %d/%d %3d%%", s.epoch, s.epochs, s.total > 0 ? int(100 * done / s.total) : 0);
  std::snprintf(loss, sizeof loss, " mean loss %.4f", s.mean_loss);
  const std::string head = pct, counts = ' ' + std::to_string(done) + '/' + std::to_string(s.total);
  // Narrower and narrower tails; the widest gets a bar if at least 3 columns are left for it.
  const std::string tails[] = {counts + " [" + elapsed + "<" + eta + ", " + rate + "]" + loss,
                               counts + " " + elapsed + "<" + eta + " " + rate + loss,
                               counts + " <" + eta + " " + rate + loss, counts + " <" + eta + loss};
  const int room = std::max(width, 1) - 1;
  const int left = room - int(head.size() + tails[0].size());
  if (left >= 3 + 2) return head + bar(done, s.total, left - 2) + tails[0];
  for (const std::string& tail : tails)
    if (head.size() + tail.size() <= size_t(room)) return head + tail;
  return (head + tails[3]).substr(0, size_t(room));
}

int terminal_width() {
  struct winsize ws {};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    char* end = nullptr;
    long n = std::strtol(c, &end, 10);
    if (end != c && *end == '\0' && n > 0 && n < 100000) return int(n);
  }
  return 80;
}

Progress::Progress(bool enabled) : tty_(enabled && isatty(fileno(stderr))) {}

Progress::~Progress() { clear(); }

void Progress::begin_epoch(int epoch, int epochs, int64_t total, int64_t start) {
  state_ = ProgressState{epoch, epochs, start, total, start, 0, 0, 0};
  t0_ = std::chrono::steady_clock::now();
  drawn_ = false;
}

void Progress::update(int64_t done, int64_t images, double mean_loss) {
  if (!tty_) return;
  state_.done = done, state_.images += images, state_.mean_loss = mean_loss;
  const auto now = std::chrono::steady_clock::now();
  // tqdm's mininterval: a redraw costs a write to the terminal, at most 10 a second.
  if (drawn_ && done < state_.total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  state_.seconds = std::chrono::duration<double>(now - t0_).count();
  const std::string line = progress_line(state_, terminal_width());
  std::fprintf(stderr, "\r%s\033[K", line.c_str());
  std::fflush(stderr);
  g_line_width = int(line.size());
  drawn_ = true, last_draw_ = now;
}

void Progress::clear() {
  if (!tty_) return;
  if (g_line_width.exchange(0) > 0) std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

namespace {

std::atomic<int> g_signal{0};  // the one process-wide flag: the first signal, set by the handler
sem_t g_wake;                  // posted by the handler (sem_post is async-signal-safe) to start the watchdog

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
  int none = 0;
  if (!g_signal.compare_exchange_strong(none, sig)) {
    // A second signal: leave at once, but never leave a half-written temporary file behind.
    remove_temp_files();
    clear_line_signal_safe();
    say("dp_train: ");
    say(signal_name(sig));
    say(" again: exiting at once; nothing more is saved (a file being written is removed, its previous "
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
  std::atomic<Stage> stage{Stage::setup};
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
  const int p = int(stage.load());
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

void SignalGuard::stage(Stage s) { watchdog_->stage = s; }

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
  if (end == v || *end != '\0' || !std::isfinite(s) || s <= 0 || s > 86400)
    throw UsageError(std::string("DP_GRACE_SECONDS=") + v +
                     ": give the grace period after a signal in seconds, more than 0 and at most 86400 "
                     "(default 10)");
  return s;
}

}  // namespace dp
