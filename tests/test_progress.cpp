// The progress line: its layout at every width (progress_line is pure, so no terminal is needed), its
// times and rates, and dp_train drawing it on a pseudo-terminal of 60 columns without wrapping.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/util.h"
#include "train/progress.h"

using namespace dp;
using namespace dp::test;

namespace {

ProgressState mid_epoch() {
  ProgressState s;
  s.epoch = 1, s.epochs = 2, s.done = 29, s.total = 79, s.images = 29 * 32, s.seconds = 4.2, s.mean_loss = 2.2096;
  return s;
}

int count(const std::string& s, char c) { return int(std::count(s.begin(), s.end(), c)); }

}  // namespace

TEST_CASE("progress: the line has every field and never reaches the last column, widths 20 to 200") {
  for (int width = 20; width <= 200; ++width) {
    CAPTURE(width);
    const std::string line = progress_line(mid_epoch(), width);
    CHECK(int(line.size()) <= width - 1);
    CHECK(line.find('\n') == std::string::npos);
    CHECK(line.rfind("epoch 1/2", 0) == 0);
    if (width >= 80) {  // wide enough for the full layout with a bar
      CHECK(line.find(" 36%|") != std::string::npos);
      CHECK(line.find("| 29/79 [00:04<00:07, 221 img/s] mean loss 2.2096") != std::string::npos);
      CHECK(int(line.size()) == width - 1);  // the bar takes up the rest, as tqdm's does
    }
  }
  // Narrower, the bar goes first, then the brackets, the elapsed time, the rate; the loss stays.
  CHECK(progress_line(mid_epoch(), 67) == "epoch 1/2  36% 29/79 [00:04<00:07, 221 img/s] mean loss 2.2096");
  CHECK(progress_line(mid_epoch(), 60) == "epoch 1/2  36% 29/79 00:04<00:07 221 img/s mean loss 2.2096");
  CHECK(progress_line(mid_epoch(), 55) == "epoch 1/2  36% 29/79 <00:07 221 img/s mean loss 2.2096");
  CHECK(progress_line(mid_epoch(), 54) == "epoch 1/2  36% 29/79 <00:07 mean loss 2.2096");
  CHECK(progress_line(mid_epoch(), 20) == "epoch 1/2  36% 29/7");
}

TEST_CASE("progress: the bar fills in proportion to the steps done") {
  ProgressState s = mid_epoch();
  s.total = 100;
  for (int64_t done : {0, 1, 25, 50, 99, 100}) {
    CAPTURE(done);
    s.done = done;
    const std::string line = progress_line(s, 200);
    const size_t open = line.find('|'), close = line.find('|', open + 1);
    REQUIRE(close != std::string::npos);
    const std::string bar = line.substr(open + 1, close - open - 1);
    const int width = int(bar.size());
    CHECK(count(bar, '#') == int(width * done / 100));
    CHECK(count(bar, '#') + count(bar, ' ') == width);
    CHECK(bar.find(" #") == std::string::npos);  // filled from the left
  }
}

TEST_CASE("progress: times are mm:ss, h:mm:ss from an hour, unknown ones are '?'") {
  CHECK(format_duration(0) == "00:00");
  CHECK(format_duration(4.9) == "00:04");
  CHECK(format_duration(59 * 60 + 59.5) == "59:59");
  CHECK(format_duration(3600) == "1:00:00");
  CHECK(format_duration(100 * 3600 + 61) == "100:01:01");
  CHECK(format_duration(-1) == "?");
  CHECK(format_duration(NAN) == "?");
  CHECK(format_duration(INFINITY) == "?");
  // The ETA is the epoch's remaining steps at the rate of the steps timed so far.
  ProgressState s = mid_epoch();
  s.done = 10, s.total = 1000, s.seconds = 40, s.images = 320;
  CHECK(progress_line(s, 200).find("[00:40<1:06:00, 8.00 img/s]") != std::string::npos);
  // Resumed mid-epoch: only the steps since `start` are behind `seconds`.
  s.start = 5;
  CHECK(progress_line(s, 200).find("[00:40<2:12:00, 8.00 img/s]") != std::string::npos);
  s.start = 0, s.images = 3412 * 40;
  CHECK(progress_line(s, 200).find(", 3.41k img/s]") != std::string::npos);
}

TEST_CASE("progress: nothing done, no time, no steps: no division by zero, no nan") {
  ProgressState s;
  s.epoch = 1, s.epochs = 1, s.total = 79;
  for (const ProgressState& t : {s, ProgressState{}}) {
    for (int width : {0, 1, 2, 20, 80}) {
      const std::string line = progress_line(t, width);
      CAPTURE(line);
      CHECK(int(line.size()) <= std::max(width - 1, 0));
      CHECK(line.find("nan") == std::string::npos);
      CHECK(line.find("inf") == std::string::npos);
    }
  }
  CHECK(progress_line(s, 200).find("  0%|  ") != std::string::npos);
  CHECK(progress_line(s, 200).find(" 0/79 [00:00<?, ? img/s] mean loss 0.0000") != std::string::npos);
  ProgressState empty;  // an epoch of no steps
  CHECK(progress_line(empty, 200).find(" 0/0 [00:00<00:00, ? img/s]") != std::string::npos);
}

TEST_CASE("progress: dp_train on a 60-column terminal draws the line within 59 columns") {
  if (run_command("command -v script").exit_code != 0) {
    MESSAGE("skipped: util-linux script(1) is not installed");
    return;
  }
  TempDir dir;
  std::filesystem::create_directory(dir / "data");
  write_synthetic_dataset(dir / "data", 128, 32);
  // stty: script's terminal takes the size of ours when there is one; this test wants 60 regardless.
  const std::string train =
      std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir / "data" + " --batch 32 --epochs 2";
  CommandResult r = run_command("timeout -s KILL 60 script -qec 'stty cols 60 rows 24; COLUMNS=60 " + train +
                                "' /dev/null </dev/null");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  bool drawn = false;
  // Each redraw starts at \r; the epoch lines on stdout are not the progress line and may be wider.
  for (size_t at = 0; at < r.output.size();) {
    size_t end = std::min(r.output.find_first_of("\r\n", at), r.output.size());
    std::string piece = r.output.substr(at, end - at);
    for (size_t k; (k = piece.find("\033[K")) != std::string::npos;) piece.erase(k, 3);
    if (piece.find("mean loss") != std::string::npos) {
      CAPTURE(piece);
      CHECK(piece.size() <= 59);
      drawn = drawn || piece.find("img/s") != std::string::npos;
    }
    at = end + 1;
  }
  CHECK(drawn);
}
