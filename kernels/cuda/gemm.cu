// Row-major GEMM over column-major cuBLAS; the same signature as kernels/cpu/gemm.cpp.
//
// A row-major (r, c) matrix is, byte for byte, the column-major (c, r) matrix, its transpose. So
// row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: hand cuBLAS B first, A second,
// and swap m and n. The leading dimensions are those of the matrices as stored (row length).
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

__global__ void scale_kernel(int64_t n, float beta, float* c) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { c[i] = beta == 0.0f ? 0.0f : beta * c[i]; }
}

}  // namespace

void CudaOps::gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
                   float* c) {
  gemm(main(), ta, tb, m, n, k, alpha, a, b, beta, c);
}

void CudaOps::gemm(const Lane& on, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b,
                   float beta, float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: C = beta * C, as the CPU twin (BLAS libraries disagree on this edge)
    const int64_t count = int64_t(m) * n;
    cuda::launch("scale_kernel", scale_kernel, cuda::blocks_for(count), cuda::kThreads, 0, on.stream, count, beta, c);
    return;
  }
  // A stored (m, k), or (k, m) when transposed; B stored (k, n), or (n, k) when transposed
  gemm_ld(on, ta, tb, m, n, k, alpha, a, ta ? m : k, b, tb ? k : n, beta, c);
}

void CudaOps::gemm_ld(const Lane& on, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                      const float* b, int ldb, float beta, float* c) {
  DP_CUBLAS_CHECK(cublasSgemm(on.cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                              &alpha, b, ldb, a, lda, &beta, c, n));
}

}  // namespace dp
