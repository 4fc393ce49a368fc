// Row-major GEMM on BLIS (its CBLAS interface); the same signature as the cuBLAS wrapper in kernels/cuda/gemm.cu.
#include <cblas.h>

#include "kernels/cpu/kernels.h"

namespace dp::cpu {
namespace {

// cblas_?gemm by scalar type; row-major, so the leading dimensions are the stored row lengths.
void blas_gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
               float* c) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
              ta ? m : k, b, tb ? k : n, beta, c, n);
}
void blas_gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, const double* b, double beta,
               double* c) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
              ta ? m : k, b, tb ? k : n, beta, c, n);
}

}  // namespace

template <class T>
void gemm(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, const T* b, T beta, T* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: C = beta * C (BLAS implementations disagree on this edge)
    for (int64_t i = 0; i < int64_t(m) * n; ++i) c[i] = beta == T(0) ? T(0) : beta * c[i];
    return;
  }
  blas_gemm(ta, tb, m, n, k, alpha, a, b, beta, c);
}

template void gemm<float>(bool, bool, int, int, int, float, const float*, const float*, float, float*);
template void gemm<double>(bool, bool, int, int, int, double, const double*, const double*, double, double*);

}  // namespace dp::cpu
