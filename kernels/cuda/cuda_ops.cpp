// CudaOps' own state: the handles and the scratch memory it borrows from its device, and its lanes.
// The ops themselves live in the .cu files of this directory, one per op family.
#include "kernels/cuda/cuda_ops.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/launch.h"

namespace dp {

namespace {

// DP_CUDA_PDL=1 needs the GPU's support (compute capability 9.0) and kernels that wait for the one
// before them (compiled for compute_90 on: launch.h's await_previous).
void refuse_programmatic_unless_supported() {
  const int device = cuda::current_device();
  int major = 0, minor = 0;
  DP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  DP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major < 9)
    throw UsageError("DP_CUDA_PDL=1: programmatic dependent launch needs compute capability 9.0 or later, and cuda:" +
                     std::to_string(device) + " has " + std::to_string(major) + "." + std::to_string(minor) +
                     "; unset it or use 0");
  if (const int ptx = cuda::kernels_ptx_version(); ptx < 90)
    throw UsageError("DP_CUDA_PDL=1: dp's kernels run on cuda:" + std::to_string(device) + " from compute_" +
                     std::to_string(ptx) +
                     " code, which cannot wait for the kernel before them (griddepcontrol, compute_90 on); "
                     "build with 90 in CMAKE_CUDA_ARCHITECTURES, or unset DP_CUDA_PDL");
}

}  // namespace

CudaOps::CudaOps(cudaStream_t stream, cublasHandle_t cublas, cudnnHandle_t cudnn, Scratch* scratch, Lane side)
    : stream_(stream),
      cublas_(cublas),
      cudnn_(cudnn),
      side_(side.stream ? side : Lane{stream, cublas}),
      scratch_(scratch),
      flag_(&scratch->flag) {
  implicit_wanted();  // a DP_CUDA_CONV or DP_CUDA_FUSE it does not know fails here, before any step
  fuse_wanted();
  if (cuda::programmatic()) refuse_programmatic_unless_supported();  // before any step, too
  if (two_lanes()) forked_ = cuda::make_event(), joined_ = cuda::make_event();
  DP_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(Scratch), stream_));  // xent_done starts at 0
}

CudaOps::~CudaOps() = default;

namespace cuda {

int env_choice(const char* name, std::initializer_list<const char*> choices, const char* refusal) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  int i = 0;
  for (const char* c : choices) {
    if (std::strcmp(v, c) == 0) return i;
    ++i;
  }
  throw UsageError(std::string(name) + ": '" + v + "' " + refusal);
}

// Read once per process, as DP_CUDA_STREAMS, DP_CUDA_FUSE and DP_CUDA_CONV.
bool programmatic() {
  static const bool wanted =
      env_choice("DP_CUDA_PDL", {"0", "1"},
                 "is not a choice of kernel launch; use 0 (each kernel launched once the one before it is complete, "
                 "the default) or 1 (programmatic dependent launch, compute capability 9.0 on), or unset it") == 1;
  return wanted;
}

}  // namespace cuda

// Read once per process.
int CudaOps::streams_wanted() {
  static const int wanted =
      1 + cuda::env_choice("DP_CUDA_STREAMS", {"1", "2"},
                           "is not a number of streams for the backward pass; use 1 (one stream, the default) or 2 "
                           "(the weight gradients on a second one), or unset it");
  return wanted;
}

// Read once per process.
bool CudaOps::fuse_wanted() {
  static const bool wanted =
      cuda::env_choice("DP_CUDA_FUSE", {"1", "0"},
                       "is not a choice of kernels; use 1 (the passes dp fuses as one kernel each, the default) or "
                       "0 (on the kernels each took before), or unset it") == 0;
  return wanted;
}

// Events recorded here order work; in a capture they become the graph's edges between the lanes.
void CudaOps::fork() {
  if (!two_lanes()) return;
  DP_CUDA_CHECK(cudaEventRecord(forked_.get(), stream_));
  DP_CUDA_CHECK(cudaStreamWaitEvent(side_.stream, forked_.get(), 0));
}

void CudaOps::join() {
  if (!two_lanes()) return;
  DP_CUDA_CHECK(cudaEventRecord(joined_.get(), side_.stream));
  DP_CUDA_CHECK(cudaStreamWaitEvent(stream_, joined_.get(), 0));
}

void CudaOps::Forked::join() {
  if (CudaOps* ops = std::exchange(ops_, nullptr)) ops->join();
}

CudaOps::Forked::~Forked() {
  try {
    join();
  } catch (const std::exception&) {  // an error of its own while another one unwinds: that one is thrown
  }
}

}  // namespace dp
