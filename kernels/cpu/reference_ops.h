// The reference CPU backend: every op of the Ops interface as the float instantiation of its
// reference kernel in kernels/cpu/kernels.h (plain loops over shape-commented buffers, GEMM on
// BLIS), the oracle the fast kernels and the CUDA twins are tested against. The fast backends
// (kernels/cpu/fast_ops.h) derive from it and override the ops they speed up. Made through
// make_cpu_ops (kernels/cpu/cpu_ops.h).
#pragma once

#include "kernels/ops.h"

namespace dp::cpu {

// Every member is defined in reference_ops.cpp, compiled without instruction-set flags, so that no
// copy of one (nor of Ops's inline defaults, which the destructor and the fused ops below would pull
// in) is compiled into a fast unit, whose copy the linker might keep for every caller.
class ReferenceOps : public Ops {
 public:
  ReferenceOps();
  ~ReferenceOps() override;
  const char* backend() const override;
  const char* variant() const override;
  // A chunk of LeNet's per-sample layers at 16 samples holds ~2.5 MB of activations, about one
  // core's L2 (and one chunk of the AVX-512 kernels, two of the AVX2 ones).
  int preferred_chunk() const override;

  void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override;
  size_t conv2d_workspace_floats(const ConvShape& s) override;
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* workspace) override;
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* workspace) override;
  // Ops's defaults: the three ops one after another.
  void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool, float* workspace) override;
  void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                float* db, float* workspace) override;
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override;
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override;
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override;
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) override;
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override;
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override;
  void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) override;
  void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db) override;
  void bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) override;
  void bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var, const float* gamma,
                    const float* beta, float eps, float* y) override;
  void bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                        const float* dy, float* sums) override;
  void bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                      const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) override;
  void bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum, float* running_mean,
                         float* running_var) override;
  void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                    float* stats) override;
  void sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) override;
  void adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                 float* nonfinite) override;
  void add(int64_t n, const float* x, float* y) override;
  void fill(int64_t n, float value, float* x) override;
  void narrow(DType t, int64_t n, const float* x, void* y) override;
  void widen(DType t, int64_t n, const void* x, float* y) override;
  void add_typed(DType t, int64_t n, const void* x, void* y) override;
  bool all_finite(int64_t n, const float* x) override;
  void sum_squares(int64_t n, const float* x, float* sum) override;
  void clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) override;
};

}  // namespace dp::cpu
