// Checkpoints you can trust: resuming continues a run bit for bit (one device, scatter, allreduce,
// across epoch boundaries); SIGINT/SIGTERM save and exit 130/143; a crash in the middle of a save
// leaves the previous checkpoint; a diverging run never saves the bad step; a checkpoint that does
// not belong to this run is refused.
#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "engine/error.h"
#include "tests/util.h"
#include "train/checkpoint.h"

using namespace dp;
using namespace dp::test;

namespace {

// On the simulated CPU devices, so --devices N means N devices on any machine, one with a GPU too.

// Every tensor (weights and momentum) bit for bit, and the metadata.
void check_same_checkpoint(const std::string& got_path, const std::string& want_path) {
  check_same_tensors(got_path, want_path);
  INFO("got " << got_path << ", want " << want_path);
  CHECK(read_safetensors(got_path).metadata == read_safetensors(want_path).metadata);
}

// Waits until `path` exists while `proc` runs; false if it ended first or a minute passed.
bool wait_for_file(const std::string& path, Spawned& proc) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(path)) {
    if (!proc.running() || std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

}  // namespace

namespace {

// Resume is bit-exact at every later step, across epoch boundaries, for one configuration (flags).
void check_resume_chain(const std::string& flags) {
  TempDir dir;
  // 120 samples in batches of 32: 4 steps per epoch, the last one 24 samples. K = 9 steps cross
  // two epoch boundaries; the interrupted run stops at k = 3, in the middle of the first epoch.
  write_synthetic_dataset(dir.path.string(), 120, 32);
  const int K = 9, k = 3;
  const std::string lr =
      flags.find("--lr") == std::string::npos && flags.find("--optimizer") == std::string::npos ? " --lr 0.05" : "";
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 --quiet" + lr + " " + flags;
  auto run = [&](const std::string& args) {
    CommandResult r = run_command(base + " " + args);
    INFO(args << "\n" << r.output);
    REQUIRE(r.exit_code == 0);
  };
  auto ref = [&](int j) { return dir / ("ref" + std::to_string(j)); };
  // The uninterrupted run's state after every step j from k on: --steps only decides where a run
  // stops. Under the sanitizers, after k and K alone: every configuration still saves, stops and
  // resumes across two epoch boundaries there, in 4 runs instead of 15; the plain builds check the
  // bits at every step between.
  for (int j = k; j <= K; ++j)
    if (!kSanitized || j == k || j == K) run("--steps " + std::to_string(j) + " --save " + ref(j));

  // Stopped after k steps, then resumed to K in one go (saving every 2 steps on the way).
  run("--steps " + std::to_string(k) + " --save " + dir / "A");
  check_same_checkpoint(dir / "A", ref(k));
  CHECK(global_step(dir / "A") == k);
  run("--resume " + dir / "A" + " --steps " + std::to_string(K) + " --save " + dir / "B" + " --save-every 2");
  check_same_checkpoint(dir / "B", ref(K));

  // Resumed one step at a time from its own checkpoint: every later step, including a resume
  // exactly at an epoch boundary (steps 4 and 8) and the first step of a new epoch.
  if (kSanitized) return;
  std::filesystem::copy_file(dir / "A", dir / "chain", std::filesystem::copy_options::overwrite_existing);
  for (int j = k + 1; j <= K; ++j) {
    CAPTURE(j);
    run("--resume " + dir / "chain" + " --steps " + std::to_string(j) + " --save " + dir / "chain");
    check_same_checkpoint(dir / "chain", ref(j));
  }
}

}  // namespace

// One case per configuration, so that ctest runs them side by side. lenet-bn: BatchNorm's running
// statistics and num_batches_tracked resume too.
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: 1 device") {
  check_resume_chain("--devices 1");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: 2-device scatter") {
  check_resume_chain("--devices 2 --sync scatter");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: 2-device allreduce") {
  check_resume_chain("--devices 2 --sync allreduce");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: lenet-bn, 2-device allreduce") {
  check_resume_chain("--model lenet-bn --devices 2 --sync allreduce");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: lenet-bn, 2-device scatter, --sync-bn") {
  check_resume_chain("--model lenet-bn --devices 2 --sync scatter --sync-bn");
}
// Adam's two moments and its step count (the bias correction) resume too.
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: adam, 2-device allreduce") {
  check_resume_chain("--optimizer adam --lr 0.002 --devices 2 --sync allreduce");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: adamw, 2-device scatter") {
  check_resume_chain("--optimizer adamw --devices 2 --sync scatter");
}

// ZeRO-1: each device's shard of the optimizer state gathered into the checkpoint and split again on
// resume; three devices pad the flat buffers (P is not a multiple of 3).
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: adam, 3-device zero1") {
  check_resume_chain("--optimizer adam --lr 0.002 --devices 3 --sync zero1");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: lenet-bn, 2-device zero1") {
  check_resume_chain("--model lenet-bn --devices 2 --sync zero1");
}
// ZeRO-2: a unit per layer (and with --bucket-kb, per bucket), each padded to 3 chunks.
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: adamw, 3-device zero2") {
  check_resume_chain("--optimizer adamw --devices 3 --sync zero2");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: 3-device zero2, 16 KiB buckets") {
  check_resume_chain("--devices 3 --sync zero2 --bucket-kb 16");
}
// ZeRO-3: the weights too are each device's chunks, gathered into the checkpoint and split on resume.
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: adam, lenet-bn, 3-device zero3") {
  check_resume_chain("--optimizer adam --lr 0.002 --model lenet-bn --devices 3 --sync zero3");
}

// --accumulate: a step is micro-batches of 32, 64 or 96 images in all (the epoch's last: 56 as 32 + 24, or
// 24 alone); an interrupted run saved between steps restarts at the next step's first micro-batch.
TEST_CASE(
    "resume is bit-exact at every later step, across epoch boundaries: --accumulate 2, lenet-bn, 2-device allreduce") {
  check_resume_chain("--accumulate 2 --model lenet-bn --devices 2 --sync allreduce");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: --accumulate 3, 2-device scatter") {
  check_resume_chain("--accumulate 3 --devices 2 --sync scatter");
}
TEST_CASE("resume is bit-exact at every later step, across epoch boundaries: --accumulate 3, adam, 3-device zero3") {
  check_resume_chain("--accumulate 3 --optimizer adam --lr 0.002 --devices 3 --sync zero3");
}

TEST_CASE("resume on another strategy or device count runs, with a one-line warning") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 120, 32);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 --quiet";
  REQUIRE(run_command(base + " --devices 1 --steps 3 --save " + dir / "ck").exit_code == 0);
  CommandResult r = run_command(base + " --devices 2 --sync allreduce --steps 5 --resume " + dir / "ck");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("warning: --resume " + dir / "ck") != std::string::npos);
  CHECK(r.output.find("devices 1 -> 2") != std::string::npos);
  CHECK(r.output.find("sync scatter -> allreduce") != std::string::npos);
  CHECK(r.output.find("not guaranteed bit-exact") != std::string::npos);
  // the same configuration resumes silently
  r = run_command(base + " --devices 1 --steps 5 --resume " + dir / "ck");
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("warning") == std::string::npos);
}

TEST_CASE("resume from the run's last step or past it trains nothing and says which") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 120, 32);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 --devices 1";
  REQUIRE(run_command(base + " --quiet --steps 3 --save " + dir / "ck").exit_code == 0);
  CommandResult r = run_command(base + " --steps 3 --resume " + dir / "ck");
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("at step 3 (epoch 1, step 3 of 4); that is already the last step, nothing to train") !=
        std::string::npos);
  r = run_command(base + " --steps 2 --resume " + dir / "ck");
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("at step 3 (epoch 1, step 3 of 4); past the run's 2 steps, nothing to train") !=
        std::string::npos);
}

TEST_CASE("resume refuses a checkpoint from a different run: exit 2 naming what differs") {
  TempDir dir, other;
  write_synthetic_dataset(dir.path.string(), 120, 32);
  write_synthetic_dataset(other.path.string(), 120, 32, true, 99);  // same size, other samples
  const std::string data = " --data " + dir.path.string();
  const std::string base = kTrainCpu + " --quiet";
  REQUIRE(run_command(base + data + " --batch 32 --steps 3 --save " + dir / "ck").exit_code == 0);
  ModelSpec spec = make_model("lenet");
  Checkpoint weights_only = load_checkpoint(dir / "ck", spec);
  weights_only.metadata.clear();
  save_checkpoint(dir / "weights", spec, weights_only);
  SafeTensors st = read_safetensors(dir / "ck");
  st.metadata["global_step"] = "3abc";
  write_safetensors(dir / "badstep", st);
  st.metadata["global_step"] = "-4";
  write_safetensors(dir / "negstep", st);
  write_file(dir / "garbage", "not a checkpoint at all", false);

  struct Case {
    std::string args, words;
  };
  const std::string ck = " --batch 32 --resume " + dir / "ck";
  std::vector<Case> cases = {
      {data + " --resume " + dir / "ck" + " --steps 6 --batch 16", "--batch 32"},
      {data + ck + " --steps 6 --seed 1", "--seed 0"},
      {data + ck + " --steps 6 --limit-train 100", "a training set of 120 samples"},
      {data + ck + " --steps 6 --no-shuffle", "--no-shuffle"},
      {" --data " + other.path.string() + ck + " --steps 6", "training labels with CRC-32"},
      {data + ck + " --steps 6 --model lenet5", "this checkpoint is lenet"},
      {data + ck + " --steps 6 --load " + dir / "ck", "--load and --resume"},
      {data + " --resume " + dir / "weights" + " --steps 6", "not a resumable checkpoint"},
      {data + " --resume " + dir / "badstep" + " --steps 6", "3abc"},
      {data + " --resume " + dir / "negstep" + " --steps 6", "-4"},
      {data + " --resume " + dir / "garbage" + " --steps 6", "not a valid safetensors file"},
      {data + " --resume " + dir / "absent" + " --steps 6", "no such checkpoint"},
      {data + " --resume " + dir.path.string() + " --steps 6", "not a checkpoint file"},
      {data + " --resume /dev/null --steps 6", "not a checkpoint file"},
  };
  for (auto& c : cases) {
    CAPTURE(c.args);
    CommandResult r = run_command(base + c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
  }
}

TEST_CASE("SIGINT and SIGTERM finish the step, save, name the checkpoint and exit 130 / 143") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 32);
  for (int sig : {SIGINT, SIGTERM}) {
    CAPTURE(sig);
    const std::string ck = dir / ("ck" + std::to_string(sig)), log = dir / "log";
    Spawned run(kTrainCpu + " --data " + dir.path.string() + " --batch 32 --steps 1000000 --save-every 1 --save " + ck +
                " > " + log + " 2>&1");
    // Once the first checkpoint exists the handlers are installed and training is under way.
    REQUIRE(wait_for_file(ck, run));
    REQUIRE(::kill(run.pid, sig) == 0);
    int code = run.wait();
    std::string out = slurp(log);
    INFO(out);
    CHECK(code == 128 + sig);
    CHECK(out.find(sig == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)") != std::string::npos);
    CHECK(out.find("checkpoint saved to " + ck) != std::string::npos);
    Checkpoint c = load_checkpoint(ck, make_model("lenet"));
    int64_t step = std::stoll(c.metadata.at("global_step"));
    CHECK(step > 0);
    CHECK(out.find("after step " + std::to_string(step)) != std::string::npos);
    // and it resumes
    CommandResult more = run_command(kTrainCpu + " --data " + dir.path.string() + " --batch 32 --quiet --steps " +
                                     std::to_string(step + 2) + " --resume " + ck + " --save " + ck);
    CHECK(more.exit_code == 0);
    CHECK(global_step(ck) == step + 2);
  }
}

TEST_CASE("a process killed while saving leaves the previous checkpoint loadable") {
  TempDir dir;
  ModelSpec spec = make_model("lenet");
  Checkpoint old;
  old.params = random_floats(size_t(spec.param_count), 11);
  old.metadata["global_step"] = "7";
  save_checkpoint(dir / "ck", spec, old);
  const std::string before = slurp(dir / "ck");

  SUBCASE("a writer killed with SIGKILL in the middle of the file") {
    // 64 MiB of payload: long enough to be caught between open() and rename().
    SafeTensors big = read_safetensors(dir / "ck");
    Tensor pad{"F32", {16 << 20}, std::vector<unsigned char>(size_t(64) << 20, 0x5a)};
    big.tensors["padding"] = std::move(pad);
    big.order.push_back("padding");
    pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      write_safetensors(dir / "ck", big);
      _exit(0);
    }
    // The temporary file is a short hidden name beside ck: whatever else appears in the directory.
    auto temp_file = [&] {
      for (auto& e : std::filesystem::directory_iterator(dir.path))
        if (e.path().filename() != "ck") return e.path().string();
      return std::string();
    };
    std::string tmp;
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((tmp = temp_file()).empty() && std::chrono::steady_clock::now() < end) std::this_thread::yield();
    ::kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));  // it died before finishing the save
    CHECK(!tmp.empty());
    CHECK(std::filesystem::exists(tmp));
    CHECK(slurp(dir / "ck") == before);
  }
  SUBCASE("a stale partial temporary file from a crashed run beside it") {
    write_file(dir / "ck.tmp.999999", before.substr(0, before.size() / 2), false);
    CHECK(slurp(dir / "ck") == before);
  }
  Checkpoint back = load_checkpoint(dir / "ck", spec);
  CHECK(back.params == old.params);
  CHECK(back.metadata.at("global_step") == "7");
  // and the next save replaces it as usual
  Checkpoint next = old;
  next.params[0] += 1;
  save_checkpoint(dir / "ck", spec, next);
  CHECK(load_checkpoint(dir / "ck", spec).params == next.params);
}

TEST_CASE("dp_train killed with SIGKILL at any moment leaves a checkpoint that loads and resumes") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 32);
  const std::string ck = dir / "ck";
  for (int delay_ms : {0, 3, 11, 29}) {  // kills landing at different points of the step/save cycle
    CAPTURE(delay_ms);
    Spawned run(kTrainCpu + " --data " + dir.path.string() + " --batch 32 --steps 1000000 --save-every 1 --save " + ck +
                (std::filesystem::exists(ck) ? " --resume " + ck : std::string()) + " > " + dir / "log" + " 2>&1");
    REQUIRE(wait_for_file(ck, run));
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(run.pid, SIGKILL);
    CHECK(run.wait() == 128 + SIGKILL);
    Checkpoint c = load_checkpoint(ck, make_model("lenet"));
    CHECK(std::stoll(c.metadata.at("global_step")) > 0);
  }
}

TEST_CASE("a diverging run exits 3 naming the step and the layer, and never saves the bad step") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 32);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 --quiet";
  const std::string ck = dir / "ck";
  ModelSpec spec = make_model("lenet");
  auto finite = [](const std::vector<float>& v) {
    for (float x : v)
      if (!std::isfinite(x)) return false;
    return true;
  };

  CommandResult r = run_command(base + " --steps 50 --lr 1e6 --save-every 1 --save " + ck);
  INFO(r.output);
  REQUIRE(r.exit_code == 3);
  auto at = r.output.find("step ");
  REQUIRE(at != std::string::npos);
  const int64_t bad_step = std::stoll(r.output.substr(at + 5));
  CHECK(bad_step >= 1);
  bool names_layer = false;
  for (auto& p : spec.params) names_layer |= r.output.find("non-finite gradient is " + p.name) != std::string::npos;
  bool weights_overflowed = r.output.find("weights are no longer finite") != std::string::npos;
  CHECK((names_layer || weights_overflowed));
  if (std::filesystem::exists(ck)) {
    CHECK(r.output.find("the last good checkpoint (step ") != std::string::npos);
    Checkpoint c = load_checkpoint(ck, spec);
    CHECK(finite(c.params));
    for (const auto& s : c.optimizer_state) CHECK(finite(s.second));
    CHECK(std::stoll(c.metadata.at("global_step")) < bad_step);
  }

  // Finite loss and gradients whose update overflows the weights: all of fc2.bias at 3.39e38 shifts
  // every logit alike (the loss stays ln 10). A bias gradient is 0.1 minus the class's share of the
  // batch, and 32 samples over 10 classes give some class a share >= 4/32: lr 3e38 times -0.025
  // pushes it past FLT_MAX (3.4028e38). The check before saving catches it; nothing is written.
  {
    REQUIRE(run_command(base + " --steps 1 --save " + dir / "base").exit_code == 0);
    SafeTensors st = read_safetensors(dir / "base");
    std::vector<float> big(10, 3.39e38f);
    std::memcpy(st.tensors.at("fc2.bias").data.data(), big.data(), big.size() * sizeof(float));
    write_safetensors(dir / "huge-bias", st);
    const std::string out = dir / "overflow";
    CommandResult o = run_command(base + " --steps 3 --lr 3e38 --momentum 0 --load " + dir / "huge-bias" +
                                  " --save-every 1 --save " + out);
    INFO(o.output);
    CHECK(o.exit_code == 3);
    CHECK(o.output.find("step 1: the weights are no longer finite after the update") != std::string::npos);
    CHECK(o.output.find("nothing was saved") != std::string::npos);
    CHECK(!std::filesystem::exists(out));
  }

  // A good checkpoint, then a run resumed from it that diverges: the file is left as it was.
  REQUIRE(run_command(base + " --steps 2 --save " + ck).exit_code == 0);
  const std::string good = slurp(ck);
  r = run_command(base + " --steps 50 --lr 1e6 --resume " + ck + " --save " + ck);
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(r.output.find(ck + " is left as it was") != std::string::npos);
  CHECK(slurp(ck) == good);
}

TEST_CASE("dp_train: an empty training set is refused up front, a batch past the set's size is one step per epoch") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 40, 16);
  write_file(dir / "train-images-idx3-ubyte.gz", idx_images({}, 0, 28, 28), true);
  write_file(dir / "train-labels-idx1-ubyte.gz", idx_labels({}), true);
  CommandResult r = run_command(kTrainCpu + " --data " + dir.path.string() + " --quiet --steps 1 --save " + dir / "ck");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("no images") != std::string::npos);
  CHECK(!std::filesystem::exists(dir / "ck"));

  write_synthetic_dataset(dir.path.string(), 40, 16);
  // buffers are sized for the 40 samples there are, not for a billion
  r = run_command(kTrainCpu + " --data " + dir.path.string() + " --quiet --epochs 2 --batch 1000000000 --report " +
                  dir / "r.json");
  INFO(r.output);
  CHECK(r.exit_code == 0);
}

TEST_CASE("dp_train: what would fail at the end of a run is refused before it starts") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 40, 16);
  std::filesystem::create_directory(dir / "adir");
  struct Case {
    std::string args, words;
  };
  std::vector<Case> cases = {
      {"--steps 0", "--steps: 0"},
      {"--steps 2 --save " + dir / "adir", "is a directory"},
      {"--steps 2 --save /proc/dp_ck", "cannot write there"},  // even root cannot create files in /proc
      {"--steps 2 --report /proc/dp_r.json", "cannot write there"},
      {"--steps 2 --trace " + dir / "adir", "is a directory"},
  };
  for (auto& c : cases) {
    CAPTURE(c.args);
    auto t0 = std::chrono::steady_clock::now();
    CommandResult r = run_command(kTrainCpu + " --data " + dir.path.string() + " " + c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
    CHECK(r.output.find("epoch 1/") == std::string::npos);  // nothing was trained
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  }
  CHECK(std::filesystem::is_empty(dir / "adir"));
}
