// A device: an id, a kind, a compute worker thread alive for the whole run, an allocator that books
// every byte in a ledger, and its kernels. Simulated devices run on a CPU thread; CUDA devices own a
// stream and library handles (engine/cuda/). The engine above sees only this interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "engine/ledger.h"
#include "engine/worker.h"
#include "kernels/ops.h"

namespace dp {

enum class DeviceKind { simulated, cuda };
// The backend a kind belongs to, as --backend names it: "cpu" (simulated devices) or "cuda".
inline const char* kind_name(DeviceKind k) { return k == DeviceKind::cuda ? "cuda" : "cpu"; }

class Device;

// Move-only device memory, booked under a category for as long as it lives. A CUDA device allocates
// and frees it in the order of its compute stream (engine/cuda/cuda_device.h), so a buffer's other
// users keep to that order: its uses on another stream (the comm stream's collectives, the copy
// stream's uploads) or by another device (copy_from_peer) are ordered after the compute stream's work
// at its allocation, by an event recorded there, and are done, or ordered before the compute stream's
// work, when it is freed (the peer collectives end with every rank's copies waited for; NCCL's wait()
// makes the compute stream wait for the comm stream). A free while the device captures is held until
// the capture ends, and the capture is refused (Device::free_held).
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device* device, void* ptr, size_t bytes, Category category)
      : device_(device), ptr_(ptr), bytes_(bytes), category_(category) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset() noexcept;
  float* f() const { return static_cast<float*>(ptr_); }
  int32_t* i32() const { return static_cast<int32_t*>(ptr_); }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Category category_ = Category::workspace;
};

class Device {
 public:
  Device(int rank, int id, DeviceKind kind, int64_t memory_cap)
      : rank_(rank), id_(id), kind_(kind), ledger_(id, memory_cap) {}
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int rank() const { return rank_; }  // position in the device list: the communicator's rank
  int id() const { return id_; }      // the id the user gave (--gpus)
  DeviceKind kind() const { return kind_; }
  std::string name() const;  // "sim:1", "cuda:0"
  Ledger& ledger() { return ledger_; }

  Buffer alloc(size_t bytes, Category category);
  Buffer alloc_floats(int64_t n, Category category) { return alloc(size_t(n) * sizeof(float), category); }

  virtual Ops& ops() = 0;
  // Copies. upload/copy/copy_from_peer are ordered on the device's compute stream (asynchronous on
  // CUDA, the host buffer must outlive synchronize()); download returns when the bytes are on the host.
  virtual void upload(void* dst, const void* src_host, size_t bytes) = 0;
  virtual void download(void* dst_host, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_from_peer(void* dst, const Device& src_device, const void* src, size_t bytes) = 0;
  // Waits for everything enqueued on the device: its compute stream and its copy stream.
  virtual void synchronize() = 0;

  // The copy stream: the next step's batch uploaded while this step computes (Engine::stage; Apex's
  // data_prefetcher, DALI). upload_ahead enqueues the copy there, into a buffer of one of
  // kUploadSlots slots, ordered after the compute stream's work so far (the buffer's last reader), and
  // returns at once; await_upload(slot) orders the compute stream's following work after that slot's
  // uploads (on CUDA an event the stream waits on, no host wait; a simulated device runs its uploads
  // on a thread of their own and waits for them). The host memory must stay untouched until
  // synchronize() or finish_uploads(). upload_ahead may be called from any thread between steps.
  static constexpr int kUploadSlots = 2;
  virtual void upload_ahead(int slot, void* dst, const void* src_host, size_t bytes) = 0;
  virtual void await_upload(int slot) = 0;
  // Waits for the uploads ahead and never throws: what a failed step calls before the host memory of
  // the batches it staged may go. On CUDA the copy stream's copies follow the compute stream's work,
  // which may wait for a dead peer's NCCL kernels: there it gives up after the collective timeout.
  virtual void finish_uploads() noexcept = 0;
  // Page-locks the host memory [p, p + bytes) for uploads from it until the returned handle goes
  // away: on CUDA (cudaHostRegister, for every GPU of the process) an upload from it is then one DMA
  // the host does not wait for, instead of a copy staged through the driver's bounce buffer. Null
  // on a simulated device, whose copies are memcpy. p and bytes should be whole pages (a range that
  // shares a page with one already locked is refused): PageAllocator's (engine/host_pages.h).
  virtual std::shared_ptr<void> pin_host(void* /*p*/, size_t /*bytes*/) { return nullptr; }
  // A step's end without a host wait (Engine::start_step, --run-ahead): download_async(slot, src,
  // bytes) queues a copy of `bytes` (at most kDownloadBytes; 0: none, only the point reached) of
  // device memory into this device's own page-locked slot, behind everything enqueued on the compute
  // stream so far, and returns at once; download_wait(slot, dst, bytes) waits for that point (as
  // synchronize() waits: bounded by a watch's deadline and abort on CUDA) and copies the bytes to dst.
  // A slot's next download_async must come after its download_wait. Compute thread; not while
  // capturing.
  static constexpr int kDownloadSlots = 2;
  static constexpr size_t kDownloadBytes = 64;
  virtual void download_async(int slot, const void* src, size_t bytes) = 0;
  virtual void download_wait(int slot, void* dst_host, size_t bytes) = 0;
  // The most this device's allocator held at once, what is allocated and what it keeps for reuse
  // (a CUDA device's memory pool: PyTorch's max_memory_reserved, beside the ledger's peak, its
  // max_memory_allocated); -1 where every allocation is handed back as it is freed (simulated devices).
  virtual int64_t reserved_peak() { return -1; }

  // Step graphs (--graphs; CUDA graphs, as torch.cuda.graph captures and replays). Between
  // begin_capture() and end_capture(slot) the work the calling thread enqueues on this device (ops,
  // copies, marks) is recorded, not run, and kept as the graph of upload slot `slot` (replacing the
  // one there); launch(slot) runs that graph once, after the slot's uploads (an await_upload while
  // capturing is left to launch). Nothing of the host is replayed: an upload or download while
  // capturing throws, as does an allocation (a replay would use the first step's host memory, or a
  // buffer freed since), and every argument is the capture's (a pointer, a batch size: what changes
  // from step to step is read from device memory instead, as the optimizer's scalars are).
  // prepare_steps() before an engine's first step, graphs or not: what its steps need set up once
  // (cuBLAS's workspace on CUDA, booked, so that eager steps and graphs run on the same one and pick
  // the same GEMM kernels). abandon_capture() drops a capture that failed. Compute thread only.
  virtual void prepare_steps() {}
  virtual void begin_capture() = 0;
  virtual void end_capture(int slot) = 0;
  virtual void abandon_capture() noexcept = 0;
  virtual void launch(int slot) = 0;

  // Timing without waiting. mark() notes the point the device's work has reached in its order and
  // returns its index: on a simulated device the host clock (its work is done when a call returns),
  // on CUDA an event on the compute stream, so a phase is timed without a host synchronisation. The
  // marks come in kDownloadSlots sets, one per step in flight (the engine's: its download slot):
  // clear_marks(set) empties a set and takes the marks after it, and once the work after the set's
  // last mark is done (its step's download waited for, or synchronize()), mark_time(set, i) is when
  // mark i was reached, on the host's steady clock, while the next step marks into the other set.
  // Compute thread only.
  virtual int mark() = 0;
  virtual std::chrono::steady_clock::time_point mark_time(int set, int i) = 0;
  virtual void clear_marks(int set) = 0;

  // Runs fn on the device's compute thread / its communication thread.
  std::future<void> run(std::function<void()> fn) { return compute_->submit(std::move(fn)); }
  std::future<void> run_comm(std::function<void()> fn) { return comm_->submit(std::move(fn)); }

 protected:
  virtual void* raw_alloc(size_t bytes) = 0;
  virtual void raw_free(void* ptr) noexcept = 0;
  // Called by the derived constructor once it can run `init` (e.g. cudaSetDevice) on new threads;
  // the derived destructor calls stop_workers() before its own members go.
  void start_workers(std::function<void()> init);
  void stop_workers();
  // Throws DeviceError unless 0 <= slot < kUploadSlots (upload_ahead, await_upload).
  void check_upload_slot(int slot) const;
  // Throws DeviceError unless 0 <= slot < kDownloadSlots and bytes <= kDownloadBytes.
  void check_download(int slot, size_t bytes) const;
  // Throws DeviceError unless 0 <= set < kDownloadSlots (clear_marks, mark_time).
  void check_mark_set(int set) const;
  // Whether the calling thread captures a step graph on this device.
  virtual bool capturing() const = 0;
  // The step graphs' errors, alike on every backend: `what` (an upload, a download, an allocation)
  // while this thread captures, which a replay would get wrong (refused(what) throws it); a launch of
  // a slot with no graph.
  void refuse_while_capturing(const char* what) const {
    if (capturing()) refused(what);
  }
  [[noreturn]] void refused(const char* what) const;
  [[noreturn]] void no_graph(int slot) const;
  // A buffer freed while capturing (its reset cannot throw) is held, not freed: a captured free would
  // repeat at every replay, and the work captured before it still uses the memory. Once the capture
  // has ended, end_capture and abandon_capture call free_held(), which frees what was held and says
  // whether there was any: end_capture then refuses the graph, refused("a free").
  bool free_held() noexcept;

 private:
  friend class Buffer;
  void free(void* ptr) noexcept;  // raw_free, or held while capturing
  int rank_, id_;
  DeviceKind kind_;
  Ledger ledger_;
  std::unique_ptr<Worker> compute_, comm_;
  std::vector<void*> held_;  // freed while capturing (free_held)
};

// Where there is no GPU, "every device" (--gpus all, dp_train's default) means this many simulated
// devices: the fewest that show data parallelism.
inline constexpr int kDefaultSimulatedDevices = 2;
// The most devices one process runs (--devices, --gpus): a simulated device is two threads.
inline constexpr int kMaxDevices = 4096;

struct DeviceConfig {
  std::string backend = "auto";  // auto | cpu | cuda
  std::vector<int> ids{0};
  // --gpus all: every usable GPU (PyTorch's device_ids=None, Caffe's -gpu all), or
  // kDefaultSimulatedDevices simulated devices where there is none; ids is then ignored.
  bool all = false;
  int64_t memory_cap = 0;  // bytes per simulated device; 0 = unlimited
  bool allow_shared_device = false;
};

struct DeviceSet {
  std::vector<std::unique_ptr<Device>> devices;
  std::string notice;    // one line: which backend was chosen and why
  std::vector<int> ids;  // the ids in use (--gpus all resolved)
};

// Throws UsageError for an empty list, repeated ids without allow_shared_device, a bad backend.
DeviceSet make_devices(const DeviceConfig& config);

// ops: the kernels it runs; null for make_cpu_ops()'s choice (the best this CPU runs, or
// DP_CPU_KERNELS's). Tests pass the reference kernels to compare another backend with the oracle.
std::unique_ptr<Device> make_simulated_device(int rank, int id, int64_t memory_cap, std::unique_ptr<Ops> ops = nullptr);

// The CUDA backend's entry points; engine/cuda/ defines them, or engine/stub/ when built without CUDA.
struct CudaProbe {
  int count = 0;       // usable CUDA devices
  std::string reason;  // why there are none: "built without CUDA", "no CUDA driver", ...
};
CudaProbe probe_cuda();  // cheap, never throws
std::unique_ptr<Device> make_cuda_device(int rank, int id, int64_t memory_cap);
bool cuda_built();

}  // namespace dp
