// dp_train --eval --load FILE: the checkpoint scored on the test set by the devices a run trains on,
// nothing trained; the same accuracy and loss as the final epoch of the run that saved it, a small
// --report, and the options of a training run refused by name.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <regex>

#include "models/model.h"
#include "tests/util.h"
#include "train/checkpoint.h"

using namespace dp::test;

TEST_CASE("eval: --eval --load scores the checkpoint as the run that saved it did, on the same devices") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 192, 100);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --devices 2";
  const std::string ck = dir / "ck.st";
  CommandResult trained = run_command(base + " --epochs 2 --quiet --save " + ck + " --report " + dir / "r.json");
  INFO(trained.output);
  REQUIRE(trained.exit_code == 0);
  const nlohmann::json last = read_json(dir / "r.json")["epochs"].back();

  for (std::string sync : {"scatter", "allreduce"}) {
    CAPTURE(sync);
    CommandResult r =
        run_command(base + " --sync " + sync + " --eval --load " + ck + " --report " + dir / ("e-" + sync + ".json"));
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::smatch m;
    REQUIRE(
        std::regex_search(r.output, m, std::regex(R"(test acc (\S+)  test loss (\S+)  \((\d+) images, lenet, from )")));
    char want[32];
    std::snprintf(want, sizeof want, "%.4f", last["test_accuracy"].get<double>());
    CHECK(m[1].str() == want);
    CHECK(m[3].str() == "100");
    CHECK(r.output.find("from " + ck + ")") != std::string::npos);
    CHECK(r.output.find("epoch ") == std::string::npos);  // nothing trained
    const nlohmann::json e = read_json(dir / ("e-" + sync + ".json"));
    CHECK(e["kind"] == "evaluation");
    CHECK(e["checkpoint"] == ck);
    CHECK(e["images"] == 100);
    CHECK(e["test_accuracy"] == last["test_accuracy"]);  // the same weights, devices and batches
    CHECK(e["test_loss"].get<double>() == doctest::Approx(last["test_loss"].get<double>()).epsilon(1e-6));
    CHECK(e["devices"].size() == 2);
    CHECK(e["config"]["strategy"] == sync);
  }
}

TEST_CASE("eval: --eval without --load, or with the options of a training run, exits 2 naming them") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string ck = dir / "ck.st";
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 ";
  REQUIRE(run_command(base + "--steps 1 --quiet --save " + ck).exit_code == 0);
  const std::vector<Refusal> cases = {
      {"--eval", "give --load FILE"},
      {"--eval --load " + ck + " --save " + dir / "x.st", "--eval: --save only makes sense for training"},
      {"--eval --load " + ck + " --save-every 2", "--save-every"},
      {"--eval --load " + ck + " --resume " + ck, "--resume"},
      {"--eval --load " + ck + " --verify", "--verify"},
      {"--eval --load " + ck + " --steps 3", "--steps"},
      {"--eval --load " + ck + " --epochs 10", "--epochs"},
      {"--eval --load " + ck + " --log " + dir / "l.jsonl", "--log"},
      {"--eval --load " + ck + " --steps 3 --log " + dir / "l.jsonl", "--steps, --log only make sense"},
      {"--eval --load " + ck + " --no-prefetch", "--eval: --no-prefetch only makes sense for training"},
      // the optimizer, its schedule and the training set's order and size: nothing --eval uses
      {"--eval --load " + ck + " --lr 0.5 --optimizer adam", "--eval: --optimizer, --lr only make sense for training"},
      {"--eval --load " + ck + " --accumulate 2", "--accumulate"},
      {"--eval --load " + ck + " --lr-schedule cosine --warmup 2", "--lr-schedule, --warmup"},
      {"--eval --load " + ck + " --clip-grad-norm 1", "--clip-grad-norm"},
      {"--eval --load " + ck + " --seed 3 --no-shuffle", "--seed, --no-shuffle only make sense"},
      {"--eval --load " + ck + " --devices 2 --sync allreduce --bucket-kb 64", "--bucket-kb only makes sense"},
      {"--eval --load " + dir / "missing.st", "missing.st"},
      {"--eval --load " + ck + " --model lenet5", "lenet5"},
  };
  check_refusals(base, cases, "test acc");
}

// Weights every one of which is finite, whose logits are not: --eval ends as training would, exit 3.
TEST_CASE("eval: finite weights whose test loss overflows exit 3 naming the checkpoint") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --devices 2";
  const std::string ck = dir / "ck.st", huge = dir / "huge.st";
  REQUIRE(run_command(base + " --steps 1 --quiet --save " + ck).exit_code == 0);
  const dp::ModelSpec spec = dp::make_model("lenet");
  dp::Checkpoint c = dp::load_checkpoint(ck, spec);
  const dp::Param& fc1 =
      *std::find_if(spec.params.begin(), spec.params.end(), [](const dp::Param& p) { return p.name == "fc1.weight"; });
  std::fill(c.params.begin() + fc1.offset, c.params.begin() + fc1.offset + fc1.size, 3e38f);
  dp::save_checkpoint(huge, spec, c);
  CommandResult r = run_command(base + " --eval --load " + huge);
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(r.output.find("--eval: the test loss of " + huge + " is not finite") != std::string::npos);
  CHECK(run_command(base + " --eval --load " + ck).exit_code == 0);
}
