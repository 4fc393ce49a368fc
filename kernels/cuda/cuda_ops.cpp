// CudaOps' own state: the handles and the one-int flag it borrows from its device.
// The ops themselves live in the .cu files of this directory, one per op family.
#include "kernels/cuda/cuda_ops.h"

namespace dp {

CudaOps::CudaOps(cudaStream_t stream, cublasHandle_t cublas, cudnnHandle_t cudnn, int32_t* flag)
    : stream_(stream), cublas_(cublas), cudnn_(cudnn), flag_(flag) {}

CudaOps::~CudaOps() = default;

}  // namespace dp
