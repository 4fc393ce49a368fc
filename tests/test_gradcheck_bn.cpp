// Finite-difference gradient checks of BatchNorm in training mode, in double on the CPU reference
// kernels (tests/gradcheck.h derives the step and the tolerance): the forward composed as the engine
// composes it (channel sums -> mean, squared-deviation sums -> biased variance, normalize) under
// L = sum(y * r) for a fixed random r; every input gradient from bn_backward_sums + bn_backward_dx,
// and gamma's and beta's (the two sums). Then SyncBatchNorm's composition: the batch split over
// replicas, each summing its shard, the sums added as the all-reduce would, the global count.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"
#include "tests/gradcheck.h"

namespace dp::test {
namespace {

using DVec = std::vector<double>;

constexpr double kEps = 1e-5;

// One BatchNorm layer (N, C, HW) with its data: x with a different offset per channel, gamma of both
// signs, beta, and the loss weights r.
struct BnLayer {
  int n, c, hw;
  DVec x, gamma, beta, r;
  BnLayer(int n_, int c_, int hw_, uint64_t seed) : n(n_), c(c_), hw(hw_) {
    std::mt19937_64 gen(seed);
    x = uniform(size(), -1, 1, gen);  // (N, C, HW)
    const DVec offset = uniform(c, -2, 2, gen);
    for (int64_t i = 0; i < size(); ++i) x[size_t(i)] += offset[size_t(i / hw % c)];
    gamma = uniform(c, 0.5, 1.5, gen);  // (C)
    gamma[0] = -gamma[0];
    beta = uniform(c, -1, 1, gen);    // (C)
    r = uniform(size(), -1, 1, gen);  // (N, C, HW)
  }
  int64_t size() const { return int64_t(n) * c * hw; }
  int64_t count() const { return int64_t(n) * hw; }
};

// The training forward over replicas (shards of the batch along N, `split` samples each but the
// last), the channel sums added across them as SyncBatchNorm's all-reduce adds them: mean (C) and
// the biased var (C) over the whole batch, y (N, C, HW). split = n: one replica.
void forward(const BnLayer& l, int split, DVec& mean, DVec& var, DVec& y) {
  const int64_t shard = int64_t(split) * l.c * l.hw;  // elements per full shard
  DVec part(size_t(l.c));
  mean.assign(size_t(l.c), 0.0), var.assign(size_t(l.c), 0.0);
  for (int first = 0; first < l.n; first += split) {  // sums of x
    const int rows = std::min(split, l.n - first);
    cpu::bn_channel_sums<double>(rows, l.c, l.hw, l.x.data() + first / split * shard, nullptr, 1.0, part.data());
    for (int ch = 0; ch < l.c; ++ch) mean[ch] += part[ch];
  }
  for (int ch = 0; ch < l.c; ++ch) mean[ch] = math::bn_mean_of(mean[ch], l.count());
  for (int first = 0; first < l.n; first += split) {  // sums of squared deviations
    const int rows = std::min(split, l.n - first);
    cpu::bn_channel_sums<double>(rows, l.c, l.hw, l.x.data() + first / split * shard, mean.data(), 1.0, part.data());
    for (int ch = 0; ch < l.c; ++ch) var[ch] += part[ch];
  }
  for (int ch = 0; ch < l.c; ++ch) var[ch] = math::bn_mean_of(var[ch], l.count());
  y.assign(size_t(l.size()), 0.0);
  cpu::bn_normalize<double>(l.n, l.c, l.hw, l.x.data(), mean.data(), var.data(), l.gamma.data(), l.beta.data(), kEps,
                            y.data());
}

// The backward over the same replicas: each shard's sums (2, C) added, then each shard's dx from the
// global sums and `count`. Returns dx (N, C, HW); sums gets d beta ([0]) and d gamma ([1]).
DVec backward(const BnLayer& l, int split, const DVec& mean, const DVec& var, int64_t count, DVec& sums) {
  const int64_t shard = int64_t(split) * l.c * l.hw;
  DVec part(2 * size_t(l.c)), dx(size_t(l.size()));
  sums.assign(2 * size_t(l.c), 0.0);
  for (int first = 0; first < l.n; first += split) {
    const int rows = std::min(split, l.n - first);
    const int64_t at = first / split * shard;
    cpu::bn_backward_sums<double>(rows, l.c, l.hw, l.x.data() + at, mean.data(), var.data(), kEps, l.r.data() + at,
                                  part.data());
    for (size_t i = 0; i < sums.size(); ++i) sums[i] += part[i];
  }
  for (int first = 0; first < l.n; first += split) {
    const int rows = std::min(split, l.n - first);
    const int64_t at = first / split * shard;
    cpu::bn_backward_dx<double>(rows, l.c, l.hw, l.x.data() + at, mean.data(), var.data(), kEps, l.gamma.data(),
                                l.r.data() + at, sums.data(), count, dx.data() + at);
  }
  return dx;
}

void check_layer(int n, int c, int hw, uint64_t seed, int split) {
  CAPTURE(n);
  CAPTURE(c);
  CAPTURE(hw);
  CAPTURE(split);
  BnLayer l(n, c, hw, seed);
  DVec mean, var, y;
  forward(l, split, mean, var, y);
  DVec sums;
  const DVec dx = backward(l, split, mean, var, l.count(), sums);
  const DVec dbeta(sums.begin(), sums.begin() + c), dgamma(sums.begin() + c, sums.end());
  // The objective is the whole batch on one replica: the split must not change the gradient.
  auto objective = [&] {
    DVec m, v, out;
    forward(l, n, m, v, out);
    return dot(out, l.r);
  };
  check_gradient("batchnorm dx", l.x.data(), l.size(), dx.data(), objective);
  check_gradient("batchnorm dgamma", l.gamma.data(), c, dgamma.data(), objective);
  check_gradient("batchnorm dbeta", l.beta.data(), c, dbeta.data(), objective);
}

TEST_CASE("gradcheck: batchnorm dx, dgamma, dbeta in training mode") {
  check_layer(4, 3, 1, 80, 4);   // BatchNorm1d on (N, C)
  check_layer(7, 5, 1, 81, 7);   // odd sizes
  check_layer(2, 3, 5, 82, 2);   // BatchNorm2d, n = 2
  check_layer(3, 2, 12, 83, 3);  // more positions than samples
  check_layer(1, 4, 9, 84, 1);   // one image: the statistics over its positions alone
}

TEST_CASE("gradcheck: SyncBatchNorm's composition, shards with added sums and the global count") {
  check_layer(5, 3, 1, 90, 2);  // replicas of 2, 2 and 1 samples
  check_layer(6, 2, 4, 91, 3);  // 2 replicas
  check_layer(4, 3, 6, 92, 1);  // 4 replicas of one image
}

TEST_CASE("gradcheck: batchnorm's check is sharp: a shard's local count instead of the global one fails") {
  BnLayer l(6, 2, 4, 93);
  DVec mean, var, y, sums;
  forward(l, 3, mean, var, y);
  const DVec dx = backward(l, 3, mean, var, int64_t(3) * l.hw, sums);  // one shard's count: wrong
  auto objective = [&] {
    DVec m, v, out;
    forward(l, l.n, m, v, out);
    return dot(out, l.r);
  };
  CHECK(compare_gradient(dx.data(), numeric_gradient(l.x.data(), all_coords(l.size()), kStep, objective), kTolerance)
            .failed > 0);
}

}  // namespace
}  // namespace dp::test
