#include "train/lr_schedule.h"

#include <cmath>
#include <cstdio>

#include "engine/error.h"

namespace dp {

double LrSchedule::at(int64_t t) const {
  if (t < warmup) return lr * double(t + 1) / double(warmup);
  const int64_t s = t - warmup;  // the schedule's own step
  switch (kind) {
    case LrScheduleKind::constant:
      return lr;
    case LrScheduleKind::step:
      return lr * std::pow(gamma, double(s / step_size));
    case LrScheduleKind::cosine: {
      const int64_t span = total_steps - warmup;
      return span > 0 ? lr * (1 + std::cos(M_PI * double(s) / double(span))) / 2 : lr;
    }
  }
  return lr;
}

std::string LrSchedule::describe() const {
  char text[160];
  if (kind == LrScheduleKind::step)
    std::snprintf(text, sizeof text, "step: %g, times %g every %lld steps", lr, gamma, (long long)step_size);
  else if (kind == LrScheduleKind::cosine)
    std::snprintf(text, sizeof text, "cosine: %g down to 0 at step %lld", lr, (long long)total_steps);
  else
    std::snprintf(text, sizeof text, "constant: %g", lr);
  std::string out = text;
  if (warmup > 0) out += ", after " + std::to_string(warmup) + " steps of linear warmup";
  return out;
}

LrScheduleKind parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrScheduleKind::constant;
  if (name == "step") return LrScheduleKind::step;
  if (name == "cosine") return LrScheduleKind::cosine;
  throw UsageError("--lr-schedule: '" + name +
                   "' is not a schedule; use constant, step (StepLR: --lr-step-size, --lr-gamma) or cosine "
                   "(CosineAnnealingLR to 0 at the run's end)");
}

const char* lr_schedule_name(LrScheduleKind k) {
  return k == LrScheduleKind::step ? "step" : k == LrScheduleKind::cosine ? "cosine" : "constant";
}

}  // namespace dp
