// The CPU backend of the Ops interface: each op is the float instantiation of its reference kernel in
// kernels/cpu/kernels.h (plain loops over shape-commented buffers, GEMM on OpenBLAS). They are the
// oracle the CUDA twins are tested against.
#pragma once

#include "kernels/cpu/kernels.h"
#include "kernels/ops.h"

namespace dp {

class CpuOps final : public Ops {
 public:
  explicit CpuOps(int threads = 1);  // gemm.cpp: sets OpenBLAS's thread count
  const char* backend() const override { return "cpu"; }

  void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override {
    cpu::gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c);
  }
  size_t conv2d_workspace_floats(const ConvShape& s) override { return size_t(cpu::conv2d_workspace_size(s)); }
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* workspace) override {
    cpu::conv2d_forward(s, x, w, b, y, workspace);
  }
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* workspace) override {
    cpu::conv2d_backward(s, x, w, dy, dx, dw, db, workspace);
  }
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override { cpu::avgpool_forward(s, x, y); }
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override { cpu::avgpool_backward(s, dy, dx); }
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override {
    cpu::maxpool_forward(s, x, y, argmax);
  }
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) override {
    cpu::maxpool_backward(s, dy, argmax, dx);
  }
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override {
    cpu::activation_forward(a, n, x, y);
  }
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override {
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
  int threads_;
};

}  // namespace dp
