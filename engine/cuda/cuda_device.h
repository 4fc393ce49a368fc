// A CUDA GPU as a dp::Device: its worker threads are bound to the GPU (cudaSetDevice first thing),
// and it owns, all created on its compute thread: the compute stream every op and copy is enqueued
// on, a cuBLAS and a cuDNN handle bound to that stream, a communication stream (NCCL's, for
// all-reduce overlapping backward), a copy stream (the next batch's upload, overlapping the step),
// and the events peers and streams wait on. Memory comes from a pool of its own, stream-ordered on
// the compute stream (cudaMallocFromPoolAsync, cudaFreeAsync: below), and is booked by the Device
// base in the ledger.
//
// Several CudaDevices may name the same GPU (--gpus 0,0 --allow-shared-device): each then has its
// own streams and handles on the shared context, and the communicator uses peer copies, not NCCL.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/device.h"
#include "engine/wait.h"
#include "kernels/cuda/raii.h"

namespace dp {

class CudaOps;

class CudaDevice final : public Device {
 public:
  CudaDevice(int rank, int id, int64_t memory_cap);
  ~CudaDevice() override;

  Ops& ops() override;
  // Host memory may be pageable: the copy is then staged by the driver (slower), which may wait in
  // the driver for the stream's work before it, NCCL's kernels perhaps, past any --timeout: so the
  // stream is waited for first (polled, below). From pinned memory the copy is truly asynchronous.
  // Either way the host buffer must stay untouched until synchronize(), as the Device contract says.
  void upload(void* dst, const void* src_host, size_t bytes) override;
  // Through a page-locked bounce buffer of this device (kBounceBytes, made by open(): a page-locked
  // allocation or free may wait for the whole device, behind NCCL's kernels; copied in chunks), then
  // out: a copy into pageable memory returns only when it is done, after everything before it on the
  // stream (an NCCL all-reduce waiting for a dead peer, say), so the thread would sit in the driver
  // past any --timeout. Into page-locked memory the copy is asynchronous and the wait polls (below).
  void download(void* dst_host, const void* src, size_t bytes) override;
  static constexpr size_t kBounceBytes = size_t(4) << 20;
  // Into a page-locked slot of this device's (filled with NaN first, so that a read before the copy
  // lands shows), then an event on the compute stream; download_wait polls the event as synchronize()
  // polls the stream (a watch's deadline and abort), then copies out.
  void download_async(int slot, const void* src, size_t bytes) override;
  void download_wait(int slot, void* dst_host, size_t bytes) override;
  std::shared_ptr<void> pin_host(void* p, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  // Ordered after everything already enqueued on both this device's stream and src_device's (an
  // event, not a host wait), on this device's stream: cudaMemcpyPeerAsync between GPUs (with peer
  // access where the topology allows), cudaMemcpyAsync within one GPU.
  void copy_from_peer(void* dst, const Device& src_device, const void* src, size_t bytes) override;
  // Blocks in cudaStreamSynchronize, or, while a watch is set, polls (wait.h): NCCL's kernels on the
  // stream may wait for a peer that never comes, and no host wait on them may last forever. The copy
  // stream first: only copies run there.
  void synchronize() override;
  // On the copy stream (cudaMemcpyAsync from pinned memory: a DMA by the copy engine while kernels
  // run), after an event on the compute stream; then the slot's event is recorded there, which
  // await_upload makes the compute stream wait on.
  void upload_ahead(int slot, void* dst, const void* src_host, size_t bytes) override;
  void await_upload(int slot) override;
  void finish_uploads() noexcept override;
  // Step graphs (cuda_graph.cpp): cudaStreamBeginCapture on the compute stream in thread-local mode
  // (the loader's and the communication thread's CUDA calls go on), instantiated per upload slot;
  // marks taken while capturing are event-record nodes (cudaEventRecordExternal, so they can be
  // timed), and launch starts the first mark's clock at cudaGraphLaunch. prepare_steps gives cuBLAS
  // a workspace of kCublasWorkspaceBytes (booked), as PyTorch gives every handle one of its own (and
  // the side lane's handle, under DP_CUDA_STREAMS=2, one more).
  void prepare_steps() override;
  void begin_capture() override;
  void end_capture(int slot) override;
  void abandon_capture() noexcept override;
  void launch(int slot) override;
  static constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
  // Events recorded on the compute stream (with timing, unlike the ordering events). The first mark
  // of a set is taken as reached when it was recorded, or when the GPU reached the last mark read
  // before it if that is later (a step started ahead queues its first mark behind the step before:
  // the stream reaches it no sooner); every later mark is that time plus the GPU's elapsed time
  // between the two events. A graph's marks are events of its own, recorded by its nodes, so the
  // steps in flight never share one (launch points the step's set at them).
  int mark() override;
  std::chrono::steady_clock::time_point mark_time(int set, int i) override;
  void clear_marks(int set) override;

  // Set by the NCCL communicator while its clique exists (nullptr: none). While set, every host wait
  // on this device's stream (synchronize, download) polls instead of blocking: between polls it asks
  // aborted(), which says whether another rank failed and throws when NCCL reported an error; a wait
  // longer than `timeout` seconds throws TimedOut naming what(), what the stream waits for.
  struct Watch {
    std::function<bool()> aborted;
    std::function<std::string()> what;
    double timeout = kDefaultTimeout;
  };
  void set_watch(std::shared_ptr<const Watch> watch);

  // Memory (cuda_memory.cpp). Each CudaDevice allocates from a pool of its own (cudaMemPoolCreate on
  // its GPU) in the order of its compute stream: cudaMallocFromPoolAsync, and cudaFreeAsync, which
  // returns at once and hands the memory back once the stream's work before it is done, where
  // cudaFree waits for the whole GPU (zero2 and zero3 free a bucket or a layer's weights several
  // times a step, one of them while the next bucket's reduce-scatter runs). The pool keeps what it got from the driver
  // (no release threshold), so a step's buffers are the last step's memory again, as PyTorch's
  // caching allocator and its cudaMallocAsync backend keep theirs. What makes this safe is the
  // Buffer contract (engine/device.h): every use of a buffer on another stream or GPU is ordered
  // after the compute stream's work at its allocation and finished or ordered before the compute
  // stream's work at its free. Where the GPU has no memory pools (cudaDevAttrMemoryPoolsSupported),
  // cudaMalloc and cudaFree.
  struct PoolMemory {
    size_t reserved = 0, reserved_high = 0;  // what the pool holds from the driver, now and at most
    size_t used = 0;                         // what is allocated from it now
  };
  PoolMemory pool_memory();  // zeros where there is no pool
  int64_t reserved_peak() override { return pool_ ? int64_t(pool_memory().reserved_high) : -1; }
  bool pooled() const { return bool(pool_); }

  cudaStream_t stream() const { return stream_.get(); }
  cudaStream_t comm_stream() const { return comm_stream_.get(); }
  // Makes this device's stream wait for the work enqueued on `other`'s stream so far.
  void wait_for(const CudaDevice& other);

 protected:
  void* raw_alloc(size_t bytes) override;
  void raw_free(void* ptr) noexcept override;

 private:
  void open();            // on the compute thread
  void close() noexcept;  // on the compute thread
  // Lets this GPU read peer's memory: peer access between the GPUs where the topology allows, and
  // peer's pool opened to this GPU (a pool's memory does not follow cudaDeviceEnablePeerAccess).
  void enable_peer_access(const CudaDevice& peer);
  void open_pool();                                                 // in open(): pool_, where the GPU has memory pools
  void* pool_alloc(size_t bytes);                                   // raw_alloc with a pool
  [[noreturn]] void out_of_memory(const char* call, size_t bytes);  // OutOfMemory, with the driver's and ledger's view
  void wait_stream(cudaStream_t stream);                            // synchronize()'s wait, for this device's stream
  void wait_event(cudaEvent_t event);                               // the same for an event of this device's
  // Polls done() while a watch is set (wait.h: its deadline and abort), else blocks in block().
  void wait_until(const std::function<bool()>& done, const std::function<void()>& block);
  std::shared_ptr<const Watch> current_watch();  // set_watch's, or null
  // An upload's copy on `stream` (bytes > 0). From pageable memory CUDA may hold the thread in the copy
  // until the stream's work before it is done, NCCL's kernels perhaps: that is waited for first, polled.
  void copy_from_host(void* dst, const void* src_host, size_t bytes, cudaStream_t stream);

  cuda::Stream stream_, comm_stream_, copy_stream_;
  cuda::CublasHandle cublas_;
  cuda::CudnnHandle cudnn_;
  Buffer scratch_;  // CudaOps::Scratch, lent to ops_
  std::unique_ptr<CudaOps> ops_;
  std::mutex bounce_mu_;     // downloads from several threads take turns
  cuda::PinnedHost bounce_;  // download's page-locked landing place
  cuda::Event ready_;        // recorded on stream_ when a peer wants to wait for this device
  // The thread capturing a step graph (none: not capturing); what it may not do then throws.
  std::atomic<std::thread::id> capture_thread_{};
  bool capturing() const override { return capture_thread_.load() == std::this_thread::get_id(); }
  Buffer cublas_workspace_;  // prepare_steps'
  // CudaOps' side lane, under DP_CUDA_STREAMS=2 (CudaOps::streams_wanted); else none
  cuda::Stream side_stream_;
  cuda::CublasHandle side_cublas_;
  Buffer side_cublas_workspace_;
  cuda::GraphExec graphs_[Device::kUploadSlots];  // one per upload slot
  cuda::Event computed_;                          // recorded on stream_ for the copy stream to wait on
  cuda::Event uploaded_[Device::kUploadSlots];    // recorded on copy_stream_ after a slot's uploads
  cuda::PinnedHost downloads_;                    // (kDownloadSlots, kDownloadBytes): download_async's slots
  char* download_slot(int slot) const { return static_cast<char*>(downloads_.get()) + size_t(slot) * kDownloadBytes; }
  cuda::Event downloaded_[Device::kDownloadSlots];  // recorded on stream_ after a slot's download
  mutable std::mutex ready_mu_;
  std::mutex peer_mu_;
  std::vector<const CudaDevice*> peers_seen_;
  // Created in open(); kept past close() (a buffer freed after it still goes back with cudaFreeAsync)
  // and destroyed with the device, when the driver ends it once every buffer is back.
  cuda::MemPool pool_;
  // Marks (mark, mark_time): a set's events, grown on demand and reused, how many its step took
  // and when the first was reached (anchored: moved past the marks read before it).
  struct MarkSet {
    std::vector<cuda::Event> events;
    size_t used = 0;
    std::chrono::steady_clock::time_point first;
    bool anchored = false;
  };
  MarkSet own_marks_[Device::kDownloadSlots];  // the eager steps'
  MarkSet graph_marks_[Device::kUploadSlots];  // each graph's, taken while it was captured
  size_t graph_mark_count_[Device::kUploadSlots] = {};
  MarkSet capture_marks_;  // a capture's, until end_capture gives them to its slot
  // What each set's marks are: its own, a capture's or a launched graph's; mark() records into set_'s,
  // the set cleared last.
  MarkSet* sets_[Device::kDownloadSlots] = {&own_marks_[0], &own_marks_[1]};
  static_assert(Device::kDownloadSlots == 2, "sets_ names each set's own marks");
  int set_ = 0;
  std::chrono::steady_clock::time_point reached_;  // the latest mark mark_time has returned
  std::mutex watch_mu_;                            // set_watch runs on another rank's thread
  std::shared_ptr<const Watch> watch_;
};

// cudaStreamQuery as a "done?" for poll_until (wait.h): false while work is queued (cudaErrorNotReady,
// not an error: it is cleared from the last-error slot, as PyTorch's event query does), true once the
// stream is idle; throws the stream's error when its work failed. On the stream's device.
bool stream_idle(cudaStream_t stream);

// Makes `id` the calling thread's current device for the guard's lifetime. On a thread bound to a
// device (a CudaDevice worker) the previous device is restored afterwards; any other thread (main,
// a test) simply stays on `id`, so no context is ever created on a GPU nobody asked for. Never
// throws: a failure to switch is printed, naming `id`, and surfaces as the error of the CUDA call
// that follows.
class DeviceGuard {
 public:
  explicit DeviceGuard(int id) noexcept;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  bool restore_ = false;
};

}  // namespace dp
