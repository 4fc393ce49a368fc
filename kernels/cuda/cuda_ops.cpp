// CudaOps' own state: the handles it borrows from its device and the one small buffer it owns.
// The ops themselves live in the .cu files of this directory, one per op family.
#include "kernels/cuda/cuda_ops.h"

namespace dp {

CudaOps::CudaOps(Device& device, cudaStream_t stream, cublasHandle_t cublas, cudnnHandle_t cudnn)
    : device_(device), stream_(stream), cublas_(cublas), cudnn_(cudnn) {
  flag_ = device_.alloc(sizeof(int32_t), Category::workspace);  // (1) booked like every other byte
}

CudaOps::~CudaOps() = default;

}  // namespace dp
