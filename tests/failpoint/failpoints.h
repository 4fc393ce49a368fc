// The test build's failpoints (engine/failpoint.h): what a test arms in its own process. A dp_train the
// tests start (dp_train_failpoints) arms the same ones from its environment, as engine/failpoint.h
// lists. A release binary has none of this.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"

namespace dp::failpoint {

// The next kernel call (a forward or backward) on `dev` throws DeviceError "injected fault in
// <where>: <what>", naming the device.
void inject_fault(const Device& dev, std::string what);

// The next time `rank` of `comm` enters collective c it stops answering: it never arrives, and waits
// until a peer's timeout (or failure) aborts the collective, then throws Aborted.
void stall_once(const Communicator& comm, int rank, Collective c);

// While alive, every upload ahead on these devices first waits `delay` (a simulated device's copy
// thread sleeps, a CUDA device's copy stream runs a sleeping host function before the copy): a slow
// copy engine, so that a step reading a batch before its upload finished reads the wrong bytes.
class SlowUploads {
 public:
  SlowUploads(const std::vector<Device*>& devices, std::chrono::milliseconds delay);
  ~SlowUploads();
  SlowUploads(const SlowUploads&) = delete;
  SlowUploads& operator=(const SlowUploads&) = delete;

 private:
  std::vector<const Device*> devices_;
};

// While alive, every copy these simulated devices make from a peer first waits `delay` (a slow link):
// a peer still copies from a rank's buffer well after that rank could have left the collective.
class SlowPeerCopies {
 public:
  SlowPeerCopies(const std::vector<Device*>& devices, std::chrono::milliseconds delay);
  ~SlowPeerCopies();
  SlowPeerCopies(const SlowPeerCopies&) = delete;
  SlowPeerCopies& operator=(const SlowPeerCopies&) = delete;

 private:
  std::vector<const Device*> devices_;
};

// While alive, every step on these devices is held `delay` before its stats are copied out (a CUDA
// device's compute stream sleeps in a host function, a simulated device sleeps): a slow step, which
// the host has enqueued the next one beside (--run-ahead) long before it ends.
class SlowSteps {
 public:
  SlowSteps(const std::vector<Device*>& devices, std::chrono::milliseconds delay);
  ~SlowSteps();
  SlowSteps(const SlowSteps&) = delete;
  SlowSteps& operator=(const SlowSteps&) = delete;

 private:
  std::vector<const Device*> devices_;
};

// While alive, the communicators made for CUDA devices are NCCL's wherever they can be
// (failpoint::nccl_always): one GPU, or one GPU named twice.
class NcclAlways {
 public:
  NcclAlways();
  ~NcclAlways();
  NcclAlways(const NcclAlways&) = delete;
  NcclAlways& operator=(const NcclAlways&) = delete;
};

}  // namespace dp::failpoint
