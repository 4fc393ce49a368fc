// The simulated backend: a device that is a CPU thread with host memory booked in its ledger, so the
// engine, the collectives and the memory-skew demo run and are tested on a machine without a GPU.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "engine/device.h"
#include "engine/error.h"
#include "kernels/cpu/cpu_ops.h"

namespace dp {
namespace {

// A simulated device: host memory (64-byte aligned), the CPU kernels (the fast path this CPU runs, or
// the reference), a compute and a communication thread.
class SimDevice final : public Device {
 public:
  SimDevice(int rank, int id, int64_t cap, std::unique_ptr<Ops> ops)
      : Device(rank, id, DeviceKind::simulated, cap), ops_(ops ? std::move(ops) : make_cpu_ops()) {
    start_workers({});
  }
  ~SimDevice() override { stop_workers(); }

  Ops& ops() override { return *ops_; }
  // n == 0 comes with null pointers (empty shards, zero-size buffers): memcpy(dst, nullptr, 0) is
  // undefined behaviour, so it is skipped.
  void upload(void* dst, const void* src, size_t n) override {
    if (n) std::memcpy(dst, src, n);
  }
  void download(void* dst, const void* src, size_t n) override {
    if (n) std::memcpy(dst, src, n);
  }
  void copy(void* dst, const void* src, size_t n) override {
    if (n) std::memmove(dst, src, n);
  }
  void copy_from_peer(void* dst, const Device&, const void* src, size_t n) override {
    if (n) std::memcpy(dst, src, n);
  }
  void synchronize() override {}

 protected:
  void* raw_alloc(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw DeviceError(rank(), "host allocation of " + format_bytes(int64_t(bytes)) + " failed");
    return p;
  }
  void raw_free(void* p) noexcept override { std::free(p); }

 private:
  std::unique_ptr<Ops> ops_;
};

}  // namespace

std::unique_ptr<Device> make_simulated_device(int rank, int id, int64_t cap, std::unique_ptr<Ops> ops) {
  return std::make_unique<SimDevice>(rank, id, cap, std::move(ops));
}

}  // namespace dp
