// A CUDA device's host waits give up: while a watch is set (the NCCL communicator sets one), a wait
// for the stream polls, asks whether the job aborted and stops at its timeout, whatever the stream is
// stuck behind. tests/cuda/spin.h's kernel stands in for an NCCL collective waiting for a dead peer.
#include <doctest/doctest.h>

#include <chrono>
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
  auto watch = std::make_shared<CudaDevice::Watch>();
  watch->aborted = [] { return false; };
  watch->what = [] { return std::string("the spin kernel"); };
  watch->timeout = 0.5;
  cuda->set_watch(watch);
  SpinFlag flag;
  std::vector<float> host(1024);
  bool timed_out = false;
  const auto t0 = std::chrono::steady_clock::now();
  dev->run([&] {
       spin_on(cuda->stream(), flag, 20.0);
       try {
         dev->download(host.data(), buf.data(), host.size() * sizeof(float));
       } catch (const TimedOut&) {
         timed_out = true;
       }
     })
      .get();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  flag.release();
  cuda->set_watch(nullptr);
  dev->synchronize();
  CHECK(timed_out);
  CHECK(waited < 10.0);
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

}  // namespace
}  // namespace dp::test
