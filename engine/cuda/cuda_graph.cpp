// The CUDA device's step graphs (cuda_device.h; Device::begin_capture): the compute stream captured
// in thread-local mode, one instantiated graph per upload slot, launched after that slot's uploads.
// Run on an H200 (docs/gpu.md).
#include <chrono>
#include <utility>

#include "engine/cuda/cuda_device.h"
#include "engine/error.h"
#include "kernels/cuda/check.h"

namespace dp {

// cuBLAS otherwise allocates its workspace as it likes (per graph, with cudaMallocAsync, since CUDA
// 12.2), and picks its GEMM kernels by the workspace it has: one buffer, booked, for every engine's
// steps, eager or graphs alike, so that the two run the same kernels (tests/test_graphs.cpp holds them
// to the same bits). 32 MiB: cuBLAS's recommendation for Hopper. The side lane's GEMMs run beside the
// stream's: a buffer of its own. Each is kept once cuBLAS has it, so where one failed (a --device-memory
// cap), a later engine's call gives what is still missing.
void CudaDevice::prepare_steps() {
  DeviceGuard guard(id());
  auto give = [this](cublasHandle_t handle, Buffer& kept) {
    if (kept) return;
    Buffer buffer = alloc(kCublasWorkspaceBytes, Category::workspace);
    DP_CUBLAS_CHECK(cublasSetWorkspace(handle, buffer.data(), kCublasWorkspaceBytes));
    kept = std::move(buffer);
  };
  give(cublas_.get(), cublas_workspace_);
  if (side_cublas_) give(side_cublas_.get(), side_cublas_workspace_);
}

void CudaDevice::begin_capture() {
  if (capture_thread_.load() != std::thread::id())
    throw DeviceError(id(), "begin_capture: a capture is already under way");
  DeviceGuard guard(id());
  DP_CUDA_CHECK(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
  capture_thread_.store(std::this_thread::get_id());
  capture_marks_.used = 0;  // the graph's marks: events of its own (launch)
  sets_[set_] = &capture_marks_;
}

void CudaDevice::end_capture(int slot) {
  check_upload_slot(slot);
  if (!capturing()) throw DeviceError(id(), "end_capture: this thread is not capturing");
  DeviceGuard guard(id());
  capture_thread_.store(std::thread::id());
  cudaGraph_t raw = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_.get(), &raw);
  cuda::Graph graph(raw);
  const bool freed = free_held();  // now on the stream, after the capture
  DP_CUDA_CHECK_NAMED(ended, "cudaStreamEndCapture(stream_.get(), &raw)");
  if (freed) refused("a free");
  cudaGraphExec_t exec = nullptr;
  DP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph.get(), 0));
  graphs_[slot] = cuda::GraphExec(exec);
  std::swap(graph_marks_[slot], capture_marks_);  // the events its nodes record
  graph_mark_count_[slot] = graph_marks_[slot].used;
}

// The capture is ended and whatever it made dropped; an error it left (the reason it failed, most
// likely already thrown, or one a cuBLAS or cuDNN call left behind) is cleared from the thread's
// last-error slot, so that the eager steps after do not report it as theirs.
void CudaDevice::abandon_capture() noexcept {
  if (!capturing()) return;
  capture_thread_.store(std::thread::id());
  DeviceGuard guard(id());
  cudaGraph_t raw = nullptr;
  (void)cudaStreamEndCapture(stream_.get(), &raw);
  (void)cudaGetLastError();
  if (raw) cuda::Graph drop(raw);
  free_held();
}

void CudaDevice::launch(int slot) {
  check_upload_slot(slot);
  if (!graphs_[slot]) no_graph(slot);
  DeviceGuard guard(id());
  DP_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), uploaded_[slot].get(), 0));
  // The step's marks are the graph's event-record nodes, counted from its launch (mark_time).
  MarkSet& m = graph_marks_[slot];
  m.used = graph_mark_count_[slot];
  m.first = std::chrono::steady_clock::now();
  m.anchored = false;
  sets_[set_] = &m;
  DP_CUDA_CHECK(cudaGraphLaunch(graphs_[slot].get(), stream_.get()));
}

}  // namespace dp
