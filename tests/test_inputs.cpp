// Issue 17's inputs and overflow families: a test set held to the training set's checks, data files
// read header first and streamed (no decompression bomb, no /dev/zero), numbers that parse without
// wrapping, 64-bit step arithmetic, and --verify's bound from the batch actually trained.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "tests/util.h"
#include "train/data.h"
#include "train/options.h"
#include "train/verify.h"

using namespace dp;
using namespace dp::test;

namespace {

// On the simulated CPU devices, so --devices N means N devices on any machine, one with a GPU too.

// A learnable training set of `train` images and a test set of `test` images of rows x cols.
void write_dataset(const TempDir& dir, int train, int test, uint32_t rows, uint32_t cols) {
  write_synthetic_dataset(dir.path.string(), train, test);
  std::vector<uint8_t> px(size_t(test) * rows * cols, 100), lab(size_t(test), 3);
  write_file(dir / "t10k-images-idx3-ubyte.gz", idx_images(px, uint32_t(test), rows, cols), true);
  write_file(dir / "t10k-labels-idx1-ubyte.gz", idx_labels(lab), true);
}

// One gzip member holding `bytes`.
std::string gz_member(const std::string& bytes) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&z, uLong(bytes.size())), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = uInt(bytes.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = uInt(out.size());
  REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// dp_train under a 2 GiB memory cap and a 60 s clock: a reader that inflated a bomb whole would die
// of either, not exit 2. The sanitizers reserve terabytes of shadow memory, so there the cap is
// their own resident-memory limit instead of ulimit -v (the binary is built the same way as this one).
CommandResult run_capped(const std::string& args) {
  const std::string cap = kSanitized ? "ASAN_OPTIONS=$ASAN_OPTIONS:hard_rss_limit_mb=2048 "
                                       "TSAN_OPTIONS=$TSAN_OPTIONS:hard_rss_limit_mb=2048 "
                                     : "ulimit -v 2097152; ";
  return run_command(cap + "timeout 60 " + kTrainCpu + " " + args);
}

}  // namespace

TEST_CASE("inputs: a test set of another image size is refused up front, naming the file and both sizes") {
  for (uint32_t side : {1u, 14u, 56u}) {
    CAPTURE(side);
    TempDir dir;
    write_dataset(dir, 64, side == 1 ? 200 : 8, side, side);
    CommandResult r = run_command(kTrainCpu + " --data " + dir.path.string() + " --steps 2 --batch 32 --quiet");
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("t10k-images-idx3-ubyte.gz") != std::string::npos);
    CHECK(r.output.find(std::to_string(side) + "x" + std::to_string(side)) != std::string::npos);
    CHECK(r.output.find("lenet takes 28x28") != std::string::npos);
  }
}

TEST_CASE("inputs: the test set's labels are held to the model's classes") {
  TempDir dir;
  write_dataset(dir, 64, 4, 28, 28);
  write_file(dir / "t10k-labels-idx1-ubyte.gz", idx_labels({1, 2, 10, 3}), true);
  CommandResult r = run_command(kTrainCpu + " --data " + dir.path.string() + " --steps 1 --batch 32 --quiet");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("t10k-labels-idx1-ubyte.gz") != std::string::npos);
  CHECK(r.output.find("out of range") != std::string::npos);
}

TEST_CASE("inputs: the image size is checked at the header, before the body is read") {
  TempDir dir;
  // 2^31 images of 1x1 with no body: the size is wrong before the missing body is.
  write_file(dir / "i.gz", idx_images({}, 1u << 31, 1, 1), true);
  write_file(dir / "l", idx_labels({1}), false);
  ImageShape lenet{28, 28, "lenet"};
  CHECK_THROWS_WITH_AS(load_idx_files(dir / "i.gz", dir / "l", 0, 10, lenet),
                       doctest::Contains("1x1, lenet takes 28x28"), UsageError);
  // any size where no shape is given
  write_file(dir / "i1", idx_images({7}, 1, 1, 1), false);
  CHECK(load_idx_files(dir / "i1", dir / "l").rows == 1);
  CHECK_THROWS_WITH_AS(load_idx_files(dir / "i1", dir / "l", 0, 10, lenet), doctest::Contains("i1"), UsageError);
}

TEST_CASE("inputs: a header declaring more than 16 GiB of pixels is refused before any body is read") {
  TempDir dir;
  write_file(dir / "i.gz", idx_images({}, 0xFFFFFFFFu, 28, 28), true);
  write_file(dir / "l.gz", idx_labels({}), true);
  CHECK_THROWS_WITH_AS(load_idx_files(dir / "i.gz", dir / "l.gz"), doctest::Contains("16 GiB"), UsageError);
}

TEST_CASE("inputs: bytes past the declared size are still refused, gzip'd or raw") {
  TempDir dir;
  for (bool gz : {false, true}) {
    std::string ext = gz ? ".gz" : "";
    write_file(dir / ("i" + ext), idx_images({1, 2}, 2, 1, 1), gz);
    write_file(dir / ("l" + ext), idx_labels({1, 2}), gz);
    write_file(dir / ("i-long" + ext), idx_images({1, 2, 3}, 2, 1, 1), gz);
    write_file(dir / ("l-long" + ext), idx_labels({1, 2}) + "x", gz);
    CHECK(load_idx_files(dir / ("i" + ext), dir / ("l" + ext)).count == 2);
    CHECK_THROWS_WITH_AS(load_idx_files(dir / ("i-long" + ext), dir / ("l" + ext)),
                         doctest::Contains("past the 2 images"), UsageError);
    CHECK_THROWS_WITH_AS(load_idx_files(dir / ("i" + ext), dir / ("l-long" + ext)), doctest::Contains("more bytes"),
                         UsageError);
    // --limit-train keeps the first N but the whole file is still checked
    CHECK_THROWS_AS(load_idx_files(dir / ("i-long" + ext), dir / ("l" + ext), 1), UsageError);
    CHECK(load_idx_files(dir / ("i" + ext), dir / ("l" + ext), 1).images.size() == 1);
  }
}

TEST_CASE("inputs: a labels file linked to /dev/zero is refused before it is read, at once") {
  if (!std::filesystem::exists("/dev/zero")) return;
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8, false);
  std::filesystem::remove(dir / "train-labels-idx1-ubyte");
  std::filesystem::create_symlink("/dev/zero", dir / "train-labels-idx1-ubyte");
  auto t0 = std::chrono::steady_clock::now();
  CommandResult r = run_capped("--data " + dir.path.string() + " --steps 1 --quiet");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("train-labels-idx1-ubyte") != std::string::npos);
  CHECK(r.output.find("is not a regular file") != std::string::npos);
  CHECK(seconds_since(t0) < 20);
}

TEST_CASE("inputs: a labels .gz that inflates to 3 GiB fails after its declared size, in bounded memory") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  // A valid header and its 64 labels, then 3 GiB of zeros as 48 gzip members of 64 MiB (about 3 MB on
  // disk); zlib reads concatenated members as one stream.
  std::string bomb = gz_member(idx_labels(std::vector<uint8_t>(64, 1)));
  const std::string zeros = gz_member(std::string(size_t(64) << 20, '\0'));
  for (int i = 0; i < 48; ++i) bomb += zeros;
  std::filesystem::remove(dir / "train-labels-idx1-ubyte.gz");
  write_file(dir / "train-labels-idx1-ubyte.gz", bomb, false);
  auto t0 = std::chrono::steady_clock::now();
  CommandResult r = run_capped("--data " + dir.path.string() + " --steps 1 --quiet");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("train-labels-idx1-ubyte.gz") != std::string::npos);
  CHECK(r.output.find("more bytes") != std::string::npos);
  CHECK(seconds_since(t0) < 20);
  // a count that does not match the images fails at the header, whatever follows it
  std::string liar = gz_member(idx_labels(std::vector<uint8_t>(65, 1)));
  for (int i = 0; i < 48; ++i) liar += zeros;
  write_file(dir / "train-labels-idx1-ubyte.gz", liar, false);
  r = run_capped("--data " + dir.path.string() + " --steps 1 --quiet");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("must match") != std::string::npos);
}

TEST_CASE("overflow: step counts whose epochs do not fit are refused, not wrapped") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --quiet --save " + dir / "ck.st";
  for (std::string args :
       {"--steps 4294967296 --batch 2048", "--steps 9223372036854775807", "--steps 9223372036854775807 --batch 1"}) {
    CAPTURE(args);
    CommandResult r = run_command(base + " " + args);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--steps") != std::string::npos);
    CHECK(r.output.find("epochs") != std::string::npos);
    CHECK(!std::filesystem::exists(dir / "ck.st"));
  }
  // 64-bit counts past int64 are refused, not saturated to 2^63-1
  for (std::string flag : {"--steps", "--limit-train", "--limit-test", "--save-every", "--bucket-kb"}) {
    CAPTURE(flag);
    CommandResult r = run_command(base + " " + flag + " 9223372036854775808");
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(flag) != std::string::npos);
    CHECK(r.output.find("out of range") != std::string::npos);
  }
}

TEST_CASE("overflow: integer flags read as decimal, exactly") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --quiet";
  // strtoll in base 0 read "010" as 8 and "0x10" as 16
  CommandResult r = run_command(base + " --steps 010 --batch 8 --report " + dir / "r.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::ifstream f(dir / "r.json");
  CHECK(nlohmann::json::parse(f)["config"]["steps"].get<int64_t>() == 10);
  for (std::string args : {"--batch 0x10", "--batch 2147483648", "--epochs 1e3", "--devices 1.5"}) {
    CAPTURE(args);
    r = run_command(base + " " + args);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(args.substr(0, args.find(' '))) != std::string::npos);
  }
}

TEST_CASE("overflow: --verify's tolerance comes from the batch trained, not --batch") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  CommandResult r =
      run_command(kTrainCpu + " --data " + dir.path.string() +
                  " --steps 2 --batch 2147483647 --devices 2 --verify --quiet --report " + dir / "r.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::ifstream f(dir / "r.json");
  nlohmann::json rep = nlohmann::json::parse(f);
  // The summation bound and each step's rounding of the update, an ulp of the largest weight (a few %).
  CHECK(rep["verify"]["tolerance"].get<double>() > summation_tolerance(2, 64, 0.1f, 0.9f));
  CHECK(rep["verify"]["tolerance"].get<double>() ==
        doctest::Approx(summation_tolerance(2, 64, 0.1f, 0.9f)).epsilon(0.1));
  CHECK(rep["verify"]["tolerance"].get<double>() < 1e-3);
}

TEST_CASE("overflow: summation_tolerance is linear in the steps") {
  // the closed form of sum_k sum_{j<=k} mu^j for mu = 0.5 over 3 steps: 1 + 1.5 + 1.75
  const double u = std::ldexp(1.0, -24);
  CHECK(summation_tolerance(3, 4, 1.0f, 0.5f) == doctest::Approx(2.0 * (2.0 * 4 * u) * 4.25));
  // 2^26 steps: (S - mu (1 - mu^S) / (1 - mu)) / (1 - mu) in closed form, mu^S = 0. A double loop over
  // the steps (2^51 terms) would not return, and ctest's timeout would fail the case; no wall-clock
  // bound here, which a loaded machine under a sanitizer broke (7 s against 5).
  const double steps = std::ldexp(1.0, 26), mu = double(0.9f), lr = double(0.1f);
  const double carried = (steps - mu / (1 - mu)) / (1 - mu);
  CHECK(summation_tolerance(int64_t(1) << 26, 64, 0.1f, 0.9f) ==
        doctest::Approx(2.0 * (2.0 * 64 * u) * lr * carried).epsilon(1e-6));
}

TEST_CASE("overflow: seeds parse exactly 0..2^64-1 and nothing else") {
  CHECK(parse_seed("0", "--seed") == 0);
  CHECK(parse_seed("42", "--seed") == 42);
  CHECK(parse_seed("18446744073709551615", "--seed") == UINT64_MAX);
  for (std::string bad : {"-1", "-5", "18446744073709551616", "1e23", "1.5", "", " 1", "+1", "0x10", "12a"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(parse_seed(bad, "--seed"), doctest::Contains("--seed"), UsageError);
  }
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --steps 1 --batch 32 --quiet";
  for (std::string bad : {"-1", "-5", "18446744073709551616", "1e23"}) {
    CAPTURE(bad);
    CommandResult r = run_command(base + " --seed " + bad);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--seed") != std::string::npos);
    CHECK(r.output.find("18446744073709551615") != std::string::npos);
  }
  CommandResult r = run_command(base + " --seed 18446744073709551615 --report " + dir / "r.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::ifstream f(dir / "r.json");
  CHECK(nlohmann::json::parse(f)["config"]["seed"].get<uint64_t>() == UINT64_MAX);
}

TEST_CASE("overflow: a float flag that float cannot hold is named as such, not as zero or infinity") {
  CHECK(parse_float("0.1", "--lr") == 0.1f);
  CHECK(parse_float("1e-40", "--lr") > 0);  // subnormal, still positive
  CHECK(parse_float("0", "--lr") == 0);     // the range checks after parsing refuse it
  CHECK_THROWS_WITH_AS(parse_float("1e-46", "--lr"), doctest::Contains("round to 0"), UsageError);
  CHECK_THROWS_WITH_AS(parse_float("1e-5000", "--lr"), doctest::Contains("round to 0"), UsageError);
  CHECK_THROWS_WITH_AS(parse_float("1e39", "--lr"), doctest::Contains("too large"), UsageError);
  CHECK_THROWS_WITH_AS(parse_float("abc", "--lr"), doctest::Contains("not a number"), UsageError);
  CHECK_THROWS_WITH_AS(parse_float("0.1x", "--weight-decay"), doctest::Contains("--weight-decay"), UsageError);
  // One number syntax, decimal: strtold's hexadecimal floats, inf and nan are refused by name.
  for (const char* other : {"0x1p-3", "inf", "nan", "-infinity"})
    CHECK_THROWS_WITH_AS(parse_float(other, "--lr"), doctest::Contains("is not a decimal number"), UsageError);
  CHECK(parse_float("1.25e-1", "--lr") == 0.125f);
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  CommandResult r = run_command(kTrainCpu + " --data " + dir.path.string() + " --steps 1 --quiet --lr 1e-46");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--lr") != std::string::npos);
  CHECK(r.output.find("round to 0") != std::string::npos);
}
