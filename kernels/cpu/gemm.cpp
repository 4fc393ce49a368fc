// Row-major GEMM on OpenBLAS; the same signature as the cuBLAS wrapper in kernels/cuda/gemm.cu.
#include <cblas.h>

#include "kernels/cpu/cpu_ops.h"

namespace dp {

CpuOps::CpuOps(int threads) : threads_(threads) {
  // OpenBLAS's thread count is process-wide; every simulated device asks for the same number.
  openblas_set_num_threads(threads_);
}

void CpuOps::gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a,
                  const float* b, float beta, float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: C = beta * C (BLAS implementations disagree on this edge)
    for (int64_t i = 0; i < int64_t(m) * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k,
              alpha, a, ta ? m : k, b, tb ? k : n, beta, c, n);
}

}  // namespace dp
