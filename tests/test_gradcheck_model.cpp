// The finite-difference gradient check of the whole model, in double on the CPU reference kernels:
// d loss / d params of lenet and lenet5 against central differences of the mean cross-entropy, with
// kinks (a ReLU's zero, a change of max-pool winner) detected exactly, and the checker's teeth shown.
// The step and the tolerance are derived in gradcheck.h.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "models/model.h"
#include "tests/gradcheck.h"

namespace dp::test {
namespace {

using DVec = std::vector<double>;

// engine/network.cpp's layer walk in double over the dp::cpu templates: the same ConvShape/PoolShape
// construction, flatten as a view, dx not computed for the first layer.
class DoubleNet {
 public:
  DoubleNet(const ModelSpec& spec, int n) : spec_(spec), n_(n) {
    int64_t ws = 0;
    for (const Layer& l : spec.layers) {
      acts_.emplace_back(l.kind == LayerKind::flatten ? 0 : size_t(n * l.out_size()));
      bn_stats_.emplace_back();
      argmax_.emplace_back(l.kind == LayerKind::maxpool ? size_t(n * l.out_size()) : 0);
      if (l.kind == LayerKind::conv) ws = std::max(ws, cpu::conv2d_workspace_size(conv_shape(l)));
    }
    ws_.resize(size_t(ws));
  }

  // Mean cross-entropy of x (n, C, H, W) against labels (n); dlogits (n, classes) = d loss / d logits.
  double loss(const double* params, const double* x, const int32_t* labels, double* dlogits) {
    input_ = x;
    for (size_t i = 0; i < spec_.layers.size(); ++i) {
      const Layer& l = spec_.layers[i];
      const double* in = input(int(i));
      double* out = acts_[i].data();
      const int64_t count = int64_t(n_) * l.out_size();
      switch (l.kind) {
        case LayerKind::conv:
          cpu::conv2d_forward(conv_shape(l), in, weight(params, l), bias(params, l), out, ws_.data());
          break;
        case LayerKind::linear:
          cpu::linear_forward(n_, int(l.in_size()), l.out_c, in, weight(params, l), bias(params, l), out);
          break;
        case LayerKind::relu:
          cpu::activation_forward(Activation::relu, count, in, out);
          break;
        case LayerKind::sigmoid:
          cpu::activation_forward(Activation::sigmoid, count, in, out);
          break;
        case LayerKind::avgpool:
          cpu::avgpool_forward(pool_shape(l), in, out);
          break;
        case LayerKind::maxpool:
          cpu::maxpool_forward(pool_shape(l), in, out, argmax_[i].data());
          break;
        case LayerKind::batchnorm: {  // training: the batch's statistics, as engine/network.cpp
          const int c = l.out_c, hw = l.out_h * l.out_w;
          const double scale = 1.0 / double(int64_t(n_) * hw);
          DVec& st = bn_stats_[i];  // mean (C), var (C)
          st.assign(2 * size_t(c), 0.0);
          cpu::bn_channel_sums(n_, c, hw, in, static_cast<const double*>(nullptr), scale, st.data());
          cpu::bn_channel_sums(n_, c, hw, in, st.data(), scale, st.data() + c);
          cpu::bn_normalize(n_, c, hw, in, st.data(), st.data() + c, weight(params, l), bias(params, l),
                            double(kBatchNormEps), out);
          break;
        }
        case LayerKind::flatten:
          break;
      }
    }
    double stats[2] = {0.0, 0.0};
    cpu::softmax_xent(n_, spec_.classes, output(int(spec_.layers.size()) - 1), labels, 1.0 / n_, dlogits, stats);
    return stats[0];
  }

  // grads (P) = d loss / d params, from the dlogits of the last loss().
  void backward(const double* params, const double* dlogits, double* grads) {
    int64_t widest = 0;
    for (const Layer& l : spec_.layers) widest = std::max({widest, l.in_size(), l.out_size()});
    DVec dx_buf = zeros(n_ * widest), dy_buf = zeros(n_ * widest);
    std::copy(dlogits, dlogits + n_ * spec_.classes, dy_buf.begin());
    for (int i = int(spec_.layers.size()) - 1; i >= 0; --i) {
      const Layer& l = spec_.layers[i];
      if (l.kind == LayerKind::flatten) continue;
      const double* dy = dy_buf.data();
      double* dx = i > 0 ? dx_buf.data() : nullptr;
      const int64_t count = int64_t(n_) * l.out_size();
      switch (l.kind) {
        case LayerKind::conv:
          cpu::conv2d_backward(conv_shape(l), input(i), weight(params, l), dy, dx,
                               grads + spec_.params[l.weight].offset, grads + spec_.params[l.bias].offset, ws_.data());
          break;
        case LayerKind::linear:
          cpu::linear_backward(n_, int(l.in_size()), l.out_c, input(i), weight(params, l), dy, dx,
                               grads + spec_.params[l.weight].offset, grads + spec_.params[l.bias].offset);
          break;
        case LayerKind::relu:
          cpu::activation_backward(Activation::relu, count, output(i), dy, dx);
          break;
        case LayerKind::sigmoid:
          cpu::activation_backward(Activation::sigmoid, count, output(i), dy, dx);
          break;
        case LayerKind::avgpool:
          cpu::avgpool_backward(pool_shape(l), dy, dx);
          break;
        case LayerKind::maxpool:
          cpu::maxpool_backward(pool_shape(l), dy, argmax_[i].data(), dx);
          break;
        case LayerKind::batchnorm: {
          const int c = l.out_c, hw = l.out_h * l.out_w;
          const double *mean = bn_stats_[i].data(), *var = mean + c;
          DVec sums(2 * size_t(c));  // d beta, d gamma
          cpu::bn_backward_sums(n_, c, hw, input(i), mean, var, double(kBatchNormEps), dy, sums.data());
          std::copy(sums.begin(), sums.begin() + c, grads + spec_.params[l.bias].offset);
          std::copy(sums.begin() + c, sums.end(), grads + spec_.params[l.weight].offset);
          cpu::bn_backward_dx(n_, c, hw, input(i), mean, var, double(kBatchNormEps), weight(params, l), dy, sums.data(),
                              int64_t(n_) * hw, dx);
          break;
        }
        case LayerKind::flatten:
          break;
      }
      std::swap(dx_buf, dy_buf);
    }
  }

  // Which linear piece of the network the last loss() ran in: a hash of every ReLU mask and every
  // max-pool winner. Equal hashes on both sides of a central difference mean no kink was crossed.
  uint64_t region() const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (size_t i = 0; i < spec_.layers.size(); ++i) {
      if (spec_.layers[i].kind == LayerKind::relu)
        for (double y : acts_[i]) mix(y > 0.0);
      for (int32_t a : argmax_[i]) mix(uint64_t(a));
    }
    return h;
  }

 private:
  const ModelSpec& spec_;
  int n_;
  std::vector<DVec> acts_;                    // per layer: its output, (n, out_size); none for flatten
  std::vector<std::vector<int32_t>> argmax_;  // per max-pool layer: (n, out_size)
  std::vector<DVec> bn_stats_;                // per batchnorm layer: the batch's mean and variance, (2, C)
  DVec ws_;                                   // conv scratch
  const double* input_ = nullptr;

  ConvShape conv_shape(const Layer& l) const {
    return {.n = n_, .c = l.in_c, .h = l.in_h, .w = l.in_w, .k = l.out_c, .kh = l.kernel, .kw = l.kernel, .pad = l.pad};
  }
  PoolShape pool_shape(const Layer& l) const { return {.n = n_, .c = l.in_c, .h = l.in_h, .w = l.in_w, .k = l.kernel}; }
  const double* weight(const double* p, const Layer& l) const { return p + spec_.params[l.weight].offset; }
  const double* bias(const double* p, const Layer& l) const { return p + spec_.params[l.bias].offset; }
  const double* output(int i) const {
    while (i >= 0 && spec_.layers[i].kind == LayerKind::flatten) --i;  // flatten is a view
    return i < 0 ? input_ : acts_[i].data();
  }
  const double* input(int i) const { return i == 0 ? input_ : output(i - 1); }
};

// Every bias coordinate, plus a random sample of ~200 weight coordinates spread evenly over the weight
// tensors (a uniform draw over all of them would almost never touch conv1's 150-odd weights).
std::vector<int64_t> sample_coords(const ModelSpec& spec, std::mt19937_64& gen) {
  std::set<int64_t> picked;
  int weights = 0;
  for (const Param& p : spec.params) weights += p.shape.size() > 1;
  for (const Param& p : spec.params) {
    if (p.shape.size() == 1) {
      for (int64_t i = 0; i < p.size; ++i) picked.insert(p.offset + i);
      continue;
    }
    std::uniform_int_distribution<int64_t> d(0, p.size - 1);
    for (int k = 0; k < 200 / weights; ++k) picked.insert(p.offset + d(gen));
  }
  return {picked.begin(), picked.end()};
}

TEST_CASE("gradcheck: whole-model loss, lenet, lenet5 and lenet-bn (BatchNorm with the batch's statistics)") {
  for (std::string name : {"lenet", "lenet5", "lenet-bn"}) {
    CAPTURE(name);
    const ModelSpec spec = make_model(name);
    const int n = name == "lenet-bn" ? 3 : 2;  // BatchNorm1d over 2 samples normalises them to +-1: no gradient
    std::mt19937_64 gen(60);
    std::vector<float> init(static_cast<size_t>(spec.param_count));
    init_params(spec, 7, init.data());
    DVec params(init.begin(), init.end());               // (P)
    DVec x = uniform(n * spec.input_size(), 0, 1, gen);  // (N, C, H, W), pixel-like
    std::vector<int32_t> labels = {3, 8, 5};             // (N)
    labels.resize(size_t(n));
    DVec dlogits = zeros(n * spec.classes), grads = zeros(spec.param_count);

    DoubleNet net(spec, n);
    net.loss(params.data(), x.data(), labels.data(), dlogits.data());
    net.backward(params.data(), dlogits.data(), grads.data());

    const std::vector<int64_t> coords = sample_coords(spec, gen);
    auto objective = [&] { return net.loss(params.data(), x.data(), labels.data(), dlogits.data()); };
    const std::vector<Probe> probes =
        numeric_gradient(params.data(), coords, kStep, objective, {}, [&] { return net.region(); });

    GradCheckResult res = compare_gradient(grads.data(), probes, kTolerance);
    MESSAGE(name << ": " << res.checked << " parameter coordinates checked, " << res.skipped << " at a kink, max error "
                 << res.max_error);
    INFO(res.failures);
    CHECK(res.failed == 0);
    CHECK(res.checked >= int64_t(coords.size()) * 9 / 10);  // kinks are rare: the check is not hollow

    // The kink test has teeth too: a step of 0.1 on a conv1 bias moves every pre-activation of its
    // channel by 0.1, which in LeNet crosses some ReLU's zero in nearly every channel; LeNet-5 (sigmoid) has no kinks.
    const Param& b1 = *spec.find("conv1.bias");
    std::vector<int64_t> b1_coords;
    for (int64_t i = 0; i < b1.size; ++i) b1_coords.push_back(b1.offset + i);
    int64_t kinks = 0;
    for (const Probe& p : numeric_gradient(params.data(), b1_coords, 0.1, objective, {}, [&] { return net.region(); }))
      kinks += p.kink;
    if (name == "lenet")
      CHECK(kinks >= b1.size / 2);  // a channel can be all on or all off
    else if (name == "lenet-bn")
      CHECK(kinks == 0);  // BatchNorm after conv1 subtracts the batch mean: a bias moves nothing
    else
      CHECK(kinks == 0);

    // The checker has teeth: a gradient 1% off is caught.
    DVec wrong = grads;
    for (double& g : wrong) g *= 1.01;
    CHECK(compare_gradient(wrong.data(), probes, kTolerance).failed > 0);
  }
}

}  // namespace
}  // namespace dp::test
