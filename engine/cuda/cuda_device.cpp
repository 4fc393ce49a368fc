// The CUDA device (cuda_device.h) and the backend's entry points declared in engine/device.h:
// cuda_built, probe_cuda, make_cuda_device. The stub (engine/stub/cuda_stub.cpp) replaces this
// file in builds without CUDA.
#include "engine/cuda/cuda_device.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"

namespace dp {
namespace {

// The GPU a CudaDevice worker thread was bound to by its init; -1 on every other thread.
thread_local int t_bound_device = -1;

// A query's answer (cudaStreamQuery, cudaEventQuery) as "done?": cudaErrorNotReady is no error, and is
// cleared from the last-error slot; anything else but success is the work's failure, thrown.
bool query_done(cudaError_t err, const char* call) {
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  DP_CUDA_CHECK_NAMED(err, call);
  return true;
}

// cudaEventQuery as a "done?" for poll_until: true once the work before the event's record is done.
bool event_done(cudaEvent_t event) { return query_done(cudaEventQuery(event), "cudaEventQuery(event)"); }

// A host function on a stream (cudaLaunchHostFunc): holds the stream for `ms` milliseconds.
void CUDART_CB sleep_ms(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}

}  // namespace

DeviceGuard::DeviceGuard(int id) noexcept {
  if (cudaGetDevice(&prev_) != cudaSuccess) {
    (void)cudaGetLastError();
    prev_ = -1;
  }
  if (prev_ == id) return;
  const cudaError_t err = cudaSetDevice(id);
  if (err != cudaSuccess) {
    // Not thrown (destructors and cleanup switch devices too), so said here, naming the device: the
    // thread stays on its current one (the line ends with it), where the calls meant for `id` fail.
    (void)cudaGetLastError();
    try {
      const std::string call = "cudaSetDevice(" + std::to_string(id) + ")";
      cuda::print_failure("CUDA", call.c_str(),
                          std::string(cudaGetErrorString(err)) + "; the CUDA calls meant for cuda:" +
                              std::to_string(id) + " that follow run on this thread's device instead and will fail",
                          __FILE__, __LINE__);
    } catch (...) {  // out of memory for the message: nothing more to say
    }
    return;
  }
  restore_ = t_bound_device >= 0 && prev_ >= 0;
}

DeviceGuard::~DeviceGuard() {
  if (restore_) DP_CUDA_CHECK_PRINT(cudaSetDevice(prev_));
}

CudaDevice::CudaDevice(int rank, int id, int64_t memory_cap) : Device(rank, id, DeviceKind::cuda, memory_cap) {
  // Both workers (compute, communication) bind to the GPU before anything else runs on them, so no
  // CUDA call of theirs can create a context on device 0 by default.
  start_workers([id] {
    DP_CUDA_CHECK(cudaSetDevice(id));
    t_bound_device = id;
  });
  try {
    run([this] { open(); }).get();
  } catch (...) {
    run([this] { close(); }).wait();
    stop_workers();
    throw;
  }
}

CudaDevice::~CudaDevice() {
  run([this] { close(); }).wait();
  stop_workers();
}

namespace {

// A cuBLAS handle bound to `stream`, FP32 GEMMs in FP32: the default math mode never uses TF32 tensor
// cores for cublasSgemm (that takes CUBLAS_TF32_TENSOR_OP_MATH); said explicitly because the tests'
// error bounds rely on it.
cuda::CublasHandle make_cublas(cudaStream_t stream) {
  cublasHandle_t blas = nullptr;
  DP_CUBLAS_CHECK(cublasCreate(&blas));
  cuda::CublasHandle owned(blas);
  DP_CUBLAS_CHECK(cublasSetStream(blas, stream));
  DP_CUBLAS_CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  return owned;
}

// Host memory neither page-locked nor registered (cudaHostRegister); memory CUDA cannot tell counts as such.
bool pageable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered;
}

}  // namespace

void CudaDevice::open() {
  stream_ = cuda::make_stream();       // compute: every op, upload, download, copy
  comm_stream_ = cuda::make_stream();  // NCCL all-reduce of buckets, overlapping backward
  copy_stream_ = cuda::make_stream();  // uploads ahead, overlapping the step
  ready_ = cuda::make_event();
  computed_ = cuda::make_event();
  for (cuda::Event& e : uploaded_) e = cuda::make_event();
  for (cuda::Event& e : downloaded_) e = cuda::make_event();
  void* slots = nullptr;
  DP_CUDA_CHECK(cudaMallocHost(&slots, kDownloadSlots * kDownloadBytes));
  downloads_ = cuda::PinnedHost(slots);
  void* bounce = nullptr;
  DP_CUDA_CHECK(cudaMallocHost(&bounce, kBounceBytes));
  bounce_ = cuda::PinnedHost(bounce);
  cublas_ = make_cublas(stream_.get());
  CudaOps::Lane side{};  // none, unless DP_CUDA_STREAMS=2 (CudaOps::streams_wanted)
  if (CudaOps::streams_wanted() == 2) {
    side_stream_ = cuda::make_stream();
    side_cublas_ = make_cublas(side_stream_.get());
    side = {side_stream_.get(), side_cublas_.get()};
  }
  cudnnHandle_t dnn = nullptr;
  DP_CUDNN_CHECK(cudnnCreate(&dnn));
  cudnn_ = cuda::CudnnHandle(dnn);
  DP_CUDNN_CHECK(cudnnSetStream(dnn, stream_.get()));
  open_pool();
  scratch_ = alloc(sizeof(CudaOps::Scratch), Category::workspace);  // booked like every byte
  ops_ = std::make_unique<CudaOps>(stream_.get(), cublas_.get(), dnn, static_cast<CudaOps::Scratch*>(scratch_.data()),
                                   side);
}

void CudaDevice::close() noexcept {
  abandon_capture();
  if (stream_) DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(stream_.get()));
  if (comm_stream_) DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(comm_stream_.get()));
  if (copy_stream_) DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(copy_stream_.get()));
  if (side_stream_) DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(side_stream_.get()));
  for (cuda::GraphExec& g : graphs_) g.reset();
  ops_.reset();  // its cuDNN descriptors first: it borrows the handles and the scratch below
  scratch_.reset();
  bounce_.reset();
  cudnn_.reset();
  cublas_.reset();
  side_cublas_.reset();
  cublas_workspace_.reset();  // after the handles that used them
  side_cublas_workspace_.reset();
  side_stream_.reset();
  ready_.reset();
  computed_.reset();
  for (cuda::Event& e : uploaded_) e.reset();
  for (cuda::Event& e : downloaded_) e.reset();
  downloads_.reset();
  for (MarkSet& m : own_marks_) m = {};
  for (MarkSet& m : graph_marks_) m = {};
  capture_marks_ = {};
  copy_stream_.reset();
  comm_stream_.reset();
  stream_.reset();
}

Ops& CudaDevice::ops() {
  if (!ops_) throw DeviceError(id(), name() + " has no kernels: it failed to start or is shutting down");
  return *ops_;
}

void CudaDevice::upload(void* dst, const void* src_host, size_t bytes) {
  refuse_while_capturing("an upload from host memory");
  if (bytes == 0) return;
  DeviceGuard guard(id());
  copy_from_host(dst, src_host, bytes, stream_.get());
}

void CudaDevice::copy_from_host(void* dst, const void* src_host, size_t bytes, cudaStream_t stream) {
  if (pageable(src_host)) wait_stream(stream);
  DP_CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, stream));
}

std::shared_ptr<void> CudaDevice::pin_host(void* p, size_t bytes) {
  if (bytes == 0) return nullptr;
  DeviceGuard guard(id());
  if (const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable); err != cudaSuccess) {
    // Not fatal: uploads from pageable memory work, only slower. Said once per buffer.
    (void)cudaGetLastError();
    std::fprintf(stderr, "note: %s: cudaHostRegister of %s failed (%s); its uploads stage through pageable memory\n",
                 name().c_str(), format_bytes(int64_t(bytes)).c_str(), cudaGetErrorString(err));
    return nullptr;
  }
  // Unregistered when the last copy of the handle goes, which is after the loader's last upload
  // from it was waited for (Engine::step returns after its download).
  return std::shared_ptr<void>(p, [](void* q) { DP_CUDA_CHECK_PRINT(cudaHostUnregister(q)); });
}

void CudaDevice::download(void* dst_host, const void* src, size_t bytes) {
  refuse_while_capturing("a download to host memory");
  if (bytes == 0) return;
  DeviceGuard guard(id());
  std::lock_guard lock(bounce_mu_);
  const size_t chunk = std::min(bytes, kBounceBytes);
  for (size_t done = 0; done < bytes; done += chunk) {
    const size_t n = std::min(chunk, bytes - done);
    DP_CUDA_CHECK(
        cudaMemcpyAsync(bounce_.get(), static_cast<const char*>(src) + done, n, cudaMemcpyDeviceToHost, stream_.get()));
    wait_stream(stream_.get());  // behind NCCL's kernels, perhaps: polls while a watch is set
    std::memcpy(static_cast<char*>(dst_host) + done, bounce_.get(), n);
  }
}

void CudaDevice::download_async(int slot, const void* src, size_t bytes) {
  refuse_while_capturing("a download to host memory");
  check_download(slot, bytes);
  DeviceGuard guard(id());
  if (const auto delay = failpoint::step_end_delay(*this); delay.count() > 0)  // the test build's slow step
    DP_CUDA_CHECK(cudaLaunchHostFunc(stream_.get(), sleep_ms, reinterpret_cast<void*>(intptr_t(delay.count()))));
  char* to = download_slot(slot);
  std::memset(to, 0xff, kDownloadBytes);  // NaN as floats until the copy lands: a read before it shows
  if (bytes) DP_CUDA_CHECK(cudaMemcpyAsync(to, src, bytes, cudaMemcpyDeviceToHost, stream_.get()));
  DP_CUDA_CHECK(cudaEventRecord(downloaded_[slot].get(), stream_.get()));
}

void CudaDevice::download_wait(int slot, void* dst_host, size_t bytes) {
  check_download(slot, bytes);
  DeviceGuard guard(id());
  wait_event(downloaded_[slot].get());
  if (bytes) std::memcpy(dst_host, download_slot(slot), bytes);
}

void CudaDevice::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(id());
  DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_.get()));
}

void CudaDevice::wait_for(const CudaDevice& other) {
  if (&other == this) return;
  std::lock_guard lock(other.ready_mu_);
  {
    DeviceGuard on_other(other.id());  // the event and the stream it is recorded on are other's
    DP_CUDA_CHECK(cudaEventRecord(other.ready_.get(), other.stream_.get()));
  }
  DeviceGuard on_this(id());
  DP_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), other.ready_.get(), 0));  // may cross devices
}

void CudaDevice::enable_peer_access(const CudaDevice& peer) {
  std::lock_guard lock(peer_mu_);
  if (std::find(peers_seen_.begin(), peers_seen_.end(), &peer) != peers_seen_.end()) return;
  int can = 0;
  DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, id(), peer.id()));
  if (can) {  // otherwise cudaMemcpyPeerAsync still works, staged through the host
    if (cudaError_t err = cudaDeviceEnablePeerAccess(peer.id(), 0); err == cudaErrorPeerAccessAlreadyEnabled)
      (void)cudaGetLastError();  // by another CudaDevice on this GPU, or by NCCL
    else
      DP_CUDA_CHECK_NAMED(err, "cudaDeviceEnablePeerAccess(peer.id(), 0)");
    if (peer.pool_) {
      cudaMemAccessDesc access{};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = id();
      access.flags = cudaMemAccessFlagsProtReadWrite;
      DP_CUDA_CHECK(cudaMemPoolSetAccess(peer.pool_.get(), &access, 1));
    }
  }
  peers_seen_.push_back(&peer);  // once all of it succeeded: a failure is met again at the next copy
}

void CudaDevice::copy_from_peer(void* dst, const Device& src_device, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const auto* peer = dynamic_cast<const CudaDevice*>(&src_device);
  if (!peer) throw DeviceError(id(), "copy_from_peer: " + src_device.name() + " is not a CUDA device");
  DeviceGuard guard(id());
  wait_for(*peer);
  if (peer->id() == id()) {
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_.get()));
  } else {
    enable_peer_access(*peer);
    DP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, id(), src, peer->id(), bytes, stream_.get()));
  }
}

void CudaDevice::synchronize() {
  refuse_while_capturing("a host wait for the device");  // cudaErrorStreamCaptureUnsupported
  DeviceGuard guard(id());
  wait_stream(copy_stream_.get());
  wait_stream(stream_.get());
}

void CudaDevice::upload_ahead(int slot, void* dst, const void* src_host, size_t bytes) {
  check_upload_slot(slot);
  DeviceGuard guard(id());
  DP_CUDA_CHECK(cudaEventRecord(computed_.get(), stream_.get()));
  DP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_.get(), computed_.get(), 0));
  if (const auto delay = failpoint::upload_delay(*this); delay.count() > 0)  // the test build's slow copy engine
    DP_CUDA_CHECK(cudaLaunchHostFunc(copy_stream_.get(), sleep_ms, reinterpret_cast<void*>(intptr_t(delay.count()))));
  if (bytes) copy_from_host(dst, src_host, bytes, copy_stream_.get());  // pageable where pin_host failed
  DP_CUDA_CHECK(cudaEventRecord(uploaded_[slot].get(), copy_stream_.get()));
}

void CudaDevice::await_upload(int slot) {
  check_upload_slot(slot);
  if (capturing()) return;  // launch waits: an event recorded outside a capture cannot be waited on inside it
  DeviceGuard guard(id());
  DP_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), uploaded_[slot].get(), 0));
}

// The copy stream's uploads are ordered after the compute stream's work (upload_ahead), NCCL's kernels
// perhaps, which a failure that did not abort the communicators yet may leave waiting: so within the
// watch's deadline, whatever the abort flag says (the uploads must be done before their memory goes).
void CudaDevice::finish_uploads() noexcept {
  if (!copy_stream_) return;
  DeviceGuard guard(id());
  const std::shared_ptr<const Watch> watch = current_watch();
  if (!watch) {  // no NCCL: the compute stream's work ends
    DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(copy_stream_.get()));
    return;
  }
  try {
    cudaStream_t copies = copy_stream_.get();
    poll_until([copies] { return stream_idle(copies); }, [] { return false; }, Deadline::after(watch->timeout), id(),
               [] { return std::string("the uploads ahead, behind the compute stream's work"); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp: %s: %s\n", name().c_str(), e.what());
  }
}

void CudaDevice::set_watch(std::shared_ptr<const Watch> watch) {
  std::lock_guard lock(watch_mu_);
  watch_ = std::move(watch);
}

std::shared_ptr<const CudaDevice::Watch> CudaDevice::current_watch() {
  std::lock_guard lock(watch_mu_);
  return watch_;
}

void CudaDevice::wait_until(const std::function<bool()>& done, const std::function<void()>& block) {
  const std::shared_ptr<const Watch> watch = current_watch();
  if (!watch) return block();
  poll_until(done, watch->aborted, Deadline::after(watch->timeout), id(), watch->what);
}

void CudaDevice::wait_stream(cudaStream_t stream) {
  wait_until([stream] { return stream_idle(stream); }, [stream] { DP_CUDA_CHECK(cudaStreamSynchronize(stream)); });
}

void CudaDevice::wait_event(cudaEvent_t event) {
  wait_until([event] { return event_done(event); }, [event] { DP_CUDA_CHECK(cudaEventSynchronize(event)); });
}

bool stream_idle(cudaStream_t stream) { return query_done(cudaStreamQuery(stream), "cudaStreamQuery(stream)"); }

void CudaDevice::clear_marks(int set) {
  check_mark_set(set);
  MarkSet& m = own_marks_[set];
  m.used = 0;
  m.anchored = false;
  sets_[set] = &m;
  set_ = set;
}

int CudaDevice::mark() {
  DeviceGuard guard(id());
  MarkSet& m = *sets_[set_];
  if (m.used == m.events.size()) {
    cudaEvent_t e = nullptr;
    DP_CUDA_CHECK(cudaEventCreate(&e));  // timing on: cudaEventElapsedTime reads it
    m.events.emplace_back(e);
  }
  if (m.used == 0) m.first = std::chrono::steady_clock::now();
  // Inside a capture an event-record node, which only the external flag lets the host time.
  DP_CUDA_CHECK(
      cudaEventRecordWithFlags(m.events[m.used].get(), stream_.get(), capturing() ? cudaEventRecordExternal : 0));
  return int(m.used++);
}

std::chrono::steady_clock::time_point CudaDevice::mark_time(int set, int i) {
  check_mark_set(set);
  MarkSet* m = sets_[set];
  if (i < 0 || size_t(i) >= m->used)
    throw DeviceError(id(), "mark_time: no mark " + std::to_string(i) + " in set " + std::to_string(set));
  if (!m->anchored) {  // once a set: its first mark's time moves the set's every mark
    m->first = std::max(m->first, reached_);
    m->anchored = true;
  }
  auto t = m->first;
  if (i > 0) {
    DeviceGuard guard(id());
    float ms = 0;
    DP_CUDA_CHECK(cudaEventElapsedTime(&ms, m->events[0].get(), m->events[size_t(i)].get()));
    t += std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double, std::milli>(ms));
  }
  reached_ = std::max(reached_, t);
  return t;
}

bool cuda_built() { return true; }

CudaProbe probe_cuda() {
  try {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      // cudaDriverGetVersion answers 0 where no driver is installed: the runtime's "CUDA driver version
      // is insufficient" would then blame a driver that is not there.
      int driver = 0, runtime = 0;
      if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
      if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
      (void)cudaGetLastError();
      auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
      if (driver == 0) return {0, "no CUDA driver installed (no libcuda)"};
      if (err == cudaErrorInsufficientDriver)
        return {0, "the CUDA driver supports CUDA " + version(driver) + ", older than this build's runtime (" +
                       version(runtime) + ")"};
      return {0, std::string("no CUDA device: ") + cudaGetErrorString(err)};
    }
    if (count <= 0) return {0, "no CUDA device found"};
    return {count, ""};
  } catch (...) {
    return {0, "the CUDA probe failed"};
  }
}

std::unique_ptr<Device> make_cuda_device(int rank, int id, int64_t memory_cap) {
  CudaProbe probe = probe_cuda();
  if (id < 0 || id >= probe.count)
    throw UsageError("device " + std::to_string(id) + ": not a usable CUDA device (" +
                     (probe.count > 0 ? "ids are 0.." + std::to_string(probe.count - 1) : probe.reason) + ")");
  return std::make_unique<CudaDevice>(rank, id, memory_cap);
}

}  // namespace dp
