// --sync allreduce --allreduce naive: d2l's hand-written all-reduce (every replica's gradients summed
// into device 0's, the sum copied back) as the engine's gradient reduction. Training equals one device
// on the full batch within the summation-order bound, every replica holds the same bits after every
// step, the bytes per step are the naive model's; dp_train takes the flag, refuses it where it means
// nothing, and names the algorithm in its report and its table.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/engine.h"
#include "engine/error.h"
#include "tests/backends.h"
#include "tests/util.h"
#include "train/trainer.h"

using namespace dp;
using dp::test::Batches;
using dp::test::make_batches;
using dp::test::max_diff;
using dp::test::raw;

TEST_CASE("naive all-reduce training equals one device and keeps every replica bitwise equal") {
  const int K = 3;
  const float lr = 0.1f, momentum = 0.9f;
  for (std::string model : {"lenet", "lenet5"}) {
    ModelSpec spec = make_model(model);
    std::vector<float> init(size_t(spec.param_count));
    init_params(spec, 42, init.data());
    for (int B : {24, 25}) {  // 25: uneven shards
      Batches data = make_batches(K, B, 100);
      auto ref_devs = dp::test::make_test_devices("cpu", 1);
      EngineConfig rc;
      rc.batch = B, rc.lr = lr, rc.momentum = momentum, rc.weight_decay = 5e-4f, rc.sync = "allreduce";
      Engine ref(raw(ref_devs), spec, rc);
      ref.set_params(init);
      for (int s = 0; s < K; ++s) ref.step(data.x[s].data(), data.y[s].data(), B);
      const std::vector<float> want = ref.params();
      // The bound the other strategies are held to (test_engine.cpp): only the order of the sums differs.
      const double tol = summation_tolerance(K, B, lr, momentum);
      for (int n : {2, 3})
        for (int64_t bucket_kb : {int64_t(0), int64_t(16)}) {
          CAPTURE(model);
          CAPTURE(B);
          CAPTURE(n);
          CAPTURE(bucket_kb);
          auto devs = dp::test::make_test_devices("cpu", n);
          EngineConfig c = rc;
          c.all_reduce = AllReduceAlgorithm::naive, c.bucket_kb = bucket_kb;
          Engine e(raw(devs), spec, c);
          CHECK(e.comm().all_reduce_algorithm() == AllReduceAlgorithm::naive);
          e.set_params(init);
          if (bucket_kb > 0) CHECK(e.buckets().size() > 1);
          for (int s = 0; s < K; ++s) {
            e.step(data.x[s].data(), data.y[s].data(), B);
            auto p0 = e.params(0);
            for (int r = 1; r < n; ++r) REQUIRE(e.params(r) == p0);  // bitwise, every step
          }
          double d = max_diff(e.params(), want);
          CHECK(d <= tol);
          CHECK(d < 1e-3);  // and far from a different trajectory
          // The naive model, not the ring's: device 0 receives every peer's gradients and sends each
          // the sum, (n-1)·P·4 bytes each way; every other device P·4 each way (buckets add up to P).
          const int64_t P = spec.param_count;
          CHECK(e.recorder().step_traffic(0).sent == (n - 1) * P * 4);
          CHECK(e.recorder().step_traffic(0).received == (n - 1) * P * 4);
          for (int r = 1; r < n; ++r) {
            CHECK(e.recorder().step_traffic(r).sent == P * 4);
            CHECK(e.recorder().step_traffic(r).received == P * 4);
          }
          CHECK(e.comm().traffic(0, Collective::reduce).received == 0);  // counted as the all_reduce it is
        }
    }
  }
}

TEST_CASE("naive all-reduce: device 0 holds the (n-1) gradient buffers it sums, the others no comm buffer") {
  ModelSpec spec = make_model("lenet5");
  Batches data = make_batches(1, 12, 4);
  auto devs = dp::test::make_test_devices("cpu", 3);
  EngineConfig c;
  c.batch = 12, c.sync = "allreduce", c.all_reduce = AllReduceAlgorithm::naive;
  Engine e(raw(devs), spec, c);
  e.step(data.x[0].data(), data.y[0].data(), 12);
  CHECK(devs[0]->ledger().snapshot().peak[int(Category::comm)] == 2 * spec.param_count * 4);
  for (int r = 1; r < 3; ++r) CHECK(devs[r]->ledger().snapshot().peak[int(Category::comm)] == 0);
}

TEST_CASE("dp_train --allreduce: bogus values and --sync scatter exit 2 and say why") {
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string base =
      std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir.path.string() + " --quiet --steps 1 ";
  struct Case {
    std::string args, words;
  };
  std::vector<Case> cases = {
      {"--sync allreduce --allreduce bogus", "--allreduce: 'bogus' is not an all-reduce algorithm; use ring"},
      {"--allreduce naive", "--allreduce: applies to --sync allreduce only"},
      {"--sync scatter --allreduce ring", "--allreduce: applies to --sync allreduce only"},
  };
  for (auto& c : cases) {
    CAPTURE(c.args);
    dp::test::CommandResult r = dp::test::run_command(base + c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
  }
}

TEST_CASE("dp_train --allreduce naive trains and names the algorithm in the report and the table") {
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 256, 64);
  const std::string base =
      std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir.path.string() + " --batch 32 --steps 4 ";
  for (std::string algo : {"naive", "ring"}) {
    CAPTURE(algo);
    const std::string report = dir / (algo + ".json");
    dp::test::CommandResult r =
        dp::test::run_command(base + "--devices 3 --sync allreduce --allreduce " + algo + " --report " + report);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("(allreduce, " + algo + ": ") != std::string::npos);  // the skew line under the table
    nlohmann::json rep = dp::test::read_json(report);
    CHECK(rep["strategy"] == "allreduce");
    CHECK(rep["allreduce"] == algo);
    CHECK(rep["config"]["allreduce"] == algo);
    const int64_t P = rep["config"]["parameters"];
    const int64_t dev0 = rep["devices"][0]["bytes_received_per_step"];
    if (algo == "naive")
      CHECK(dev0 == 2 * P * 4);
    else
      CHECK(dev0 < 2 * P * 4);  // the ring's 2(n-1)/n P floats
  }
  // Without --allreduce the ring is the default; under scatter there is no all-reduce to name.
  const std::string report = dir / "scatter.json";
  dp::test::CommandResult r = dp::test::run_command(base + "--devices 2 --report " + report);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(dp::test::read_json(report)["allreduce"].is_null());
}
