// What ZeRO-2 and ZeRO-3 share (zero2.cpp, zero3.cpp): the gradients reduce-scattered bucket by
// bucket as backward finishes each, every device keeping its chunk alone (BucketReducer); and
// ZeRO-3's parameters, gathered layer by layer from every device's chunks for the pass that uses
// them and freed after it (LayerGatherer). The buckets are the engine's (one per parameterised layer
// without --bucket-kb), each a ShardUnit of n chunks.
#pragma once

#include <functional>
#include <vector>

#include "engine/network.h"
#include "engine/strategy.h"

namespace dp {

// The units without --bucket-kb, one per parameterised layer, the last layer's first (the memory
// models of zero2 and zero3).
std::vector<ShardUnit> layer_units(const ModelSpec& spec, int n);

// The memory model's lines for what zero2 (and, with `parameters`, zero3) keeps of the model on each
// of n devices: its 1/n of every layer's gradient (and weights) and optimizer state, plus the whole of
// the largest layer while a pass uses it.
std::vector<Holding> sharded_holdings(const ModelSpec& spec, const EngineConfig& c, int n, bool parameters);

// Backward writes a bucket's gradients into a buffer of that bucket alone, which is reduce-scattered
// as soon as backward has finished the bucket (on the compute thread, timed as the bucket's span);
// the device keeps its chunk of the sum in its gradient chunks and frees the buffer. One per step.
class BucketReducer {
 public:
  explicit BucketReducer(StepContext& s);
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;
  const GradientBlocks& blocks() const { return blocks_; }
  const std::function<void(int layer)>& ready() const { return ready_; }

 private:
  StepContext& s_;
  std::vector<Buffer> bucket_;
  std::vector<int> remaining_;  // per bucket: its layers backward has not finished
  GradientBlocks blocks_;
  std::function<void(int)> ready_;
};

// A layer's weights, when a pass first asks for them, gathered into a buffer of its bucket from every
// device's chunk (an all-gather); freed once the pass has released every layer of the bucket. One per
// pass (forward, backward).
class LayerGatherer {
 public:
  explicit LayerGatherer(StepContext& s);
  LayerGatherer(const LayerGatherer&) = delete;
  LayerGatherer& operator=(const LayerGatherer&) = delete;
  const ParameterBlocks& blocks() const { return blocks_; }

 private:
  StepContext& s_;
  std::vector<Buffer> gathered_;
  std::vector<int> released_;  // per bucket: its layers released in this pass
  ParameterBlocks blocks_;
};

}  // namespace dp
