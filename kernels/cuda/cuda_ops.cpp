// CudaOps' own state: the handles and the scratch memory it borrows from its device, and its lanes.
// The ops themselves live in the .cu files of this directory, one per op family.
#include "kernels/cuda/cuda_ops.h"

#include <cstdlib>
#include <cstring>
#include <string>

namespace dp {

CudaOps::CudaOps(cudaStream_t stream, cublasHandle_t cublas, cudnnHandle_t cudnn, Scratch* scratch, Lane side)
    : stream_(stream),
      cublas_(cublas),
      cudnn_(cudnn),
      side_(side.stream ? side : Lane{stream, cublas}),
      scratch_(scratch),
      flag_(&scratch->flag) {
  implicit_wanted();  // a DP_CUDA_CONV it does not know fails here, before any step
  if (two_lanes()) forked_ = cuda::make_event(), joined_ = cuda::make_event();
  DP_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(Scratch), stream_));  // xent_done starts at 0
}

CudaOps::~CudaOps() = default;

// Read once per process: anything but 1 (the default) or 2 is refused, naming both.
int CudaOps::streams_wanted() {
  static const int wanted = [] {
    const char* v = std::getenv("DP_CUDA_STREAMS");
    if (!v || !*v || std::strcmp(v, "1") == 0) return 1;
    if (std::strcmp(v, "2") == 0) return 2;
    throw UsageError(std::string("DP_CUDA_STREAMS: '") + v +
                     "' is not a number of streams for the backward pass; use 1 (one stream, the default) or 2 "
                     "(the weight gradients on a second one), or unset it");
  }();
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

}  // namespace dp
