#include "train/progress.h"

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

namespace dp {
namespace {

// The width of the progress line on the terminal now, 0 when none is shown: process-wide so that
// the signal handler and the watchdog can clear it before their own line.
std::atomic<int> g_line_width{0};

}  // namespace

void say_signal_safe(const char* s) noexcept {
  for (size_t n = std::strlen(s); n > 0;) {
    ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w, n -= size_t(w);
  }
}

// Erase to the end of the line from its start: right whatever width the line had or the terminal has.
void clear_line_signal_safe() noexcept {
  if (g_line_width.exchange(0) > 0) say_signal_safe("\r\033[K");
}

namespace {

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

}  // namespace dp
