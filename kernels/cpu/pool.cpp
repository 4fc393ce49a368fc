// Average and max pooling with a k x k window and stride k (PyTorch's defaults for both).
#include <algorithm>

#include "kernels/cpu/kernels.h"

namespace dp::cpu {

template <class T>
void avgpool_forward(const PoolShape& s, const T* x, T* y) {
  const int oh = s.out_h(), ow = s.out_w();
  const T inv = T(1) / T(s.k * s.k);
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const T* xp = x + p * s.h * s.w;  // (H, W)
    T* yp = y + p * oh * ow;          // (OH, OW)
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        T acc = T(0);
        for (int a = 0; a < s.k; ++a)
          for (int b = 0; b < s.k; ++b) acc += xp[(i * s.k + a) * s.w + j * s.k + b];
        yp[i * ow + j] = acc * inv;
      }
  }
}

template <class T>
void avgpool_backward(const PoolShape& s, const T* dy, T* dx) {
  const int oh = s.out_h(), ow = s.out_w();
  const T inv = T(1) / T(s.k * s.k);
  std::fill_n(dx, int64_t(s.n) * s.c * s.h * s.w, T(0));  // rows/cols past oh*k stay zero
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const T* dyp = dy + p * oh * ow;  // (OH, OW)
    T* dxp = dx + p * s.h * s.w;      // (H, W)
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        T g = dyp[i * ow + j] * inv;
        for (int a = 0; a < s.k; ++a)
          for (int b = 0; b < s.k; ++b) dxp[(i * s.k + a) * s.w + j * s.k + b] = g;
      }
  }
}

template <class T>
void maxpool_forward(const PoolShape& s, const T* x, T* y, int32_t* argmax) {
  const int oh = s.out_h(), ow = s.out_w();
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const T* xp = x + p * s.h * s.w;  // (H, W)
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        int best = (i * s.k) * s.w + j * s.k;
        for (int a = 0; a < s.k; ++a)
          for (int b = 0; b < s.k; ++b) {
            int idx = (i * s.k + a) * s.w + j * s.k + b;
            if (xp[idx] > xp[best]) best = idx;  // first maximum wins, as in PyTorch
          }
        y[p * oh * ow + i * ow + j] = xp[best];
        argmax[p * oh * ow + i * ow + j] = best;
      }
  }
}

template <class T>
void maxpool_backward(const PoolShape& s, const T* dy, const int32_t* argmax, T* dx) {
  const int64_t outs = int64_t(s.out_h()) * s.out_w();
  std::fill_n(dx, int64_t(s.n) * s.c * s.h * s.w, T(0));
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p)
    for (int64_t o = 0; o < outs; ++o) dx[p * s.h * s.w + argmax[p * outs + o]] += dy[p * outs + o];
}

#define DP_INSTANTIATE(T)                                                     \
  template void avgpool_forward<T>(const PoolShape&, const T*, T*);           \
  template void avgpool_backward<T>(const PoolShape&, const T*, T*);          \
  template void maxpool_forward<T>(const PoolShape&, const T*, T*, int32_t*); \
  template void maxpool_backward<T>(const PoolShape&, const T*, const int32_t*, T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
