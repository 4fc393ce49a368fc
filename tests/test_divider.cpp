// cuda::Divider, the CUDA layout kernels' division by a multiply-high and a shift
// (kernels/cuda/divider.h), against the C++ `/` and `%`. The header is plain C++ outside nvcc, and
// the device's __umulhi gives the same high word as the host's 64-bit product, so the host checks
// the arithmetic the GPU runs.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cuda/divider.h"

namespace dp::test {
namespace {

void check_divides(int d, int n) {
  const cuda::Divider by(d);
  int q = -1, r = -1;
  by.divmod(n, q, r);
  if (q == n / d && r == n % d && by.mod(n) == r) return;  // one CHECK per failure, not per division (millions)
  FAIL_CHECK(n << " / " << d << ": " << q << " remainder " << r << " (mod " << by.mod(n) << "), not " << n / d
               << " remainder " << n % d);
}

TEST_CASE("Divider: n / d and n % d for every divisor and dividend edge, and at random") {
  constexpr int kMax = INT32_MAX;
  std::vector<int> divisors = {1, 2, 3, 5, 6, 7, 9, 13, 25, 26, 81, 169, 500, 676, 641, 6700417, kMax - 1, kMax};
  for (int s = 1; s < 31; ++s) divisors.insert(divisors.end(), {(1 << s) - 1, 1 << s, (1 << s) + 1});
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> any(1, kMax);
  for (int i = 0; i < 2000; ++i) divisors.push_back(any(gen));
  for (int d : divisors) {
    CHECK(cuda::Divider(d).divisor() == d);
    // around 0, around multiples of d (where a wrong rounding would show), and up to 2^31 - 1
    for (int n : {0, 1, 2, d - 1, d, kMax - 1, kMax})
      if (n >= 0) check_divides(d, n);
    for (int64_t m : {int64_t(2), int64_t(3), int64_t(1000), int64_t(kMax) / d})
      for (int64_t e : {int64_t(-1), int64_t(0), int64_t(1)})
        if (const int64_t n = m * d + e; n >= 0 && n <= kMax) check_divides(d, int(n));
    for (int i = 0; i < 200; ++i) check_divides(d, any(gen) - 1);
  }
  // every dividend below 2^16 by the small divisors the kernels see (image sizes, kernel taps)
  for (int d = 1; d <= 64; ++d)
    for (int n = 0; n < 1 << 16; ++n) check_divides(d, n);
}

TEST_CASE("Divider: a divisor below 1 is refused") {
  CHECK_THROWS_AS(cuda::Divider(0), std::invalid_argument);
  CHECK_THROWS_AS(cuda::Divider(-3), std::invalid_argument);
}

}  // namespace
}  // namespace dp::test
