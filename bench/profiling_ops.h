// ProfilingOps: an Ops that forwards every call to the real kernels and books each call's wall time,
// count and FLOPs under (op, shape), for `dp_bench ops`. It is handed to make_simulated_device in
// place of the CPU kernels, so the engine and the network run unchanged. On a simulated device an op
// runs to completion on the calling thread, so the call's wall time is the op's time; on CUDA it
// would be the launch's, which is why only the CPU backend is profiled this way.
//
// Only the calls the network makes through the device are seen: an inner Ops that implements an op
// by calling its own virtuals (the default conv2d_act_pool_forward runs conv2d_forward, activation
// and pooling) is booked as the one outer op.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>

#include "kernels/ops.h"

namespace dp::bench {

// The shape of a call as the numbers its key is made of; what each number means depends on the op
// (see ProfilingOps: conv c, h, w, k, kh, kw, pad, act; linear in, out; ...). The batch is not part
// of it, so a layer run in chunks is one row.
struct OpKey {
  std::string_view op;  // the Ops method: "conv2d_forward", "linear_backward", ...
  std::array<int64_t, 8> dims{};
  auto operator<=>(const OpKey&) const = default;
};

struct OpTotal {
  int64_t calls = 0;
  double seconds = 0;
  double flops = 0;  // 2 per multiply-add of convolutions, linear layers and GEMMs; 0 for the rest
};

class ProfilingOps final : public Ops {
 public:
  explicit ProfilingOps(std::unique_ptr<Ops> inner) : inner_(std::move(inner)) {}

  std::map<OpKey, OpTotal> totals() const {
    std::lock_guard lock(mu_);
    return totals_;
  }
  void reset() {
    std::lock_guard lock(mu_);
    totals_.clear();
  }

  const char* backend() const override { return inner_->backend(); }
  const char* variant() const override { return inner_->variant(); }
  int preferred_chunk() const override { return inner_->preferred_chunk(); }
  size_t conv2d_workspace_floats(const ConvShape& s) override { return inner_->conv2d_workspace_floats(s); }

  void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override {
    timed({"gemm", {m, n, k, ta, tb}}, 2.0 * m * n * k, [&] { inner_->gemm(ta, tb, m, n, k, alpha, a, b, beta, c); });
  }

  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* ws) override {
    timed(conv_key("conv2d_forward", s, -1, 0), conv_flops(s), [&] { inner_->conv2d_forward(s, x, w, b, y, ws); });
  }
  // Weight gradient, and the data gradient where dx is asked for: one forward's multiply-adds each.
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* ws) override {
    timed(conv_key("conv2d_backward", s, -1, 0), conv_flops(s) * (dx ? 2 : 1),
          [&] { inner_->conv2d_backward(s, x, w, dy, dx, dw, db, ws); });
  }
  void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool, float* ws) override {
    timed(conv_key("conv2d_act_pool_forward", s, int(a), k), conv_flops(s),
          [&] { inner_->conv2d_act_pool_forward(s, a, k, x, w, b, y_act, y_pool, ws); });
  }
  void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                float* db, float* ws) override {
    timed(conv_key("conv2d_act_pool_backward", s, int(a), k), conv_flops(s) * (dx ? 2 : 1),
          [&] { inner_->conv2d_act_pool_backward(s, a, k, x, w, y_act, dy_pool, scratch, dx, dw, db, ws); });
  }

  void avgpool_forward(const PoolShape& s, const float* x, float* y) override {
    timed(pool_key("avgpool_forward", s), 0, [&] { inner_->avgpool_forward(s, x, y); });
  }
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override {
    timed(pool_key("avgpool_backward", s), 0, [&] { inner_->avgpool_backward(s, dy, dx); });
  }
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override {
    timed(pool_key("maxpool_forward", s), 0, [&] { inner_->maxpool_forward(s, x, y, argmax); });
  }
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) override {
    timed(pool_key("maxpool_backward", s), 0, [&] { inner_->maxpool_backward(s, dy, argmax, dx); });
  }

  void activation_forward(Activation a, int64_t n, const float* x, float* y) override {
    timed({"activation_forward", {int(a), n}}, 0, [&] { inner_->activation_forward(a, n, x, y); });
  }
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override {
    timed({"activation_backward", {int(a), n}}, 0, [&] { inner_->activation_backward(a, n, y, dy, dx); });
  }

  void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) override {
    timed({"linear_forward", {in, out}}, 2.0 * n * in * out, [&] { inner_->linear_forward(n, in, out, x, w, b, y); });
  }
  void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db) override {
    timed({"linear_backward", {in, out}}, 2.0 * n * in * out * (dx ? 2 : 1),
          [&] { inner_->linear_backward(n, in, out, x, w, dy, dx, dw, db); });
  }

  void bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) override {
    timed({"bn_channel_sums", {c, hw}}, 0, [&] { inner_->bn_channel_sums(n, c, hw, x, mean, scale, out); });
  }
  void bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var, const float* gamma,
                    const float* beta, float eps, float* y) override {
    timed({"bn_normalize", {c, hw}}, 0, [&] { inner_->bn_normalize(n, c, hw, x, mean, var, gamma, beta, eps, y); });
  }
  void bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                        const float* dy, float* sums) override {
    timed({"bn_backward_sums", {c, hw}}, 0, [&] { inner_->bn_backward_sums(n, c, hw, x, mean, var, eps, dy, sums); });
  }
  void bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                      const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) override {
    timed({"bn_backward_dx", {c, hw}}, 0,
          [&] { inner_->bn_backward_dx(n, c, hw, x, mean, var, eps, gamma, dy, sums, count, dx); });
  }
  void bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum, float* running_mean,
                         float* running_var) override {
    timed({"bn_update_running", {c}}, 0,
          [&] { inner_->bn_update_running(c, mean, var, count, momentum, running_mean, running_var); });
  }

  void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                    float* stats) override {
    timed({"softmax_xent", {classes}}, 0,
          [&] { inner_->softmax_xent(n, classes, logits, labels, scale, dlogits, stats); });
  }
  void sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) override {
    timed({"sgd_step", {n}}, 0, [&] { inner_->sgd_step(n, w, g, v, s, nonfinite); });
  }
  void adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                 float* nonfinite) override {
    timed({"adam_step", {n}}, 0, [&] { inner_->adam_step(n, w, g, m, v, s, nonfinite); });
  }
  void add(int64_t n, const float* x, float* y) override {
    timed({"add", {n}}, 0, [&] { inner_->add(n, x, y); });
  }
  void fill(int64_t n, float value, float* x) override {
    timed({"fill", {n}}, 0, [&] { inner_->fill(n, value, x); });
  }
  void narrow(DType t, int64_t n, const float* x, void* y) override {
    timed({"narrow", {n, int64_t(t)}}, 0, [&] { inner_->narrow(t, n, x, y); });
  }
  void widen(DType t, int64_t n, const void* x, float* y) override {
    timed({"widen", {n, int64_t(t)}}, 0, [&] { inner_->widen(t, n, x, y); });
  }
  void add_typed(DType t, int64_t n, const void* x, void* y) override {
    timed({"add_typed", {n, int64_t(t)}}, 0, [&] { inner_->add_typed(t, n, x, y); });
  }
  bool all_finite(int64_t n, const float* x) override {
    bool finite = true;
    timed({"all_finite", {n}}, 0, [&] { finite = inner_->all_finite(n, x); });
    return finite;
  }
  void sum_squares(int64_t n, const float* x, float* sum) override {
    timed({"sum_squares", {n}}, 0, [&] { inner_->sum_squares(n, x, sum); });
  }
  void clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) override {
    timed({"clip_scale", {n}}, 0, [&] { inner_->clip_scale(n, sum_squares, max_norm, x); });
  }

 private:
  static OpKey conv_key(std::string_view op, const ConvShape& s, int act, int pool) {
    return {op, {s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad, act * 16 + pool}};
  }
  static OpKey pool_key(std::string_view op, const PoolShape& s) { return {op, {s.c, s.h, s.w, s.k}}; }
  // One forward's FLOPs: 2 per multiply-add, N*K*OH*OW outputs of C*KH*KW each.
  static double conv_flops(const ConvShape& s) { return 2.0 * s.n * s.k * double(s.col_cols()) * double(s.col_rows()); }

  template <class F>
  void timed(const OpKey& key, double flops, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard lock(mu_);  // one device's ops run on its one thread; the lock costs ~20 ns
    OpTotal& t = totals_[key];
    t.calls += 1, t.seconds += seconds, t.flops += flops;
  }

  std::unique_ptr<Ops> inner_;
  mutable std::mutex mu_;
  std::map<OpKey, OpTotal> totals_;
};

}  // namespace dp::bench
