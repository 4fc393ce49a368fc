// The BLAS under the CPU kernels (BLIS, the serial build) as the simulated devices use it: many
// device threads calling GEMM at once, and a memory limit that its buffers may not fit in. OpenBLAS,
// which dp used before, spun forever in both (its buffer allocator retries a failed mmap without
// end); these tests are bounded, so a BLAS that hangs fails them instead of hanging ctest.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "util.h"

using namespace dp;
using namespace dp::test;

namespace {

// C = op(A) op(B) by the definition, in double: the oracle for one GEMM call.
template <class T>
std::vector<double> plain_gemm(bool ta, bool tb, int m, int n, int k, const std::vector<T>& a,
                               const std::vector<T>& b) {
  std::vector<double> c(size_t(m) * n, 0.0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p)
        s += double(ta ? a[size_t(p) * m + i] : a[size_t(i) * k + p]) *
             double(tb ? b[size_t(j) * k + p] : b[size_t(p) * n + j]);
      c[size_t(i) * n + j] = s;
    }
  return c;
}

// One thread's share: `calls` GEMMs of random shapes (up to 160, so BLIS packs and blocks) and
// transpositions, each checked against plain_gemm; returns how many disagreed.
template <class T>
int gemm_calls(uint32_t seed, int calls) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dim(1, 160);
  std::uniform_real_distribution<float> val(-1, 1);
  int wrong = 0;
  for (int call = 0; call < calls; ++call) {
    const int m = dim(gen), n = dim(gen), k = dim(gen);
    const bool ta = gen() & 1, tb = gen() & 1;
    std::vector<T> a(size_t(m) * k), b(size_t(k) * n), c(size_t(m) * n);
    for (auto& v : a) v = T(val(gen));
    for (auto& v : b) v = T(val(gen));
    cpu::gemm<T>(ta, tb, m, n, k, T(1), a.data(), b.data(), T(0), c.data());
    const std::vector<double> want = plain_gemm(ta, tb, m, n, k, a, b);
    // Terms of magnitude <= 1: a float sum of k of them is off by at most ~k * eps.
    const double tol = k * (sizeof(T) == 4 ? 1.2e-7 : 2.3e-16) * 4;
    for (size_t i = 0; i < c.size(); ++i)
      if (!(std::fabs(double(c[i]) - want[i]) <= tol)) {
        ++wrong;
        break;
      }
  }
  return wrong;
}

}  // namespace

TEST_CASE("blas: 8 device threads calling GEMM at once get the right products, within a deadline") {
  constexpr int kThreads = 8, kCalls = 40;
  // Shared with the threads, which are detached: if one hangs, the test fails at the deadline
  // instead of joining it forever, and the state outlives this scope.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    int finished = 0, wrong = 0;
  };
  auto state = std::make_shared<State>();
  for (int t = 0; t < kThreads; ++t)
    std::thread([state, t] {
      int wrong = t % 2 ? gemm_calls<float>(uint32_t(t), kCalls) : gemm_calls<double>(uint32_t(t), kCalls);
      std::lock_guard lock(state->mu);
      state->wrong += wrong;
      state->finished++;
      state->cv.notify_all();
    }).detach();
  std::unique_lock lock(state->mu);
  const bool all = state->cv.wait_for(lock, std::chrono::seconds(120), [&] { return state->finished == kThreads; });
  REQUIRE_MESSAGE(all, "only " << state->finished << " of " << kThreads << " GEMM threads finished within 120 s");
  CHECK(state->wrong == 0);
}

TEST_CASE("blas: dp_train under ulimit -v finishes or fails with a message, never spins") {
  if (kSanitized) {
    MESSAGE("skipped: the sanitizers reserve terabytes of address space, so ulimit -v cannot apply");
    return;
  }
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 16, false);
  int finished = 0;
  // From a cap the run fits in down to one it cannot start under: each must end by itself, with 0
  // or with an error line (exit 1), well before the 60 s clock (137: killed by it).
  for (std::string kib : {"2000000", "1000000", "600000", "300000"}) {
    // A cap the binary cannot even be loaded under (the CUDA build maps cuBLAS/cuDNN, hundreds of
    // MiB of address space) says nothing about dp: the loader refuses it with 127. Skipped.
    if (run_command("ulimit -v " + kib + "; " + kTrain + " --version").exit_code == 127) {
      MESSAGE("ulimit -v " << kib << ": dp_train cannot be loaded under this cap; skipped");
      continue;
    }
    CommandResult r = run_command("ulimit -v " + kib + "; timeout -s KILL 60 " + kTrain + " --data " +
                                  dir.path.string() + " --backend cpu --devices 4 --batch 128 --steps 2 --quiet");
    INFO("ulimit -v " << kib << ": exit " << r.exit_code << "\n" << r.output);
    CHECK((r.exit_code == 0 || r.exit_code == 1));
    if (r.exit_code == 1) CHECK(r.output.find("dp_train: ") != std::string::npos);
    finished += r.exit_code == 0;
  }
  CHECK(finished >= 1);  // the largest cap is enough: the test does not pass by failing every run
}
