// --width K: every conv's channels and hidden layer's width times K, the names and the classifier
// unchanged; a checkpoint says its width and is refused at another.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "engine/error.h"
#include "models/model.h"
#include "tests/util.h"

using namespace dp;
using namespace dp::test;

TEST_CASE("--width multiplies the channels and hidden widths: the parameter counts in closed form") {
  // lenet: conv1 (20K, 1, 3, 3), conv2 (50K, 20K, 5, 5), fc1 (128K, 50K·16), fc2 (10, 128K), with biases.
  for (int K : {1, 2, 3}) {
    CAPTURE(K);
    const ModelSpec m = make_model("lenet", K);
    const int64_t k = K;
    CHECK(m.param_count ==
          20 * k * 9 + 20 * k + 50 * k * 20 * k * 25 + 50 * k + 128 * k * 800 * k + 128 * k + 10 * 128 * k + 10);
    CHECK(m.width == K);
    CHECK(m.layers.back().out_c == 10);  // the classifier keeps its outputs
    CHECK(m.find("conv2.weight") != nullptr);
    CHECK(m.title() == (K == 1 ? std::string("lenet") : "lenet at --width " + std::to_string(K)));
  }
  // lenet5: conv1 (6K, 1, 5, 5), conv2 (16K, 6K, 5, 5), fc1 (120K, 16K·25), fc2 (84K, 120K), fc3 (10, 84K).
  const int64_t k = 2;
  CHECK(make_model("lenet5", 2).param_count == 6 * k * 25 + 6 * k + 16 * k * 6 * k * 25 + 16 * k + 120 * k * 400 * k +
                                                   120 * k + 84 * k * 120 * k + 84 * k + 10 * 84 * k + 10);
  // lenet-bn: BatchNorm's channels and running statistics widen with the layers they follow.
  const ModelSpec bn = make_model("lenet-bn", 2);
  CHECK(bn.buffer_count == 2 * (40 + 100 + 256));
  CHECK_THROWS_AS(make_model("lenet", 0), UsageError);
  CHECK_THROWS_AS(make_model("lenet", kMaxWidth + 1), UsageError);
}

TEST_CASE("--width: a checkpoint keeps its width, trains on at it, and is refused at another") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string train = std::string(DP_TRAIN_BIN) + " --backend cpu --quiet --data " + dir.path.string();
  CommandResult r = run_command(train + " --width 2 --steps 2 --batch 16 --save " + dir / "w2.st");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(read_safetensors(dir / "w2.st").metadata.at("width") == "2");
  r = run_command(train + " --width 2 --steps 3 --batch 16 --resume " + dir / "w2.st");
  CHECK(r.exit_code == 0);
  r = run_command(train + " --eval --load " + dir / "w2.st");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("this checkpoint is lenet at --width 2, you asked for --width 1 (use --width 2)") !=
        std::string::npos);
}

// The check before any device starts counts less than a device holds (tests/test_cli.cpp has its
// refusal): a run whose devices peaked at P bytes runs again under --device-memory P.
TEST_CASE("--device-memory: a run is not refused by the check before it under the cap its own peak fits") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 32);
  // 128 images a device: the activations outweigh the parameters, where a count of them shows
  const std::string train = std::string(DP_TRAIN_BIN) + " --backend cpu --quiet --data " + dir.path.string() +
                            " --steps 1 --batch 256 --devices 2";
  for (const std::string sync : {"scatter", "zero3"}) {
    CAPTURE(sync);
    CommandResult r = run_command(train + " --sync " + sync + " --report " + dir / "r.json");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const nlohmann::json report = read_json(dir / "r.json");
    int64_t peak = 0;
    for (const auto& d : report["devices"]) peak = std::max(peak, d["peak_bytes"].get<int64_t>());
    r = run_command(train + " --sync " + sync + " --device-memory " + std::to_string(peak));
    INFO(r.output);
    CHECK(r.exit_code == 0);
  }
}
