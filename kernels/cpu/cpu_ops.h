// The CPU reference kernels: plain loops over shape-commented buffers, GEMM on OpenBLAS. They are the
// oracle the CUDA twins are tested against. Each op is defined in its own file in this directory.
#pragma once

#include "kernels/ops.h"

namespace dp {

class CpuOps final : public Ops {
 public:
  explicit CpuOps(int threads = 1);
  const char* backend() const override { return "cpu"; }

  void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
            const float* b, float beta, float* c) override;
  size_t conv2d_workspace_floats(const ConvShape& s) override;
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* workspace) override;
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy,
                       float* dx, float* dw, float* db, float* workspace) override;
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override;
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override;
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override;
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax,
                        float* dx) override;
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override;
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy,
                           float* dx) override;
  void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b,
                      float* y) override;
  void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy,
                       float* dx, float* dw, float* db) override;
  void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale,
                    float* dlogits, float* stats) override;
  void sgd_step(int64_t n, float* w, const float* g, float* v, float lr, float momentum,
                float weight_decay) override;
  void add(int64_t n, const float* x, float* y) override;
  void fill(int64_t n, float value, float* x) override;
  bool all_finite(int64_t n, const float* x) override;

 private:
  int threads_;
};

}  // namespace dp
