// conv_direct.cu's weight gradient, a thread's part of it (kernels/cuda/direct_taps.h's accumulate),
// run on the host for every thread of the grid CudaOps::direct_filter_grad launches (kSlices blocks
// of kBlock threads a group of channels), against convolutions in double. The threads' sums are
// added here in double (on the GPU: the warp's shuffles, the block's warps, the slices in order), so
// the bound is a thread's own FMA chain: a tap, pixel or image off by one is far outside it. The
// header is plain C++ outside nvcc and Divider's host arithmetic is the device's
// (tests/test_divider.cpp); the kernel itself is the `cuda: ops: conv2d*` cases'.
#include <doctest/doctest.h>

#include <vector>

#include "kernels/cuda/direct_taps.h"
#include "tests/conv_exact.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

namespace direct = cuda::direct;

// dw (K, C KH KW) and db (K) as the kernel's threads sum them, the threads added up in double.
template <int kMax>
void emulate(const ConvShape& s, const std::vector<float>& x, const std::vector<float>& dy, bool rows,
             std::vector<float>& dw, std::vector<float>& db) {
  constexpr int kGroup = direct::kGroupOf<kMax>;
  const int crs = int(s.col_rows()), residues = direct::residues(s);
  const cuda::Divider pixels(s.out_h() * s.out_w()), ow(s.out_w());
  direct::Taps taps{};
  direct::fill_taps(s, taps, 0, 1);
  std::vector<double> w_sum(size_t(s.k) * crs, 0.0), b_sum(size_t(s.k), 0.0);
  int64_t stray = 0;  // sums where none belongs
  for (int ch0 = 0; ch0 < s.k; ch0 += kGroup)
    for (int g = 0; g < direct::kGroupThreads; ++g) {
      float acc[kGroup][kMax + 1] = {};
      if (rows)
        direct::accumulate<kMax, kGroup, true>(s, taps, pixels, ow, residues, ch0, g, direct::kGroupThreads, x.data(),
                                               dy.data(), acc);
      else
        direct::accumulate<kMax, kGroup, false>(s, taps, pixels, ow, residues, ch0, g, direct::kGroupThreads, x.data(),
                                                dy.data(), acc);
      for (int k = 0; k < kGroup && ch0 + k < s.k; ++k) {
        for (int t = 0; t < crs; ++t) w_sum[size_t((ch0 + k) * crs + t)] += acc[k][t];
        b_sum[size_t(ch0 + k)] += acc[k][kMax];
      }
      for (int k = 0; k < kGroup; ++k)  // nothing past C KH KW, nor for channels past K
        for (int t = 0; t <= kMax; ++t) stray += (t >= crs && t < kMax) || ch0 + k >= s.k ? acc[k][t] != 0.0f : 0;
    }
  CHECK(stray == 0);
  dw.assign(w_sum.begin(), w_sum.end());
  db.assign(b_sum.begin(), b_sum.end());
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
  for (bool rows : {false, true}) {
    INFO((rows ? "dy as rows" : "dy as (N, K, OH, OW)"));
    std::vector<float> dw, db;
    direct::with_tap_bound(int(s.col_rows()),
                           [&]<int kMax>() { emulate<kMax>(s, x, rows ? as_rows(s, dy) : dy, rows, dw, db); });
    check_close("dw", dw, e.dw, gamma_bound(chain, e.dw_abs));
    check_close("db", db, e.db, gamma_bound(chain, e.db_abs));
  }
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
}

}  // namespace
}  // namespace dp::test
