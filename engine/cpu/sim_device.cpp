// The simulated backend: a device that is a CPU thread with host memory booked in its ledger, so the
// engine, the collectives and the memory-skew demo run and are tested on a machine without a GPU.
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "engine/cpu/recording_ops.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/failpoint.h"
#include "kernels/cpu/cpu_ops.h"

namespace dp {
namespace {

// A simulated device: host memory (64-byte aligned), the CPU kernels (the fast path this CPU runs, or
// the reference), a compute and a communication thread, and for uploads ahead a copy thread, started
// by the first: its copies run while the compute thread works, as a GPU's copy engine does. Its step
// graphs are recorded calls (RecordingOps), replayed in order.
class SimDevice final : public Device {
 public:
  SimDevice(int rank, int id, int64_t cap, std::unique_ptr<Ops> ops)
      : Device(rank, id, DeviceKind::simulated, cap), ops_(ops ? std::move(ops) : make_cpu_ops()) {
    start_workers({});
  }
  ~SimDevice() override {
    finish_uploads();
    copier_.reset();
    stop_workers();
  }

  Ops& ops() override { return ops_; }
  // n == 0 comes with null pointers (empty shards, zero-size buffers): memcpy(dst, nullptr, 0) is
  // undefined behaviour, so it is skipped.
  void upload(void* dst, const void* src, size_t n) override {
    refuse_while_capturing("an upload from host memory");
    if (n) std::memcpy(dst, src, n);
  }
  void download(void* dst, const void* src, size_t n) override {
    refuse_while_capturing("a download to host memory");
    if (n) std::memcpy(dst, src, n);
  }
  // Its compute is done when a call returns, so the bytes are copied at once: the step's end is
  // reached when it is queued.
  void download_async(int slot, const void* src, size_t n) override {
    refuse_while_capturing("a download to host memory");
    check_download(slot, n);
    if (const auto delay = failpoint::step_end_delay(*this); delay.count() > 0) std::this_thread::sleep_for(delay);
    if (n) std::memcpy(downloaded_[size_t(slot)].data(), src, n);
  }
  void download_wait(int slot, void* dst, size_t n) override {
    check_download(slot, n);
    if (n) std::memcpy(dst, downloaded_[size_t(slot)].data(), n);
  }
  void copy(void* dst, const void* src, size_t n) override {
    if (n) ops_.run([=] { std::memmove(dst, src, n); });
  }
  void copy_from_peer(void* dst, const Device&, const void* src, size_t n) override {
    if (n)
      ops_.run([=, delay = failpoint::peer_copy_delay(*this)] {
        if (delay.count() > 0) std::this_thread::sleep_for(delay);
        std::memcpy(dst, src, n);
      });
  }
  // Compute work is done when its call returns; the copy thread's may not be.
  void synchronize() override {
    refuse_while_capturing("a host wait for the device");  // as CUDA's capture refuses it
    finish_uploads();
  }

  void upload_ahead(int slot, void* dst, const void* src, size_t n) override {
    check_upload_slot(slot);
    std::lock_guard lock(mu_);
    if (!copier_) {
      try {
        copier_ = std::make_unique<Worker>();
      } catch (const std::system_error& e) {
        throw DeviceError(id(), std::string("cannot start the copy thread: ") + e.what());
      }
    }
    uploads_[size_t(slot)].push_back(copier_->submit([dst, src, n, delay = failpoint::upload_delay(*this)] {
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      if (n) std::memcpy(dst, src, n);
    }));
  }
  void await_upload(int slot) override {
    check_upload_slot(slot);
    if (capturing()) return;  // launch waits
    for (auto& f : take(slot)) f.get();
  }
  void finish_uploads() noexcept override {
    for (int s = 0; s < kUploadSlots; ++s)
      for (auto& f : take(s)) f.wait();
  }

  void begin_capture() override {
    if (capturing()) throw DeviceError(id(), "begin_capture: a capture is already under way");
    capture_.clear();
    ops_.record(&capture_);
  }
  void end_capture(int slot) override {
    check_upload_slot(slot);
    ops_.stop();
    if (free_held()) {
      capture_.clear();
      refused("a free");
    }
    graphs_[size_t(slot)] = {std::exchange(capture_, {}), marks().size()};
  }
  void abandon_capture() noexcept override {
    ops_.stop();
    capture_.clear();
    free_held();
  }
  void launch(int slot) override {
    check_upload_slot(slot);
    const Graph& g = graphs_[size_t(slot)];
    if (g.calls.empty()) no_graph(slot);
    await_upload(slot);
    marks().resize(g.marks);
    for (const auto& call : g.calls) call();
  }

  // Marks on the host clock, as the base's, but a mark taken while capturing is stamped when replayed,
  // into the set the replaying step marks into.
  int mark() override {
    const size_t i = marks().size();
    marks().emplace_back();
    ops_.run([this, i] { marks()[i] = std::chrono::steady_clock::now(); });
    return int(i);
  }
  std::chrono::steady_clock::time_point mark_time(int set, int i) override {
    check_mark_set(set);
    const auto& m = marks_[size_t(set)];
    if (i < 0 || size_t(i) >= m.size())
      throw DeviceError(id(), "mark_time: no mark " + std::to_string(i) + " in set " + std::to_string(set));
    return m[size_t(i)];
  }
  void clear_marks(int set) override {
    check_mark_set(set);
    set_ = set;
    marks().clear();
  }

 protected:
  void* raw_alloc(size_t bytes) override {
    refuse_while_capturing("an allocation");
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw DeviceError(id(), "host allocation of " + format_bytes(int64_t(bytes)) + " failed");
    return p;
  }
  void raw_free(void* p) noexcept override { std::free(p); }
  bool capturing() const override { return ops_.recording(); }

 private:
  // A slot's pending uploads, handed to the caller to wait for (the comm thread synchronizes too).
  std::vector<std::future<void>> take(int slot) noexcept {
    std::lock_guard lock(mu_);
    return std::exchange(uploads_[size_t(slot)], {});
  }

  struct Graph {
    RecordingOps::Graph calls;
    size_t marks = 0;  // the marks taken while it was captured
  };
  RecordingOps ops_;
  RecordingOps::Graph capture_;  // the capture under way
  std::array<Graph, kUploadSlots> graphs_;
  // Per mark set (Device::clear_marks); marks() is the one the device marks into.
  std::array<std::vector<std::chrono::steady_clock::time_point>, kDownloadSlots> marks_;
  int set_ = 0;
  std::vector<std::chrono::steady_clock::time_point>& marks() { return marks_[size_t(set_)]; }
  std::array<std::array<char, kDownloadBytes>, kDownloadSlots> downloaded_{};  // download_async's slots
  std::mutex mu_;                                                              // guards copier_ and uploads_
  std::unique_ptr<Worker> copier_;
  std::array<std::vector<std::future<void>>, kUploadSlots> uploads_;
};

}  // namespace

std::unique_ptr<Device> make_simulated_device(int rank, int id, int64_t cap, std::unique_ptr<Ops> ops) {
  return std::make_unique<SimDevice>(rank, id, cap, std::move(ops));
}

}  // namespace dp
