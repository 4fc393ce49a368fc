// The models dp trains, defined once: a layer list and the parameter table derived from it (name,
// PyTorch shape, offset into the flat parameter buffer). Names and layouts are PyTorch's, so a
// checkpoint loads into the equivalent torch.nn.Module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace dp {

enum class LayerKind { conv, linear, relu, sigmoid, avgpool, maxpool, flatten };

struct Layer {
  LayerKind kind;
  std::string name;  // "conv1", "fc2"; empty for layers without parameters
  // Shapes of one sample: input (c, h, w) and output (c, h, w); linear layers use c only.
  int in_c = 0, in_h = 1, in_w = 1;
  int out_c = 0, out_h = 1, out_w = 1;
  int kernel = 0, pad = 0;     // conv kernel / pool window
  int weight = -1, bias = -1;  // indices into ModelSpec::params
  int64_t in_size() const { return int64_t(in_c) * in_h * in_w; }
  int64_t out_size() const { return int64_t(out_c) * out_h * out_w; }
};

struct Param {
  std::string name;            // "conv1.weight"
  std::vector<int64_t> shape;  // PyTorch's: (O, I, KH, KW), (out, in), (out)
  int64_t offset = 0;          // into the flat buffer, in floats
  int64_t size = 0;
  int layer = -1;
  int64_t fan_in = 0;  // for PyTorch's default initialisation
};

struct ModelSpec {
  std::string name;
  int in_c = 1, in_h = 28, in_w = 28;
  int classes = 10;
  std::vector<Layer> layers;
  std::vector<Param> params;
  int64_t param_count = 0;
  int64_t input_size() const { return int64_t(in_c) * in_h * in_w; }
  const Param* find(const std::string& name) const;
};

// "lenet" or "lenet5"; throws UsageError naming the accepted models otherwise.
ModelSpec make_model(const std::string& name);
std::vector<std::string> model_names();

// PyTorch's default init for Conv2d and Linear (kaiming_uniform with a = sqrt(5), which is
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights, and the same bound for biases), drawn from a
// generator seeded with `seed`. The values differ from torch's (different generator), the
// distribution does not.
void init_params(const ModelSpec& spec, uint64_t seed, float* params /* (P) */);

// Training FLOPs of one sample (forward + backward), counted from the layer list: 2 per multiply-add
// of the conv and linear layers; forward, weight gradient, and data gradient but the first layer's.
double train_flops_per_sample(const ModelSpec& spec);

}  // namespace dp
