// What DDP and the ZeRO stages share: each device loads its own rows of the batch (DistributedSampler's
// rank slice) and runs forward, its part of the loss and backward on them alone. They differ in how
// the gradients are reduced and in what each device keeps and updates (allreduce.cpp, zero1.cpp).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/strategy.h"

namespace dp {

class OwnBatch : public Strategy {
 public:
  bool steps_optimizer(int) const override { return true; }
  // Each device: its own rows, (b, D) and (b), and their logit gradients, (b, C).
  void allocate(Device& dev, Replica& rep, const ModelSpec& spec, const EngineConfig& c, int rank,
                int b) const override;
  // Each device reads its own rows straight from host memory, from the process's first device on.
  std::pair<int, int> upload_rows(const std::vector<int>& sizes, int first_device, int rank) const override;
  bool computes_loss(int) const override { return true; }
  const char* idle_device() const override { return "their shards are empty and they add zero gradients"; }

 protected:
  // The step up to the reduction: load, BatchNorm's broadcast (DDP's broadcast_buffers), forward, the
  // loss (weighted 1/B, so that the devices' gradients sum to the global batch's) and backward;
  // `ready` (may be empty) is told each parameterised layer as backward finishes its gradient, which
  // goes to the replica's flat gradient buffer or, given `blocks`, where those put it; the weights are
  // read from the replica's flat parameters or, given `params`, where those put them.
  static void forward_backward(StepContext& s, const std::function<void(int)>& ready,
                               const GradientBlocks* blocks = nullptr, const ParameterBlocks* params = nullptr);
  // The memory model's lines for the rows and logit gradients every device holds.
  static std::vector<Holding> batch_holdings(const ModelSpec& spec, const EngineConfig& c, int n);
};

}  // namespace dp
