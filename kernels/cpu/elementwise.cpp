// SGD, the reduction add, fill and the finiteness check over flat buffers.
#include <cmath>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"

namespace dp::cpu {

template <class T>
void sgd_step(int64_t n, T* w, const T* g, T* v, T lr, T momentum, T weight_decay) {
  if (!v) {  // momentum 0: no buffer (the optimizer category stays empty)
    T none = T(0);
    for (int64_t i = 0; i < n; ++i) math::sgd_update(w[i], none, g[i], lr, T(0), weight_decay);
    return;
  }
  for (int64_t i = 0; i < n; ++i) math::sgd_update(w[i], v[i], g[i], lr, momentum, weight_decay);
}

template <class T>
void add(int64_t n, const T* x, T* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <class T>
void fill(int64_t n, T value, T* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

template <class T>
bool all_finite(int64_t n, const T* x) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

template <class T>
void flag_nonfinite(int64_t n, const T* x, T* flag) {
  if (!all_finite(n, x)) *flag = T(1);
}

#define DP_INSTANTIATE(T)                                        \
  template void sgd_step<T>(int64_t, T*, const T*, T*, T, T, T); \
  template void add<T>(int64_t, const T*, T*);                   \
  template void fill<T>(int64_t, T, T*);                         \
  template bool all_finite<T>(int64_t, const T*);                \
  template void flag_nonfinite<T>(int64_t, const T*, T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
