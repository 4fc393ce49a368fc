// The IDX reader on good and malformed synthetic files, and the per-epoch order.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <set>
#include <thread>

#include "engine/error.h"
#include "tests/util.h"
#include "train/data.h"

using namespace dp;
using namespace dp::test;

namespace {

// Expects load_idx_files to throw a UsageError whose message names `file` and contains `words`.
void expect_error(const std::string& images, const std::string& labels, const std::string& file,
                  const std::string& words) {
  try {
    load_idx_files(images, labels);
    FAIL("no error for " << file);
  } catch (const UsageError& e) {
    std::string w = e.what();
    INFO(w);
    CHECK(w.find(file) != std::string::npos);
    CHECK(w.find(words) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("IDX: gzip'd and raw files read the same, pixels scaled to [0, 1]") {
  TempDir dir;
  std::vector<uint8_t> px = {0, 255, 51, 102, 0, 0, 0, 0, 10, 20, 30, 40};
  for (bool gz : {false, true}) {
    std::string ext = gz ? ".gz" : "";
    write_file(dir / ("i" + ext), idx_images(px, 3, 2, 2), gz);
    write_file(dir / ("l" + ext), idx_labels({3, 0, 9}), gz);
    Dataset d = load_idx_files(dir / ("i" + ext), dir / ("l" + ext));
    CHECK(d.count == 3);
    CHECK(d.rows == 2);
    CHECK(d.cols == 2);
    CHECK(d.images[1] == 1.0f);
    CHECK(d.images[2] == doctest::Approx(0.2f));
    CHECK(d.labels == std::vector<int32_t>{3, 0, 9});
    Dataset lim = load_idx_files(dir / ("i" + ext), dir / ("l" + ext), 2);
    CHECK(lim.count == 2);
    CHECK(lim.images.size() == 8);
  }
}

TEST_CASE("IDX: malformed files give errors naming the file") {
  TempDir dir;
  std::vector<uint8_t> px(2 * 4, 7);
  write_file(dir / "good-i", idx_images(px, 2, 2, 2), false);
  write_file(dir / "good-l", idx_labels({1, 2}), false);

  expect_error(dir / "missing", dir / "good-l", "missing", "no such file");
  std::string bad_magic = idx_images(px, 2, 2, 2);
  bad_magic[3] = 0x01;
  write_file(dir / "magic", bad_magic, false);
  expect_error(dir / "magic", dir / "good-l", "magic", "magic");
  expect_error(dir / "good-l", dir / "good-l", "good-l", "too short");  // a labels file given as images
  write_file(dir / "zero", idx_images({}, 2, 0, 2), false);
  expect_error(dir / "zero", dir / "good-l", "zero", "impossible");
  write_file(dir / "trunc", idx_images({1, 2, 3}, 2, 2, 2), false);
  expect_error(dir / "trunc", dir / "good-l", "trunc", "truncated");
  std::string gz = idx_images(px, 2, 2, 2);
  write_file(dir / "trunc.gz", gz, true);
  std::string zipped;
  {
    std::ifstream f(dir / "trunc.gz", std::ios::binary);
    zipped.assign(std::istreambuf_iterator<char>(f), {});
  }
  write_file(dir / "cut.gz", zipped.substr(0, zipped.size() - 6), false);
  expect_error(dir / "cut.gz", dir / "good-l", "cut.gz", "");
  write_file(dir / "short", "\x00\x00", false);
  expect_error(dir / "short", dir / "good-l", "short", "too short");
  write_file(dir / "range-l", idx_labels({1, 10}), false);
  expect_error(dir / "good-i", dir / "range-l", "range-l", "out of range");
  write_file(dir / "count-l", idx_labels({1, 2, 3}), false);
  expect_error(dir / "good-i", dir / "count-l", "count-l", "must match");
  std::string lab = idx_labels({1, 2});
  write_file(dir / "lab-trunc", lab.substr(0, lab.size() - 1), false);
  expect_error(dir / "good-i", dir / "lab-trunc", "lab-trunc", "declares");
  expect_error(dir.path.string(), dir / "good-l", dir.path.string(), "directory");
}

TEST_CASE("IDX: a data directory without the expected files is named in the error") {
  TempDir dir;
  try {
    load_idx(dir.path.string(), "train");
    FAIL("no error");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("train-images-idx3-ubyte") != std::string::npos);
  }
  CHECK_THROWS_AS(load_idx(dir / "nope", "train"), UsageError);
}

TEST_CASE("IDX: a data file that is a FIFO is refused at once, not read until a writer comes") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 8, 8);
  const std::string images = dir / "train-images-idx3-ubyte.gz";
  std::filesystem::remove(images);
  REQUIRE(::mkfifo(images.c_str(), 0644) == 0);
  // A reader that opened the FIFO would wait there for a writer: after 5 s this one comes and goes at
  // once, so that such a reader fails (on an empty file) instead of hanging the suite.
  std::promise<void> returned;
  std::thread writer([&, done = returned.get_future()] {
    if (done.wait_for(std::chrono::seconds(5)) == std::future_status::ready) return;
    if (int fd = ::open(images.c_str(), O_WRONLY | O_NONBLOCK); fd >= 0) ::close(fd);
  });
  std::string error;
  try {
    load_idx(dir.path.string(), "train");
  } catch (const UsageError& e) {
    error = e.what();
  }
  returned.set_value();
  writer.join();
  CHECK(error == images + ": is not a regular file (a FIFO, socket or device); expected an IDX file");
}

TEST_CASE("epoch order: a permutation fixed by (seed, epoch), file order without shuffle") {
  auto a = epoch_order(1000, 5, 0, true), b = epoch_order(1000, 5, 0, true), c = epoch_order(1000, 5, 1, true);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(std::set<int64_t>(a.begin(), a.end()).size() == 1000);
  CHECK(*std::max_element(a.begin(), a.end()) == 999);
  auto plain = epoch_order(5, 5, 3, false);
  CHECK(plain == std::vector<int64_t>{0, 1, 2, 3, 4});
  // pinned: the order must not change across platforms or releases (resume relies on it)
  auto small = epoch_order(6, 0, 0, true);
  std::vector<int64_t> seen = small;
  std::sort(seen.begin(), seen.end());
  CHECK(seen == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("IDX from memory: the same checks as the file reader") {
  std::string img = idx_images({0, 255, 51, 102}, 1, 2, 2), lab = idx_labels({4});
  auto u = [](const std::string& s) { return reinterpret_cast<const unsigned char*>(s.data()); };
  Dataset d = parse_idx(u(img), img.size(), "img", u(lab), lab.size(), "lab");
  CHECK(d.count == 1);
  CHECK(d.images[1] == 1.0f);
  CHECK(d.labels == std::vector<int32_t>{4});
  // zero images is a valid, empty file
  std::string img0 = idx_images({}, 0, 28, 28), lab0 = idx_labels({});
  CHECK(parse_idx(u(img0), img0.size(), "img", u(lab0), lab0.size(), "lab").count == 0);
  // a header promising 2^32-1 images of 4096x4096 is refused without allocating them
  std::string huge = idx_images({}, 0xFFFFFFFFu, 4096, 4096);
  CHECK_THROWS_WITH_AS(parse_idx(u(huge), huge.size(), "img", u(lab), lab.size(), "lab"),
                       doctest::Contains("truncated"), UsageError);
  CHECK_THROWS_WITH_AS(parse_idx(nullptr, 0, "img", u(lab), lab.size(), "lab"), doctest::Contains("too short"),
                       UsageError);
  CHECK_THROWS_WITH_AS(parse_idx(u(img), img.size(), "img", nullptr, 0, "lab"), doctest::Contains("lab"), UsageError);
}

// Every seed and every crash input the fuzzer found (tests/fuzz/corpus/idx/crash-*), as an images
// file and as a labels file: a Dataset or a UsageError, nothing else.
TEST_CASE("the IDX fuzz corpus: each file reads or is refused cleanly") {
  TempDir dir;
  write_file(dir / "img", idx_images({1, 2, 3}, 3, 1, 1), false);
  write_file(dir / "lab", idx_labels({1, 2, 3}), false);
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(std::string(DP_SOURCE_DIR) + "/tests/fuzz/corpus/idx")) {
    CAPTURE(e.path().string());
    ++files;
    for (auto [images, labels] :
         {std::pair{e.path().string(), dir / "lab"}, std::pair{dir / "img", e.path().string()}}) {
      try {
        Dataset d = load_idx_files(images, labels);
        CHECK(d.images.size() == size_t(d.count * d.image_size()));
      } catch (const UsageError& err) {
        CHECK(std::string(err.what()).find(e.path().string()) != std::string::npos);
      }
    }
  }
  CHECK(files >= 10);
}
