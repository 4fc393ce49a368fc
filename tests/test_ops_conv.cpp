// conv2d over the op matrix (tests/ops_matrix.h): small cases worked out by hand, exact on every
// backend (small integers: every product and partial sum is exact in float, in any order); LeNet's
// and LeNet-5's layers, odd and random shapes, padding, non-square kernels, the fast path's direct-way
// shapes and dx = null against the reference in double; the empty batch.
//
// Tolerances: each output is a float sum of products, so it is within gamma(k) * sum |terms| of the
// exact value (tests/tolerance.h), k counting the roundings on the longest path to it:
//   y      C KH KW products and the bias, one tree of additions on the CPU (the reference's GEMM
//          accumulates onto the bias, the fast path's FMA chain starts from it): C KH KW + 1. cuDNN
//          adds the bias in a separate pass, and its alpha/beta scaling may round: 2 more.
//   dx     at most K KH KW products per input pixel. The CPU sums them in one tree (the reference's
//          GEMM and then col2im's additions are still one tree): K KH KW. CUDA's (kernels/cuda/conv2d.cu:
//          a GEMM over K per tap, then col2im over the taps) is a tree too; the bound keeps room for a
//          library's algorithm that scales with alpha/beta: K KH KW + KH KW + 2.
//   dw, db N OH OW products/terms. The CPU: N OH OW (per image, then over the images, one tree);
//          CUDA's dw is one GEMM over the N OH OW terms (or one per chunk of images, added), with
//          room for per-image partial sums and scaling: N OH OW + N + 2. (CUDA's db is dp's own
//          kernel, a fixed tree over slices of the N OH OW terms: within N OH OW, any tree is.)
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

Vec ramp(int n) {  // 0, 1, 2, ...
  Vec v(size_t(n), 0.0f);
  for (int i = 0; i < n; ++i) v[size_t(i)] = float(i);
  return v;
}

int64_t in_size(const ConvShape& s) { return int64_t(s.n) * s.c * s.h * s.w; }
int64_t out_size(const ConvShape& s) { return int64_t(s.n) * s.k * s.col_cols(); }
int64_t w_size(const ConvShape& s) { return int64_t(s.k) * s.col_rows(); }

Vec forward(Backend& be, const ConvShape& s, const Vec& x, const Vec& w, const Vec& b) {
  Mem gx = be.put(x), gw = be.put(w), gb = be.put(b), gy = be.out(size_t(out_size(s))), ws = be.workspace(s);
  be.run([&](Ops& ops) { ops.conv2d_forward(s, gx.f(), gw.f(), gb.f(), gy.f(), ws.f()); });
  be.get(ws);  // the guard past the workspace
  return be.get(gy);
}

DP_OPS_TEST("conv2d: 3x3 on a 4x4 ramp, forward and backward by hand") {
  const Vec x = ramp(16);  // (1, 1, 4, 4): x(i, j) = 4i + j
  const ConvShape s{.n = 1, .c = 1, .h = 4, .w = 4, .k = 1, .kh = 3, .kw = 3};
  SUBCASE("a ones kernel sums each window") {
    const Vec w(9, 1.0f), b = {0.5f};
    // The window at (i, j) holds 4(i+a) + (j+b) for a, b in 0..2: sum 9 (4i + j + 5).
    CHECK(forward(be, s, x, w, b) == Vec{45.5f, 54.5f, 81.5f, 90.5f});

    // Backward with dy = 1: db = number of outputs, dw(a, b) = sum over outputs of x(i+a, j+b) =
    // 16a + 4b + 10, dx(p, q) = how many windows cover (p, q) = cover(p) * cover(q), cover = 1 2 2 1.
    Mem gx = be.put(x), gw = be.put(w), gdy = be.put(Vec(4, 1.0f)), gdx = be.out(16), gdw = be.out(9), gdb = be.out(1),
        ws = be.workspace(s);
    be.run([&](Ops& ops) { ops.conv2d_backward(s, gx.f(), gw.f(), gdy.f(), gdx.f(), gdw.f(), gdb.f(), ws.f()); });
    const Vec dx = be.get(gdx), dw = be.get(gdw);
    CHECK(be.get(gdb)[0] == 4.0f);
    for (int a = 0; a < 3; ++a)
      for (int c = 0; c < 3; ++c) CHECK(dw[size_t(a * 3 + c)] == float(16 * a + 4 * c + 10));
    const int cover[4] = {1, 2, 2, 1};
    for (int p = 0; p < 4; ++p)
      for (int q = 0; q < 4; ++q) CHECK(dx[size_t(p * 4 + q)] == float(cover[p] * cover[q]));
  }
  SUBCASE("cross-correlation, not convolution: a single off-centre tap shifts the image") {
    Vec w(9, 0.0f);
    w[1 * 3 + 2] = 1.0f;  // tap (1, 2): y(i, j) = x(i + 1, j + 2)
    CHECK(forward(be, s, x, w, {0.0f}) == Vec{6.0f, 7.0f, 10.0f, 11.0f});
  }
  SUBCASE("zero padding 1 keeps the size and reads zeros outside") {
    const ConvShape p{.n = 1, .c = 1, .h = 4, .w = 4, .k = 1, .kh = 3, .kw = 3, .pad = 1};
    const Vec y = forward(be, p, x, Vec(9, 1.0f), {0.0f});
    CHECK(y[0] == 0.0f + 1 + 4 + 5);                           // corner: a 2x2 window
    CHECK(y[1] == 0.0f + 1 + 2 + 4 + 5 + 6);                   // edge: 2x3
    CHECK(y[5] == 0.0f + 0 + 1 + 2 + 4 + 5 + 6 + 8 + 9 + 10);  // interior: all nine
    CHECK(y[15] == 10.0f + 11 + 14 + 15);
  }
  SUBCASE("two channels and two filters with a batch of two") {
    // x(n, c) = ramp + 100 c + 1000 n; filter k sums channel k only; so y(n, k) is the ones-kernel
    // result for that channel's plane.
    const ConvShape two{.n = 2, .c = 2, .h = 4, .w = 4, .k = 2, .kh = 3, .kw = 3};
    Vec x2(64), w(36, 0.0f);
    const Vec b = {0.0f, -1.0f};
    for (int n = 0; n < 2; ++n)
      for (int c = 0; c < 2; ++c)
        for (int i = 0; i < 16; ++i) x2[size_t((n * 2 + c) * 16 + i)] = float(i + 100 * c + 1000 * n);
    for (int k = 0; k < 2; ++k)
      for (int i = 0; i < 9; ++i) w[size_t((k * 2 + k) * 9 + i)] = 1.0f;
    const Vec y = forward(be, two, x2, w, b);
    const float base[4] = {45, 54, 81, 90};
    for (int n = 0; n < 2; ++n)
      for (int k = 0; k < 2; ++k)
        for (int p = 0; p < 4; ++p)
          CHECK(y[size_t((n * 2 + k) * 4 + p)] == base[p] + 9.0f * (100 * k + 1000 * n) + b[size_t(k)]);
  }
}

// The roundings on the longest path to each output, per backend (see the top of this file).
struct Roundings {
  double y, dx, dw;
};
Roundings roundings(const Backend& be, const ConvShape& s) {
  const double taps = double(s.col_rows()), per_input = double(s.k) * s.kh * s.kw;
  const double per_weight = double(s.n) * double(s.col_cols());
  if (be.is_cuda()) return {taps + 3, per_input + s.kh * s.kw + 2, per_weight + s.n + 2};
  return {taps + 1, per_input, per_weight};
}

// The reference in double on the same inputs, and its sums of |terms| (the reference on |inputs|).
struct ConvOracle {
  DVec y, dx, dw, db;
  DVec y_abs, dx_abs, dw_abs, db_abs;
};
ConvOracle conv_oracle(const ConvShape& s, const Vec& x, const Vec& w, const Vec& b, const Vec& dy) {
  ConvOracle o;
  DVec ws(size_t(cpu::conv2d_workspace_size(s)));
  auto run = [&](bool absolute, DVec& y, DVec& dx, DVec& dw, DVec& db) {
    const DVec xd = dbl(x, absolute), wd = dbl(w, absolute), bd = dbl(b, absolute), dyd = dbl(dy, absolute);
    y.assign(size_t(out_size(s)), 0.0), dx.assign(x.size(), 0.0), dw.assign(w.size(), 0.0), db.assign(b.size(), 0.0);
    cpu::conv2d_forward(s, xd.data(), wd.data(), bd.data(), y.data(), ws.data());
    cpu::conv2d_backward(s, xd.data(), wd.data(), dyd.data(), dx.data(), dw.data(), db.data(), ws.data());
  };
  run(false, o.y, o.dx, o.dw, o.db);
  run(true, o.y_abs, o.dx_abs, o.dw_abs, o.db_abs);
  return o;
}

// Forward and backward (with and without dx) of one shape on one backend, against the oracle.
// `queried`: the batch the workspace is sized for (the engine's largest); s.n may be smaller, which
// on CUDA takes the plan path for shapes nobody asked about.
void check_conv(Backend& be, const ConvShape& s, uint32_t seed, int queried = -1) {
  INFO(describe(s));
  const Vec x = random_floats(size_t(in_size(s)), seed, -1, 1);        // (N, C, H, W)
  const Vec w = random_floats(size_t(w_size(s)), seed + 1, -1, 1);     // (K, C, KH, KW)
  const Vec b = random_floats(size_t(s.k), seed + 2, -1, 1);           // (K)
  const Vec dy = random_floats(size_t(out_size(s)), seed + 3, -1, 1);  // (N, K, OH, OW)
  const ConvOracle o = conv_oracle(s, x, w, b, dy);

  ConvShape qs = s;
  qs.n = queried < 0 ? s.n : queried;
  Mem ws = be.workspace(qs), gx = be.put(x), gw = be.put(w), gb = be.put(b), gdy = be.put(dy);
  Mem gy = be.out(o.y.size()), gdx = be.out(x.size()), gdw = be.out(w.size()), gdb = be.out(b.size());
  Mem gdw2 = be.out(w.size()), gdb2 = be.out(b.size());
  be.run([&](Ops& ops) {
    ops.conv2d_forward(s, gx.f(), gw.f(), gb.f(), gy.f(), ws.f());
    ops.conv2d_backward(s, gx.f(), gw.f(), gdy.f(), gdx.f(), gdw.f(), gdb.f(), ws.f());
    // dx = null (the first layer; for few taps per output the fast path's direct weight gradient)
    ops.conv2d_backward(s, gx.f(), gw.f(), gdy.f(), nullptr, gdw2.f(), gdb2.f(), ws.f());
  });
  be.get(ws);
  const Roundings k = roundings(be, s);
  check_close("y", be.get(gy), o.y, gamma_bound(k.y, o.y_abs));
  check_close("dx", be.get(gdx), o.dx, gamma_bound(k.dx, o.dx_abs));
  check_close("dw", be.get(gdw), o.dw, gamma_bound(k.dw, o.dw_abs));
  check_close("db", be.get(gdb), o.db, gamma_bound(k.dw, o.db_abs));
  check_close("dw without dx", be.get(gdw2), o.dw, gamma_bound(k.dw, o.dw_abs));
  check_close("db without dx", be.get(gdb2), o.db, gamma_bound(k.dw, o.db_abs));
}

DP_OPS_TEST("conv2d: against the reference on LeNet's layers, odd, padded and random shapes") {
  // LeNet's and LeNet-5's layers, with a batch that leaves a partial chunk for every vector width.
  check_conv(be, {.n = 37, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3}, 1);
  check_conv(be, {.n = 37, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5}, 11);
  check_conv(be, {.n = 37, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 5, .kw = 5, .pad = 2}, 21);
  check_conv(be, {.n = 37, .c = 6, .h = 14, .w = 14, .k = 16, .kh = 5, .kw = 5}, 31);
  // LeNet's conv2 with a workspace sized for a larger batch than it runs.
  check_conv(be, {.n = 3, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5}, 41, 8);
  // Single images, channel counts that no register tile divides, non-square kernels, kernels as
  // large as the padded image (a 1x1 output), padding wider than the kernel's reach.
  check_conv(be, {.n = 1, .c = 1, .h = 1, .w = 1, .k = 1, .kh = 1, .kw = 1}, 51);
  check_conv(be, {.n = 1, .c = 3, .h = 5, .w = 7, .k = 7, .kh = 3, .kw = 2, .pad = 1}, 61);
  check_conv(be, {.n = 9, .c = 2, .h = 4, .w = 4, .k = 13, .kh = 6, .kw = 6, .pad = 1}, 71);
  check_conv(be, {.n = 17, .c = 7, .h = 6, .w = 5, .k = 11, .kh = 1, .kw = 3}, 81);
  check_conv(be, {.n = 3, .c = 5, .h = 3, .w = 3, .k = 9, .kh = 3, .kw = 3, .pad = 3}, 91);
  check_conv(be, {.n = 3, .c = 2, .h = 9, .w = 7, .k = 5, .kh = 3, .kw = 2, .pad = 1}, 101);
  check_conv(be, {.n = 1, .c = 3, .h = 5, .w = 5, .k = 1, .kh = 5, .kw = 5}, 111);
  // The fast path's direct way (few taps per output, rows that fill their vectors): channel counts
  // no row option divides, padding, one and two vectors per row, and a layer that needs dx.
  check_conv(be, {.n = 19, .c = 2, .h = 20, .w = 30, .k = 7, .kh = 3, .kw = 2, .pad = 1}, 121);
  check_conv(be, {.n = 5, .c = 1, .h = 16, .w = 13, .k = 13, .kh = 4, .kw = 4, .pad = 3}, 131);
  check_conv(be, {.n = 33, .c = 1, .h = 9, .w = 16, .k = 11, .kh = 1, .kw = 1}, 141);
  check_conv(be, {.n = 2, .c = 3, .h = 12, .w = 26, .k = 5, .kh = 3, .kw = 3}, 151);
  // LeNet's and LeNet-5's first layers at --width 22 and 27: CUDA's direct kernels with all but the
  // most weights they take (4,096).
  check_conv(be, {.n = 3, .c = 1, .h = 28, .w = 28, .k = 440, .kh = 3, .kw = 3}, 161);
  check_conv(be, {.n = 2, .c = 1, .h = 28, .w = 28, .k = 162, .kh = 5, .kw = 5, .pad = 2}, 171);
  // More output pixels than CUDA's direct dw has threads for a group of channels (64 x 256): a
  // thread takes several pixels, each over every image.
  check_conv(be, {.n = 2, .c = 1, .h = 140, .w = 130, .k = 3, .kh = 3, .kw = 3, .pad = 1}, 181);
  // CUDA's plan: the direct kernels' partials (3.7 MiB) fit its workspace's 64 MiB but not beside the
  // chunk of one image dx's path takes (62.6 MiB); the im2col path's partials are fewer and do.
  if (be.is_cuda()) check_conv(be, {.n = 1, .c = 1, .h = 190, .w = 190, .k = 455, .kh = 3, .kw = 3}, 191);
  std::mt19937_64 gen(99);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (uint32_t trial = 0; trial < 24; ++trial) {
    const int kh = pick(1, 5), kw = pick(1, 5), pad = pick(0, 2);
    const int h = std::max(kh - 2 * pad, 1) + pick(0, 9), w = std::max(kw - 2 * pad, 1) + pick(0, 9);
    const int n = pick(1, 40), c = pick(1, 9), k = pick(1, 17);
    check_conv(be, {.n = n, .c = c, .h = h, .w = w, .k = k, .kh = kh, .kw = kw, .pad = pad}, 1000 + 10 * trial);
  }
}

DP_OPS_TEST("conv2d: an empty batch writes zero gradients and nothing else") {
  const ConvShape s{.n = 0, .c = 2, .h = 5, .w = 5, .k = 3, .kh = 3, .kw = 3, .pad = 1};
  Mem ws = be.workspace(s), gw = be.put(Vec(54, 1.0f)), gb = be.put(Vec(3, 1.0f));
  Mem gy = be.out(1), gdw = be.out(54), gdb = be.out(3);
  if (be.is_cuda()) CHECK(ws.size() == 0);  // cuDNN rejects N = 0: nothing to plan for
  be.run([&](Ops& ops) {
    ops.conv2d_forward(s, nullptr, gw.f(), gb.f(), gy.f(), ws.f());
    ops.conv2d_backward(s, nullptr, gw.f(), nullptr, nullptr, gdw.f(), gdb.f(), ws.f());
  });
  CHECK(be.get(gdw) == Vec(54, 0.0f));
  CHECK(be.get(gdb) == Vec(3, 0.0f));
  CHECK(std::isnan(be.get(gy)[0]));  // untouched
  be.get(ws);
}

DP_OPS_TEST("conv2d: the bound is sharp enough to catch a wrong index") {
  // LeNet's conv2 with one weight's gradient swapped for its neighbour's: far outside its bound.
  const ConvShape s{.n = 5, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5};
  const Vec x = random_floats(size_t(in_size(s)), 7, -1, 1), w = random_floats(size_t(w_size(s)), 8, -1, 1);
  const Vec b(size_t(s.k), 0.0f), dy = random_floats(size_t(out_size(s)), 9, -1, 1);
  const ConvOracle o = conv_oracle(s, x, w, b, dy);
  Mem ws = be.workspace(s), gx = be.put(x), gw = be.put(w), gdy = be.put(dy), gdw = be.out(w.size()),
      gdb = be.out(b.size());
  be.run([&](Ops& ops) { ops.conv2d_backward(s, gx.f(), gw.f(), gdy.f(), nullptr, gdw.f(), gdb.f(), ws.f()); });
  Vec dw = be.get(gdw);
  std::swap(dw[1234], dw[1235]);
  const double err = std::fabs(double(dw[1234]) - o.dw[1234]), allowed = gamma(roundings(be, s).dw) * o.dw_abs[1234];
  CHECK(err > 100 * allowed);
}

// The fused op against conv2d, the activation and 2x2 pooling run one after another, bit for bit
// (CUDA's dx and dw in chunks of images: within twice the bound, below). `queried`: the batch the
// workspace is sized for, as in check_conv.
void check_fused(Backend& be, const ConvShape& s, Activation act, bool with_dx, int queried = -1) {
  INFO(describe(s));
  const std::string activation = act == Activation::relu ? "relu" : "sigmoid";
  CAPTURE(activation);
  CAPTURE(with_dx);
  CAPTURE(queried);
  const PoolShape ps = Ops::conv_pool_shape(s, 2);
  const int64_t out = out_size(s), pooled = int64_t(s.n) * s.k * ps.out_h() * ps.out_w();
  const uint32_t seed = uint32_t(s.c * 100 + s.h);
  ConvShape qs = s;
  qs.n = queried < 0 ? s.n : queried;
  const Vec hx = random_floats(size_t(in_size(s)), seed, -1, 1), hw = random_floats(size_t(w_size(s)), seed + 1, -1, 1),
            hb = random_floats(size_t(s.k), seed + 2, -1, 1);
  Mem x = be.put(hx), w = be.put(hw), b = be.put(hb), dp = be.put(random_floats(size_t(pooled), seed + 3, -1, 1)),
      ws = be.workspace(qs);
  // the three ops
  Mem y = be.out(size_t(out)), a = be.out(size_t(out)), p = be.out(size_t(pooled)), g = be.out(size_t(out)),
      dy = be.out(size_t(out)), dx = be.out(size_t(in_size(s))), dw = be.out(size_t(w_size(s))),
      db = be.out(size_t(s.k));
  // fused
  Mem fa = be.out(size_t(out)), fp = be.out(size_t(pooled)), scratch = be.out(size_t(out)),
      fdx = be.out(size_t(in_size(s))), fdw = be.out(size_t(w_size(s))), fdb = be.out(size_t(s.k));
  be.run([&](Ops& ops) {
    ops.conv2d_forward(s, x.f(), w.f(), b.f(), y.f(), ws.f());
    ops.activation_forward(act, out, y.f(), a.f());
    ops.avgpool_forward(ps, a.f(), p.f());
    ops.avgpool_backward(ps, dp.f(), g.f());
    ops.activation_backward(act, out, a.f(), g.f(), dy.f());
    ops.conv2d_backward(s, x.f(), w.f(), dy.f(), with_dx ? dx.f() : nullptr, dw.f(), db.f(), ws.f());
    ops.conv2d_act_pool_forward(s, act, 2, x.f(), w.f(), b.f(), fa.f(), fp.f(), ws.f());
    // The fast path needs no scratch (kernels/ops.h): a null one shows it.
    ops.conv2d_act_pool_backward(s, act, 2, x.f(), w.f(), fa.f(), dp.f(), be.is_fast() ? nullptr : scratch.f(),
                                 with_dx ? fdx.f() : nullptr, fdw.f(), fdb.f(), ws.f());
  });
  check_same_bits("y_act", be.get(fa), be.get(a));
  check_same_bits("y_pool", be.get(fp), be.get(p));
  check_same_bits("db", be.get(fdb), be.get(db));
  if (be.is_cuda() && qs.n < s.n) {
    // In chunks of images the fused op's GEMMs read dy's rows inside the whole batch's block (leading
    // dimension N OH OW, a chunk's start aligned to 4 bytes only), the three ops' in a chunk's own: cuBLAS
    // may choose another kernel there, so another order of the same sums. dx and dw are each within
    // the summation-order bound of the exact sums, so within twice it of each other.
    const ConvOracle o = conv_oracle(s, hx, hw, hb, be.get(dy));
    const Roundings k = roundings(be, s);
    auto twice = [](std::vector<double> bound) {
      for (double& t : bound) t *= 2;
      return bound;
    };
    if (with_dx) check_close("dx", be.get(fdx), be.get(dx), twice(gamma_bound(k.dx, o.dx_abs)));
    check_close("dw", be.get(fdw), be.get(dw), twice(gamma_bound(k.dw, o.dw_abs)));
  } else {
    if (with_dx) check_same_bits("dx", be.get(fdx), be.get(dx));
    check_same_bits("dw", be.get(fdw), be.get(dw));
  }
  be.get(ws);
  be.get(scratch);
}

DP_OPS_TEST("conv2d_act_pool: the fused op gives the bits of conv2d, the activation and 2x2 pooling") {
  // The fast path fuses them, with the same operations in the same order as its separate kernels
  // (each checked against the reference above and in test_ops_eltwise.cpp): equal bits, on both of
  // its ways (direct: the 1-channel shapes; blocked: the others), odd output sizes included. CUDA
  // fuses the bias, activation and pooling on each side of its convolutions
  // (kernels/cuda/conv_act_pool.cu), with the same operations in the same order: the same bits. The
  // reference runs Ops' default, the three ops themselves.
  const ConvShape shapes[] = {{.n = 37, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3},
                              {.n = 37, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5},
                              {.n = 37, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 5, .kw = 5, .pad = 2},
                              {.n = 37, .c = 6, .h = 14, .w = 14, .k = 16, .kh = 5, .kw = 5},
                              {.n = 5, .c = 3, .h = 9, .w = 8, .k = 7, .kh = 3, .kw = 2, .pad = 1},
                              {.n = 19, .c = 1, .h = 17, .w = 20, .k = 9, .kh = 3, .kw = 3, .pad = 1},
                              // 16 and 32 taps per output (CUDA's direct kernels' larger bounds)
                              {.n = 7, .c = 1, .h = 11, .w = 12, .k = 5, .kh = 4, .kw = 4},
                              {.n = 7, .c = 2, .h = 10, .w = 9, .k = 3, .kh = 4, .kw = 4, .pad = 1},
                              // outputs the 2 x 2 windows tile, 16 and 12 taps, padded (CUDA's forward
                              // pass in one kernel, conv_direct.cu, beside lenet's conv1 above)
                              {.n = 5, .c = 1, .h = 11, .w = 9, .k = 7, .kh = 4, .kw = 4, .pad = 1},
                              {.n = 4, .c = 2, .h = 8, .w = 7, .k = 6, .kh = 3, .kw = 2, .pad = 1},
                              // an output of one row: the window is larger than the plane, nothing pooled
                              {.n = 3, .c = 2, .h = 3, .w = 6, .k = 5, .kh = 3, .kw = 3},
                              // planes larger than CUDA's tile of shared memory: 9 taps, one kernel
                              // forward (it needs no tile); 27, the three ops forward
                              {.n = 2, .c = 1, .h = 112, .w = 112, .k = 2, .kh = 3, .kw = 3, .pad = 1},
                              {.n = 2, .c = 3, .h = 112, .w = 112, .k = 2, .kh = 3, .kw = 3, .pad = 1}};
  for (const ConvShape& s : shapes)
    for (Activation act : {Activation::relu, Activation::sigmoid})
      for (bool with_dx : {false, true}) check_fused(be, s, act, with_dx);
  // CUDA's backward pass in chunks of images (a workspace sized for 6 images, 37 run: several chunks,
  // the last a partial one), where the fused op's GEMMs read a block of dy's rows as wide as the whole batch
  // (dx and dw there within twice the bound: check_fused).
  // The CPU backends size their buffers by the batch asked about, so only CUDA runs more.
  if (be.is_cuda())
    for (bool with_dx : {false, true}) {
      check_fused(be, {.n = 37, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5}, Activation::relu, with_dx, 6);
      check_fused(be, {.n = 37, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3}, Activation::relu, with_dx, 6);
    }
}

}  // namespace
}  // namespace dp::test
