// Move-only owners of CUDA, cuBLAS and cuDNN objects: streams, events, memory pools, library handles
// and cuDNN descriptors. Each is destroyed exactly once, with a printed (never thrown) error if that fails.
// Device memory is owned by dp::Buffer (engine/device.h), which also books it in the ledger.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <utility>

#include "kernels/cuda/check.h"

namespace dp::cuda {

template <class T, void (*Destroy)(T) noexcept>
class Unique {
 public:
  Unique() = default;
  explicit Unique(T h) : h_(h) {}
  ~Unique() { reset(); }
  Unique(Unique&& o) noexcept : h_(std::exchange(o.h_, T{})) {}
  Unique& operator=(Unique&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, T{});
    }
    return *this;
  }
  Unique(const Unique&) = delete;
  Unique& operator=(const Unique&) = delete;

  T get() const { return h_; }
  explicit operator bool() const { return h_ != T{}; }
  void reset() noexcept {
    if (h_ != T{}) Destroy(std::exchange(h_, T{}));
  }

 private:
  T h_{};
};

inline void destroy_stream(cudaStream_t s) noexcept { DP_CUDA_CHECK_PRINT(cudaStreamDestroy(s)); }
inline void destroy_event(cudaEvent_t e) noexcept { DP_CUDA_CHECK_PRINT(cudaEventDestroy(e)); }
inline void destroy_cublas(cublasHandle_t h) noexcept { DP_CUBLAS_CHECK_PRINT(cublasDestroy(h)); }
inline void destroy_cudnn(cudnnHandle_t h) noexcept { DP_CUDNN_CHECK_PRINT(cudnnDestroy(h)); }
inline void destroy_tensor_desc(cudnnTensorDescriptor_t d) noexcept {
  DP_CUDNN_CHECK_PRINT(cudnnDestroyTensorDescriptor(d));
}
inline void destroy_filter_desc(cudnnFilterDescriptor_t d) noexcept {
  DP_CUDNN_CHECK_PRINT(cudnnDestroyFilterDescriptor(d));
}
inline void destroy_conv_desc(cudnnConvolutionDescriptor_t d) noexcept {
  DP_CUDNN_CHECK_PRINT(cudnnDestroyConvolutionDescriptor(d));
}

inline void destroy_pinned(void* p) noexcept { DP_CUDA_CHECK_PRINT(cudaFreeHost(p)); }
inline void destroy_graph(cudaGraph_t g) noexcept { DP_CUDA_CHECK_PRINT(cudaGraphDestroy(g)); }
inline void destroy_graph_exec(cudaGraphExec_t g) noexcept { DP_CUDA_CHECK_PRINT(cudaGraphExecDestroy(g)); }
// Memory still allocated from the pool keeps it alive: the driver destroys it once that is freed.
inline void destroy_mem_pool(cudaMemPool_t p) noexcept { DP_CUDA_CHECK_PRINT(cudaMemPoolDestroy(p)); }

using Stream = Unique<cudaStream_t, destroy_stream>;
using Event = Unique<cudaEvent_t, destroy_event>;
using CublasHandle = Unique<cublasHandle_t, destroy_cublas>;
using CudnnHandle = Unique<cudnnHandle_t, destroy_cudnn>;
using TensorDesc = Unique<cudnnTensorDescriptor_t, destroy_tensor_desc>;
using FilterDesc = Unique<cudnnFilterDescriptor_t, destroy_filter_desc>;
using ConvDesc = Unique<cudnnConvolutionDescriptor_t, destroy_conv_desc>;
using PinnedHost = Unique<void*, destroy_pinned>;               // cudaMallocHost's page-locked host memory
using Graph = Unique<cudaGraph_t, destroy_graph>;               // a captured graph
using GraphExec = Unique<cudaGraphExec_t, destroy_graph_exec>;  // its instantiation, what is launched
using MemPool = Unique<cudaMemPool_t, destroy_mem_pool>;        // a stream-ordered allocator's pool

// A stream that never synchronises with the legacy default stream (work of other libraries or
// threads on stream 0 cannot serialise with ours). Created on the calling thread's current device.
inline Stream make_stream() {
  cudaStream_t s = nullptr;
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(s);
}

// Events only order work here; timing is off, which makes record and wait cheaper.
inline Event make_event() {
  cudaEvent_t e = nullptr;
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return Event(e);
}

inline TensorDesc make_tensor_desc(int n, int c, int h, int w) {
  cudnnTensorDescriptor_t d = nullptr;
  DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
  TensorDesc owned(d);
  DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w));
  return owned;
}

inline FilterDesc make_filter_desc(int k, int c, int kh, int kw) {
  cudnnFilterDescriptor_t d = nullptr;
  DP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
  FilterDesc owned(d);
  DP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, k, c, kh, kw));
  return owned;
}

}  // namespace dp::cuda
