// The models dp trains, defined once: a layer list and the parameter table derived from it (name,
// PyTorch shape, offset into the flat parameter buffer), and for BatchNorm the buffer table of its
// running statistics (offsets into a second flat buffer, which is not trained: no gradients, never
// all-reduced as one). Names and layouts are PyTorch's, so a checkpoint loads into the equivalent
// torch.nn.Module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace dp {

enum class LayerKind { conv, linear, batchnorm, relu, sigmoid, avgpool, maxpool, flatten };

// PyTorch's BatchNorm defaults (nn.BatchNorm1d/2d): eps, and the running statistics' momentum.
inline constexpr float kBatchNormEps = 1e-5f;
inline constexpr float kBatchNormMomentum = 0.1f;

struct Layer {
  LayerKind kind;
  std::string name;  // "conv1", "fc2"; empty for layers without parameters
  // Shapes of one sample: input (c, h, w) and output (c, h, w); linear layers use c only.
  int in_c = 0, in_h = 1, in_w = 1;
  int out_c = 0, out_h = 1, out_w = 1;
  int kernel = 0, pad = 0;     // conv kernel / pool window
  int weight = -1, bias = -1;  // indices into ModelSpec::params (batchnorm: gamma, beta)
  int running = -1;            // batchnorm: index into ModelSpec::buffers of running_mean (running_var next)
  int64_t in_size() const { return int64_t(in_c) * in_h * in_w; }
  int64_t out_size() const { return int64_t(out_c) * out_h * out_w; }
};

struct Param {
  std::string name;            // "conv1.weight"
  std::vector<int64_t> shape;  // PyTorch's: (O, I, KH, KW), (out, in), (out)
  int64_t offset = 0;          // into the flat buffer, in floats
  int64_t size = 0;
  int layer = -1;
  int64_t fan_in = 0;  // for PyTorch's default initialisation; 0: a BatchNorm weight (1) or bias (0)
  float init = 0;      // the value of a parameter with fan_in 0
};

// A BatchNorm running statistic, "bn1.running_mean" / "bn1.running_var" (C): float, initialised to 0 / 1.
// PyTorch's third buffer, "bn1.num_batches_tracked" (int64, a scalar), is the same count for every
// BatchNorm layer of a model trained as a whole: the engine keeps it once (Engine::batches_tracked).
struct BufferSpec {
  std::string name;
  int64_t channels = 0;
  int64_t offset = 0;  // into the flat buffer of running statistics, in floats
  float init = 0;
  int layer = -1;
};

struct ModelSpec {
  std::string name;
  int width = 1;  // every conv's output channels and every hidden linear layer's width times this
  int in_c = 1, in_h = 28, in_w = 28;
  int classes = 10;
  std::vector<Layer> layers;
  std::vector<Param> params;
  int64_t param_count = 0;
  std::vector<BufferSpec> buffers;  // empty for a model without BatchNorm
  int64_t buffer_count = 0;         // floats
  int64_t input_size() const { return int64_t(in_c) * in_h * in_w; }
  const Param* find(const std::string& name) const;
  const BufferSpec* find_buffer(const std::string& name) const;
  bool has_batchnorm() const { return !buffers.empty(); }
  // "lenet", or "lenet at --width 4": the model as messages and headings name it.
  std::string title() const { return width == 1 ? name : name + " at --width " + std::to_string(width); }
  // "bn1.num_batches_tracked", ... : PyTorch's step counters, one per BatchNorm layer.
  std::vector<std::string> batches_tracked_names() const;
};

// "lenet", "lenet5" or "lenet-bn" (lenet with BatchNorm after conv1, conv2 and fc1, each before its
// ReLU); throws UsageError naming the accepted models otherwise. `width` (--width, at least 1)
// multiplies every conv's output channels and every hidden linear layer's width (the classifier keeps
// its 10 outputs): about width² times the parameters, width times the activations.
// Widths past kMaxWidth are refused: the kernels count a tensor's elements in int, and lenet's fc1
// weight alone is 102,400·width² of them (419 million at 64, past 2^31 at 145).
inline constexpr int kMaxWidth = 64;
ModelSpec make_model(const std::string& name, int width = 1);
std::vector<std::string> model_names();

// PyTorch's default init for Conv2d and Linear (kaiming_uniform with a = sqrt(5), which is
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights, and the same bound for biases), drawn from a
// generator seeded with `seed`. The values differ from torch's (different generator), the
// distribution does not. BatchNorm's weight is 1 and its bias 0, as PyTorch's.
void init_params(const ModelSpec& spec, uint64_t seed, float* params /* (P) */);
// Running means 0, running variances 1 (PyTorch's reset_running_stats).
void init_buffers(const ModelSpec& spec, float* buffers /* (R) */);

// Training FLOPs of one sample (forward + backward), counted from the layer list: 2 per multiply-add
// of the conv and linear layers; forward, weight gradient, and data gradient but the first layer's.
double train_flops_per_sample(const ModelSpec& spec);
// A layer's multiply-adds per sample in its forward pass: a convolution's or linear layer's, 0 for the rest.
double layer_macs(const Layer& l);
// Each layer's multiply-adds per sample in its backward pass, by layer index: a convolution's or linear
// layer's weight and data gradient, the weight gradient alone for the first of them (whose input
// gradient network.cpp does not compute), 0 for the rest.
std::vector<double> backward_macs(const ModelSpec& spec);

}  // namespace dp
