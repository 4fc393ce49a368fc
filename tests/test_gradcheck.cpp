// Finite-difference gradient checks of each layer, in double on the CPU reference kernels: every
// layer's dx, dw, db against the numeric derivatives of L = sum(y * r) for a fixed random r, and the
// softmax cross-entropy's dlogits against its loss (the whole model: test_gradcheck_model.cpp). The
// step and the tolerance are derived in gradcheck.h.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "tests/gradcheck.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using DVec = std::vector<double>;

// ---- layers: L = sum(y * r), so dL/dy = r is the dy fed to each backward ----------------------------

void check_conv(const ConvShape& s, uint64_t seed) {
  INFO(dp::test::describe(s));
  std::mt19937_64 gen(seed);
  const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.k * s.out_h() * s.out_w();
  const int64_t wsize = int64_t(s.k) * s.c * s.kh * s.kw;
  DVec x = uniform(in, -1, 1, gen);     // (N, C, H, W)
  DVec w = uniform(wsize, -1, 1, gen);  // (K, C, KH, KW)
  DVec b = uniform(s.k, -1, 1, gen);    // (K)
  DVec r = uniform(out, -1, 1, gen);    // (N, K, OH, OW)
  DVec y = zeros(out), ws = zeros(cpu::conv2d_workspace_size(s));
  auto objective = [&] {
    cpu::conv2d_forward(s, x.data(), w.data(), b.data(), y.data(), ws.data());
    return dot(y, r);
  };
  DVec dx = zeros(in), dw = zeros(wsize), db = zeros(s.k);
  cpu::conv2d_backward(s, x.data(), w.data(), r.data(), dx.data(), dw.data(), db.data(), ws.data());
  check_gradient("conv2d dx", x.data(), in, dx.data(), objective);
  check_gradient("conv2d dw", w.data(), wsize, dw.data(), objective);
  check_gradient("conv2d db", b.data(), s.k, db.data(), objective);
}

TEST_CASE("gradcheck: conv2d dx, dw, db") {
  check_conv({.n = 2, .c = 1, .h = 6, .w = 5, .k = 3, .kh = 3, .kw = 3}, 1);            // one input channel, no padding
  check_conv({.n = 2, .c = 3, .h = 6, .w = 6, .k = 4, .kh = 3, .kw = 3, .pad = 1}, 2);  // C > 1, padding 1 ("same")
  // padding 2 as LeNet-5's conv1, kernel wider than the image
  check_conv({.n = 1, .c = 2, .h = 7, .w = 5, .k = 2, .kh = 5, .kw = 5, .pad = 2}, 3);
  check_conv({.n = 2, .c = 2, .h = 5, .w = 6, .k = 3, .kh = 2, .kw = 3}, 4);  // non-square kernel
  check_conv({.n = 1, .c = 4, .h = 9, .w = 9, .k = 5, .kh = 5, .kw = 5}, 5);  // LeNet's conv2 in miniature
}

TEST_CASE("gradcheck: linear dx, dw, db") {
  for (auto [n_, in_, out_] : {std::array{3, 7, 4}, std::array{1, 5, 1}, std::array{4, 12, 9}}) {
    const auto n = n_;  // a copy: clang 14 cannot capture a structured binding (CAPTURE)
    const auto in = in_;
    const auto out = out_;
    CAPTURE(n);
    CAPTURE(in);
    CAPTURE(out);
    std::mt19937_64 gen(uint64_t(10 + in));
    DVec x = uniform(int64_t(n) * in, -1, 1, gen);    // (N, IN)
    DVec w = uniform(int64_t(out) * in, -1, 1, gen);  // (OUT, IN)
    DVec b = uniform(out, -1, 1, gen);                // (OUT)
    DVec r = uniform(int64_t(n) * out, -1, 1, gen);   // (N, OUT)
    DVec y(r.size());
    auto objective = [&] {
      cpu::linear_forward(n, in, out, x.data(), w.data(), b.data(), y.data());
      return dot(y, r);
    };
    DVec dx(x.size()), dw(w.size()), db(b.size());
    cpu::linear_backward(n, in, out, x.data(), w.data(), r.data(), dx.data(), dw.data(), db.data());
    check_gradient("linear dx", x.data(), int64_t(x.size()), dx.data(), objective);
    check_gradient("linear dw", w.data(), int64_t(w.size()), dw.data(), objective);
    check_gradient("linear db", b.data(), out, db.data(), objective);
  }
}

TEST_CASE("gradcheck: relu, skipping inputs within a step of the kink") {
  std::mt19937_64 gen(20);
  const int64_t n = 200;
  DVec x = uniform(n, -2, 2, gen), r = uniform(n, -1, 1, gen), y = zeros(n), dx = zeros(n);
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
  DVec x = uniform(n, -8, 8, gen), r = uniform(n, -1, 1, gen), y = zeros(n), dx = zeros(n);
  x[0] = 0.0, x[1] = 30.0, x[2] = -30.0;
  auto objective = [&] {
    cpu::activation_forward(Activation::sigmoid, n, x.data(), y.data());
    return dot(y, r);
  };
  objective();
  cpu::activation_backward(Activation::sigmoid, n, y.data(), r.data(), dx.data());
  check_gradient("sigmoid dx", x.data(), n, dx.data(), objective);
}

// Square windows of 2 and 3, with rows and columns past the last window.
const PoolShape kPools[] = {{.n = 2, .c = 2, .h = 4, .w = 4, .k = 2},
                            {.n = 2, .c = 3, .h = 5, .w = 6, .k = 2},
                            {.n = 1, .c = 2, .h = 7, .w = 6, .k = 3}};

TEST_CASE("gradcheck: avgpool, including rows and columns past the last window") {
  for (const PoolShape& s : kPools) {
    CAPTURE(s.h);
    CAPTURE(s.w);
    CAPTURE(s.k);
    std::mt19937_64 gen(uint64_t(30 + s.h));
    const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.c * s.out_h() * s.out_w();
    DVec x = uniform(in, -1, 1, gen), r = uniform(out, -1, 1, gen), y = zeros(out), dx = zeros(in);
    auto objective = [&] {
      cpu::avgpool_forward(s, x.data(), y.data());
      return dot(y, r);
    };
    cpu::avgpool_backward(s, r.data(), dx.data());
    check_gradient("avgpool dx", x.data(), in, dx.data(), objective);
  }
}

TEST_CASE("gradcheck: maxpool, skipping windows whose two largest are within 2 steps") {
  for (const PoolShape& s : kPools) {
    CAPTURE(s.h);
    CAPTURE(s.w);
    CAPTURE(s.k);
    std::mt19937_64 gen(uint64_t(40 + s.h));
    const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.c * s.out_h() * s.out_w();
    DVec x = uniform(in, -1, 1, gen), r = uniform(out, -1, 1, gen), y = zeros(out), dx = zeros(in);
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
    DVec z = uniform(int64_t(n) * classes, -4, 4, gen);  // (N, CLASSES)
    z[5] = 40.0;                                         // one confident row
    std::vector<int32_t> labels = {2, 0, 6, 3};          // (N)
    DVec dz(z.size()), stats(2);
    auto objective = [&] {
      stats = {0.0, 0.0};
      cpu::softmax_xent(n, classes, z.data(), labels.data(), scale, dz.data(), stats.data());
      return stats[0];
    };
    objective();
    DVec analytic = dz;
    check_gradient("softmax_xent dlogits", z.data(), int64_t(z.size()), analytic.data(), objective);
  }
}

}  // namespace
}  // namespace dp::test
