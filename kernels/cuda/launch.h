// Launch helpers for the element-wise kernels: grid-stride loops over int64 counts, a grid no larger
// than the device can keep busy, and never a zero-size grid (callers return early on n == 0).
#pragma once

#include <cstdint>

#include "kernels/cuda/check.h"

namespace dp::cuda {

inline constexpr int kThreads = 256;
// Enough blocks to fill an H100 (132 SMs x 2048 threads / 256) several times over; the grid-stride
// loops cover any n beyond that.
inline constexpr int64_t kMaxBlocks = 4096;

inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  return unsigned(b < kMaxBlocks ? (b > 0 ? b : 1) : kMaxBlocks);
}

}  // namespace dp::cuda

#if defined(__CUDACC__)
namespace dp::cuda {

// A deterministic reduction over blocks (the threadFenceReduction pattern of CUDA's samples): thread
// 0 of each block writes its block's partials, then asks this; it is true in the last block to finish,
// which then adds every block's partials in block order (reading them through a volatile pointer:
// other blocks wrote them). `done` counts finished blocks and wraps back to 0 with the last one, so
// it is ready for the next launch (it starts zeroed: CudaOps' constructor clears its scratch).
__device__ inline bool last_block_done(unsigned* done) {
  __threadfence();  // this block's partials are visible to every block before the count says so
  return atomicInc(done, gridDim.x - 1) == gridDim.x - 1;
}

}  // namespace dp::cuda

// for (int64_t i = first index of this thread; i < n; i += all threads of the grid)
#define DP_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)
#endif
