#include "engine/device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "engine/error.h"

namespace dp {

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    device_ = std::exchange(o.device_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
  }
  return *this;
}

void Buffer::reset() noexcept {
  if (ptr_) {
    device_->free(ptr_);
    device_->ledger_.release(category_, int64_t(bytes_));
  }
  device_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

std::string Device::name() const {
  return std::string(kind_ == DeviceKind::cuda ? "cuda:" : "sim:") + std::to_string(id_);
}

Buffer Device::alloc(size_t bytes, Category category) {
  if (bytes == 0) return Buffer();
  ledger_.book(category, int64_t(bytes));  // throws past the cap, before anything is allocated
  void* p = nullptr;
  try {
    p = raw_alloc(bytes);
  } catch (...) {
    ledger_.release(category, int64_t(bytes));
    throw;
  }
  return Buffer(this, p, bytes, category);
}

void Device::check_upload_slot(int slot) const {
  if (slot < 0 || slot >= kUploadSlots)
    throw DeviceError(id_,
                      "upload slot " + std::to_string(slot) + ": the slots are 0.." + std::to_string(kUploadSlots - 1));
}

void Device::check_download(int slot, size_t bytes) const {
  if (slot < 0 || slot >= kDownloadSlots)
    throw DeviceError(
        id_, "download slot " + std::to_string(slot) + ": the slots are 0.." + std::to_string(kDownloadSlots - 1));
  if (bytes > kDownloadBytes)
    throw DeviceError(id_, "download_async of " + std::to_string(bytes) + " bytes: a slot holds " +
                               std::to_string(kDownloadBytes) + "; use download() for more");
}

void Device::check_mark_set(int set) const {
  if (set < 0 || set >= kDownloadSlots)
    throw DeviceError(id_,
                      "mark set " + std::to_string(set) + ": the sets are 0.." + std::to_string(kDownloadSlots - 1));
}

void Device::refused(const char* what) const {
  throw DeviceError(id_, std::string(what) +
                             " while capturing a step graph: a graph holds the device's work alone, and a "
                             "replay repeats the captured step's pointers");
}

void Device::free(void* ptr) noexcept {
  if (capturing())
    held_.push_back(ptr);
  else
    raw_free(ptr);
}

bool Device::free_held() noexcept {
  for (void* p : held_) raw_free(p);
  const bool any = !held_.empty();
  held_.clear();
  return any;
}

void Device::no_graph(int slot) const {
  throw DeviceError(id_, "launch: no graph captured for upload slot " + std::to_string(slot));
}

void Device::start_workers(std::function<void()> init) {
  try {
    compute_ = std::make_unique<Worker>(init);
    comm_ = std::make_unique<Worker>(init);
  } catch (const std::system_error& e) {  // std::thread's EAGAIN: no thread or no stack to give it
    throw DeviceError(id_, std::string("cannot start a worker thread: ") + e.what() +
                               " (the process is short of threads or address space; see ulimit -u and ulimit -v)");
  }
}

void Device::stop_workers() {
  compute_.reset();
  comm_.reset();
}

namespace {

void check_ids(const DeviceConfig& cfg) {
  if (cfg.all) return;
  if (cfg.ids.empty()) throw UsageError("--gpus: the device list is empty; give at least one id, e.g. --gpus 0");
  for (int id : cfg.ids)
    if (id < 0) throw UsageError("--gpus: device id " + std::to_string(id) + " is negative; ids are 0, 1, ...");
  if (std::set<int>(cfg.ids.begin(), cfg.ids.end()).size() != cfg.ids.size() && !cfg.allow_shared_device)
    throw UsageError(
        "--gpus: a device id is repeated; pass --allow-shared-device to run several replicas on one device");
}

std::vector<int> first_ids(int n) {
  std::vector<int> ids(size_t(n), 0);
  for (int i = 0; i < n; ++i) ids[size_t(i)] = i;
  return ids;
}

std::string simulated_count_note(const DeviceConfig& cfg) {
  if (!cfg.all) return "--gpus ids name simulated devices";
  return std::to_string(kDefaultSimulatedDevices) + " simulated devices (--gpus all; --devices N for another count)";
}

}  // namespace

DeviceSet make_devices(const DeviceConfig& cfg) {
  check_ids(cfg);
  if (cfg.backend != "auto" && cfg.backend != "cpu" && cfg.backend != "cuda")
    throw UsageError("--backend: '" + cfg.backend + "' is not a backend; use auto, cpu or cuda");

  DeviceSet set;
  set.ids = cfg.all ? first_ids(kDefaultSimulatedDevices) : cfg.ids;
  bool use_cuda = false;
  if (cfg.backend != "cpu") {
    CudaProbe probe = probe_cuda();
    if (probe.count > 0) {
      if (cfg.all) set.ids = first_ids(probe.count);
      for (int id : set.ids)
        if (id >= probe.count)
          throw UsageError("--gpus: device " + std::to_string(id) + " does not exist; this machine has " +
                           std::to_string(probe.count) + " CUDA device(s), ids 0.." + std::to_string(probe.count - 1));
      use_cuda = true;
      set.notice = "backend: cuda (" + std::to_string(probe.count) + " CUDA device(s) found" +
                   (cfg.all ? ", all in use" : "") + ")";
    } else if (cfg.backend == "cuda") {
      throw UsageError("--backend cuda: no CUDA device is usable (" + probe.reason + "); use --backend cpu or auto");
    } else {
      set.notice = "backend: simulated CPU devices (" + probe.reason + "); " + simulated_count_note(cfg);
    }
  } else {
    set.notice = "backend: simulated CPU devices (--backend cpu)" + (cfg.all ? "; " + simulated_count_note(cfg) : "");
  }

  for (int r = 0; r < int(set.ids.size()); ++r)
    set.devices.push_back(use_cuda ? make_cuda_device(r, set.ids[r], cfg.memory_cap)
                                   : make_simulated_device(r, set.ids[r], cfg.memory_cap));
  return set;
}

}  // namespace dp
