// Activations and pooling over the op matrix (tests/ops_matrix.h): values worked out by hand (ReLU at
// -0 and 0, sigmoid in both tails, average pooling's floor mode, max pooling's first-maximum rule);
// ReLU, sigmoid and their gradients over the whole float range, NaN and infinities, against the
// reference; average and max pooling on odd shapes against the float reference, value for value.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;
const float kInf = std::numeric_limits<float>::infinity();

Vec act_forward(Backend& be, Activation a, const Vec& x) {
  Mem gx = be.put(x), gy = be.out(x.size());
  be.run([&](Ops& ops) { ops.activation_forward(a, int64_t(x.size()), gx.f(), gy.f()); });
  return be.get(gy);
}
Vec act_backward(Backend& be, Activation a, const Vec& y, const Vec& dy) {
  Mem gy = be.put(y), gdy = be.put(dy), gdx = be.out(y.size());
  be.run([&](Ops& ops) { ops.activation_backward(a, int64_t(y.size()), gy.f(), gdy.f(), gdx.f()); });
  return be.get(gdx);
}
bool all_finite(Backend& be, const Vec& v) {
  Mem g = be.put(v);
  bool yes = false;
  be.run([&](Ops& ops) { yes = ops.all_finite(int64_t(v.size()), g.f()); });
  return yes;
}

DP_OPS_TEST("activation: relu and sigmoid values, sigmoid stable in both tails") {
  const Vec y = act_forward(be, Activation::relu, {-2.0f, -0.0f, 0.0f, 0.5f, 3.0f});
  CHECK(y == Vec{0, 0, 0, 0.5f, 3});
  // passes where the output is positive (PyTorch: x > 0)
  CHECK(act_backward(be, Activation::relu, y, {10, 20, 30, 40, 50}) == Vec{0, 0, 0, 40, 50});

  const Vec z = {0.0f, 2.0f, -2.0f, 100.0f, -100.0f, 1000.0f, -1000.0f, kInf, -kInf};
  const Vec s = act_forward(be, Activation::sigmoid, z);
  CHECK(s[0] == 0.5f);
  CHECK(s[1] == doctest::Approx(0.8807970779778823).epsilon(1e-6));
  CHECK(s[1] + s[2] == doctest::Approx(1.0).epsilon(1e-6));  // sigmoid(-x) = 1 - sigmoid(x)
  CHECK(s[3] == 1.0f);
  CHECK(s[5] == 1.0f);
  CHECK(s[7] == 1.0f);
  for (size_t i : {4u, 6u, 8u}) {  // the negative tail: tiny (e^-100 is a float denormal) or 0
    CHECK(s[i] >= 0.0f);
    CHECK(s[i] < 1e-30f);
  }
  CHECK(all_finite(be, s));
  const Vec ds = act_backward(be, Activation::sigmoid, s, Vec(z.size(), 1.0f));
  CHECK(ds[0] == 0.25f);  // y (1 - y) at y = 1/2
  CHECK(all_finite(be, ds));
}

DP_OPS_TEST("activation: over the float range, NaN and infinities, against the reference") {
  // The sample: a dense sweep of [-120, 120] (both exp tails, the subnormal region past -87), the
  // points where the formula switches, powers of two, and the specials; 2.4 million values, past
  // the CUDA grid's cap, and not a multiple of any vector width, so the tail paths run. Its prefixes
  // of 1 and 1000 values check the small launches.
  Vec x;
  for (int i = -1'200'000; i <= 1'200'000; ++i) x.push_back(float(i) * 1e-4f);
  for (int e = -149; e < 128; ++e) x.push_back(std::ldexp(1.0f, e)), x.push_back(-std::ldexp(1.0f, e));
  for (float v : {0.0f, -0.0f, kInf, -kInf, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()})
    x.push_back(v);
  x.push_back(kNaN);
  const size_t total = x.size();
  const Vec dy = random_floats(total, 5, -1, 1);
  Vec ref_relu(total), ref_sig(total), ref_relu_dx(total), ref_sig_dx(total);  // the float reference
  cpu::activation_forward(Activation::relu, int64_t(total), x.data(), ref_relu.data());
  cpu::activation_forward(Activation::sigmoid, int64_t(total), x.data(), ref_sig.data());
  cpu::activation_backward(Activation::relu, int64_t(total), ref_relu.data(), dy.data(), ref_relu_dx.data());
  cpu::activation_backward(Activation::sigmoid, int64_t(total), ref_sig.data(), dy.data(), ref_sig_dx.data());
  auto prefix = [](const Vec& v, size_t n) { return Vec(v.begin(), v.begin() + ptrdiff_t(n)); };

  SUBCASE("sigmoid forward within 7u relative (plus 2^-126 absolute in the subnormal tail)") {
    // exp(-|x|) = z within 2 ulp (4u relative: Cephes' expf on the fast path, the CUDA guide's
    // expf; glibc's is within 1). 1/(1 + z) passes half of z's error on, z/(1 + z) all of it, and
    // the addition and the division round once each: 6u to first order, one u more for the second
    // order. Past -87 z is subnormal, where a relative bound means nothing (AVX2 flushes it to zero,
    // AVX-512 and CUDA round into subnormals): an absolute 2^-126 covers both.
    for (size_t n : {size_t(1), size_t(1000), total}) {
      CAPTURE(n);
      const Vec y = act_forward(be, Activation::sigmoid, prefix(x, n));
      std::vector<double> want(n), tol(n);
      for (size_t i = 0; i < n; ++i) {
        want[i] = std::isnan(x[i]) ? 0.0 : math::sigmoid(double(x[i]));  // exact to 2^-53 relative
        tol[i] = 7 * kU * want[i] + std::ldexp(1.0, -126);
      }
      if (n == total) {
        CHECK(std::isnan(y[n - 1]));  // NaN in, NaN out
        CHECK(y[n - 9] == 0.5f);      // sigmoid(+-0) is exactly 1/2
        CHECK(y[n - 8] == 0.5f);
        n -= 1;  // the NaN is not compared by value
      }
      check_close("sigmoid", prefix(y, n), std::vector<double>(want.begin(), want.begin() + ptrdiff_t(n)),
                  std::vector<double>(tol.begin(), tol.begin() + ptrdiff_t(n)));
    }
  }
  SUBCASE("relu forward, relu and sigmoid backward: the reference's bits") {
    // The same formulas as math.h in the same order of operations, and no multiply-add to fuse:
    // nothing to round differently. The backward runs from the reference's output, isolating it.
    for (size_t n : {size_t(1), size_t(1000), total}) {
      CAPTURE(n);
      check_same_bits("relu", act_forward(be, Activation::relu, prefix(x, n)), prefix(ref_relu, n));
      check_same_bits("relu dx", act_backward(be, Activation::relu, prefix(ref_relu, n), prefix(dy, n)),
                      prefix(ref_relu_dx, n));
      check_same_bits("sigmoid dx", act_backward(be, Activation::sigmoid, prefix(ref_sig, n), prefix(dy, n)),
                      prefix(ref_sig_dx, n));
    }
  }
  SUBCASE("n = 0 touches nothing") {
    Mem gx = be.put(prefix(x, 8)), gy = be.out(0);
    be.run([&](Ops& ops) {
      ops.activation_forward(Activation::sigmoid, 0, gx.f(), gy.f());
      ops.activation_backward(Activation::relu, 0, gx.f(), gx.f(), gy.f());
    });
    be.get(gy);  // the guard
  }
}

// ---- pooling --------------------------------------------------------------------------------------

struct Pooled {
  Vec avg_y, avg_dx, max_y, max_dx;
  std::vector<int32_t> argmax;
};
Pooled pool(Backend& be, const PoolShape& s, const Vec& x, const Vec& dy) {
  const size_t in = x.size(), out = dy.size();
  Mem gx = be.put(x), gdy = be.put(dy), ay = be.out(out), adx = be.out(in), my = be.out(out), mdx = be.out(in);
  Mem arg = be.out_i32(out);
  be.run([&](Ops& ops) {
    ops.avgpool_forward(s, gx.f(), ay.f());
    ops.avgpool_backward(s, gdy.f(), adx.f());
    ops.maxpool_forward(s, gx.f(), my.f(), arg.i32());
    ops.maxpool_backward(s, gdy.f(), arg.i32(), mdx.f());
  });
  return {be.get(ay), be.get(adx), be.get(my), be.get(mdx), be.get_i32(arg)};
}

DP_OPS_TEST("pool: average values and zero gradient past the last window, max's first maximum wins") {
  SUBCASE("average") {
    Vec x(16);
    for (int i = 0; i < 16; ++i) x[size_t(i)] = float(i);  // (1, 1, 4, 4) ramp
    CHECK(pool(be, {.n = 1, .c = 1, .h = 4, .w = 4, .k = 2}, x, Vec(4)).avg_y == Vec{2.5f, 4.5f, 10.5f, 12.5f});
    // floor mode: row 4 and column 4 are never read, and get a zero gradient
    const Vec dy = {4.0f, 8.0f, 12.0f, 16.0f};
    const Vec dx = pool(be, {.n = 1, .c = 1, .h = 5, .w = 5, .k = 2}, Vec(25), dy).avg_dx;
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 5; ++j) {
        const float want = (i < 4 && j < 4) ? dy[size_t((i / 2) * 2 + j / 2)] / 4.0f : 0.0f;
        CHECK(dx[size_t(i * 5 + j)] == want);
      }
  }
  SUBCASE("max") {
    // (1, 1, 4, 4); windows: top-left has a three-way tie at 3 (first: index 0), top-right its
    // maximum last (index 7), bottom-left all negative (maximum -1 at index 9), bottom-right a tie
    // between indices 11 and 14 (first in row-major order: 11).
    const Vec x = {3,  3,  0, 1,  //
                   1,  3,  2, 9,  //
                   -5, -1, 4, 6,  //
                   -2, -3, 6, 5};
    const Pooled p = pool(be, {.n = 1, .c = 1, .h = 4, .w = 4, .k = 2}, x, {1, 2, 3, 4});
    CHECK(p.max_y == Vec{3, 9, -1, 6});
    CHECK(p.argmax == std::vector<int32_t>{0, 7, 9, 11});
    Vec want(16, 0.0f);
    want[0] = 1, want[7] = 2, want[9] = 3, want[11] = 4;
    CHECK(p.max_dx == want);
  }
}

DP_OPS_TEST("pool: average and max on odd shapes equal the float reference") {
  // The same additions in the same order and the same multiplication by 1/k^2; max is a comparison:
  // equal values (== also equates the reference's +0 with a -0 a vector loop may keep from a -0
  // input). The gradients include the zeroed rows and columns past the last window.
  for (auto [n_, c_, h_, w_, k_] : {std::array{3, 2, 26, 26, 2}, std::array{2, 3, 9, 9, 2}, std::array{1, 1, 5, 4, 2},
                                    std::array{4, 5, 1, 7, 2}, std::array{3, 2, 9, 7, 2}, std::array{2, 20, 26, 26, 2},
                                    std::array{1, 3, 8, 11, 3}, std::array{0, 2, 4, 4, 2}}) {
    const auto n = n_;  // a copy: clang 14 cannot capture a structured binding (CAPTURE)
    const auto c = c_;
    const auto h = h_;
    const auto w = w_;
    const auto k = k_;
    const PoolShape s{.n = n, .c = c, .h = h, .w = w, .k = k};
    CAPTURE(n);
    CAPTURE(c);
    CAPTURE(h);
    CAPTURE(w);
    CAPTURE(k);
    const size_t in = size_t(n) * c * h * w, out = size_t(n) * c * s.out_h() * s.out_w();
    const Vec x = random_floats(in, uint32_t(h * 31 + w), -1, 1), dy = random_floats(out, uint32_t(h * 37 + c), -1, 1);
    Vec ay(out), adx(in), my(out), mdx(in);
    std::vector<int32_t> arg(out);
    cpu::avgpool_forward(s, x.data(), ay.data());
    cpu::avgpool_backward(s, dy.data(), adx.data());
    cpu::maxpool_forward(s, x.data(), my.data(), arg.data());
    cpu::maxpool_backward(s, dy.data(), arg.data(), mdx.data());
    const Pooled p = pool(be, s, x, dy);
    check_equal("avgpool y", p.avg_y, ay);
    check_equal("avgpool dx", p.avg_dx, adx);
    check_equal("maxpool y", p.max_y, my);
    CHECK(p.argmax == arg);
    check_equal("maxpool dx", p.max_dx, mdx);
  }
}

}  // namespace
}  // namespace dp::test
