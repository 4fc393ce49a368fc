// The reference CPU backend (kernels/cpu/reference_ops.h): each op forwards to its kernel.
#include "kernels/cpu/reference_ops.h"

#include <algorithm>

#include "kernels/cpu/kernels.h"

namespace dp::cpu {

ReferenceOps::ReferenceOps() = default;
ReferenceOps::~ReferenceOps() = default;
const char* ReferenceOps::backend() const { return "cpu"; }
const char* ReferenceOps::variant() const { return "reference"; }
int ReferenceOps::preferred_chunk() const { return 16; }

void ReferenceOps::gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, const float* b,
                        float beta, float* c) {
  cpu::gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c);
}
size_t ReferenceOps::conv2d_workspace_floats(const ConvShape& s) { return size_t(cpu::conv2d_workspace_size(s)); }
void ReferenceOps::conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                                  float* workspace) {
  cpu::conv2d_forward(s, x, w, b, y, workspace);
}
void ReferenceOps::conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                                   float* dw, float* db, float* workspace) {
  cpu::conv2d_backward(s, x, w, dy, dx, dw, db, workspace);
}
void ReferenceOps::conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                           const float* b, float* y_act, float* y_pool, float* workspace) {
  Ops::conv2d_act_pool_forward(s, a, k, x, w, b, y_act, y_pool, workspace);
}
void ReferenceOps::conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                            const float* y_act, const float* dy_pool, float* scratch, float* dx,
                                            float* dw, float* db, float* workspace) {
  Ops::conv2d_act_pool_backward(s, a, k, x, w, y_act, dy_pool, scratch, dx, dw, db, workspace);
}
void ReferenceOps::avgpool_forward(const PoolShape& s, const float* x, float* y) { cpu::avgpool_forward(s, x, y); }
void ReferenceOps::avgpool_backward(const PoolShape& s, const float* dy, float* dx) {
  cpu::avgpool_backward(s, dy, dx);
}
void ReferenceOps::maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) {
  cpu::maxpool_forward(s, x, y, argmax);
}
void ReferenceOps::maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) {
  cpu::maxpool_backward(s, dy, argmax, dx);
}
void ReferenceOps::activation_forward(Activation a, int64_t n, const float* x, float* y) {
  cpu::activation_forward(a, n, x, y);
}
void ReferenceOps::activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) {
  cpu::activation_backward(a, n, y, dy, dx);
}
void ReferenceOps::linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) {
  cpu::linear_forward(n, in, out, x, w, b, y);
}
void ReferenceOps::linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx,
                                   float* dw, float* db) {
  cpu::linear_backward(n, in, out, x, w, dy, dx, dw, db);
}
void ReferenceOps::bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) {
  cpu::bn_channel_sums(n, c, hw, x, mean, scale, out);
}
void ReferenceOps::bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var,
                                const float* gamma, const float* beta, float eps, float* y) {
  cpu::bn_normalize(n, c, hw, x, mean, var, gamma, beta, eps, y);
}
void ReferenceOps::bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var,
                                    float eps, const float* dy, float* sums) {
  cpu::bn_backward_sums(n, c, hw, x, mean, var, eps, dy, sums);
}
void ReferenceOps::bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                                  const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) {
  cpu::bn_backward_dx(n, c, hw, x, mean, var, eps, gamma, dy, sums, count, dx);
}
void ReferenceOps::bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum,
                                     float* running_mean, float* running_var) {
  cpu::bn_update_running(c, mean, var, count, momentum, running_mean, running_var);
}
void ReferenceOps::softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale,
                                float* dlogits, float* stats) {
  cpu::softmax_xent(n, classes, logits, labels, scale, dlogits, stats);
}
void ReferenceOps::sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) {
  if (n > 0) cpu::sgd_step(n, w, g, v, s->lr, s->momentum, s->weight_decay, nonfinite);
}
void ReferenceOps::add(int64_t n, const float* x, float* y) { cpu::add(n, x, y); }
void ReferenceOps::fill(int64_t n, float value, float* x) { cpu::fill(n, value, x); }
void ReferenceOps::narrow(DType t, int64_t n, const float* x, void* y) {
  if (t == DType::fp32) return void(std::copy_n(x, n, static_cast<float*>(y)));
  cpu::narrow(t, n, x, static_cast<uint16_t*>(y));
}
void ReferenceOps::widen(DType t, int64_t n, const void* x, float* y) {
  if (t == DType::fp32) return void(std::copy_n(static_cast<const float*>(x), n, y));
  cpu::widen(t, n, static_cast<const uint16_t*>(x), y);
}
void ReferenceOps::add_typed(DType t, int64_t n, const void* x, void* y) {
  if (t == DType::fp32) return add(n, static_cast<const float*>(x), static_cast<float*>(y));
  cpu::add_typed(t, n, static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y));
}
void ReferenceOps::adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                             float* nonfinite) {
  if (n > 0) cpu::adam_step(n, w, g, m, v, *s, nonfinite);
}

bool ReferenceOps::all_finite(int64_t n, const float* x) { return cpu::all_finite(n, x); }
void ReferenceOps::sum_squares(int64_t n, const float* x, float* sum) { cpu::sum_squares(n, x, sum); }
void ReferenceOps::clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) {
  cpu::clip_scale(n, sum_squares, max_norm, x);
}

}  // namespace dp::cpu
