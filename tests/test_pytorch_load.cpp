// docs/load_into_pytorch.py, the README's "load into PyTorch" example, run as written: a checkpoint
// from dp_train loads into PyTorch modules with strict names and scores the test set as dp did.
// Needs /usr/bin/python3 with torch (Debian's python3-torch); without it the cases say so and pass.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/util.h"

using namespace dp::test;

namespace {

// On the simulated CPU devices, so --devices N means N devices on any machine, one with a GPU too.
const std::string kLoadScript = std::string("/usr/bin/python3 ") + DP_SOURCE_DIR + "/docs/load_into_pytorch.py";

// find_spec instead of `import torch`: the same answer where torch is absent, without the 3 s import.
bool have_torch() {
  return run_command(
             "/usr/bin/python3 -c \"import importlib.util, sys; "
             "sys.exit(importlib.util.find_spec('torch') is None)\"")
             .exit_code == 0;
}

// The script's last line, "model=lenet images=200 correct=187 test_accuracy=0.9350 test_loss=0.2", as a map.
std::map<std::string, std::string> result_line(const std::string& output) {
  const size_t at = output.rfind("model=");
  std::map<std::string, std::string> kv;
  std::istringstream words(at == std::string::npos ? "" : output.substr(at));
  for (std::string w; words >> w;)
    if (auto eq = w.find('='); eq != std::string::npos) kv[w.substr(0, eq)] = w.substr(eq + 1);
  return kv;
}

// Trains a few steps on a synthetic set of 200 test images, then scores the checkpoint with the script
// on the same first `test` of them.
void check_model(const std::string& model, const std::string& train_flags, int test) {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 512, 200);
  const std::string limit = test < 200 ? " --limit-test " + std::to_string(test) : "";
  CommandResult t = run_command(kTrainCpu + " --quiet --data " + dir.path.string() + " --model " + model + " " +
                                train_flags + limit + " --save " + dir / "ck.st" + " --report " + dir / "r.json");
  INFO(t.output);
  REQUIRE(t.exit_code == 0);
  std::ifstream rf(dir / "r.json");
  const nlohmann::json rep = nlohmann::json::parse(rf);
  const double dp_accuracy = rep["test_accuracy"].get<double>();
  const double dp_loss = rep["epochs"].back()["test_loss"].get<double>();

  // No --model: the script takes it from the checkpoint's metadata.
  CommandResult py = run_command(kLoadScript + " " + dir / "ck.st" + " --data " + dir.path.string() +
                                 (test < 200 ? " --limit " + std::to_string(test) : ""));
  INFO(py.output);
  REQUIRE(py.exit_code == 0);
  auto kv = result_line(py.output);
  REQUIRE(kv.count("correct"));
  CHECK(kv["model"] == model);
  CHECK(std::stoi(kv["images"]) == test);
  // Both evaluate in fp32 but sum in different orders, so a logit may move by a few ulps of its
  // terms: an image whose two best logits are that close could flip, so allow one image.
  const int dp_correct = int(std::lround(dp_accuracy * test));
  CHECK(std::abs(std::stoi(kv["correct"]) - dp_correct) <= 1);
  // The same reordering in the loss: a K-term fp32 sum in another order moves by ~sqrt(K) * 2^-24
  // relative, 2e-6 for fc1's 800 terms (measured: 1e-7 to 4e-7), and the script's 6 decimals round
  // by 5e-7. 1e-5 leaves room for the other kernel paths (AVX2, AVX-512, BLAS) yet still fails an
  // average pooling turned max pooling in the near-chance lenet5 below (3e-5 apart).
  const double py_loss = std::stod(kv["test_loss"]);
  CHECK(std::abs(py_loss - dp_loss) <= 1e-5 * std::max(1.0, dp_loss));
  MESSAGE(model << ": dp " << dp_correct << "/" << test << " loss " << dp_loss << ", PyTorch " << kv["correct"] << "/"
                << test << " loss " << py_loss);
}

}  // namespace

TEST_CASE("pytorch: a lenet checkpoint scores in PyTorch what it scored in dp") {
  if (!have_torch()) {
    MESSAGE("skipped: /usr/bin/python3 has no torch (Debian: apt install python3-torch)");
    return;
  }
  check_model("lenet", "--batch 32 --epochs 2 --lr 0.05", 200);  // 0.81 accuracy
}

TEST_CASE("pytorch: a lenet5 checkpoint from two devices scores in PyTorch what it scored in dp") {
  if (!have_torch()) {
    MESSAGE("skipped: /usr/bin/python3 has no torch (Debian: apt install python3-torch)");
    return;
  }
  // Sigmoids leave chance on this set only after many epochs, so here the loss carries the check.
  check_model("lenet5", "--batch 64 --epochs 2 --lr 0.5 --devices 2 --sync allreduce", 150);
}

// ZeRO-3's checkpoint is gathered from every device's chunks of the weights: the same file.
TEST_CASE("pytorch: a lenet checkpoint from zero3 on three devices scores in PyTorch what it scored in dp") {
  if (!have_torch()) {
    MESSAGE("skipped: /usr/bin/python3 has no torch (Debian: apt install python3-torch)");
    return;
  }
  check_model("lenet", "--batch 32 --epochs 2 --lr 0.05 --devices 3 --sync zero3", 200);
}

TEST_CASE(
    "pytorch: a lenet-bn checkpoint (BatchNorm, SyncBatchNorm on two devices) scores in PyTorch what it did in dp") {
  if (!have_torch()) {
    MESSAGE("skipped: /usr/bin/python3 has no torch (Debian: apt install python3-torch)");
    return;
  }
  // The running statistics travel in the checkpoint: PyTorch's eval() normalises with them as dp does.
  check_model("lenet-bn", "--batch 32 --epochs 2 --lr 0.05 --devices 2 --sync allreduce --sync-bn", 200);
}

TEST_CASE("pytorch: a missing file or a checkpoint of the other model exits 2 and says why") {
  if (!have_torch()) {
    MESSAGE("skipped: /usr/bin/python3 has no torch (Debian: apt install python3-torch)");
    return;
  }
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  CommandResult missing = run_command(kLoadScript + " " + dir / "none.st" + " --data " + dir.path.string());
  CHECK(missing.exit_code == 2);
  CHECK(missing.output.find("none.st: no such checkpoint file") != std::string::npos);

  REQUIRE(run_command(kTrainCpu + " --quiet --data " + dir.path.string() +
                      " --model lenet5 --steps 1 --batch 16 --save " + dir / "ck.st")
              .exit_code == 0);
  CommandResult wrong = run_command(kLoadScript + " " + dir / "ck.st" + " --model lenet --data " + dir.path.string());
  INFO(wrong.output);
  CHECK(wrong.exit_code == 2);
  for (const char* words : {"use --model lenet5", "expected (lenet):", "conv1.weight [20, 1, 3, 3]", "found",
                            "conv1.weight [6, 1, 5, 5]", "fc3.weight [10, 84]"})
    CHECK(wrong.output.find(words) != std::string::npos);
}
