// --lr-schedule and --warmup (train/lr_schedule.h): the rate of every step as PyTorch's schedulers give
// it, the rate each step trains with (a scheduled run equals one whose steps were taken at those rates
// by hand, bit for bit), the rate in every --log record, a resume that moves the schedule's end said,
// and bad input refused before training.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/util.h"
#include "train/checkpoint.h"
#include "train/lr_schedule.h"

using namespace dp;
using namespace dp::test;

TEST_CASE("lr schedule: every step's rate is PyTorch's SequentialLR of LinearLR warmup and the schedule") {
  // torch 1.13: SequentialLR([LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1), main],
  // milestones=[W]) with main ConstantLR(factor=1, total_iters=0), StepLR(step_size=3, gamma=0.1) or
  // CosineAnnealingLR(T_max=T-W); base lr 0.1; optimizer.param_groups[0]["lr"] before each step.
  struct Case {
    LrScheduleKind kind;
    int64_t warmup, total;
    std::vector<double> want;
  };
  const Case cases[] = {
      {LrScheduleKind::constant, 3, 8, {0.0333333333, 0.0666666667, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1}},
      {LrScheduleKind::step, 2, 10, {0.05, 0.1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001, 0.001}},
      {LrScheduleKind::cosine,
       3,
       10,
       {0.0333333333, 0.0666666667, 0.1, 0.1, 0.0950484434, 0.0811744901, 0.0611260467, 0.0388739533, 0.0188255099,
        0.0049515566}},
      {LrScheduleKind::cosine, 0, 6, {0.1, 0.0933012702, 0.075, 0.05, 0.025, 0.00669872981}},
      {LrScheduleKind::step, 0, 7, {0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001}},
  };
  for (const Case& c : cases) {
    LrSchedule s;
    s.kind = c.kind, s.lr = 0.1, s.warmup = c.warmup, s.step_size = 3, s.gamma = 0.1, s.total_steps = c.total;
    CAPTURE(s.describe());
    for (int64_t t = 0; t < c.total; ++t) {
      CAPTURE(t);
      CHECK(s.at(t) == doctest::Approx(c.want[size_t(t)]).epsilon(1e-8));
    }
  }
}

TEST_CASE("lr schedule: a scheduled run trains each step at its rate, logs it, and refuses what cannot run") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);  // 4 steps an epoch of 32
  const std::string train = "timeout -s KILL 60 " + std::string(DP_TRAIN_BIN) + " --backend cpu --quiet --data " +
                            dir.path.string() + " --batch 32 --devices 2 --sync allreduce ";
  // Warmup over 2 steps: 0.05, then 0.1.
  REQUIRE(run_command(train + "--steps 2 --warmup 2 --save " + dir / "sched.st").exit_code == 0);
  // The same two steps by hand: one at 0.05 (stopped after it), resumed for the second at 0.1.
  CommandResult r =
      run_command("env DP_TEST_AT=step-1:SIGINT " + train + "--steps 2 --lr 0.05 --save " + dir / "hand.st");
  REQUIRE(r.exit_code == 130);
  r = run_command(train + "--steps 2 --lr 0.1 --save " + dir / "hand.st" + " --resume " + dir / "hand.st");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const ModelSpec spec = make_model("lenet");
  CHECK(load_checkpoint(dir / "sched.st", spec).params == load_checkpoint(dir / "hand.st", spec).params);
  // And the warmup mattered: at 0.1 throughout the weights end elsewhere.
  REQUIRE(run_command(train + "--steps 2 --save " + dir / "flat.st").exit_code == 0);
  CHECK(load_checkpoint(dir / "sched.st", spec).params != load_checkpoint(dir / "flat.st", spec).params);

  // Every step record's lr is its step's.
  REQUIRE(run_command(train + "--steps 8 --lr-schedule cosine --warmup 2 --log-every 1 --log " + dir / "l.jsonl")
              .exit_code == 0);
  LrSchedule s;
  s.kind = LrScheduleKind::cosine, s.lr = 0.1, s.warmup = 2, s.total_steps = 8;
  std::istringstream lines(slurp(dir / "l.jsonl"));
  int records = 0;
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["kind"] != "step") continue;
    ++records;
    CHECK(j["lr"].get<double>() == doctest::Approx(s.at(j["step"].get<int64_t>() - 1)).epsilon(1e-6));
  }
  CHECK(records == 8);

  // A cosine run resumed with another length ends its schedule elsewhere: the resume says so.
  REQUIRE(
      run_command("env DP_TEST_AT=step-2:SIGINT " + train + "--steps 8 --lr-schedule cosine --save " + dir / "cos.st")
          .exit_code == 130);
  r = run_command(train + "--steps 10 --lr-schedule cosine --save " + dir / "cos.st" + " --resume " + dir / "cos.st");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("lr_schedule_steps 8 -> 10") != std::string::npos);

  check_refusals(train,
                 {
                     {"--steps 4 --warmup 5", "--warmup 5: past the run's 4 steps"},
                     {"--steps 4 --warmup -1", "--warmup: -1 steps"},
                     {"--steps 4 --lr-schedule linear", "--lr-schedule: 'linear' is not a schedule"},
                     {"--steps 4 --lr-step-size 2", "--lr-step-size: only --lr-schedule step"},
                     {"--steps 4 --lr-schedule step --lr-step-size -2", "--lr-step-size: -2 steps"},
                     {"--steps 4 --lr-schedule step --lr-step-size 0", "--lr-step-size: 0 steps; give at least 1"},
                     {"--steps 4 --lr-gamma 0.5", "--lr-gamma: only --lr-schedule step decays by a factor"},
                     {"--steps 4 --lr-schedule step --lr-gamma 1.5", "--lr-gamma: must be in (0, 1]"},
                     {"--steps 4 --lr-schedule step --lr-gamma nan", "--lr-gamma"},
                 },
                 "epoch 1/");
}
