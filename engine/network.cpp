#include "engine/network.h"

#include <algorithm>

#include "engine/failpoint.h"

namespace dp {
namespace {

ConvShape conv_shape(const Layer& l, int n) {
  return {.n = n, .c = l.in_c, .h = l.in_h, .w = l.in_w, .k = l.out_c, .kh = l.kernel, .kw = l.kernel, .pad = l.pad};
}

PoolShape pool_shape(const Layer& l, int n) { return {.n = n, .c = l.in_c, .h = l.in_h, .w = l.in_w, .k = l.kernel}; }

}  // namespace

int Network::prefix_layers(const ModelSpec& spec) {
  int n = 0;
  while (n < int(spec.layers.size()) && spec.layers[n].kind != LayerKind::flatten &&
         spec.layers[n].kind != LayerKind::linear && spec.layers[n].kind != LayerKind::batchnorm)
    ++n;
  return n;
}

Network::Network(const ModelSpec& spec, Device& dev, int max_batch, int chunk, bool accumulates)
    : spec_(spec), dev_(dev), max_batch_(max_batch), accumulates_(accumulates) {
  int64_t widest = spec.input_size();
  size_t ws = 0;
  prefix_ = prefix_layers(spec);
  if (chunk < 0) chunk = dev.ops().preferred_chunk();
  if (chunk > 0 && max_batch > chunk) chunk_ = chunk;
  for (int i = 0; i < prefix_; i += step_layers(i)) steps_.push_back(i);
  int64_t prefix_params = 0;  // the largest weight + bias of a parameterised prefix layer
  int64_t layer_params = 0;   // of any parameterised layer
  int64_t prefix_widest = 0;  // the widest input of a prefix layer (its dx)
  for (int i = 0; i < int(spec.layers.size()); ++i) {
    const Layer& l = spec.layers[i];
    if (chunk_ && i < prefix_)
      prefix_widest = std::max(prefix_widest, l.in_size());
    else
      widest = std::max({widest, l.in_size(), l.out_size()});
    // A fused conv layer's output is only its step's scratch: a chunk's worth when the prefix is chunked.
    const bool view = l.kind == LayerKind::flatten, scratch = chunk_ && l.kind == LayerKind::conv && fused(i);
    acts_.push_back(view ? Buffer()
                         : dev.alloc_floats((scratch ? chunk_ : max_batch) * l.out_size(), Category::activations));
    argmax_.push_back(l.kind == LayerKind::maxpool
                          ? dev.alloc(size_t(max_batch * l.out_size()) * sizeof(int32_t), Category::activations)
                          : Buffer());
    // A chunked conv layer sees at most chunk_ samples; the workspace never depends on more.
    if (l.kind == LayerKind::conv)
      ws = std::max(ws, dev.ops().conv2d_workspace_floats(conv_shape(l, i < prefix_ && chunk_ ? chunk_ : max_batch)));
    if (l.weight >= 0) {
      const int64_t w = spec.params[l.weight].size + (l.bias >= 0 ? spec.params[l.bias].size : 0);
      layer_params = std::max(layer_params, w);
      if (i < prefix_) prefix_params = std::max(prefix_params, w);
    }
    bn_stats_.push_back(l.kind == LayerKind::batchnorm ? dev.alloc_floats(2 * l.out_c, Category::activations)
                                                       : Buffer());
    if (l.kind == LayerKind::batchnorm && 2 * l.out_c > int64_t(bn_sums_.bytes() / sizeof(float)))
      bn_sums_ = dev.alloc_floats(2 * l.out_c, Category::workspace);
  }
  grad_a_ = dev.alloc_floats(max_batch * widest, Category::activations);
  grad_b_ = dev.alloc_floats(max_batch * widest, Category::activations);
  workspace_ = dev.alloc_floats(int64_t(ws), Category::workspace);
  if (chunk_) {
    chunk_a_ = dev.alloc_floats(chunk_ * prefix_widest, Category::activations);
    chunk_b_ = dev.alloc_floats(chunk_ * prefix_widest, Category::activations);
  }
  if (accumulates || chunk_)
    sum_grads_ = dev.alloc_floats(accumulates ? layer_params : prefix_params, Category::workspace);
}

void Network::set_accumulating(bool on) {
  if (on && !accumulates_) throw std::logic_error("Network::set_accumulating: built without accumulates");
  accumulating_ = on;
}

bool Network::fused(int i) const {
  const auto& ls = spec_.layers;
  return i + 2 < prefix_ && ls[i].kind == LayerKind::conv &&
         (ls[i + 1].kind == LayerKind::relu || ls[i + 1].kind == LayerKind::sigmoid) &&
         ls[i + 2].kind == LayerKind::avgpool;
}

const float* Network::output(int i) const {
  while (i >= 0 && spec_.layers[i].kind == LayerKind::flatten) --i;  // flatten is a view
  return i < 0 ? input_ : acts_[i].f();
}

void Network::forward_layer(int i, const float* w, int first, int n) {
  Ops& ops = dev_.ops();
  const Layer& l = spec_.layers[i];
  const float* in = input(i) + int64_t(first) * l.in_size();
  float* out = l.kind == LayerKind::flatten ? nullptr : acts_[i].f() + int64_t(first) * l.out_size();
  const int64_t count = int64_t(n) * l.out_size();
  switch (l.kind) {
    case LayerKind::conv:
      ops.conv2d_forward(conv_shape(l, n), in, w, w + spec_.params[l.weight].size, out, workspace_.f());
      break;
    case LayerKind::linear:
      ops.linear_forward(n, int(l.in_size()), l.out_c, in, w, w + spec_.params[l.weight].size, out);
      break;
    case LayerKind::relu:
      ops.activation_forward(Activation::relu, count, in, out);
      break;
    case LayerKind::sigmoid:
      ops.activation_forward(Activation::sigmoid, count, in, out);
      break;
    case LayerKind::avgpool:
      ops.avgpool_forward(pool_shape(l, n), in, out);
      break;
    case LayerKind::maxpool:
      ops.maxpool_forward(pool_shape(l, n), in, out, argmax_[i].i32() + int64_t(first) * l.out_size());
      break;
    case LayerKind::batchnorm:
      batchnorm_forward(i, w, n);
      break;
    case LayerKind::flatten:
      break;
  }
  failpoint::device_call(dev_, "forward");
}

void Network::batchnorm_forward(int i, const float* w, int n) {
  Ops& ops = dev_.ops();
  const Layer& l = spec_.layers[i];
  if (!bn_ || !bn_->running) throw std::logic_error("Network: a BatchNorm layer needs a BatchNormPass");
  const int c = l.out_c, hw = l.out_h * l.out_w;
  const float* x = input(i);
  const float* gamma = n > 0 ? w : nullptr;                               // (C)
  const float* beta = n > 0 ? w + spec_.params[l.weight].size : nullptr;  // (C)
  float* running_mean = bn_->running + spec_.buffers[l.running].offset;
  float* running_var = bn_->running + spec_.buffers[l.running + 1].offset;
  if (!bn_->training)
    return ops.bn_normalize(n, c, hw, x, running_mean, running_var, gamma, beta, kBatchNormEps, acts_[i].f());
  // Each replica's partial sums scaled by 1 / the global count add up to the global mean and variance.
  const int64_t count = int64_t(bn_->all_reduce ? bn_->global_n : n) * hw;
  const float scale = float(1.0 / double(count));
  float* mean = bn_stats_[i].f();  // (C)
  float* var = mean + c;           // (C)
  auto sum = [&](float* out, const float* about) {
    if (n > 0)
      ops.bn_channel_sums(n, c, hw, x, about, scale, out);
    else
      ops.fill(c, 0.0f, out);
    if (bn_->all_reduce) dev_.synchronize(), bn_->all_reduce(out, c);
  };
  sum(mean, nullptr);
  sum(var, mean);
  if (n > 0) ops.bn_normalize(n, c, hw, x, mean, var, gamma, beta, kBatchNormEps, acts_[i].f());
  ops.bn_update_running(c, mean, var, count, kBatchNormMomentum, running_mean, running_var);
}

void Network::batchnorm_backward(int i, const float* w, const float* dy, float* dx, float* dw, float* db, int n) {
  Ops& ops = dev_.ops();
  const Layer& l = spec_.layers[i];
  const int c = l.out_c, hw = l.out_h * l.out_w;
  const float *x = input(i), *mean = bn_stats_[i].f(), *var = mean + c;
  float* sums = bn_sums_.f();  // (2, C): sum of dy (d beta), sum of dy * xhat (d gamma)
  if (n > 0)
    ops.bn_backward_sums(n, c, hw, x, mean, var, kBatchNormEps, dy, sums);
  else
    ops.fill(2 * c, 0.0f, sums);
  // The parameter gradients are this replica's share, summed over replicas with the others.
  dev_.copy(db, sums, size_t(c) * sizeof(float));
  dev_.copy(dw, sums + c, size_t(c) * sizeof(float));
  if (bn_->all_reduce) dev_.synchronize(), bn_->all_reduce(sums, 2 * c);
  const int64_t count = int64_t(bn_->all_reduce ? bn_->global_n : n) * hw;
  if (n > 0 && dx) ops.bn_backward_dx(n, c, hw, x, mean, var, kBatchNormEps, w, dy, sums, count, dx);
}

void Network::forward_step(int i, const float* w, int first, int n) {
  if (!fused(i)) return forward_layer(i, w, first, n);
  const Layer &l = spec_.layers[i], &act = spec_.layers[i + 1], &pool = spec_.layers[i + 2];
  dev_.ops().conv2d_act_pool_forward(conv_shape(l, n),
                                     act.kind == LayerKind::relu ? Activation::relu : Activation::sigmoid, pool.kernel,
                                     input(i) + int64_t(first) * l.in_size(), w, w + spec_.params[l.weight].size,
                                     acts_[i + 1].f() + int64_t(first) * act.out_size(),
                                     acts_[i + 2].f() + int64_t(first) * pool.out_size(), workspace_.f());
  failpoint::device_call(dev_, "forward");
}

void Network::backward_step(int i, const float* w, const float* dy, float* dx, float* dw, float* db, int first, int n) {
  if (!fused(i)) return backward_layer(i, w, dy, dx, dw, db, first, n);
  const Layer &l = spec_.layers[i], &act = spec_.layers[i + 1], &pool = spec_.layers[i + 2];
  dev_.ops().conv2d_act_pool_backward(
      conv_shape(l, n), act.kind == LayerKind::relu ? Activation::relu : Activation::sigmoid, pool.kernel,
      input(i) + int64_t(first) * l.in_size(), w, acts_[i + 1].f() + int64_t(first) * act.out_size(), dy,
      acts_[i].f() + (chunk_ ? 0 : int64_t(first) * l.out_size()),  // scratch
      dx, dw, db, workspace_.f());
  failpoint::device_call(dev_, "backward");
}

ParameterBlocks Network::flat(const float* params) const {
  return {[this, params](int layer) { return params + spec_.params[spec_.layers[layer].weight].offset; }, {}};
}

const float* Network::acquire(const ParameterBlocks& p, int i) const {
  return spec_.layers[i].weight >= 0 ? p.acquire(i) : nullptr;
}

void Network::release(const ParameterBlocks& p, int i) const {
  if (spec_.layers[i].weight >= 0 && p.release) p.release(i);
}

const float* Network::forward(const float* params, const float* x, int n, const BatchNormPass* bn) {
  return forward(flat(params), x, n, bn);
}

// The prefix's weights are acquired before its first chunk and released after its last, so that a
// strategy's collectives run in the same order whatever the number of chunks.
const float* Network::forward(const ParameterBlocks& p, const float* x, int n, const BatchNormPass* bn) {
  input_ = x;
  bn_ = bn;
  const int step = chunk_ ? chunk_ : n;
  std::vector<const float*> w(spec_.layers.size(), nullptr);
  for (int i : steps_) w[size_t(i)] = acquire(p, i);
  for (int first = 0; first < n; first += step)
    for (int i : steps_) forward_step(i, w[size_t(i)], first, std::min(step, n - first));
  for (int i : steps_) release(p, i);
  for (int i = prefix_; i < int(spec_.layers.size()); ++i) {
    forward_layer(i, acquire(p, i), 0, n);
    release(p, i);
  }
  return output(int(spec_.layers.size()) - 1);
}

void Network::backward_layer(int i, const float* w, const float* dy, float* dx, float* dw, float* db, int first,
                             int n) {
  Ops& ops = dev_.ops();
  const Layer& l = spec_.layers[i];
  const float* in = input(i) + int64_t(first) * l.in_size();
  const float* out = output(i) + int64_t(first) * l.out_size();
  const int64_t count = int64_t(n) * l.out_size();
  switch (l.kind) {
    case LayerKind::conv:
      ops.conv2d_backward(conv_shape(l, n), in, w, dy, dx, dw, db, workspace_.f());
      break;
    case LayerKind::linear:
      ops.linear_backward(n, int(l.in_size()), l.out_c, in, w, dy, dx, dw, db);
      break;
    case LayerKind::relu:
      ops.activation_backward(Activation::relu, count, out, dy, dx);
      break;
    case LayerKind::sigmoid:
      ops.activation_backward(Activation::sigmoid, count, out, dy, dx);
      break;
    case LayerKind::avgpool:
      ops.avgpool_backward(pool_shape(l, n), dy, dx);
      break;
    case LayerKind::maxpool:
      ops.maxpool_backward(pool_shape(l, n), dy, argmax_[i].i32() + int64_t(first) * l.out_size(), dx);
      break;
    case LayerKind::batchnorm:
      batchnorm_backward(i, w, dy, dx, dw, db, n);
      break;
    case LayerKind::flatten:
      break;
  }
  failpoint::device_call(dev_, "backward");
}

void Network::backward(const float* params, float* grads, const float* dlogits, int n,
                       const std::function<void(int)>& on_ready, const BatchNormPass* bn) {
  backward(flat(params), flat_gradients(grads), dlogits, n, on_ready, bn);
}

void Network::backward(const float* params, const GradientBlocks& blocks, const float* dlogits, int n,
                       const std::function<void(int)>& on_ready, const BatchNormPass* bn) {
  backward(flat(params), blocks, dlogits, n, on_ready, bn);
}

GradientBlocks Network::flat_gradients(float* grads) const {
  return [this, grads](int layer) { return grads + spec_.params[spec_.layers[layer].weight].offset; };
}

void Network::backward(const ParameterBlocks& p, const GradientBlocks& blocks, const float* dlogits, int n,
                       const std::function<void(int)>& on_ready, const BatchNormPass* bn) {
  bn_ = bn;
  const float* dy = dlogits;  // gradient w.r.t. the current layer's output, (n, out_size)
  float* spare[2] = {grad_a_.f(), grad_b_.f()};
  int next = 0;
  // A layer's weight gradient where `blocks` puts it, its bias gradient right after.
  auto dw_of = [&](const Layer& l) { return l.weight >= 0 ? blocks(int(&l - spec_.layers.data())) : nullptr; };
  auto db_of = [&](const Layer& l) { return l.bias >= 0 ? dw_of(l) + spec_.params[l.weight].size : nullptr; };
  // Adding (a prefix chunk after the first, or accumulating): a layer's gradients go to sum_grads_
  // first, then are added to where they go.
  float* sum_w = sum_grads_ ? sum_grads_.f() : nullptr;
  auto sum_b = [&](const Layer& l) { return l.bias >= 0 ? sum_w + spec_.params[l.weight].size : nullptr; };
  auto add_on = [&](const Layer& l) {
    const int64_t count = spec_.params[l.weight].size + (l.bias >= 0 ? spec_.params[l.bias].size : 0);
    dev_.ops().add(count, sum_w, dw_of(l));  // the bias gradient right after the weights', in both
  };
  // The layers after the prefix, on the whole batch.
  for (int i = int(spec_.layers.size()) - 1; i >= prefix_; --i) {
    const Layer& l = spec_.layers[i];
    if (l.kind == LayerKind::flatten) continue;
    float* dx = i > 0 ? spare[next] : nullptr;
    const bool sum = accumulating_ && l.weight >= 0;
    backward_layer(i, acquire(p, i), dy, dx, sum ? sum_w : dw_of(l), sum ? sum_b(l) : db_of(l), 0, n);
    if (sum) add_on(l);
    if (l.weight >= 0 && on_ready) on_ready(i);
    release(p, i);
    if (dx) dy = dx, next ^= 1;
  }
  if (prefix_ == 0) return;
  // The prefix, chunk by chunk (unchunked: the whole batch as one chunk, through the same ping-pong
  // as the layers after it). The first chunk writes each layer's weight gradients into grads, the
  // others into sum_grads_, added on. Its weights are acquired before the first chunk and released
  // after the last, as in forward.
  std::vector<const float*> w(spec_.layers.size(), nullptr);
  for (auto st = steps_.rbegin(); st != steps_.rend(); ++st) w[size_t(*st)] = acquire(p, *st);
  const int step = chunk_ ? chunk_ : n;
  float* prefix_spare[2] = {chunk_ ? chunk_a_.f() : spare[next], chunk_ ? chunk_b_.f() : spare[next ^ 1]};
  for (int first = 0; first < n; first += step) {
    const int m = std::min(step, n - first);
    const float* dyc = dy + int64_t(first) * spec_.layers[prefix_ - 1].out_size();
    int nextc = 0;
    for (auto st = steps_.rbegin(); st != steps_.rend(); ++st) {
      const int i = *st;
      const Layer& l = spec_.layers[i];
      float* dx = i > 0 ? prefix_spare[nextc] : nullptr;
      const bool sum = (first > 0 || accumulating_) && l.weight >= 0;
      backward_step(i, w[size_t(i)], dyc, dx, sum ? sum_w : dw_of(l), sum ? sum_b(l) : db_of(l), first, m);
      if (sum) add_on(l);
      if (l.weight >= 0 && on_ready && first + m == n) on_ready(i);  // its last chunk
      if (dx) dyc = dx, nextc ^= 1;
    }
  }
  for (auto st = steps_.rbegin(); st != steps_.rend(); ++st) release(p, *st);
}

void Network::forward_without_samples(const BatchNormPass* bn, const ParameterBlocks* p) {
  bn_ = bn;
  const bool sync = bn && bn->all_reduce && bn->training;
  // The collectives of a pass with samples, in its order: each layer's weights, then its BatchNorm's sums.
  for (int i = 0; i < int(spec_.layers.size()); ++i) {
    if (p) acquire(*p, i);
    if (sync && spec_.layers[i].kind == LayerKind::batchnorm) batchnorm_forward(i, nullptr, 0);
    if (p) release(*p, i);
  }
}

void Network::backward_without_samples(float* grads, const std::function<void(int)>& on_ready,
                                       const BatchNormPass* bn) {
  backward_without_samples(flat_gradients(grads), on_ready, bn);
}

void Network::backward_without_samples(const GradientBlocks& blocks, const std::function<void(int)>& on_ready,
                                       const BatchNormPass* bn, const ParameterBlocks* p) {
  bn_ = bn;
  // The collectives of a pass with samples, in its order: after the prefix layer by layer, then the
  // prefix's weights acquired together, its gradients ready in turn, its weights released.
  // Accumulating, they are written to sum_grads_ and added on, as with samples.
  auto zero_and_ready = [&](int i) {
    const Layer& l = spec_.layers[i];
    float* dw = accumulating_ ? sum_grads_.f() : blocks(i);
    const int64_t w = spec_.params[l.weight].size, b = l.bias >= 0 ? spec_.params[l.bias].size : 0;
    dev_.ops().fill(w + b, 0.0f, dw);
    if (l.kind == LayerKind::batchnorm && bn && bn->all_reduce)
      batchnorm_backward(i, nullptr, nullptr, nullptr, dw, dw + w, 0);
    if (accumulating_) dev_.ops().add(w + b, dw, blocks(i));
    dev_.synchronize();
    if (on_ready) on_ready(i);
  };
  for (int i = int(spec_.layers.size()) - 1; i >= prefix_; --i) {
    if (spec_.layers[i].weight < 0) continue;
    if (p) acquire(*p, i);
    zero_and_ready(i);
    if (p) release(*p, i);
  }
  for (auto st = steps_.rbegin(); p && st != steps_.rend(); ++st) acquire(*p, *st);
  for (auto st = steps_.rbegin(); st != steps_.rend(); ++st)
    if (spec_.layers[*st].weight >= 0) zero_and_ready(*st);
  for (auto st = steps_.rbegin(); p && st != steps_.rend(); ++st) release(*p, *st);
}

}  // namespace dp
