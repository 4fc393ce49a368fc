// BatchNorm's five ops over the op matrix (tests/ops_matrix.h): a whole layer worked out by hand;
// each op against the double reference (kernels/cpu/batchnorm.cpp) with tolerances derived below,
// over shapes with HW = 1 (BatchNorm1d), n = 2 and 1, odd sizes, C not a multiple of 8, and channels
// longer than a CUDA block; the running statistics by hand and against the reference. Against PyTorch:
// test_ops_batchnorm_golden.cpp; gradients: test_gradcheck_bn.cpp.
#include <doctest/doctest.h>

#include "tests/batchnorm_ops.h"

namespace dp::test {
namespace {

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
    for (const auto& pass : {std::tuple{"training (batch statistics)", batch, 1e-5f},
                             std::tuple{"evaluation (running statistics)", running, 1e-3f}}) {
      // Copies, not structured bindings: clang 14 cannot capture a binding (CAPTURE, the lambdas below).
      const char* what = std::get<0>(pass);
      const Stats& st = std::get<1>(pass);
      const float eps = std::get<2>(pass);
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
  for (auto [count_, momentum_] : {std::pair{int64_t(2), 0.1f}, std::pair{int64_t(5408), 0.01f},
                                   std::pair{int64_t(6), 0.9f}, std::pair{int64_t(3), 0.0f}}) {
    const auto count = count_;  // a copy: clang 14 cannot capture a structured binding (CAPTURE)
    const auto momentum = momentum_;
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

}  // namespace
}  // namespace dp::test
