// SGD, Adam, the reduction add, fill and the finiteness check over flat buffers; --grad-dtype's
// conversions and its add in 16 bits.
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"

namespace dp::cpu {

namespace {

// An element is not finite when its exponent bits are all ones. Tested on the bits and OR-ed without
// a branch, so the loops vectorize: an early-exit isfinite loop over LeNet's 129,068 gradients ran at
// a scalar's pace (107 us, dp_bench ops).
template <class T>
auto nonfinite_bit(T x) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U exponent = sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  return U((std::bit_cast<U>(x) & exponent) == exponent);
}

template <class T>
void raise_if(bool bad, T* flag) {
  if (bad && flag) *flag = T(1);
}

}  // namespace

// The optimizers read each gradient once, for the update and for the finiteness check.
template <class T>
void sgd_step(int64_t n, T* w, const T* g, T* v, T lr, T momentum, T weight_decay, T* nonfinite) {
  decltype(nonfinite_bit(T(0))) bad = 0;
  if (!v) {  // momentum 0: no buffer (the optimizer category stays empty)
    T none = T(0);
    for (int64_t i = 0; i < n; ++i) {
      bad |= nonfinite_bit(g[i]);
      math::sgd_update(w[i], none, g[i], lr, T(0), weight_decay);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      bad |= nonfinite_bit(g[i]);
      math::sgd_update(w[i], v[i], g[i], lr, momentum, weight_decay);
    }
  }
  raise_if(bad != 0, nonfinite);
}

template <class T>
void adam_step(int64_t n, T* w, const T* g, T* m, T* v, const math::AdamStep& s, T* nonfinite) {
  decltype(nonfinite_bit(T(0))) bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad |= nonfinite_bit(g[i]);
    math::adam_update(w[i], m[i], v[i], g[i], s);
  }
  raise_if(bad != 0, nonfinite);
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
  decltype(nonfinite_bit(T(0))) bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= nonfinite_bit(x[i]);
  return bad == 0;
}

// Left to right, in double: the CPU's sum is as exact as the data allows.
template <class T>
void sum_squares(int64_t n, const T* x, T* sum) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  *sum += T(s);
}

template <class T>
void clip_scale(int64_t n, const T* sum_squares, T max_norm, T* x) {
  const T c = math::clip_coefficient(*sum_squares, max_norm);
  for (int64_t i = 0; i < n; ++i) x[i] *= c;
}

void narrow(DType t, int64_t n, const float* x, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = math::narrow(t, x[i]);
}

void widen(DType t, int64_t n, const uint16_t* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = math::widen(t, x[i]);
}

void add_typed(DType t, int64_t n, const uint16_t* x, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = math::add16(t, x[i], y[i]);
}

#define DP_INSTANTIATE(T)                                                               \
  template void sum_squares<T>(int64_t, const T*, T*);                                  \
  template void clip_scale<T>(int64_t, const T*, T, T*);                                \
  template void sgd_step<T>(int64_t, T*, const T*, T*, T, T, T, T*);                    \
  template void adam_step<T>(int64_t, T*, const T*, T*, T*, const math::AdamStep&, T*); \
  template void add<T>(int64_t, const T*, T*);                                          \
  template void fill<T>(int64_t, T, T*);                                                \
  template bool all_finite<T>(int64_t, const T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
