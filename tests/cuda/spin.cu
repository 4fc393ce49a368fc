// tests/cuda/spin.h's kernel.
#include "kernels/cuda/check.h"
#include "tests/cuda/spin.h"

namespace dp::test {
namespace {

__global__ void spin_kernel(const volatile int* flag, long long max_ns) {
  long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    if (*flag) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < max_ns);
}

}  // namespace

SpinFlag::SpinFlag() {
  void* p = nullptr;
  DP_CUDA_CHECK(cudaHostAlloc(&p, sizeof(int), cudaHostAllocMapped));
  host = static_cast<volatile int*>(p);
  *host = 0;
  DP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), p, 0));
}

// Released first, so that a test leaving by an error ends its kernel too (the free waits for the GPU).
SpinFlag::~SpinFlag() {
  release();
  DP_CUDA_CHECK_PRINT(cudaFreeHost(const_cast<int*>(host)));
}

void spin_on(cudaStream_t stream, const SpinFlag& flag, double max_seconds) {
  spin_kernel<<<1, 1, 0, stream>>>(flag.device, static_cast<long long>(max_seconds * 1e9));
  DP_CUDA_LAUNCH_CHECK("spin_kernel");
}

}  // namespace dp::test
