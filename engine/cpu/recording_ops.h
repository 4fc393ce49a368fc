// The simulated device's twin of CUDA stream capture (--graphs, Device::begin_capture): an Ops that
// runs every call at once, or, while the thread that began a capture calls it, records the call with
// its arguments (pointers, shapes, scalars: what a CUDA graph's kernel nodes keep) to be replayed,
// in order, by launch. Other threads' calls run at once, as under cudaStreamCaptureModeThreadLocal.
// all_finite, which answers the host, throws while recording: it cannot be captured on CUDA either.
// So a step that passes a value a replay would not see again (a scalar argument changed since, the
// first step's host batch) goes wrong here as it would on a GPU.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/ops.h"

namespace dp {

class RecordingOps final : public Ops {
 public:
  using Graph = std::vector<std::function<void()>>;
  explicit RecordingOps(std::unique_ptr<Ops> inner) : inner_(std::move(inner)) {}

  // From here until stop(), the calling thread's calls go into `graph` instead of running.
  // Only that thread reads graph_; the others see that thread_ is not theirs.
  void record(Graph* graph) {
    graph_ = graph;
    thread_.store(std::this_thread::get_id());
  }
  void stop() {
    thread_.store(std::thread::id());
    graph_ = nullptr;
  }
  bool recording() const { return thread_.load() == std::this_thread::get_id(); }
  // Runs fn now, or records it.
  void run(std::function<void()> fn) {
    if (recording())
      graph_->push_back(std::move(fn));
    else
      fn();
  }

  const char* backend() const override { return inner_->backend(); }
  const char* variant() const override { return inner_->variant(); }
  int preferred_chunk() const override { return inner_->preferred_chunk(); }
  size_t conv2d_workspace_floats(const ConvShape& s) override { return inner_->conv2d_workspace_floats(s); }

  void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override {
    run([=, this] { inner_->gemm(ta, tb, m, n, k, alpha, a, b, beta, c); });
  }
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* ws) override {
    run([=, this] { inner_->conv2d_forward(s, x, w, b, y, ws); });
  }
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* ws) override {
    run([=, this] { inner_->conv2d_backward(s, x, w, dy, dx, dw, db, ws); });
  }
  void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool, float* ws) override {
    run([=, this] { inner_->conv2d_act_pool_forward(s, a, k, x, w, b, y_act, y_pool, ws); });
  }
  void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                float* db, float* ws) override {
    run([=, this] { inner_->conv2d_act_pool_backward(s, a, k, x, w, y_act, dy_pool, scratch, dx, dw, db, ws); });
  }
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override {
    run([=, this] { inner_->avgpool_forward(s, x, y); });
  }
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override {
    run([=, this] { inner_->avgpool_backward(s, dy, dx); });
  }
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override {
    run([=, this] { inner_->maxpool_forward(s, x, y, argmax); });
  }
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) override {
    run([=, this] { inner_->maxpool_backward(s, dy, argmax, dx); });
  }
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override {
    run([=, this] { inner_->activation_forward(a, n, x, y); });
  }
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override {
    run([=, this] { inner_->activation_backward(a, n, y, dy, dx); });
  }
  void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) override {
    run([=, this] { inner_->linear_forward(n, in, out, x, w, b, y); });
  }
  void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db) override {
    run([=, this] { inner_->linear_backward(n, in, out, x, w, dy, dx, dw, db); });
  }
  void bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) override {
    run([=, this] { inner_->bn_channel_sums(n, c, hw, x, mean, scale, out); });
  }
  void bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var, const float* gamma,
                    const float* beta, float eps, float* y) override {
    run([=, this] { inner_->bn_normalize(n, c, hw, x, mean, var, gamma, beta, eps, y); });
  }
  void bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                        const float* dy, float* sums) override {
    run([=, this] { inner_->bn_backward_sums(n, c, hw, x, mean, var, eps, dy, sums); });
  }
  void bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                      const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) override {
    run([=, this] { inner_->bn_backward_dx(n, c, hw, x, mean, var, eps, gamma, dy, sums, count, dx); });
  }
  void bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum, float* rm,
                         float* rv) override {
    run([=, this] { inner_->bn_update_running(c, mean, var, count, momentum, rm, rv); });
  }
  void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                    float* stats) override {
    run([=, this] { inner_->softmax_xent(n, classes, logits, labels, scale, dlogits, stats); });
  }
  void sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) override {
    run([=, this] { inner_->sgd_step(n, w, g, v, s, nonfinite); });
  }
  void adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                 float* nonfinite) override {
    run([=, this] { inner_->adam_step(n, w, g, m, v, s, nonfinite); });
  }
  void add(int64_t n, const float* x, float* y) override {
    run([=, this] { inner_->add(n, x, y); });
  }
  void fill(int64_t n, float value, float* x) override {
    run([=, this] { inner_->fill(n, value, x); });
  }
  void narrow(DType t, int64_t n, const float* x, void* y) override {
    run([=, this] { inner_->narrow(t, n, x, y); });
  }
  void widen(DType t, int64_t n, const void* x, float* y) override {
    run([=, this] { inner_->widen(t, n, x, y); });
  }
  void add_typed(DType t, int64_t n, const void* x, void* y) override {
    run([=, this] { inner_->add_typed(t, n, x, y); });
  }
  bool all_finite(int64_t n, const float* x) override {
    if (recording()) throw std::logic_error("all_finite answers the host: it cannot be captured in a step graph");
    return inner_->all_finite(n, x);
  }
  void sum_squares(int64_t n, const float* x, float* sum) override {
    run([=, this] { inner_->sum_squares(n, x, sum); });
  }
  void clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) override {
    run([=, this] { inner_->clip_scale(n, sum_squares, max_norm, x); });
  }

 private:
  std::unique_ptr<Ops> inner_;
  Graph* graph_ = nullptr;
  std::atomic<std::thread::id> thread_{};
};

}  // namespace dp
