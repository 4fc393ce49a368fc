// Finite-difference gradient checks, in double on the CPU reference kernels: every layer's dx, dw, db
// against the numeric derivatives of L = sum(y * r) for a fixed random r, the softmax cross-entropy's
// dlogits against its loss, and the whole model's d loss / d params for lenet and lenet5. The step and
// the tolerance are derived in gradcheck.h.
#include <doctest/doctest.h>

#include "tests/util.h"

#include <algorithm>
#include <array>
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

using Vec = std::vector<double>;

Vec uniform(int64_t n, double lo, double hi, std::mt19937_64& gen) {
  std::uniform_real_distribution<double> d(lo, hi);
  Vec v(size_t(n), 0.0);
  for (auto& x : v) x = d(gen);
  return v;
}

Vec zeros(int64_t n) { return Vec(static_cast<size_t>(n), 0.0); }

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- layers: L = sum(y * r), so dL/dy = r is the dy fed to each backward ----------------------------

void check_conv(const ConvShape& s, uint64_t seed) {
  INFO(dp::test::describe(s));
  std::mt19937_64 gen(seed);
  const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.k * s.out_h() * s.out_w();
  const int64_t wsize = int64_t(s.k) * s.c * s.kh * s.kw;
  Vec x = uniform(in, -1, 1, gen);     // (N, C, H, W)
  Vec w = uniform(wsize, -1, 1, gen);  // (K, C, KH, KW)
  Vec b = uniform(s.k, -1, 1, gen);    // (K)
  Vec r = uniform(out, -1, 1, gen);    // (N, K, OH, OW)
  Vec y = zeros(out), ws = zeros(cpu::conv2d_workspace_size(s));
  auto objective = [&] {
    cpu::conv2d_forward(s, x.data(), w.data(), b.data(), y.data(), ws.data());
    return dot(y, r);
  };
  Vec dx = zeros(in), dw = zeros(wsize), db = zeros(s.k);
  cpu::conv2d_backward(s, x.data(), w.data(), r.data(), dx.data(), dw.data(), db.data(), ws.data());
  check_gradient("conv2d dx", x.data(), in, dx.data(), objective);
  check_gradient("conv2d dw", w.data(), wsize, dw.data(), objective);
  check_gradient("conv2d db", b.data(), s.k, db.data(), objective);
}

ConvShape conv(int n, int c, int h, int w, int k, int kh, int kw, int pad) {
  ConvShape s;
  s.n = n, s.c = c, s.h = h, s.w = w, s.k = k, s.kh = kh, s.kw = kw, s.pad = pad;
  return s;
}

TEST_CASE("gradcheck: conv2d dx, dw, db") {
  check_conv(conv(2, 1, 6, 5, 3, 3, 3, 0), 1);  // one input channel, no padding
  check_conv(conv(2, 3, 6, 6, 4, 3, 3, 1), 2);  // C > 1, padding 1 ("same")
  check_conv(conv(1, 2, 7, 5, 2, 5, 5, 2), 3);  // padding 2 as LeNet-5's conv1, kernel wider than the image
  check_conv(conv(2, 2, 5, 6, 3, 2, 3, 0), 4);  // non-square kernel
  check_conv(conv(1, 4, 9, 9, 5, 5, 5, 0), 5);  // LeNet's conv2 in miniature
}

TEST_CASE("gradcheck: linear dx, dw, db") {
  for (auto [n, in, out] : {std::array{3, 7, 4}, std::array{1, 5, 1}, std::array{4, 12, 9}}) {
    CAPTURE(n);
    CAPTURE(in);
    CAPTURE(out);
    std::mt19937_64 gen(uint64_t(10 + in));
    Vec x = uniform(int64_t(n) * in, -1, 1, gen);    // (N, IN)
    Vec w = uniform(int64_t(out) * in, -1, 1, gen);  // (OUT, IN)
    Vec b = uniform(out, -1, 1, gen);                // (OUT)
    Vec r = uniform(int64_t(n) * out, -1, 1, gen);   // (N, OUT)
    Vec y(r.size());
    auto objective = [&] {
      cpu::linear_forward(n, in, out, x.data(), w.data(), b.data(), y.data());
      return dot(y, r);
    };
    Vec dx(x.size()), dw(w.size()), db(b.size());
    cpu::linear_backward(n, in, out, x.data(), w.data(), r.data(), dx.data(), dw.data(), db.data());
    check_gradient("linear dx", x.data(), int64_t(x.size()), dx.data(), objective);
    check_gradient("linear dw", w.data(), int64_t(w.size()), dw.data(), objective);
    check_gradient("linear db", b.data(), out, db.data(), objective);
  }
}

TEST_CASE("gradcheck: relu, skipping inputs within a step of the kink") {
  std::mt19937_64 gen(20);
  const int64_t n = 200;
  Vec x = uniform(n, -2, 2, gen), r = uniform(n, -1, 1, gen), y = zeros(n), dx = zeros(n);
  x[3] = 0.0, x[7] = 0.3 * kStep, x[11] = -0.9 * kStep;  // on or beside the kink: must be skipped
  auto objective = [&] {
    cpu::activation_forward(Activation::relu, n, x.data(), y.data());
    return dot(y, r);
  };
  objective();
  cpu::activation_backward(Activation::relu, n, y.data(), r.data(), dx.data());
  auto at_kink = [&](int64_t i) { return std::fabs(x[size_t(i)]) < kStep; };
  GradCheckResult res = check_gradient("relu dx", x.data(), n, dx.data(), objective, at_kink);
  CHECK(res.skipped == 3);
  // Without the kink test the central difference straddles 0 and disagrees: the skip is what
  // keeps this test honest, not a loose tolerance.
  CHECK(compare_gradient(dx.data(), numeric_gradient(x.data(), {7}, kStep, objective), kTolerance).failed == 1);
}

TEST_CASE("gradcheck: sigmoid") {
  std::mt19937_64 gen(21);
  const int64_t n = 200;
  Vec x = uniform(n, -8, 8, gen), r = uniform(n, -1, 1, gen), y = zeros(n), dx = zeros(n);
  x[0] = 0.0, x[1] = 30.0, x[2] = -30.0;
  auto objective = [&] {
    cpu::activation_forward(Activation::sigmoid, n, x.data(), y.data());
    return dot(y, r);
  };
  objective();
  cpu::activation_backward(Activation::sigmoid, n, y.data(), r.data(), dx.data());
  check_gradient("sigmoid dx", x.data(), n, dx.data(), objective);
}

PoolShape pool(int n, int c, int h, int w, int k) {
  PoolShape s;
  s.n = n, s.c = c, s.h = h, s.w = w, s.k = k;
  return s;
}

TEST_CASE("gradcheck: avgpool, including rows and columns past the last window") {
  for (PoolShape s : {pool(2, 2, 4, 4, 2), pool(2, 3, 5, 6, 2), pool(1, 2, 7, 6, 3)}) {
    CAPTURE(s.h);
    CAPTURE(s.w);
    CAPTURE(s.k);
    std::mt19937_64 gen(uint64_t(30 + s.h));
    const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.c * s.out_h() * s.out_w();
    Vec x = uniform(in, -1, 1, gen), r = uniform(out, -1, 1, gen), y = zeros(out), dx = zeros(in);
    auto objective = [&] {
      cpu::avgpool_forward(s, x.data(), y.data());
      return dot(y, r);
    };
    cpu::avgpool_backward(s, r.data(), dx.data());
    check_gradient("avgpool dx", x.data(), in, dx.data(), objective);
  }
}

TEST_CASE("gradcheck: maxpool, skipping windows whose two largest are within 2 steps") {
  for (PoolShape s : {pool(2, 2, 4, 4, 2), pool(2, 3, 5, 6, 2), pool(1, 2, 7, 6, 3)}) {
    CAPTURE(s.h);
    CAPTURE(s.w);
    CAPTURE(s.k);
    std::mt19937_64 gen(uint64_t(40 + s.h));
    const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.c * s.out_h() * s.out_w();
    Vec x = uniform(in, -1, 1, gen), r = uniform(out, -1, 1, gen), y = zeros(out), dx = zeros(in);
    x[0] = x[1] = 5.0;  // a tie in the first window: not differentiable there, must be skipped
    std::vector<int32_t> argmax(static_cast<size_t>(out));
    auto objective = [&] {
      cpu::maxpool_forward(s, x.data(), y.data(), argmax.data());
      return dot(y, r);
    };
    objective();
    cpu::maxpool_backward(s, r.data(), argmax.data(), dx.data());
    // Perturbing any element of a window by h can change its winner only if the two largest are
    // within 2h of each other; elements outside every window (past OH*k, OW*k) have no kink.
    auto at_kink = [&](int64_t i) {
      const int64_t plane = i / (s.h * s.w), row = i / s.w % s.h, col = i % s.w;
      if (row >= s.out_h() * s.k || col >= s.out_w() * s.k) return false;
      const double* xp = x.data() + plane * s.h * s.w;  // (H, W)
      double top = -INFINITY, second = -INFINITY;
      for (int a = 0; a < s.k; ++a)
        for (int b = 0; b < s.k; ++b) {
          double v = xp[(row / s.k * s.k + a) * s.w + col / s.k * s.k + b];
          if (v > top)
            second = top, top = v;
          else if (v > second)
            second = v;
        }
      return top - second < 2 * kStep;
    };
    GradCheckResult res = check_gradient("maxpool dx", x.data(), in, dx.data(), objective, at_kink);
    CHECK(res.skipped >= s.k * s.k);  // at least the tied window
  }
}

TEST_CASE("gradcheck: softmax cross-entropy dlogits, with scale") {
  for (double scale : {1.0, 0.25, 1.0 / 3.0}) {
    CAPTURE(scale);
    const int n = 4, classes = 7;
    std::mt19937_64 gen(50);
    Vec z = uniform(int64_t(n) * classes, -4, 4, gen);  // (N, CLASSES)
    z[5] = 40.0;                                        // one confident row
    std::vector<int32_t> labels = {2, 0, 6, 3};         // (N)
    Vec dz(z.size()), stats(2);
    auto objective = [&] {
      stats = {0.0, 0.0};
      cpu::softmax_xent(n, classes, z.data(), labels.data(), scale, dz.data(), stats.data());
      return stats[0];
    };
    objective();
    Vec analytic = dz;
    check_gradient("softmax_xent dlogits", z.data(), int64_t(z.size()), analytic.data(), objective);
  }
}

// ---- the whole model ------------------------------------------------------------------------------

// engine/network.cpp's layer walk in double over the dp::cpu templates: the same ConvShape/PoolShape
// construction, flatten as a view, dx not computed for the first layer.
class DoubleNet {
 public:
  DoubleNet(const ModelSpec& spec, int n) : spec_(spec), n_(n) {
    int64_t ws = 0;
    for (const Layer& l : spec.layers) {
      acts_.emplace_back(l.kind == LayerKind::flatten ? 0 : size_t(n * l.out_size()));
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
    Vec dx_buf = zeros(n_ * widest), dy_buf = zeros(n_ * widest);
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
  std::vector<Vec> acts_;                     // per layer: its output, (n, out_size); none for flatten
  std::vector<std::vector<int32_t>> argmax_;  // per max-pool layer: (n, out_size)
  Vec ws_;                                    // conv scratch
  const double* input_ = nullptr;

  ConvShape conv_shape(const Layer& l) const {
    return conv(n_, l.in_c, l.in_h, l.in_w, l.out_c, l.kernel, l.kernel, l.pad);
  }
  PoolShape pool_shape(const Layer& l) const { return pool(n_, l.in_c, l.in_h, l.in_w, l.kernel); }
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

TEST_CASE("gradcheck: whole-model loss, lenet and lenet5") {
  for (std::string name : {"lenet", "lenet5"}) {
    CAPTURE(name);
    const ModelSpec spec = make_model(name);
    const int n = 2;
    std::mt19937_64 gen(60);
    std::vector<float> init(static_cast<size_t>(spec.param_count));
    init_params(spec, 7, init.data());
    Vec params(init.begin(), init.end());               // (P)
    Vec x = uniform(n * spec.input_size(), 0, 1, gen);  // (N, C, H, W), pixel-like
    std::vector<int32_t> labels = {3, 8};               // (N)
    Vec dlogits = zeros(n * spec.classes), grads = zeros(spec.param_count);

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
    else
      CHECK(kinks == 0);

    // The checker has teeth: a gradient 1% off is caught.
    Vec wrong = grads;
    for (double& g : wrong) g *= 1.01;
    CHECK(compare_gradient(wrong.data(), probes, kTolerance).failed > 0);
  }
}

}  // namespace
}  // namespace dp::test
