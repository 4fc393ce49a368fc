// Softmax cross-entropy fused with its gradient, one warp per row, numerically stable (shifted by
// the row maximum). Twin of kernels/cpu/softmax_xent.cpp, through the same kernels/math.h formulas.
//
// Differences from the CPU, all within the tolerances of the op matrix (tests/test_ops_*.cpp): the row's sum of
// exponentials is added in a warp tree instead of left to right, device expf/logf are within 2 ulp
// of the host's, and the loss statistic is summed per block in a fixed order, then added to stats
// with one atomicAdd per block (blocks land in any order: the loss's last bits may differ from run
// to run; the gradients do not).
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"
#include "kernels/math.h"

namespace dp {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = cuda::kThreads / kWarp;
constexpr unsigned kAll = 0xffffffffu;

__global__ void softmax_xent_kernel(int n, int classes, const float* logits, const int32_t* labels, float scale,
                                    float* dlogits, float* stats) {
  __shared__ float block_loss[kRowsPerBlock];
  __shared__ float block_correct[kRowsPerBlock];
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const int row = int(blockIdx.x) * kRowsPerBlock + warp;
  float row_loss = 0.0f, row_correct = 0.0f;
  if (row < n) {                                       // the whole warp takes this branch together
    const float* z = logits + int64_t(row) * classes;  // (C)
    float* dz = dlogits + int64_t(row) * classes;      // (C)
    // Argmax, first maximum wins (as the CPU's strict >): lanes scan their columns in order, then
    // the warp keeps the larger value, or the smaller index on a tie.
    int best = lane < classes ? lane : 0;
    for (int j = lane + kWarp; j < classes; j += kWarp)
      if (z[j] > z[best]) best = j;
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const int other = __shfl_xor_sync(kAll, best, off);
      if (z[other] > z[best] || (z[other] == z[best] && other < best)) best = other;
    }
    const float m = z[best];
    float sum = 0.0f;
    for (int j = lane; j < classes; j += kWarp) sum += expf(z[j] - m);
    for (int off = kWarp / 2; off > 0; off /= 2) sum += __shfl_xor_sync(kAll, sum, off);
    const float log_sum = logf(__shfl_sync(kAll, sum, 0));  // every lane the same bits
    const int label = labels[row];
    for (int j = lane; j < classes; j += kWarp) dz[j] = math::xent_grad(z[j], m, log_sum, j == label, scale);
    row_loss = math::xent_loss(z[label], m, log_sum);
    row_correct = best == label ? 1.0f : 0.0f;
  }
  if (lane == 0) {
    block_loss[warp] = row_loss;
    block_correct[warp] = row_correct;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float loss = 0.0f, correct = 0.0f;
    for (int w = 0; w < kRowsPerBlock; ++w) loss += block_loss[w], correct += block_correct[w];
    atomicAdd(&stats[0], loss * scale);
    atomicAdd(&stats[1], correct);
  }
}

}  // namespace

void CudaOps::softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                           float* stats) {
  if (n == 0 || classes == 0) return;  // stats += 0
  const unsigned blocks = unsigned((n + kRowsPerBlock - 1) / kRowsPerBlock);
  softmax_xent_kernel<<<blocks, cuda::kThreads, 0, stream_>>>(n, classes, logits, labels, scale, dlogits, stats);
  DP_CUDA_LAUNCH_CHECK("softmax_xent_kernel");
}

}  // namespace dp
