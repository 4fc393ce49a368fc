// The CUDA backend against its CPU oracle: every CudaOps op next to CpuOps on random shapes (odd
// sizes, n = 0), the collectives on CUDA devices (NCCL and the peer ring), three LeNet steps on CUDA
// against the CPU, and the fallback to simulated devices where CUDA is built but no GPU is usable.
// The GPU cases are skipped, visibly, on machines without one; the fallback case runs everywhere.
//
// Tolerances. u = 2^-24 is float's unit roundoff and gamma(k) = k u / (1 - k u). A k-term sum of
// products computed in float in any order is within gamma(k) * sum |a_i b_i| of the exact value
// (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so two implementations that sum in
// different orders (OpenBLAS / im2col on the CPU, cuBLAS / cuDNN on the GPU) differ by at most
// 2 gamma(k) * sum |a_i b_i|, element by element. That is the bound for GEMM, convolution and
// linear, with k counting every rounding on the longer path (bias, partial sums merged, alpha and
// beta); the sums of |a||b| are computed in double here. It holds because the backend runs GEMM-like
// algorithms in FP32 (no TF32, no FFT or Winograd: see kernels/cuda/conv2d.cu). Element-wise ops
// name their roundings where they are defined below. Exact ops (ReLU, pooling, add, fill) must agree
// bit for bit.
#include <doctest/doctest.h>

#include "tests/util.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "models/model.h"
#include "tests/backends.h"

namespace dp {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // 2^-24
double gamma_k(double k) { return k * kU / (1.0 - k * kU); }
const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> random_floats(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One CUDA device and the moves of test data to and from it. Every CUDA call runs on the device's
// compute thread, as in the engine. Declare a Gpu before the Buffers that live on it.
class Gpu {
 public:
  explicit Gpu(int id = 0) : dev_(make_cuda_device(0, id, 0)) {}
  Device& dev() { return *dev_; }
  Ops& ops() { return dev_->ops(); }
  void on(std::function<void()> fn) { dev_->run(std::move(fn)).get(); }

  Buffer put(const std::vector<float>& h) {
    Buffer b;
    on([&] {
      b = dev_->alloc_floats(int64_t(std::max<size_t>(h.size(), 1)), Category::workspace);
      dev_->upload(b.f(), h.data(), h.size() * sizeof(float));
      dev_->synchronize();
    });
    return b;
  }
  Buffer put(const std::vector<int32_t>& h) {
    Buffer b;
    on([&] {
      b = dev_->alloc(std::max<size_t>(h.size(), 1) * sizeof(int32_t), Category::workspace);
      dev_->upload(b.data(), h.data(), h.size() * sizeof(int32_t));
      dev_->synchronize();
    });
    return b;
  }
  Buffer sentinel(size_t n) { return put(std::vector<float>(n, kNaN)); }  // must be overwritten
  std::vector<float> get(const Buffer& b, size_t n) {
    std::vector<float> h(n);
    on([&] { dev_->download(h.data(), b.data(), n * sizeof(float)); });
    return h;
  }
  std::vector<int32_t> get_i32(const Buffer& b, size_t n) {
    std::vector<int32_t> h(n);
    on([&] { dev_->download(h.data(), b.data(), n * sizeof(int32_t)); });
    return h;
  }

 private:
  std::unique_ptr<Device> dev_;
};

// Mixed tolerance per element (llm.c's validate_result): reports the first mismatches.
void check_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                 const std::vector<double>& tol) {
  REQUIRE(got.size() == ref.size());
  REQUIRE(tol.size() == ref.size());
  size_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double diff = std::fabs(double(got[i]) - double(ref[i]));
    if (!(diff <= tol[i])) {
      if (bad < 5)
        MESSAGE(what << "[" << i << "]: cuda " << got[i] << ", cpu " << ref[i] << ", |diff| " << diff << " > tolerance "
                     << tol[i]);
      ++bad;
    }
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << ref.size() << " elements outside the tolerance");
}

void check_equal(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref) {
  check_close(what, got, ref, std::vector<double>(ref.size(), 0.0));
}

std::vector<double> scaled(const std::vector<double>& abs_sum, double k_roundings) {
  std::vector<double> t(abs_sum.size());
  for (size_t i = 0; i < t.size(); ++i) t[i] = 2.0 * gamma_k(k_roundings) * abs_sum[i];
  return t;
}

// ------------------------------------------------------------------------------------------------
// GEMM

// |alpha| sum_p |op(A)_ip| |op(B)_pj| + |beta| |C_ij|, in double.
std::vector<double> gemm_abs(bool ta, bool tb, int m, int n, int k, float alpha, const std::vector<float>& a,
                             const std::vector<float>& b, float beta, const std::vector<float>& c) {
  std::vector<double> out(size_t(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        double av = ta ? a[size_t(p) * m + i] : a[size_t(i) * k + p];
        double bv = tb ? b[size_t(j) * k + p] : b[size_t(p) * n + j];
        s += std::fabs(av * bv);
      }
      out[size_t(i) * n + j] = std::fabs(alpha) * s + std::fabs(beta) * std::fabs(double(c[size_t(i) * n + j]));
    }
  return out;
}

TEST_CASE("cuda: gemm matches the CPU for every transpose, odd sizes and empty dimensions" *
          doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(1);
  struct Case {
    int m, n, k;
  };
  const Case cases[] = {{1, 1, 1}, {7, 5, 3}, {33, 17, 129}, {64, 64, 64}, {3, 129, 800}, {5, 4, 0}, {0, 3, 2}};
  for (const Case& cs : cases)
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const float alpha = 0.7f, beta = cs.k == 0 ? 0.5f : -0.3f;
      CAPTURE(cs.m);
      CAPTURE(cs.n);
      CAPTURE(cs.k);
      CAPTURE(ta);
      CAPTURE(tb);
      auto a = random_floats(size_t(cs.m) * cs.k, rng), b = random_floats(size_t(cs.k) * cs.n, rng);
      auto c = random_floats(size_t(cs.m) * cs.n, rng);
      auto ref = c;
      cpu.gemm(ta, tb, cs.m, cs.n, cs.k, alpha, a.data(), b.data(), beta, ref.data());
      Buffer da = gpu.put(a), db = gpu.put(b), dc = gpu.put(c);
      gpu.on([&] { gpu.ops().gemm(ta, tb, cs.m, cs.n, cs.k, alpha, da.f(), db.f(), beta, dc.f()); });
      // k products, k - 1 additions, alpha, beta and the final addition: k + 2 roundings.
      check_close("gemm", gpu.get(dc, c.size()), ref,
                  scaled(gemm_abs(ta, tb, cs.m, cs.n, cs.k, alpha, a, b, beta, c), cs.k + 2));
    }
  SUBCASE("beta = 0 does not read C (a NaN there stays out of the result)") {
    auto a = random_floats(6, rng), b = random_floats(6, rng);
    std::vector<float> ref(4, kNaN);
    cpu.gemm(false, false, 2, 2, 3, 1.0f, a.data(), b.data(), 0.0f, ref.data());
    Buffer da = gpu.put(a), db = gpu.put(b), dc = gpu.sentinel(4);
    gpu.on([&] { gpu.ops().gemm(false, false, 2, 2, 3, 1.0f, da.f(), db.f(), 0.0f, dc.f()); });
    check_close("gemm beta 0", gpu.get(dc, 4), ref,
                scaled(gemm_abs(false, false, 2, 2, 3, 1.0f, a, b, 0.0f, std::vector<float>(4, 0.0f)), 5));
  }
}

// ------------------------------------------------------------------------------------------------
// Convolution

struct ConvAbs {
  std::vector<double> y, dx, dw, db;  // sums of |terms| of each output, in double
};

ConvAbs conv_abs(const ConvShape& s, const std::vector<float>& x, const std::vector<float>& w,
                 const std::vector<float>& b, const std::vector<float>& dy) {
  const int oh = s.out_h(), ow = s.out_w();
  ConvAbs r;
  r.y.assign(size_t(s.n) * s.k * oh * ow, 0.0);
  r.dx.assign(size_t(s.n) * s.c * s.h * s.w, 0.0);
  r.dw.assign(size_t(s.k) * s.c * s.kh * s.kw, 0.0);
  r.db.assign(size_t(s.k), 0.0);
  for (int n = 0; n < s.n; ++n)
    for (int k = 0; k < s.k; ++k)
      for (int oy = 0; oy < oh; ++oy)
        for (int ox = 0; ox < ow; ++ox) {
          const size_t yi = ((size_t(n) * s.k + k) * oh + oy) * ow + ox;
          const double g = std::fabs(double(dy[yi]));
          double acc = std::fabs(double(b[size_t(k)]));
          r.db[size_t(k)] += g;
          for (int c = 0; c < s.c; ++c)
            for (int i = 0; i < s.kh; ++i)
              for (int j = 0; j < s.kw; ++j) {
                const int iy = oy + i - s.pad, ix = ox + j - s.pad;
                if (iy < 0 || iy >= s.h || ix < 0 || ix >= s.w) continue;
                const size_t xi = ((size_t(n) * s.c + c) * s.h + iy) * s.w + ix;
                const size_t wi = ((size_t(k) * s.c + c) * s.kh + i) * s.kw + j;
                const double xv = std::fabs(double(x[xi])), wv = std::fabs(double(w[wi]));
                acc += wv * xv;
                r.dw[wi] += g * xv;
                r.dx[xi] += wv * g;
              }
          r.y[yi] = acc;
        }
  return r;
}

// Runs one shape on both backends. `queried` is the batch the workspace is sized for (the engine's
// largest batch); s.n may be smaller, which takes the plan path for shapes nobody asked about.
void check_conv(Gpu& gpu, CpuOps& cpu, const ConvShape& s, int queried, std::mt19937& rng) {
  INFO(dp::test::describe(s));
  const int oh = s.out_h(), ow = s.out_w();
  auto x = random_floats(size_t(s.n) * s.c * s.h * s.w, rng);    // (N, C, H, W)
  auto w = random_floats(size_t(s.k) * s.c * s.kh * s.kw, rng);  // (K, C, KH, KW)
  auto b = random_floats(size_t(s.k), rng);                      // (K)
  auto dy = random_floats(size_t(s.n) * s.k * oh * ow, rng);     // (N, K, OH, OW)
  std::vector<float> y(dy.size()), dx(x.size()), dw(w.size()), db(b.size());
  std::vector<float> cws(std::max<size_t>(cpu.conv2d_workspace_floats(s), 1));
  cpu.conv2d_forward(s, x.data(), w.data(), b.data(), y.data(), cws.data());
  cpu.conv2d_backward(s, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data(), cws.data());

  ConvShape qs = s;
  qs.n = queried;
  size_t ws_floats = 0;
  gpu.on([&] { ws_floats = gpu.ops().conv2d_workspace_floats(qs); });
  Buffer ws;
  if (ws_floats > 0) gpu.on([&] { ws = gpu.dev().alloc_floats(int64_t(ws_floats), Category::workspace); });
  Buffer gx = gpu.put(x), gw = gpu.put(w), gb = gpu.put(b), gdy = gpu.put(dy);
  Buffer gy = gpu.sentinel(y.size()), gdx = gpu.sentinel(dx.size()), gdw = gpu.sentinel(dw.size()),
         gdb = gpu.sentinel(db.size());
  gpu.on([&] {
    gpu.ops().conv2d_forward(s, gx.f(), gw.f(), gb.f(), gy.f(), ws.f());
    gpu.ops().conv2d_backward(s, gx.f(), gw.f(), gdy.f(), gdx.f(), gdw.f(), gdb.f(), ws.f());
  });
  ConvAbs abs = conv_abs(s, x, w, b, dy);
  const double taps = double(s.c) * s.kh * s.kw, pixels = double(oh) * ow;
  // y: C KH KW products and the bias; the CPU adds them onto the bias inside its GEMM.
  check_close("conv y", gpu.get(gy, y.size()), y, scaled(abs.y, taps + 3));
  // dx: K KH KW products, summed on the CPU as a GEMM then col2im (KH KW more additions).
  check_close("conv dx", gpu.get(gdx, dx.size()), dx, scaled(abs.dx, double(s.k) * s.kh * s.kw + s.kh * s.kw + 2));
  // dw, db: N OH OW products / terms, summed per image on the CPU, then over the N images.
  check_close("conv dw", gpu.get(gdw, dw.size()), dw, scaled(abs.dw, s.n * pixels + s.n + 2));
  check_close("conv db", gpu.get(gdb, db.size()), db, scaled(abs.db, s.n * pixels + s.n + 2));

  // dx = nullptr (the first layer): dw and db alone, overwritten again.
  Buffer gdw2 = gpu.sentinel(dw.size()), gdb2 = gpu.sentinel(db.size());
  gpu.on([&] { gpu.ops().conv2d_backward(s, gx.f(), gw.f(), gdy.f(), nullptr, gdw2.f(), gdb2.f(), ws.f()); });
  check_close("conv dw (no dx)", gpu.get(gdw2, dw.size()), dw, scaled(abs.dw, s.n * pixels + s.n + 2));
  check_close("conv db (no dx)", gpu.get(gdb2, db.size()), db, scaled(abs.db, s.n * pixels + s.n + 2));
}

ConvShape conv(int n, int c, int h, int w, int k, int kh, int kw, int pad) {
  ConvShape s;
  s.n = n, s.c = c, s.h = h, s.w = w, s.k = k, s.kh = kh, s.kw = kw, s.pad = pad;
  return s;
}

TEST_CASE("cuda: conv2d forward and backward match the CPU (LeNet's shapes, odd shapes, padding)" *
          doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(2);
  check_conv(gpu, cpu, conv(4, 1, 28, 28, 20, 3, 3, 0), 4, rng);   // LeNet conv1
  check_conv(gpu, cpu, conv(3, 20, 13, 13, 50, 5, 5, 0), 3, rng);  // LeNet conv2
  check_conv(gpu, cpu, conv(2, 1, 28, 28, 6, 5, 5, 2), 2, rng);    // LeNet-5 c1 (padded)
  check_conv(gpu, cpu, conv(3, 2, 9, 7, 5, 3, 2, 1), 3, rng);      // odd everything, KH != KW
  check_conv(gpu, cpu, conv(1, 3, 5, 5, 1, 5, 5, 0), 1, rng);      // a 1x1 output
  check_conv(gpu, cpu, conv(3, 20, 13, 13, 50, 5, 5, 0), 8, rng);  // smaller than the queried batch
}

TEST_CASE("cuda: conv2d with no samples runs nothing and zeroes dw and db" * doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  const ConvShape s = conv(0, 2, 9, 9, 3, 3, 3, 1);
  size_t ws = 1;
  gpu.on([&] { ws = gpu.ops().conv2d_workspace_floats(s); });
  CHECK(ws == 0);
  Buffer gx = gpu.put(std::vector<float>(1)), gw = gpu.put(std::vector<float>(3 * 2 * 9, 1.0f));
  Buffer gy = gpu.sentinel(1), gdw = gpu.sentinel(3 * 2 * 9), gdb = gpu.sentinel(3);
  gpu.on([&] {
    gpu.ops().conv2d_forward(s, gx.f(), gw.f(), gw.f(), gy.f(), nullptr);
    gpu.ops().conv2d_backward(s, gx.f(), gw.f(), gx.f(), nullptr, gdw.f(), gdb.f(), nullptr);
  });
  check_equal("dw", gpu.get(gdw, 3 * 2 * 9), std::vector<float>(3 * 2 * 9, 0.0f));
  check_equal("db", gpu.get(gdb, 3), std::vector<float>(3, 0.0f));
  CHECK(std::isnan(gpu.get(gy, 1)[0]));  // untouched
}

// ------------------------------------------------------------------------------------------------
// Linear

TEST_CASE("cuda: linear forward and backward match the CPU, with n = 0 and without dx" *
          doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(3);
  const int in = 37, out = 11;
  for (int n : {13, 1, 0}) {
    CAPTURE(n);
    auto x = random_floats(size_t(n) * in, rng), w = random_floats(size_t(out) * in, rng);
    auto b = random_floats(size_t(out), rng), dy = random_floats(size_t(n) * out, rng);
    std::vector<float> y(size_t(n) * out), dx(x.size()), dw(w.size()), db(b.size());
    cpu.linear_forward(n, in, out, x.data(), w.data(), b.data(), y.data());
    cpu.linear_backward(n, in, out, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data());
    Buffer gx = gpu.put(x), gw = gpu.put(w), gb = gpu.put(b), gdy = gpu.put(dy);
    Buffer gy = gpu.sentinel(y.size()), gdx = gpu.sentinel(dx.size()), gdw = gpu.sentinel(dw.size()),
           gdb = gpu.sentinel(db.size());
    gpu.on([&] {
      gpu.ops().linear_forward(n, in, out, gx.f(), gw.f(), gb.f(), gy.f());
      gpu.ops().linear_backward(n, in, out, gx.f(), gw.f(), gdy.f(), gdx.f(), gdw.f(), gdb.f());
    });
    // y = b + x W^T: the bias is C of a GEMM with beta 1 (in + 2 roundings, plus the bias copy).
    std::vector<double> abs_y = gemm_abs(false, true, n, out, in, 1.0f, x, w, 0.0f, y);
    for (int i = 0; i < n; ++i)
      for (int o = 0; o < out; ++o) abs_y[size_t(i) * out + o] += std::fabs(double(b[size_t(o)]));
    check_close("linear y", gpu.get(gy, y.size()), y, scaled(abs_y, in + 3));
    check_close("linear dw", gpu.get(gdw, dw.size()), dw,
                scaled(gemm_abs(true, false, out, in, n, 1.0f, dy, x, 0.0f, dw), n + 2));
    check_close("linear dx", gpu.get(gdx, dx.size()), dx,
                scaled(gemm_abs(false, false, n, in, out, 1.0f, dy, w, 0.0f, dx), out + 2));
    // db: rows summed in order on both sides, the same bits.
    check_equal("linear db", gpu.get(gdb, db.size()), db);

    Buffer gdw2 = gpu.sentinel(dw.size()), gdb2 = gpu.sentinel(db.size());
    gpu.on([&] { gpu.ops().linear_backward(n, in, out, gx.f(), gw.f(), gdy.f(), nullptr, gdw2.f(), gdb2.f()); });
    check_close("linear dw (no dx)", gpu.get(gdw2, dw.size()), dw,
                scaled(gemm_abs(true, false, out, in, n, 1.0f, dy, x, 0.0f, dw), n + 2));
    check_equal("linear db (no dx)", gpu.get(gdb2, db.size()), db);
  }
}

// ------------------------------------------------------------------------------------------------
// Pooling and activations: the same formulas in the same order, so the same bits.

TEST_CASE("cuda: average and max pooling match the CPU bit for bit" * doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(4);
  for (auto [n, c, h, w, k] :
       std::vector<std::array<int, 5>>{{3, 2, 9, 7, 2}, {2, 20, 26, 26, 2}, {1, 3, 8, 11, 3}, {0, 2, 4, 4, 2}}) {
    PoolShape s;
    s.n = n, s.c = c, s.h = h, s.w = w, s.k = k;
    CAPTURE(n);
    CAPTURE(c);
    CAPTURE(h);
    CAPTURE(w);
    CAPTURE(k);
    const size_t in = size_t(n) * c * h * w, out = size_t(n) * c * s.out_h() * s.out_w();
    auto x = random_floats(in, rng), dy = random_floats(out, rng);
    std::vector<float> ay(out), adx(in), my(out), mdx(in);
    std::vector<int32_t> arg(out);
    cpu.avgpool_forward(s, x.data(), ay.data());
    cpu.avgpool_backward(s, dy.data(), adx.data());
    cpu.maxpool_forward(s, x.data(), my.data(), arg.data());
    cpu.maxpool_backward(s, dy.data(), arg.data(), mdx.data());
    Buffer gx = gpu.put(x), gdy = gpu.put(dy);
    Buffer gay = gpu.sentinel(out), gadx = gpu.sentinel(in), gmy = gpu.sentinel(out), gmdx = gpu.sentinel(in);
    Buffer garg = gpu.put(std::vector<int32_t>(out, -1));
    gpu.on([&] {
      gpu.ops().avgpool_forward(s, gx.f(), gay.f());
      gpu.ops().avgpool_backward(s, gdy.f(), gadx.f());
      gpu.ops().maxpool_forward(s, gx.f(), gmy.f(), garg.i32());
      gpu.ops().maxpool_backward(s, gdy.f(), garg.i32(), gmdx.f());
    });
    check_equal("avgpool y", gpu.get(gay, out), ay);
    check_equal("avgpool dx", gpu.get(gadx, in), adx);  // including the zeroed rows past the windows
    check_equal("maxpool y", gpu.get(gmy, out), my);
    CHECK(gpu.get_i32(garg, out) == arg);
    check_equal("maxpool dx", gpu.get(gmdx, in), mdx);
  }
}

TEST_CASE("cuda: activations match the CPU" * doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(5);
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1'100'003)}) {  // the last spans the grid cap
    CAPTURE(n);
    auto x = random_floats(size_t(n), rng, -20.0f, 20.0f), dy = random_floats(size_t(n), rng);
    for (Activation a : {Activation::relu, Activation::sigmoid}) {
      const bool relu = a == Activation::relu;
      CAPTURE(relu);
      std::vector<float> y(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
      cpu.activation_forward(a, n, x.data(), y.data());
      cpu.activation_backward(a, n, y.data(), dy.data(), dx.data());
      Buffer gx = gpu.put(x), gdy = gpu.put(dy), gy_in = gpu.put(y);
      Buffer gy = gpu.sentinel(static_cast<size_t>(n)), gdx = gpu.sentinel(static_cast<size_t>(n));
      gpu.on([&] {
        gpu.ops().activation_forward(a, n, gx.f(), gy.f());
        gpu.ops().activation_backward(a, n, gy_in.f(), gdy.f(), gdx.f());  // from the CPU's y: isolates the op
      });
      if (relu) {
        check_equal("relu y", gpu.get(gy, size_t(n)), y);
        check_equal("relu dx", gpu.get(gdx, size_t(n)), dx);
      } else {
        // sigmoid: the device's expf is within 2 ulp (CUDA Programming Guide, maths functions), the
        // host's within 1; z / (1 + z) adds two roundings on each side, and the relative error of z
        // passes to y at most unchanged: 3 * 2u + 4u = 10u, rounded up to 16u.
        std::vector<double> tol(static_cast<size_t>(n));
        for (size_t i = 0; i < tol.size(); ++i) tol[i] = 16 * kU * std::fabs(double(y[i]));
        check_close("sigmoid y", gpu.get(gy, size_t(n)), y, tol);
        // dy * y * (1 - y): the same three operations in the same order, no multiply-add to fuse.
        check_equal("sigmoid dx", gpu.get(gdx, size_t(n)), dx);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Softmax cross-entropy

TEST_CASE("cuda: softmax cross-entropy matches the CPU and adds to stats" * doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(6);
  for (auto [n, classes] : std::vector<std::pair<int, int>>{{37, 10}, {1, 3}, {300, 70}, {0, 10}, {9, 32}}) {
    CAPTURE(n);
    CAPTURE(classes);
    const float scale = n > 0 ? 1.0f / float(n + 5) : 1.0f;  // as the engine's 1/B with B > n
    auto z = random_floats(size_t(n) * classes, rng, -4.0f, 4.0f);
    std::vector<int32_t> labels(static_cast<size_t>(n));
    std::uniform_int_distribution<int> pick(0, classes - 1);
    for (auto& l : labels) l = pick(rng);
    std::vector<float> dz(z.size()), stats{0.25f, 2.0f};  // ops add to stats
    cpu.softmax_xent(n, classes, z.data(), labels.data(), scale, dz.data(), stats.data());
    Buffer gz = gpu.put(z), gl = gpu.put(labels), gdz = gpu.sentinel(z.size()),
           gs = gpu.put(std::vector<float>{0.25f, 2.0f});
    gpu.on([&] { gpu.ops().softmax_xent(n, classes, gz.f(), gl.i32(), scale, gdz.f(), gs.f()); });

    // Per row, in double: the shift m, L = log sum exp(z - m), p = softmax. The sum of exponentials
    // differs by (C + 3) u on each side (order, expf's 2 ulp), log and the shifts add 2u |L| and
    // 4u |z - m|, exp 3u: p differs relatively by u (2C + 9 + 4|L| + 4|z - m|). Subtracting the
    // one-hot and scaling add 4u of the result. Doubled for margin.
    std::vector<double> tol(z.size());
    double loss_tol = 0, loss_abs = 0;
    for (int i = 0; i < n; ++i) {
      const float* zr = z.data() + size_t(i) * classes;
      const double m = *std::max_element(zr, zr + classes);
      double s = 0;
      for (int j = 0; j < classes; ++j) s += std::exp(zr[j] - m);
      const double L = std::log(s);
      for (int j = 0; j < classes; ++j) {
        const double p = std::exp(zr[j] - m - L);
        const size_t at = size_t(i) * classes + j;
        tol[at] = 2 * kU * std::fabs(scale) * p * (2.0 * classes + 9 + 4 * L + 4 * std::fabs(zr[j] - m)) +
                  8 * kU * std::fabs(double(dz[at]));
      }
      const double row_loss = L - (zr[labels[size_t(i)]] - m);
      loss_abs += row_loss;
      loss_tol += kU * (2.0 * classes + 6 + 2 * L + 2 * std::fabs(zr[labels[size_t(i)]] - m) + 2 * row_loss);
    }
    check_close("dlogits", gpu.get(gdz, z.size()), dz, tol);
    // The loss: each row as above, summed in a different order (2 gamma(n) of the sum), scaled and
    // added to the 0.25 already there.
    auto got = gpu.get(gs, 2);
    const double stat_tol =
        2 * (std::fabs(scale) * (loss_tol + 2 * gamma_k(n + 8) * loss_abs)) + 4 * kU * std::fabs(stats[0]);
    CHECK(std::fabs(double(got[0]) - double(stats[0])) <= stat_tol);
    CHECK(got[1] == stats[1]);  // argmax with the same first-maximum rule: exact
  }
}

// ------------------------------------------------------------------------------------------------
// SGD, add, fill, all_finite

TEST_CASE("cuda: sgd, add, fill and all_finite match the CPU" * doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CpuOps cpu;
  std::mt19937 rng(7);
  const int64_t n = 100'003;
  auto w = random_floats(size_t(n), rng), g = random_floats(size_t(n), rng), v = random_floats(size_t(n), rng);

  SUBCASE("sgd with momentum and weight decay") {
    const float lr = 0.05f, mom = 0.9f, wd = 1e-3f;
    auto w1 = w, v1 = v;
    cpu.sgd_step(n, w1.data(), g.data(), v1.data(), lr, mom, wd);
    Buffer gw = gpu.put(w), gg = gpu.put(g), gv = gpu.put(v);
    gpu.on([&] { gpu.ops().sgd_step(n, gw.f(), gg.f(), gv.f(), lr, mom, wd); });
    // d = g + wd w, v = mom v + d, w = w - lr v: the device may fuse each multiply-add (one rounding
    // instead of two), the host does not. Carried through: |dv| <= 3u sv and |dw| <= 2u |w| +
    // 5u lr sv, with sv = |mom v| + |g| + |wd w|; 8u covers both.
    std::vector<double> tw(static_cast<size_t>(n)), tv(static_cast<size_t>(n));
    for (size_t i = 0; i < tw.size(); ++i) {
      const double sv = std::fabs(mom * v[i]) + std::fabs(g[i]) + std::fabs(wd * w[i]);
      tv[i] = 8 * kU * sv;
      tw[i] = 8 * kU * (std::fabs(w[i]) + lr * sv);
    }
    check_close("sgd v", gpu.get(gv, size_t(n)), v1, tv);
    check_close("sgd w", gpu.get(gw, size_t(n)), w1, tw);
  }
  SUBCASE("sgd without momentum (no buffer)") {
    auto w1 = w;
    cpu.sgd_step(n, w1.data(), g.data(), nullptr, 0.1f, 0.0f, 0.0f);
    Buffer gw = gpu.put(w), gg = gpu.put(g);
    gpu.on([&] { gpu.ops().sgd_step(n, gw.f(), gg.f(), nullptr, 0.1f, 0.0f, 0.0f); });
    std::vector<double> tw(static_cast<size_t>(n));
    for (size_t i = 0; i < tw.size(); ++i) tw[i] = 4 * kU * (std::fabs(w[i]) + 0.1 * std::fabs(g[i]));
    check_close("sgd w (no momentum)", gpu.get(gw, size_t(n)), w1, tw);
  }
  SUBCASE("add and fill") {
    auto y = w;
    cpu.add(n, g.data(), y.data());
    Buffer gy = gpu.put(w), gg = gpu.put(g), gf = gpu.sentinel(static_cast<size_t>(n));
    gpu.on([&] {
      gpu.ops().add(n, gg.f(), gy.f());
      gpu.ops().add(0, gg.f(), gy.f());
      gpu.ops().fill(n, 1.5f, gf.f());
      gpu.ops().fill(0, 2.5f, gf.f());
    });
    check_equal("add", gpu.get(gy, size_t(n)), y);
    check_equal("fill", gpu.get(gf, size_t(n)), std::vector<float>(size_t(n), 1.5f));
  }
  SUBCASE("all_finite") {
    auto bad = w;
    bad[size_t(n) - 7] = std::numeric_limits<float>::infinity();
    auto nan = w;
    nan[12345] = kNaN;
    Buffer gw = gpu.put(w), gbad = gpu.put(bad), gnan = gpu.put(nan);
    bool a = false, b = true, c = true, empty = false;
    gpu.on([&] {
      a = gpu.ops().all_finite(n, gw.f());
      b = gpu.ops().all_finite(n, gbad.f());
      c = gpu.ops().all_finite(n, gnan.f());
      empty = gpu.ops().all_finite(0, gnan.f());
    });
    CHECK(a);
    CHECK_FALSE(b);
    CHECK_FALSE(c);
    CHECK(empty);
    CHECK(a == cpu.all_finite(n, w.data()));
  }
}

TEST_CASE("cuda: a CUDA device books its memory, copies, and refuses past its cap" *
          doctest::skip(!test::cuda_available())) {
  Gpu gpu;
  CHECK(gpu.dev().name() == "cuda:0");
  CHECK(std::string(gpu.ops().backend()) == "cuda");
  std::mt19937 rng(8);
  auto h = random_floats(1001, rng);
  Buffer a = gpu.put(h), b;
  gpu.on([&] {
    b = gpu.dev().alloc_floats(1001, Category::activations);
    gpu.dev().copy(b.f(), a.f(), 1001 * sizeof(float));
  });
  check_equal("round trip", gpu.get(b, 1001), h);
  CHECK(gpu.dev().ledger().snapshot().current[int(Category::activations)] == int64_t(1001 * sizeof(float)));

  auto capped = make_cuda_device(0, 0, 4096);
  capped
      ->run([&] {
        Buffer ok = capped->alloc(1024, Category::parameters);
        CHECK_THROWS_AS(capped->alloc(8192, Category::activations), OutOfMemory);
      })
      .get();
}

// ------------------------------------------------------------------------------------------------
// Collectives

// Runs fn(rank) on every device's compute thread at once (SPMD); a failure aborts the others.
void on_all_ranks(std::vector<std::unique_ptr<Device>>& devs, Communicator& comm, const std::function<void(int)>& fn) {
  std::vector<std::future<void>> fs;
  for (int r = 0; r < int(devs.size()); ++r)
    fs.push_back(devs[size_t(r)]->run([&, r] {
      try {
        fn(r);
      } catch (...) {
        comm.abort();
        throw;
      }
    }));
  for (auto& f : fs) f.get();
}

TEST_CASE("cuda: collectives over CUDA devices: rank r contributes r, the sum is n(n-1)/2" *
          doctest::skip(!test::cuda_available())) {
  const int gpus = probe_cuda().count;
  std::vector<std::vector<int>> layouts;
  if (gpus >= 2) layouts.push_back({0, 1});  // distinct GPUs: NCCL
  layouts.push_back({0, 0});                 // one GPU shared: the peer ring
  layouts.push_back(gpus >= 2 ? std::vector<int>{0, 1, 0} : std::vector<int>{0, 0, 0});  // mixed: the ring
  if (gpus >= 3) layouts.push_back({0, 1, 2});
  for (const auto& ids : layouts) {
    const int n = int(ids.size());
    CAPTURE(n);
    CAPTURE(ids[1]);
    std::vector<std::unique_ptr<Device>> devs;
    for (int r = 0; r < n; ++r) devs.push_back(make_cuda_device(r, ids[size_t(r)], 0));
    std::unique_ptr<Communicator> comm = make_communicator(test::raw(devs));
    const int64_t count = 1001;  // not a multiple of n: uneven chunks
    std::vector<Buffer> bufs(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      devs[size_t(r)]
          ->run([&, r] { bufs[size_t(r)] = devs[size_t(r)]->alloc_floats(count, Category::gradients); })
          .get();
    auto fill_rank = [&](int r) { devs[size_t(r)]->ops().fill(count, float(r), bufs[size_t(r)].f()); };
    auto expect_all = [&](float want, const char* what) {
      for (int r = 0; r < n; ++r) {
        std::vector<float> h(static_cast<size_t>(count));
        devs[size_t(r)]
            ->run([&] { devs[size_t(r)]->download(h.data(), bufs[size_t(r)].f(), h.size() * sizeof(float)); })
            .get();
        CHECK_MESSAGE(std::all_of(h.begin(), h.end(), [&](float x) { return x == want; }),
                      what << ": rank " << r << " holds " << h[0] << " ... " << h.back() << ", want " << want);
      }
    };
    const float sum = float(n * (n - 1) / 2);

    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      comm->all_reduce(r, bufs[size_t(r)].f(), count);
      devs[size_t(r)]->synchronize();
    });
    expect_all(sum, "all_reduce");

    // Bytes as the ring counts them, whichever communicator: the same as on simulated devices.
    {
      auto sims = test::make_test_devices("cpu", n);
      Communicator ring(test::raw(sims));
      std::vector<std::vector<float>> hs(size_t(n), std::vector<float>(size_t(count), 1.0f));
      on_all_ranks(sims, ring, [&](int r) { ring.all_reduce(r, hs[size_t(r)].data(), count); });
      for (int r = 0; r < n; ++r) {
        CHECK(comm->traffic(r, Collective::all_reduce).sent == ring.traffic(r, Collective::all_reduce).sent);
        CHECK(comm->traffic(r, Collective::all_reduce).received == ring.traffic(r, Collective::all_reduce).received);
      }
    }

    // Buckets overlapping "backward": three ranges started on the compute thread, then wait().
    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      float* b = bufs[size_t(r)].f();
      comm->all_reduce_async(r, b + 600, count - 600);
      comm->all_reduce_async(r, b + 100, 500);
      comm->all_reduce_async(r, b, 100);
      comm->wait(r);
      devs[size_t(r)]->synchronize();
    });
    expect_all(sum, "all_reduce_async");

    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      comm->broadcast(r, bufs[size_t(r)].f(), count, n - 1);
    });
    expect_all(float(n - 1), "broadcast");

    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      comm->reduce(r, bufs[size_t(r)].f(), count, 0);
      devs[size_t(r)]->synchronize();
    });
    std::vector<float> root(static_cast<size_t>(count));
    devs[0]->run([&] { devs[0]->download(root.data(), bufs[0].f(), root.size() * sizeof(float)); }).get();
    CHECK(root.front() == sum);
    CHECK(root.back() == sum);

    for (int r = 0; r < n; ++r) devs[size_t(r)]->run([&, r] { bufs[size_t(r)].reset(); }).get();
    comm.reset();
  }
}

// ------------------------------------------------------------------------------------------------
// Training: CUDA against the CPU

struct Trained {
  std::vector<float> params;
  std::vector<double> losses;
};

Trained train_three_steps(std::vector<Device*> devs, const ModelSpec& spec, Sync sync, int64_t bucket_kb,
                          const std::vector<float>& init, const std::vector<float>& x, const std::vector<int32_t>& y,
                          int batch) {
  EngineConfig ec;
  ec.sync = sync, ec.batch = batch, ec.lr = 0.05f, ec.momentum = 0.9f, ec.weight_decay = 1e-4f,
  ec.bucket_kb = bucket_kb;
  Engine engine(std::move(devs), spec, ec);
  engine.set_params(init);
  Trained t;
  for (int s = 0; s < 3; ++s) t.losses.push_back(engine.step(x.data(), y.data(), batch).loss);
  t.params = engine.params();
  return t;
}

TEST_CASE("cuda: three LeNet steps on CUDA match the CPU from the same weights and batch" *
          doctest::skip(!test::cuda_available())) {
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 7, init.data());
  const int batch = 64;
  std::mt19937 rng(9);
  auto x = random_floats(size_t(batch) * size_t(spec.input_size()), rng, 0.0f, 1.0f);
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (auto& l : y) l = int32_t(rng() % 10);

  auto cpu_devs = test::make_test_devices("cpu", 1);
  const Trained ref = train_three_steps(test::raw(cpu_devs), spec, Sync::allreduce, 0, init, x, y, batch);

  struct Variant {
    const char* name;
    int devices;
    Sync sync;
    int64_t bucket_kb;
  };
  for (const Variant& v : {Variant{"one GPU", 1, Sync::allreduce, 0},
                           Variant{"two replicas, allreduce in buckets", 2, Sync::allreduce, 16},
                           Variant{"two replicas, allreduce", 2, Sync::allreduce, 0},
                           Variant{"two replicas, scatter", 2, Sync::scatter, 0}}) {
    CAPTURE(v.name);
    auto devs = test::make_test_devices("cuda", v.devices);
    const Trained got = train_three_steps(test::raw(devs), spec, v.sync, v.bucket_kb, init, x, y, batch);
    // Per step the gradients differ by the kernels' summation-order bounds, at most about
    // gamma(800) (fc1's fan-in) ~ 5e-5 relative to sums of |terms| of the gradients' own size; three
    // SGD steps at lr 0.05 with momentum move the weights by ~ 3 lr (1 + 0.9 + 0.81) |g| per weight,
    // so their differences stay near 1e-6. A wrong kernel moves them by ~ lr |g| ~ 1e-3. The
    // tolerance sits between: 1e-4 + 1e-3 |w|.
    std::vector<double> tol(ref.params.size());
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = 1e-4 + 1e-3 * std::fabs(double(ref.params[i]));
    check_close(std::string("weights, ") + v.name, got.params, ref.params, tol);
    for (int s = 0; s < 3; ++s)
      CHECK(std::fabs(got.losses[size_t(s)] - ref.losses[size_t(s)]) <= 1e-4 * std::fabs(ref.losses[size_t(s)]));
  }
}

TEST_CASE("cuda: a failure on one replica aborts the step on all, and the next step runs" *
          doctest::skip(!test::cuda_available())) {
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 3, init.data());
  const int batch = 32;
  std::mt19937 rng(10);
  auto x = random_floats(size_t(batch) * size_t(spec.input_size()), rng, 0.0f, 1.0f);
  std::vector<int32_t> y(size_t(batch), 1);
  for (int64_t bucket_kb : {int64_t(0), int64_t(16)}) {
    CAPTURE(bucket_kb);
    auto devs = test::make_test_devices("cuda", 2);
    EngineConfig ec;
    ec.sync = Sync::allreduce, ec.batch = batch, ec.bucket_kb = bucket_kb;
    Engine engine(test::raw(devs), spec, ec);
    engine.set_params(init);
    devs[1]->inject_fault("test");
    CHECK_THROWS_AS(engine.step(x.data(), y.data(), batch), DeviceError);
    StepResult r = engine.step(x.data(), y.data(), batch);
    CHECK(std::isfinite(r.loss));
  }
}

// ------------------------------------------------------------------------------------------------
// Every machine

TEST_CASE("without a usable CUDA device, auto falls back to simulated devices and --backend cuda is refused") {
  const CudaProbe probe = probe_cuda();
  if (probe.count > 0) {
    MESSAGE("this machine has " << probe.count << " CUDA device(s): the fallback is not exercised here");
    DeviceConfig cfg;
    cfg.backend = "cpu";
    CHECK(make_devices(cfg).devices.at(0)->kind() == DeviceKind::simulated);
    return;
  }
  CHECK_FALSE(probe.reason.empty());
  if (cuda_built()) {
    MESSAGE("CUDA is built in; the probe says: " << probe.reason);
    CHECK(probe.reason.find("no CUDA") != std::string::npos);
  }
  DeviceConfig cfg;
  cfg.backend = "auto";
  cfg.ids = {0, 1};
  cfg.threads = 1;
  DeviceSet set = make_devices(cfg);
  REQUIRE(set.devices.size() == 2);
  for (auto& d : set.devices) CHECK(d->kind() == DeviceKind::simulated);
  CHECK(set.notice.find("simulated") != std::string::npos);
  CHECK(set.notice.find(probe.reason) != std::string::npos);

  DeviceConfig want_cuda = cfg;
  want_cuda.backend = "cuda";
  CHECK_THROWS_AS(make_devices(want_cuda), UsageError);
  CHECK_THROWS_AS(make_cuda_device(0, 0, 0), UsageError);

  // And the fallback devices train: the same batch five times, the loss goes down.
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 11, init.data());
  const int batch = 16;
  std::mt19937 rng(12);
  auto x = random_floats(size_t(batch) * size_t(spec.input_size()), rng, 0.0f, 1.0f);
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (auto& l : y) l = int32_t(rng() % 10);
  std::vector<Device*> ptrs;
  for (auto& d : set.devices) ptrs.push_back(d.get());
  EngineConfig ec;
  ec.sync = Sync::allreduce, ec.batch = batch, ec.lr = 0.05f;
  Engine engine(ptrs, spec, ec);
  engine.set_params(init);
  const double first = engine.step(x.data(), y.data(), batch).loss;
  double last = first;
  for (int s = 0; s < 4; ++s) last = engine.step(x.data(), y.data(), batch).loss;
  CHECK(std::isfinite(first));
  CHECK(last < first);
}

}  // namespace
}  // namespace dp
