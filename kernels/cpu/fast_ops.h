// A fast CPU backend: the reference backend with convolution (also fused with an activation and 2x2
// average pooling), activations and 2x2 average pooling replaced by the vector kernels of this
// directory, for the vector type S (kernels/cpu/fast_simd_avx2.h, fast_simd_avx512.h). Instantiated
// once, in that instruction set's translation unit (fast_avx2.cpp, fast_avx512.cpp); the same
// contracts as the reference, checked against it by the op matrix (tests/test_ops_*.cpp).
#pragma once

#include "kernels/cpu/fast_conv.h"
#include "kernels/cpu/fast_eltwise.h"
#include "kernels/cpu/reference_ops.h"

namespace dp::cpu::fast {

template <class S>
class FastOps final : public ReferenceOps {
 public:
  const char* variant() const override { return S::kName; }

  size_t conv2d_workspace_floats(const ConvShape& s) override { return size_t(workspace_floats<S>(s)); }
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* workspace) override {
    conv_forward<S>(s, x, w, b, y, workspace, nullptr);
  }
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* workspace) override {
    conv_backward<S>(s, x, w, dy, dx, dw, db, workspace, nullptr);
  }
  // Fused for k == 2 (the same bits as the three ops one after another); other windows run the three.
  void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool, float* workspace) override {
    if (k != 2) return ReferenceOps::conv2d_act_pool_forward(s, a, k, x, w, b, y_act, y_pool, workspace);
    const Fusion f{.act = a, .y_pool = y_pool};
    conv_forward<S>(s, x, w, b, y_act, workspace, &f);
  }
  // The scratch buffer is not needed: the convolution's output gradient is built chunk by chunk.
  void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                float* db, float* workspace) override {
    if (k != 2)
      return ReferenceOps::conv2d_act_pool_backward(s, a, k, x, w, y_act, dy_pool, scratch, dx, dw, db, workspace);
    const Fusion f{.act = a, .y_act = y_act, .dy_pool = dy_pool};
    conv_backward<S>(s, x, w, nullptr, dx, dw, db, workspace, &f);
  }
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override {
    if (s.k != 2) return ReferenceOps::avgpool_forward(s, x, y);
    avgpool2_forward<S>(s, x, y);
  }
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override {
    if (s.k != 2) return ReferenceOps::avgpool_backward(s, dy, dx);
    avgpool2_backward<S>(s, dy, dx);
  }
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override {
    fast::activation_forward<S>(a, n, x, y);
  }
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override {
    fast::activation_backward<S>(a, n, y, dy, dx);
  }
};

}  // namespace dp::cpu::fast
