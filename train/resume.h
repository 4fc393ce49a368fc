// Resuming a run: what a checkpoint records about the run that wrote it, what a run that resumes it
// must agree on (checked before training), and the checkpoints a run writes as it goes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/lr_schedule.h"
#include "train/trainer.h"

namespace dp {

// What a checkpoint must agree on with the run that resumes it. The sample order of every later step
// is a function of (seed, epoch, shuffle, training set) and the position of (global step, steps per
// epoch = ceil(samples / batch)): any of these differing makes --resume a different run, so it is
// refused. The strategy, device count, split, buckets, backend and optimizer settings change only
// how the same steps are computed (float summation order) or deliberately change them (lr): those
// resume with a warning that the continuation is not bit-exact.
struct RunIdentity {
  std::vector<std::pair<std::string, std::string>> required, exact_only;  // checked in this order
};

RunIdentity run_identity(const TrainOptions& o, const Dataset& train_set, const std::string& backend, int devices,
                         const LrSchedule& lr);

// --resume: the checkpoint and the global step it was saved at, once its identity agrees with this
// run's: a difference in `required` throws UsageError, one in `exact_only` warns on stderr. Without
// --resume: no weights, step 0.
struct Resumed {
  Checkpoint checkpoint;
  int64_t global_step = 0;
};
Resumed resume_checkpoint(const TrainOptions& o, const ModelSpec& spec, const RunIdentity& id);

// --save and --save-every: the weights, the momentum and the position (the global step alone; epoch
// = step / steps per epoch) with the run's identity beside them.
class CheckpointSaver {
 public:
  CheckpointSaver(const TrainOptions& o, const ModelSpec& spec, const RunIdentity& id, int64_t per_epoch)
      : o_(o), spec_(spec), id_(id), per_epoch_(per_epoch) {}
  // Between steps only, `global_step` the steps taken; once per step. `weights` and
  // `optimizer_state` are engine.params() and engine.optimizer_state(), taken by the caller (under a
  // sharded strategy every process gathers them together; rank 0 alone saves). Weights that
  // overflowed in the update are never written: NumericalError, the previous checkpoint kept.
  void save(Engine& engine, int64_t global_step, std::vector<float> weights,
            std::vector<std::vector<float>> optimizer_state);
  // What --save holds now, for an error that stops the run: "the last good checkpoint (step 40) in
  // ck.safetensors is kept", "ck.safetensors is left as it was" or "nothing was saved".
  std::string kept() const;

 private:
  const TrainOptions& o_;
  const ModelSpec& spec_;
  const RunIdentity& id_;
  int64_t per_epoch_;
  int64_t saved_step_ = -1;  // the step of the last checkpoint this run wrote
};

}  // namespace dp
