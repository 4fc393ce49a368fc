// A finite-difference gradient checker in the style of Caffe's test_gradient_check_util.hpp: central
// differences of a scalar objective, compared coordinate by coordinate with an analytic gradient at
// the relative scale max(|analytic|, |numeric|, 1), skipping coordinates whose perturbation crosses a
// kink (ReLU at 0, a change of max-pool winner). Run in double on the CPU reference kernels.
//
// Step and tolerance (double, u = 2^-53 ~ 1.1e-16). The central difference of L along x_i is
//   (L(x + h e_i) - L(x - h e_i)) / 2h = dL/dx_i + (h^2 / 6) d^3L/dx_i^3 + O(eps_L / h),
// where eps_L is the rounding error of one evaluation of L. With eps_L ~ 1e-15 |L| (a few ulps after
// the reductions of a small layer or a LeNet forward pass), the two error terms balance at
// h ~ (3 eps_L / |L'''|)^(1/3) ~ 1e-5, the step used here. Then
//   truncation  h^2/6 |L'''| ~ 1.7e-11 |L'''|   (exactly 0 for conv, linear and the pools, which are
//                                                linear in each single coordinate)
//   rounding    eps_L / h    ~ 1e-10 |L|
// so with |L| and |L'''| below ~100 for the objectives in these tests the error is below ~1e-8 on the
// scale max(|a|, |n|, 1). kTolerance = 1e-6 leaves a factor 100 of margin for those estimates and still
// catches a 1% error in any gradient component of magnitude above 1e-4 (test_gradcheck_model.cpp asserts that
// a gradient scaled by 1.01 fails). Measured (with OpenBLAS, before BLIS; x86-64): at most 2e-9 over the layer checks
// (conv, the largest sums), 4e-11 over the whole-model checks.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace dp::test {

// n doubles drawn uniformly from [lo, hi), and n zeros: the checks' data.
inline std::vector<double> uniform(int64_t n, double lo, double hi, std::mt19937_64& gen) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(size_t(n), 0.0);
  for (auto& x : v) x = d(gen);
  return v;
}
inline std::vector<double> zeros(int64_t n) { return std::vector<double>(size_t(n), 0.0); }
// The objective of a linear loss sum(w * y): its gradient with respect to y is w.
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline constexpr double kStep = 1e-5;
inline constexpr double kTolerance = 1e-6;

// The numeric derivative along one coordinate.
struct Probe {
  int64_t index = 0;
  double numeric = 0;
  bool kink = false;  // skipped: the perturbation crosses a kink
};

// Central differences dL/dx_i for each i in `coords`. objective() evaluates L at the current x; x is
// perturbed in place and restored bit for bit. Two ways to detect a kink:
//   at_kink(i), asked before perturbing: Caffe's test, from the layer's input (|x_i| < h for ReLU).
//   region(), asked after each evaluation: names the linear piece the point lies in (e.g. a hash of
//   every ReLU mask in a network); the coordinate is skipped when x + h and x - h lie in different
//   pieces, which is exact where a per-coordinate test cannot see through the layers above.
inline std::vector<Probe> numeric_gradient(double* x, const std::vector<int64_t>& coords, double step,
                                           const std::function<double()>& objective,
                                           const std::function<bool(int64_t)>& at_kink = {},
                                           const std::function<uint64_t()>& region = {}) {
  std::vector<Probe> probes;
  probes.reserve(coords.size());
  for (int64_t i : coords) {
    Probe p{i, 0.0, at_kink && at_kink(i)};
    if (!p.kink) {
      const double old = x[i];
      const double plus = old + step, minus = old - step;
      x[i] = plus;
      const double f_plus = objective();
      const uint64_t r_plus = region ? region() : 0;
      x[i] = minus;
      const double f_minus = objective();
      const uint64_t r_minus = region ? region() : 0;
      x[i] = old;
      p.kink = r_plus != r_minus;
      // Divide by the step as represented (plus - minus), not 2h: removes the O(u |x| / h) error of
      // rounding old +- h.
      p.numeric = (f_plus - f_minus) / (plus - minus);
    }
    probes.push_back(p);
  }
  return probes;
}

inline std::vector<int64_t> all_coords(int64_t n) {
  std::vector<int64_t> v(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
}

struct GradCheckResult {
  int64_t checked = 0, skipped = 0, failed = 0;
  double max_error = 0;  // max of |a - n| / max(|a|, |n|, 1) over the checked coordinates
  std::string failures;  // the first few mismatches, one per line
};

// Compares analytic[probe.index] with each probe's numeric derivative.
inline GradCheckResult compare_gradient(const double* analytic, const std::vector<Probe>& probes, double tol) {
  GradCheckResult r;
  std::ostringstream first;
  first.precision(10);
  for (const Probe& p : probes) {
    if (p.kink) {
      ++r.skipped;
      continue;
    }
    ++r.checked;
    const double a = analytic[p.index], n = p.numeric;
    const double scale = std::max({std::fabs(a), std::fabs(n), 1.0});
    const double err = std::fabs(a - n) / scale;
    r.max_error = std::max(r.max_error, err);
    if (!(err <= tol)) {  // NaN fails too
      if (r.failed < 5) first << "  [" << p.index << "] analytic " << a << " numeric " << n << "\n";
      ++r.failed;
    }
  }
  r.failures = first.str();
  return r;
}

// The usual test: every coordinate in `coords` (all of them by default) must match, and at least
// one must have been checked rather than skipped.
inline GradCheckResult check_gradient(const std::string& what, double* x, int64_t size, const double* analytic,
                                      const std::function<double()>& objective,
                                      const std::function<bool(int64_t)>& at_kink = {},
                                      std::vector<int64_t> coords = {}) {
  if (coords.empty()) coords = all_coords(size);
  GradCheckResult r = compare_gradient(analytic, numeric_gradient(x, coords, kStep, objective, at_kink), kTolerance);
  INFO(what << ": checked " << r.checked << ", skipped " << r.skipped << ", max error " << r.max_error << "\n"
            << r.failures);
  CHECK(r.checked > 0);
  CHECK(r.failed == 0);
  return r;
}

}  // namespace dp::test
