// One replica's forward and backward pass over the layer list, on one device. Owns the activation
// buffers (sized for the largest local batch) and the convolution workspace; reads parameters from
// and writes gradients to the replica's flat buffers.
//
// Where the device's Ops ask for it (Ops::preferred_chunk, the CPU backends), the convolutional
// prefix of the model (the layers before the first flatten or linear layer, which treat each sample
// on its own) runs chunk by chunk: every layer of the prefix on a chunk of samples, then the next
// chunk. A chunk's activations then stay in the core's cache from one layer to the next instead of
// the whole batch streaming through memory once per layer; the linear layers run on the whole batch,
// where the GEMMs want it. The weight gradients of the prefix are summed over the chunks, and each
// prefix layer reports on_ready once the last chunk is through it.
//
// A conv layer followed by an activation and average pooling (each of LeNet's and LeNet-5's) runs as
// one op, Ops::conv2d_act_pool_forward / backward, which a backend may fuse: the conv layer's own
// output buffer is then only the op's scratch (a chunk's worth when the prefix is chunked).
//
// A BatchNorm layer mixes the samples of a batch, so it ends the per-sample prefix. In training it
// normalises with the batch's statistics (mean, then the biased variance about it: two passes, as
// PyTorch's CPU kernel) and updates the running ones; in evaluation it uses the running ones
// (BatchNormPass). With SyncBatchNorm the per-channel sums of both passes, and of the backward's two
// gradient sums, are added over every replica before use (BatchNormPass::all_reduce), so each
// replica normalises with the statistics of the whole global batch.
#pragma once

#include <functional>
#include <vector>

#include "engine/device.h"
#include "models/model.h"

namespace dp {

// What the BatchNorm layers of one pass need; a model without BatchNorm ignores it.
struct BatchNormPass {
  bool training = true;      // batch statistics, the running ones updated; false: the running ones
  float* running = nullptr;  // (R) this replica's running statistics
  // SyncBatchNorm: sums a buffer of per-channel partial sums over every replica, in place, all of
  // them calling it with the same sizes in the same order. Empty: each replica uses its own samples.
  std::function<void(float* buf, int64_t count)> all_reduce;
  int global_n = 0;  // with all_reduce: the samples of every replica together
};

// Where backward writes a parameterised layer's gradients when they do not go to one flat buffer:
// the layer's weight gradient at the pointer it returns, its bias gradient right after (the order the
// model lays them out in). A sharded strategy gives each bucket of layers its own buffer this way.
using GradientBlocks = std::function<float*(int layer)>;

// Where forward and backward read a parameterised layer's weights (its bias right after) when they
// do not read one flat buffer: `acquire` before the layer's first use in a pass, `release` (may be
// empty) after its last. A strategy that keeps 1/n of the parameters (zero3) gathers a layer's there
// and frees them. Every device calls them in the same order whatever its batch: the prefix's are
// acquired together before its first chunk and released together after its last.
struct ParameterBlocks {
  std::function<const float*(int layer)> acquire;
  std::function<void(int layer)> release;
};

class Network {
 public:
  // chunk: samples per chunk of the prefix; 0: the whole batch at once; -1: what the device's Ops prefer.
  // accumulates: backward may be told to add its gradients (set_accumulating).
  Network(const ModelSpec& spec, Device& device, int max_batch, int chunk = -1, bool accumulates = false);
  // The per-sample prefix: the layers before the first flatten, linear or BatchNorm layer. Chunked,
  // backward writes the gradients of all its layers from the first chunk on, and each is ready after
  // the last.
  static int prefix_layers(const ModelSpec& spec);
  // From now on backward adds each layer's gradients to what is where they go instead of overwriting
  // it (--accumulate's micro-batches after the first; a network built to accumulate). A layer's are
  // written to a scratch of the largest layer's and added: the kernels' GEMMs and sums overwrite.
  void set_accumulating(bool on);

  // x (n, C, H, W) -> logits (n, classes), which live in this network's activations. A model with
  // BatchNorm needs `bn`; its backward follows a training forward.
  const float* forward(const float* params /* (P) */, const float* x, int n, const BatchNormPass* bn = nullptr);
  const float* forward(const ParameterBlocks& params, const float* x, int n, const BatchNormPass* bn = nullptr);
  // dlogits (n, classes) -> grads (P), overwritten. After each parameterised layer's gradients are
  // written, on_ready(layer index) runs (the bucketed all-reduce starts from there).
  void backward(const float* params, float* grads, const float* dlogits, int n,
                const std::function<void(int layer)>& on_ready = {}, const BatchNormPass* bn = nullptr);
  // The same, each layer's gradients where `blocks` puts them (and its weights where `params` does).
  void backward(const float* params, const GradientBlocks& blocks, const float* dlogits, int n,
                const std::function<void(int layer)>& on_ready = {}, const BatchNormPass* bn = nullptr);
  void backward(const ParameterBlocks& params, const GradientBlocks& blocks, const float* dlogits, int n,
                const std::function<void(int layer)>& on_ready = {}, const BatchNormPass* bn = nullptr);
  // A replica without samples this step (a batch smaller than the device count): zero gradients,
  // and the collectives a pass with samples would join, in the same order: with SyncBatchNorm its
  // partial sums are zeros, and it takes the global statistics into its running ones like the others.
  // Given `params`, each layer's weights are acquired and released as a pass with samples would.
  void forward_without_samples(const BatchNormPass* bn, const ParameterBlocks* params = nullptr);
  void backward_without_samples(float* grads, const std::function<void(int layer)>& on_ready, const BatchNormPass* bn);
  void backward_without_samples(const GradientBlocks& blocks, const std::function<void(int layer)>& on_ready,
                                const BatchNormPass* bn, const ParameterBlocks* params = nullptr);
  int max_batch() const { return max_batch_; }

 private:
  const ModelSpec& spec_;
  Device& dev_;
  int max_batch_;
  int prefix_ = 0;              // layers [0, prefix_) are the per-sample prefix
  std::vector<int> steps_;      // the prefix as steps: first layer of each, 3 layers when fused
  bool fused(int i) const;      // layers i, i+1, i+2 are conv, activation, average pooling
  int chunk_ = 0;               // samples per chunk of the prefix; 0: the whole batch at once
  std::vector<Buffer> acts_;    // per layer: its output, (max_batch, out_size); none for flatten
  std::vector<Buffer> argmax_;  // per max-pool layer: (max_batch, out_size) indices
  Buffer grad_a_, grad_b_;      // ping-pong activation gradients, (max_batch, largest layer); with
                                // chunks, (max_batch, largest layer after the prefix)
  Buffer chunk_a_, chunk_b_;    // with chunks: the prefix's ping-pong, (chunk_, largest prefix layer)
  Buffer workspace_;            // conv scratch
  // A chunk's weight and bias gradients of one prefix layer, summed into grads; accumulating, any
  // layer's, added to where they go.
  Buffer sum_grads_;
  bool accumulates_ = false, accumulating_ = false;
  const float* input_ = nullptr;       // the x of the last forward
  std::vector<Buffer> bn_stats_;       // per batchnorm layer: the batch's mean and biased variance, (2, C)
  Buffer bn_sums_;                     // a batchnorm backward's two gradient sums, (2, largest C)
  const BatchNormPass* bn_ = nullptr;  // the pass in progress
  // The flat buffers as blocks; a layer's weights acquired (null for a layer without) and released.
  ParameterBlocks flat(const float* params) const;
  GradientBlocks flat_gradients(float* grads) const;
  const float* acquire(const ParameterBlocks& p, int i) const;
  void release(const ParameterBlocks& p, int i) const;
  // w: layer i's weights, its bias right after (null for a layer without).
  void batchnorm_forward(int i, const float* w, int n);
  void batchnorm_backward(int i, const float* w, const float* dy, float* dx, float* dw, float* db, int n);
  const float* output(int layer) const;
  const float* input(int layer) const { return layer == 0 ? input_ : output(layer - 1); }
  // Layer i forward / backward on samples [first, first + n) of the batch. Backward reads dy and
  // writes dx at those samples' rows (dx null for the first layer) and the layer's weight and bias
  // gradients to dw, db.
  void forward_layer(int i, const float* w, int first, int n);
  void backward_layer(int i, const float* w, const float* dy, float* dx, float* dw, float* db, int first, int n);
  // One step of the prefix (a layer, or a fused conv + activation + pooling) on samples [first, first + n).
  void forward_step(int i, const float* w, int first, int n);
  void backward_step(int i, const float* w, const float* dy, float* dx, float* dw, float* db, int first, int n);
  int step_layers(int i) const { return fused(i) ? 3 : 1; }
};

}  // namespace dp
