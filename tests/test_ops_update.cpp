// The optimizer steps and the flat-buffer ops over the op matrix (tests/ops_matrix.h): SGD, Adam and
// AdamW against PyTorch's rules worked out by hand and against them in double on a large buffer; add, fill,
// all_finite and the optimizers' finiteness check; and every op's empty edge (n = 0, null pointers)
// touching nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;

// The optimizers' scalars in device memory, where their kernels read them (Ops::sgd_step).
template <class Step>
struct Scalars {
  Mem mem;
  Scalars(Backend& be, const Step& s) {
    static_assert(sizeof(Step) % sizeof(float) == 0);
    Vec words(sizeof(Step) / sizeof(float));
    std::memcpy(words.data(), &s, sizeof s);
    mem = be.put(words);
  }
  const Step* get() { return reinterpret_cast<const Step*>(mem.f()); }
};
Scalars<math::SgdStep> sgd(Backend& be, float lr, float momentum, float weight_decay) {
  return {be, math::SgdStep{lr, momentum, weight_decay}};
}
// One SGD step on the backend, its scalars put in device memory for it, no finiteness flag.
void sgd_step(Backend& be, int64_t n, Mem& w, Mem& g, Mem* v, float lr, float momentum, float weight_decay) {
  auto s = sgd(be, lr, momentum, weight_decay);
  be.run([&](Ops& ops) { ops.sgd_step(n, w.f(), g.f(), v ? v->f() : nullptr, s.get(), nullptr); });
}

DP_OPS_TEST("sgd: PyTorch's rule over two steps") {
  // torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01), w0 = 1, grads 0.5 then -0.2:
  //   step 1: d = 0.5 + 0.01 * 1 = 0.51;            buf = d = 0.51;                 w = 1 - 0.051 = 0.949
  //   step 2: d = -0.2 + 0.01 * 0.949 = -0.19051;   buf = 0.9 * 0.51 + d = 0.26849;  w = 0.949 - 0.026849 = 0.922151
  // A second element, w0 = 0 and grads 1 then 1, where weight decay first acts on step 2:
  //   step 1: d = 1;                          buf = 1;                    w = -0.1
  //   step 2: d = 1 + 0.01 * -0.1 = 0.999;    buf = 0.9 + 0.999 = 1.899;  w = -0.1 - 0.1899 = -0.2899
  SUBCASE("with momentum and weight decay") {
    Mem w = be.put(Vec{1.0f, 0.0f}), v = be.put(Vec{0.0f, 0.0f});  // dp's buffers start at zero
    Mem g1 = be.put(Vec{0.5f, 1.0f}), g2 = be.put(Vec{-0.2f, 1.0f});
    sgd_step(be, 2, w, g1, &v, 0.1f, 0.9f, 0.01f);
    CHECK(be.get(v)[0] == doctest::Approx(0.51).epsilon(1e-6));
    CHECK(be.get(w)[0] == doctest::Approx(0.949).epsilon(1e-6));
    sgd_step(be, 2, w, g2, &v, 0.1f, 0.9f, 0.01f);
    const Vec v2 = be.get(v), w2 = be.get(w);
    CHECK(v2[0] == doctest::Approx(0.26849).epsilon(1e-6));
    CHECK(w2[0] == doctest::Approx(0.922151).epsilon(1e-6));
    CHECK(v2[1] == doctest::Approx(1.899).epsilon(1e-6));
    CHECK(w2[1] == doctest::Approx(-0.2899).epsilon(1e-6));
  }
  SUBCASE("momentum 0 without a buffer (v == nullptr): plain w -= lr (g + wd w)") {
    //   step 1: w = 1 - 0.1 * (0.5 + 0.01)          = 0.949
    //   step 2: w = 0.949 - 0.1 * (-0.2 + 0.00949)  = 0.968051
    Mem w = be.put(Vec{1.0f}), g1 = be.put(Vec{0.5f}), g2 = be.put(Vec{-0.2f});
    sgd_step(be, 1, w, g1, nullptr, 0.1f, 0.0f, 0.01f);
    CHECK(be.get(w)[0] == doctest::Approx(0.949).epsilon(1e-6));
    sgd_step(be, 1, w, g2, nullptr, 0.1f, 0.0f, 0.01f);
    CHECK(be.get(w)[0] == doctest::Approx(0.968051).epsilon(1e-6));
  }
  SUBCASE("momentum 0 with a buffer leaves the buffer alone") {
    Mem w = be.put(Vec{1.0f}), g = be.put(Vec{0.5f}), v = be.put(Vec{7.0f});
    sgd_step(be, 1, w, g, &v, 0.1f, 0.0f, 0.0f);
    CHECK(be.get(w)[0] == doctest::Approx(0.95).epsilon(1e-6));
    CHECK(be.get(v)[0] == 7.0f);
  }
}

DP_OPS_TEST("sgd: against the reference in double on a large buffer") {
  const int64_t n = 100'003;  // past a vector width and a CUDA block, not a multiple of either
  const Vec w = random_floats(size_t(n), 71, -1, 1), g = random_floats(size_t(n), 72, -1, 1),
            v = random_floats(size_t(n), 73, -1, 1);
  SUBCASE("with momentum and weight decay") {
    // d = g + wd w, v = mom v + d, w = w - lr v, each operation rounding once (or a multiply-add
    // once, where a backend fuses it): with sv = |mom v| + |g| + |wd w|, which bounds |d| and the new
    // |v|, v is within 3u sv of exact and w within u |w| + 5u lr sv (lr times v's error, the
    // product's and the subtraction's roundings); one u more on each for the second-order terms.
    const float lr = 0.05f, mom = 0.9f, wd = 1e-3f;
    std::vector<double> wd_ref = dbl(w), vd_ref = dbl(v), tw(w.size()), tv(w.size());
    const std::vector<double> gd = dbl(g);
    cpu::sgd_step<double>(n, wd_ref.data(), gd.data(), vd_ref.data(), lr, mom, wd, nullptr);
    for (size_t i = 0; i < tw.size(); ++i) {
      const double sv = std::fabs(mom * v[i]) + std::fabs(g[i]) + std::fabs(wd * w[i]);
      tv[i] = 4 * kU * sv;
      tw[i] = 2 * kU * std::fabs(w[i]) + 6 * kU * lr * sv;
    }
    Mem gw = be.put(w), gg = be.put(g), gv = be.put(v);
    sgd_step(be, n, gw, gg, &gv, lr, mom, wd);
    check_close("sgd v", be.get(gv), vd_ref, tv);
    check_close("sgd w", be.get(gw), wd_ref, tw);
  }
  SUBCASE("without momentum (no buffer)") {
    // w - lr g: the product and the subtraction round once each: u |w| + 2u lr |g|, plus one u.
    std::vector<double> wd_ref = dbl(w), tw(w.size());
    const std::vector<double> gd = dbl(g);
    cpu::sgd_step<double>(n, wd_ref.data(), gd.data(), nullptr, 0.1, 0.0, 0.0, nullptr);
    for (size_t i = 0; i < tw.size(); ++i) tw[i] = 2 * kU * std::fabs(w[i]) + 3 * kU * 0.1 * std::fabs(g[i]);
    Mem gw = be.put(w), gg = be.put(g);
    sgd_step(be, n, gw, gg, nullptr, 0.1f, 0.0f, 0.0f);
    check_close("sgd w (no momentum)", be.get(gw), wd_ref, tw);
  }
}

// PyTorch's Adam / AdamW step written out in double, as torch/optim/adam.py's single-tensor path
// orders it: the oracle of the adam tests (independent of math::adam_update).
struct AdamRef {
  double lr, beta1, beta2, eps, wd;
  bool decoupled;
  void step(double& w, double& m, double& v, double g, int t) const {
    if (decoupled)
      w *= 1 - lr * wd;
    else
      g += wd * w;
    m += (1 - beta1) * (g - m);
    v = v * beta2 + (1 - beta2) * g * g;
    const double step_size = lr / (1 - std::pow(beta1, t)), bc2_sqrt = std::sqrt(1 - std::pow(beta2, t));
    w -= step_size * (m / (std::sqrt(v) / bc2_sqrt + eps));
  }
};

DP_OPS_TEST("adam and adamw: PyTorch's rule over three steps") {
  // torch.optim.Adam(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), w0 = 1, grads 0.5, -0.2,
  // 0.3. By hand for step 1: g = 0.51, m = 0.051, v = 0.001 * 0.51^2, step_size = 0.1 / 0.1 = 1,
  // denom = 0.51 / sqrt(0.001) * sqrt(0.001) + 1e-8 = 0.51: w = 1 - 0.051 / 0.51 = 0.9. AdamW instead
  // scales w by 1 - 0.1 * 0.01 first and leaves g alone: m = 0.05, denom 0.5, w = 0.999 - 0.1 = 0.899.
  for (bool decoupled : {false, true}) {
    CAPTURE(decoupled);
    const AdamRef ref{0.1, 0.9, 0.999, 1e-8, 0.01, decoupled};
    Mem w = be.put(Vec{1.0f, -0.5f}), m = be.put(Vec{0.0f, 0.0f}), v = be.put(Vec{0.0f, 0.0f});
    double rw[2] = {1.0, -0.5}, rm[2] = {0, 0}, rv[2] = {0, 0};
    const float grads[3][2] = {{0.5f, 1.0f}, {-0.2f, 1.0f}, {0.3f, -2.0f}};
    for (int t = 1; t <= 3; ++t) {
      CAPTURE(t);
      Mem g = be.put(Vec{grads[t - 1][0], grads[t - 1][1]});
      const math::AdamStep s = math::adam_coefficients(0.1, 0.9, 0.999, 1e-8, 0.01, decoupled, t);
      Scalars<math::AdamStep> scalars(be, s);
      be.run([&](Ops& ops) { ops.adam_step(2, w.f(), g.f(), m.f(), v.f(), scalars.get(), nullptr); });
      for (int i = 0; i < 2; ++i) ref.step(rw[i], rm[i], rv[i], grads[t - 1][i], t);
      const Vec gw = be.get(w), gm = be.get(m), gv = be.get(v);
      for (int i = 0; i < 2; ++i) {
        CHECK(gw[size_t(i)] == doctest::Approx(rw[i]).epsilon(1e-6));
        CHECK(gm[size_t(i)] == doctest::Approx(rm[i]).epsilon(1e-6));
        CHECK(gv[size_t(i)] == doctest::Approx(rv[i]).epsilon(1e-5));
      }
      if (t == 1) CHECK(gw[0] == doctest::Approx(decoupled ? 0.899 : 0.9).epsilon(1e-6));
    }
  }
}

DP_OPS_TEST("adam and adamw: against PyTorch's rule in double on a large buffer, at step 1 and step 50") {
  // Every operation rounds once (twice where a backend splits it): m = m + a (g - m) is within 3u
  // (|m| + a |g|) of exact and v = v b + c g g within 4u (|v| b + c g^2). The update m / (sqrt(v) / k +
  // eps) times step_size carries m's error, half v's (the square root) and five roundings of its own:
  // within (5u + m's relative error + v's / 2) of |update|; w + update adds u |w| (u |w| more for AdamW's
  // scaling). The coefficients are floats in both, the oracle's arithmetic is double: the bounds below
  // hold them with a unit to spare.
  const int64_t n = 100'003;
  const Vec w = random_floats(size_t(n), 81, -1, 1), g = random_floats(size_t(n), 82, -1, 1),
            m = random_floats(size_t(n), 83, -0.1f, 0.1f), v = random_floats(size_t(n), 84, 1e-6f, 1e-2f);
  for (bool decoupled : {false, true})
    for (int t : {1, 50}) {
      CAPTURE(decoupled);
      CAPTURE(t);
      const math::AdamStep s = math::adam_coefficients(1e-3, 0.9, 0.999, 1e-8, 1e-2, decoupled, t);
      std::vector<double> rw = dbl(w), rm = dbl(m), rv = dbl(v), tw(w.size()), tm(w.size()), tv(w.size());
      for (size_t i = 0; i < w.size(); ++i) {
        // The oracle with the kernels' float coefficients, in double.
        double gi = g[i], wi = rw[i];
        if (s.weight_decay != 0) gi += double(s.weight_decay) * wi;
        if (s.decay != 1) wi *= double(s.decay);
        rm[i] += double(s.one_minus_beta1) * (gi - rm[i]);
        rv[i] = rv[i] * double(s.beta2) + double(s.one_minus_beta2) * gi * gi;
        const double update = double(s.step_size) * (rm[i] / (std::sqrt(rv[i]) / double(s.bc2_sqrt) + double(s.eps)));
        tm[i] = 4 * kU * (std::fabs(m[i]) + 0.1 * std::fabs(gi)) + 1e-300;
        tv[i] = 5 * kU * (std::fabs(v[i]) + 0.001 * gi * gi);
        const double rel = 6 * kU + tm[i] / std::fabs(rm[i]) + tv[i] / (2 * rv[i]);
        tw[i] = 3 * kU * std::fabs(rw[i]) + rel * std::fabs(update);
        rw[i] = wi - update;
      }
      Mem gw = be.put(w), gg = be.put(g), gm = be.put(m), gv = be.put(v);
      Scalars<math::AdamStep> scalars(be, s);
      be.run([&](Ops& ops) { ops.adam_step(n, gw.f(), gg.f(), gm.f(), gv.f(), scalars.get(), nullptr); });
      check_close("adam m", be.get(gm), rm, tm);
      check_close("adam v", be.get(gv), rv, tv);
      check_close("adam w", be.get(gw), rw, tw);
    }
}

DP_OPS_TEST("add, fill and all_finite") {
  SUBCASE("by hand; all_finite reads only the first n") {
    Mem x = be.put(Vec{1, 2, 3}), y = be.put(Vec{10, 20, 30});
    be.run([&](Ops& ops) { ops.add(3, x.f(), y.f()); });
    CHECK(be.get(y) == Vec{11, 22, 33});
    be.run([&](Ops& ops) { ops.fill(2, -1.5f, y.f()); });
    CHECK(be.get(y) == Vec{-1.5f, -1.5f, 33});
    bool finite = false;
    be.run([&](Ops& ops) { finite = ops.all_finite(3, y.f()); });
    CHECK(finite);
    for (float last : {kNaN, -std::numeric_limits<float>::infinity()}) {
      CAPTURE(last);
      Mem z = be.put(Vec{-1.5f, -1.5f, last});
      bool all = true, first_two = false;
      be.run([&](Ops& ops) { all = ops.all_finite(3, z.f()), first_two = ops.all_finite(2, z.f()); });
      CHECK_FALSE(all);
      CHECK(first_two);
    }
  }
  SUBCASE("a large buffer: add equals the reference (one rounding each), fill, n = 0 does nothing") {
    const int64_t n = 100'003;
    const Vec w = random_floats(size_t(n), 74, -1, 1), g = random_floats(size_t(n), 75, -1, 1);
    Vec y = w;
    cpu::add(n, g.data(), y.data());
    Mem gy = be.put(w), gg = be.put(g), gf = be.out(size_t(n));
    be.run([&](Ops& ops) {
      ops.add(n, gg.f(), gy.f());
      ops.add(0, gg.f(), gy.f());
      ops.fill(n, 1.5f, gf.f());
      ops.fill(0, 2.5f, gf.f());
    });
    check_same_bits("add", be.get(gy), y);
    check_equal("fill", be.get(gf), Vec(size_t(n), 1.5f));
  }
  SUBCASE("all_finite over a large buffer: an infinity or a NaN anywhere, and the empty buffer") {
    const int64_t n = 100'003;
    const Vec w = random_floats(size_t(n), 76, -1, 1);
    Vec bad = w, nan = w;
    bad[size_t(n) - 7] = std::numeric_limits<float>::infinity();
    nan[12345] = kNaN;
    Mem gw = be.put(w), gbad = be.put(bad), gnan = be.put(nan);
    bool a = false, b = true, c = true, empty = false;
    be.run([&](Ops& ops) {
      a = ops.all_finite(n, gw.f());
      b = ops.all_finite(n, gbad.f());
      c = ops.all_finite(n, gnan.f());
      empty = ops.all_finite(0, gnan.f());
    });
    CHECK(a);
    CHECK_FALSE(b);
    CHECK_FALSE(c);
    CHECK(empty);
  }
}

DP_OPS_TEST("the optimizers' finiteness check: the flag raised for an infinity or a NaN in g, else left") {
  const int64_t n = 100'003;
  Vec bad = random_floats(size_t(n), 77, -1, 1), nan = bad;
  const Vec good = bad, w = random_floats(size_t(n), 78, -1, 1), v = random_floats(size_t(n), 79, 0, 0.1f);
  bad[size_t(n) - 1] = -std::numeric_limits<float>::infinity();
  nan[3] = kNaN;
  Scalars<math::AdamStep> adam(be, math::adam_coefficients(1e-3, 0.9, 0.999, 1e-8, 1e-2, true, 3));
  auto sgd_scalars = sgd(be, 0.1f, 0.9f, 0.01f);
  // Each optimizer (SGD with and without a buffer, AdamW) over: a good gradient (the flag stays 0), a
  // bad one, a NaN, a good one on a raised flag (stays 1), the bad one's first n - 1 elements only
  // (stays 0), and the NaN with no flag at all.
  for (int optimizer = 0; optimizer < 3; ++optimizer) {
    CAPTURE(optimizer);
    Mem gg = be.put(good), gb = be.put(bad), gn = be.put(nan), flags = be.put(Vec{0, 0, 0, 1, 0});
    std::vector<Mem> ws, ms, vs;
    for (int k = 0; k < 6; ++k) ws.push_back(be.put(w)), ms.push_back(be.put(v)), vs.push_back(be.put(v));
    Mem* grads[6] = {&gg, &gb, &gn, &gg, &gb, &gn};
    be.run([&](Ops& ops) {
      for (int k = 0; k < 6; ++k) {
        const int64_t count = k == 4 ? n - 1 : n;
        float* flag = k == 5 ? nullptr : flags.f() + k;
        float* g = grads[k]->f();
        if (optimizer == 2)
          ops.adam_step(count, ws[size_t(k)].f(), g, ms[size_t(k)].f(), vs[size_t(k)].f(), adam.get(), flag);
        else
          ops.sgd_step(count, ws[size_t(k)].f(), g, optimizer == 0 ? vs[size_t(k)].f() : nullptr, sgd_scalars.get(),
                       flag);
      }
    });
    CHECK(be.get(flags) == Vec{0, 1, 1, 1, 0});
    // The check changes nothing else: the same weights with a flag as without (k = 2 against k = 5).
    check_same_bits("weights, NaN gradient, flag or none", be.get(ws[2]), be.get(ws[5]));
    check_same_bits("weights, good gradient, flag raised or not", be.get(ws[0]), be.get(ws[3]));
  }
}

DP_OPS_TEST("zero-size edges: n = 0 with null pointers touches nothing") {
  SUBCASE("linear over an empty batch zeroes dw and db") {
    Mem w = be.put(Vec(12, 1.0f)), b = be.put(Vec(3, 1.0f)), dw = be.out(12), db = be.out(3);
    be.run([&](Ops& ops) {
      ops.linear_forward(0, 4, 3, nullptr, w.f(), b.f(), nullptr);
      ops.linear_backward(0, 4, 3, nullptr, w.f(), nullptr, nullptr, dw.f(), db.f());
    });
    CHECK(be.get(dw) == Vec(12, 0.0f));
    CHECK(be.get(db) == Vec(3, 0.0f));
  }
  SUBCASE("pools, activations, loss and SGD") {
    const PoolShape s{.n = 0, .c = 2, .h = 4, .w = 4, .k = 2};
    Mem stats = be.put(Vec{1.5f, 2.0f});
    bool finite = false;
    be.run([&](Ops& ops) {
      ops.avgpool_forward(s, nullptr, nullptr);
      ops.avgpool_backward(s, nullptr, nullptr);
      ops.maxpool_forward(s, nullptr, nullptr, nullptr);
      ops.maxpool_backward(s, nullptr, nullptr, nullptr);
      ops.activation_forward(Activation::sigmoid, 0, nullptr, nullptr);
      ops.activation_backward(Activation::relu, 0, nullptr, nullptr, nullptr);
      ops.softmax_xent(0, 10, nullptr, nullptr, 1.0f, nullptr, stats.f());
      ops.sgd_step(0, nullptr, nullptr, nullptr, nullptr, nullptr);  // n = 0: the scalars are not read either
      finite = ops.all_finite(0, nullptr);
    });
    CHECK(be.get(stats) == Vec{1.5f, 2.0f});
    CHECK(finite);
  }
}

DP_OPS_TEST("sum_squares and clip_scale: PyTorch's clip_grad_norm_ coefficient, the same bits every run") {
  const Vec x = random_floats(70001, 3, -1.0f, 1.0f);  // many blocks' worth on CUDA, an odd tail
  double want = 1.5;                                   // added onto what is there
  for (float v : x) want += double(v) * v;
  Mem g = be.put(x), sum = be.put(Vec{1.5f}), again = be.put(Vec{1.5f});
  be.run([&](Ops& ops) {
    ops.sum_squares(int64_t(x.size()), g.f(), sum.f());
    ops.sum_squares(int64_t(x.size()), g.f(), again.f());
    ops.sum_squares(0, nullptr, again.f());  // nothing: no change
  });
  const float got = be.get(sum)[0];
  CHECK(got == doctest::Approx(want).epsilon(1e-5));  // a float tree on CUDA, double on the CPU
  CHECK(be.get(again)[0] == got);                     // bit for bit
  // Over the limit: every element times max / (norm + 1e-6), computed from the sum as stored.
  const float max_norm = 10.0f, coef = math::clip_coefficient(got, max_norm);
  REQUIRE(coef < 0.2f);
  be.run([&](Ops& ops) { ops.clip_scale(int64_t(x.size()), sum.f(), max_norm, g.f()); });
  const Vec scaled = be.get(g);
  Vec expect(x.size());
  for (size_t i = 0; i < x.size(); ++i) expect[i] = x[i] * coef;
  check_same_bits("x * coefficient", scaled, expect);
  // Within the limit: the coefficient is 1, nothing moves.
  Mem h = be.put(x);
  be.run([&](Ops& ops) { ops.clip_scale(int64_t(x.size()), sum.f(), 1e6f, h.f()); });
  check_same_bits("x * 1", be.get(h), x);
}

}  // namespace
}  // namespace dp::test
