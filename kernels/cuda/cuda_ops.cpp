// CudaOps' own state: the handles and the scratch memory it borrows from its device.
// The ops themselves live in the .cu files of this directory, one per op family.
#include "kernels/cuda/cuda_ops.h"

namespace dp {

CudaOps::CudaOps(cudaStream_t stream, cublasHandle_t cublas, cudnnHandle_t cudnn, Scratch* scratch)
    : stream_(stream), cublas_(cublas), cudnn_(cudnn), scratch_(scratch), flag_(&scratch->flag) {
  implicit_wanted();  // a DP_CUDA_CONV it does not know fails here, before any step
  DP_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(Scratch), stream_));  // xent_done starts at 0
}

CudaOps::~CudaOps() = default;

}  // namespace dp
