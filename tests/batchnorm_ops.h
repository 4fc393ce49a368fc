// BatchNorm's ops as the tests drive them over the op matrix (tests/ops_matrix.h): shapes, inputs with
// a mean and spread per channel, the batch statistics as the engine forms them, and each op run on a
// backend (test_ops_batchnorm.cpp, test_ops_batchnorm_golden.cpp).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"
#include "train/checkpoint.h"

namespace dp::test {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

// Double's unit roundoff, and its gamma(k): the channel sums accumulate in double on every backend.
constexpr double kUd = 0x1p-53;
inline double gamma_d(double k) { return k * kUd / (1 - k * kUd); }

struct Shape {
  int n, c, hw;
  int64_t count() const { return int64_t(n) * hw; }
  size_t size() const { return size_t(n) * c * hw; }
};

// BatchNorm1d on (N, C): hw = 1, n = 2 (the smallest batch PyTorch trains), LeNet-BN's bn3 (64, 128),
// and channels of 300 values, more than a CUDA block's threads; BatchNorm2d with n = 1, odd sizes and
// C not a multiple of 8, and LeNet-BN's bn1 and bn2 (8 images).
inline const Shape kShapes[] = {{2, 3, 1},  {5, 7, 1},   {64, 128, 1}, {300, 9, 1},  {1, 5, 7},
                                {3, 13, 9}, {4, 11, 16}, {2, 50, 81},  {8, 20, 676}, {8, 50, 81}};

// (N, C, HW) with a different mean and spread per channel (the statistics must not be those of the
// whole tensor; a mean far from 0 makes the squared deviations, not x^2, matter).
inline Vec make_x(const Shape& s, uint32_t seed) {
  const Vec u = random_floats(s.size(), seed, -1, 1);
  const Vec off = random_floats(size_t(s.c), seed + 1, -3, 3), spread = random_floats(size_t(s.c), seed + 2, 0.2f, 2);
  Vec x(s.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t ch = i / size_t(s.hw) % size_t(s.c);
    x[i] = off[ch] + spread[ch] * u[i];
  }
  return x;
}

// The batch statistics as float, as the engine forms them: the float sums divided by count.
struct Stats {
  Vec mean, var;
};
inline Stats batch_stats(const Shape& s, const Vec& x) {
  Vec sum(size_t(s.c)), mean(size_t(s.c)), var(size_t(s.c));
  cpu::bn_channel_sums<float>(s.n, s.c, s.hw, x.data(), nullptr, 1.0f, sum.data());
  for (int ch = 0; ch < s.c; ++ch) mean[ch] = math::bn_mean_of(sum[ch], s.count());
  cpu::bn_channel_sums<float>(s.n, s.c, s.hw, x.data(), mean.data(), 1.0f, sum.data());
  for (int ch = 0; ch < s.c; ++ch) var[ch] = math::bn_mean_of(sum[ch], s.count());
  return {mean, var};
}

inline Vec channel_sums(Backend& be, const Shape& s, const Vec& x, const Vec* mean, float scale = 1.0f) {
  Mem gx = be.put(x), gm = be.put(mean ? *mean : Vec{}), out = be.out(size_t(s.c));
  be.run([&](Ops& ops) { ops.bn_channel_sums(s.n, s.c, s.hw, gx.f(), mean ? gm.f() : nullptr, scale, out.f()); });
  return be.get(out);
}
inline Vec normalize(Backend& be, const Shape& s, const Vec& x, const Vec& mean, const Vec& var, const Vec& gamma,
                     const Vec& beta, float eps) {
  Mem gx = be.put(x), gm = be.put(mean), gv = be.put(var), gg = be.put(gamma), gb = be.put(beta), gy = be.out(x.size());
  be.run([&](Ops& ops) { ops.bn_normalize(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), gg.f(), gb.f(), eps, gy.f()); });
  return be.get(gy);
}
inline Vec backward_sums(Backend& be, const Shape& s, const Vec& x, const Vec& mean, const Vec& var, float eps,
                         const Vec& dy) {
  Mem gx = be.put(x), gm = be.put(mean), gv = be.put(var), gdy = be.put(dy), out = be.out(2 * size_t(s.c));
  be.run([&](Ops& ops) { ops.bn_backward_sums(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), eps, gdy.f(), out.f()); });
  return be.get(out);
}
inline Vec backward_dx(Backend& be, const Shape& s, const Vec& x, const Vec& mean, const Vec& var, float eps,
                       const Vec& gamma, const Vec& dy, const Vec& sums, int64_t count) {
  Mem gx = be.put(x), gm = be.put(mean), gv = be.put(var), gg = be.put(gamma), gdy = be.put(dy), gs = be.put(sums);
  Mem gdx = be.out(x.size());
  be.run([&](Ops& ops) {
    ops.bn_backward_dx(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), eps, gg.f(), gdy.f(), gs.f(), count, gdx.f());
  });
  return be.get(gdx);
}
struct Running {
  Vec mean, var;
};
inline Running update_running(Backend& be, int c, const Vec& mean, const Vec& var, int64_t count, float momentum,
                              const Vec& running_mean, const Vec& running_var) {
  Mem gm = be.put(mean), gv = be.put(var), rm = be.put(running_mean), rv = be.put(running_var);
  be.run([&](Ops& ops) { ops.bn_update_running(c, gm.f(), gv.f(), count, momentum, rm.f(), rv.f()); });
  return {be.get(rm), be.get(rv)};
}

}  // namespace dp::test
