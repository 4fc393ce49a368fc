// A CUDA device's memory (cuda_device.h): a pool of its own on its GPU, allocations and frees in the
// order of its compute stream, and out of memory said with the driver's and the ledger's view.
#include <cstdint>
#include <string>

#include "engine/cuda/cuda_device.h"
#include "engine/error.h"
#include "kernels/cuda/check.h"

namespace dp {

void CudaDevice::open_pool() {
  int supported = 0;
  DP_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, id()));
  if (!supported) return;  // cudaMalloc and cudaFree
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = id();
  cudaMemPool_t pool = nullptr;
  DP_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  pool_ = cuda::MemPool(pool);
  // Kept, not handed back to the driver at each synchronisation (the default threshold, 0, would):
  // the next step allocates the same buffers again.
  uint64_t keep = UINT64_MAX;
  DP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
}

void* CudaDevice::raw_alloc(size_t bytes) {
  refuse_while_capturing("an allocation");
  DeviceGuard guard(id());
  if (pool_) return pool_alloc(bytes);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    out_of_memory("cudaMalloc", bytes);
  }
  DP_CUDA_CHECK_NAMED(err, "cudaMalloc(&p, bytes)");
  return p;
}

// On the compute stream: usable at once by the work enqueued after it there, and by other streams
// and GPUs once they are ordered after that work (the Buffer contract). Out of memory, the pool may
// hold enough in pieces of other sizes: freed to the driver (after the stream's frees so far
// complete), then tried once more.
void* CudaDevice::pool_alloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, pool_.get(), stream_.get());
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    wait_stream(stream_.get());
    DP_CUDA_CHECK(cudaMemPoolTrimTo(pool_.get(), 0));
    err = cudaMallocFromPoolAsync(&p, bytes, pool_.get(), stream_.get());
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      out_of_memory("cudaMallocFromPoolAsync", bytes);
    }
  }
  DP_CUDA_CHECK_NAMED(err, "cudaMallocFromPoolAsync(&p, bytes, pool_.get(), stream_.get())");
  return p;
}

void CudaDevice::out_of_memory(const char* call, size_t bytes) {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
  throw OutOfMemory(id(), std::string(call) + " of " + format_bytes(int64_t(bytes)) + " on " + name() +
                              " failed: the driver reports " + format_bytes(int64_t(free)) + " free of " +
                              format_bytes(int64_t(total)) + " (the ledger: " + ledger().snapshot().describe() + ")");
}

// Returns at once with a pool: the memory goes back to the pool when the compute stream's work
// enqueued so far is done, and a later allocation on that stream may take it.
void CudaDevice::raw_free(void* p) noexcept {
  DeviceGuard guard(id());
  if (pool_)
    DP_CUDA_CHECK_PRINT(cudaFreeAsync(p, stream_.get()));  // after close(), the legacy stream's order
  else
    DP_CUDA_CHECK_PRINT(cudaFree(p));
}

CudaDevice::PoolMemory CudaDevice::pool_memory() {
  PoolMemory m;
  if (!pool_) return m;
  DeviceGuard guard(id());
  auto get = [this](cudaMemPoolAttr attr) {
    uint64_t v = 0;
    DP_CUDA_CHECK(cudaMemPoolGetAttribute(pool_.get(), attr, &v));
    return size_t(v);
  };
  m.reserved = get(cudaMemPoolAttrReservedMemCurrent);
  m.reserved_high = get(cudaMemPoolAttrReservedMemHigh);
  m.used = get(cudaMemPoolAttrUsedMemCurrent);
  return m;
}

}  // namespace dp
