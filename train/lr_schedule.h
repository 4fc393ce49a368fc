// --lr-schedule and --warmup: the learning rate of every optimizer step, as PyTorch's schedulers give
// it. With --warmup W the first W steps ramp linearly to --lr (LinearLR(start_factor=1/W,
// total_iters=W-1): step t at (t+1)/W of it, the large-batch recipe of Goyal et al.), then the schedule
// runs from its own step 0 (SequentialLR(milestones=[W])):
//   constant  --lr throughout
//   step      --lr times --lr-gamma every --lr-step-size steps (StepLR)
//   cosine    from --lr down to 0 at the run's end: --lr (1 + cos(pi t / (T - W))) / 2 (CosineAnnealingLR,
//             T_max = T - W, T the run's steps)
#pragma once

#include <cstdint>
#include <string>

namespace dp {

enum class LrScheduleKind { constant, step, cosine };

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::constant;
  double lr = 0.1;          // --lr: the rate the warmup reaches and the schedule starts from
  int64_t warmup = 0;       // --warmup: steps of linear warmup (0: none)
  int64_t step_size = 0;    // --lr-step-size (step)
  double gamma = 0.1;       // --lr-gamma (step)
  int64_t total_steps = 0;  // the run's steps, resumed or not (cosine's end)

  // The learning rate of global step t (0-based: the run's first step is t = 0).
  double at(int64_t t) const;
  bool is_constant() const { return kind == LrScheduleKind::constant && warmup == 0; }
  // "cosine from 0.1 to 0 after 5 warmup steps", for the run's header.
  std::string describe() const;
};

LrScheduleKind parse_lr_schedule(const std::string& name);  // throws UsageError naming the accepted ones
const char* lr_schedule_name(LrScheduleKind k);

}  // namespace dp
