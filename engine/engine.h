// The data-parallel engine: one replica per device, each driven by its device's worker thread, kept
// in sync by a strategy (strategy.h; one file each under engine/strategies/: scatter is
// nn.DataParallel, allreduce is DDP). The engine holds the replicas and the communicator, stages the
// batches (their uploads overlapping the step before with prefetch), runs the strategy's step on
// every device at once and turns a failure on any device into one exception on the caller's thread,
// with no device left waiting; what it measures goes to its Recorder (recorder.h).
#pragma once

#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/device.h"
#include "engine/host_pages.h"
#include "engine/network.h"
#include "engine/optimizer.h"
#include "engine/process_group.h"
#include "engine/recorder.h"
#include "engine/strategy.h"
#include "models/model.h"

namespace dp {

struct StepResult {
  double loss = 0;      // mean over the batch
  int64_t correct = 0;  // argmax == label
  int n = 0;
  int micro_batches = 1;         // --accumulate: the micro-batches n was trained in
  bool finite_gradients = true;  // every element of the step's (reduced) gradient is finite
};

class Engine {
 public:
  Engine(std::vector<Device*> devices, const ModelSpec& spec, EngineConfig config);
  ~Engine();

  // Host copies of device 0's parameters; setting them places them on device 0 and broadcasts them
  // to every replica. Under zero3 each device holds its chunks: params() gathers them (a collective:
  // every device of every process of the job takes part) and setting them splits them.
  std::vector<float> params(int rank = 0);
  void set_params(const std::vector<float>& host);
  // The optimizer's state (optimizer_state_names: SGD's momentum buffer, Adam's two moments; none
  // for SGD at momentum 0), device 0's, each (P); setting it places it on every device that steps the
  // optimizer. Under a sharded strategy each device holds its chunk: optimizer_state() all-gathers
  // them (a collective: every process of the job calls it together) and setting it splits it. optimizer_steps: the
  // steps the optimizer has taken (Adam's bias correction counts them), counted on from what set_optimizer_steps gave.
  std::vector<std::vector<float>> optimizer_state();
  void set_optimizer_state(const std::vector<std::vector<float>>& host);
  int64_t optimizer_steps() const { return optimizer_steps_; }
  void set_optimizer_steps(int64_t n) {
    require_no_step_in_flight("set_optimizer_steps");
    optimizer_steps_ = n;
  }
  // BatchNorm's running statistics (ModelSpec::buffers; empty without BatchNorm): device 0's, which
  // a checkpoint keeps; setting them places them on every replica. batches_tracked is PyTorch's
  // num_batches_tracked: training steps taken, counted on from what set_batches_tracked gave (and
  // held at 2^63 - 1 once there).
  std::vector<float> running_stats(int rank = 0);
  void set_running_stats(const std::vector<float>& host);
  int64_t batches_tracked() const { return batches_tracked_; }
  void set_batches_tracked(int64_t n) {
    require_no_step_in_flight("set_batches_tracked");
    batches_tracked_ = n;
  }
  // The learning rate of the next step() (a schedule's: train/lr_schedule.h). Between steps only.
  void set_lr(float lr) { cfg_.lr = lr; }

  // One training step over a global batch of n: x (rows, C, H, W) and y (rows) are the rows of it this
  // process's devices train on, rows [slice(n).first, slice(n).second) (in one process: all n). The
  // result is this process's share: its devices' losses (each already scaled by 1/n) and correct
  // counts; across processes the trainer sums the shares. With EngineConfig::accumulate, n is up to
  // batch·accumulate: micro-batch k is rows [k·batch, (k+1)·batch), the last what is left, each split
  // over the devices as a batch of its own, and one optimizer step ends the last.
  // stage(x, y, n) then step().
  StepResult step(const float* x, const int32_t* y, int n);
  // step() in two halves, so that the host can enqueue the next step before it reads this one's
  // result (dp_train --run-ahead; PyTorch's host runs ahead of the GPU until something reads a result,
  // as loss.item() does): start_step() trains on the oldest staged batch, enqueues the step on every
  // device and returns; on CUDA without waiting for it, its result queued into page-locked memory
  // behind its work (Device::download_async), unless the phases are timed (Recorder::timing: their
  // marks are read at once, a wait for the device). finish_step() waits for the oldest started step
  // and returns its result. Steps start and finish in order, at most kStepsInFlight started and not
  // finished; a step's batch must stay untouched until its finish_step() returns. What reads or sets
  // the model between steps (params(), evaluate(), the optimizer state, the running statistics, their
  // counts) wants none in flight: std::logic_error otherwise. steps(), optimizer_steps() and
  // batches_tracked() count the started steps.
  static constexpr int kStepsInFlight = Device::kDownloadSlots;
  // Two steps in flight never share an upload slot (staged batches alternate them): a step graph's
  // timing marks are its slot's.
  static_assert(kStepsInFlight <= Device::kUploadSlots);
  void start_step();
  StepResult finish_step();
  int in_flight() const { return int(started_.size()); }
  int64_t steps_started_ahead() const { return started_ahead_; }  // started while another was in flight
  // The same in two halves, so that a batch uploads while the step before it trains (prefetch):
  // stage() queues the batch of a later step(); with EngineConfig::prefetch its upload (its first
  // micro-batch's) starts at once on every device's copy stream (Device::upload_ahead), without it
  // the step uploads it. Either
  // way x and y must stay untouched until the step() that trains on it returns. step() trains on the
  // oldest staged batch, and returns once the devices have done its work (the next batch's upload may
  // still be under way). At most two staged with prefetch (the next step's and the one after it),
  // one without: more, or a step() with none staged, is a std::logic_error. A failed step drops
  // every staged batch and every started step, after waiting for their uploads.
  void stage(const float* x, const int32_t* y, int n);
  StepResult step();
  int staged() const { return int(staged_.size()); }
  // Forgets every staged batch and every started step after waiting for every upload (each device's
  // streams): before the host memory they read goes.
  void drop_staged() noexcept;
  // The rows of a global batch of n that this process's devices train on: with --accumulate all n
  // (its devices' rows of every micro-batch are spread over the step's).
  std::pair<int, int> slice(int n) const;
  // The job's devices (P·K), and the job's index of this engine's device 0.
  int world_size() const { return world_; }
  int first_device() const { return first_; }
  // Data-parallel inference over n samples: each device its shard, in chunks.
  StepResult evaluate(const float* x, const int32_t* y, int n);
  // Page-locks host memory the uploads of step() will read (Device::pin_host, on device 0 for the
  // process: a CUDA lock serves every GPU); null where the devices do not lock.
  std::shared_ptr<void> pin_host(void* p, size_t bytes) { return devices_[0]->pin_host(p, bytes); }
  // The parameter, in backward order, whose gradient on device 0 is first not finite ("" if none);
  // under a sharded strategy, in the chunks this process's devices own. A host round trip per
  // tensor: for a step whose StepResult::finite_gradients is false.
  std::string first_nonfinite_gradient();

  int size() const { return int(devices_.size()); }
  Device& device(int rank) { return *devices_[rank]; }
  Communicator& comm() { return *comm_; }
  const ModelSpec& spec() const { return spec_; }
  const EngineConfig& config() const { return cfg_; }
  const Strategy& strategy() const { return strategy_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Time per phase, trace spans, bytes per step.
  Recorder& recorder() { return recorder_; }
  const Recorder& recorder() const { return recorder_; }
  int64_t steps() const { return step_; }  // started: all of them finished where none is in flight
  // --graphs: the step graphs captured and the steps that ran as one (a launch), so far.
  int64_t graph_captures() const { return graph_captures_; }
  int64_t graph_launches() const { return graph_launches_; }

 private:
  friend class StepContext;
  void run_all(const std::function<void(int rank)>& fn);
  void make_buckets();
  // The gradient buckets, the sharded units and every device's Replica (the constructor's second half).
  void allocate_replicas();
  // The rows of a batch of n that device `rank` uploads (the first and how many), by the strategy.
  std::pair<int, int> upload_rows(int rank, int n) const;
  // The rows of a (micro-)batch of n that this process's devices train on.
  std::pair<int, int> process_rows(int n) const;
  // Micro-batch k of a staged step (EngineConfig::accumulate), its rows among the step's.
  StagedBatch micro_batch(const StagedBatch& b, int k) const;
  void upload(int rank, const StagedBatch& b, bool ahead);
  void load(int rank, const StagedBatch& b);
  // The BatchNorm pass of a training step on `rank` over a global batch of B.
  BatchNormPass batchnorm_pass(int rank, int B);
  bool broadcasts_buffers() const { return spec_.has_batchnorm() && !cfg_.sync_bn && world_ > 1; }
  int evaluation_slot() const;

  std::vector<Device*> devices_;
  ModelSpec spec_;
  EngineConfig cfg_;
  const Strategy& strategy_;
  std::unique_ptr<Communicator> comm_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::vector<Bucket> buckets_;
  std::vector<int> layer_bucket_;  // layer index -> bucket index
  Recorder recorder_;
  int world_ = 0, first_ = 0;  // the job's devices, and this engine's device 0 among them
  int64_t step_ = 0;
  int64_t batches_tracked_ = 0;
  int64_t optimizer_steps_ = 0;
  std::vector<ShardUnit> units_;  // under a sharded strategy (Strategy::zero_stage), else none
  int64_t owned_ = 0;             // the floats of a device's chunks, every unit's together
  // Where device `rank`'s reduced gradient of its chunk of `u` is: in the padded flat buffer (zero1)
  // or in its chunks (zero2).
  float* owned_gradient(int rank, const ShardUnit& u) const;
  // Device `rank`'s chunks of every unit from a host copy of the whole (P), the padding zero.
  void upload_chunks(int rank, float* chunks, const std::vector<float>& host);
  // zero3: the whole model gathered on device `rank` from every device's chunks (a collective).
  Buffer gather_parameters(int rank);
  // --graphs (EngineConfig::graphs; step_graph.cpp): refused where it cannot run; the step of the
  // one device as the graph of b's upload slot, captured where there is none, then launched; false
  // where the capture failed (the caller then runs the step eagerly, in mark set `set`, begun again).
  void check_graphs() const;
  bool runs_as_graph(const StagedBatch& b) const;
  bool graph_step(const StagedBatch& b, const std::vector<int>& sizes, int set);  // false: run it eagerly
  struct StepGraph {
    bool captured = false;
    std::vector<Recorder::OpenPhase> phases;  // the capture's, reopened at each launch
  };
  std::array<StepGraph, Device::kUploadSlots> graphs_;
  bool warm_ = false;  // a full step ran eagerly: cuDNN's plans made, every workspace at its size
  int64_t graph_captures_ = 0, graph_launches_ = 0;
  std::deque<StagedBatch> staged_;  // oldest first
  // A started step, for its finish_step: its number, images, micro-batches and download slot (its
  // number modulo kStepsInFlight: also its mark set and the host copy of its optimizer scalars, which
  // its upload reads).
  struct Started {
    int64_t step = 0;
    int n = 0, micros = 1, slot = 0;
  };
  std::deque<Started> started_;  // oldest first
  int64_t started_ahead_ = 0;    // steps started while another was in flight
  // The host copy of each started step's optimizer scalars (kStepsInFlight of them), on a page of their
  // own, page-locked where the devices lock host memory (CUDA): an upload from pageable memory may wait
  // for the work queued before it, which with a step in flight is that step.
  PageVector<OptimizerScalars> scalars_;
  std::shared_ptr<void> scalars_locked_;                   // after scalars_: unlocked before the page is freed
  void require_no_step_in_flight(const char* what) const;  // std::logic_error naming `what` unless none is
  // A started step of n images in `micros` micro-batches counted: the steps, the optimizer's, BatchNorm's
  // batches, and whether a full step ran (warm_).
  void count_started(int n, int micros);
  int next_slot_ = 0;  // where the next batch staged with prefetch uploads
};

}  // namespace dp
