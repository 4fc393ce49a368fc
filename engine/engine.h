// The data-parallel engine: one replica per device, each driven by its device's worker thread, and
// the two ways of keeping replicas in sync (DESIGN.md):
//   scatter   — nn.DataParallel: batch to device 0, scatter, broadcast parameters every step,
//               gather logits, loss on device 0, scatter logit gradients, reduce gradients to
//               device 0, optimizer on device 0 only.
//   allreduce — DDP/Horovod: parameters broadcast once, each device loads its own shard, local loss
//               weighted n_i/B, ring all-reduce of the flat gradient buffer (optionally in buckets
//               overlapping backward), the same optimizer step everywhere.
//               --allreduce naive swaps the ring for d2l's hand-written allreduce (reduce to device 0,
//               broadcast back); the communicator runs either (communicator.h).
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/network.h"
#include "engine/process_group.h"
#include "models/model.h"

namespace dp {

enum class Sync { scatter, allreduce };
enum class Split { even, chunk };
Sync parse_sync(const std::string& s);
Split parse_split(const std::string& s);
const char* sync_name(Sync s);
const char* split_name(Split s);

// Per-device sample counts of a batch of b over n devices.
//   even:  sizes differ by at most one (256 over 3 -> 86/85/85)
//   chunk: torch.chunk's ceil(b/n) per device, the last smaller, trailing ones possibly 0
//          (256 over 3 -> 86/86/84, 9 over 4 -> 3/3/3/0)
std::vector<int> split_batch(int b, int n, Split split);

enum class Phase { load, scatter, broadcast, forward, gather_loss, backward, reduce, optimizer };
inline constexpr int kPhases = 8;
// "reduce" is the gradient reduction of either strategy: reduce-to-root or all-reduce.
const char* phase_name(Phase p, Sync s);

struct Span {
  Phase phase;
  int64_t step;
  double start_us, end_us;  // since the engine started
};

// The spans that are not step phases, recorded only when tracing (trace.h lays them out).
struct BucketSpan {  // one bucket's all-reduce on the rank's communication thread
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

struct EngineConfig {
  Sync sync = Sync::scatter;
  Split split = Split::even;
  int batch = 256;  // the largest global batch a step will see; buffers are sized for it
  float lr = 0.1f, momentum = 0.9f, weight_decay = 0.0f;
  int64_t bucket_kb = 0;  // allreduce: 0 = one all-reduce after backward
  // BatchNorm across replicas. Off: each replica normalises its own samples, and device 0's running
  // statistics are broadcast to every replica before each step (nn.DataParallel's replicas copy
  // device 0's buffers; DDP's broadcast_buffers does the same): they are device 0's alone. On
  // (SyncBatchNorm): the statistics of the whole global batch, in both strategies.
  bool sync_bn = false;
  AllReduceAlgorithm all_reduce = AllReduceAlgorithm::ring;  // allreduce: ring or naive (d2l)
  double timeout = kDefaultTimeout;  // seconds a collective waits for its peers (--timeout; wait.h)
  // Each batch uploaded during the step before it, on the devices' copy streams (stage(); dp_train's
  // default, --no-prefetch turns it off): the load phase is then only the wait for that upload, and
  // every device that uploads (device 0 under scatter, each device under allreduce) holds two batch
  // buffers instead of one.
  bool prefetch = false;
  bool trace = false;
  // The job's processes (mpirun; process_group.h), with --sync allreduce only. Null, or a group of one:
  // this process alone. Otherwise this engine's devices are the job's devices rank·K .. rank·K + K-1
  // of P·K, a step's batch is split over all of them, and step() takes this process's rows of it.
  ProcessGroup* group = nullptr;
};

struct StepResult {
  double loss = 0;      // mean over the batch
  int64_t correct = 0;  // argmax == label
  int n = 0;
  bool finite_gradients = true;  // every element of the step's (reduced) gradient is finite
};

struct Bucket {
  int64_t offset = 0, count = 0;  // a contiguous range of the flat gradient buffer
  int layers = 0;                 // parameterised layers in it
};

class Engine {
 public:
  Engine(std::vector<Device*> devices, const ModelSpec& spec, EngineConfig config);
  ~Engine();

  // Host copies of device 0's parameters / momentum; setting them places them on device 0 and
  // broadcasts to every replica (allreduce keeps the momentum on every device).
  std::vector<float> params(int rank = 0);
  void set_params(const std::vector<float>& host);
  std::vector<float> momentum();  // empty when momentum is 0
  void set_momentum(const std::vector<float>& host);
  // BatchNorm's running statistics (ModelSpec::buffers; empty without BatchNorm): device 0's, which
  // a checkpoint keeps; setting them places them on every replica. batches_tracked is PyTorch's
  // num_batches_tracked: training steps taken, counted on from what set_batches_tracked gave.
  std::vector<float> buffers(int rank = 0);
  void set_buffers(const std::vector<float>& host);
  int64_t batches_tracked() const { return batches_tracked_; }
  void set_batches_tracked(int64_t n) { batches_tracked_ = n; }

  // One training step over a global batch of n: x (rows, C, H, W) and y (rows) are the rows of it this
  // process's devices train on, rows [slice(n).first, slice(n).second) (in one process: all n). The
  // result is this process's share: its devices' losses (each already scaled by 1/n) and correct
  // counts; across processes the trainer sums the shares.
  // stage(x, y, n) then step().
  StepResult step(const float* x, const int32_t* y, int n);
  // The same in two halves, so that a batch uploads while the step before it trains (prefetch):
  // stage() queues the batch of a later step(); with EngineConfig::prefetch its upload starts at
  // once on every device's copy stream (Device::upload_ahead), without it the step uploads it. Either
  // way x and y must stay untouched until the step() that trains on it returns. step() trains on the
  // oldest staged batch. At most two staged with prefetch (the next step's and the one after it),
  // one without: more, or a step() with none staged, is a std::logic_error. A failed step drops
  // every staged batch, after waiting for their uploads.
  void stage(const float* x, const int32_t* y, int n);
  StepResult step();
  int staged() const { return int(staged_.size()); }
  // The rows of a global batch of n that this process's devices train on.
  std::pair<int, int> slice(int n) const;
  // The job's devices (P·K), and the job's index of this engine's device 0.
  int world_size() const { return world_; }
  int first_device() const { return first_; }
  // Data-parallel inference over n samples: each device its shard, in chunks.
  StepResult evaluate(const float* x, const int32_t* y, int n);
  // Page-locks host memory the uploads of step() will read (Device::pin_host, on device 0 for the
  // process: a CUDA lock serves every GPU); null where the devices do not lock.
  std::shared_ptr<void> pin_host(void* p, size_t bytes) { return devices_[0]->pin_host(p, bytes); }
  // The parameter, in backward order, whose gradient on device 0 is first not finite ("" if none).
  // A host round trip per tensor: for a step whose StepResult::finite_gradients is false.
  std::string first_nonfinite_gradient();

  int size() const { return int(devices_.size()); }
  Device& device(int rank) { return *devices_[rank]; }
  Communicator& comm() { return *comm_; }
  const ModelSpec& spec() const { return spec_; }
  const EngineConfig& config() const { return cfg_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Seconds per phase, summed over the steps so far, per device; the spans when tracing.
  const std::vector<std::array<double, kPhases>>& phase_seconds() const { return phase_seconds_; }
  const std::vector<std::vector<Span>>& spans() const { return spans_; }
  const std::vector<std::vector<BucketSpan>>& bucket_spans() const { return bucket_spans_; }
  const std::vector<std::vector<EvalSpan>>& eval_spans() const { return eval_spans_; }
  const std::vector<HostSpan>& host_spans() const { return host_spans_; }
  // Drops the phase seconds and every span.
  void reset_timing();
  // The clock every span is on: microseconds since start_time(), when the engine was built.
  std::chrono::steady_clock::time_point start_time() const { return t0_; }
  double now_us() const { return us_since_start(std::chrono::steady_clock::now()); }
  // A span on the trace's host lane, e.g. host_span("epoch 3", t, now_us(), {{"images", 60000}});
  // kept only when tracing. Called from the thread that drives the engine, between its calls.
  void host_span(std::string name, double start_us, double end_us,
                 std::vector<std::pair<std::string, double>> args = {});
  // Traffic of the most recent full-batch step (n == config().batch), per device: among this process's
  // devices, and to and from other processes.
  Traffic step_traffic(int rank) const { return step_traffic_[rank]; }
  Traffic step_inter_traffic(int rank) const { return step_inter_traffic_[rank]; }
  int64_t steps() const { return step_; }

 private:
  struct Replica;
  void run_all(const std::function<void(int rank)>& fn);
  template <class F>
  void timed(int rank, Phase p, F&& f);
  void close_phases(int rank);
  double us_since_start(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double, std::micro>(t - t0_).count();
  }
  void record_buckets(int rank);
  struct Staged {  // a batch stage() took: the host rows, and the device buffers it uploads into
    const float* x;
    const int32_t* y;
    int n;
    int slot;  // Replica::batch[slot]; always 0 without prefetch
  };
  // The rows of a batch of n that device `rank` uploads (the first and how many): under scatter all
  // of them to device 0 and none elsewhere, under allreduce the device's shard of this process's rows.
  std::pair<int, int> upload_rows(int rank, int n) const;
  void upload(int rank, const Staged& b, bool ahead);
  void load(int rank, const Staged& b);
  void drop_staged() noexcept;
  void step_scatter(int rank, const Staged& b, const std::vector<int>& sizes);
  void step_allreduce(int rank, const Staged& b, const std::vector<int>& sizes);
  // The BatchNorm pass of a training step on `rank` over a global batch of B.
  BatchNormPass batchnorm_pass(int rank, int B);
  // Without SyncBatchNorm, on a model with BatchNorm and more than one device: device 0's running
  // statistics to every replica (counted as a broadcast).
  bool broadcasts_buffers() const { return spec_.has_batchnorm() && !cfg_.sync_bn && world_ > 1; }

  std::vector<Device*> devices_;
  ModelSpec spec_;
  EngineConfig cfg_;
  std::unique_ptr<Communicator> comm_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::vector<Bucket> buckets_;
  std::vector<int> layer_bucket_;  // layer index -> bucket index
  std::vector<std::array<double, kPhases>> phase_seconds_;
  std::vector<std::vector<Span>> spans_;
  struct OpenPhase {  // a phase of the step in flight: its marks on the device (Device::mark)
    Phase phase;
    int start, end;
  };
  std::vector<std::vector<OpenPhase>> open_phases_;   // per rank
  std::vector<std::vector<Interval>> bucket_timing_;  // per rank, per bucket: this step's, when tracing
  std::vector<std::vector<BucketSpan>> bucket_spans_;
  std::vector<std::vector<EvalSpan>> eval_spans_;
  std::vector<HostSpan> host_spans_;
  std::vector<Traffic> step_traffic_, step_inter_traffic_;
  int world_ = 0, first_ = 0;  // the job's devices, and this engine's device 0 among them
  std::chrono::steady_clock::time_point t0_;
  int64_t step_ = 0;
  int64_t batches_tracked_ = 0;
  std::deque<Staged> staged_;  // oldest first
  int next_slot_ = 0;          // where the next batch staged with prefetch uploads
};

}  // namespace dp
