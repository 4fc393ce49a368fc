// Gradient accumulation (--accumulate, EngineConfig::accumulate): an optimizer step of N micro-batches
// equals one step on all their images at once, in every strategy; the gradients are communicated once
// per step (scatter: every micro-batch, as nn.DataParallel); BatchNorm's running statistics move per
// micro-batch.
#include <doctest/doctest.h>

#include <fstream>

#include "engine/engine.h"
#include "engine/error.h"
#include "tests/backends.h"
#include "tests/util.h"
#include "train/verify.h"

using namespace dp;
using dp::test::all_strategies;
using dp::test::Batches;
using dp::test::make_batches;
using dp::test::max_diff;
using dp::test::raw;
using dp::test::takes_buckets;

namespace {

// K optimizer steps of `rows` images each (micro-batches of `micro`, the last what is left) on n
// devices; the parameters after them.
std::vector<float> accumulated(const ModelSpec& spec, const EngineConfig& c, int n, const Batches& data, int rows,
                               const std::vector<float>& init, std::vector<StepResult>* results = nullptr) {
  auto devs = dp::test::make_test_devices("cpu", n);
  Engine e(raw(devs), spec, c);
  e.set_params(init);
  for (size_t s = 0; s < data.x.size(); ++s) {
    StepResult r = e.step(data.x[s].data(), data.y[s].data(), rows);
    if (results) results->push_back(r);
    if (c.sync != "scatter")
      for (int q = 1; q < n; ++q) REQUIRE(e.params(q) == e.params(0));  // bitwise, every step
  }
  return e.params();
}

}  // namespace

TEST_CASE("--accumulate: every strategy equals one device on the step's images at once, within summation order") {
  const int K = 2, micro = 8, N = 3;
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 7, init.data());
  EngineConfig rc;
  rc.lr = 0.1f, rc.momentum = 0.9f, rc.sync = "allreduce";
  // 24: three full micro-batches; 19: 8 + 8 + 3, the last uneven over the devices
  for (int rows : {micro * N, 19}) {
    Batches data = make_batches(K, rows, 300);
    EngineConfig one = rc;
    one.batch = rows;
    std::vector<StepResult> want_r;
    const std::vector<float> want = accumulated(spec, one, 1, data, rows, init, &want_r);
    const double tol = summation_tolerance(K, rows, rc.lr, rc.momentum);
    for (int n : {1, 2, 3})
      for (const std::string& sync : all_strategies())
        for (int64_t bucket_kb : {int64_t(0), int64_t(8)}) {
          if ((!takes_buckets(sync) || n == 1) && bucket_kb > 0) continue;
          CAPTURE(rows);
          CAPTURE(n);
          CAPTURE(sync);
          CAPTURE(bucket_kb);
          EngineConfig c = rc;
          c.sync = sync, c.batch = micro, c.accumulate = N, c.bucket_kb = bucket_kb;
          c.split = n == 3 ? Split::chunk : Split::even;
          std::vector<StepResult> got_r;
          const double d = max_diff(accumulated(spec, c, n, data, rows, init, &got_r), want);
          CHECK(d <= tol);
          for (int s = 0; s < K; ++s) {
            CHECK(got_r[size_t(s)].micro_batches == (rows + micro - 1) / micro);
            CHECK(got_r[size_t(s)].n == rows);
            CHECK(got_r[size_t(s)].correct == want_r[size_t(s)].correct);
            CHECK(got_r[size_t(s)].loss == doctest::Approx(want_r[size_t(s)].loss).epsilon(1e-5));
          }
        }
  }
}

TEST_CASE("--accumulate: a step is not its last micro-batch's alone, nor a step per micro-batch") {
  // What a wrong accumulation would give: each is far outside the bound the test above holds to.
  const int micro = 8, N = 3, rows = micro * N;
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 7, init.data());
  Batches data = make_batches(1, rows, 300);
  EngineConfig c;
  c.lr = 0.1f, c.momentum = 0.9f, c.sync = "allreduce", c.batch = micro, c.accumulate = N;
  const std::vector<float> got = accumulated(spec, c, 2, data, rows, init);
  EngineConfig plain = c;
  plain.accumulate = 1;
  auto devs = dp::test::make_test_devices("cpu", 2);
  Engine e(raw(devs), spec, plain);
  e.set_params(init);
  const size_t D = 784;
  for (int k = 0; k < N; ++k) e.step(data.x[0].data() + k * micro * D, data.y[0].data() + k * micro, micro);
  const double tol = summation_tolerance(1, rows, c.lr, c.momentum);
  CHECK(max_diff(e.params(), got) > 100 * tol);  // three steps of 8
  e.set_params(init);
  e.step(data.x[0].data() + (N - 1) * micro * D, data.y[0].data() + (N - 1) * micro, micro);
  CHECK(max_diff(e.params(), got) > 100 * tol);  // the last micro-batch alone
}

TEST_CASE("--accumulate: bytes per step are the byte model's, the gradients travel once, scatter's every micro-batch") {
  const ModelSpec spec = make_model("lenet-bn");
  const int micro = 12, N = 3, n = 3;
  Batches data = make_batches(1, micro * N, 5);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 0, init.data());
  for (const std::string& sync : all_strategies())
    for (bool sync_bn : {false, true}) {
      CAPTURE(sync);
      CAPTURE(sync_bn);
      std::vector<int64_t> sent;  // device 1's, accumulating and not
      for (int accumulate : {1, N}) {
        auto devs = dp::test::make_test_devices("cpu", n);
        EngineConfig c;
        c.batch = micro, c.sync = sync, c.accumulate = accumulate, c.sync_bn = sync_bn;
        Engine e(raw(devs), spec, c);
        e.set_params(init);
        e.step(data.x[0].data(), data.y[0].data(), micro * accumulate);
        StepShape shape{spec, split_batch(micro, n, Split::even), e.buckets(), sync_bn};
        shape.micro_batches = accumulate;
        const std::vector<Traffic> model = total_traffic(e.strategy().step_collectives(shape), n);
        for (int r = 0; r < n; ++r) {
          CHECK(e.recorder().step_traffic(r).sent == model[size_t(r)].sent);
          CHECK(e.recorder().step_traffic(r).received == model[size_t(r)].received);
        }
        sent.push_back(e.recorder().step_traffic(1).sent);
      }
      // What device 1 sends more over three micro-batches than over one: scatter all of it again
      // twice; the others BatchNorm's collectives alone (zero3 also its weights' gathers), never the gradients.
      const int64_t more = sent[1] - sent[0];
      if (sync == "scatter")
        CHECK(more == 2 * sent[0]);
      else if (sync == "zero3")
        CHECK(more > 0);
      else if (sync_bn)
        CHECK((more > 0 && more < sent[0] / 10));
      else
        CHECK(more == 0);  // the running statistics' broadcast: device 1 only receives
    }
}

TEST_CASE("--accumulate: BatchNorm's running statistics move every micro-batch, as a step's each would") {
  const ModelSpec spec = make_model("lenet-bn");
  const int micro = 8, N = 3;
  Batches data = make_batches(1, micro * N, 9);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 1, init.data());
  auto devs = dp::test::make_test_devices("cpu", 1);
  EngineConfig c;
  c.batch = micro, c.sync = "allreduce", c.accumulate = N, c.momentum = 0.0f;
  Engine e(raw(devs), spec, c);
  e.set_params(init);
  e.step(data.x[0].data(), data.y[0].data(), micro * N);
  CHECK(e.batches_tracked() == N);
  CHECK(e.params() != init);
  // The same forwards as plain steps of one micro-batch each, every one from the initial weights (as
  // the micro-batches of a step all are): the running statistics move alike.
  auto ref_devs = dp::test::make_test_devices("cpu", 1);
  EngineConfig rc = c;
  rc.accumulate = 1;
  Engine ref(raw(ref_devs), spec, rc);
  const size_t D = 784;
  for (int k = 0; k < N; ++k) {
    ref.set_params(init);
    ref.step(data.x[0].data() + k * micro * D, data.y[0].data() + k * micro, micro);
  }
  CHECK(ref.batches_tracked() == N);
  CHECK(ref.running_stats() == e.running_stats());  // bitwise: the same forwards in the same order
}

TEST_CASE("--accumulate: 0 or negative is refused naming the flag, and so is a step past batch x accumulate") {
  const ModelSpec spec = make_model("lenet5");
  auto devs = dp::test::make_test_devices("cpu", 2);
  for (int bad : {0, -2}) {
    EngineConfig c;
    c.batch = 8, c.accumulate = bad;
    CHECK_THROWS_WITH_AS(Engine(raw(devs), spec, c), doctest::Contains("--accumulate"), UsageError);
  }
  EngineConfig c;
  c.batch = 8, c.accumulate = 2;
  Engine e(raw(devs), spec, c);
  Batches data = make_batches(1, 17, 1);
  CHECK_THROWS_WITH_AS(e.step(data.x[0].data(), data.y[0].data(), 17), doctest::Contains("1..16 (2 micro-batches)"),
                       UsageError);
}

TEST_CASE("--accumulate with prefetch: the first micro-batch uploaded ahead, the others at their turn, the same bits") {
  const ModelSpec spec = make_model("lenet5");
  const int micro = 6, N = 3, K = 3;
  Batches data = make_batches(K, micro * N, 21);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 2, init.data());
  std::vector<std::vector<float>> got;
  for (bool prefetch : {false, true}) {
    auto devs = dp::test::make_test_devices("cpu", 2);
    EngineConfig c;
    c.batch = micro, c.accumulate = N, c.sync = "zero2", c.prefetch = prefetch;
    Engine e(raw(devs), spec, c);
    e.set_params(init);
    int staged = 0;
    for (int s = 0; s < K; ++s) {  // with prefetch the next step's batch staged before this one trains
      for (; staged <= s + (prefetch ? 1 : 0) && staged < K; ++staged)
        e.stage(data.x[size_t(staged)].data(), data.y[size_t(staged)].data(), micro * N);
      e.step();
    }
    got.push_back(e.params());
  }
  CHECK(got[0] == got[1]);
  CHECK(got[0] != init);
}

namespace dp::test {

TEST_CASE(
    "dp_train --accumulate: steps, the log and the report count optimizer steps, and give images and micro-batches") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);  // steps of 3 x 16 = 48: 48, 48, then 32 as 16 + 16
  const std::string train =
      std::string(DP_TRAIN_BIN) + " --backend cpu --devices 2 --data " + dir.path.string() + " --quiet ";
  const std::string report = dir / "r.json", log = dir / "l.jsonl";
  CommandResult r = run_command(train + "--batch 16 --accumulate 3 --steps 3 --sync zero1 --log-every 1 --log " + log +
                                " --report " + report);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = read_json(report);
  CHECK(j["config"]["steps"] == 3);
  CHECK(j["config"]["accumulate"] == 3);
  CHECK(j["config"]["step_images"] == 48);
  CHECK(j["accumulation"].get<std::string>().find("zero1 reduce-scatters its gradients once a step") !=
        std::string::npos);
  std::ifstream in(log);
  std::vector<std::pair<int64_t, int64_t>> records;  // images, micro-batches
  for (std::string line; std::getline(in, line);)
    if (auto rec = nlohmann::json::parse(line); rec["kind"] == "step")
      records.emplace_back(rec["images"].get<int64_t>(), rec["micro_batches"].get<int64_t>());
  CHECK(records == std::vector<std::pair<int64_t, int64_t>>{{48, 3}, {48, 3}, {32, 2}});
  check_refusals(train + "--steps 2 ",
                 {
                     {"--accumulate 0", "--accumulate: 0 is not a number of micro-batches; give at least 1"},
                     {"--accumulate -2", "--accumulate: -2 is not a number of micro-batches"},
                     {"--accumulate 2 --batch 1", "micro-batches of --batch 1 leave some of the 2 devices without"},
                     {"--accumulate x", "--accumulate"},
                 },
                 "epoch 1/");
}

}  // namespace dp::test
