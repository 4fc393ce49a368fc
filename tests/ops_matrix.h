// The op matrix: one test body runs over every backend this machine has and is compared with the
// reference kernels (kernels/cpu/kernels.h, the oracle: the float templates where a claim is bit for
// bit, the double ones where it is a derived tolerance, tests/tolerance.h). The backends:
//   cpu reference   make_cpu_ops(Isa::reference): the float reference kernels through Ops
//   cpu avx2, ...   make_cpu_ops(isa) for each fast instruction set this CPU runs
//   cuda            a CUDA device's Ops, where one is usable
//
//   DP_OPS_TEST("gemm: ...") { ... be.ops() ... }
// registers the body twice: "ops: gemm: ..." runs it once per CPU backend, each in a SUBCASE named
// for it, so a failure says which (an instruction set this CPU lacks is named in a MESSAGE);
// "cuda: ops: gemm: ..." runs it on a CUDA device and is skipped without one (CMakeLists.txt's ctest
// entry for "cuda: " cases then shows as Skipped). Bodies use nested SUBCASEs freely.
//
// Every buffer a body hands an op lives on the backend (Mem: host memory on the CPU, device memory on
// CUDA) and is followed by kGuard sentinels; get() checks they were not written. Outputs start as
// NaN, so an element an op forgets to write fails its comparison.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "tests/backends.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {

inline constexpr size_t kGuard = 16;
inline constexpr float kSentinel = -12345.678f;
inline constexpr int32_t kSentinelI32 = -1234567;
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// n elements on one backend, then kGuard sentinels.
class Mem {
 public:
  float* f() { return dev_ ? dev_.f() : host_f_.data(); }
  int32_t* i32() { return dev_ ? dev_.i32() : host_i_.data(); }
  size_t size() const { return n_; }

 private:
  friend class Backend;
  size_t n_ = 0;
  bool ints_ = false;
  std::vector<float> host_f_;    // (n + kGuard) on a CPU backend
  std::vector<int32_t> host_i_;  // (n + kGuard) on a CPU backend, for int32 buffers
  Buffer dev_;                   // (n + kGuard) on a CUDA device
};

class Backend {
 public:
  // The CPU backend for one instruction set, on host memory.
  explicit Backend(cpu::Isa isa)
      : name_(std::string("cpu ") + cpu::isa_name(isa)),
        reference_(isa == cpu::Isa::reference),
        ops_(make_cpu_ops(isa)) {}
  // A CUDA device (device memory; every op and copy on its compute thread, as in the engine).
  explicit Backend(std::unique_ptr<Device> cuda) : name_("cuda"), device_(std::move(cuda)) {}

  const std::string& name() const { return name_; }
  bool is_cuda() const { return device_ != nullptr; }
  bool is_reference() const { return reference_; }
  bool is_fast() const { return !device_ && !reference_; }  // a fast CPU instruction set
  Device* device() const { return device_.get(); }
  Ops& ops() { return device_ ? device_->ops() : *ops_; }

  // Runs fn(ops) where this backend's ops run: here on the CPU, on the device's compute thread for CUDA.
  void run(const std::function<void(Ops&)>& fn) {
    if (device_)
      device_->run([&] { fn(device_->ops()); }).get();
    else
      fn(*ops_);
  }

  Mem put(const std::vector<float>& h) { return make(h.data(), h.size(), 0.0f); }
  Mem put(const std::vector<int32_t>& h) { return make_i32(h.data(), h.size(), 0); }
  // n floats an op must overwrite (NaN until then), or n copies of `fill`.
  Mem out(size_t n, float fill = kNaN) { return make(nullptr, n, fill); }
  Mem out_i32(size_t n, int32_t fill = -1) { return make_i32(nullptr, n, fill); }
  Mem workspace(const ConvShape& s) {
    size_t n = 0;
    run([&](Ops& ops) { n = ops.conv2d_workspace_floats(s); });
    return out(n);
  }

  // The n elements, checking that nothing was written past them.
  std::vector<float> get(const Mem& m) {
    std::vector<float> h(m.n_ + kGuard);
    download(m, h.data(), h.size() * sizeof(float));
    size_t written = 0;
    for (size_t i = m.n_; i < h.size(); ++i) written += std::memcmp(&h[i], &kSentinel, sizeof(float)) != 0;
    CHECK_MESSAGE(written == 0, "an op wrote past the end of a buffer of " << m.n_ << " floats");
    h.resize(m.n_);
    return h;
  }
  std::vector<int32_t> get_i32(const Mem& m) {
    std::vector<int32_t> h(m.n_ + kGuard);
    download(m, h.data(), h.size() * sizeof(int32_t));
    size_t written = 0;
    for (size_t i = m.n_; i < h.size(); ++i) written += h[i] != kSentinelI32;
    CHECK_MESSAGE(written == 0, "an op wrote past the end of a buffer of " << m.n_ << " ints");
    h.resize(m.n_);
    return h;
  }

 private:
  std::string name_;
  bool reference_ = false;
  std::unique_ptr<Ops> ops_;        // CPU
  std::unique_ptr<Device> device_;  // CUDA

  Mem make(const float* src, size_t n, float fill) {
    Mem m;
    m.n_ = n;
    std::vector<float> h(n + kGuard, kSentinel);
    for (size_t i = 0; i < n; ++i) h[i] = src ? src[i] : fill;
    if (!device_) {
      m.host_f_ = std::move(h);
      return m;
    }
    run([&](Ops&) {
      m.dev_ = device_->alloc_floats(int64_t(h.size()), Category::workspace);
      device_->upload(m.dev_.data(), h.data(), h.size() * sizeof(float));
      device_->synchronize();
    });
    return m;
  }
  Mem make_i32(const int32_t* src, size_t n, int32_t fill) {
    Mem m;
    m.n_ = n;
    m.ints_ = true;
    std::vector<int32_t> h(n + kGuard, kSentinelI32);
    for (size_t i = 0; i < n; ++i) h[i] = src ? src[i] : fill;
    if (!device_) {
      m.host_i_ = std::move(h);
      return m;
    }
    run([&](Ops&) {
      m.dev_ = device_->alloc(h.size() * sizeof(int32_t), Category::workspace);
      device_->upload(m.dev_.data(), h.data(), h.size() * sizeof(int32_t));
      device_->synchronize();
    });
    return m;
  }
  void download(const Mem& m, void* dst, size_t bytes) {
    if (device_) {
      run([&](Ops&) { device_->download(dst, m.dev_.data(), bytes); });
      return;
    }
    std::memcpy(dst, m.ints_ ? static_cast<const void*>(m.host_i_.data()) : m.host_f_.data(), bytes);
  }
};

// The CPU instruction sets to run: the reference always, each fast one this CPU runs; the others are
// named in a MESSAGE (once per process: doctest re-enters a test case for every SUBCASE), so the log
// says what was not covered here.
inline std::vector<cpu::Isa> cpu_isas() {
  static bool told = false;
  std::vector<cpu::Isa> out = {cpu::Isa::reference};
  for (cpu::Isa isa : {cpu::Isa::avx2, cpu::Isa::avx512}) {
    if (cpu::isa_supported(isa))
      out.push_back(isa);
    else if (!told)
      MESSAGE("ops: cpu " << std::string(cpu::isa_name(isa)) << " cases skipped: this CPU (or build) does not run it");
  }
  told = true;
  return out;
}

inline std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<Backend>(make_cuda_device(0, 0, 0)); }

// Double copies of float data for the oracle, optionally of the magnitudes (the sums of |terms| that
// the tolerances scale with are the oracle run on |inputs|).
inline std::vector<double> dbl(const std::vector<float>& v, bool absolute = false) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = absolute ? std::fabs(double(v[i])) : double(v[i]);
  return out;
}

}  // namespace dp::test

#define DP_OPS_TEST_IMPL(body, title)                                               \
  static void body(::dp::test::Backend& be);                                        \
  TEST_CASE("ops: " title) {                                                        \
    for (::dp::cpu::Isa isa : ::dp::test::cpu_isas()) {                             \
      SUBCASE((std::string("cpu ") + ::dp::cpu::isa_name(isa)).c_str()) {           \
        ::dp::test::Backend b(isa);                                                 \
        body(b);                                                                    \
      }                                                                             \
    }                                                                               \
  }                                                                                 \
  TEST_CASE(("cuda: ops: " title) * doctest::skip(!::dp::test::cuda_available())) { \
    SUBCASE("cuda") {                                                               \
      auto b = ::dp::test::make_cuda_backend();                                     \
      body(*b);                                                                     \
    }                                                                               \
  }                                                                                 \
  static void body(::dp::test::Backend& be)

// One test body over the backend matrix (see the top of this file); `be` is the backend.
#define DP_OPS_TEST(title) DP_OPS_TEST_IMPL(DOCTEST_ANONYMOUS(dp_ops_body_), title)
