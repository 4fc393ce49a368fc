#include "models/model.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "kernels/error.h"

namespace dp {
namespace {

// Builds a ModelSpec layer by layer, tracking the running shape and the parameter table.
struct Builder {
  ModelSpec m;
  int c, h, w;
  explicit Builder(std::string name) {
    m.name = std::move(name);
    c = m.in_c, h = m.in_h, w = m.in_w;
  }
  Layer& push(LayerKind kind, std::string name = {}) {
    Layer l{kind, std::move(name)};
    l.in_c = c, l.in_h = h, l.in_w = w;
    m.layers.push_back(l);
    return m.layers.back();
  }
  int param(const std::string& name, std::vector<int64_t> shape, int64_t fan_in, float init = 0) {
    Param p{name, std::move(shape), m.param_count, 1, int(m.layers.size()) - 1, fan_in, init};
    for (auto d : p.shape) p.size *= d;
    m.param_count += p.size;
    m.params.push_back(p);
    return int(m.params.size()) - 1;
  }
  void conv(const std::string& name, int out, int k, int pad = 0) {
    Layer& l = push(LayerKind::conv, name);
    l.kernel = k, l.pad = pad;
    l.out_c = out, l.out_h = h + 2 * pad - k + 1, l.out_w = w + 2 * pad - k + 1;
    int64_t fan_in = int64_t(c) * k * k;
    int wi = param(name + ".weight", {out, c, k, k}, fan_in);
    int bi = param(name + ".bias", {out}, fan_in);
    m.layers.back().weight = wi, m.layers.back().bias = bi;
    c = out, h = m.layers.back().out_h, w = m.layers.back().out_w;
  }
  void linear(const std::string& name, int out) {
    int in = c * h * w;
    Layer& l = push(LayerKind::linear, name);
    l.out_c = out;
    int wi = param(name + ".weight", {out, in}, in);
    int bi = param(name + ".bias", {out}, in);
    m.layers.back().weight = wi, m.layers.back().bias = bi;
    c = out, h = 1, w = 1;
  }
  // BatchNorm2d over the channels of (c, h, w), BatchNorm1d over the features of a flat layer.
  void batchnorm(const std::string& name) {
    Layer& l = push(LayerKind::batchnorm, name);
    l.out_c = c, l.out_h = h, l.out_w = w;
    int wi = param(name + ".weight", {c}, 0, 1.0f);
    int bi = param(name + ".bias", {c}, 0, 0.0f);
    const int layer = int(m.layers.size()) - 1;
    m.layers.back().weight = wi, m.layers.back().bias = bi, m.layers.back().running = int(m.buffers.size());
    for (auto [stat, init] : {std::pair{".running_mean", 0.0f}, std::pair{".running_var", 1.0f}}) {
      m.buffers.push_back({name + stat, c, m.buffer_count, init, layer});
      m.buffer_count += c;
    }
  }
  void act(LayerKind k) {
    Layer& l = push(k);
    l.out_c = c, l.out_h = h, l.out_w = w;
  }
  void pool(LayerKind k, int window) {
    Layer& l = push(k);
    l.kernel = window;
    l.out_c = c, l.out_h = h / window, l.out_w = w / window;
    h /= window, w /= window;
  }
  void flatten() {
    Layer& l = push(LayerKind::flatten);
    c = c * h * w, h = 1, w = 1;
    l.out_c = c;
  }
};

}  // namespace

std::vector<std::string> model_names() { return {"lenet", "lenet5", "lenet-bn"}; }

ModelSpec make_model(const std::string& name, int width) {
  if (width < 1 || width > kMaxWidth)
    throw UsageError("--width: " + std::to_string(width) + " is not a width dp trains; give 1 to " +
                     std::to_string(kMaxWidth) + " (1: the model as published)");
  Builder b(name);
  b.m.width = width;
  const int k = width;  // the shapes below are at width 1
  if (name == "lenet") {
    b.conv("conv1", 20 * k, 3);  // (N, 20, 26, 26)
    b.act(LayerKind::relu);
    b.pool(LayerKind::avgpool, 2);  // (N, 20, 13, 13)
    b.conv("conv2", 50 * k, 5);     // (N, 50, 9, 9)
    b.act(LayerKind::relu);
    b.pool(LayerKind::avgpool, 2);  // (N, 50, 4, 4)
    b.flatten();                    // (N, 800)
    b.linear("fc1", 128 * k);
    b.act(LayerKind::relu);
    b.linear("fc2", 10);  // (N, 10)
  } else if (name == "lenet-bn") {
    b.conv("conv1", 20 * k, 3);  // (N, 20, 26, 26)
    b.batchnorm("bn1");
    b.act(LayerKind::relu);
    b.pool(LayerKind::avgpool, 2);  // (N, 20, 13, 13)
    b.conv("conv2", 50 * k, 5);     // (N, 50, 9, 9)
    b.batchnorm("bn2");
    b.act(LayerKind::relu);
    b.pool(LayerKind::avgpool, 2);  // (N, 50, 4, 4)
    b.flatten();                    // (N, 800)
    b.linear("fc1", 128 * k);
    b.batchnorm("bn3");  // BatchNorm1d(128)
    b.act(LayerKind::relu);
    b.linear("fc2", 10);  // (N, 10)
  } else if (name == "lenet5") {
    b.conv("conv1", 6 * k, 5, 2);  // (N, 6, 28, 28)
    b.act(LayerKind::sigmoid);
    b.pool(LayerKind::avgpool, 2);  // (N, 6, 14, 14)
    b.conv("conv2", 16 * k, 5);     // (N, 16, 10, 10)
    b.act(LayerKind::sigmoid);
    b.pool(LayerKind::avgpool, 2);  // (N, 16, 5, 5)
    b.flatten();                    // (N, 400)
    b.linear("fc1", 120 * k);
    b.act(LayerKind::sigmoid);
    b.linear("fc2", 84 * k);
    b.act(LayerKind::sigmoid);
    b.linear("fc3", 10);  // (N, 10)
  } else {
    throw UsageError("--model: unknown model '" + name + "'; accepted: lenet, lenet5, lenet-bn");
  }
  return b.m;
}

const Param* ModelSpec::find(const std::string& n) const {
  for (auto& p : params)
    if (p.name == n) return &p;
  return nullptr;
}

const BufferSpec* ModelSpec::find_buffer(const std::string& n) const {
  for (auto& b : buffers)
    if (b.name == n) return &b;
  return nullptr;
}

std::vector<std::string> ModelSpec::batches_tracked_names() const {
  std::vector<std::string> names;
  for (auto& l : layers)
    if (l.kind == LayerKind::batchnorm) names.push_back(l.name + ".num_batches_tracked");
  return names;
}

void init_params(const ModelSpec& spec, uint64_t seed, float* params) {
  std::mt19937_64 gen(seed);
  for (auto& p : spec.params) {
    if (p.fan_in == 0) {  // BatchNorm: no draw, so the other layers' values do not move
      std::fill(params + p.offset, params + p.offset + p.size, p.init);
      continue;
    }
    double bound = 1.0 / std::sqrt(double(p.fan_in));
    // The 53-bit uniform from raw generator output: identical on every standard library.
    for (int64_t i = 0; i < p.size; ++i) {
      double u = double(gen() >> 11) * 0x1.0p-53;
      params[p.offset + i] = float((2.0 * u - 1.0) * bound);
    }
  }
}

void init_buffers(const ModelSpec& spec, float* buffers) {
  for (auto& b : spec.buffers) std::fill(buffers + b.offset, buffers + b.offset + b.channels, b.init);
}

double train_flops_per_sample(const ModelSpec& spec) {
  // Multiply-adds of the convolutions and linear layers only (bias, activations, pooling, the loss
  // and the optimizer are O(activations), not counted), 2 FLOPs each: forward 1x, weight gradient
  // 1x, data gradient 1x except for the first parameterised layer, whose input gradient nobody
  // needs and network.cpp does not compute. bench/torch_compare.py uses the same formula.
  const std::vector<double> backward = backward_macs(spec);
  double macs = 0;
  for (size_t i = 0; i < spec.layers.size(); ++i) macs += layer_macs(spec.layers[i]) + backward[i];
  return 2.0 * macs;
}

double layer_macs(const Layer& l) {
  if (l.kind == LayerKind::conv) return double(l.out_size()) * l.in_c * l.kernel * l.kernel;  // per output: C*KH*KW
  if (l.kind == LayerKind::linear) return double(l.in_size()) * l.out_c;
  return 0;
}

std::vector<double> backward_macs(const ModelSpec& spec) {
  std::vector<double> out(spec.layers.size(), 0.0);
  bool first = true;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const double m = layer_macs(spec.layers[i]);
    if (m == 0) continue;
    out[i] = first ? m : 2 * m;  // the weight gradient, and the data gradient but the first layer's
    first = false;
  }
  return out;
}

}  // namespace dp
