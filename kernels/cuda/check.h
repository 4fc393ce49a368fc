// Error checks for CUDA, cuBLAS, cuDNN and NCCL calls. The throwing forms raise dp::DeviceError with
// the call's text, the library's error string, the current device and file:line; the *_PRINT twins
// write the same line to stderr and carry on (destructors, cleanup after a first failure).
//
// The device is the calling thread's current CUDA device: every thread that touches a CudaDevice has
// bound it first (the worker init, or CudaDevice's guard on other threads), so that is the device
// the failing call ran on. The macros name functions of the library they check, so a file includes
// that library's header before using them.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "kernels/error.h"

namespace dp::cuda {

inline int current_device() noexcept {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}

inline std::string describe_failure(const char* lib, const char* call, const std::string& what, const char* file,
                                    int line) {
  return std::string(lib) + " call " + call + " failed: " + what + " (cuda:" + std::to_string(current_device()) + ", " +
         file + ":" + std::to_string(line) + ")";
}

[[noreturn]] inline void throw_failure(const char* lib, const char* call, const std::string& what, const char* file,
                                       int line) {
  throw DeviceError(current_device(), describe_failure(lib, call, what, file, line));
}

inline void print_failure(const char* lib, const char* call, const std::string& what, const char* file,
                          int line) noexcept {
  try {
    std::fprintf(stderr, "dp: %s\n", describe_failure(lib, call, what, file, line).c_str());
  } catch (...) {
  }
}

}  // namespace dp::cuda

// cudaGetLastError() after a failed call clears the runtime's last-error slot, so that a later
// launch check does not report this (already handled) failure again. Sticky errors stay.
#define DP_CUDA_CHECK(call)                                                                      \
  do {                                                                                           \
    cudaError_t dp_err_ = (call);                                                                \
    if (dp_err_ != cudaSuccess) {                                                                \
      (void)cudaGetLastError();                                                                  \
      ::dp::cuda::throw_failure("CUDA", #call, cudaGetErrorString(dp_err_), __FILE__, __LINE__); \
    }                                                                                            \
  } while (0)

#define DP_CUDA_CHECK_PRINT(call)                                                                \
  do {                                                                                           \
    cudaError_t dp_err_ = (call);                                                                \
    if (dp_err_ != cudaSuccess) {                                                                \
      (void)cudaGetLastError();                                                                  \
      ::dp::cuda::print_failure("CUDA", #call, cudaGetErrorString(dp_err_), __FILE__, __LINE__); \
    }                                                                                            \
  } while (0)

// For an error already in hand (a stored result, a launch), named by `text`.
#define DP_CUDA_CHECK_NAMED(call, text)                                                         \
  do {                                                                                          \
    cudaError_t dp_err_ = (call);                                                               \
    if (dp_err_ != cudaSuccess) {                                                               \
      (void)cudaGetLastError();                                                                 \
      ::dp::cuda::throw_failure("CUDA", text, cudaGetErrorString(dp_err_), __FILE__, __LINE__); \
    }                                                                                           \
  } while (0)

// After every kernel launch: a bad configuration is reported here, at the launch that caused it.
// (A fault inside the kernel surfaces later, at the next synchronising call, as that call's error.)
#define DP_CUDA_LAUNCH_CHECK(kernel_name) DP_CUDA_CHECK_NAMED(cudaGetLastError(), "launch of " kernel_name)

#define DP_CUBLAS_CHECK(call)                                                                        \
  do {                                                                                               \
    cublasStatus_t dp_st_ = (call);                                                                  \
    if (dp_st_ != CUBLAS_STATUS_SUCCESS)                                                             \
      ::dp::cuda::throw_failure("cuBLAS", #call, cublasGetStatusString(dp_st_), __FILE__, __LINE__); \
  } while (0)

#define DP_CUBLAS_CHECK_PRINT(call)                                                                  \
  do {                                                                                               \
    cublasStatus_t dp_st_ = (call);                                                                  \
    if (dp_st_ != CUBLAS_STATUS_SUCCESS)                                                             \
      ::dp::cuda::print_failure("cuBLAS", #call, cublasGetStatusString(dp_st_), __FILE__, __LINE__); \
  } while (0)

#define DP_CUDNN_CHECK(call)                                                                      \
  do {                                                                                            \
    cudnnStatus_t dp_st_ = (call);                                                                \
    if (dp_st_ != CUDNN_STATUS_SUCCESS)                                                           \
      ::dp::cuda::throw_failure("cuDNN", #call, cudnnGetErrorString(dp_st_), __FILE__, __LINE__); \
  } while (0)

#define DP_CUDNN_CHECK_PRINT(call)                                                                \
  do {                                                                                            \
    cudnnStatus_t dp_st_ = (call);                                                                \
    if (dp_st_ != CUDNN_STATUS_SUCCESS)                                                           \
      ::dp::cuda::print_failure("cuDNN", #call, cudnnGetErrorString(dp_st_), __FILE__, __LINE__); \
  } while (0)

// ncclGetLastError carries NCCL's detailed message (which peer, which transport) when it has one.
#define DP_NCCL_CHECK(call)                                                                                 \
  do {                                                                                                      \
    ncclResult_t dp_st_ = (call);                                                                           \
    if (dp_st_ != ncclSuccess) {                                                                            \
      const char* dp_last_ = ncclGetLastError(nullptr);                                                     \
      ::dp::cuda::throw_failure("NCCL", #call,                                                              \
                                std::string(ncclGetErrorString(dp_st_)) +                                   \
                                    (dp_last_ && *dp_last_ ? std::string(": ") + dp_last_ : std::string()), \
                                __FILE__, __LINE__);                                                        \
    }                                                                                                       \
  } while (0)

#define DP_NCCL_CHECK_PRINT(call)                                                               \
  do {                                                                                          \
    ncclResult_t dp_st_ = (call);                                                               \
    if (dp_st_ != ncclSuccess)                                                                  \
      ::dp::cuda::print_failure("NCCL", #call, ncclGetErrorString(dp_st_), __FILE__, __LINE__); \
  } while (0)
