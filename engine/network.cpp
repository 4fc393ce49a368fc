#include "engine/network.h"

#include <algorithm>

namespace dp {
namespace {

ConvShape conv_shape(const Layer& l, int n) {
  ConvShape s;
  s.n = n, s.c = l.in_c, s.h = l.in_h, s.w = l.in_w;
  s.k = l.out_c, s.kh = s.kw = l.kernel, s.pad = l.pad;
  return s;
}

PoolShape pool_shape(const Layer& l, int n) {
  PoolShape s;
  s.n = n, s.c = l.in_c, s.h = l.in_h, s.w = l.in_w, s.k = l.kernel;
  return s;
}

}  // namespace

Network::Network(const ModelSpec& spec, Device& dev, int max_batch)
    : spec_(spec), dev_(dev), max_batch_(max_batch) {
  int64_t widest = spec.input_size();
  size_t ws = 0;
  for (auto& l : spec.layers) {
    widest = std::max({widest, l.in_size(), l.out_size()});
    bool view = l.kind == LayerKind::flatten;
    acts_.push_back(view ? Buffer() : dev.alloc_floats(max_batch * l.out_size(), Category::activations));
    argmax_.push_back(l.kind == LayerKind::maxpool
                          ? dev.alloc(size_t(max_batch * l.out_size()) * sizeof(int32_t), Category::activations)
                          : Buffer());
    if (l.kind == LayerKind::conv) ws = std::max(ws, dev.ops().conv2d_workspace_floats(conv_shape(l, max_batch)));
  }
  grad_a_ = dev.alloc_floats(max_batch * widest, Category::activations);
  grad_b_ = dev.alloc_floats(max_batch * widest, Category::activations);
  workspace_ = dev.alloc_floats(int64_t(ws), Category::workspace);
}

const float* Network::output(int i) const {
  while (i >= 0 && spec_.layers[i].kind == LayerKind::flatten) --i;  // flatten is a view
  return i < 0 ? input_ : acts_[i].f();
}

const float* Network::forward(const float* params, const float* x, int n) {
  Ops& ops = dev_.ops();
  input_ = x;
  for (size_t i = 0; i < spec_.layers.size(); ++i) {
    const Layer& l = spec_.layers[i];
    const float* in = input(int(i));
    float* out = acts_[i].f();
    const int64_t count = int64_t(n) * l.out_size();
    switch (l.kind) {
      case LayerKind::conv:
        ops.conv2d_forward(conv_shape(l, n), in, params + spec_.params[l.weight].offset,
                           params + spec_.params[l.bias].offset, out, workspace_.f());
        break;
      case LayerKind::linear:
        ops.linear_forward(n, int(l.in_size()), l.out_c, in, params + spec_.params[l.weight].offset,
                           params + spec_.params[l.bias].offset, out);
        break;
      case LayerKind::relu: ops.activation_forward(Activation::relu, count, in, out); break;
      case LayerKind::sigmoid: ops.activation_forward(Activation::sigmoid, count, in, out); break;
      case LayerKind::avgpool: ops.avgpool_forward(pool_shape(l, n), in, out); break;
      case LayerKind::maxpool: ops.maxpool_forward(pool_shape(l, n), in, out, argmax_[i].i32()); break;
      case LayerKind::flatten: break;
    }
    dev_.maybe_fail("forward");
  }
  return output(int(spec_.layers.size()) - 1);
}

void Network::backward(const float* params, float* grads, const float* dlogits, int n,
                       const std::function<void(int)>& on_ready) {
  Ops& ops = dev_.ops();
  const float* dy = dlogits;  // gradient w.r.t. the current layer's output
  float* spare[2] = {grad_a_.f(), grad_b_.f()};
  int next = 0;
  for (int i = int(spec_.layers.size()) - 1; i >= 0; --i) {
    const Layer& l = spec_.layers[i];
    if (l.kind == LayerKind::flatten) continue;
    const bool need_dx = i > 0;
    float* dx = need_dx ? spare[next] : nullptr;
    const int64_t count = int64_t(n) * l.out_size();
    switch (l.kind) {
      case LayerKind::conv:
        ops.conv2d_backward(conv_shape(l, n), input(i), params + spec_.params[l.weight].offset, dy, dx,
                            grads + spec_.params[l.weight].offset, grads + spec_.params[l.bias].offset,
                            workspace_.f());
        break;
      case LayerKind::linear:
        ops.linear_backward(n, int(l.in_size()), l.out_c, input(i), params + spec_.params[l.weight].offset,
                            dy, dx, grads + spec_.params[l.weight].offset, grads + spec_.params[l.bias].offset);
        break;
      case LayerKind::relu: ops.activation_backward(Activation::relu, count, output(i), dy, dx); break;
      case LayerKind::sigmoid: ops.activation_backward(Activation::sigmoid, count, output(i), dy, dx); break;
      case LayerKind::avgpool: ops.avgpool_backward(pool_shape(l, n), dy, dx); break;
      case LayerKind::maxpool: ops.maxpool_backward(pool_shape(l, n), dy, argmax_[i].i32(), dx); break;
      case LayerKind::flatten: break;
    }
    dev_.maybe_fail("backward");
    if (l.weight >= 0 && on_ready) on_ready(i);
    if (need_dx) {
      dy = dx;
      next ^= 1;
    }
  }
}

}  // namespace dp
