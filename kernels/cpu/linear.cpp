// nn.Linear: y = x W^T + b, W stored (out, in).
#include <algorithm>

#include "kernels/cpu/kernels.h"

namespace dp::cpu {

template <class T>
void linear_forward(int n, int in, int out, const T* x, const T* w, const T* b, T* y) {
  for (int i = 0; i < n; ++i) std::copy_n(b, out, y + int64_t(i) * out);  // (N, OUT)
  gemm(false, true, n, out, in, T(1), x, w, T(1), y);                     // y += x W^T
}

template <class T>
void linear_backward(int n, int in, int out, const T* x, const T* w, const T* dy, T* dx, T* dw, T* db) {
  gemm(true, false, out, in, n, T(1), dy, x, T(0), dw);  // (OUT, IN) = dy^T x
  for (int o = 0; o < out; ++o) db[o] = T(0);
  for (int i = 0; i < n; ++i)
    for (int o = 0; o < out; ++o) db[o] += dy[int64_t(i) * out + o];
  if (dx) gemm(false, false, n, in, out, T(1), dy, w, T(0), dx);  // (N, IN) = dy W
}

#define DP_INSTANTIATE(T)                                                           \
  template void linear_forward<T>(int, int, int, const T*, const T*, const T*, T*); \
  template void linear_backward<T>(int, int, int, const T*, const T*, const T*, T*, T*, T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
