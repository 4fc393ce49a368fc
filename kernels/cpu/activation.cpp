// ReLU and sigmoid, forward and backward, through the shared per-element math.
#include "kernels/cpu/kernels.h"
#include "kernels/math.h"

namespace dp::cpu {

template <class T>
void activation_forward(Activation a, int64_t n, const T* x, T* y) {
  if (a == Activation::relu)
    for (int64_t i = 0; i < n; ++i) y[i] = math::relu(x[i]);
  else
    for (int64_t i = 0; i < n; ++i) y[i] = math::sigmoid(x[i]);
}

template <class T>
void activation_backward(Activation a, int64_t n, const T* y, const T* dy, T* dx) {
  if (a == Activation::relu)
    for (int64_t i = 0; i < n; ++i) dx[i] = math::relu_grad(y[i], dy[i]);
  else
    for (int64_t i = 0; i < n; ++i) dx[i] = math::sigmoid_grad(y[i], dy[i]);
}

#define DP_INSTANTIATE(T)                                                 \
  template void activation_forward<T>(Activation, int64_t, const T*, T*); \
  template void activation_backward<T>(Activation, int64_t, const T*, const T*, T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
