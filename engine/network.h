// One replica's forward and backward pass over the layer list, on one device. Owns the activation
// buffers (sized for the largest local batch) and the convolution workspace; reads parameters from
// and writes gradients to the replica's flat buffers.
#pragma once

#include <functional>
#include <vector>

#include "engine/device.h"
#include "models/model.h"

namespace dp {

class Network {
 public:
  Network(const ModelSpec& spec, Device& device, int max_batch);

  // x (n, C, H, W) -> logits (n, classes), which live in this network's activations.
  const float* forward(const float* params /* (P) */, const float* x, int n);
  // dlogits (n, classes) -> grads (P), overwritten. After each parameterised layer's gradients are
  // written, on_ready(layer index) runs (the bucketed all-reduce starts from there).
  void backward(const float* params, float* grads, const float* dlogits, int n,
                const std::function<void(int layer)>& on_ready = {});
  int max_batch() const { return max_batch_; }

 private:
  const ModelSpec& spec_;
  Device& dev_;
  int max_batch_;
  std::vector<Buffer> acts_;      // per layer: its output, (max_batch, out_size); none for flatten
  std::vector<Buffer> argmax_;    // per max-pool layer: (max_batch, out_size) indices
  Buffer grad_a_, grad_b_;        // ping-pong activation gradients, (max_batch, largest layer)
  Buffer workspace_;              // conv scratch
  const float* input_ = nullptr;  // the x of the last forward
  const float* output(int layer) const;
  const float* input(int layer) const { return layer == 0 ? input_ : output(layer - 1); }
};

}  // namespace dp
