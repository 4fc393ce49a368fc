// The fast float kernels (kernels/cpu/fast.h) against the reference templates, for every instruction
// set this CPU runs (AVX2, AVX-512; the others are skipped visibly): convolution on random shapes with
// odd sizes, batches that are not a multiple of the vector width, n = 0, padding, non-square kernels;
// activations over the whole float range; 2x2 average pooling; and the FLOP count the benchmarks use.
//
// Tolerances are derived, not tuned. The oracle is the reference run in double on the same float
// inputs (its own error, ~K 2^-53, is negligible). A float sum of K products evaluated in any order,
// with or without FMA, differs from the exact sum by at most gamma_K * sum|terms| with
// gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability, 3.1 and 3.5); the bias is one
// more term. sum|terms| is the reference run on |x|, |w|, |b|, so each element gets its own bound.
// The bound is a worst case, so it cannot fail by bad luck, and an indexing mistake (an error of the
// order of the value itself) exceeds it by orders of magnitude (checked below).
#include <doctest/doctest.h>

#include "tests/util.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/network.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/kernels.h"
#include "kernels/math.h"
#include "models/model.h"

namespace dp::test {
namespace {

using cpu::fast::Isa;
using Vec = std::vector<float>;
using DVec = std::vector<double>;
const double u = std::ldexp(1.0, -24);
const float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int kGuard = 64;  // floats past the end of every output and of the workspace, checked untouched
const float kSentinel = -12345.678f;

double gamma(double k) { return k * u / (1 - k * u); }

std::vector<Isa> fast_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (cpu::fast::isa_supported(isa))
      out.push_back(isa);
    else
      MESSAGE("fast kernels: " << cpu::fast::isa_name(isa) << " case skipped: this CPU does not support it");
  }
  return out;
}

// A buffer of n floats followed by kGuard sentinels.
struct Guarded {
  Vec v;
  int64_t n;
  Guarded(int64_t n, float fill) : v(size_t(n + kGuard), kSentinel), n(n) { std::fill_n(v.begin(), n, fill); }
  float* data() { return v.data(); }
  bool intact() const {
    for (int64_t i = n; i < n + kGuard; ++i)
      if (std::memcmp(&v[size_t(i)], &kSentinel, sizeof(float)) != 0) return false;
    return true;
  }
};

Vec uniform(int64_t n, std::mt19937_64& gen) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen);
  return v;
}

DVec to_double(const float* p, int64_t n, bool absolute = false) {
  DVec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = absolute ? std::fabs(double(p[i])) : double(p[i]);
  return v;
}

// Every got[i] within gamma(terms) * bound[i] of want[i]; reports the worst element.
void check_within(const char* what, const float* got, const DVec& want, const DVec& bound, double terms) {
  double worst = 0;  // as a fraction of the allowed error
  int64_t at = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    const double allowed = gamma(terms) * bound[i], err = std::fabs(double(got[i]) - want[i]);
    const double r = allowed > 0 ? err / allowed : (err > 0 ? INFINITY : 0);
    if (!(r <= worst)) worst = r, at = int64_t(i);  // also catches NaN
  }
  INFO(what << ": worst element " << at << " uses " << worst << " of its bound");
  CHECK(worst <= 1.0);
}

ConvShape conv(int n, int c, int h, int w, int k, int kh, int kw, int pad) {
  ConvShape s;
  s.n = n, s.c = c, s.h = h, s.w = w, s.k = k, s.kh = kh, s.kw = kw, s.pad = pad;
  return s;
}

// Forward and backward of one shape on one instruction set, each output against the double reference.
void check_conv(Isa isa, const ConvShape& s, uint64_t seed) {
  CAPTURE(std::string(cpu::fast::isa_name(isa)));
  INFO(dp::test::describe(s));
  std::mt19937_64 gen(seed);
  const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.k * s.col_cols();
  const int64_t wsize = int64_t(s.k) * s.col_rows();
  const Vec x = uniform(in, gen), w = uniform(wsize, gen), b = uniform(s.k, gen), dy = uniform(out, gen);

  // The double oracle and the bounds' sums of |terms|.
  const int64_t dws = cpu::conv2d_workspace_size(s);
  DVec ws(static_cast<size_t>(dws));
  DVec xd = to_double(x.data(), in), wd = to_double(w.data(), wsize), bd = to_double(b.data(), s.k),
       dyd = to_double(dy.data(), out);
  DVec xa = to_double(x.data(), in, true), wa = to_double(w.data(), wsize, true), ba = to_double(b.data(), s.k, true),
       dya = to_double(dy.data(), out, true);
  DVec y_ref(static_cast<size_t>(out)), y_abs(static_cast<size_t>(out)), dx_ref(static_cast<size_t>(in)),
      dx_abs(static_cast<size_t>(in)), dw_ref(static_cast<size_t>(wsize)), dw_abs(static_cast<size_t>(wsize)),
      db_ref(size_t(s.k)), db_abs(size_t(s.k));
  cpu::conv2d_forward(s, xd.data(), wd.data(), bd.data(), y_ref.data(), ws.data());
  cpu::conv2d_forward(s, xa.data(), wa.data(), ba.data(), y_abs.data(), ws.data());
  cpu::conv2d_backward(s, xd.data(), wd.data(), dyd.data(), dx_ref.data(), dw_ref.data(), db_ref.data(), ws.data());
  cpu::conv2d_backward(s, xa.data(), wa.data(), dya.data(), dx_abs.data(), dw_abs.data(), db_abs.data(), ws.data());

  Guarded work(cpu::fast::conv2d_workspace_size(isa, s), kNaN);
  Guarded y(out, kNaN), dx(in, kNaN), dw(wsize, kNaN), db(s.k, kNaN);
  cpu::fast::conv2d_forward(isa, s, x.data(), w.data(), b.data(), y.data(), work.data());
  cpu::fast::conv2d_backward(isa, s, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data(), work.data());
  CHECK(y.intact());
  CHECK(dx.intact());
  CHECK(dw.intact());
  CHECK(db.intact());
  CHECK(work.intact());
  const double per_output = double(s.col_rows()) + 1;            // C*KH*KW products and the bias
  const double per_weight = double(s.n) * double(s.col_cols());  // N*OH*OW products
  const double per_input = double(s.k) * s.kh * s.kw;            // at most K*KH*KW products
  check_within("y", y.data(), y_ref, y_abs, per_output);
  check_within("dx", dx.data(), dx_ref, dx_abs, per_input);
  check_within("dw", dw.data(), dw_ref, dw_abs, per_weight);
  check_within("db", db.data(), db_ref, db_abs, per_weight);

  // Without dx (the first layer; for few taps per output this is the direct way's weight gradient).
  Guarded dw2(wsize, kNaN), db2(s.k, kNaN);
  cpu::fast::conv2d_backward(isa, s, x.data(), w.data(), dy.data(), nullptr, dw2.data(), db2.data(), work.data());
  CHECK(dw2.intact());
  CHECK(db2.intact());
  CHECK(work.intact());
  check_within("dw without dx", dw2.data(), dw_ref, dw_abs, per_weight);
  check_within("db without dx", db2.data(), db_ref, db_abs, per_weight);
}

TEST_CASE("fast kernels: conv2d against the reference on LeNet's layers and random odd shapes") {
  for (Isa isa : fast_isas()) {
    // LeNet's and LeNet-5's layers, with a batch that leaves a partial chunk for both widths.
    check_conv(isa, conv(37, 1, 28, 28, 20, 3, 3, 0), 1);
    check_conv(isa, conv(37, 20, 13, 13, 50, 5, 5, 0), 2);
    check_conv(isa, conv(37, 1, 28, 28, 6, 5, 5, 2), 3);
    check_conv(isa, conv(37, 6, 14, 14, 16, 5, 5, 0), 4);
    // Single images, channel counts that no register tile divides, non-square kernels, kernels as
    // large as the padded image, padding wider than the kernel's reach.
    check_conv(isa, conv(1, 1, 1, 1, 1, 1, 1, 0), 5);
    check_conv(isa, conv(1, 3, 5, 7, 7, 3, 2, 1), 6);
    check_conv(isa, conv(9, 2, 4, 4, 13, 6, 6, 1), 7);
    check_conv(isa, conv(17, 7, 6, 5, 11, 1, 3, 0), 8);
    check_conv(isa, conv(3, 5, 3, 3, 9, 3, 3, 3), 9);
    // The direct way (few taps per output, rows that fill their vectors), with channel counts no row
    // option divides, padding, one and two vectors per row, and a layer that needs dx.
    for (auto [n, c, h, w, k, kh, kw, pad] :
         {std::array{19, 2, 20, 30, 7, 3, 2, 1}, std::array{5, 1, 16, 13, 13, 4, 4, 3},
          std::array{33, 1, 9, 16, 11, 1, 1, 0}, std::array{2, 3, 12, 26, 5, 3, 3, 0}}) {
      const ConvShape s = conv(n, c, h, w, k, kh, kw, pad);
      CAPTURE(std::string(cpu::fast::isa_name(isa)));
      CAPTURE(w);
      CHECK(cpu::fast::conv2d_direct(isa, s));
      check_conv(isa, s, uint64_t(10 + n));
    }
    CHECK(cpu::fast::conv2d_direct(isa, conv(1, 1, 28, 28, 20, 3, 3, 0)));  // LeNet's conv1
    CHECK(cpu::fast::conv2d_direct(isa, conv(1, 1, 28, 28, 6, 5, 5, 2)));   // LeNet-5's
    CHECK_FALSE(cpu::fast::conv2d_direct(isa, conv(1, 20, 13, 13, 50, 5, 5, 0)));
    std::mt19937_64 gen(99);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
    for (int trial = 0; trial < 24; ++trial) {
      const int kh = pick(1, 5), kw = pick(1, 5), pad = pick(0, 2);
      const int h = std::max(kh - 2 * pad, 1) + pick(0, 9), w = std::max(kw - 2 * pad, 1) + pick(0, 9);
      check_conv(isa, conv(pick(1, 40), pick(1, 9), h, w, pick(1, 17), kh, kw, pad), uint64_t(100 + trial));
    }
  }
}

TEST_CASE("fast kernels: conv2d over an empty batch writes zero gradients and nothing else") {
  for (Isa isa : fast_isas()) {
    CAPTURE(std::string(cpu::fast::isa_name(isa)));
    ConvShape s = conv(0, 2, 5, 5, 3, 3, 3, 1);
    Vec w(54, 1.0f), b(3, 1.0f), work(size_t(cpu::fast::conv2d_workspace_size(isa, s)));
    Guarded dw(54, kNaN), db(3, kNaN);
    cpu::fast::conv2d_forward(isa, s, nullptr, w.data(), b.data(), nullptr, work.data());
    cpu::fast::conv2d_backward(isa, s, nullptr, w.data(), nullptr, nullptr, dw.data(), db.data(), work.data());
    CHECK(std::all_of(dw.v.begin(), dw.v.begin() + 54, [](float v) { return v == 0.0f; }));
    CHECK(std::all_of(db.v.begin(), db.v.begin() + 3, [](float v) { return v == 0.0f; }));
    CHECK(dw.intact());
  }
}

TEST_CASE("fast kernels: the bound is sharp enough to catch a wrong index") {
  // LeNet's conv2 with one weight's gradient swapped for its neighbour's: far outside its bound.
  for (Isa isa : fast_isas()) {
    ConvShape s = conv(5, 20, 13, 13, 50, 5, 5, 0);
    std::mt19937_64 gen(7);
    const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.k * s.col_cols();
    const Vec x = uniform(in, gen), w = uniform(500 * 50, gen), dy = uniform(out, gen);
    DVec ws(size_t(cpu::conv2d_workspace_size(s))), dw_ref(25000), dw_abs(25000), db_ref(50), db_abs(50);
    DVec xd = to_double(x.data(), in), wd = to_double(w.data(), 25000), dyd = to_double(dy.data(), out);
    DVec xa = to_double(x.data(), in, true), wa = to_double(w.data(), 25000, true),
         dya = to_double(dy.data(), out, true);
    cpu::conv2d_backward<double>(s, xd.data(), wd.data(), dyd.data(), nullptr, dw_ref.data(), db_ref.data(), ws.data());
    cpu::conv2d_backward<double>(s, xa.data(), wa.data(), dya.data(), nullptr, dw_abs.data(), db_abs.data(), ws.data());
    Vec work(size_t(cpu::fast::conv2d_workspace_size(isa, s))), dw(25000), db(50);
    cpu::fast::conv2d_backward(isa, s, x.data(), w.data(), dy.data(), nullptr, dw.data(), db.data(), work.data());
    std::swap(dw[1234], dw[1235]);
    const double terms = double(s.n) * double(s.col_cols());
    const double err = std::fabs(double(dw[1234]) - dw_ref[1234]), allowed = gamma(terms) * dw_abs[1234];
    CHECK(err > 100 * allowed);
  }
}

// Sigmoid in double from math.h's formula: the exact value to within 2^-53 relative.
double sigmoid_exact(double x) { return math::sigmoid(x); }

TEST_CASE("fast kernels: activations over the float range, NaN and infinities") {
  // The sample: a dense sweep of [-120, 120] (both exp tails, the subnormal region past -87), the
  // points where the formula switches, powers of two, and the specials.
  Vec x;
  for (int i = -120000; i <= 120000; ++i) x.push_back(float(i) * 1e-3f);
  for (int e = -149; e < 128; ++e) x.push_back(std::ldexp(1.0f, e)), x.push_back(-std::ldexp(1.0f, e));
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()})
    x.push_back(v);
  x.push_back(kNaN);
  const int64_t n = int64_t(x.size());  // not a multiple of any vector width: the tail path runs
  for (Isa isa : fast_isas()) {
    CAPTURE(std::string(cpu::fast::isa_name(isa)));
    SUBCASE("sigmoid forward within 4 ulp (plus 2^-126 absolute in the subnormal tail)") {
      // exp's polynomial and range reduction are within 2 ulp (Cephes expf), 1 + z and the division
      // round once each: 4 ulp of relative error. AVX2 flushes e^-|x| below 2^-126 to zero and AVX-512
      // rounds into subnormals, where a relative bound means nothing: an absolute 2^-126 covers both.
      Guarded y(n, kNaN);
      cpu::fast::activation_forward(isa, Activation::sigmoid, n, x.data(), y.data());
      CHECK(y.intact());
      double worst = 0;
      int64_t at = -1;
      for (int64_t i = 0; i < n; ++i) {
        const float xi = x[size_t(i)], yi = y.v[size_t(i)];
        if (std::isnan(xi)) {
          CHECK(std::isnan(yi));
          continue;
        }
        const double want = sigmoid_exact(double(xi));
        const double allowed = 4 * u * want + std::ldexp(1.0, -126);
        const double r = std::fabs(double(yi) - want) / allowed;
        if (!(r <= worst)) worst = r, at = i;
      }
      INFO("worst at x = " << (at >= 0 ? x[size_t(at)] : 0.0f) << ": " << worst << " of the bound");
      CHECK(worst <= 1.0);
      CHECK(y.v[size_t(n - 9)] == 0.5f);  // sigmoid(+-0) is exactly 1/2
      CHECK(y.v[size_t(n - 8)] == 0.5f);
    }
    SUBCASE("relu forward, relu and sigmoid backward: bitwise the reference") {
      // Same formulas as math.h in the same order of operations: nothing to round differently.
      std::mt19937_64 gen(5);
      const Vec dy = uniform(n, gen);
      Vec y_ref(static_cast<size_t>(n)), dx_ref(static_cast<size_t>(n));
      Guarded y(n, kNaN), dx(n, kNaN);
      cpu::activation_forward(Activation::relu, n, x.data(), y_ref.data());
      cpu::fast::activation_forward(isa, Activation::relu, n, x.data(), y.data());
      CHECK(std::memcmp(y.data(), y_ref.data(), size_t(n) * sizeof(float)) == 0);
      cpu::activation_backward(Activation::relu, n, y_ref.data(), dy.data(), dx_ref.data());
      cpu::fast::activation_backward(isa, Activation::relu, n, y_ref.data(), dy.data(), dx.data());
      CHECK(std::memcmp(dx.data(), dx_ref.data(), size_t(n) * sizeof(float)) == 0);
      Vec s(static_cast<size_t>(n));
      cpu::activation_forward(Activation::sigmoid, n, x.data(), s.data());
      cpu::activation_backward(Activation::sigmoid, n, s.data(), dy.data(), dx_ref.data());
      cpu::fast::activation_backward(isa, Activation::sigmoid, n, s.data(), dy.data(), dx.data());
      CHECK(std::memcmp(dx.data(), dx_ref.data(), size_t(n) * sizeof(float)) == 0);
      CHECK(y.intact());
      CHECK(dx.intact());
    }
    SUBCASE("n = 0 touches nothing") {
      Guarded y(0, 0.0f);
      cpu::fast::activation_forward(isa, Activation::sigmoid, 0, x.data(), y.data());
      cpu::fast::activation_backward(isa, Activation::relu, 0, x.data(), x.data(), y.data());
      CHECK(y.intact());
    }
  }
}

TEST_CASE("fast kernels: 2x2 average pooling equals the reference, odd sizes included") {
  // The same four additions in the same order and the same multiplication by 1/4: equal values
  // (== also equates the reference's +0 with a -0 the fast loop may keep from a -0 input).
  for (Isa isa : fast_isas()) {
    CAPTURE(std::string(cpu::fast::isa_name(isa)));
    for (auto [n, c, h, w] : {std::array{3, 2, 26, 26}, std::array{2, 3, 9, 9}, std::array{1, 1, 5, 4},
                              std::array{4, 5, 1, 7}, std::array{0, 2, 4, 4}}) {
      CAPTURE(h);
      CAPTURE(w);
      PoolShape s;
      s.n = n, s.c = c, s.h = h, s.w = w, s.k = 2;
      std::mt19937_64 gen(uint64_t(h * 31 + w));
      const int64_t in = int64_t(n) * c * h * w, out = int64_t(n) * c * s.out_h() * s.out_w();
      const Vec x = uniform(in, gen), dy = uniform(out, gen);
      Vec y_ref(static_cast<size_t>(out)), dx_ref(static_cast<size_t>(in));
      Guarded y(out, kNaN), dx(in, kNaN);
      cpu::avgpool_forward(s, x.data(), y_ref.data());
      cpu::avgpool_backward(s, dy.data(), dx_ref.data());
      cpu::fast::avgpool_forward(isa, s, x.data(), y.data());
      cpu::fast::avgpool_backward(isa, s, dy.data(), dx.data());
      CHECK(std::equal(y_ref.begin(), y_ref.end(), y.v.begin()));
      CHECK(std::equal(dx_ref.begin(), dx_ref.end(), dx.v.begin()));
      CHECK(y.intact());
      CHECK(dx.intact());
    }
  }
}

TEST_CASE("fast kernels: CpuOps picks the best instruction set unless told otherwise") {
  CpuOps ops;
  CHECK(ops.isa() == cpu::fast::detect_isa());
  CpuOps ref(1, Isa::reference);
  ConvShape s = conv(4, 2, 6, 6, 3, 3, 3, 1);
  CHECK(ref.conv2d_workspace_floats(s) == size_t(cpu::conv2d_workspace_size(s)));
}

TEST_CASE("fast kernels: conv2d + activation + 2x2 pooling fused give the bits of the three ops") {
  // The fused op activates, pools and builds the output gradient with the same operations in the same
  // order as the separate fast kernels (which are checked against the reference above): equal bits,
  // on both ways (direct: the 1-channel shapes; blocked: the others), odd output sizes included.
  auto same = [](const Vec& a, const Vec& b) { return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0; };
  for (Isa isa : fast_isas())
    for (Activation act : {Activation::relu, Activation::sigmoid})
      for (const ConvShape& s :
           {conv(37, 1, 28, 28, 20, 3, 3, 0), conv(37, 20, 13, 13, 50, 5, 5, 0), conv(37, 1, 28, 28, 6, 5, 5, 2),
            conv(37, 6, 14, 14, 16, 5, 5, 0), conv(5, 3, 9, 8, 7, 3, 2, 1), conv(19, 1, 17, 20, 9, 3, 3, 1)})
        for (bool with_dx : {false, true}) {
          CAPTURE(std::string(cpu::fast::isa_name(isa)));
          CAPTURE(int(act));
          CAPTURE(s.c);
          CAPTURE(s.h);
          CAPTURE(s.w);
          CAPTURE(with_dx);
          std::mt19937_64 gen(uint64_t(s.c * 100 + s.h));
          const int64_t in = int64_t(s.n) * s.c * s.h * s.w, out = int64_t(s.n) * s.k * s.col_cols();
          PoolShape ps;
          ps.n = s.n, ps.c = s.k, ps.h = s.out_h(), ps.w = s.out_w(), ps.k = 2;
          const int64_t pooled = int64_t(s.n) * s.k * ps.out_h() * ps.out_w();
          const Vec x = uniform(in, gen), w = uniform(s.k * s.col_rows(), gen), b = uniform(s.k, gen),
                    dp = uniform(pooled, gen);
          Vec work(static_cast<size_t>(cpu::fast::conv2d_workspace_size(isa, s)));
          // the three ops
          Vec y(static_cast<size_t>(out)), a(y.size()), p(dp.size()), g(y.size()), dy(y.size());
          cpu::fast::conv2d_forward(isa, s, x.data(), w.data(), b.data(), y.data(), work.data());
          cpu::fast::activation_forward(isa, act, out, y.data(), a.data());
          cpu::fast::avgpool_forward(isa, ps, a.data(), p.data());
          cpu::fast::avgpool_backward(isa, ps, dp.data(), g.data());
          cpu::fast::activation_backward(isa, act, out, a.data(), g.data(), dy.data());
          Vec dx(x.size()), dw(w.size()), db(b.size());
          cpu::fast::conv2d_backward(isa, s, x.data(), w.data(), dy.data(), with_dx ? dx.data() : nullptr, dw.data(),
                                     db.data(), work.data());
          // fused
          Vec fa(y.size()), fp(p.size()), fdx(x.size()), fdw(w.size()), fdb(b.size());
          cpu::fast::conv2d_act_pool_forward(isa, s, act, x.data(), w.data(), b.data(), fa.data(), fp.data(),
                                             work.data());
          cpu::fast::conv2d_act_pool_backward(isa, s, act, x.data(), w.data(), fa.data(), dp.data(),
                                              with_dx ? fdx.data() : nullptr, fdw.data(), fdb.data(), work.data());
          CHECK(same(fa, a));
          CHECK(same(fp, p));
          CHECK(same(fdx, dx));
          CHECK(same(fdw, dw));
          CHECK(same(fdb, db));
        }
}

TEST_CASE("network: the chunked convolutional prefix equals the whole-batch walk") {
  // 37 samples: chunks of 16, 16 and 5. The forward is per sample, so the logits are the same bits;
  // the linear layers run on the whole batch either way, so their gradients are the same bits too.
  // The prefix's weight gradients are the same products summed in another order (per chunk, then
  // the chunks): within the golden comparison's bound, 2 K u max|g| * 4 (tests/test_golden.cpp),
  // K = 37 * OH * OW products per weight.
  auto dev = make_simulated_device(0, 0, 0, 1);
  for (std::string name : {"lenet", "lenet5"}) {
    CAPTURE(name);
    const ModelSpec spec = make_model(name);
    const int n = 37;
    std::mt19937_64 gen(3);
    Vec params(static_cast<size_t>(spec.param_count)), x = uniform(int64_t(n) * spec.input_size(), gen);
    init_params(spec, 11, params.data());
    const Vec dlogits = uniform(int64_t(n) * spec.classes, gen);
    Network chunked(spec, *dev, n), whole(spec, *dev, n, 0);
    Vec g1(params.size()), g2(params.size());
    std::vector<int> ready1, ready2;
    const float* l1 = chunked.forward(params.data(), x.data(), n);
    const float* l2 = whole.forward(params.data(), x.data(), n);
    CHECK(std::memcmp(l1, l2, sizeof(float) * size_t(n * spec.classes)) == 0);
    chunked.backward(params.data(), g1.data(), dlogits.data(), n, [&](int l) { ready1.push_back(l); });
    whole.backward(params.data(), g2.data(), dlogits.data(), n, [&](int l) { ready2.push_back(l); });
    CHECK(ready1 == ready2);  // every parameterised layer once, from the last to the first
    for (const Param& p : spec.params) {
      CAPTURE(p.name);
      const Layer& l = spec.layers[size_t(p.layer)];
      if (l.kind == LayerKind::linear) {
        CHECK(std::memcmp(g1.data() + p.offset, g2.data() + p.offset, sizeof(float) * size_t(p.size)) == 0);
        continue;
      }
      double scale = 0, worst = 0;
      for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
        scale = std::max(scale, double(std::fabs(g2[size_t(i)])));
        worst = std::max(worst, std::fabs(double(g1[size_t(i)]) - double(g2[size_t(i)])));
      }
      CHECK(worst <= 2 * double(n) * l.out_h * l.out_w * u * scale * 4);
    }
  }
}

TEST_CASE("train_flops_per_sample: 2 per multiply-add, forward, weight and data gradients but conv1's") {
  // LeNet:   conv1 20*26*26 * 1*3*3 = 121,680   conv2 50*9*9 * 20*5*5 = 2,025,000
  //          fc1 800*128 = 102,400               fc2 128*10 = 1,280             total 2,250,360
  //          2 * (3 * 2,250,360 - 121,680) = 13,258,800
  // LeNet-5: conv1 6*28*28 * 1*5*5 = 117,600    conv2 16*10*10 * 6*5*5 = 240,000
  //          fc1 400*120 = 48,000  fc2 120*84 = 10,080  fc3 84*10 = 840         total 416,520
  //          2 * (3 * 416,520 - 117,600) = 2,263,920
  CHECK(train_flops_per_sample(make_model("lenet")) == 13258800.0);
  CHECK(train_flops_per_sample(make_model("lenet5")) == 2263920.0);
}

}  // namespace
}  // namespace dp::test
