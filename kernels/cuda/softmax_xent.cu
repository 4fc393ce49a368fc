// Softmax cross-entropy fused with its gradient, one warp per row, numerically stable (shifted by
// the row maximum). Twin of kernels/cpu/softmax_xent.cpp, through the same kernels/math.h formulas.
//
// Differences from the CPU, all within the tolerances of the op matrix (tests/test_ops_*.cpp): the row's sum of
// exponentials is added in a warp tree instead of left to right, device expf/logf are within 2 ulp
// of the host's, and the statistics are summed in a fixed order that is not the CPU's row order: each
// warp its rows, each block its warps, then the last block to finish adds the blocks' partials in
// block order (the threadFenceReduction pattern of CUDA's samples) and adds that to stats. The grid
// has at most kReduceBlocks blocks, looping over more rows, so the partials fit the device's scratch and
// the same n gives the same bits on every run (an atomicAdd per block would not: blocks finish in
// any order).
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"
#include "kernels/math.h"

namespace dp {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = cuda::kThreads / kWarp;
constexpr unsigned kAll = 0xffffffffu;

__global__ void softmax_xent_kernel(int n, int classes, const float* logits, const int32_t* labels, float scale,
                                    float* dlogits, float* stats, CudaOps::Scratch* scratch) {
  cuda::await_previous();
  __shared__ float warp_loss[kRowsPerBlock];
  __shared__ float warp_correct[kRowsPerBlock];
  __shared__ bool last;
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  float loss = 0.0f, correct = 0.0f;  // this warp's rows, in order (every lane the same)
  for (int64_t row = (int64_t(blockIdx.x) * kRowsPerBlock + warp); row < n; row += int64_t(gridDim.x) * kRowsPerBlock) {
    const float* z = logits + row * classes;  // (C): the whole warp takes this row together
    float* dz = dlogits + row * classes;      // (C)
    // Argmax by the CPU's order (math::argmax_beats, which holds in any order of comparisons): lanes
    // scan their columns in turn, then the warp's butterfly, so every lane ends with one column. (A
    // strict > let a lane whose first column is NaN keep it, and lanes end on different columns.)
    int best = lane < classes ? lane : 0;
    for (int j = lane + kWarp; j < classes; j += kWarp)
      if (math::argmax_beats(z, j, best)) best = j;
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const int other = __shfl_xor_sync(kAll, best, off);
      if (math::argmax_beats(z, other, best)) best = other;
    }
    const float m = z[best];
    float sum = 0.0f;
    for (int j = lane; j < classes; j += kWarp) sum += expf(z[j] - m);
    for (int off = kWarp / 2; off > 0; off /= 2) sum += __shfl_xor_sync(kAll, sum, off);
    const float log_sum = logf(__shfl_sync(kAll, sum, 0));  // every lane the same bits
    const int label = labels[row];
    loss += math::xent_loss(z[label], m, log_sum);  // read before dz is written, as the CPU does
    for (int j = lane; j < classes; j += kWarp) dz[j] = math::xent_grad(z[j], m, log_sum, j == label, scale);
    correct += best == label ? 1.0f : 0.0f;
  }
  if (lane == 0) {
    warp_loss[warp] = loss;
    warp_correct[warp] = correct;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float block_loss = 0.0f, block_correct = 0.0f;
    for (int w = 0; w < kRowsPerBlock; ++w) block_loss += warp_loss[w], block_correct += warp_correct[w];
    scratch->xent_partials[2 * blockIdx.x] = block_loss;
    scratch->xent_partials[2 * blockIdx.x + 1] = block_correct;
    last = cuda::last_block_done(&scratch->xent_done);
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    const volatile float* partials = scratch->xent_partials;  // written by other blocks: not from L1
    float total_loss = 0.0f, total_correct = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total_loss += partials[2 * b], total_correct += partials[2 * b + 1];
    stats[0] += total_loss * scale;
    stats[1] += total_correct;
  }
}

}  // namespace

void CudaOps::softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                           float* stats) {
  if (n == 0 || classes == 0) return;  // stats += 0
  const int rows_blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const unsigned blocks = unsigned(rows_blocks < kReduceBlocks ? rows_blocks : kReduceBlocks);
  cuda::launch("softmax_xent_kernel", softmax_xent_kernel, blocks, cuda::kThreads, 0, stream_, n, classes, logits,
               labels, scale, dlogits, stats, scratch_);
}

}  // namespace dp
