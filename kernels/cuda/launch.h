// Launch helpers: every kernel's launch (`launch`, and the wait each kernel begins with), and for the
// element-wise kernels grid-stride loops over int64 counts, a grid no larger than the device can keep
// busy, and never a zero-size grid (callers return early on n == 0).
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

// DP_CUDA_PDL (kernels/cuda/cuda_ops.cpp): whether kernels are launched programmatically dependent
// (below); 0, the default, or 1, read once per process.
bool programmatic();

// The virtual architecture (major x 10 + minor) dp's kernels run from on the current device, as
// cudaFuncGetAttributes' ptxVersion gives it for one of them (all are built with the same flags):
// below 90, await_previous() below compiled to nothing, so DP_CUDA_PDL=1 would race.
int kernels_ptx_version();

}  // namespace dp::cuda

#if defined(__CUDACC__)
#include <string>
#include <utility>

namespace dp::cuda {

// Programmatic dependent launch (compute capability 9.0 on; DP_CUDA_PDL=1, programmatic()): a
// kernel so launched may begin before the kernel before it on the stream is complete and its memory
// flushed: as soon as every block of that kernel has signalled (griddepcontrol.launch_dependents) or
// ended. This hides a launch's latency between two dependent kernels (in a graph too, as a
// programmatic edge). Every dp kernel therefore begins here: it waits for the kernel before it and that
// one's memory (griddepcontrol.wait, CUTLASS's wait_on_dependent_grids, Triton's gdc_wait) before it
// reads or writes anything, then signals, so that the next kernel's blocks are launched and waiting
// once all of this one's have started (in its last wave), which they may, as they wait in turn. A
// no-op without the launch attribute, and before sm_90. At most two kernels of a stream are in
// flight: the running one and the next, waiting. Nothing else overlaps: the same operations in the
// same order, the same bits.
__device__ __forceinline__ void await_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// kernel<<<grid, block, shared, stream>>>(args...) through cudaLaunchKernelEx, with the launch
// attribute above where programmatic(); a bad configuration is reported here, naming the kernel.
template <class... Params, class... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = shared, config.stream = stream;
  config.attrs = &attribute, config.numAttrs = programmatic() ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw_failure("CUDA", (std::string("launch of ") + name).c_str(), cudaGetErrorString(err), __FILE__, __LINE__);
  }
}

// A deterministic reduction over blocks (the threadFenceReduction pattern of CUDA's samples): thread
// 0 of each block writes its block's partials, then asks this; it is true in the last block to finish,
// which then adds every block's partials in block order (reading them through a volatile pointer:
// other blocks wrote them). `done` counts finished blocks and wraps back to 0 with the last one, so
// it is ready for the next launch (it starts zeroed: CudaOps' constructor clears its scratch).
__device__ inline bool last_block_done(unsigned* done) {
  __threadfence();  // this block's partials are visible to every block before the count says so
  const bool last = atomicInc(done, gridDim.x - 1) == gridDim.x - 1;
  // and the last block reads the others' after it: the samples' volatile loads alone are not
  // ordered after the count in PTX's memory model, a fence on this side too makes them so
  if (last) __threadfence();
  return last;
}

}  // namespace dp::cuda

// for (int64_t i = first index of this thread; i < n; i += all threads of the grid)
#define DP_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)
#endif
