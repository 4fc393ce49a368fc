// Average and max pooling with a k x k window and stride k (PyTorch's defaults for both).
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace dp {

void CpuOps::avgpool_forward(const PoolShape& s, const float* x, float* y) {
  const int oh = s.out_h(), ow = s.out_w();
  const float inv = 1.0f / float(s.k * s.k);
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const float* xp = x + p * s.h * s.w;  // (H, W)
    float* yp = y + p * oh * ow;          // (OH, OW)
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        float acc = 0.0f;
        for (int a = 0; a < s.k; ++a)
          for (int b = 0; b < s.k; ++b) acc += xp[(i * s.k + a) * s.w + j * s.k + b];
        yp[i * ow + j] = acc * inv;
      }
  }
}

void CpuOps::avgpool_backward(const PoolShape& s, const float* dy, float* dx) {
  const int oh = s.out_h(), ow = s.out_w();
  const float inv = 1.0f / float(s.k * s.k);
  std::memset(dx, 0, sizeof(float) * s.n * s.c * s.h * s.w);  // rows/cols past oh*k stay zero
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const float* dyp = dy + p * oh * ow;
    float* dxp = dx + p * s.h * s.w;
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        float g = dyp[i * ow + j] * inv;
        for (int a = 0; a < s.k; ++a)
          for (int b = 0; b < s.k; ++b) dxp[(i * s.k + a) * s.w + j * s.k + b] = g;
      }
  }
}

void CpuOps::maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) {
  const int oh = s.out_h(), ow = s.out_w();
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const float* xp = x + p * s.h * s.w;
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        int best = (i * s.k) * s.w + j * s.k;
        for (int a = 0; a < s.k; ++a)
          for (int b = 0; b < s.k; ++b) {
            int idx = (i * s.k + a) * s.w + j * s.k + b;
            if (xp[idx] > xp[best]) best = idx;  // first maximum wins, as in PyTorch
          }
        y[p * oh * ow + i * ow + j] = xp[best];
        argmax[p * oh * ow + i * ow + j] = best;
      }
  }
}

void CpuOps::maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) {
  const int64_t outs = int64_t(s.out_h()) * s.out_w();
  std::memset(dx, 0, sizeof(float) * s.n * s.c * s.h * s.w);
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p)
    for (int64_t o = 0; o < outs; ++o) dx[p * s.h * s.w + argmax[p * outs + o]] += dy[p * outs + o];
}

}  // namespace dp
