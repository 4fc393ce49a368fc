// dp_train end to end: bad arguments exit 2 with a message naming the flag; a short run on a
// synthetic data set learns; --save/--load, --report, --trace and --verify produce what they say.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/util.h"

using namespace dp::test;

TEST_CASE("dp_train: every bad argument says what is wrong and exits 2") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string data = " --data " + dir.path.string();
  struct Case {
    std::string args, words;
  };
  std::vector<Case> cases = {
      {"--batch 0", "--batch"},
      {"--batch -5", "--batch"},
      {"--batch abc", "--batch"},
      {"--model resnet", "lenet, lenet5"},
      {"--width 0", "--width: 0 is not a width dp trains; give 1 to 64"},
      {"--width -2", "--width: -2 is not a width"},
      {"--width 65", "give 1 to 64"},
      {"--width 8 --device-memory 64M --sync zero1 --optimizer adam --devices 4",
       "more than --device-memory 64.00 MiB; the largest width that fits is "},
      {"--lr -1", "--lr"},
      {"--lr nan", "--lr"},
      {"--momentum 1.5", "--momentum"},
      {"--optimizer rmsprop", "sgd (torch.optim.SGD with --momentum), adam"},
      {"--optimizer adam --momentum 0.5", "--momentum: SGD's"},
      {"--betas 0.9,0.99", "--betas: Adam's and AdamW's"},
      {"--optimizer adam --betas 0.9", "give beta1,beta2"},
      {"--optimizer adam --betas 0.9,1", "--betas: each must be in [0, 1)"},
      {"--optimizer adamw --eps 0", "--eps"},
      {"--epochs 0", "--epochs"},
      {"--sync ring", "scatter, allreduce, zero1, zero2 or zero3"},
      {"--split half", "even or chunk"},
      {"--gpus ''", "--gpus"},
      {"--gpus 0,x", "--gpus"},
      {"--gpus 0,0", "--allow-shared-device"},
      {"--devices 0", "--devices"},
      {"--backend tpu", "auto, cpu or cuda"},
      {"--device-memory 12X", "--device-memory"},
      {"--bucket-kb 64", "--bucket-kb: buckets are a feature of --sync allreduce, zero2 and zero3"},
      {"--save-every 5", "--save"},
      {"--load /nonexistent/ck.safetensors", "/nonexistent/ck.safetensors"},
      {"--report /nonexistent/dir/r.json", "/nonexistent/dir"},
      {"--no-such-flag", "--no-such-flag"},
      {"--limit-train -1", "--limit-train"},
      {"--timeout 0", "--timeout: '0' is not a timeout; give a positive number of seconds"},
      {"--timeout -5", "--timeout: '-5' is not a timeout"},
      {"--timeout inf", "--timeout: 'inf' is not a decimal number"},
      {"--timeout soon", "--timeout: 'soon' is not a number"},
      // an option that needs a value, followed by another option: not a file named --verify
      {"--steps 1 --save --verify", "--save: needs a value, and got the option --verify"},
      {"--steps 1 --log --report r.json", "--log: needs a value, and got the option --report"},
      {"--epochs 1 --epochs 2", "--epochs: given 2 times; give it once"},
  };
  for (auto& c : cases) {
    CAPTURE(c.args);
    // Simulated devices (so --devices and --gpus mean the same on any machine), except where --backend is the
    // argument refused: CLI11 refuses a repeated --backend.
    const std::string backend = c.args.rfind("--backend", 0) == 0 ? "" : "--backend cpu ";
    CommandResult r = run_command(kTrain + data + " --quiet " + backend + c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists("--verify"));  // nothing written
  CommandResult r = run_command(kTrain + " --backend cpu --data " + dir / "nowhere" + " --quiet");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("nowhere") != std::string::npos);
  // A misspelt kernel set is refused, not silently replaced by the best one.
  r = run_command("DP_CPU_KERNELS=avx3 " + kTrain + data + " --quiet --steps 1 --backend cpu");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("DP_CPU_KERNELS: 'avx3' is not a kernel set; use reference, avx2 or avx512") !=
        std::string::npos);
}

TEST_CASE("dp_train: a device that stops answering in a collective fails the run within --timeout, no hang") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  struct Case {
    std::string stall, args, words;
  };
  // DP_TEST_STALL (engine/communicator.h): that rank never arrives in its first such collective.
  const std::vector<Case> cases = {
      {"all_reduce:1", "--sync allreduce",
       "device 0: the all-reduce on sim:0 did not finish within 1 s (--timeout): sim:1 stopped answering"},
      {"all_reduce:1", "--sync allreduce --bucket-kb 4",  // the communication thread's wait
       "device 0: the all-reduce on sim:0 did not finish within 1 s (--timeout): sim:1 stopped answering"},
      {"broadcast:0", "--sync scatter",
       "device 1: the broadcast on sim:1 did not finish within 1 s (--timeout): sim:0 stopped answering"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.stall);
    CAPTURE(c.args);
    const auto start = std::chrono::steady_clock::now();
    CommandResult r =
        run_command("timeout -s KILL 60 env DP_TEST_STALL=" + c.stall + " " + kTrain + " --data " + dir.path.string() +
                    " --backend cpu --devices 2 --batch 32 --steps 3 --quiet " + "--timeout 1 " + c.args);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO(r.output);
    CHECK(r.exit_code == 1);  // a device failed; 137 would be the KILL of a hang
    CHECK(r.output.find(c.words) != std::string::npos);
    CHECK(took < 20);
  }
  // A malformed hook is refused, as DP_TEST_AT is.
  CommandResult bad = run_command("env DP_TEST_STALL=all_reduce " + kTrain + " --data " + dir.path.string() +
                                  " --backend cpu --steps 1");
  CHECK(bad.exit_code == 2);
  CHECK(bad.output.find("DP_TEST_STALL=all_reduce: give <collective>:<rank>") != std::string::npos);
}

TEST_CASE("dp_train: a short run learns, saves, reloads, reports and traces") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 1024, 256);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 64 --lr 0.05";
  CommandResult r = run_command(base + " --epochs 3 --devices 2 --sync allreduce --save " + dir / "ck.safetensors" +
                                " --report " + dir / "r.json" + " --trace " + dir / "t.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("backend: simulated CPU devices") != std::string::npos);
  nlohmann::json rep = read_json(dir / "r.json");
  CHECK(rep["epochs"].size() == 3);
  CHECK(rep["epochs"][2]["train_loss"].get<double>() < rep["epochs"][0]["train_loss"].get<double>());
  CHECK(rep["test_accuracy"].get<double>() > 0.8);  // chance is 0.1
  CHECK(rep["images_per_second"].get<double>() > 0);
  CHECK(rep["devices"].size() == 2);
  for (auto& d : rep["devices"]) {
    CHECK(d["peak_bytes"].get<int64_t>() > 0);
    CHECK(d["bytes_sent_per_step"].get<int64_t>() > 0);
    int64_t sum = 0;
    for (auto& [k, v] : d["peak_by_category"].items()) sum += v.get<int64_t>();
    CHECK(sum == d["peak_bytes"].get<int64_t>());
  }
  CHECK(rep["config"]["strategy"] == "allreduce");
  nlohmann::json trace = read_json(dir / "t.json");
  CHECK(trace["traceEvents"].size() > 10);

  // --load starts from the saved weights: the first epoch's loss is already low
  CommandResult again =
      run_command(base + " --epochs 1 --load " + dir / "ck.safetensors" + " --report " + dir / "r2.json");
  REQUIRE(again.exit_code == 0);
  CHECK(read_json(dir / "r2.json")["epochs"][0]["train_loss"].get<double>() <
        rep["epochs"][0]["train_loss"].get<double>());
}

TEST_CASE("dp_train --verify compares with one device and passes for both strategies") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  for (std::string sync : {"scatter", "allreduce"}) {
    CommandResult r = run_command(kTrain + " --backend cpu --data " + dir.path.string() +
                                  " --batch 32 --steps 8 --devices 3 --sync " + sync + " --verify");
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("verify: largest weight difference") != std::string::npos);
    CHECK(r.output.find(" ok") != std::string::npos);
  }
}

TEST_CASE("dp_train --verify over more steps than its bound holds for is refused before training") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 8 --devices 2 --verify";
  CommandResult r = run_command(base + " --epochs 1");  // 32 steps
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--verify: this run trains 32 steps") != std::string::npos);
  CHECK(r.output.find("(--steps 20)") != std::string::npos);
  CHECK(r.output.find("epoch") == std::string::npos);  // nothing trained
  // 20 steps are verified, on LeNet-5's sigmoids: on lenet's ReLUs this data's difference from one
  // device grew from 6e-8 after 10 steps to 2.3e-5 after 15 and 3.3e-4 after 20 on an AMD EPYC's
  // AVX-512 kernels (the AVX2 and reference kernels' stayed under 1.2e-7), past the rounding bound:
  // most likely a value within rounding of zero going either way through a ReLU (as with BatchNorm;
  // lenet is held to the weights' movement past the bound since), so the sigmoids keep the bound itself.
  const CommandResult twenty = run_command(base + " --steps 20 --quiet --model lenet5");
  INFO(twenty.output);
  CHECK(twenty.exit_code == 0);
}

// Adam's bound is per weight (AdamTolerance): a correct run passes under every strategy, and a weight
// moved past its bound (the test build's hook) fails.
TEST_CASE("dp_train --verify with Adam and AdamW: per weight, on every strategy") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --steps 8 --devices 3";
  for (std::string sync : dp::test::all_strategies()) {
    CAPTURE(sync);
    CommandResult r = run_command(base + " --sync " + sync + " --optimizer " + (sync == "zero2" ? "adamw" : "adam") +
                                  " --verify --report " + dir / "r.json");
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("Adam's bound is per weight") != std::string::npos);
    CHECK(r.output.find(" ok;") != std::string::npos);
    CHECK(read_json(dir / "r.json")["verify"]["ok"] == true);
  }
  CommandResult r = run_command("DP_TEST_VERIFY_OFFSET=0.01 " + base + " --sync zero3 --optimizer adam --verify");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("differs from 1 device by 0.01") != std::string::npos);
  CHECK(r.output.find(" FAILED;") != std::string::npos);
}

// A model with a threshold (ReLU, max-pool) past the rounding bound is held to 10% of the weights'
// movement, as a value within rounding of the threshold goes either way (verify.cpp); one without
// (lenet5's sigmoids and average pools) to the bound alone. The test build's hook moves the
// reference's first weight by 1e-4 (past the bound, within the movement) and by 0.5 (past both).
TEST_CASE("dp_train --verify: past the rounding bound, a ReLU model is held to the movement, a sigmoid one fails") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  const std::string base =
      kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --steps 3 --devices 2 --verify";
  CommandResult r = run_command("DP_TEST_VERIFY_OFFSET=1e-4 " + base + " --model lenet");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find(") over it") != std::string::npos);
  CHECK(r.output.find("verify: with ReLUs or max-pools ok: ") != std::string::npos);
  r = run_command("DP_TEST_VERIFY_OFFSET=0.5 " + base + " --model lenet");
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("verify: with ReLUs or max-pools FAILED: ") != std::string::npos);
  r = run_command("DP_TEST_VERIFY_OFFSET=1e-4 " + base + " --model lenet5");
  CHECK(r.exit_code == 1);
  CHECK(r.output.find(") FAILED") != std::string::npos);
  CHECK(r.output.find("max-pools") == std::string::npos);
}

TEST_CASE("dp_train: a non-finite loss stops with exit 3 naming the step and the layer") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  CommandResult r =
      run_command(kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --epochs 1 --lr 1e6 --quiet");
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(r.output.find("step ") != std::string::npos);
  CHECK(r.output.find("non-finite") != std::string::npos);
}

TEST_CASE("dp_train --help: options in groups, then the exit codes, the environment and examples") {
  CommandResult r = run_command(kTrain + " --help");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  // Each group's heading, and the flags under it, in the order shown.
  const std::vector<std::pair<std::string, std::string>> groups = {
      {"Devices:", "--gpus"},    {"Strategy:", "--sync"},    {"Training:", "--batch"},
      {"Data:", "--limit-test"}, {"Checkpoints:", "--eval"}, {"Output:", "--log-every"},
  };
  size_t at = 0;
  for (auto& group : groups) {  // no structured bindings under CAPTURE: clang 14 refuses the capture
    const auto& heading = group.first;
    const auto& flag = group.second;
    CAPTURE(heading);
    const size_t h = r.output.find("\n" + heading + "\n", at);
    REQUIRE(h != std::string::npos);
    CHECK(r.output.find(flag, h) != std::string::npos);
    at = h;
  }
  for (const char* words :
       {"Exit codes:", "non-finite loss", "130 SIGINT", "143 SIGTERM", "129 SIGHUP",
        "DP_CPU_KERNELS=reference|avx2|avx512", "DP_CUDA_CONV=library|implicit", "DP_CUDA_STREAMS=1|2",
        "DP_CUDA_PDL=0|1", "DP_CUDA_FUSE=1|0", "DP_GRACE_SECONDS", "(default 10)", "dp_train --gpus 0,1 --batch 256",
        "--sync allreduce --bucket-kb", "--save ck.st && dp_train --eval --load ck.st"}) {
    CAPTURE(words);
    CHECK(r.output.find(words, at) != std::string::npos);  // after the options
  }
  CHECK(r.output.find("DP_TEST_AT") == std::string::npos);  // a test hook, not for users
#ifdef DP_BENCH_BIN
  // dp_bench shares the device flags: its help still lists them, in their group
  CommandResult b = run_command(std::string(DP_BENCH_BIN) + " compare --help");
  INFO(b.output);
  CHECK(b.exit_code == 0);
  CHECK(b.output.find("Devices:") != std::string::npos);
  CHECK(b.output.find("--gpus") != std::string::npos);
#endif
}

TEST_CASE("dp_train: sizes past the data are clamped with a one-line note") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string base = kTrain + " --backend cpu --devices 1 --steps 1 --data " + dir.path.string();
  CommandResult r = run_command(base + " --batch 100 --limit-train 70000 --limit-test 50");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("note: --limit-train 70000 is more than the 64 training images in " + dir.path.string() +
                      "; all of them are used") != std::string::npos);
  CHECK(r.output.find("note: --limit-test 50 is more than the 32 test images") != std::string::npos);
  CHECK(r.output.find("note: --batch 100 is more than the 64 training images in") != std::string::npos);
  r = run_command(base + " --batch 40 --limit-train 20");
  CHECK(r.output.find("note: --batch 40 is more than the 20 training images --limit-train keeps") != std::string::npos);
  r = run_command(base + " --batch 32 --limit-train 64");  // nothing clamped: nothing said
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("note:") == std::string::npos);
}

// A release binary carries no test seam (engine/failpoint.h): no DP_TEST_ string in dp_train or
// dp_bench, and the environment that drives the test build's failpoints changes nothing there.
TEST_CASE("release binaries: no failpoint, no DP_TEST_ string in dp_train or dp_bench") {
  auto contains = [](const std::string& path, const std::string& needle) {  // grep: fast under the sanitizers
    return run_command("grep -q -a -F '" + needle + "' '" + path + "'").exit_code == 0;
  };
  CHECK(contains(kTrain, "DP_TEST_"));  // the test build's dp_train has them: the search finds what it looks for
  CHECK_FALSE(contains(DP_RELEASE_TRAIN_BIN, "DP_TEST_"));
#ifdef DP_BENCH_BIN
  CHECK_FALSE(contains(DP_BENCH_BIN, "DP_TEST_"));
#endif
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  const std::string run = " --backend cpu --quiet --data " + dir.path.string() + " --batch 16 --steps 2";
  // In the test build this signals the run before it starts (exit 143); in a release build it is nothing.
  CommandResult seamed = run_command("env DP_TEST_AT=start:SIGTERM " + kTrain + run);
  CHECK(seamed.exit_code == 143);
  CommandResult release =
      run_command("env DP_TEST_AT=start:SIGTERM DP_TEST_STALL=all_reduce:x " + std::string(DP_RELEASE_TRAIN_BIN) + run);
  INFO(release.output);
  CHECK(release.exit_code == 0);
}

// A missing checkpoint to start from is refused before any device starts, as --eval's is.
TEST_CASE("dp_train --load and --resume of a missing file exit 2 before the devices start") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  for (const std::string flag : {"--load", "--resume"}) {
    CAPTURE(flag);
    CommandResult r = run_command(kTrain + " --backend cpu --data " + dir.path.string() + " --steps 1 " + flag + " " +
                                  dir / "none.st");
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(dir / "none.st" + ": no such checkpoint file") != std::string::npos);
    CHECK(r.output.find("backend:") == std::string::npos);
  }
}

// A run that --steps ends inside an epoch says so on the epoch's line; a full epoch's line does not.
TEST_CASE("dp_train: an epoch --steps cut short says how many of its steps ran") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 16);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32";  // 8 steps an epoch
  CommandResult r = run_command(base + " --steps 3");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("epoch 1/1 ") != std::string::npos);
  CHECK(r.output.find("(3 of the epoch's 8 steps)\n") != std::string::npos);
  r = run_command(base + " --epochs 1");
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("epoch 1/1 ") != std::string::npos);
  CHECK(r.output.find(" of the epoch's ") == std::string::npos);
}
