// GEMM, linear and softmax cross-entropy over the op matrix (tests/ops_matrix.h): every GEMM transpose
// exact on small integers and against the reference in double on odd and empty sizes; linear with and
// without dx, n = 0 included; softmax cross-entropy's values and stability at large logits worked out
// by hand, its count where logits are NaN, and random rows against the reference in double with a
// derived bound.
//
// GEMM's and linear's tolerances: C = alpha op(A) op(B) + beta C is, per element, k products summed
// in any order (k roundings on a product's path), scaled by alpha and added to beta C (two more):
// within gamma(k + 2) (|alpha| sum |a||b| + |beta| |c|) of the exact value (tests/tolerance.h).
// Linear is such a GEMM: y onto C = the bias (k = IN), dw = dy^T x (k = N), dx = dy W (k = OUT).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;
using Labels = std::vector<int32_t>;

// The reference GEMM in double, and (absolute) its sums of |terms| |alpha| sum |a||b| + |beta| |c|.
DVec gemm_oracle(bool ta, bool tb, int m, int n, int k, float alpha, const Vec& a, const Vec& b, float beta,
                 const Vec& c, bool absolute) {
  DVec out = dbl(c, absolute);
  const double al = absolute ? std::fabs(alpha) : alpha, bt = absolute ? std::fabs(beta) : beta;
  cpu::gemm<double>(ta, tb, m, n, k, al, dbl(a, absolute).data(), dbl(b, absolute).data(), bt, out.data());
  return out;
}

Vec run_gemm(Backend& be, bool ta, bool tb, int m, int n, int k, float alpha, const Vec& a, const Vec& b, float beta,
             const Vec& c) {
  Mem ga = be.put(a), gb = be.put(b), gc = be.put(c);
  be.run([&](Ops& ops) { ops.gemm(ta, tb, m, n, k, alpha, ga.f(), gb.f(), beta, gc.f()); });
  return be.get(gc);
}

DP_OPS_TEST("gemm: all four transpose combinations against a naive loop, exact on small integers") {
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
      const Vec c = run_gemm(be, ta, tb, m, n, k, 2.0f, a, b, -0.5f, c0);
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          float acc = 0;
          for (int p = 0; p < k; ++p) acc += A(i, p) * B(p, j);
          CHECK(c[size_t(i * n + j)] == 2.0f * acc - 0.5f * c0[size_t(i * n + j)]);
        }
    }
}

DP_OPS_TEST("gemm: against the reference for every transpose, odd sizes and empty dimensions") {
  struct Case {
    int m, n, k;
  };
  uint32_t seed = 1;
  for (const Case cs : {Case{1, 1, 1}, Case{7, 5, 3}, Case{33, 17, 129}, Case{64, 64, 64}, Case{3, 129, 800},
                        Case{5, 4, 0}, Case{0, 3, 2}})
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const float alpha = 0.7f, beta = cs.k == 0 ? 0.5f : -0.3f;
      CAPTURE(cs.m);
      CAPTURE(cs.n);
      CAPTURE(cs.k);
      CAPTURE(ta);
      CAPTURE(tb);
      const Vec a = random_floats(size_t(cs.m) * cs.k, seed++, -1, 1),
                b = random_floats(size_t(cs.k) * cs.n, seed++, -1, 1);
      const Vec c = random_floats(size_t(cs.m) * cs.n, seed++, -1, 1);
      check_close("gemm", run_gemm(be, ta, tb, cs.m, cs.n, cs.k, alpha, a, b, beta, c),
                  gemm_oracle(ta, tb, cs.m, cs.n, cs.k, alpha, a, b, beta, c, false),
                  gamma_bound(cs.k + 2, gemm_oracle(ta, tb, cs.m, cs.n, cs.k, alpha, a, b, beta, c, true)));
    }
  SUBCASE("beta = 0 does not read C (a NaN there stays out of the result)") {
    const Vec a = random_floats(6, 90, -1, 1), b = random_floats(6, 91, -1, 1), zero(4, 0.0f);
    check_close("gemm beta 0", run_gemm(be, false, false, 2, 2, 3, 1.0f, a, b, 0.0f, Vec(4, kNaN)),
                gemm_oracle(false, false, 2, 2, 3, 1.0f, a, b, 0.0f, zero, false),
                gamma_bound(5, gemm_oracle(false, false, 2, 2, 3, 1.0f, a, b, 0.0f, zero, true)));
  }
}

DP_OPS_TEST("gemm: k = 0 is an empty sum: C = beta C, and 0 when beta = 0 even over NaN") {
  Vec c = run_gemm(be, false, false, 2, 2, 0, 1.0f, {}, {}, 3.0f, {1, 2, kNaN, 4});
  CHECK(c[0] == 3.0f);
  CHECK(c[3] == 12.0f);
  c = run_gemm(be, true, true, 2, 2, 0, 1.0f, {}, {}, 0.0f, c);
  CHECK(c == Vec{0, 0, 0, 0});
  be.run([&](Ops& ops) {
    ops.gemm(false, false, 0, 2, 3, 1.0f, nullptr, nullptr, 0.0f, nullptr);  // m = 0: nothing to do
    ops.gemm(false, false, 2, 0, 3, 1.0f, nullptr, nullptr, 0.0f, nullptr);  // n = 0
  });
}

DP_OPS_TEST("linear: forward and backward against the reference, with n = 0 and without dx") {
  // Up to 16 outputs: CUDA's kernels for layers of few outputs (kernels/cuda/linear.cu); 17 and 40: its
  // cuBLAS path. 300 rows: more than CUDA's column sums stage at once (256); 256 exactly. Inputs: none (y = b), 37,
  // and 128 (LeNet's fc2: four a lane of CUDA's forward warp); no outputs: dx is an empty sum, zero.
  uint32_t seed = 200;
  const std::pair<int, int> sizes[] = {{13, 11},  {1, 11},   {0, 11},   {13, 40},  {1, 40}, {0, 40},
                                       {300, 16}, {300, 17}, {300, 40}, {256, 10}, {13, 0}};  // (n, out)
  for (const int in : {37, 0, 128})
    for (const auto& size : sizes) {
      const int n = size.first, out = size.second;  // plain variables: the lambdas below capture them
      CAPTURE(in);
      CAPTURE(n);
      CAPTURE(out);
      const Vec x = random_floats(size_t(n) * in, seed++, -1, 1);    // (N, IN)
      const Vec w = random_floats(size_t(out) * in, seed++, -1, 1);  // (OUT, IN)
      const Vec b = random_floats(size_t(out), seed++, -1, 1);       // (OUT)
      const Vec dy = random_floats(size_t(n) * out, seed++, -1, 1);  // (N, OUT)
      Mem gx = be.put(x), gw = be.put(w), gb = be.put(b), gdy = be.put(dy);
      Mem gy = be.out(size_t(n) * out), gdx = be.out(x.size()), gdw = be.out(w.size()), gdb = be.out(b.size());
      Mem gdw2 = be.out(w.size()), gdb2 = be.out(b.size());
      be.run([&](Ops& ops) {
        ops.linear_forward(n, in, out, gx.f(), gw.f(), gb.f(), gy.f());
        ops.linear_backward(n, in, out, gx.f(), gw.f(), gdy.f(), gdx.f(), gdw.f(), gdb.f());
        ops.linear_backward(n, in, out, gx.f(), gw.f(), gdy.f(), nullptr, gdw2.f(), gdb2.f());
      });
      Vec bias_rows(size_t(n) * out);  // y = x W^T + b is a GEMM onto C = b broadcast over the rows
      for (int i = 0; i < n; ++i) std::copy(b.begin(), b.end(), bias_rows.begin() + i * out);
      check_close("y", be.get(gy), gemm_oracle(false, true, n, out, in, 1.0f, x, w, 1.0f, bias_rows, false),
                  gamma_bound(in + 2, gemm_oracle(false, true, n, out, in, 1.0f, x, w, 1.0f, bias_rows, true)));
      const Vec none(w.size(), 0.0f);
      const DVec dw = gemm_oracle(true, false, out, in, n, 1.0f, dy, x, 0.0f, none, false);
      const DVec dw_tol = gamma_bound(n + 2, gemm_oracle(true, false, out, in, n, 1.0f, dy, x, 0.0f, none, true));
      check_close("dw", be.get(gdw), dw, dw_tol);
      check_close("dw without dx", be.get(gdw2), dw, dw_tol);
      const Vec no_dx(x.size(), 0.0f);
      check_close("dx", be.get(gdx), gemm_oracle(false, false, n, in, out, 1.0f, dy, w, 0.0f, no_dx, false),
                  gamma_bound(out + 2, gemm_oracle(false, false, n, in, out, 1.0f, dy, w, 0.0f, no_dx, true)));
      // db: the rows summed in order on every backend, so the float reference's bits.
      Vec db(b.size()), dw_f(w.size());
      cpu::linear_backward<float>(n, in, out, x.data(), w.data(), dy.data(), nullptr, dw_f.data(), db.data());
      check_same_bits("db", be.get(gdb), db);
      check_same_bits("db without dx", be.get(gdb2), db);
    }
}

// ---- softmax cross-entropy --------------------------------------------------------------------------

struct Xent {
  Vec dz, stats;
};
Xent run_xent(Backend& be, int n, int classes, const Vec& z, const Labels& labels, float scale, const Vec& stats) {
  Mem gz = be.put(z), gl = be.put(labels), gdz = be.out(z.size()), gs = be.put(stats);
  be.run([&](Ops& ops) { ops.softmax_xent(n, classes, gz.f(), gl.i32(), scale, gdz.f(), gs.f()); });
  return {be.get(gdz), be.get(gs)};
}

// loss of one row by the log-sum-exp form, in double: m + log sum exp(z - m) - z_label.
double lse_loss(const Vec& z, int label) {
  double m = -INFINITY, sum = 0;
  for (float v : z) m = std::max(m, double(v));
  for (float v : z) sum += std::exp(double(v) - m);
  return m + std::log(sum) - z[size_t(label)];
}

DP_OPS_TEST("softmax_xent: stable at large logits, accumulates loss and correct count") {
  SUBCASE("equal logits of 1000: log 3, no overflow; ties go to the first class") {
    const Xent r = run_xent(be, 2, 3, Vec(6, 1000.0f), {0, 2}, 0.5f, {0.5f, 2.0f});
    CHECK(r.stats[0] == doctest::Approx(0.5 + std::log(3.0)).epsilon(1e-6));  // += mean over 2 rows of log 3
    CHECK(r.stats[1] == 3.0f);  // += 1: row 0's argmax is class 0 (first maximum), row 1's is not class 2
    const float third = 1.0f / 3.0f;
    const Vec want = {(third - 1) * 0.5f, third * 0.5f, third * 0.5f, third * 0.5f, third * 0.5f, (third - 1) * 0.5f};
    for (size_t i = 0; i < 6; ++i) CHECK(r.dz[i] == doctest::Approx(want[i]).epsilon(1e-6));
  }
  SUBCASE("logits 1000 apart: the loss is the log-sum-exp form, gradients finite") {
    const Vec row = {1000.0f, 0.0f, -1000.0f, 999.0f};
    for (int label : {0, 1, 2, 3}) {
      CAPTURE(label);
      const Xent r = run_xent(be, 1, 4, row, {label}, 1.0f, {0, 0});
      // lse = 1000 + log(1 + e^-1) = 1000.3132617; the loss is lse - z_label (2000.31 for label 2).
      CHECK(r.stats[0] == doctest::Approx(lse_loss(row, label)).epsilon(1e-6));
      CHECK(std::all_of(r.dz.begin(), r.dz.end(), [](float g) { return std::isfinite(g); }));
      CHECK(r.stats[1] == (label == 0 ? 1.0f : 0.0f));
      float sum = 0;
      for (float g : r.dz) sum += g;
      CHECK(std::fabs(sum) < 1e-6f);  // softmax sums to 1, the one-hot too
    }
  }
  SUBCASE("ordinary logits against log-sum-exp in double, and the count over rows") {
    const Vec z = {0.1f,  -1.2f, 2.0f,  0.3f,  //
                   1.5f,  1.4f,  -0.3f, 0.0f,  //
                   -2.0f, 0.0f,  0.5f,  0.49f};
    const Labels labels = {2, 1, 2};  // argmaxes are 2, 0, 2: two correct
    const Xent r = run_xent(be, 3, 4, z, labels, 1.0f / 3, {0, 0});
    double want = 0;
    for (int i = 0; i < 3; ++i) want += lse_loss(Vec(z.begin() + 4 * i, z.begin() + 4 * i + 4), labels[size_t(i)]);
    CHECK(r.stats[0] == doctest::Approx(want / 3).epsilon(1e-6));
    CHECK(r.stats[1] == 2.0f);
  }
  SUBCASE("rows of no classes add nothing to stats, as no rows do") {
    const Xent r = run_xent(be, 3, 0, Vec{}, {0, 0, 0}, 1.0f, {0.5f, 2.0f});
    CHECK(r.stats == Vec{0.5f, 2.0f});
  }
  SUBCASE("NaN logits: the count follows the CPU's scan, the loss and every gradient NaN") {
    // 40 classes: a warp's lane l starts from column l and goes on to l + 32.
    const int classes = 40, n = 4;
    Vec z(size_t(n * classes));
    for (size_t i = 0; i < z.size(); ++i) z[i] = float(int(i * 7 % 11) - 5) * 0.1f;  // within [-0.5, 0.5]
    auto at = [&](int row, int col) -> float& { return z[size_t(row * classes + col)]; };
    const float nan = std::nanf("");
    at(0, 0) = nan;                                 // the scan starts on a NaN and stays: column 0
    at(1, 3) = nan, at(1, 35) = nan, at(1, 7) = 5;  // NaNs are passed over: column 7
    at(2, 5) = nan, at(2, 37) = 5;                  // behind a lane's NaN first column: column 37
    at(3, 1) = nan, at(3, 33) = 5;                  // column 33, and labelled otherwise
    const Labels labels = {0, 7, 37, 2};
    const Xent r = run_xent(be, n, classes, z, labels, 1.0f / n, {0, 0});
    DVec dz(z.size()), stats(2);
    cpu::softmax_xent<double>(n, classes, dbl(z).data(), labels.data(), 1.0 / n, dz.data(), stats.data());
    CHECK(stats[1] == 3.0);  // the reference's own scan, as worked out above
    CHECK(r.stats[1] == 3.0f);
    CHECK(std::isnan(r.stats[0]));
    CHECK(std::all_of(r.dz.begin(), r.dz.end(), [](float g) { return std::isnan(g); }));
  }
}

DP_OPS_TEST("softmax_xent: random rows against the reference in double, adding to stats") {
  // Per row, with t_j = z_j - m (m the row's maximum, exact), L = log sum_j exp(t_j) >= 0 and
  // p_j = exp(t_j - L), to first order in u, with d = 4u for exp and log (2 ulp each: the CUDA
  // Programming Guide; glibc is within 1):
  //   the sum S of exp(t_j): relative d + u max|t| (the shift's rounding, through exp) + (C - 1) u;
  //   L: that, plus d L (log's own error), absolute;
  //   t_j - L: u |t_j| + u (|t_j| + L) + L's error; p_j: relative that plus d,
  // so p_j's relative error is within u (C + 7 + 5 L + max|t| + 2 |t_j|), one more u for the
  // second-order terms; subtracting the one-hot and scaling round twice more (2u |dz|). The loss:
  // each row's L - t_label carries L's error, u |t_label| and u of itself; the rows are summed,
  // scaled and added to stats in some order, at most n + 1 roundings on any path: gamma(n + 2) with
  // one to spare. The count is exact.
  std::mt19937 rng(6);
  for (auto [n_, classes_] : std::vector<std::pair<int, int>>{{37, 10}, {1, 3}, {300, 70}, {0, 10}, {9, 32}}) {
    const auto n = n_;  // a copy: clang 14 cannot capture a structured binding (CAPTURE)
    const auto classes = classes_;
    CAPTURE(n);
    CAPTURE(classes);
    const float scale = n > 0 ? 1.0f / float(n + 5) : 1.0f;  // as the engine's 1/B with B > n
    const Vec z = random_floats(size_t(n) * classes, uint32_t(n * 100 + classes), -4, 4);
    Labels labels(static_cast<size_t>(n));
    std::uniform_int_distribution<int> pick(0, classes - 1);
    for (auto& l : labels) l = pick(rng);
    const Vec stats0 = {0.25f, 2.0f};  // ops add to stats
    const Xent r = run_xent(be, n, classes, z, labels, scale, stats0);

    const DVec zd = dbl(z);
    DVec dz(z.size()), stats = dbl(stats0);
    cpu::softmax_xent<double>(n, classes, zd.data(), labels.data(), scale, dz.data(), stats.data());
    DVec tol(z.size());
    double loss_err = 0, loss_abs = 0;
    for (int i = 0; i < n; ++i) {
      const double* zr = zd.data() + size_t(i) * classes;
      const double m = *std::max_element(zr, zr + classes);
      double s = 0, max_t = 0;
      for (int j = 0; j < classes; ++j) s += std::exp(zr[j] - m), max_t = std::max(max_t, m - zr[j]);
      const double L = std::log(s), err_L = kU * (4 + max_t + classes - 1) + 4 * kU * L;
      for (int j = 0; j < classes; ++j) {
        const size_t at = size_t(i) * classes + j;
        const double t = m - zr[j], p = std::exp(-t - L);
        tol[at] = kU * std::fabs(scale) * p * (classes + 8 + 5 * L + max_t + 2 * t) + 2 * kU * std::fabs(dz[at]);
      }
      const double t_label = m - zr[labels[size_t(i)]], row_loss = L + t_label;
      loss_abs += row_loss;
      loss_err += err_L + kU * t_label + kU * row_loss;
    }
    check_close("dlogits", r.dz, dz, tol);
    const double stat_tol = std::fabs(scale) * loss_err + gamma(n + 2) * (std::fabs(scale) * loss_abs + stats0[0]);
    CHECK(std::fabs(double(r.stats[0]) - stats[0]) <= stat_tol);
    CHECK(double(r.stats[1]) == stats[1]);  // argmax with the same first-maximum rule: exact
  }
}

}  // namespace
}  // namespace dp::test
