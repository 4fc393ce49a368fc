// The CPU backend of the Ops interface. Convolution (also fused with an activation and 2x2 pooling),
// activations and average pooling run the fast float path (kernels/cpu/fast.h: AVX-512 or AVX2, chosen once per CpuOps)
// when the CPU has one; everything else, and every op on a CPU without AVX2 or with DP_CPU_KERNELS=reference, is the
// float instantiation of its reference kernel in kernels/cpu/kernels.h (plain loops over shape-commented buffers, GEMM
// on OpenBLAS): the oracle the fast path and the CUDA twins are tested against.
#pragma once

#include "kernels/cpu/fast.h"
#include "kernels/cpu/kernels.h"
#include "kernels/ops.h"

namespace dp {

class CpuOps final : public Ops {
 public:
  // gemm.cpp: sets OpenBLAS's thread count. isa: the fast path to use; detect_isa() by default.
  explicit CpuOps(int threads = 1);
  CpuOps(int threads, cpu::fast::Isa isa);
  const char* backend() const override { return "cpu"; }
  cpu::fast::Isa isa() const { return isa_; }

  void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override {
    cpu::gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c);
  }
  size_t conv2d_workspace_floats(const ConvShape& s) override {
    return size_t(fast() ? cpu::fast::conv2d_workspace_size(isa_, s) : cpu::conv2d_workspace_size(s));
  }
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* workspace) override {
    if (fast())
      cpu::fast::conv2d_forward(isa_, s, x, w, b, y, workspace);
    else
      cpu::conv2d_forward(s, x, w, b, y, workspace);
  }
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* workspace) override {
    if (fast())
      cpu::fast::conv2d_backward(isa_, s, x, w, dy, dx, dw, db, workspace);
    else
      cpu::conv2d_backward(s, x, w, dy, dx, dw, db, workspace);
  }
  void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool, float* workspace) override {
    if (fast() && k == 2)
      cpu::fast::conv2d_act_pool_forward(isa_, s, a, x, w, b, y_act, y_pool, workspace);
    else
      Ops::conv2d_act_pool_forward(s, a, k, x, w, b, y_act, y_pool, workspace);
  }
  void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                float* db, float* workspace) override {
    if (fast() && k == 2)
      cpu::fast::conv2d_act_pool_backward(isa_, s, a, x, w, y_act, dy_pool, dx, dw, db, workspace);
    else
      Ops::conv2d_act_pool_backward(s, a, k, x, w, y_act, dy_pool, scratch, dx, dw, db, workspace);
  }
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override {
    if (fast())
      cpu::fast::avgpool_forward(isa_, s, x, y);
    else
      cpu::avgpool_forward(s, x, y);
  }
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override {
    if (fast())
      cpu::fast::avgpool_backward(isa_, s, dy, dx);
    else
      cpu::avgpool_backward(s, dy, dx);
  }
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override {
    cpu::maxpool_forward(s, x, y, argmax);
  }
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) override {
    cpu::maxpool_backward(s, dy, argmax, dx);
  }
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override {
    if (fast())
      cpu::fast::activation_forward(isa_, a, n, x, y);
    else
      cpu::activation_forward(a, n, x, y);
  }
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override {
    if (fast())
      cpu::fast::activation_backward(isa_, a, n, y, dy, dx);
    else
      cpu::activation_backward(a, n, y, dy, dx);
  }
  void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) override {
    cpu::linear_forward(n, in, out, x, w, b, y);
  }
  void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db) override {
    cpu::linear_backward(n, in, out, x, w, dy, dx, dw, db);
  }
  void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                    float* stats) override {
    cpu::softmax_xent(n, classes, logits, labels, scale, dlogits, stats);
  }
  void sgd_step(int64_t n, float* w, const float* g, float* v, float lr, float momentum, float weight_decay) override {
    cpu::sgd_step(n, w, g, v, lr, momentum, weight_decay);
  }
  void add(int64_t n, const float* x, float* y) override { cpu::add(n, x, y); }
  void fill(int64_t n, float value, float* x) override { cpu::fill(n, value, x); }
  bool all_finite(int64_t n, const float* x) override { return cpu::all_finite(n, x); }

 private:
  bool fast() const { return isa_ != cpu::fast::Isa::reference; }
  int threads_;
  cpu::fast::Isa isa_;
};

}  // namespace dp
