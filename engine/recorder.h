// What the engine records of its steps, in one place: the seconds each device spends in each phase,
// the trace's spans (phases, bucket collectives, evaluations, the trainer's host spans) and the bytes
// each device moved in the last full step. The engine writes to it; the report, the log, the trace and
// dp_bench read it.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/device.h"

namespace dp {

// A phase of a step on a device, as the trace shows it.
struct Span {
  Phase phase;
  int64_t step;
  double start_us, end_us;  // since the engine started
};
// The spans that are not step phases, recorded only when tracing (the trace lays them out).
struct BucketSpan {  // one bucket's collective on the device's communication thread
  int64_t step;
  int bucket;
  double start_us, end_us;
};
struct EvalSpan {  // one evaluate() on the device
  int64_t step;    // steps trained before it
  int images;      // this device's share
  double start_us, end_us;
};
struct HostSpan {  // the trainer's own: an epoch, a save
  std::string name;
  double start_us, end_us;
  std::vector<std::pair<std::string, double>> args;
};

// Per device: the seconds spent in each phase so far.
using PhaseSeconds = std::vector<std::array<double, kPhases>>;
// The host's side of the steps so far, in seconds: per device, its thread's time enqueueing the steps'
// work (a simulated device runs its ops as they are called, so there this is their compute) and waiting
// for the device to finish it (the step's one round trip: the stats' download and the stream's end);
// and the trainer's time inside Engine::step, the rest of whose wall time is its own between the steps.
struct HostSeconds {
  struct PerDevice {
    double enqueue = 0, wait = 0;
  };
  std::vector<PerDevice> device;  // [rank]
  double in_step = 0;
};

class Recorder {
 public:
  // devices: the engine's; trace: keep spans (else only the phase seconds and the bytes); timing: mark
  // the phases on the devices at all (on CUDA two events each), which tracing implies. Without it the
  // phase seconds stay 0 and a step enqueues no timing event.
  Recorder(int devices, bool trace, bool timing = true);
  void set_buckets(int buckets);

  // The clock every span is on: microseconds since start_time(), when the engine was built.
  std::chrono::steady_clock::time_point start_time() const { return t0_; }
  double now_us() const { return us(std::chrono::steady_clock::now()); }
  double us(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double, std::micro>(t - t0_).count();
  }
  bool tracing() const { return trace_; }
  bool timing() const { return timing_; }  // the phases are marked on the devices (tracing implies it)

  // A phase is two marks on the device (Device::mark): on CUDA two events, so the host goes on
  // enqueueing the next phase instead of waiting for this one. Compute thread of `rank` only.
  void phase(Device& dev, int rank, Phase p, const std::function<void()>& work);
  // Before a step's first phase on `rank`, with the mark set it takes (Device::clear_marks; the
  // engine's download slot, one per step in flight): the set's marks and open phases are dropped.
  void begin_step(Device& dev, int rank, int set);
  // Once the step that marked into `set` is done on the device (its download waited for): each
  // phase's marks become seconds and, when tracing, spans of step `step`, while a step started after
  // it may still be running in the other set. On CUDA a phase is the GPU's time from the end of the
  // previous phase to the end of its own work, idle time waiting for the host's launches included, so
  // the phases add up to the step.
  void close_phases(Device& dev, int rank, int set, int64_t step);
  // The phases of the step being enqueued on `rank`, as marks on the device; a step graph keeps those
  // of its capture and reopens them when it is launched again (its marks are its own, Device::launch).
  struct OpenPhase {
    Phase phase;
    int start, end;
  };
  const std::vector<OpenPhase>& open_phases(int rank) const { return marking(rank); }
  void reopen(int rank, std::vector<OpenPhase> phases) { marking(rank) = std::move(phases); }
  // After a step's work on `rank`, from its device's thread: the seconds it spent enqueueing the
  // step and waiting for the device. After the whole step, from the trainer's: its seconds inside.
  void host_step(int rank, double enqueue, double wait) {
    HostSeconds::PerDevice& d = host_.device[size_t(rank)];
    d.enqueue += enqueue, d.wait += wait;
  }
  void step_seconds(double seconds) { host_.in_step += seconds; }
  // Where bucket b's collective on `rank` stamps its interval: null unless tracing.
  Interval* bucket_timing(int rank, int b) { return trace_ ? &bucket_timing_[size_t(rank)][size_t(b)] : nullptr; }
  // After the bucket collectives have returned: their stamps become spans (a bucket the communicator
  // did not run left its interval unstamped).
  void close_buckets(int rank, int64_t step);
  void evaluation(int rank, int64_t step, int images, double start_us);
  // A span on the trace's host lane; kept only when tracing. From the thread that drives the engine.
  void host_span(std::string name, double start_us, double end_us,
                 std::vector<std::pair<std::string, double>> args = {});
  // Drops the phase and host seconds and every span.
  void reset_timing();

  // The bytes of a step: counted from before() to after() on every device, kept when `full` (a step of
  // the configured batch, the one the byte model describes).
  std::vector<std::pair<Traffic, Traffic>> before(const Communicator& comm) const;
  void after(const Communicator& comm, const std::vector<std::pair<Traffic, Traffic>>& before, bool full);

  const PhaseSeconds& phase_seconds() const { return phase_seconds_; }
  const HostSeconds& host_seconds() const { return host_; }
  const std::vector<std::vector<Span>>& spans() const { return spans_; }
  const std::vector<std::vector<BucketSpan>>& bucket_spans() const { return bucket_spans_; }
  const std::vector<std::vector<EvalSpan>>& eval_spans() const { return eval_spans_; }
  const std::vector<HostSpan>& host_spans() const { return host_spans_; }
  // Of the most recent full step, per device: among this process's devices, and to and from others.
  Traffic step_traffic(int rank) const { return step_traffic_[size_t(rank)]; }
  Traffic step_inter_traffic(int rank) const { return step_inter_traffic_[size_t(rank)]; }

 private:
  bool trace_, timing_;
  std::chrono::steady_clock::time_point t0_;
  PhaseSeconds phase_seconds_;
  HostSeconds host_;
  // Per device, per mark set; and the set each device marks into (begin_step's).
  std::vector<std::array<std::vector<OpenPhase>, Device::kDownloadSlots>> open_phases_;
  std::vector<int> set_;
  std::vector<OpenPhase>& marking(int rank) { return open_phases_[size_t(rank)][size_t(set_[size_t(rank)])]; }
  const std::vector<OpenPhase>& marking(int rank) const {
    return open_phases_[size_t(rank)][size_t(set_[size_t(rank)])];
  }
  std::vector<std::vector<Interval>> bucket_timing_;  // per device, per bucket: this step's, when tracing
  std::vector<std::vector<Span>> spans_;
  std::vector<std::vector<BucketSpan>> bucket_spans_;
  std::vector<std::vector<EvalSpan>> eval_spans_;
  std::vector<HostSpan> host_spans_;
  std::vector<Traffic> step_traffic_, step_inter_traffic_;
};

}  // namespace dp
