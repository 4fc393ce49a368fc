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

// Where a device waits, while armed, before it goes on (upload_delay, peer_copy_delay, step_end_delay).
enum class DelayPoint { upload, peer_copy, step_end };

// While alive, these devices wait `delay` at `point` (the classes below name each point).
class SlowDevices {
 public:
  SlowDevices(DelayPoint point, const std::vector<Device*>& devices, std::chrono::milliseconds delay);
  ~SlowDevices();
  SlowDevices(const SlowDevices&) = delete;
  SlowDevices& operator=(const SlowDevices&) = delete;

 private:
  DelayPoint point_;
  std::vector<const Device*> devices_;
};

// Every upload ahead first waits (a simulated device's copy thread sleeps, a CUDA device's copy
// stream runs a sleeping host function before the copy): a slow copy engine, so that a step reading a
// batch before its upload finished reads the wrong bytes.
struct SlowUploads : SlowDevices {
  SlowUploads(const std::vector<Device*>& devices, std::chrono::milliseconds delay)
      : SlowDevices(DelayPoint::upload, devices, delay) {}
};

// Every copy these simulated devices make from a peer first waits (a slow link): a peer still copies
// from a rank's buffer well after that rank could have left the collective.
struct SlowPeerCopies : SlowDevices {
  SlowPeerCopies(const std::vector<Device*>& devices, std::chrono::milliseconds delay)
      : SlowDevices(DelayPoint::peer_copy, devices, delay) {}
};

// Every step is held before its stats are copied out (a CUDA device's compute stream sleeps in a host
// function, a simulated device sleeps): a slow step, which the host has enqueued the next one beside
// (--run-ahead) long before it ends.
struct SlowSteps : SlowDevices {
  SlowSteps(const std::vector<Device*>& devices, std::chrono::milliseconds delay)
      : SlowDevices(DelayPoint::step_end, devices, delay) {}
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
