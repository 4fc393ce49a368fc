// BatchNorm (PyTorch's BatchNorm1d/2d, affine) on (N, C, HW) tensors: the channel sums behind the
// batch statistics and the two gradients, the normalisation, the running statistics. The engine
// composes them (mean = sum / count, var = sum of squared deviations / count), with an all-reduce of
// the sums between them for SyncBatchNorm.
//
// The sums accumulate in double whatever T, one channel at a time, samples then positions in order:
// deterministic, and for float inputs within about one float rounding of the exact sum (the terms
// themselves are exact in double: a difference of two floats and its square fit in 53 bits).
#include <stdexcept>
#include <string>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"

namespace dp::cpu {
namespace {
using Acc = double;  // the channel sums' accumulator
}  // namespace

template <class T>
void bn_channel_sums(int n, int c, int hw, const T* x, const T* mean, T scale, T* out) {
  for (int ch = 0; ch < c; ++ch) {
    const Acc m = mean ? Acc(mean[ch]) : Acc(0);
    Acc acc = 0;
    for (int i = 0; i < n; ++i) {
      const T* xp = x + (int64_t(i) * c + ch) * hw;  // (HW)
      for (int p = 0; p < hw; ++p) acc += math::bn_sum_term(Acc(xp[p]), m, mean != nullptr);
    }
    out[ch] = T(acc * Acc(scale));
  }
}

template <class T>
void bn_normalize(int n, int c, int hw, const T* x, const T* mean, const T* var, const T* gamma, const T* beta, T eps,
                  T* y) {
  for (int i = 0; i < n; ++i)
    for (int ch = 0; ch < c; ++ch) {
      const int64_t at = (int64_t(i) * c + ch) * hw;
      const T inv_std = math::bn_inv_std(var[ch], eps);
      for (int p = 0; p < hw; ++p) y[at + p] = math::bn_normalize(x[at + p], mean[ch], inv_std, gamma[ch], beta[ch]);
    }
}

template <class T>
void bn_backward_sums(int n, int c, int hw, const T* x, const T* mean, const T* var, T eps, const T* dy, T* sums) {
  for (int ch = 0; ch < c; ++ch) {
    const Acc m = mean[ch], inv_std = math::bn_inv_std(Acc(var[ch]), Acc(eps));
    Acc sum_dy = 0, sum_dy_xhat = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t at = (int64_t(i) * c + ch) * hw;
      for (int p = 0; p < hw; ++p) {
        const Acc g = dy[at + p];
        sum_dy += g;
        sum_dy_xhat += g * math::bn_xhat(Acc(x[at + p]), m, inv_std);
      }
    }
    sums[ch] = T(sum_dy);           // d beta
    sums[c + ch] = T(sum_dy_xhat);  // d gamma
  }
}

template <class T>
void bn_backward_dx(int n, int c, int hw, const T* x, const T* mean, const T* var, T eps, const T* gamma, const T* dy,
                    const T* sums, int64_t count, T* dx) {
  if (count < 1) throw std::invalid_argument("bn_backward_dx: count " + std::to_string(count) + " < 1");
  for (int i = 0; i < n; ++i)
    for (int ch = 0; ch < c; ++ch) {
      const int64_t at = (int64_t(i) * c + ch) * hw;
      const T inv_std = math::bn_inv_std(var[ch], eps);
      const T mean_dy = math::bn_mean_of(sums[ch], count), mean_dy_xhat = math::bn_mean_of(sums[c + ch], count);
      for (int p = 0; p < hw; ++p)
        dx[at + p] = math::bn_backward_dx(x[at + p], mean[ch], inv_std, gamma[ch], dy[at + p], mean_dy, mean_dy_xhat);
    }
}

template <class T>
void bn_update_running(int c, const T* mean, const T* var, int64_t count, T momentum, T* running_mean, T* running_var) {
  if (count < 2)
    throw std::invalid_argument("bn_update_running: count " + std::to_string(count) +
                                ": expected more than 1 value per channel when training (PyTorch's rule)");
  for (int ch = 0; ch < c; ++ch)
    math::bn_update_running(running_mean[ch], running_var[ch], mean[ch], var[ch], count, momentum);
}

#define DP_INSTANTIATE(T)                                                                                       \
  template void bn_channel_sums<T>(int, int, int, const T*, const T*, T, T*);                                   \
  template void bn_normalize<T>(int, int, int, const T*, const T*, const T*, const T*, const T*, T, T*);        \
  template void bn_backward_sums<T>(int, int, int, const T*, const T*, const T*, T, const T*, T*);              \
  template void bn_backward_dx<T>(int, int, int, const T*, const T*, const T*, T, const T*, const T*, const T*, \
                                  int64_t, T*);                                                                 \
  template void bn_update_running<T>(int, const T*, const T*, int64_t, T, T*, T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
