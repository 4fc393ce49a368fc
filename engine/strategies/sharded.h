// What ZeRO-2 and ZeRO-3 share (zero2.cpp, zero3.cpp): the gradients reduce-scattered bucket by
// bucket as backward finishes each, every device keeping its chunk alone (BucketReducer); and
// ZeRO-3's parameters, gathered layer by layer from every device's chunks for the pass that uses
// them and freed after it (LayerGatherer). The buckets are the engine's (one per parameterised layer
// without --bucket-kb), each a ShardUnit of n chunks.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "engine/network.h"
#include "engine/strategy.h"

namespace dp {

// The units without --bucket-kb, one per parameterised layer, the last layer's first (the memory
// models of zero2 and zero3).
std::vector<ShardUnit> layer_units(const ModelSpec& spec, int n);

// The memory model's lines for what zero2 (and, with `parameters`, zero3) keeps of the model on each
// of n devices: its 1/n of every layer's gradient (and weights) and optimizer state, plus the whole of
// the largest layer while a pass uses it (zero3's weights: as Category::gathered) (of the gradients: the two buckets
// alive at once, the one being reduce-scattered and the next, that take the most).
std::vector<Holding> sharded_holdings(const ModelSpec& spec, const EngineConfig& c, int n, bool parameters);

// Backward writes a bucket's gradients into a buffer of that bucket alone; once backward has finished
// the bucket, its reduce-scatter starts on the communication thread (reduce_scatter_async, timed as
// the bucket's span) and backward goes on into the next bucket, the device's chunk of the sum landing
// in its gradient chunks. Two buckets at most are alive, double-buffered as DeepSpeed's stage 2 does:
// when the next bucket is ready, backward first waits for the one before (the only wait it exposes)
// and frees it. finish() does so for the one in flight: at the end of backward, and before zero3
// gathers a layer. One per step.
class BucketReducer {
 public:
  explicit BucketReducer(StepContext& s);
  ~BucketReducer();
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;
  const GradientBlocks& blocks() const { return blocks_; }
  const std::function<void(int layer)>& ready() const { return ready_; }
  void finish();

 private:
  void allocate(size_t bucket);  // its buffer, unless it has one

  StepContext& s_;
  std::vector<Buffer> bucket_;
  std::unique_ptr<WireGradients> wire_;  // the bucket in flight as its reduce-scatter carries it (--grad-dtype)
  std::vector<int> remaining_;           // per bucket: its layers backward has not finished
  int in_flight_ = -1;                   // the bucket whose reduce-scatter was started last and not waited for
  int prefix_;                           // Network::prefix_layers: their buckets are allocated together
  GradientBlocks blocks_;
  std::function<void(int)> ready_;
};

// A layer's weights, when a pass first asks for them, gathered into a buffer of its bucket from every
// device's chunk (an all-gather, queued after the reduce-scatters in flight and waited for); freed
// once the pass has released every layer of the bucket. One per step (forward, then backward). With
// `reduce`, its reduce-scatter in flight is finished first: the gather queues behind it anyway, and
// so its bucket is freed before the gathered layer is allocated.
class LayerGatherer {
 public:
  LayerGatherer(StepContext& s, BucketReducer* reduce);
  LayerGatherer(const LayerGatherer&) = delete;
  LayerGatherer& operator=(const LayerGatherer&) = delete;
  const ParameterBlocks& blocks() const { return blocks_; }

 private:
  StepContext& s_;
  BucketReducer* reduce_;
  std::vector<Buffer> gathered_;
  std::vector<int> released_;  // per bucket: its layers released in this pass
  ParameterBlocks blocks_;
};

}  // namespace dp
