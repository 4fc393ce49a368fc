// Per-element math shared by the CPU kernels and their CUDA twins: one definition of every formula,
// compiled for host and device, so the two backends cannot drift apart. Templates over the scalar:
// the kernels run in float; the CPU reference also instantiates double for the gradient checks.
#pragma once

#include <cmath>
#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include "kernels/dtype.h"

#if defined(__CUDACC__)
#define DP_HD __host__ __device__ __forceinline__
#else
#define DP_HD inline
#endif

namespace dp {

enum class Activation { relu, sigmoid };

}  // namespace dp

namespace dp::math {

// exp that picks expf for float in device code as well as on the host.
DP_HD float exp_(float x) { return expf(x); }
DP_HD double exp_(double x) { return ::exp(x); }
// sqrt likewise (both correctly rounded: nvcc's default -prec-sqrt=true, IEEE on the host).
DP_HD float sqrt_(float x) { return sqrtf(x); }
DP_HD double sqrt_(double x) { return ::sqrt(x); }

// a + b rounded on its own, never merged with a product that feeds it into one FMA, as nvcc may do
// with `s += a * b` (one rounding, not two): where a kernel computes in registers what another stores
// first, its sums keep the other's bits (direct_taps.h).
DP_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

template <class T>
DP_HD T relu(T x) {
  return x > T(0) ? x : T(0);
}
// Derivative from the output: relu'(x) = [y > 0], as PyTorch's threshold_backward.
template <class T>
DP_HD T relu_grad(T y, T dy) {
  return y > T(0) ? dy : T(0);
}

// Stable in both tails: never evaluates exp of a large positive number.
template <class T>
DP_HD T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp_(-x));
  T z = exp_(x);
  return z / (T(1) + z);
}
template <class T>
DP_HD T sigmoid_grad(T y, T dy) {
  return dy * y * (T(1) - y);
}

// The activation a fused kernel's template names (conv_act_pool.cu, direct_taps.h), forward and back.
template <Activation A>
DP_HD float activate(float x) {
  if constexpr (A == Activation::relu) return relu(x);
  return sigmoid(x);
}
template <Activation A>
DP_HD float activate_grad(float y, float dy) {
  if constexpr (A == Activation::relu) return relu_grad(y, dy);
  return sigmoid_grad(y, dy);
}
// The fused conv op's way back for one pixel of the convolution's output: its share of its pooling
// window's gradient (*window_grad times inv = 1 / k^2; null for a pixel no window holds) through the
// activation's derivative at its output y. Every kernel that works it out calls this, so all give its bits.
template <Activation A>
DP_HD float act_pool_grad(float y, const float* window_grad, float inv) {
  return activate_grad<A>(y, window_grad ? *window_grad * inv : 0.0f);
}

// f.template operator()<A>() for the activation a: where a kernel's template names it.
template <class F>
void with_activation(Activation a, F&& f) {
  if (a == Activation::relu)
    f.template operator()<Activation::relu>();
  else
    f.template operator()<Activation::sigmoid>();
}

// PyTorch's clip_grad_norm_ (torch.nn.utils): the gradient is multiplied by
//   min(1, max_norm / (||g||_2 + 1e-6)),
// from the sum of the squares of every element of the whole gradient (the norm is its square root).
template <class T>
DP_HD T clip_coefficient(T sum_squares, T max_norm) {
  const T c = max_norm / (sqrt_(sum_squares) + T(1e-6));
  return c < T(1) ? c : T(1);
}

// PyTorch's SGD (torch.optim.SGD, dampening 0, nesterov off):
//   d <- g + wd * w ;  v <- momentum * v + d  (v <- d on the first step) ;  w <- w - lr * v
// PyTorch initialises the buffer to d on the first step; dp keeps zero-initialised buffers, and
// momentum * 0 + d == d exactly in floating point, so one formula covers both.
template <class T>
DP_HD void sgd_update(T& w, T& v, T g, T lr, T momentum, T weight_decay) {
  T d = g + weight_decay * w;
  if (momentum != T(0)) {
    v = momentum * v + d;
    d = v;
  }
  w = w - lr * d;
}

// SGD's scalars for one step, as Ops::sgd_step reads them (from device memory).
struct SgdStep {
  float lr = 0.0f, momentum = 0.0f, weight_decay = 0.0f;
};

// PyTorch's Adam and AdamW (torch.optim.Adam / AdamW, amsgrad off, its single-tensor path), with the
// operations in its order so that float results follow it step by step:
//   Adam:   g <- g + wd * w                 AdamW: w <- w * (1 - lr * wd)
//   m <- m + (1 - beta1) * (g - m)          (torch.lerp, whose weight is under 0.5)
//   v <- v * beta2 + (1 - beta2) * g * g    (mul_, then addcmul_)
//   w <- w + (-step_size) * (m / (sqrt(v) / bc2_sqrt + eps))
// with step t counted from 1, step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t). PyTorch
// forms those scalars, and 1 - beta1, 1 - beta2 and 1 - lr * wd, in Python's double and hands them to
// float kernels: adam_coefficients (host) does the same, and the kernels see only floats.
struct AdamStep {
  float one_minus_beta1 = 0.1f, beta2 = 0.999f, one_minus_beta2 = 0.001f, eps = 1e-8f;
  float weight_decay = 0.0f;  // Adam: added to the gradient (0: none)
  float decay = 1.0f;         // AdamW: the weights' factor 1 - lr * wd (1: none)
  float step_size = 0.0f, bc2_sqrt = 1.0f;
};
inline AdamStep adam_coefficients(double lr, double beta1, double beta2, double eps, double weight_decay,
                                  bool decoupled, int64_t step) {
  AdamStep s;
  s.one_minus_beta1 = float(1.0 - beta1), s.beta2 = float(beta2), s.one_minus_beta2 = float(1.0 - beta2);
  s.eps = float(eps);
  if (decoupled)
    s.decay = float(1.0 - lr * weight_decay);
  else
    s.weight_decay = float(weight_decay);
  s.step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
  s.bc2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  return s;
}
template <class T>
DP_HD void adam_update(T& w, T& m, T& v, T g, const AdamStep& s) {
  if (s.weight_decay != 0.0f) g = g + T(s.weight_decay) * w;
  if (s.decay != 1.0f) w = w * T(s.decay);
  m = m + T(s.one_minus_beta1) * (g - m);
  v = v * T(s.beta2) + T(s.one_minus_beta2) * g * g;
  const T denom = sqrt_(v) / T(s.bc2_sqrt) + T(s.eps);
  w = w + (-T(s.step_size)) * (m / denom);
}

// The row's argmax, the first maximum (PyTorch's argmax, but for NaN): whether column a comes before
// column b. A NaN ranks below every value, above them in column 0, ties go to the smaller index: a
// scan from column 0 (the CPU) finds what it would with a strict >, which never leaves a NaN but one
// in column 0 where it starts, and so does any order of comparisons (a warp's lanes, each starting
// from its own column, then a butterfly: softmax_xent.cu).
template <class T>
DP_HD bool argmax_beats(const T* z, int a, int b) {
  auto rank = [z](int j) {
#if defined(__CUDA_ARCH__)
    const bool nan = isnan(z[j]);
#else
    const bool nan = std::isnan(z[j]);
#endif
    return nan ? (j == 0 ? T(INFINITY) : -T(INFINITY)) : z[j];
  };
  const T ra = rank(a), rb = rank(b);
  return ra > rb || (ra == rb && a < b);
}

// Cross-entropy of one row from its maximum m and log_sum = log(sum_j exp(z_j - m)):
//   loss = log_sum - (z_label - m)
template <class T>
DP_HD T xent_loss(T z_label, T row_max, T log_sum) {
  return log_sum - (z_label - row_max);
}
// d loss / d z_j = softmax_j - [j == label], times `scale` (1/B for a mean over the global batch).
template <class T>
DP_HD T xent_grad(T z, T row_max, T log_sum, bool is_label, T scale) {
  T p = exp_(z - row_max - log_sum);
  return (p - (is_label ? T(1) : T(0))) * scale;
}

// ---- BatchNorm (PyTorch's BatchNorm1d/2d, affine), per channel of (N, C, HW) tensors --------------
// The kernels (kernels/cpu/batchnorm.cpp, kernels/cuda/batchnorm.cu) sum over N and HW per channel in
// double, calling the per-element formulas below with T = double; the element-wise ops run in T.

// One element's term in the channel sums: x itself (for the mean), or its squared deviation from the
// mean (for the variance, two-pass: no cancellation of E[x^2] - E[x]^2).
template <class T>
DP_HD T bn_sum_term(T x, T mean, bool deviation) {
  const T d = x - mean;
  return deviation ? d * d : x;
}

// 1 / sqrt(var + eps): the channel's scale; var is biased (training) or the running one (evaluation).
template <class T>
DP_HD T bn_inv_std(T var, T eps) {
  return T(1) / sqrt_(var + eps);
}

template <class T>
DP_HD T bn_xhat(T x, T mean, T inv_std) {
  return (x - mean) * inv_std;
}

// y = xhat * gamma + beta.
template <class T>
DP_HD T bn_normalize(T x, T mean, T inv_std, T gamma, T beta) {
  return bn_xhat(x, mean, inv_std) * gamma + beta;
}

// The training-mode input gradient, with mean_dy = sum(dy) / count and mean_dy_xhat = sum(dy xhat) /
// count over the channel's count values (all replicas' for SyncBatchNorm):
//   dx = gamma inv_std (dy - mean_dy - xhat mean_dy_xhat)
// (d/dx of the normalisation through the batch mean and the batch variance both; PyTorch's
// batch_norm_backward).
template <class T>
DP_HD T bn_backward_dx(T x, T mean, T inv_std, T gamma, T dy, T mean_dy, T mean_dy_xhat) {
  return gamma * inv_std * (dy - mean_dy - bn_xhat(x, mean, inv_std) * mean_dy_xhat);
}

// A channel sum over count values as a mean.
template <class T>
DP_HD T bn_mean_of(T sum, int64_t count) {
  return sum / T(count);
}

// PyTorch's running statistics: an exponential moving average with weight `momentum` on the batch,
// the variance unbiased (var * count / (count - 1), count > 1) although the normalisation uses the
// biased one.
template <class T>
DP_HD void bn_update_running(T& running_mean, T& running_var, T mean, T var, int64_t count, T momentum) {
  const T unbiased = var * T(count) / T(count - 1);
  running_mean = (T(1) - momentum) * running_mean + momentum * mean;
  running_var = (T(1) - momentum) * running_var + momentum * unbiased;
}

// The 16-bit gradient types of --grad-dtype (kernels/dtype.h), as bits. Float to bf16 or fp16 rounds
// to nearest, ties to even, as PyTorch's .to(torch.bfloat16 / torch.float16) and CUDA's
// __float2bfloat16_rn / __float2half_rn do: a NaN stays a (quiet) NaN, an fp16 overflow (65520 and up)
// becomes infinity, small values become fp16 subnormals. Back to float is exact.
DP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}
DP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

DP_HD uint16_t to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN, kept quiet
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // the carry rounds up, ties to the even half
}
DP_HD float from_bf16(uint16_t h) { return bits_float(uint32_t(h) << 16); }

// After F. Giesen's float_to_half_fast3_rtne and half_to_float (public domain): subnormals are
// rounded, and widened, by one float addition or subtraction at a magic constant, exactly.
DP_HD uint16_t to_fp16(float f) {
  uint32_t u = float_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t h;
  if (u >= (127u + 16u) << 23) {              // 65536 or more, infinity, NaN
    h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;  // a quiet NaN, or infinity
  } else if (u < (127u - 14u) << 23) {        // below fp16's smallest normal, 2^-14: a subnormal or 0
    const float denorm_magic = bits_float(((127u - 15u) + (23u - 10u) + 1u) << 23);  // 0.5: its ulp is fp16's 2^-24
    h = float_bits(bits_float(u) + denorm_magic) - float_bits(denorm_magic);
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu + odd;  // rebias, then round: 65520 and up carries into infinity
    h = u >> 13;
  }
  return uint16_t(h | (sign >> 16));
}
DP_HD float from_fp16(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (uint32_t(h) & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  if (exp == shifted_exp) {
    o += (128u - 16u) << 23;  // infinity or NaN
  } else if (exp == 0) {      // zero or a subnormal: renormalised by one exact subtraction
    o += 1u << 23;
    o = float_bits(bits_float(o) - bits_float(113u << 23));
  }
  return bits_float(o | ((uint32_t(h) & 0x8000u) << 16));
}

// A float as the 16-bit type t holds it (t is bf16 or fp16), and back.
DP_HD uint16_t narrow(DType t, float f) { return t == DType::bf16 ? to_bf16(f) : to_fp16(f); }
DP_HD float widen(DType t, uint16_t h) { return t == DType::bf16 ? from_bf16(h) : from_fp16(h); }
// The reduction's add in a 16-bit type: the exact sum of two values of the type fits a float (or lies
// within a quarter of the result's ulp of a float rounding of it), so one float addition and one
// rounding give the correctly rounded sum of the type: what NCCL's sum of two bf16 or fp16 values
// gives, a partial sum rounded to the type at every step.
DP_HD uint16_t add16(DType t, uint16_t x, uint16_t y) { return narrow(t, widen(t, x) + widen(t, y)); }

}  // namespace dp::math
