// The sharded strategies (Strategy::zero_stage): what the engine gathers from and splits into the
// shards. Their training against one device, their bytes and their ledger are in the loops over
// every strategy (test_engine.cpp, test_bench.cpp), their resume in test_resume.cpp, across processes
// in test_mpi.cpp.
#include <doctest/doctest.h>

#include <memory>

#include "engine/engine.h"
#include "tests/backends.h"
#include "tests/util.h"

using namespace dp;
using dp::test::Batches;
using dp::test::make_batches;
using dp::test::max_diff;
using dp::test::raw;

TEST_CASE("a sharded optimizer state gathers whole and splits back, on any device count") {
  const int B = 25;
  ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 44, init.data());
  Batches data = make_batches(3, B, 102);
  EngineConfig c;
  c.batch = B, c.optimizer = Optimizer::adam, c.lr = 1e-3f;
  auto engine = [&](const std::string& sync, std::vector<std::unique_ptr<Device>>& devs) {
    c.sync = sync;
    auto e = std::make_unique<Engine>(raw(devs), spec, c);
    e->set_params(init);
    return e;
  };
  // Two steps under allreduce on 3 devices and under zero1 on 3: the moments gathered from zero1's
  // shards are allreduce's up to the order of the gradient sums (a chunk in the wrong place is off by
  // the moments themselves, about 1e-3 and 1e-6).
  auto ar_devs = dp::test::make_test_devices("cpu", 3), z_devs = dp::test::make_test_devices("cpu", 3);
  auto ar = engine("allreduce", ar_devs), z = engine("zero1", z_devs);
  for (int s = 0; s < 2; ++s) {
    ar->step(data.x[s].data(), data.y[s].data(), B);
    z->step(data.x[s].data(), data.y[s].data(), B);
  }
  const auto want = ar->optimizer_state(), got = z->optimizer_state();
  REQUIRE(got.size() == 2);
  CHECK(max_diff(got[0], want[0]) < 1e-6);
  CHECK(max_diff(got[1], want[1]) < 1e-9);
  CHECK(max_diff(got[0], std::vector<float>(want[0].size())) > 1e-4);  // and the moments are not zero
  // Split onto 2, 3 and 4 devices (padded differently), one unit (zero1) or one a layer (zero2), and
  // gathered back: the same bits.
  for (const std::string sync : {"zero1", "zero2", "zero3"})
    for (int n : {2, 3, 4}) {
      CAPTURE(sync);
      CAPTURE(n);
      auto devs = dp::test::make_test_devices("cpu", n);
      auto e = engine(sync, devs);
      e->set_optimizer_state(want);
      CHECK(e->optimizer_state() == want);
      // Trained on from there, as allreduce is: the third step within the summation-order bound.
      e->set_params(ar->params());
      e->set_optimizer_steps(2);
      e->step(data.x[2].data(), data.y[2].data(), B);
      if (n == 3) {
        auto ar3 = engine("allreduce", ar_devs);
        ar3->set_params(ar->params());
        ar3->set_optimizer_state(want);
        ar3->set_optimizer_steps(2);
        ar3->step(data.x[2].data(), data.y[2].data(), B);
        CHECK(max_diff(e->params(), ar3->params()) < 1e-5);
        CHECK(max_diff(e->optimizer_state()[0], ar3->optimizer_state()[0]) < 1e-6);
      }
    }
}
