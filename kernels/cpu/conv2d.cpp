// Convolution as im2col + GEMM, one image at a time (stride 1, symmetric zero padding).
#include <algorithm>

#include "kernels/cpu/kernels.h"

namespace dp::cpu {
namespace {

// col(C*KH*KW, OH*OW) from one image x(C, H, W).
template <class T>
void im2col(const ConvShape& s, const T* x, T* col) {
  const int oh = s.out_h(), ow = s.out_w();
  for (int c = 0; c < s.c; ++c)
    for (int i = 0; i < s.kh; ++i)
      for (int j = 0; j < s.kw; ++j) {
        T* row = col + ((int64_t(c) * s.kh + i) * s.kw + j) * oh * ow;  // (OH, OW)
        for (int y = 0; y < oh; ++y) {
          int iy = y + i - s.pad;
          for (int x_ = 0; x_ < ow; ++x_) {
            int ix = x_ + j - s.pad;
            bool inside = iy >= 0 && iy < s.h && ix >= 0 && ix < s.w;
            row[y * ow + x_] = inside ? x[(int64_t(c) * s.h + iy) * s.w + ix] : T(0);
          }
        }
      }
}

// The adjoint of im2col: dx(C, H, W) = sum of the columns that read each pixel.
template <class T>
void col2im(const ConvShape& s, const T* col, T* dx) {
  const int oh = s.out_h(), ow = s.out_w();
  std::fill_n(dx, int64_t(s.c) * s.h * s.w, T(0));
  for (int c = 0; c < s.c; ++c)
    for (int i = 0; i < s.kh; ++i)
      for (int j = 0; j < s.kw; ++j) {
        const T* row = col + ((int64_t(c) * s.kh + i) * s.kw + j) * oh * ow;  // (OH, OW)
        for (int y = 0; y < oh; ++y) {
          int iy = y + i - s.pad;
          if (iy < 0 || iy >= s.h) continue;
          for (int x_ = 0; x_ < ow; ++x_) {
            int ix = x_ + j - s.pad;
            if (ix >= 0 && ix < s.w) dx[(int64_t(c) * s.h + iy) * s.w + ix] += row[y * ow + x_];
          }
        }
      }
}

}  // namespace

int64_t conv2d_workspace_size(const ConvShape& s) {
  return 2 * s.col_rows() * s.col_cols();  // col and dcol of one image
}

template <class T>
void conv2d_forward(const ConvShape& s, const T* x, const T* w, const T* b, T* y, T* ws) {
  const int64_t rows = s.col_rows(), cols = s.col_cols();
  T* col = ws;  // (C*KH*KW, OH*OW)
  for (int n = 0; n < s.n; ++n) {
    const T* xn = x + int64_t(n) * s.c * s.h * s.w;  // (C, H, W)
    T* yn = y + int64_t(n) * s.k * cols;             // (K, OH*OW)
    im2col(s, xn, col);
    for (int k = 0; k < s.k; ++k)
      for (int64_t p = 0; p < cols; ++p) yn[k * cols + p] = b[k];
    gemm(false, false, s.k, int(cols), int(rows), T(1), w, col, T(1), yn);  // y += W col
  }
}

template <class T>
void conv2d_backward(const ConvShape& s, const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, T* ws) {
  const int64_t rows = s.col_rows(), cols = s.col_cols();
  T* col = ws;                 // (C*KH*KW, OH*OW)
  T* dcol = ws + rows * cols;  // (C*KH*KW, OH*OW)
  std::fill_n(dw, s.k * rows, T(0));
  std::fill_n(db, s.k, T(0));
  for (int n = 0; n < s.n; ++n) {
    const T* xn = x + int64_t(n) * s.c * s.h * s.w;  // (C, H, W)
    const T* dyn = dy + int64_t(n) * s.k * cols;     // (K, OH*OW)
    im2col(s, xn, col);
    gemm(false, true, s.k, int(rows), int(cols), T(1), dyn, col, T(1), dw);  // dw += dy col^T
    for (int k = 0; k < s.k; ++k) {
      T acc = T(0);
      for (int64_t p = 0; p < cols; ++p) acc += dyn[k * cols + p];
      db[k] += acc;
    }
    if (dx) {
      gemm(true, false, int(rows), int(cols), s.k, T(1), w, dyn, T(0), dcol);  // W^T dy
      col2im(s, dcol, dx + int64_t(n) * s.c * s.h * s.w);
    }
  }
}

#define DP_INSTANTIATE(T)                                                                  \
  template void conv2d_forward<T>(const ConvShape&, const T*, const T*, const T*, T*, T*); \
  template void conv2d_backward<T>(const ConvShape&, const T*, const T*, const T*, T*, T*, T*, T*);
DP_INSTANTIATE(float)
DP_INSTANTIATE(double)
#undef DP_INSTANTIATE

}  // namespace dp::cpu
