#include "train/verify.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "train/setup.h"

namespace dp {

// Where two runs differ only in the order a gradient element's B per-sample contributions c_j are
// summed (one device vs several, ring vs reduce-to-root), each ordering's rounding error is at most
// (B - 1) u sum_j |c_j| (u = 2^-24, Higham's bound for recursive summation). With the mean loss,
// c_j = per-sample gradient / B and LeNet's per-sample gradients are O(1) (inputs in [0, 1],
// |dlogits| <= 1), so sum_j |c_j| <= 1 and a gradient element differs by at most 2 B u between two
// orders. Momentum carries the step-k error into every later step with weight
// 1 + mu + ... + mu^(j-k); the weight change is lr times that. Summed over K steps, doubled for the
// dynamics (the gradient depends on weights that already differ), that is the bound below.
double summation_tolerance(int64_t steps, int batch, float lr, float momentum) {
  return gradient_tolerance(steps, 2.0 * batch * std::ldexp(1.0, -24), lr, momentum);
}

double compression_rounding(DType t, int devices) {
  if (t == DType::fp32 || devices <= 1) return 0;
  return devices * std::ldexp(1.0, t == DType::bf16 ? -8 : -11);
}

double gradient_tolerance(int64_t steps, double per_step, float lr, float momentum) {
  // carried = sum over k < steps of (1 + mu + ... + mu^k), each term the last plus mu^k: linear in
  // the steps (a double loop made a long run's --verify take longer than the run).
  double carried = 0, geometric = 0, p = 1;
  for (int64_t k = 0; k < steps; ++k, p *= momentum) {
    geometric += p;
    carried += geometric;
  }
  return 2.0 * per_step * lr * carried;
}

// Adam's bound (AdamTolerance). The first moment differs by dm <- beta1 dm + (1 - beta1) delta and
// the second by dv <- beta2 dv + (1 - beta2) (2 |g| delta + delta^2), with |g| <= sqrt(v / (1 - beta2))
// from the reference's own v (v >= (1 - beta2) g^2). The update s m / D, D = sqrt(v) / b + eps, then
// moves by at most s (dm / D + |m| dD / (D (D - dD))) with dD <= min(dv / (b sqrt(v)), sqrt(dv) / b);
// where dD reaches half of D (a moment about as small as its own uncertainty) no bound is claimed.
// Summed over the steps and doubled for the dynamics, as summation_tolerance does. AdamW's decoupled
// decay shrinks a difference (1 - lr wd per step) and Adam's L2 term adds wd times one to the
// gradient's: both left out, as momentum's dynamics are.
void AdamTolerance::step(const EngineConfig& c, int64_t t, double delta, const std::vector<float>& m,
                         const std::vector<float>& v) {
  const double s = c.lr / (1 - std::pow(c.beta1, double(t))), b = std::sqrt(1 - std::pow(c.beta2, double(t)));
  for (size_t i = 0; i < dw_.size(); ++i) {
    dm_[i] = c.beta1 * dm_[i] + (1 - c.beta1) * delta;
    const double root = std::sqrt(double(v[i])), g = root / std::sqrt(1 - c.beta2), D = root / b + c.eps;
    dv_[i] = c.beta2 * dv_[i] + (1 - c.beta2) * (2 * g * delta + delta * delta);
    const double dD = std::min(root > 0 ? dv_[i] / (b * root) : INFINITY, std::sqrt(dv_[i]) / b);
    dw_[i] += dD >= D / 2 ? INFINITY : s * (dm_[i] / D + std::fabs(m[i]) * dD / (D * (D - dD)));
  }
}

void check_verified_steps(const TrainOptions& o, const Schedule& plan, int64_t start) {
  const int64_t steps = plan.total_steps - start;
  if (!o.verify || steps <= kVerifiedSteps) return;
  const std::string from = start > 0 ? " from step " + std::to_string(start) : "";
  throw UsageError("--verify: this run trains " + std::to_string(steps) + " steps" + from +
                   "; the bound --verify holds the weights to adds up each step's rounding, which training "
                   "amplifies past it after some tens of steps, so it would fail a correct run at the end. Verify "
                   "at most " +
                   std::to_string(kVerifiedSteps) + " steps (--steps " + std::to_string(start + kVerifiedSteps) +
                   "), or leave out --verify");
}

namespace {

// One device in this process, also when the run is one process of a job (EngineConfig::group), eager.
EngineConfig one_device(EngineConfig c) {
  c.sync = "allreduce", c.bucket_kb = 0, c.trace = false, c.group = nullptr, c.grad_dtype = DType::fp32;
  c.graphs = false;  // the reference steps eagerly, so --graphs --verify checks the graphs against it
  return c;
}

}  // namespace

Verifier::Verifier(const DeviceConfig& devices, const ModelSpec& spec, const EngineConfig& run, const Checkpoint& state,
                   int job_devices)
    : batchnorm_(spec.has_batchnorm()),
      thresholds_(
          std::any_of(spec.layers.begin(), spec.layers.end(),
                      [](const Layer& l) { return l.kind == LayerKind::relu || l.kind == LayerKind::maxpool; })),
      lr_(run.lr),
      compression_(compression_rounding(run.grad_dtype, job_devices)),
      start_(state.params) {
  DeviceConfig first = devices;
  first.ids = {devices.all ? 0 : devices.ids.at(0)};
  first.all = false;
  devices_ = make_devices(first);
  engine_ = std::make_unique<Engine>(std::vector<Device*>{devices_.devices[0].get()}, spec, one_device(run));
  place(*engine_, state);
  if (run.optimizer == Optimizer::adam || run.optimizer == Optimizer::adamw)
    adam_ = std::make_unique<AdamTolerance>(size_t(spec.param_count));
}

void Verifier::step(const float* x, const int32_t* y, int n) {
  engine_->step(x, y, n);
  if (!adam_) return;
  const std::vector<std::vector<float>> state = engine_->optimizer_state();  // exp_avg, exp_avg_sq
  adam_->step(engine_->config(), engine_->optimizer_steps(), 2.0 * n * std::ldexp(1.0, -24) + compression_, state.at(0),
              state.at(1));
}

VerifyResult Verifier::compare_adam(const std::vector<float>& a, const std::vector<float>& b) const {
  VerifyResult v;
  double worst = -1;  // the largest difference / bound
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i])), t = adam_->tolerance(i);
    if (!std::isfinite(t)) continue;
    ++v.bounded;
    if (const double r = t > 0 ? d / t : (d > 0 ? INFINITY : 0); r > worst) worst = r, v.max_diff = d, v.tolerance = t;
  }
  v.ok = worst <= 1;
  return v;
}

namespace {

// Where two runs differ only in the order they summed, a weight's update w - lr d also rounds apart: by
// up to an ulp of the weight, 2u |w|, a step, doubled for the dynamics as summation_tolerance is.
double update_rounding(int64_t steps, const std::vector<float>& w) {
  double top = 0;
  for (float x : w) top = std::max(top, double(std::fabs(x)));
  return 2.0 * double(steps) * 2.0 * std::ldexp(1.0, -24) * top;
}

}  // namespace

VerifyResult Verifier::compare(const std::vector<float>& a, int batch) {
  auto b = engine_->params();
  const double rounding = update_rounding(engine_->steps(), b);  // of the reference's own weights
  // A test build moves the reference's first weight (under Adam the first it bounds; engine/failpoint.h),
  // so a test can watch a failed --verify end the run (exit 1, on every process of a job) whatever the
  // kernels' rounding.
  size_t first = 0;
  while (adam_ && first + 1 < b.size() && !std::isfinite(adam_->tolerance(first))) ++first;
  if (!b.empty()) b[first] += float(failpoint::verify_offset());
  VerifyResult v;
  if (adam_) {
    v = compare_adam(a, b);
    v.steps = engine_->steps();
    std::printf(
        "verify: the weight nearest its bound after %lld steps differs from 1 device by %.3g (its bound %.3g) %s; "
        "Adam's bound is per weight, and holds for %lld of %zu (none where a gradient is as small as its "
        "rounding)\n",
        (long long)v.steps, v.max_diff, v.tolerance, v.ok ? "ok" : "FAILED", (long long)v.bounded, a.size());
  } else {
    v.steps = engine_->steps();
    v.bounded = int64_t(a.size());
    for (size_t i = 0; i < a.size(); ++i) v.max_diff = std::max(v.max_diff, double(std::fabs(a[i] - b[i])));
    const EngineConfig& c = engine_->config();
    v.tolerance = summation_tolerance(v.steps, batch, lr_, c.momentum) +
                  gradient_tolerance(v.steps, compression_, lr_, c.momentum) + rounding;
    v.ok = v.max_diff <= v.tolerance;
    std::printf("verify: largest weight difference from 1 device after %lld steps: %.3g (tolerance %.3g) %s\n",
                (long long)v.steps, v.max_diff, v.tolerance,
                v.ok          ? "ok"
                : thresholds_ ? "over it"
                              : "FAILED");
  }
  if (!v.ok && thresholds_ && !adam_) movement_check(v, a, b);
  return v;
}

// Past the rounding bound, on a model with a ReLU or a max-pool (SGD): a value within rounding of the
// threshold goes either way through it, and routes a whole gradient element one way in one run and the
// other in the other: a jump no rounding bound covers, which training then carries on. BatchNorm makes
// such values common (its beta starts at 0, so many are near zero); without it they are rare, not
// impossible (lenet's ReLUs past 15 steps on an AMD EPYC with AVX-512). What is checked there
// instead: that the runs differ by at most kMovementShare of how far the weights moved, where a wrong
// reduction (a sum not averaged, a bucket not reduced) differs by the order of the movement itself.
void Verifier::movement_check(VerifyResult& v, const std::vector<float>& a, const std::vector<float>& b) const {
  double moved = 0, diff = 0;
  for (size_t i = 0; i < b.size() && i < start_.size(); ++i)
    moved = std::max(moved, double(std::fabs(b[i] - start_[i]))), diff = std::max(diff, double(std::fabs(a[i] - b[i])));
  v.max_diff = diff, v.tolerance = kMovementShare * moved, v.bounded = int64_t(b.size());
  v.ok = v.max_diff <= v.tolerance;
  std::printf(
      "verify: with %s %s: %.3g is %s %g%% of the weights' largest movement from the start, %.3g (a value "
      "within rounding of a ReLU's or max-pool's threshold goes either way in either run, which no rounding bound "
      "covers; a wrong reduction differs by the order of the movement)\n",
      batchnorm_ ? "BatchNorm" : "ReLUs or max-pools", v.ok ? "ok" : "FAILED", v.max_diff,
      v.ok ? "within" : "more than", 100 * kMovementShare, moved);
}

}  // namespace dp
