// --verify: the same steps on one device with the full batch, run alongside the data-parallel run;
// at the end the largest weight difference between the two is held against the bound that float
// summation order allows.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/device.h"
#include "engine/engine.h"
#include "train/checkpoint.h"

namespace dp {

// The bound on the largest weight difference between two runs that differ only in the order
// gradients are summed (see verify.cpp for the derivation).
double summation_tolerance(int64_t steps, int batch, float lr, float momentum);
// The same bound for any difference of at most `per_step` in each gradient element a step
// (summation_tolerance's is 2 B u).
double gradient_tolerance(int64_t steps, double per_step, float lr, float momentum);
// How far --grad-dtype's type t moves a gradient element over n devices a step: each device's share
// rounded to t once, and every partial sum rounded as it is formed (at most n - 1 of them, in a ring,
// a tree or across processes), each by at most u_t (2^-8 for bf16, 2^-11 for fp16) of the sum of the
// shares' magnitudes, which summation_tolerance takes to be at most 1: n u_t in all; 0 for fp32 (or a
// single device, which sends nothing).
double compression_rounding(DType t, int devices);
// The bound holds over this many steps; past some tens of steps the training dynamics amplify the
// rounding differences beyond it (lenet, 4 devices, lr 0.1: 3.5e-6 after 20 steps, 0.04 after 50),
// and a longer --verify run is refused before it starts (check_verified_steps).
inline constexpr int kVerifiedSteps = 20;
// With BatchNorm, a run past the rounding bound is held to this share of the weights' largest movement
// from the start instead (Verifier::movement_check says why).
inline constexpr double kMovementShare = 0.1;

// How far two Adam (AdamW) runs that differ only in the order their gradients were summed can end
// apart, element by element, from the reference run's own moments after each step (verify.cpp has
// the derivation). Adam normalises each gradient element by its own size: where an element is about
// as small as its summation noise no bound holds, and tolerance(i) is infinite there.
class AdamTolerance {
 public:
  explicit AdamTolerance(size_t n) : dm_(n, 0.0), dv_(n, 0.0), dw_(n, 0.0) {}
  // After the reference's step t (1 on the first), a gradient element differing by at most delta
  // between the orders, m and v the reference's moments after it.
  void step(const EngineConfig& c, int64_t t, double delta, const std::vector<float>& m, const std::vector<float>& v);
  double tolerance(size_t i) const { return 2 * dw_[i]; }

 private:
  std::vector<double> dm_, dv_, dw_;
};

struct TrainOptions;
struct Schedule;

// Refuses (UsageError) a --verify run of more than kVerifiedSteps steps from `start`: it would train
// to the end and then fail however correct it was.
void check_verified_steps(const TrainOptions& o, const Schedule& plan, int64_t start);

struct VerifyResult {
  int64_t steps = 0;
  // SGD: the largest weight difference and the bound; Adam: those of the weight nearest its own bound
  // (the largest difference / bound), among the `bounded` ones (SGD: every weight).
  double max_diff = 0, tolerance = 0;
  int64_t bounded = 0;
  bool ok = true;
};

class Verifier {
 public:
  // The reference: the first device of `devices` alone, with the run's settings (`run`) less the
  // strategy's (one replica, no buckets, no trace), starting from the same state (weights, momentum
  // where there is one, running statistics).
  // `job_devices`: the run's devices in all, whose --grad-dtype rounding the bound adds
  // (compression_rounding); the reference's gradients stay float32.
  Verifier(const DeviceConfig& devices, const ModelSpec& spec, const EngineConfig& run, const Checkpoint& state,
           int job_devices);
  // The step the run just took, on the same batch x (n, C, H, W), labels y (n).
  void step(const float* x, const int32_t* y, int n);
  // The learning rate of the next step (the run's schedule).
  void set_lr(float lr) { engine_->set_lr(lr); }
  // The run's weights (Engine::params()) against the reference's after the same steps, `batch` the
  // batch each step trained (--batch, or the training set where that is smaller: the bound grows with
  // it); prints the verify line.
  VerifyResult compare(const std::vector<float>& weights, int batch);

 private:
  VerifyResult compare_adam(const std::vector<float>& a, const std::vector<float>& b) const;
  // On a model with a threshold (a ReLU or a max-pool), past the rounding bound: the difference against
  // the weights' movement (verify.cpp).
  void movement_check(VerifyResult& v, const std::vector<float>& a, const std::vector<float>& b) const;

  bool batchnorm_;
  bool thresholds_;           // the model has a ReLU or a max-pool
  float lr_;                  // --lr: under a schedule the largest the steps took, which the bound takes
  double compression_;        // compression_rounding of the run's --grad-dtype, per step
  std::vector<float> start_;  // the weights both runs started from
  DeviceSet devices_;         // declared before engine_: outlives it
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<AdamTolerance> adam_;  // under Adam and AdamW
};

}  // namespace dp
