// conv_direct.cu's weight gradient, a thread's part of it (kernels/cuda/direct_taps.h's accumulate),
// run on the host for every thread of the grid CudaOps::direct_filter_grad launches (kSlices blocks
// of kBlock threads a group of channels), against convolutions in double. The threads' sums are
// added here in double (on the GPU: the warp's shuffles, the block's warps, the slices in order), so
// the bound is a thread's own FMA chain: a tap, pixel or image off by one is far outside it. The
// header is plain C++ outside nvcc and Divider's host arithmetic is the device's
// (tests/test_divider.cpp); the kernel itself is the `cuda: ops: conv2d*` cases'.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cuda/direct_taps.h"
#include "tests/conv_exact.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

namespace direct = cuda::direct;

// dw (K, C KH KW) and db (K) as the kernel's threads sum them, dy from `dy` (direct_taps.h's Dy*), the
// threads added up in double.
template <int kMax, class Dy>
void emulate(const ConvShape& s, const std::vector<float>& x, const Dy& dy, std::vector<double>& dw,
             std::vector<double>& db) {
  constexpr int kGroup = direct::kGroupOf<kMax>;
  const int crs = int(s.col_rows()), residues = direct::residues(s);
  const cuda::Divider pixels(s.out_h() * s.out_w()), ow(s.out_w());
  direct::Taps taps{};
  direct::fill_taps(s, taps, 0, 1);
  dw.assign(size_t(s.k) * crs, 0.0), db.assign(size_t(s.k), 0.0);
  int64_t stray = 0;  // sums where none belongs
  for (int ch0 = 0; ch0 < s.k; ch0 += kGroup)
    for (int g = 0; g < direct::kGroupThreads; ++g) {
      float acc[kGroup][kMax + 1] = {};
      direct::accumulate<kMax, kGroup>(s, taps, pixels, ow, residues, ch0, g, direct::kGroupThreads, x.data(), dy, acc);
      for (int k = 0; k < kGroup && ch0 + k < s.k; ++k) {
        for (int t = 0; t < crs; ++t) dw[size_t((ch0 + k) * crs + t)] += acc[k][t];
        db[size_t(ch0 + k)] += acc[k][kMax];
      }
      for (int k = 0; k < kGroup; ++k)  // nothing past C KH KW, nor for channels past K
        for (int t = 0; t <= kMax; ++t) stray += (t >= crs && t < kMax) || ch0 + k >= s.k ? acc[k][t] != 0.0f : 0;
    }
  CHECK(stray == 0);
}

void check_direct(const ConvShape& s, uint32_t seed) {
  const int p = s.out_h() * s.out_w(), residues = direct::residues(s);
  INFO(describe(s) << ", " << residues << " residues");
  const std::vector<float> x = random_floats(size_t(s.n) * s.c * s.h * s.w, seed, -1, 1);
  const std::vector<float> w(size_t(s.k) * size_t(s.col_rows()), 0.0f);
  const std::vector<float> dy = random_floats(size_t(s.n) * s.k * p, seed + 1, -1, 1);
  const Exact e = exact(s, x, w, dy);
  // a thread's chain: its columns' images in turn; then the float it is rounded to
  const int columns = (p * residues + direct::kGroupThreads - 1) / direct::kGroupThreads;
  const double chain = double(columns) * ((s.n + residues - 1) / residues) + 1;
  const std::vector<float> dyt = as_rows(s, dy);
  for (bool rows : {false, true}) {
    INFO((rows ? "dy as rows" : "dy as (N, K, OH, OW)"));
    std::vector<double> dw, db;
    direct::with_tap_bound(int(s.col_rows()), [&]<int kMax>() {
      if (rows)
        emulate<kMax>(s, x, direct::DyRows{dyt.data(), s.n * p, p}, dw, db);
      else
        emulate<kMax>(s, x, direct::DyPlanes{dy.data(), s.k, p}, dw, db);
    });
    check_close("dw", std::vector<float>(dw.begin(), dw.end()), e.dw, gamma_bound(chain, e.dw_abs));
    check_close("db", std::vector<float>(db.begin(), db.end()), e.db, gamma_bound(chain, e.db_abs));
  }
}

// The fused op's backward without dy's rows (DyActPool): dy worked out, as conv_act_pool.cu's
// act_pool_backward_rows_kernel does, from the gradient of a window x window average pooling and the
// activation's output. Every thread's sums must be the bits it gets from that dy written out
// (DyPlanes, held to double above): the same floats in the same order.
template <Activation A>
void check_act_pool(const ConvShape& s, int window, uint32_t seed) {
  const int oh = s.out_h(), ow = s.out_w(), p = oh * ow, ph = oh / window, pw = ow / window;
  INFO(describe(s) << ", window " << window << (A == Activation::relu ? ", relu" : ", sigmoid"));
  const std::vector<float> x = random_floats(size_t(s.n) * s.c * s.h * s.w, seed, -1, 1);
  // relu's output: a third of it zero; sigmoid's: in (0, 1)
  std::vector<float> y_act = random_floats(size_t(s.n) * s.k * p, seed + 1, A == Activation::relu ? -0.5f : 0.01f, 1);
  for (float& v : y_act) v = std::max(v, 0.0f);
  const std::vector<float> dy_pool = random_floats(size_t(s.n) * s.k * ph * pw, seed + 2, -1, 1);
  const float inv = 1.0f / float(window * window);
  std::vector<float> dy(y_act.size());
  for (size_t plane = 0; plane < size_t(s.n) * s.k; ++plane)
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        const bool pooled = i / window < ph && j / window < pw;
        const float g = pooled ? dy_pool[(plane * ph + size_t(i / window)) * pw + size_t(j / window)] * inv : 0.0f;
        const size_t at = plane * p + size_t(i * ow + j);
        dy[at] = math::activate_grad<A>(y_act[at], g);
      }
  std::vector<double> dw, db, fused_dw, fused_db;
  direct::with_tap_bound(int(s.col_rows()), [&]<int kMax>() {
    emulate<kMax>(s, x, direct::DyPlanes{dy.data(), s.k, p}, dw, db);
    emulate<kMax>(s, x, direct::DyActPool<A>{y_act.data(), dy_pool.data(), s.k, p, window, ph, pw, inv}, fused_dw,
                  fused_db);
  });
  CHECK(fused_dw == dw);
  CHECK(fused_db == db);
}

TEST_CASE("direct taps: conv_direct.cu's weight gradient, every thread of its grid on the host, against double") {
  // LeNet's and LeNet-5's first layers (3 x 3, and 5 x 5 padded by 2: the taps outside the image);
  // 37 images over 24 residues (some columns walk two images, others one).
  check_direct({.n = 5, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3}, 1);
  check_direct({.n = 3, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 5, .kw = 5, .pad = 2}, 11);
  check_direct({.n = 37, .c = 1, .h = 28, .w = 28, .k = 7, .kh = 3, .kw = 3}, 21);
  // Two channels, a non-square kernel, a channel count no group divides (16 taps: groups of 2); 32
  // taps; more output pixels than a group has threads (a thread takes two pixels); a 1 x 1 output.
  check_direct({.n = 4, .c = 2, .h = 9, .w = 7, .k = 5, .kh = 3, .kw = 2, .pad = 1}, 31);
  check_direct({.n = 2, .c = 2, .h = 6, .w = 6, .k = 3, .kh = 4, .kw = 4, .pad = 1}, 41);
  check_direct({.n = 2, .c = 1, .h = 140, .w = 130, .k = 3, .kh = 3, .kw = 3, .pad = 1}, 51);
  check_direct({.n = 3, .c = 1, .h = 5, .w = 5, .k = 9, .kh = 5, .kw = 5}, 61);
  // Residues: one an image at most, at least one with no image (an empty shard: clamp's bounds ordered).
  CHECK(direct::residues({.n = 3, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 3, .kw = 3}) == 3);
  CHECK(direct::residues({.n = 0, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 3, .kw = 3}) == 1);
}

TEST_CASE("direct taps: the fused op's weight gradient from the pooled gradient, the bits of dy written out") {
  for (auto check : {check_act_pool<Activation::relu>, check_act_pool<Activation::sigmoid>}) {
    // LeNet's and LeNet-5's first layers; an odd output (its last row and column outside the windows);
    // windows of 3 (a row and column of 26 left over); an output smaller than a window (nothing pooled).
    check({.n = 5, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3}, 2, 71);
    check({.n = 3, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 5, .kw = 5, .pad = 2}, 2, 81);
    check({.n = 4, .c = 1, .h = 17, .w = 20, .k = 9, .kh = 3, .kw = 3, .pad = 1}, 2, 91);
    check({.n = 3, .c = 2, .h = 28, .w = 28, .k = 5, .kh = 3, .kw = 3}, 3, 101);
    check({.n = 3, .c = 2, .h = 3, .w = 6, .k = 5, .kh = 3, .kw = 3}, 2, 111);
  }
}

// The fused op's forward pass in one kernel (forward_window), every thread of its grid on the host,
// against the two kernels it replaces written out: direct_forward_kernel's FMA chain over the taps
// (zero outside the image), then bias_act_pool_kernel's bias, activation and window sum in row order:
// the same bits; the convolution itself also against double.
template <Activation A>
void check_forward(const ConvShape& s, uint32_t seed) {
  const int oh = s.out_h(), ow = s.out_w(), p = oh * ow, ph = oh / 2, pw = ow / 2, crs = int(s.col_rows());
  INFO(describe(s) << (A == Activation::relu ? ", relu" : ", sigmoid"));
  const std::vector<float> x = random_floats(size_t(s.n) * s.c * s.h * s.w, seed, -1, 1);
  const std::vector<float> w = random_floats(size_t(s.k) * crs, seed + 1, -1, 1);
  const std::vector<float> b = random_floats(size_t(s.k), seed + 2, -1, 1);
  std::vector<float> y(size_t(s.n) * s.k * p), act(y.size()), pool(size_t(s.n) * s.k * ph * pw);
  for (int n = 0; n < s.n; ++n)
    for (int k = 0; k < s.k; ++k)
      for (int q = 0; q < p; ++q) {
        float acc = 0.0f;
        for (int t = 0; t < crs; ++t) {
          const int c = t / (s.kh * s.kw), yy = q / ow + t / s.kw % s.kh - s.pad, xx = q % ow + t % s.kw - s.pad;
          const bool inside = yy >= 0 && yy < s.h && xx >= 0 && xx < s.w;
          acc = std::fma(w[size_t(k * crs + t)], inside ? x[size_t(((n * s.c + c) * s.h + yy) * s.w + xx)] : 0.0f, acc);
        }
        const size_t at = size_t((n * s.k + k) * p + q);
        y[at] = acc, act[at] = math::activate<A>(acc + b[size_t(k)]);
      }
  for (size_t plane = 0; plane < size_t(s.n) * s.k; ++plane)
    for (int i = 0; i < ph; ++i)
      for (int j = 0; j < pw; ++j) {
        const float* t = act.data() + plane * p + size_t(2 * i * ow + 2 * j);
        float sum = 0.0f;
        for (int a = 0; a < 2; ++a)
          for (int c = 0; c < 2; ++c) sum += t[a * ow + c];
        pool[plane * ph * pw + size_t(i * pw + j)] = sum * 0.25f;
      }
  const Exact e = exact(s, x, w, std::vector<float>(y.size(), 0.0f));
  check_close("y", y, e.y, gamma_bound(crs, e.y_abs));

  direct::Taps taps{};
  direct::fill_taps(s, taps, 0, 1);
  const cuda::Divider cells(ph * pw), by_pw(pw);
  std::vector<float> got_act(act.size(), NAN), got_pool(pool.size(), NAN);  // every element written, or NaN
  direct::with_tap_bound(crs, [&]<int kMax>() {
    if constexpr (kMax <= direct::kWindowTaps)
      for (int j = 0; j < s.n * ph * pw; ++j)
        direct::forward_window<kMax, A>(s, taps, cells, by_pw, j, x.data(), w.data(), b.data(), got_act.data(),
                                        got_pool.data());
  });
  check_same_bits("y_act", got_act, act);
  check_same_bits("y_pool", got_pool, pool);
}

TEST_CASE("direct taps: the fused op's forward pass in one kernel, every thread on the host, the two kernels' bits") {
  for (auto check : {check_forward<Activation::relu>, check_forward<Activation::sigmoid>}) {
    // LeNet's first layer (13 x 13 windows); padded; 16 taps (the larger bound), a non-square image; two
    // channels and a non-square kernel, two windows by one.
    check({.n = 3, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3}, 121);
    check({.n = 2, .c = 1, .h = 10, .w = 8, .k = 5, .kh = 3, .kw = 3, .pad = 1}, 131);
    check({.n = 2, .c = 1, .h = 9, .w = 11, .k = 3, .kh = 4, .kw = 4}, 141);
    check({.n = 2, .c = 2, .h = 3, .w = 5, .k = 4, .kh = 2, .kw = 2}, 151);
  }
}

}  // namespace
}  // namespace dp::test
