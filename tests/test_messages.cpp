// The size flags (--device-memory, dp_bench comm's --min-bytes/--max-bytes) through their one
// parser: what it accepts, and a message naming the flag and the accepted forms for all else,
// exit 2 from both front ends.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "engine/error.h"
#include "tests/util.h"
#include "train/options.h"

using namespace dp;
using namespace dp::test;

TEST_CASE("inputs: a size is a positive number of bytes after its suffix K, M, G or T") {
  CHECK(parse_bytes("4096", "--x") == 4096);
  CHECK(parse_bytes("1.5K", "--x") == 1536);
  CHECK(parse_bytes("2g", "--x") == int64_t(2) << 30);
  CHECK(parse_bytes("1T", "--x") == int64_t(1) << 40);
  CHECK(parse_bytes("3TiB", "--x") == int64_t(3) << 40);
  CHECK(parse_bytes("512MiB", "--x") == int64_t(512) << 20);
  CHECK(parse_bytes("4kb", "--x") == 4096);
  CHECK(parse_bytes("100B", "--x") == 100);
  CHECK(parse_bytes("0.5K", "--x") == 512);
  CHECK(parse_bytes("1.3", "--x") == 1);  // a fraction of a byte is dropped
  CHECK(parse_bytes("9223372036854775807", "--x") == INT64_MAX);
  CHECK(parse_bytes("64K", "--device-memory", kMinDeviceMemory) == kMinDeviceMemory);

  struct Case {
    std::string text, words;
  };
  const Case refused[] = {
      {"0.5", "is 0 bytes (rounded down to whole bytes)"},  // meant "no cap" before
      {"0", "is 0 bytes"},
      {"0.5K", "is 512 bytes"},  // under the 64 KiB minimum
      {"-1", "is negative"},
      {"-0.5G", "is negative"},
      {"9223372036854775808", "too large"},
      {"8388608T", "too large"},  // 2^63 bytes
      {"99999999999999999999999T", "too large"},
      {"", "is not a size"},
      {"lots", "is not a size"},
      {"M", "is not a size"},
      {"12Q", "the suffix 'Q' is none of K, M, G, T"},
      {"1e3", "is not a size"},
      {"0x10", "is not a size"},
      {" 5", "is not a size"},
      {"5 M", "is not a size"},
      {"1.5.5", "is not a size"},
      {"nan", "is not a size"},
      {"inf", "is not a size"},
  };
  for (const Case& c : refused) {
    CAPTURE(c.text);
    try {
      parse_bytes(c.text, "--device-memory", kMinDeviceMemory);
      FAIL("accepted");
    } catch (const UsageError& e) {
      const std::string w = e.what();
      INFO(w);
      CHECK(w.rfind("--device-memory: '" + c.text + "' ", 0) == 0);
      CHECK(w.find(c.words) != std::string::npos);
      CHECK(w.find("at least 64 KiB") != std::string::npos);
      CHECK(w.find("suffix K, M, G or T") != std::string::npos);
    }
  }
}

TEST_CASE("inputs: dp_train and dp_bench refuse --device-memory 0.5 with exit 2 and the accepted forms") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  std::vector<std::string> commands = {std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir.path.string() +
                                       " --steps 1"};
#ifdef DP_BENCH_BIN
  for (const char* sub : {"compare", "comm", "skew"})
    commands.push_back(std::string(DP_BENCH_BIN) + " " + sub + " --backend cpu");
#endif
  for (const std::string& cmd : commands)
    for (const char* size : {"0.5", "0", "-3", "1e9", "8388608T"}) {
      CommandResult r = run_command(cmd + " --device-memory " + size);
      CAPTURE(cmd);
      CAPTURE(size);
      INFO(r.output);
      CHECK(r.exit_code == 2);
      CHECK(r.output.find("--device-memory: '" + std::string(size) + "'") != std::string::npos);
      CHECK(r.output.find("K, M, G or T") != std::string::npos);
    }
}

// As git does: an option that is not one, with the nearest that is (dp_train's and a dp_bench
// subcommand's), and nothing suggested where none is near.
TEST_CASE("inputs: a mistyped option is named with the nearest real one, exit 2") {
  struct Case {
    std::string command, args, words;
  };
  std::vector<Case> cases = {
      {DP_TRAIN_BIN, "--epoch 1", "--epoch is not an option; did you mean --epochs?"},
      {DP_TRAIN_BIN, "--gpu 0,1", "--gpu is not an option; did you mean --gpus?"},
      {DP_TRAIN_BIN, "--bucket_kb 64", "--bucket_kb is not an option; did you mean --bucket-kb?"},
      {DP_TRAIN_BIN, "--steps 1 --frobnicate", "--frobnicate is not an option (see --help)"},
      {DP_TRAIN_BIN, "--steps 1 stray", "unexpected argument 'stray'"},
  };
#ifdef DP_BENCH_BIN
  cases.push_back({DP_BENCH_BIN, "skew --bach 3", "--bach is not an option; did you mean --batch?"});
#endif
  for (const Case& c : cases) {
    CommandResult r = run_command(c.command + " " + c.args);
    CAPTURE(c.args);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
  }
}

// A device count dp cannot run is refused at once, not after minutes of making threads and buffers.
TEST_CASE("inputs: --devices past what one process runs, or past its memory, exits 2 before any device is made") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  const std::string base = std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir.path.string() + " --steps 1";
  CommandResult r = run_command("timeout -s KILL 20 " + base + " --devices 2147483647");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--devices: 2147483647 devices in one process are more than dp runs (4096") != std::string::npos);
  // 4000 devices of lenet at width 16 with Adam: terabytes, more than any machine this runs on.
  r = run_command("timeout -s KILL 20 " + base + " --devices 4000 --width 16 --optimizer adam");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--devices 4000: each simulated device is a thread") != std::string::npos);
  CHECK(r.output.find(" fit") != std::string::npos);
}

// --momentum 0.99999999 is below 1 as written and 1 as a float: the refusal says which.
TEST_CASE("inputs: a momentum that rounds to 1 in float is refused saying so") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  CommandResult r = run_command(std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir.path.string() +
                                " --steps 1 --momentum 0.99999999");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--momentum: must be in [0, 1) as a float, and it rounds to 1") != std::string::npos);
}
