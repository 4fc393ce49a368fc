// Convolutions worked out in double, for the tests that hold the CUDA kernels' host emulations to them
// (tests/test_tile_gemm.cpp, tests/test_direct_taps.cpp): y, dw, db and dx, each with the sum of its
// terms' magnitudes (the scale of tolerance.h's bounds), and dy as the fused op hands it over.
#pragma once

#include <cmath>
#include <vector>

#include "kernels/ops.h"

namespace dp::test {

// y, dw, db in double, and each one's sum of |terms| (the bound's scale).
struct Exact {
  std::vector<double> y, y_abs, dw, dw_abs, db, db_abs, dx, dx_abs;
};
inline Exact exact(const ConvShape& s, const std::vector<float>& x, const std::vector<float>& w,
                   const std::vector<float>& dy) {
  const int oh = s.out_h(), ow = s.out_w(), p = oh * ow, crs = int(s.col_rows());
  Exact e;
  e.y.assign(size_t(s.n) * s.k * p, 0.0), e.y_abs = e.y;
  e.dw.assign(w.size(), 0.0), e.dw_abs = e.dw, e.db.assign(size_t(s.k), 0.0), e.db_abs = e.db;
  e.dx.assign(x.size(), 0.0), e.dx_abs = e.dx;
  for (int n = 0; n < s.n; ++n)
    for (int k = 0; k < s.k; ++k)
      for (int q = 0; q < p; ++q) {
        const size_t out = size_t((n * s.k + k) * p + q);
        const double d = dy[out];
        e.db[size_t(k)] += d, e.db_abs[size_t(k)] += std::fabs(d);
        for (int t = 0; t < crs; ++t) {
          const int c = t / (s.kh * s.kw), u = t / s.kw % s.kh, v = t % s.kw;
          const int yy = q / ow + u - s.pad, xx = q % ow + v - s.pad;
          if (yy < 0 || yy >= s.h || xx < 0 || xx >= s.w) continue;
          const size_t in = size_t(((n * s.c + c) * s.h + yy) * s.w + xx);
          const double xv = x[in], wv = w[size_t(k * crs + t)];
          e.y[out] += wv * xv, e.y_abs[out] += std::fabs(wv * xv);
          e.dw[size_t(k * crs + t)] += d * xv, e.dw_abs[size_t(k * crs + t)] += std::fabs(d * xv);
          e.dx[in] += wv * d, e.dx_abs[in] += std::fabs(wv * d);
        }
      }
  return e;
}

// dy as the fused op hands it over: its rows (K, N P).
inline std::vector<float> as_rows(const ConvShape& s, const std::vector<float>& dy) {
  const int p = s.out_h() * s.out_w(), r = s.n * p;
  std::vector<float> rows(dy.size());
  for (int n = 0; n < s.n; ++n)
    for (int k = 0; k < s.k; ++k)
      for (int q = 0; q < p; ++q) rows[size_t(k * r + n * p + q)] = dy[size_t((n * s.k + k) * p + q)];
  return rows;
}

}  // namespace dp::test
