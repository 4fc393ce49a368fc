// The tests' float tolerances, derived in one place (the engine's own bound for --verify is
// summation_tolerance in train/verify.h).
//
// u = 2^-24 is float's unit roundoff: one rounding moves a value by at most u of itself. A float sum
// of k terms, each a product, evaluated in any order (any tree of additions, with or without FMA),
// differs from the exact sum by at most gamma(k) * sum |terms| with gamma(k) = k u / (1 - k u)
// (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 3.1 and 3.5). The bound is a worst
// case, so it cannot fail by bad luck, and it is computed element by element from that element's own
// sum of |terms|, so an indexing mistake (an error of the order of the value itself) exceeds it by
// orders of magnitude. Oracles run in double on the same float inputs: their own error, about
// k 2^-53 of the same sums, is 2^-29 of the float bound and left out.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace dp::test {

inline constexpr double kU = 0x1p-24;

inline double gamma(double k) { return k * kU / (1 - k * kU); }

// gamma(k) * abs_sum[i] for every element: the tolerance of a k-rounding sum against its exact value.
inline std::vector<double> gamma_bound(double k, const std::vector<double>& abs_sum) {
  std::vector<double> t(abs_sum.size());
  for (size_t i = 0; i < t.size(); ++i) t[i] = gamma(k) * abs_sum[i];
  return t;
}

// Mixed tolerance per element (llm.c's validate_result): |got[i] - want[i]| <= tol[i], NaN failing.
// Reports the first mismatches and the element that uses the largest share of its tolerance.
inline void check_close(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                        const std::vector<double>& tol) {
  REQUIRE(got.size() == want.size());
  REQUIRE(tol.size() == want.size());
  size_t bad = 0, worst_at = 0;
  double worst = 0;  // as a fraction of the tolerance
  std::ostringstream first;
  first.precision(9);
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    const double share = tol[i] > 0 ? err / tol[i] : (err > 0 ? INFINITY : 0);
    if (!(share <= worst)) worst = share, worst_at = i;  // NaN lands here too
    if (!(err <= tol[i]) && bad++ < 5)
      first << "\n  [" << i << "] got " << got[i] << ", want " << want[i] << ", |diff| " << err << " > " << tol[i];
  }
  INFO(what << ": worst element " << worst_at << " uses " << worst << " of its tolerance" << first.str());
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << want.size() << " elements outside the tolerance");
}

inline void check_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                        const std::vector<double>& tol) {
  check_close(what, got, std::vector<double>(want.begin(), want.end()), tol);
}

// Equal values: == element by element, so +0 equals -0 and a NaN never matches.
inline void check_equal(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  check_close(what, got, want, std::vector<double>(want.size(), 0.0));
}

// The same bits, except that any NaN matches any NaN (devices differ in NaN payloads, never in
// whether a result is NaN).
inline void check_same_bits(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0;
  std::ostringstream first;
  first.precision(9);
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ < 5)
      first << "\n  [" << i << "] got " << got[i] << ", want " << want[i];
  }
  INFO(what << first.str());
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << want.size() << " elements differ in their bits");
}

}  // namespace dp::test
