// What dp_train shows while it trains: the progress line on a terminal, tqdm's layout.
#pragma once

#include <chrono>
#include <csignal>
#include <cstdint>
#include <memory>
#include <string>

namespace dp {

// Where an epoch stands, for its progress line.
struct ProgressState {
  int epoch = 0, epochs = 0;    // 1-based epoch of `epochs`
  int64_t done = 0, total = 0;  // steps of this epoch finished, steps in it
  int64_t start = 0;            // steps already done when timing began (a run resumed mid-epoch)
  int64_t images = 0;           // images trained since timing began
  double seconds = 0;           // since timing began
  double mean_loss = 0;         // the mean training loss over those images
};

// The line, tqdm's layout: "epoch 1/2  37%|#####     | 29/79 [00:04<00:07, 3.41k img/s] mean loss 2.2096",
// at most width - 1 columns so that it never wraps: the bar shrinks first, then goes; narrower still,
// the brackets, the elapsed time ("<00:07" is the ETA alone), then the rate go; at last the line is cut. Unknown times
// and rates show as "?".
std::string progress_line(const ProgressState& s, int width);

// "mm:ss", "h:mm:ss" from an hour; "?" for a negative or non-finite time.
std::string format_duration(double seconds);

// The columns of the terminal on stderr (TIOCGWINSZ), else $COLUMNS, else 80.
int terminal_width();

// One line on stderr, rewritten in place after a step at most 10 times a second (and always at an
// epoch's last step); nothing when stderr is not a terminal. Cleared on destruction, so an error
// that unwinds the run is printed on a line of its own.
class Progress {
 public:
  explicit Progress(bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  // Before an epoch's first step: `start` steps of its `total` are already done (resumed mid-epoch).
  void begin_epoch(int epoch, int epochs, int64_t total, int64_t start);
  // After a step: `done` steps of the epoch finished, `images` in this one, the epoch's mean loss so far.
  void update(int64_t done, int64_t images, double mean_loss);
  void clear();  // before anything else is printed

 private:
  bool tty_;
  ProgressState state_;
  std::chrono::steady_clock::time_point t0_, last_draw_;
  bool drawn_ = false;  // this epoch
};

// For the signal handler and the watchdog (signals.cpp): a string to stderr, and the progress line
// cleared before it, with write(2) alone (async-signal-safe).
void say_signal_safe(const char* s) noexcept;
void clear_line_signal_safe() noexcept;

}  // namespace dp
