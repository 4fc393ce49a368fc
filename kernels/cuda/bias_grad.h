// A convolution's db (K), each channel's N P values summed in a fixed order, no atomics: the same bits
// every run. One block would leave an H100 idle (LeNet has 20 to 50 channels, the H100 132 SMs), so
// each channel's values are cut into CudaOps::kBiasSlices contiguous slices, a block of cuda::kThreads
// each (block b = ch kBiasSlices + slice): a thread adds its values j = begin + thread, + blockDim, ...
// in turn, then a tree in shared memory gives the slice's partial; then each channel's partials are
// added in slice order. conv2d.cu's bias_grad reads dy; conv_act_pool.cu's backward kernel adds the
// values as it writes dy's rows, in the same order: the same db. Any order keeps the sum within
// gamma(N P) of the exact one, the bound the tests hold db to (tests/test_ops_conv.cpp).
#pragma once

#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"

namespace dp::cuda::bias {

constexpr int kSlices = CudaOps::kBiasSlices;

// This block's channel and its slice [begin, end) of the channel's `per_channel` values.
struct Slice {
  int ch;
  int64_t begin, end;
};
__device__ inline Slice slice_of(int64_t per_channel) {
  const int ch = int(blockIdx.x) / kSlices, slice = int(blockIdx.x) % kSlices;
  return {ch, per_channel * slice / kSlices, per_channel * (slice + 1) / kSlices};
}

// partial[block] = the block's threads' sums `acc`, added by a fixed tree in shared memory.
__device__ inline void write_partial(float acc, float* partial) {
  __shared__ float s[kThreads];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = int(blockDim.x) / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// Channel ch's partials in slice order (volatile: where other blocks of this grid wrote them).
__device__ inline float total(const volatile float* partial, int ch) {
  float sum = 0.0f;
  for (int slice = 0; slice < kSlices; ++slice) sum += partial[ch * kSlices + slice];
  return sum;
}

}  // namespace dp::cuda::bias
