// --clip-grad-norm (EngineConfig::clip_grad_norm), PyTorch's clip_grad_norm_: the whole averaged
// gradient is scaled by min(1, max_norm / (||g|| + 1e-6)) before the optimizer, under every strategy,
// where the sharded ones hold only their share of it (the norm is then summed across the devices).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "kernels/math.h"
#include "tests/backends.h"
#include "tests/util.h"

namespace dp::test {
namespace {

// One SGD step (no momentum, no decay: w1 = w0 - lr g) from the same weights and batch.
std::vector<float> one_step(const std::string& sync, int64_t bucket_kb, const std::vector<float>& init,
                            const Batches& data, int n, float clip) {
  EngineConfig c;
  c.sync = sync, c.bucket_kb = bucket_kb, c.batch = 13, c.lr = 0.1f, c.momentum = 0.0f;
  c.clip_grad_norm = clip;
  auto devs = make_test_devices("cpu", 3);
  Engine e(raw(devs), make_model("lenet"), c);
  e.set_params(init);
  e.step(data.x[0].data(), data.y[0].data(), n);
  return e.params();
}

TEST_CASE("clip: the update is the unclipped one times PyTorch's coefficient of the whole gradient's norm") {
  // 13 images over 3 devices (5, 4, 4): every shard of the sharded strategies holds a different
  // part of the gradient, so a norm of one shard alone would give each device another coefficient.
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 11, init.data());
  const Batches data = make_batches(1, 13, 5);
  for_each_strategy([&](const std::string& sync, int64_t bucket_kb) {
    const std::vector<float> plain = one_step(sync, bucket_kb, init, data, 13, 0.0f);
    double sum = 0;
    std::vector<double> g(init.size());
    for (size_t i = 0; i < init.size(); ++i) {
      g[i] = (double(init[i]) - double(plain[i])) / 0.1;  // the averaged gradient, to float rounding
      sum += g[i] * g[i];
    }
    const double norm = std::sqrt(sum);
    REQUIRE(norm > 0);
    // Clipped to a quarter of its norm: every element a quarter (PyTorch's 1e-6 aside).
    const float max_norm = float(norm / 4);
    const std::vector<float> clipped = one_step(sync, bucket_kb, init, data, 13, max_norm);
    const double coef = double(max_norm) / (norm + 1e-6);
    size_t bad = 0;
    double worst = 0;
    for (size_t i = 0; i < init.size(); ++i) {
      const double want = double(init[i]) - 0.1 * coef * g[i];
      // rounding: the weights' (w0, w1 and the difference above: a few ulps of |w0|) and the norm's
      const double tol = 4 * 6e-8 * std::fabs(double(init[i])) + 1e-5 * 0.1 * std::fabs(coef * g[i]);
      const double err = std::fabs(double(clipped[i]) - want);
      worst = std::max(worst, err - tol);
      bad += err > tol;
    }
    INFO("norm " << norm << ", coefficient " << coef << ", worst excess " << worst);
    CHECK(bad == 0);
    // A norm within the limit leaves the step as it was, to the bit.
    CHECK(one_step(sync, bucket_kb, init, data, 13, float(norm * 2)) == plain);
  });
}

TEST_CASE("clip: --clip-grad-norm trains, goes in the report, and refuses a norm that is not positive") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);
  const std::string train =
      std::string(DP_TRAIN_BIN) + " --backend cpu --devices 2 --data " + dir.path.string() + " --batch 32 --quiet ";
  const std::string report = dir / "r.json";
  CommandResult r = run_command(train + "--steps 3 --sync zero2 --clip-grad-norm 0.5 --report " + report);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(read_json(report)["config"]["clip_grad_norm"].get<double>() == doctest::Approx(0.5));
  check_refusals(train + "--steps 2 ",
                 {
                     {"--clip-grad-norm 0", "--clip-grad-norm: 0 is not a positive finite norm"},
                     {"--clip-grad-norm -1", "--clip-grad-norm: -1 is not a positive finite norm"},
                     {"--clip-grad-norm nan", "--clip-grad-norm"},
                     {"--clip-grad-norm inf", "--clip-grad-norm"},
                 },
                 "epoch 1/");
}

}  // namespace
}  // namespace dp::test
