// Run-ahead (Engine::start_step / finish_step; dp_train --run-ahead): a step started before the one
// before it is finished trains bit-identical to step() under every strategy, SGD and AdamW, with and
// without --graphs, and with its phases timed each step's spans are its own; what reads or sets the
// model refuses a step in flight; a failed step forgets the steps in flight. dp_train with --run-ahead
// writes the checkpoint it writes without (with --log and --trace too), stops on a signal after the
// same step, and names the same non-finite step. On simulated devices a step is done when
// start_step returns, so these check the engine's and the trainer's side of it; on a GPU (the cuda:
// case) the steps overlap for real.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "tests/backends.h"
#include "tests/failpoint/failpoints.h"
#include "tests/pinned_batches.h"
#include "tests/util.h"
#include "train/checkpoint.h"
#include "train/loader.h"

using namespace dp;
using dp::test::Batches;
using dp::test::CommandResult;
using dp::test::for_each_strategy;
using dp::test::kTrainCpu;
using dp::test::make_batches;
using dp::test::raw;
using dp::test::run_command;
using dp::test::TempDir;
namespace {

struct Trained {
  std::vector<StepResult> steps;
  StepResult eval;
  std::vector<float> params;
  std::vector<std::vector<float>> state;
  int64_t optimizer_steps = 0;
  std::vector<std::vector<Span>> spans;  // per device, with `traced`
};

// Nine steps of batch 12 (a short one, 7, among them) on n devices, prefetched as dp_train stages them,
// the learning rate changed before every step (a schedule's), then an evaluation. Without `ahead` the
// phases are timed (dp_train with --log), and with `traced` they are kept as spans, ahead or not; with
// `ahead`, as dp_train --run-ahead: stage s+1, start s, finish s-1, every step held 3 ms on the device before
// its stats are copied out, so that on a GPU the next one is enqueued while it runs, and a finish that
// did not wait reads the NaN the slot holds until the copy lands. The batches are in page-locked
// buffers as the loader's, and a finished step's is filled with NaN at once, as the loader reuses it:
// a step that read its batch after its finish_step shows it. Adam's bias correction counts the started
// steps, so a step started before the one before it finished that took the count of the finished ones
// would train otherwise.
Trained train(const std::string& kind, int n, const std::string& sync, int64_t bucket_kb, Optimizer optimizer,
              bool graphs, bool ahead, bool traced = false) {
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 11, init.data());
  const std::vector<int> sizes{12, 12, 12, 7, 12, 12, 12, 12, 12};
  const int K = int(sizes.size()), B = 12;
  const Batches data = make_batches(K, B, 31), test = make_batches(1, 16, 32);
  EngineConfig c;
  c.batch = B, c.sync = sync, c.bucket_kb = bucket_kb, c.prefetch = true, c.graphs = graphs;
  c.time_phases = traced || !ahead, c.trace = traced;
  c.optimizer = optimizer;
  if (optimizer != Optimizer::sgd) c.lr = 1e-3f, c.weight_decay = 0.01f;
  auto devs = dp::test::make_test_devices(kind, n);
  std::optional<dp::failpoint::SlowSteps> slow;
  if (ahead) slow.emplace(raw(devs), std::chrono::milliseconds(3));
  Engine e(raw(devs), spec, c);
  e.set_params(init);
  // Four host buffers: a step in flight, the step started, the batch staged, and the loader's next.
  dp::test::PinnedBatches host(e, 4, B);
  auto stage = [&](int s) { host.stage(e, data, s, sizes[size_t(s)]); };
  Trained t;
  int finished = 0;
  auto finish = [&] {
    t.steps.push_back(e.finish_step());
    host.spoil(finished++);
  };
  stage(0);
  for (int s = 0; s < K; ++s) {
    if (s + 1 < K) stage(s + 1);
    e.set_lr(c.lr * float(K - s) / float(K));
    e.start_step();
    CHECK(e.in_flight() == (ahead && s > 0 ? 2 : 1));
    while (e.in_flight() > (ahead ? 1 : 0)) finish();
  }
  while (e.in_flight() > 0) finish();
  t.eval = e.evaluate(test.x[0].data(), test.y[0].data(), 16);
  t.params = e.params();
  t.state = e.optimizer_state();
  t.optimizer_steps = e.optimizer_steps();
  t.spans = e.recorder().spans();
  CHECK(e.steps_started_ahead() == (ahead ? K - 1 : 0));
  e.drop_staged();  // before the buffers are unlocked
  return t;
}

void check_same(const Trained& want, const Trained& got) {
  REQUIRE(got.steps.size() == want.steps.size());
  for (size_t s = 0; s < want.steps.size(); ++s) {
    CAPTURE(s);
    CHECK(std::isfinite(got.steps[s].loss));
    CHECK(got.steps[s].loss == want.steps[s].loss);  // bitwise: the same kernels on the same bytes
    CHECK(got.steps[s].correct == want.steps[s].correct);
    CHECK(got.steps[s].n == want.steps[s].n);
    CHECK(got.steps[s].finite_gradients);
  }
  CHECK(got.eval.loss == want.eval.loss);
  CHECK(got.params == want.params);
  CHECK(got.state == want.state);
  CHECK(got.optimizer_steps == want.optimizer_steps);
}

void check_run_ahead_trains_as_step(const std::string& kind) {
  for (Optimizer optimizer : {Optimizer::sgd, Optimizer::adamw}) {
    CAPTURE(optimizer_name(optimizer));
    for (int n : {1, 2}) {
      CAPTURE(n);
      for_each_strategy([&](const std::string& sync, int64_t bucket_kb) {
        check_same(train(kind, n, sync, bucket_kb, optimizer, false, false),
                   train(kind, n, sync, bucket_kb, optimizer, false, true));
      });
    }
    // Step graphs (one device): a step launched while the one before runs.
    for (const std::string sync : {"scatter", "allreduce", "zero1"}) {
      CAPTURE(sync);
      check_same(train(kind, 1, sync, 0, optimizer, false, false), train(kind, 1, sync, 0, optimizer, true, true));
    }
  }
}

// With the phases timed and traced (dp_train --log, --trace), a step in flight marks into a set of its
// own while the one before it is still to be read: each step's spans are its own phases, the eager
// run's in kind and order, and on each device every span of step s ends before step s+1's first
// begins (a step run ahead that marked into the set of the step before would give that one its own
// times, or overrun its marks). Two devices under allreduce, and one under step graphs, whose replays
// mark into the set of the step that launches them.
void check_run_ahead_timed(const std::string& kind) {
  for (const bool graphs : {false, true}) {
    CAPTURE(graphs);
    const int n = graphs ? 1 : 2;
    const Trained each = train(kind, n, "allreduce", 0, Optimizer::sgd, graphs, false, true);
    const Trained ahead = train(kind, n, "allreduce", 0, Optimizer::sgd, graphs, true, true);
    check_same(each, ahead);
    REQUIRE(ahead.spans.size() == size_t(n));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const std::vector<Span>&want = each.spans[size_t(r)], &got = ahead.spans[size_t(r)];
      REQUIRE(got.size() == want.size());
      CHECK(got.size() >= 9 * 3);  // nine steps, forward, backward and the optimizer at the least
      double step_end = 0;         // the latest end among the spans of got[i - 1]'s step (closed in order)
      for (size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);
        CHECK(got[i].phase == want[i].phase);
        CHECK(got[i].step == want[i].step);
        CHECK(got[i].start_us <= got[i].end_us);
        if (i > 0 && got[i].step != got[i - 1].step) {
          CHECK(got[i].step == got[i - 1].step + 1);
          CHECK(step_end <= got[i].start_us);
          step_end = 0;
        }
        step_end = std::max(step_end, got[i].end_us);
      }
    }
  }
}

}  // namespace

TEST_CASE("run-ahead: steps started before the one before is finished train bit-identical to step()") {
  check_run_ahead_trains_as_step("cpu");
}

TEST_CASE("run-ahead: with the phases timed, each step's spans are its own, in order") { check_run_ahead_timed("cpu"); }

TEST_CASE("cuda: run-ahead: steps enqueued while the one before runs train bit-identical to step()" *
          doctest::skip(!dp::test::cuda_available())) {
  check_run_ahead_trains_as_step("cuda");
  check_run_ahead_timed("cuda");
}

TEST_CASE("run-ahead: nothing reads or sets the model while a step is in flight, and a failed step forgets them") {
  const ModelSpec spec = make_model("lenet-bn");
  const Batches data = make_batches(4, 8, 3);
  EngineConfig c;
  c.batch = 8, c.sync = "allreduce", c.prefetch = true;
  auto devs = dp::test::make_test_devices("cpu", 2);
  Engine e(raw(devs), spec, c);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 1, init.data());
  e.set_params(init);
  CHECK_THROWS_WITH_AS(e.finish_step(), doctest::Contains("no step started"), std::logic_error);
  e.stage(data.x[0].data(), data.y[0].data(), 8);
  e.stage(data.x[1].data(), data.y[1].data(), 8);
  e.start_step();
  const std::vector<std::pair<std::string, std::function<void()>>> reads = {
      {"params", [&] { e.params(); }},
      {"set_params", [&] { e.set_params(init); }},
      {"optimizer_state", [&] { e.optimizer_state(); }},
      {"running_stats", [&] { e.running_stats(); }},
      {"set_running_stats", [&] { e.set_running_stats({}); }},
      {"evaluate", [&] { e.evaluate(data.x[3].data(), data.y[3].data(), 8); }},
      {"first_nonfinite_gradient", [&] { e.first_nonfinite_gradient(); }},
      {"set_optimizer_steps", [&] { e.set_optimizer_steps(0); }},
      {"set_batches_tracked", [&] { e.set_batches_tracked(0); }}};
  for (const auto& read : reads) {
    const std::string& name = read.first;  // a plain variable: clang 14's lambdas (CAPTURE) cannot take a binding
    CAPTURE(name);
    const std::string message = "Engine::" + name + ": 1 started step(s) not finished; finish_step() first";
    CHECK_THROWS_WITH_AS(read.second(), message.c_str(), std::logic_error);
  }
  e.start_step();
  CHECK(e.in_flight() == Engine::kStepsInFlight);
  e.stage(data.x[2].data(), data.y[2].data(), 8);
  CHECK_THROWS_WITH_AS(e.start_step(), doctest::Contains("2 steps started and not finished, the most"),
                       std::logic_error);
  // The counts are the started steps'.
  CHECK(e.steps() == 2);
  CHECK(e.optimizer_steps() == 2);
  CHECK(e.batches_tracked() == 2);
  for (int s = 0; s < 2; ++s) CHECK(std::isfinite(e.finish_step().loss));
  CHECK(e.params().size() == size_t(spec.param_count));
  // A step that fails while another is in flight: both are forgotten, with the staged batches; the
  // engine trains on.
  e.stage(data.x[3].data(), data.y[3].data(), 8);
  e.start_step();
  dp::failpoint::inject_fault(*devs[1], "simulated kernel failure");
  CHECK_THROWS_AS(e.start_step(), DeviceError);
  CHECK(e.in_flight() == 0);
  CHECK(e.staged() == 0);
  CHECK_NOTHROW(e.params());
  const StepResult r = e.step(data.x[0].data(), data.y[0].data(), 8);
  CHECK(std::isfinite(r.loss));
}

namespace {

// dp_train's run-ahead loop against the one that reads every loss: the same checkpoint, bit for bit,
// and the same epoch lines, over epoch ends, a --save-every checkpoint mid-epoch, a --steps end
// mid-epoch, a schedule, AdamW and two devices under each strategy; --verify passes alongside. And the
// steps that started while another was in flight, as many as stays_in_flight allows: every step but an
// epoch's last, the run's last and a --save-every step's lets the next one start beside it.
void check_same_run(const std::string& base, const std::string& args, const TempDir& dir, int64_t started_ahead) {
  CAPTURE(args);
  std::string lines[2];
  for (int ahead = 0; ahead < 2; ++ahead) {
    const std::string ck = dir / (ahead ? "ahead.st" : "each.st"), report = dir / "r.json";
    CommandResult r = run_command(base + args + (ahead ? " --run-ahead" : " --no-run-ahead") + " --save " + ck +
                                  " --report " + report);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const nlohmann::json j = dp::test::read_json(report);
    CHECK(j["config"]["run_ahead"] == bool(ahead));
    if (ahead)
      CHECK(j["run_ahead"]["steps_started_ahead"] == started_ahead);
    else
      CHECK(!j.contains("run_ahead"));
    for (size_t at = r.output.find("epoch "); at != std::string::npos; at = r.output.find("epoch ", at + 1))
      lines[ahead] +=
          r.output.substr(at, r.output.rfind("  ", r.output.find("img/s", at)) - at) + "\n";  // not the speed
  }
  CHECK(lines[1] == lines[0]);
  CHECK(lines[0].find("epoch 2/") != std::string::npos);
  dp::test::check_same_tensors(dir / "ahead.st", dir / "each.st");
}

}  // namespace

TEST_CASE("dp_train --run-ahead: the checkpoint and epochs of reading every loss at once") {
  TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 160, 40);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 ";  // 5 steps an epoch
  // Steps 1, 2, 4, 7 and 8 of 10 (not 3, 6 and 9: saved; not 5 and 10: an epoch's last).
  check_same_run(base, "--epochs 2 --save-every 3", dir, 5);
  // Steps 1-4 and 6-7 of 8.
  check_same_run(base, "--steps 8 --optimizer adamw --lr-schedule cosine --warmup 3 --devices 2 --sync zero2", dir, 6);
  check_same_run(base, "--epochs 2 --devices 2 --sync allreduce --bucket-kb 64 --verify", dir, 8);
  check_same_run(base, "--epochs 2 --devices 1 --graphs --model lenet-bn", dir, 8);
  // Simulated devices compute as the host calls them: the default reads every loss at once there.
  CommandResult r = run_command(base + "--steps 2 --report " + dir / "d.json");
  REQUIRE(r.exit_code == 0);
  CHECK(dp::test::read_json(dir / "d.json")["config"]["run_ahead"] == false);
}

TEST_CASE("dp_train --run-ahead: a signal stops after the step it came in, saved, and the bad step is the same") {
  TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 160, 40);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 --quiet ";
  // SIGTERM as step 3 begins (step 2 in flight): steps 2 and 3 finish, the checkpoint is step 3's,
  // and resuming from it ends where an uninterrupted run ends.
  const std::string ck = dir / "ck.st";
  CommandResult stopped = run_command("env DP_TEST_AT=step-3:SIGTERM " + base + "--epochs 2 --run-ahead --save " + ck);
  INFO(stopped.output);
  CHECK(stopped.exit_code == 143);
  CHECK(stopped.output.find("after step 3; checkpoint saved") != std::string::npos);
  CHECK(load_checkpoint(ck, make_model("lenet")).metadata.at("global_step") == "3");
  CHECK(run_command(base + "--epochs 2 --run-ahead --resume " + ck + " --save " + dir / "resumed.st").exit_code == 0);
  REQUIRE(run_command(base + "--epochs 2 --no-run-ahead --save " + dir / "whole.st").exit_code == 0);
  dp::test::check_same_tensors(dir / "resumed.st", dir / "whole.st");

  // A diverging run names the same step either way; reading each loss at once also names the layer
  // (the gradients on the devices are that step's), run-ahead says why it cannot where the next step
  // had started.
  CommandResult each = run_command(base + "--steps 40 --lr 1e6 --no-run-ahead");
  CommandResult ahead = run_command(base + "--steps 40 --lr 1e6 --run-ahead");
  INFO(each.output);
  INFO(ahead.output);
  REQUIRE(each.exit_code == 3);
  REQUIRE(ahead.exit_code == 3);
  const size_t at = each.output.find("step ");
  REQUIRE(at != std::string::npos);
  const std::string step = each.output.substr(at, each.output.find(':', at) - at);  // "step N (epoch E)"
  CHECK(ahead.output.find(step + ": non-finite") != std::string::npos);
  const int64_t n = std::stoll(step.substr(5));
  if (n % 5 != 0)  // not an epoch's last step: the next one had started
    CHECK(ahead.output.find("step " + std::to_string(n + 1) + " had started before this one's loss was read") !=
          std::string::npos);
}

TEST_CASE("dp_train --run-ahead: refused with --eval and --no-run-ahead, saying why") {
  TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 64, 16);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 --steps 1 ";
  dp::test::check_refusals(
      base,
      {{"--run-ahead --no-run-ahead", "--run-ahead and --no-run-ahead: give one of them"},
       {"--eval --load " + dir / "none.st" + " --run-ahead", "--run-ahead only make sense for training"}},
      "epoch 1/");
}

// --log and --trace time every step's phases; a step run ahead marks into a set of its own, so they
// run ahead too: the same checkpoint, a log record of every step with its phases and host times, and
// a trace whose steps follow one another on the device.
TEST_CASE("dp_train --run-ahead: with --log and --trace, every step logged and traced") {
  TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 160, 40);
  const std::string base = kTrainCpu + " --data " + dir.path.string() + " --batch 32 ";
  const std::string log = dir / "l.jsonl", trace = dir / "t.json";
  check_same_run(base, "--epochs 2 --devices 2 --sync allreduce --log-every 1 --log " + log + " --trace " + trace, dir,
                 8);
  int records = 0;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["kind"] != "step") continue;
    CAPTURE(line);
    CHECK(j["step"] == ++records);
    CHECK(j["phase_ms"]["device0"]["forward"].get<double>() > 0);
    CHECK(j["host_ms"]["step"].get<double>() > 0);
  }
  CHECK(records == 10);
  // The trace's device lanes: every step's phases after the step before's, on each device.
  const nlohmann::json t = dp::test::read_json(trace);
  std::map<std::pair<int, int64_t>, std::pair<double, double>> steps;  // (lane, step): first start, last end
  for (const nlohmann::json& e : t["traceEvents"]) {
    if (e.value("ph", "") != "X" || !e.contains("args") || !e["args"].contains("step") || e.value("cat", "") != "phase")
      continue;
    auto [it, fresh] = steps.try_emplace({e["tid"].get<int>(), e["args"]["step"].get<int64_t>()}, e["ts"].get<double>(),
                                         e["ts"].get<double>() + e["dur"].get<double>());
    it->second.first = std::min(it->second.first, e["ts"].get<double>());
    it->second.second = std::max(it->second.second, e["ts"].get<double>() + e["dur"].get<double>());
  }
  CHECK(steps.size() == 2 * 10);
  for (auto it = steps.begin(); it != steps.end(); ++it) {
    const auto next = std::next(it);
    if (next == steps.end() || next->first.first != it->first.first) continue;
    CAPTURE(it->first.second);
    CHECK(next->first.second == it->first.second + 1);
    CHECK(it->second.second <= next->second.first);
  }
}
