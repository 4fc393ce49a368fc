// Convolution as im2col + GEMM, one image at a time (stride 1, symmetric zero padding).
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace dp {
namespace {

// col(C*KH*KW, OH*OW) from one image x(C, H, W).
void im2col(const ConvShape& s, const float* x, float* col) {
  const int oh = s.out_h(), ow = s.out_w();
  for (int c = 0; c < s.c; ++c)
    for (int i = 0; i < s.kh; ++i)
      for (int j = 0; j < s.kw; ++j) {
        float* row = col + ((int64_t(c) * s.kh + i) * s.kw + j) * oh * ow;
        for (int y = 0; y < oh; ++y) {
          int iy = y + i - s.pad;
          for (int x_ = 0; x_ < ow; ++x_) {
            int ix = x_ + j - s.pad;
            bool inside = iy >= 0 && iy < s.h && ix >= 0 && ix < s.w;
            row[y * ow + x_] = inside ? x[(int64_t(c) * s.h + iy) * s.w + ix] : 0.0f;
          }
        }
      }
}

// The adjoint of im2col: dx(C, H, W) = sum of the columns that read each pixel.
void col2im(const ConvShape& s, const float* col, float* dx) {
  const int oh = s.out_h(), ow = s.out_w();
  std::memset(dx, 0, sizeof(float) * s.c * s.h * s.w);
  for (int c = 0; c < s.c; ++c)
    for (int i = 0; i < s.kh; ++i)
      for (int j = 0; j < s.kw; ++j) {
        const float* row = col + ((int64_t(c) * s.kh + i) * s.kw + j) * oh * ow;
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

size_t CpuOps::conv2d_workspace_floats(const ConvShape& s) {
  return size_t(2 * s.col_rows() * s.col_cols());  // col and dcol of one image
}

void CpuOps::conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b,
                            float* y, float* ws) {
  const int64_t rows = s.col_rows(), cols = s.col_cols();
  float* col = ws;  // (C*KH*KW, OH*OW)
  for (int n = 0; n < s.n; ++n) {
    const float* xn = x + int64_t(n) * s.c * s.h * s.w;  // (C, H, W)
    float* yn = y + int64_t(n) * s.k * cols;              // (K, OH*OW)
    im2col(s, xn, col);
    for (int k = 0; k < s.k; ++k)
      for (int64_t p = 0; p < cols; ++p) yn[k * cols + p] = b[k];
    gemm(false, false, s.k, int(cols), int(rows), 1.0f, w, col, 1.0f, yn);
  }
}

void CpuOps::conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy,
                             float* dx, float* dw, float* db, float* ws) {
  const int64_t rows = s.col_rows(), cols = s.col_cols();
  float* col = ws;                // (C*KH*KW, OH*OW)
  float* dcol = ws + rows * cols;  // (C*KH*KW, OH*OW)
  std::memset(dw, 0, sizeof(float) * s.k * rows);
  std::memset(db, 0, sizeof(float) * s.k);
  for (int n = 0; n < s.n; ++n) {
    const float* xn = x + int64_t(n) * s.c * s.h * s.w;
    const float* dyn = dy + int64_t(n) * s.k * cols;  // (K, OH*OW)
    im2col(s, xn, col);
    gemm(false, true, s.k, int(rows), int(cols), 1.0f, dyn, col, 1.0f, dw);  // dw += dy col^T
    for (int k = 0; k < s.k; ++k) {
      float acc = 0.0f;
      for (int64_t p = 0; p < cols; ++p) acc += dyn[k * cols + p];
      db[k] += acc;
    }
    if (dx) {
      gemm(true, false, int(rows), int(cols), s.k, 1.0f, w, dyn, 0.0f, dcol);  // W^T dy
      col2im(s, dcol, dx + int64_t(n) * s.c * s.h * s.w);
    }
  }
}

}  // namespace dp
