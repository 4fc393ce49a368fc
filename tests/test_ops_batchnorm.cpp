// BatchNorm's five ops over the op matrix (tests/ops_matrix.h): a whole layer worked out by hand;
// each op against the double reference (kernels/cpu/batchnorm.cpp) with tolerances derived below,
// over shapes with HW = 1 (BatchNorm1d), n = 2 and 1, odd sizes, C not a multiple of 8, and channels
// longer than a CUDA block; the running statistics by hand and against the reference; and the ops
// composed as the engine composes them against PyTorch's BatchNorm2d and BatchNorm1d
// (tests/golden/batchnorm.safetensors, bench/make_golden.py). Gradients: test_gradcheck_bn.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "train/checkpoint.h"
#include "kernels/cpu/kernels.h"
#include "kernels/math.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

// Double's unit roundoff, and its gamma(k): the channel sums accumulate in double on every backend.
constexpr double kUd = 0x1p-53;
double gamma_d(double k) { return k * kUd / (1 - k * kUd); }

struct Shape {
  int n, c, hw;
  int64_t count() const { return int64_t(n) * hw; }
  size_t size() const { return size_t(n) * c * hw; }
};

// BatchNorm1d on (N, C): hw = 1, n = 2 (the smallest batch PyTorch trains), LeNet-BN's bn3 (64, 128),
// and channels of 300 values, more than a CUDA block's threads; BatchNorm2d with n = 1, odd sizes and
// C not a multiple of 8, and LeNet-BN's bn1 and bn2 (8 images).
const Shape kShapes[] = {{2, 3, 1},  {5, 7, 1},   {64, 128, 1}, {300, 9, 1},  {1, 5, 7},
                         {3, 13, 9}, {4, 11, 16}, {2, 50, 81},  {8, 20, 676}, {8, 50, 81}};

// (N, C, HW) with a different mean and spread per channel (the statistics must not be those of the
// whole tensor; a mean far from 0 makes the squared deviations, not x^2, matter).
Vec make_x(const Shape& s, uint32_t seed) {
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
Stats batch_stats(const Shape& s, const Vec& x) {
  Vec sum(size_t(s.c)), mean(size_t(s.c)), var(size_t(s.c));
  cpu::bn_channel_sums<float>(s.n, s.c, s.hw, x.data(), nullptr, 1.0f, sum.data());
  for (int ch = 0; ch < s.c; ++ch) mean[ch] = math::bn_mean_of(sum[ch], s.count());
  cpu::bn_channel_sums<float>(s.n, s.c, s.hw, x.data(), mean.data(), 1.0f, sum.data());
  for (int ch = 0; ch < s.c; ++ch) var[ch] = math::bn_mean_of(sum[ch], s.count());
  return {mean, var};
}

Vec channel_sums(Backend& be, const Shape& s, const Vec& x, const Vec* mean, float scale = 1.0f) {
  Mem gx = be.put(x), gm = be.put(mean ? *mean : Vec{}), out = be.out(size_t(s.c));
  be.run([&](Ops& ops) { ops.bn_channel_sums(s.n, s.c, s.hw, gx.f(), mean ? gm.f() : nullptr, scale, out.f()); });
  return be.get(out);
}
Vec normalize(Backend& be, const Shape& s, const Vec& x, const Vec& mean, const Vec& var, const Vec& gamma,
              const Vec& beta, float eps) {
  Mem gx = be.put(x), gm = be.put(mean), gv = be.put(var), gg = be.put(gamma), gb = be.put(beta), gy = be.out(x.size());
  be.run([&](Ops& ops) { ops.bn_normalize(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), gg.f(), gb.f(), eps, gy.f()); });
  return be.get(gy);
}
Vec backward_sums(Backend& be, const Shape& s, const Vec& x, const Vec& mean, const Vec& var, float eps,
                  const Vec& dy) {
  Mem gx = be.put(x), gm = be.put(mean), gv = be.put(var), gdy = be.put(dy), out = be.out(2 * size_t(s.c));
  be.run([&](Ops& ops) { ops.bn_backward_sums(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), eps, gdy.f(), out.f()); });
  return be.get(out);
}
Vec backward_dx(Backend& be, const Shape& s, const Vec& x, const Vec& mean, const Vec& var, float eps, const Vec& gamma,
                const Vec& dy, const Vec& sums, int64_t count) {
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
Running update_running(Backend& be, int c, const Vec& mean, const Vec& var, int64_t count, float momentum,
                       const Vec& running_mean, const Vec& running_var) {
  Mem gm = be.put(mean), gv = be.put(var), rm = be.put(running_mean), rv = be.put(running_var);
  be.run([&](Ops& ops) { ops.bn_update_running(c, gm.f(), gv.f(), count, momentum, rm.f(), rv.f()); });
  return {be.get(rm), be.get(rv)};
}

DP_OPS_TEST("batchnorm: a whole layer by hand, and PyTorch's running statistics by hand") {
  SUBCASE("x = 1, 2, 3, 4 in one channel, eps = 0, gamma = 2, beta = 1") {
    // mean 2.5, biased var 1.25, sqrt 1.1180340; xhat = (-1.5, -0.5, 0.5, 1.5) / 1.1180340.
    // dy = (1, 0, 0, 0): sum dy = 1, sum dy xhat = -1.3416408; dx_i = 2 / 1.1180340 *
    // (dy_i - 1/4 - xhat_i * -1.3416408 / 4) = 1.7888544 * (0.3, -0.4, -0.1, 0.2).
    const Shape s{4, 1, 1};
    const Vec x = {1, 2, 3, 4};
    const Vec sum = channel_sums(be, s, x, nullptr);
    CHECK(sum[0] == 10.0f);
    const Vec mean = {2.5f}, dev = channel_sums(be, s, x, &mean);
    CHECK(dev[0] == 5.0f);
    const Vec var = {1.25f}, gamma = {2.0f}, beta = {1.0f};
    const Vec y = normalize(be, s, x, mean, var, gamma, beta, 0.0f);
    const double xhat[] = {-1.3416407864998738, -0.4472135954999579, 0.4472135954999579, 1.3416407864998738};
    for (int i = 0; i < 4; ++i) CHECK(y[i] == doctest::Approx(1 + 2 * xhat[i]).epsilon(1e-6));
    const Vec dy = {1, 0, 0, 0};
    const Vec sums = backward_sums(be, s, x, mean, var, 0.0f, dy);
    CHECK(sums[0] == 1.0f);
    CHECK(sums[1] == doctest::Approx(xhat[0]).epsilon(1e-6));
    const Vec dx = backward_dx(be, s, x, mean, var, 0.0f, gamma, dy, sums, 4);
    const double want[] = {0.3, -0.4, -0.1, 0.2};
    for (int i = 0; i < 4; ++i) CHECK(dx[i] == doctest::Approx(1.7888543819998317 * want[i]).epsilon(1e-6));
  }
  SUBCASE("running statistics: momentum on the batch, the variance unbiased") {
    // momentum 0.1, count 4 (unbiased factor 4/3):
    //   mean (1, -2), running (0, 1):  0.9 * 0 + 0.1 * 1 = 0.1;  0.9 * 1 + 0.1 * -2 = 0.7
    //   var (0.5, 2), running (1, 1):  0.9 + 0.1 * 0.5 * 4/3 = 0.9666667;  0.9 + 0.1 * 2 * 4/3 = 1.1666667
    const Running r = update_running(be, 2, {1, -2}, {0.5f, 2}, 4, 0.1f, {0, 1}, {1, 1});
    CHECK(r.mean[0] == doctest::Approx(0.1).epsilon(1e-6));
    CHECK(r.mean[1] == doctest::Approx(0.7).epsilon(1e-6));
    CHECK(r.var[0] == doctest::Approx(0.9 + 0.1 * 0.5 * 4 / 3).epsilon(1e-6));
    CHECK(r.var[1] == doctest::Approx(0.9 + 0.1 * 2.0 * 4 / 3).epsilon(1e-6));
    // count 2: factor 2; momentum 1 keeps only the batch
    const Running r2 = update_running(be, 1, {3}, {0.25f}, 2, 1.0f, {7}, {7});
    CHECK(r2.mean[0] == 3.0f);
    CHECK(r2.var[0] == 0.5f);
  }
  SUBCASE("count < 2 is refused, as PyTorch refuses a channel of one value") {
    Mem m = be.put(Vec{1}), v = be.put(Vec{1}), rm = be.put(Vec{0}), rv = be.put(Vec{1});
    CHECK_THROWS_AS(be.run([&](Ops& ops) { ops.bn_update_running(1, m.f(), v.f(), 1, 0.1f, rm.f(), rv.f()); }),
                    std::invalid_argument);
    CHECK(be.get(rm)[0] == 0.0f);
    CHECK(be.get(rv)[0] == 1.0f);
  }
}

DP_OPS_TEST("batchnorm: channel sums against the double reference, within a float rounding") {
  // Every backend accumulates in double (a difference of two floats and its square are exact in
  // double, or within 2 roundings of 2^-53), then rounds once to float: within u |sum| + gamma_d(k + 2)
  // sum|terms| of the exact sum, k = N * HW terms. The oracle is within the second part too, hence
  // 2 gamma_d; one more for the products of the roundings. A float accumulation (error of order
  // k u sum|terms|) fails this by orders of magnitude for the longer channels.
  uint32_t seed = 300;
  for (const Shape& s : kShapes) {
    CAPTURE(s.n);
    CAPTURE(s.c);
    CAPTURE(s.hw);
    const Vec x = make_x(s, seed++);
    const double k = double(s.count());
    DVec want(size_t(s.c)), abs_sum(size_t(s.c));
    cpu::bn_channel_sums<double>(s.n, s.c, s.hw, dbl(x).data(), nullptr, 1.0, want.data());
    cpu::bn_channel_sums<double>(s.n, s.c, s.hw, dbl(x, true).data(), nullptr, 1.0, abs_sum.data());
    DVec tol(size_t(s.c));
    for (size_t ch = 0; ch < tol.size(); ++ch) tol[ch] = kU * std::fabs(want[ch]) + 3 * gamma_d(k + 2) * abs_sum[ch];
    check_close("sum of x", channel_sums(be, s, x, nullptr), want, tol);
    // Scaled (the engine's 1 / count) before the one rounding: the same bound, scaled.
    const float scale = float(1.0 / k);
    DVec want_scaled(want), tol_scaled(tol);
    for (size_t ch = 0; ch < tol.size(); ++ch)
      want_scaled[ch] *= double(scale), tol_scaled[ch] = tol[ch] * double(scale) + kU * std::fabs(want_scaled[ch]);
    check_close("mean of x", channel_sums(be, s, x, nullptr, scale), want_scaled, tol_scaled);

    const Vec mean = batch_stats(s, x).mean;
    cpu::bn_channel_sums<double>(s.n, s.c, s.hw, dbl(x).data(), dbl(mean).data(), 1.0, want.data());
    for (size_t ch = 0; ch < tol.size(); ++ch) tol[ch] = kU * want[ch] + 3 * gamma_d(k + 2) * want[ch];  // terms >= 0
    check_close("sum of squared deviations", channel_sums(be, s, x, &mean), want, tol);
  }
  SUBCASE("n = 0: empty sums are zero") {
    const Shape s{0, 5, 9};
    const Vec mean(5, 1.0f);
    CHECK(channel_sums(be, s, {}, nullptr) == Vec(5, 0.0f));
    CHECK(channel_sums(be, s, {}, &mean) == Vec(5, 0.0f));
  }
}

DP_OPS_TEST("batchnorm: normalize in training and evaluation against the double reference") {
  // y = ((x - mean) * inv_std) * gamma + beta in float, inv_std = 1 / sqrt(var + eps): the addition
  // rounds (u), sqrt halves that and rounds (1.5u), the division rounds (2.5u); x - mean (u) and the
  // product with inv_std (u) put xhat within 4.5u of itself, the product t with gamma within 5.5u of
  // |t|, and the addition of beta adds u |y|. With the second-order terms: 6u |t| + u |y| (a fused
  // multiply-add rounds less). |t| = |y - beta| from the oracle.
  uint32_t seed = 400;
  for (const Shape& s : kShapes) {
    CAPTURE(s.n);
    CAPTURE(s.c);
    CAPTURE(s.hw);
    const Vec x = make_x(s, seed++);
    Vec gamma = random_floats(size_t(s.c), seed++, 0.5f, 1.5f);
    for (size_t ch = 0; ch < gamma.size(); ch += 3) gamma[ch] = -gamma[ch];  // a negative scale too
    const Vec beta = random_floats(size_t(s.c), seed++, -1, 1);
    const Stats batch = batch_stats(s, x);
    const Stats running = {random_floats(size_t(s.c), seed++, -3, 3), random_floats(size_t(s.c), seed++, 0.1f, 3)};
    for (const auto& [what, st, eps] : {std::tuple{"training (batch statistics)", batch, 1e-5f},
                                        std::tuple{"evaluation (running statistics)", running, 1e-3f}}) {
      CAPTURE(what);
      DVec want(s.size());
      cpu::bn_normalize<double>(s.n, s.c, s.hw, dbl(x).data(), dbl(st.mean).data(), dbl(st.var).data(),
                                dbl(gamma).data(), dbl(beta).data(), double(eps), want.data());
      DVec tol(want.size());
      for (size_t i = 0; i < tol.size(); ++i) {
        const double b = beta[i / size_t(s.hw) % size_t(s.c)];
        tol[i] = 6 * kU * std::fabs(want[i] - b) + kU * std::fabs(want[i]);
      }
      const Vec y = normalize(be, s, x, st.mean, st.var, gamma, beta, eps);
      check_close("y", y, want, tol);
      // In place (y == x): the same values.
      Mem gx = be.put(x), gm = be.put(st.mean), gv = be.put(st.var), gg = be.put(gamma), gb = be.put(beta);
      be.run([&](Ops& ops) { ops.bn_normalize(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), gg.f(), gb.f(), eps, gx.f()); });
      check_same_bits("y in place", be.get(gx), y);
    }
  }
  SUBCASE("n = 0 touches nothing") {
    const Vec one(3, 1.0f);
    Mem y = be.out(0);
    Mem g = be.put(one);
    be.run([&](Ops& ops) { ops.bn_normalize(0, 3, 4, g.f(), g.f(), g.f(), g.f(), g.f(), 1e-5f, y.f()); });
    be.get(y);  // the guard
  }
}

DP_OPS_TEST("batchnorm: backward sums against the double reference, within a float rounding") {
  // Accumulated in double like the channel sums, with xhat in double (x - mean exact, inv_std within
  // 2.5 and the product 1 rounding of 2^-53) and the product dy * xhat one more: each term within
  // 5 roundings of 2^-53, so the sums within gamma_d(k + 6) sum|terms| before the final float
  // rounding, and the oracle likewise (2 gamma_d, and one more for the products).
  uint32_t seed = 500;
  for (const Shape& s : kShapes) {
    CAPTURE(s.n);
    CAPTURE(s.c);
    CAPTURE(s.hw);
    const Vec x = make_x(s, seed++), dy = random_floats(s.size(), seed++, -1, 1);
    const Stats st = batch_stats(s, x);
    const float eps = 1e-5f;
    DVec want(2 * size_t(s.c)), abs_sum(2 * size_t(s.c), 0.0);
    cpu::bn_backward_sums<double>(s.n, s.c, s.hw, dbl(x).data(), dbl(st.mean).data(), dbl(st.var).data(), eps,
                                  dbl(dy).data(), want.data());
    for (size_t i = 0; i < s.size(); ++i) {
      const size_t ch = i / size_t(s.hw) % size_t(s.c);
      const double xhat = (double(x[i]) - st.mean[ch]) * math::bn_inv_std(double(st.var[ch]), double(eps));
      abs_sum[ch] += std::fabs(dy[i]);
      abs_sum[size_t(s.c) + ch] += std::fabs(dy[i] * xhat);
    }
    DVec tol(want.size());
    for (size_t i = 0; i < tol.size(); ++i)
      tol[i] = kU * std::fabs(want[i]) + 3 * gamma_d(double(s.count()) + 6) * abs_sum[i];
    check_close("sums (dbeta, dgamma)", backward_sums(be, s, x, st.mean, st.var, eps, dy), want, tol);
  }
  SUBCASE("n = 0: zeros") {
    const Vec one(4, 1.0f);
    CHECK(backward_sums(be, {0, 4, 3}, {}, one, one, 1e-5f, {}) == Vec(8, 0.0f));
  }
}

DP_OPS_TEST("batchnorm: input gradient against the double reference, with the local and a global count") {
  // dx = (gamma * inv_std) * ((dy - mean_dy) - xhat * mean_dy_xhat) in float, mean_dy = sums[0] /
  // count (u), mean_dy_xhat likewise: gamma * inv_std within 3.5u (inv_std 2.5u, see the normalize
  // test), xhat within 4.5u, its product with mean_dy_xhat within 6.5u; the two subtractions add u
  // each of partial sums bounded by A = |dy| + |mean_dy| + |xhat mean_dy_xhat|: the bracket within
  // 7.5u A, and with gamma * inv_std's 3.5u and the last product's u, dx within 12u |gamma inv_std| A;
  // 13u with the second-order terms. A global count (SyncBatchNorm: the statistics over 3 replicas'
  // values) changes the means, not the bound.
  uint32_t seed = 600;
  for (const Shape& s : kShapes) {
    for (int replicas : {1, 3}) {
      CAPTURE(s.n);
      CAPTURE(s.c);
      CAPTURE(s.hw);
      CAPTURE(replicas);
      const int64_t count = s.count() * replicas;
      const Vec x = make_x(s, seed++), dy = random_floats(s.size(), seed++, -1, 1);
      Vec gamma = random_floats(size_t(s.c), seed++, 0.5f, 1.5f);
      gamma[0] = -gamma[0];
      const Stats st = batch_stats(s, x);
      const float eps = 1e-5f;
      Vec sums(2 * size_t(s.c));
      cpu::bn_backward_sums<float>(s.n, s.c, s.hw, x.data(), st.mean.data(), st.var.data(), eps, dy.data(),
                                   sums.data());
      for (float& v : sums) v *= float(replicas);  // as if the other replicas had added the same
      DVec want(s.size()), tol(s.size());
      cpu::bn_backward_dx<double>(s.n, s.c, s.hw, dbl(x).data(), dbl(st.mean).data(), dbl(st.var).data(), eps,
                                  dbl(gamma).data(), dbl(dy).data(), dbl(sums).data(), count, want.data());
      for (size_t i = 0; i < s.size(); ++i) {
        const size_t ch = i / size_t(s.hw) % size_t(s.c);
        const double inv_std = math::bn_inv_std(double(st.var[ch]), double(eps));
        const double xhat = (double(x[i]) - st.mean[ch]) * inv_std;
        const double a = std::fabs(dy[i]) + std::fabs(double(sums[ch]) / double(count)) +
                         std::fabs(xhat * sums[size_t(s.c) + ch] / double(count));
        tol[i] = 13 * kU * std::fabs(gamma[ch] * inv_std) * a;
      }
      const Vec dx = backward_dx(be, s, x, st.mean, st.var, eps, gamma, dy, sums, count);
      check_close("dx", dx, want, tol);
      // In place (dx == dy): the same values.
      Mem gx = be.put(x), gm = be.put(st.mean), gv = be.put(st.var), gg = be.put(gamma), gdy = be.put(dy),
          gs = be.put(sums);
      be.run([&](Ops& ops) {
        ops.bn_backward_dx(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), eps, gg.f(), gdy.f(), gs.f(), count, gdy.f());
      });
      check_same_bits("dx in place", be.get(gdy), dx);
    }
  }
}

DP_OPS_TEST("batchnorm: running statistics against the double reference") {
  // (1 - m) r + m mean: 1 - m, the two products and the sum round once each: within 4u of
  // |(1 - m) r| + |m mean|. The variance's var * count / (count - 1) adds two roundings (count is
  // exact in float below 2^24): 6u of |(1 - m) r| + |m var count / (count - 1)|.
  const int c = 37;
  const Vec mean = random_floats(c, 700, -3, 3), var = random_floats(c, 701, 0, 4);
  const Vec rm = random_floats(c, 702, -3, 3), rv = random_floats(c, 703, 0.1f, 4);
  for (auto [count, momentum] : {std::pair{int64_t(2), 0.1f}, std::pair{int64_t(5408), 0.01f},
                                 std::pair{int64_t(6), 0.9f}, std::pair{int64_t(3), 0.0f}}) {
    CAPTURE(count);
    CAPTURE(momentum);
    DVec want_m = dbl(rm), want_v = dbl(rv), tol_m(c), tol_v(c);
    cpu::bn_update_running<double>(c, dbl(mean).data(), dbl(var).data(), count, momentum, want_m.data(), want_v.data());
    const double m = momentum, keep = 1 - m, factor = double(count) / double(count - 1);
    for (int ch = 0; ch < c; ++ch) {
      tol_m[ch] = 4 * kU * (std::fabs(keep * rm[ch]) + std::fabs(m * mean[ch]));
      tol_v[ch] = 6 * kU * (std::fabs(keep * rv[ch]) + std::fabs(m * var[ch] * factor));
    }
    const Running r = update_running(be, c, mean, var, count, momentum, rm, rv);
    check_close("running_mean", r.mean, want_m, tol_m);
    check_close("running_var", r.var, want_v, tol_v);
  }
}

// ---- against PyTorch -------------------------------------------------------------------------------

Vec golden(const SafeTensors& g, const std::string& name) {
  const Tensor& t = g.tensors.at(name);
  REQUIRE(t.dtype == "F32");
  Vec v(t.data.size() / 4);
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

DP_OPS_TEST("batchnorm: the ops composed match PyTorch's BatchNorm2d and BatchNorm1d (golden)") {
  // Composed as the engine composes a training step: sums -> mean = sum / count -> squared-deviation
  // sums -> biased var -> normalize; backward sums (dbias, dweight) -> dx; the running statistics;
  // and evaluation with PyTorch's running statistics after the step.
  //
  // Tolerance: both implementations are within a bound B of the exact layer on these float inputs,
  // so they are within 2B of each other. Per channel, k = count, M = max |x|, s = 1 / sqrt(var + eps),
  // g = |gamma|. Float sums of k terms put the mean within gamma(k + 1) M and the variance within
  // gamma(k + 3) of itself (its terms are positive; the mean's error enters at second order), so s
  // within gamma(k + 6) of itself; the element-wise ops add at most 6u of their operands (the
  // normalize and dx tests above; PyTorch's x * alpha + (beta - mean * alpha) form is within the
  // same). Collected generously under gamma(k + 10):
  //   y        g s (M + |x - mean|) + |beta| + |y|
  //   dx       g s (|dy| + mean|dy| + |xhat| mean|dy xhat| + (s M + |xhat|) |mean(dy xhat)| + |bracket|)
  //   dweight  sum |dy| (|xhat| + s M);   dbias  sum |dy| (gamma(k) suffices)
  //   running  m M and m var k / (k - 1), each with 4u of the update's terms
  //   y_eval   6u (g s (|x| + |mean|) + |beta| + |y|): no sums, the same running statistics as input.
  // For these sizes (k = 36 and 6) that is ~1e-5 relative: a biased running variance or an unbiased
  // normalisation (k / (k - 1): 3% and 20%), eps or momentum swapped for PyTorch's defaults (the file
  // uses 1e-3 and 0.2), or a mean over the wrong axis are all far outside it.
  const SafeTensors g = read_safetensors(std::string(DP_SOURCE_DIR) + "/tests/golden/batchnorm.safetensors");
  const float eps = std::stof(g.metadata.at("eps")), momentum = std::stof(g.metadata.at("momentum"));
  for (const std::string p : {"bn2d", "bn1d"}) {
    CAPTURE(p);
    const std::vector<int64_t>& shape = g.tensors.at(p + ".x").shape;
    int hw = 1;
    for (size_t d = 2; d < shape.size(); ++d) hw *= int(shape[d]);
    const Shape s{int(shape[0]), int(shape[1]), hw};
    const size_t c = size_t(s.c);
    const int64_t count = s.count();
    const Vec x = golden(g, p + ".x"), weight = golden(g, p + ".weight"), bias = golden(g, p + ".bias");
    const Vec dy = golden(g, p + ".dy");
    REQUIRE(x.size() == s.size());

    // The step as the engine composes it (the divisions by count here on the host, with the formula
    // the engine uses).
    Mem gx = be.put(x), gg = be.put(weight), gb = be.put(bias), gdy = be.put(dy);
    Mem sum = be.out(c), gy = be.out(s.size()), sums = be.out(2 * c), gdx = be.out(s.size());
    Mem rm = be.put(golden(g, p + ".running_mean0")), rv = be.put(golden(g, p + ".running_var0"));
    be.run([&](Ops& ops) { ops.bn_channel_sums(s.n, s.c, s.hw, gx.f(), nullptr, 1.0f, sum.f()); });
    Vec mean = be.get(sum);
    for (float& v : mean) v = math::bn_mean_of(v, count);
    Mem gm = be.put(mean);
    be.run([&](Ops& ops) { ops.bn_channel_sums(s.n, s.c, s.hw, gx.f(), gm.f(), 1.0f, sum.f()); });
    Vec var = be.get(sum);
    for (float& v : var) v = math::bn_mean_of(v, count);
    Mem gv = be.put(var);
    be.run([&](Ops& ops) {
      ops.bn_normalize(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), gg.f(), gb.f(), eps, gy.f());
      ops.bn_backward_sums(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), eps, gdy.f(), sums.f());
      ops.bn_backward_dx(s.n, s.c, s.hw, gx.f(), gm.f(), gv.f(), eps, gg.f(), gdy.f(), sums.f(), count, gdx.f());
      ops.bn_update_running(s.c, gm.f(), gv.f(), count, momentum, rm.f(), rv.f());
    });
    const Vec y = be.get(gy), dx = be.get(gdx), sum2 = be.get(sums);
    const Vec dbias(sum2.begin(), sum2.begin() + ptrdiff_t(c)), dweight(sum2.begin() + ptrdiff_t(c), sum2.end());
    // Evaluation with PyTorch's running statistics (its update is checked separately, just below).
    const Vec rm_t = golden(g, p + ".running_mean"), rv_t = golden(g, p + ".running_var");
    const Vec y_eval = normalize(be, s, x, rm_t, rv_t, weight, bias, eps);

    // The bounds, from PyTorch's values and the exact statistics (double) of x.
    const Vec y_t = golden(g, p + ".y"), dx_t = golden(g, p + ".dx"), y_eval_t = golden(g, p + ".y_eval");
    const Vec dw_t = golden(g, p + ".dweight"), db_t = golden(g, p + ".dbias");
    const Vec rm0 = golden(g, p + ".running_mean0"), rv0 = golden(g, p + ".running_var0");
    DVec mu(c), v(c), big(c, 0.0), inv(c), abs_dy(c, 0.0), abs_dy_xhat(c, 0.0), dw_bound(c, 0.0), m_dy_xhat(c);
    cpu::bn_channel_sums<double>(s.n, s.c, s.hw, dbl(x).data(), nullptr, 1.0, mu.data());
    for (size_t ch = 0; ch < c; ++ch) mu[ch] /= double(count);
    cpu::bn_channel_sums<double>(s.n, s.c, s.hw, dbl(x).data(), mu.data(), 1.0, v.data());
    for (size_t ch = 0; ch < c; ++ch) v[ch] /= double(count), inv[ch] = 1 / std::sqrt(v[ch] + eps);
    auto chan = [&](size_t i) { return i / size_t(s.hw) % c; };
    auto xhat = [&](size_t i) { return (x[i] - mu[chan(i)]) * inv[chan(i)]; };
    for (size_t i = 0; i < s.size(); ++i) {
      const size_t ch = chan(i);
      big[ch] = std::max(big[ch], double(std::fabs(x[i])));
      abs_dy[ch] += std::fabs(dy[i]);
      abs_dy_xhat[ch] += std::fabs(dy[i] * xhat(i));
    }
    for (size_t i = 0; i < s.size(); ++i)
      dw_bound[chan(i)] += std::fabs(dy[i]) * (std::fabs(xhat(i)) + inv[chan(i)] * big[chan(i)]);
    for (size_t ch = 0; ch < c; ++ch) m_dy_xhat[ch] = std::fabs(dw_t[ch]) / double(count);
    const double gk = gamma(double(count) + 10);
    DVec tol_y(s.size()), tol_dx(s.size()), tol_eval(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
      const size_t ch = chan(i);
      const double gs = std::fabs(weight[ch]) * inv[ch], xh = std::fabs(xhat(i));
      tol_y[i] = 2 * gk * (gs * (big[ch] + std::fabs(x[i] - mu[ch])) + std::fabs(bias[ch]) + std::fabs(y_t[i]));
      const double bracket = std::fabs(dy[i] - db_t[ch] / double(count) - xhat(i) * dw_t[ch] / double(count));
      tol_dx[i] = 2 * gk * gs *
                  (std::fabs(dy[i]) + abs_dy[ch] / double(count) + xh * abs_dy_xhat[ch] / double(count) +
                   (inv[ch] * big[ch] + xh) * m_dy_xhat[ch] + bracket);
      const double gs_eval = std::fabs(weight[ch]) / std::sqrt(double(rv_t[ch]) + eps);
      tol_eval[i] = 2 * 6 * kU *
                    (gs_eval * (std::fabs(x[i]) + std::fabs(rm_t[ch])) + std::fabs(bias[ch]) + std::fabs(y_eval_t[i]));
    }
    DVec tol_dw(c), tol_db(c), tol_rm(c), tol_rv(c);
    const double m = momentum, factor = double(count) / double(count - 1);
    for (size_t ch = 0; ch < c; ++ch) {
      tol_dw[ch] = 2 * gk * dw_bound[ch];
      tol_db[ch] = 2 * gamma(double(count)) * abs_dy[ch];
      tol_rm[ch] = 2 * (gk * m * big[ch] + 4 * kU * (std::fabs((1 - m) * rm0[ch]) + std::fabs(m * mu[ch])));
      tol_rv[ch] = 2 * (gk * m * v[ch] * factor + 4 * kU * (std::fabs((1 - m) * rv0[ch]) + m * v[ch] * factor));
    }
    check_close("y", y, y_t, tol_y);
    check_close("dx", dx, dx_t, tol_dx);
    check_close("dweight", dweight, dw_t, tol_dw);
    check_close("dbias", dbias, db_t, tol_db);
    check_close("running_mean", be.get(rm), rm_t, tol_rm);
    check_close("running_var", be.get(rv), rv_t, tol_rv);
    check_close("y_eval", y_eval, y_eval_t, tol_eval);
  }
}

}  // namespace
}  // namespace dp::test
