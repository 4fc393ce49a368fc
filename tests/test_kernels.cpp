// The float CPU kernels through the Ops interface (dp::CpuOps), on small cases whose answers can be
// worked out by hand: values, argmax ties, numerical stability in the tails, PyTorch's SGD rule,
// every GEMM transpose against a naive loop, and the empty-batch edges.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

ConvShape conv_shape(int n, int c, int h, int w, int k, int kernel, int pad) {
  ConvShape s;
  s.n = n, s.c = c, s.h = h, s.w = w, s.k = k, s.kh = s.kw = kernel, s.pad = pad;
  return s;
}

PoolShape pool_shape(int n, int c, int h, int w, int k) {
  PoolShape s;
  s.n = n, s.c = c, s.h = h, s.w = w, s.k = k;
  return s;
}

Vec ramp(int n) {  // 0, 1, 2, ...
  Vec v(size_t(n), 0.0f);
  for (int i = 0; i < n; ++i) v[size_t(i)] = float(i);
  return v;
}

TEST_CASE("kernels: conv2d 3x3 on a 4x4 ramp, forward and backward by hand") {
  CpuOps ops;
  const Vec x = ramp(16);  // (1, 1, 4, 4): x(i, j) = 4i + j
  SUBCASE("a ones kernel sums each window") {
    ConvShape s = conv_shape(1, 1, 4, 4, 1, 3, 0);
    Vec w(9, 1.0f), b = {0.5f}, y(4), ws(ops.conv2d_workspace_floats(s));
    ops.conv2d_forward(s, x.data(), w.data(), b.data(), y.data(), ws.data());
    // The window at (i, j) holds 4(i+a) + (j+b) for a, b in 0..2: sum 9 (4i + j + 5).
    CHECK(y == Vec{45.5f, 54.5f, 81.5f, 90.5f});

    // Backward with dy = 1: db = number of outputs, dw(a, b) = sum over outputs of x(i+a, j+b) =
    // 16a + 4b + 10, dx(p, q) = how many windows cover (p, q) = cover(p) * cover(q), cover = 1 2 2 1.
    Vec dy(4, 1.0f), dx(16, kNaN), dw(9, kNaN), db(1, kNaN);
    ops.conv2d_backward(s, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data(), ws.data());
    CHECK(db[0] == 4.0f);
    for (int a = 0; a < 3; ++a)
      for (int c = 0; c < 3; ++c) CHECK(dw[size_t(a * 3 + c)] == float(16 * a + 4 * c + 10));
    const int cover[4] = {1, 2, 2, 1};
    for (int p = 0; p < 4; ++p)
      for (int q = 0; q < 4; ++q) CHECK(dx[size_t(p * 4 + q)] == float(cover[p] * cover[q]));
  }
  SUBCASE("cross-correlation, not convolution: a single off-centre tap shifts the image") {
    ConvShape s = conv_shape(1, 1, 4, 4, 1, 3, 0);
    Vec w(9, 0.0f), b = {0.0f}, y(4), ws(ops.conv2d_workspace_floats(s));
    w[1 * 3 + 2] = 1.0f;  // tap (1, 2): y(i, j) = x(i + 1, j + 2)
    ops.conv2d_forward(s, x.data(), w.data(), b.data(), y.data(), ws.data());
    CHECK(y == Vec{6.0f, 7.0f, 10.0f, 11.0f});
  }
  SUBCASE("zero padding 1 keeps the size and reads zeros outside") {
    ConvShape s = conv_shape(1, 1, 4, 4, 1, 3, 1);
    Vec w(9, 1.0f), b = {0.0f}, y(16), ws(ops.conv2d_workspace_floats(s));
    ops.conv2d_forward(s, x.data(), w.data(), b.data(), y.data(), ws.data());
    CHECK(y[0] == 0.0f + 1 + 4 + 5);                           // corner: a 2x2 window
    CHECK(y[1] == 0.0f + 1 + 2 + 4 + 5 + 6);                   // edge: 2x3
    CHECK(y[5] == 0.0f + 0 + 1 + 2 + 4 + 5 + 6 + 8 + 9 + 10);  // interior: all nine
    CHECK(y[15] == 10.0f + 11 + 14 + 15);
  }
  SUBCASE("two channels and two filters with a batch of two") {
    // x(n, c) = ramp + 100 c + 1000 n; filter k sums channel k only; so y(n, k) is the ones-kernel
    // result for that channel's plane.
    ConvShape s = conv_shape(2, 2, 4, 4, 2, 3, 0);
    Vec x2(64), w(36, 0.0f), b = {0.0f, -1.0f}, y(16), ws(ops.conv2d_workspace_floats(s));
    for (int n = 0; n < 2; ++n)
      for (int c = 0; c < 2; ++c)
        for (int i = 0; i < 16; ++i) x2[size_t((n * 2 + c) * 16 + i)] = float(i + 100 * c + 1000 * n);
    for (int k = 0; k < 2; ++k)
      for (int i = 0; i < 9; ++i) w[size_t((k * 2 + k) * 9 + i)] = 1.0f;
    ops.conv2d_forward(s, x2.data(), w.data(), b.data(), y.data(), ws.data());
    const float base[4] = {45, 54, 81, 90};
    for (int n = 0; n < 2; ++n)
      for (int k = 0; k < 2; ++k)
        for (int p = 0; p < 4; ++p)
          CHECK(y[size_t((n * 2 + k) * 4 + p)] == base[p] + 9.0f * (100 * k + 1000 * n) + b[size_t(k)]);
  }
}

TEST_CASE("kernels: avgpool values, and zero gradient past the last window") {
  CpuOps ops;
  const Vec x = ramp(16);  // (1, 1, 4, 4)
  PoolShape s = pool_shape(1, 1, 4, 4, 2);
  Vec y(4);
  ops.avgpool_forward(s, x.data(), y.data());
  CHECK(y == Vec{2.5f, 4.5f, 10.5f, 12.5f});  // (0+1+4+5)/4, ...

  PoolShape odd = pool_shape(1, 1, 5, 5, 2);  // floor mode: row 4 and column 4 are never read
  Vec dy = {4.0f, 8.0f, 12.0f, 16.0f}, dx(25, kNaN);
  ops.avgpool_backward(odd, dy.data(), dx.data());
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 5; ++j) {
      float want = (i < 4 && j < 4) ? dy[size_t((i / 2) * 2 + j / 2)] / 4.0f : 0.0f;
      CHECK(dx[size_t(i * 5 + j)] == want);
    }
}

TEST_CASE("kernels: maxpool values and argmax, the first maximum wins") {
  CpuOps ops;
  // (1, 1, 4, 4); windows: top-left has a three-way tie at 3 (first: index 0), top-right its
  // maximum last (index 7), bottom-left all negative (maximum -1 at index 9), bottom-right a tie
  // between indices 11 and 14 (first in row-major order: 11).
  const Vec x = {3,  3,  0, 1,  //
                 1,  3,  2, 9,  //
                 -5, -1, 4, 6,  //
                 -2, -3, 6, 5};
  PoolShape s = pool_shape(1, 1, 4, 4, 2);
  Vec y(4);
  std::vector<int32_t> argmax(4, -1);
  ops.maxpool_forward(s, x.data(), y.data(), argmax.data());
  CHECK(y == Vec{3, 9, -1, 6});
  CHECK(argmax == std::vector<int32_t>{0, 7, 9, 11});

  Vec dy = {1, 2, 3, 4}, dx(16, kNaN);
  ops.maxpool_backward(s, dy.data(), argmax.data(), dx.data());
  Vec want(16, 0.0f);
  want[0] = 1, want[7] = 2, want[9] = 3, want[11] = 4;
  CHECK(dx == want);
}

TEST_CASE("kernels: relu and sigmoid values, sigmoid stable in both tails") {
  CpuOps ops;
  const Vec x = {-2.0f, -0.0f, 0.0f, 0.5f, 3.0f};
  Vec y(5), dx(5);
  ops.activation_forward(Activation::relu, 5, x.data(), y.data());
  CHECK(y == Vec{0, 0, 0, 0.5f, 3});
  const Vec dy = {10, 20, 30, 40, 50};
  ops.activation_backward(Activation::relu, 5, y.data(), dy.data(), dx.data());
  CHECK(dx == Vec{0, 0, 0, 40, 50});  // passes where the output is positive (PyTorch: x > 0)

  const float inf = std::numeric_limits<float>::infinity();
  const Vec z = {0.0f, 2.0f, -2.0f, 100.0f, -100.0f, 1000.0f, -1000.0f, inf, -inf};
  Vec s(z.size()), ds(z.size());
  ops.activation_forward(Activation::sigmoid, int64_t(z.size()), z.data(), s.data());
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
  CHECK(ops.all_finite(int64_t(s.size()), s.data()));
  const Vec one(z.size(), 1.0f);
  ops.activation_backward(Activation::sigmoid, int64_t(z.size()), s.data(), one.data(), ds.data());
  CHECK(ds[0] == 0.25f);  // y (1 - y) at y = 1/2
  CHECK(ops.all_finite(int64_t(ds.size()), ds.data()));
}

// loss of one row by the log-sum-exp form, in double: m + log sum exp(z - m) - z_label.
double lse_loss(const Vec& z, int label) {
  double m = -INFINITY, sum = 0;
  for (float v : z) m = std::max(m, double(v));
  for (float v : z) sum += std::exp(double(v) - m);
  return m + std::log(sum) - z[size_t(label)];
}

TEST_CASE("kernels: softmax cross-entropy stable at large logits, accumulates loss and correct count") {
  CpuOps ops;
  SUBCASE("equal logits of 1000: log 3, no overflow; ties go to the first class") {
    Vec z = {1000, 1000, 1000, 1000, 1000, 1000}, dz(6, kNaN), stats = {0.5f, 2.0f};
    std::vector<int32_t> labels = {0, 2};
    ops.softmax_xent(2, 3, z.data(), labels.data(), 0.5f, dz.data(), stats.data());
    CHECK(stats[0] == doctest::Approx(0.5 + std::log(3.0)).epsilon(1e-6));  // += mean over 2 rows of log 3
    CHECK(stats[1] == 3.0f);  // += 1: row 0's argmax is class 0 (first maximum), row 1's is not class 2
    const float third = 1.0f / 3.0f;
    const Vec want = {(third - 1) * 0.5f, third * 0.5f, third * 0.5f, third * 0.5f, third * 0.5f, (third - 1) * 0.5f};
    for (size_t i = 0; i < 6; ++i) CHECK(dz[i] == doctest::Approx(want[i]).epsilon(1e-6));
  }
  SUBCASE("logits 1000 apart: the loss is the log-sum-exp form, gradients finite") {
    const Vec row = {1000.0f, 0.0f, -1000.0f, 999.0f};
    for (int label : {0, 1, 2, 3}) {
      CAPTURE(label);
      Vec dz(4), stats = {0, 0};
      std::vector<int32_t> labels = {label};
      ops.softmax_xent(1, 4, row.data(), labels.data(), 1.0f, dz.data(), stats.data());
      // lse = 1000 + log(1 + e^-1) = 1000.3132617; the loss is lse - z_label (2000.31 for label 2).
      CHECK(stats[0] == doctest::Approx(lse_loss(row, label)).epsilon(1e-6));
      CHECK(ops.all_finite(4, dz.data()));
      CHECK(stats[1] == (label == 0 ? 1.0f : 0.0f));
      float sum = 0;
      for (float g : dz) sum += g;
      CHECK(std::fabs(sum) < 1e-6f);  // softmax sums to 1, the one-hot too
    }
  }
  SUBCASE("ordinary logits against log-sum-exp in double, and the count over rows") {
    Vec z = {0.1f,  -1.2f, 2.0f,  0.3f,  //
             1.5f,  1.4f,  -0.3f, 0.0f,  //
             -2.0f, 0.0f,  0.5f,  0.49f};
    std::vector<int32_t> labels = {2, 1, 2};  // argmaxes are 2, 0, 2: two correct
    Vec dz(12), stats = {0, 0};
    ops.softmax_xent(3, 4, z.data(), labels.data(), 1.0f / 3, dz.data(), stats.data());
    double want = 0;
    for (int i = 0; i < 3; ++i) want += lse_loss(Vec(z.begin() + 4 * i, z.begin() + 4 * i + 4), labels[size_t(i)]);
    CHECK(stats[0] == doctest::Approx(want / 3).epsilon(1e-6));
    CHECK(stats[1] == 2.0f);
  }
}

TEST_CASE("kernels: SGD matches PyTorch's rule over two steps") {
  CpuOps ops;
  // torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01), w0 = 1, grads 0.5 then -0.2:
  //   step 1: d = 0.5 + 0.01 * 1 = 0.51;            buf = d = 0.51;                 w = 1 - 0.051 = 0.949
  //   step 2: d = -0.2 + 0.01 * 0.949 = -0.19051;   buf = 0.9 * 0.51 + d = 0.26849;  w = 0.949 - 0.026849 = 0.922151
  // A second element, w0 = 0 and grads 1 then 1, where weight decay first acts on step 2:
  //   step 1: d = 1;                          buf = 1;                    w = -0.1
  //   step 2: d = 1 + 0.01 * -0.1 = 0.999;    buf = 0.9 + 0.999 = 1.899;  w = -0.1 - 0.1899 = -0.2899
  SUBCASE("with momentum and weight decay") {
    Vec w = {1.0f, 0.0f}, v = {0.0f, 0.0f};  // dp's buffers start at zero; momentum * 0 + d == d
    Vec g1 = {0.5f, 1.0f}, g2 = {-0.2f, 1.0f};
    ops.sgd_step(2, w.data(), g1.data(), v.data(), 0.1f, 0.9f, 0.01f);
    CHECK(v[0] == doctest::Approx(0.51).epsilon(1e-6));
    CHECK(w[0] == doctest::Approx(0.949).epsilon(1e-6));
    ops.sgd_step(2, w.data(), g2.data(), v.data(), 0.1f, 0.9f, 0.01f);
    CHECK(v[0] == doctest::Approx(0.26849).epsilon(1e-6));
    CHECK(w[0] == doctest::Approx(0.922151).epsilon(1e-6));
    CHECK(v[1] == doctest::Approx(1.899).epsilon(1e-6));
    CHECK(w[1] == doctest::Approx(-0.2899).epsilon(1e-6));
  }
  SUBCASE("momentum 0 without a buffer (v == nullptr): plain w -= lr (g + wd w)") {
    //   step 1: w = 1 - 0.1 * (0.5 + 0.01)          = 0.949
    //   step 2: w = 0.949 - 0.1 * (-0.2 + 0.00949)  = 0.968051
    Vec w = {1.0f}, g1 = {0.5f}, g2 = {-0.2f};
    ops.sgd_step(1, w.data(), g1.data(), nullptr, 0.1f, 0.0f, 0.01f);
    CHECK(w[0] == doctest::Approx(0.949).epsilon(1e-6));
    ops.sgd_step(1, w.data(), g2.data(), nullptr, 0.1f, 0.0f, 0.01f);
    CHECK(w[0] == doctest::Approx(0.968051).epsilon(1e-6));
  }
  SUBCASE("momentum 0 with a buffer leaves the buffer alone") {
    Vec w = {1.0f}, g = {0.5f}, v = {7.0f};
    ops.sgd_step(1, w.data(), g.data(), v.data(), 0.1f, 0.0f, 0.0f);
    CHECK(w[0] == doctest::Approx(0.95).epsilon(1e-6));
    CHECK(v[0] == 7.0f);
  }
}

TEST_CASE("kernels: add, fill, all_finite") {
  CpuOps ops;
  Vec x = {1, 2, 3}, y = {10, 20, 30};
  ops.add(3, x.data(), y.data());
  CHECK(y == Vec{11, 22, 33});
  ops.fill(2, -1.5f, y.data());
  CHECK(y == Vec{-1.5f, -1.5f, 33});
  CHECK(ops.all_finite(3, y.data()));
  y[2] = kNaN;
  CHECK_FALSE(ops.all_finite(3, y.data()));
  CHECK(ops.all_finite(2, y.data()));  // only the first n are read
  y[2] = -std::numeric_limits<float>::infinity();
  CHECK_FALSE(ops.all_finite(3, y.data()));
}

TEST_CASE("kernels: gemm in all four transpose combinations against a naive loop") {
  CpuOps ops;
  const int m = 3, n = 4, k = 5;
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> d(-4, 4);  // small integers: every product and sum is exact
  Vec a(size_t(m * k)), b(size_t(k * n)), c0(size_t(m * n));
  for (auto& v : a) v = float(d(gen));
  for (auto& v : b) v = float(d(gen));
  for (auto& v : c0) v = float(d(gen));
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      // op(A)(i, p) is A stored (m, k) or, transposed, (k, m); likewise B.
      auto A = [&](int i, int p) { return ta ? a[size_t(p * m + i)] : a[size_t(i * k + p)]; };
      auto B = [&](int p, int j) { return tb ? b[size_t(j * k + p)] : b[size_t(p * n + j)]; };
      Vec c = c0;
      ops.gemm(ta, tb, m, n, k, 2.0f, a.data(), b.data(), -0.5f, c.data());
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          float acc = 0;
          for (int p = 0; p < k; ++p) acc += A(i, p) * B(p, j);
          CHECK(c[size_t(i * n + j)] == 2.0f * acc - 0.5f * c0[size_t(i * n + j)]);
        }
    }
}

TEST_CASE("kernels: zero-size edges") {
  CpuOps ops;
  SUBCASE("gemm with k = 0 is an empty sum: C = beta C, and 0 when beta = 0 even over NaN") {
    Vec c = {1, 2, kNaN, 4};
    ops.gemm(false, false, 2, 2, 0, 1.0f, nullptr, nullptr, 3.0f, c.data());
    CHECK(c[0] == 3.0f);
    CHECK(c[3] == 12.0f);
    ops.gemm(true, true, 2, 2, 0, 1.0f, nullptr, nullptr, 0.0f, c.data());
    CHECK(c == Vec{0, 0, 0, 0});
    ops.gemm(false, false, 0, 2, 3, 1.0f, nullptr, nullptr, 0.0f, nullptr);  // m = 0: nothing to do
    ops.gemm(false, false, 2, 0, 3, 1.0f, nullptr, nullptr, 0.0f, nullptr);  // n = 0
  }
  SUBCASE("conv2d backward over an empty batch zeroes dw and db") {
    ConvShape s = conv_shape(0, 2, 5, 5, 3, 3, 1);
    Vec w(54, 1.0f), b(3, 1.0f), dw(54, kNaN), db(3, kNaN), ws(ops.conv2d_workspace_floats(s));
    ops.conv2d_forward(s, nullptr, w.data(), b.data(), nullptr, ws.data());
    ops.conv2d_backward(s, nullptr, w.data(), nullptr, nullptr, dw.data(), db.data(), ws.data());
    CHECK(dw == Vec(54, 0.0f));
    CHECK(db == Vec(3, 0.0f));
  }
  SUBCASE("linear backward over an empty batch zeroes dw and db") {
    Vec w(12, 1.0f), b(3, 1.0f), dw(12, kNaN), db(3, kNaN);
    ops.linear_forward(0, 4, 3, nullptr, w.data(), b.data(), nullptr);
    ops.linear_backward(0, 4, 3, nullptr, w.data(), nullptr, nullptr, dw.data(), db.data());
    CHECK(dw == Vec(12, 0.0f));
    CHECK(db == Vec(3, 0.0f));
  }
  SUBCASE("pools, activations, loss and SGD accept n = 0 and touch nothing") {
    PoolShape s = pool_shape(0, 2, 4, 4, 2);
    ops.avgpool_forward(s, nullptr, nullptr);
    ops.avgpool_backward(s, nullptr, nullptr);
    ops.maxpool_forward(s, nullptr, nullptr, nullptr);
    ops.maxpool_backward(s, nullptr, nullptr, nullptr);
    ops.activation_forward(Activation::sigmoid, 0, nullptr, nullptr);
    ops.activation_backward(Activation::relu, 0, nullptr, nullptr, nullptr);
    Vec stats = {1.5f, 2.0f};
    ops.softmax_xent(0, 10, nullptr, nullptr, 1.0f, nullptr, stats.data());
    CHECK(stats == Vec{1.5f, 2.0f});
    ops.sgd_step(0, nullptr, nullptr, nullptr, 0.1f, 0.9f, 0.0f);
    CHECK(ops.all_finite(0, nullptr));
  }
}

}  // namespace
}  // namespace dp::test
