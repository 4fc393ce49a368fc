// BatchNorm's ops composed as the engine composes them, against PyTorch's BatchNorm2d and BatchNorm1d
// (tests/golden/batchnorm.safetensors, bench/make_golden.py), over the op matrix.
#include <doctest/doctest.h>

#include "tests/batchnorm_ops.h"

namespace dp::test {
namespace {

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
