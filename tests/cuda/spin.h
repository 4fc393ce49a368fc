// A kernel for tests that holds a CUDA stream busy until the host says so: it stands in for an NCCL
// collective waiting for a peer that never comes. Built into dp_tests only (never into dp_train).
#pragma once

#include <cuda_runtime.h>

namespace dp::test {

// Page-locked host memory the GPU reads while the kernel spins: set *flag = 1 on the host to end it.
struct SpinFlag {
  SpinFlag();
  ~SpinFlag();
  SpinFlag(const SpinFlag&) = delete;
  SpinFlag& operator=(const SpinFlag&) = delete;
  void release() { *host = 1; }
  volatile int* host = nullptr;
  int* device = nullptr;  // the same memory, as the kernel sees it
};

// Enqueues on `stream` a one-thread kernel that returns once *flag.device is 1, or after about
// `max_seconds` of the GPU's clock, whichever comes first (so a test that fails still ends).
void spin_on(cudaStream_t stream, const SpinFlag& flag, double max_seconds);

}  // namespace dp::test
