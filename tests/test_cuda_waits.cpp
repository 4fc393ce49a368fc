// A CUDA device's host waits give up: while a watch is set (the NCCL communicator sets one), a wait
// for the stream polls, asks whether the job aborted and stops at its timeout, whatever the stream is
// stuck behind; and freeing memory does not wait for the GPU at all. tests/cuda/spin.h's kernel stands
// in for an NCCL collective waiting for a dead peer, or for a reduce-scatter still running.
#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/wait.h"
#include "tests/backends.h"
#if DP_TESTS_CUDA
#include "engine/cuda/cuda_device.h"
#include "tests/cuda/spin.h"
#endif

namespace dp::test {
namespace {

#if DP_TESTS_CUDA
// `call` on the device's thread behind the spin kernel (20 s at most) on its compute stream, a watch of
// 0.5 s set: whether it threw TimedOut, and the seconds it took. The kernel is released, the watch
// unset and the device synchronized after.
struct Gave {
  bool timed_out = false;
  double seconds = 0;
};
Gave behind_stuck_kernel(Device& dev, CudaDevice& cuda, const std::function<void()>& call) {
  auto watch = std::make_shared<CudaDevice::Watch>();
  watch->aborted = [] { return false; };
  watch->what = [] { return std::string("the spin kernel"); };
  watch->timeout = 0.5;
  cuda.set_watch(watch);
  SpinFlag flag;
  Gave gave;
  const auto t0 = std::chrono::steady_clock::now();
  dev.run([&] {
       spin_on(cuda.stream(), flag, 20.0);
       try {
         call();
       } catch (const TimedOut&) {
         gave.timed_out = true;
       }
     })
      .get();
  gave.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  flag.release();
  cuda.set_watch(nullptr);
  dev.synchronize();
  return gave;
}
#endif

TEST_CASE("cuda: a download behind a stuck kernel gives up at the watch's timeout instead of blocking" *
          doctest::skip(!cuda_available())) {
#if DP_TESTS_CUDA
  // A copy into pageable host memory returns only when it is done, after the stuck kernel: the
  // thread would sit in the driver and the timeout never fire. download() lands in page-locked
  // memory and polls; this one must end with TimedOut after 0.5 s, long before the kernel's 20 s.
  auto dev = make_cuda_device(0, 0, 0);
  auto* cuda = dynamic_cast<CudaDevice*>(dev.get());
  REQUIRE(cuda != nullptr);
  Buffer buf = dev->alloc_floats(1024, Category::workspace);
  std::vector<float> host(1024);
  const Gave gave =
      behind_stuck_kernel(*dev, *cuda, [&] { dev->download(host.data(), buf.data(), host.size() * sizeof(float)); });
  CHECK(gave.timed_out);
  CHECK(gave.seconds < 10.0);
  // And with the stream free again, a download works and brings the bytes.
  std::vector<float> ones(1024, 1.0f);
  dev->run([&] {
       dev->upload(buf.data(), ones.data(), ones.size() * sizeof(float));
       dev->download(host.data(), buf.data(), host.size() * sizeof(float));
     })
      .get();
  CHECK(host == ones);
#else
  FAIL("a CUDA device is usable, but this build has no CUDA backend");
#endif
}

TEST_CASE("cuda: an upload ahead from pageable memory behind a stuck kernel gives up at the watch's timeout" *
          doctest::skip(!cuda_available())) {
#if DP_TESTS_CUDA
  // Where pin_host failed the batch stays pageable, and CUDA may hold the thread in such a copy until
  // the copy stream's work before it is done: here the spin kernel on the compute stream, which the
  // copy stream waits for. upload_ahead waits for that first, polled: TimedOut after 0.5 s, not 20 s.
  auto dev = make_cuda_device(0, 0, 0);
  auto* cuda = dynamic_cast<CudaDevice*>(dev.get());
  REQUIRE(cuda != nullptr);
  constexpr int64_t kFloats = int64_t(4) << 20;  // 16 MiB: more than the driver's staging takes at once
  Buffer buf = dev->alloc_floats(kFloats, Category::inputs);
  std::vector<float> host(size_t(kFloats), 1.0f);  // pageable
  const Gave gave = behind_stuck_kernel(
      *dev, *cuda, [&] { dev->upload_ahead(0, buf.data(), host.data(), host.size() * sizeof(float)); });
  CHECK(gave.timed_out);
  CHECK(gave.seconds < 10.0);
#else
  FAIL("a CUDA device is usable, but this build has no CUDA backend");
#endif
}

TEST_CASE("cuda: a free returns while the GPU is busy, and the memory is the pool's again for the next step" *
          doctest::skip(!cuda_available())) {
#if DP_TESTS_CUDA
  // zero2 and zero3 free a bucket or a layer's weights several times a step, one of them while the
  // next bucket's reduce-scatter runs; cudaFree would wait for everything on the GPU each time. The
  // pool's free is ordered on the compute stream and returns at once: here the stream is held busy
  // by the spin kernel (20 s at most) and the free must come back while it still is.
  auto dev = make_cuda_device(0, 0, 0);
  auto* cuda = dynamic_cast<CudaDevice*>(dev.get());
  REQUIRE(cuda != nullptr);
  REQUIRE_MESSAGE(cuda->pooled(), "this GPU has no memory pools (cudaDevAttrMemoryPoolsSupported is 0)");
  constexpr int64_t kFloats = int64_t(1) << 22;  // 16 MiB, as a LeNet step's largest bucket is a few MiB
  const int64_t booked = dev->ledger().snapshot().total;
  SpinFlag flag;
  bool busy_after_free = false;
  double free_seconds = 0;
  dev->run([&] {
       Buffer bucket = dev->alloc_floats(kFloats, Category::gradients);
       dev->ops().fill(kFloats, 1.0f, bucket.f());
       spin_on(cuda->stream(), flag, 20.0);
       const auto t0 = std::chrono::steady_clock::now();
       bucket = Buffer();
       free_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
       busy_after_free = cudaStreamQuery(cuda->stream()) == cudaErrorNotReady;
       (void)cudaGetLastError();
     })
      .get();
  flag.release();
  dev->synchronize();
  CHECK(busy_after_free);
  CHECK(free_seconds < 5.0);
  CHECK(dev->ledger().snapshot().total == booked);  // the ledger books what is allocated, not the pool
  // Steps after the first take the same memory from the pool: nothing more from the driver.
  const CudaDevice::PoolMemory first = cuda->pool_memory();
  CHECK(first.reserved >= size_t(kFloats) * sizeof(float));
  CHECK(first.used < size_t(kFloats) * sizeof(float));
  for (int step = 0; step < 5; ++step)
    dev->run([&] {
         Buffer bucket = dev->alloc_floats(kFloats, Category::gradients);
         dev->ops().fill(kFloats, 2.0f, bucket.f());
       })
        .get();
  dev->synchronize();
  const CudaDevice::PoolMemory later = cuda->pool_memory();
  CHECK(later.reserved_high == first.reserved_high);
  CHECK(later.used == first.used);
  // What the report shows as "pool held": at least every buffer the ledger booked at its peak.
  CHECK(dev->reserved_peak() == int64_t(later.reserved_high));
  CHECK(dev->reserved_peak() >= dev->ledger().snapshot().total_peak);
#else
  FAIL("a CUDA device is usable, but this build has no CUDA backend");
#endif
}

}  // namespace
}  // namespace dp::test
