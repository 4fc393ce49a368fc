// The byte model: the collectives of one training step and what each device sends and receives in
// each, from the model, the batch split and the buckets alone. Every strategy states its own
// (Strategy::step_collectives) with this builder; the engine's measured bytes must equal it to the
// byte (tests, dp_bench compare), and dp_bench's alpha-beta model costs a step with it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/config.h"
#include "models/model.h"

namespace dp {

// One collective of a step and what each rank sends and receives in it.
struct CollectiveTraffic {
  Collective collective;
  std::string what;               // "input chunks", "parameters", "gradient bucket 2", ...
  std::vector<Traffic> per_rank;  // bytes
  int64_t busiest() const;        // the most bytes one rank sends or receives in it
};

// What a step's bytes depend on.
struct StepShape {
  const ModelSpec& spec;
  std::vector<int> sizes;       // each device's samples (split_batch of the global batch)
  std::vector<Bucket> buckets;  // empty: the gradients in one piece
  bool sync_bn = false;         // SyncBatchNorm (EngineConfig::sync_bn)
  AllReduceAlgorithm all_reduce = AllReduceAlgorithm::ring;
  // --clip-grad-norm: the sharded strategies all-reduce their shares' squared norms, one float
  // (clip_gradients, strategy.h)
  bool clip_norm = false;
  // --accumulate: an optimizer step of this many micro-batches, each split as `sizes`
  int micro_batches = 1;
  // --grad-dtype: the type the gradients' collectives carry (the others stay float)
  DType grad_dtype = DType::fp32;
  int devices() const { return int(sizes.size()); }
};

// Ring all-reduce of `count` floats over n ranks (reduce-scatter then all-gather over
// even_chunks(count, n)): what each rank sends and receives.
std::vector<Traffic> ring_all_reduce_traffic(int64_t count, int n, DType t = DType::fp32);

// The collectives of a step as a strategy lists them, in the order it runs them. All sizes in floats.
class ByteModel {
 public:
  ByteModel(int n, AllReduceAlgorithm algorithm) : n_(n), algorithm_(algorithm) {}
  // A collective rooted at device 0: with root_sends device 0 sends device i share(i) floats (scatter,
  // broadcast), otherwise it receives them (gather, reduce).
  void rooted(Collective c, const std::string& what, bool root_sends, const std::vector<int64_t>& share,
              DType t = DType::fp32);
  void rooted(Collective c, const std::string& what, bool root_sends, int64_t each, DType t = DType::fp32);
  // An all-reduce of count elements of type t by the model's algorithm: the ring, or naive's two rooted
  // halves.
  void all_reduce(const std::string& what, int64_t count, DType t = DType::fp32);
  // A reduce-scatter or all-gather (Collective c) of n chunks of `chunk` elements of type t: each rank
  // sends and receives (n-1) chunks, as the ring does and nccl-tests counts (busbw: (n-1)/n of the whole).
  void sharded(Collective c, const std::string& what, int64_t chunk, DType t = DType::fp32);
  // BatchNorm's part of a step: local BatchNorm broadcasts device 0's running statistics before the
  // forward; SyncBatchNorm all-reduces, per BatchNorm layer of C channels, two sums of C floats in
  // forward (mean, variance) and one of 2C in backward (layer order, then reversed).
  void batchnorm(const ModelSpec& spec, bool sync_bn, bool backward);
  // The collectives that follow are micro-batch k's of `count` (--accumulate), and say so when there
  // is more than one; k < 0: the optimizer step's own again.
  void micro_batch(int k, int count);
  // BatchNorm's forward and backward collectives (batchnorm) of each of the step's micro-batches, for
  // a strategy whose other collectives come once a step; the notes then end.
  void batchnorm_per_micro_batch(const StepShape& s);
  std::vector<CollectiveTraffic> take() { return std::move(out_); }

 private:
  void push(CollectiveTraffic ct);  // with the micro-batch's note
  std::string note_;
  int n_;
  AllReduceAlgorithm algorithm_;
  std::vector<CollectiveTraffic> out_;
};

// Every collective's bytes added up, per rank.
std::vector<Traffic> total_traffic(const std::vector<CollectiveTraffic>& collectives, int n);

}  // namespace dp
