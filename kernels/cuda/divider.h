// Division by a number fixed at launch, as a multiply-high, an add and a shift (Granlund and
// Montgomery, "Division by invariant integers using multiplication", 1994; PyTorch's IntDivider in
// ATen/cuda/detail/IntegerDivider.cuh is the same): a GPU has no integer divider, and the index
// arithmetic of the layout kernels (which pixel, which channel, which tap) divides by runtime sizes,
// about twenty instructions each way. Made on the host, passed by value, used on the device.
//
// Exact for 0 <= n < 2^31 and 1 <= d < 2^31 (tests/test_divider.cpp checks it against `/` over the
// edges and at random): with s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1,
// n / d = (mulhi(n, m) + n) >> s, and mulhi(n, m) + n < 2^32 for such n.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define DP_DIVIDER_HD __host__ __device__ __forceinline__
#else
#define DP_DIVIDER_HD inline
#endif

namespace dp::cuda {

class Divider {
 public:
  Divider() = default;
  explicit Divider(int d) : d_(uint32_t(d)) {
    if (d < 1) throw std::invalid_argument("Divider: the divisor must be at least 1, not " + std::to_string(d));
    while (shift_ < 32 && (uint64_t(1) << shift_) < d_) ++shift_;
    magic_ = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift_) - d_)) / d_ + 1);
  }
  DP_DIVIDER_HD int divisor() const { return int(d_); }
  // n / d, for 0 <= n < 2^31
  DP_DIVIDER_HD int div(int n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(uint32_t(n), magic_);
#else
    const uint32_t hi = uint32_t((uint64_t(uint32_t(n)) * magic_) >> 32);
#endif
    return int((hi + uint32_t(n)) >> shift_);
  }
  // n % d
  DP_DIVIDER_HD int mod(int n) const { return n - div(n) * int(d_); }
  // n / d and n % d
  DP_DIVIDER_HD void divmod(int n, int& q, int& r) const {
    q = div(n);
    r = n - q * int(d_);
  }

 private:
  uint32_t d_ = 1, magic_ = 1, shift_ = 0;
};

}  // namespace dp::cuda
