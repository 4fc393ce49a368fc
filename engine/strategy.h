// A strategy is one way of keeping the replicas in sync, a value of --sync: one file each under
// engine/strategies/, listed once in the registry (engine/strategy.cpp). It says what each device
// holds, which rows of a batch each device uploads, its step phase by phase, what it does before an
// evaluation, its byte model and its memory model; the engine (engine.h) runs it and everything that
// reports on a run (the report, the log, the trace, dp_bench) takes the strategy's names and models
// from it, never from tables of its own.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/byte_model.h"
#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/device.h"
#include "engine/network.h"
#include "models/model.h"

namespace dp {

class Engine;
struct OptimizerScalars;  // optimizer.h

// The floats of the chunk each of n devices owns of P under a sharded strategy: ceil(P / n).
inline int64_t shard_chunk(int64_t P, int n) { return (P + n - 1) / n; }

// Under a sharded strategy the flat parameters fall into units (zero1: the whole model; zero2 and
// zero3: their gradient buckets), each cut into n chunks of `chunk` floats, the last padded with
// zeros. Device r owns chunk Communicator::shard(r) of every unit, parameters [offset + shard·chunk,
// + chunk) clipped to the unit, and keeps the optimizer state (zero2: also the gradients; zero3: the
// parameters too) of its chunks alone, back to back in unit order from `owned` on.
struct ShardUnit {
  int64_t offset = 0, count = 0;  // the unit's parameters in the flat buffer
  int64_t chunk = 0;              // shard_chunk(count, n)
  int64_t owned = 0;              // where this unit's chunk starts in a device's shard buffers
};
// The units of the given contiguous ranges (buckets), in their order, over n devices.
std::vector<ShardUnit> shard_units(const std::vector<Bucket>& ranges, int n);
// The floats of a device's chunks, every unit's together: the size of its shard buffers.
inline int64_t owned_floats(const std::vector<ShardUnit>& units) {
  return units.empty() ? 0 : units.back().owned + units.back().chunk;
}
// Unit u whole on device `rank`: its chunk, from the device's shard buffer `chunks`, to its place in
// `whole` (u.chunk floats per device of the job), then all-gathered from every device's; `queued`:
// on the communication thread after the collectives started there (Communicator::all_gather_async),
// and waited for.
void gather_unit(Communicator& comm, int rank, const ShardUnit& u, const float* chunks, float* whole,
                 bool queued = false);

// A replica's stats buffer: the loss sum, the correct count and, on a device that stepped the
// optimizer, 1 where the gradient it stepped held a value that is not finite (else 0).
inline constexpr int kStats = 3, kNonfinite = 2;

// Everything one device holds for its replica; which of the optional buffers it has is its
// strategy's choice (Strategy::allocate). Shapes use B (global batch), b (largest local batch),
// P (parameters), R (running statistics), D (input size), C (classes).
struct Replica {
  Buffer params;  // (P), padded under zero1 (Strategy::zero_stage)
  Buffer grads;   // (P), padded likewise; under zero2 the device's chunks alone
  // (P) under zero2 and zero3 with --accumulate: the whole gradient of the step's micro-batches so
  // far, which backward adds to until the last reduce-scatters it (FSDP's no_sync holds it likewise).
  Buffer accumulated;
  // (P) each, on a device that steps the optimizer: its state (optimizer_state_names: SGD's momentum
  // buffer, Adam's two moments; none for SGD at momentum 0); the owned chunk's alone when sharded.
  std::vector<Buffer> state;
  std::vector<float*> state_pointers() const;
  Buffer running;  // (R) BatchNorm's running statistics; none without BatchNorm
  std::unique_ptr<Network> net;
  Buffer stats;  // (kStats)
  Buffer norm;   // (1) the gradient's sum of squares, on a device that steps the optimizer, under --clip-grad-norm
  // On a device that steps the optimizer: the step's optimizer scalars (optimizer.h), written before
  // each step (Engine::step), read by the optimizer's kernels.
  Buffer scalars;
  const OptimizerScalars* optimizer_scalars() const { return static_cast<const OptimizerScalars*>(scalars.data()); }
  // The rows the device uploads (Strategy::upload_rows); with prefetch two: the one a step trains on
  // and the next step's, uploading meanwhile (Engine::stage).
  struct Upload {
    Buffer x, y;
  };
  std::array<Upload, Device::kUploadSlots> batch;
  Buffer input;          // (b, D) on a device that uploads nothing: the rows another device sends it
  Buffer dlogits;        // (b, C) this device's logit gradients
  Buffer gathered;       // (B, C) on a device that computes the loss for every device: the logits
  Buffer gathered_grad;  // (B, C) and their gradients
};

// A batch as Engine::stage took it: the host rows, and the upload slot it goes to. A step's
// micro-batch (EngineConfig::accumulate) is one too, its rows among the step's.
struct StagedBatch {
  const float* x;
  const int32_t* y;
  int n;
  int slot;            // Replica::batch[slot]; always 0 without prefetch
  bool ahead = false;  // uploaded on the copy stream while the step before ran (prefetch)
};

// Where a micro-batch stands in its optimizer step (EngineConfig::accumulate): the k-th of `count`,
// and the step's images over all of them (its loss weight is 1/images).
struct MicroBatch {
  int index = 0, count = 1;
  int images = 0;
};

// One device's part of one training step: what a strategy's step() works with. The engine builds one
// per device per step, on that device's compute thread.
class StepContext {
 public:
  StepContext(Engine& engine, int rank, const StagedBatch& batch, const std::vector<int>& sizes,
              const MicroBatch& micro);
  int rank() const { return rank_; }  // the device, among the engine's
  Device& device() const;
  Replica& replica() const;
  Communicator& comm() const;
  const ModelSpec& spec() const;
  const EngineConfig& config() const;
  const std::vector<int>& sizes() const { return sizes_; }  // every device of the job's share of the batch
  int batch() const { return batch_; }                      // B: the (micro-)batch's global size
  int mine() const;                                         // this device's share of it
  // With --accumulate: the micro-batch among its optimizer step's. Backward adds its gradients to
  // those of the micro-batches before (Network::set_accumulating) from the second on, and the
  // gradients are communicated and the optimizer stepped at the last alone (scatter: reduced each time).
  const MicroBatch& micro() const { return micro_; }
  bool last_micro() const { return micro_.index + 1 == micro_.count; }
  int images() const { return micro_.images; }  // the optimizer step's: the loss is weighted 1/images
  const Replica::Upload& upload() const;        // where this step's rows were uploaded
  // Runs `work` as phase p of the step, timed on the device (Recorder::phase).
  void phase(Phase p, const std::function<void()>& work);
  // The batch onto this device: its upload on the compute stream or, with prefetch, the compute
  // stream's wait for its upload on the copy stream, staged while the step before ran.
  void load();
  // The BatchNorm pass of a training step; with SyncBatchNorm its statistics are all-reduced.
  BatchNormPass batchnorm() const;
  // Without SyncBatchNorm, on a model with BatchNorm and more than one device: device 0's running
  // statistics go to every replica before the forward (counted as a broadcast).
  bool broadcasts_buffers() const;
  // Under a sharded strategy (Strategy::zero_stage): its units, and the chunk of each this device owns.
  const std::vector<ShardUnit>& units() const;
  int shard() const;
  // The gradient buckets, and the bucket of parameterised layer `layer` (-1: none).
  const std::vector<Bucket>& buckets() const;
  int layer_bucket(int layer) const;
  Interval* bucket_timing(int bucket);  // where a bucket's collective stamps its time: null unless tracing
  void close_buckets();                 // after the bucket collectives are done: their trace spans

 private:
  Engine& engine_;
  int rank_;
  const StagedBatch& batch_rows_;
  const std::vector<int>& sizes_;
  int batch_;
  MicroBatch micro_;
};

// What a device of the strategy holds of one category beyond what every replica holds (the bytes its
// memory model predicts, for dp_bench skew to set beside the ledger).
struct Holding {
  Category category;
  int64_t bytes;
  std::string what;
  bool checked = true;  // false: a line of text with no ledger figure to check
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual const char* name() const = 0;     // the --sync value
  virtual const char* mirrors() const = 0;  // what it is in PyTorch: "nn.DataParallel", "DDP"
  // How it reduces the gradients, for messages: "reduces its gradients to device 0".
  virtual const char* reduces() const = 0;

  // The options it takes: --allreduce (the all-reduce algorithm), --bucket-kb (gradients in buckets
  // overlapped with backward), --grad-dtype (the gradients' collective in 16 bits: DDP's compression
  // hooks, DeepSpeed's communication_data_type, FSDP's reduce_dtype), and whether it runs across
  // processes (nullptr; else why not).
  virtual bool takes_all_reduce_algorithm() const { return false; }
  virtual bool takes_buckets() const { return false; }
  virtual bool takes_grad_dtype() const { return true; }
  virtual const char* one_process_only() const { return nullptr; }
  // What each device keeps 1/n of, as the ZeRO paper's stages count it: 0 nothing (every device holds
  // the whole of everything it holds), 1 the optimizer state, 2 the gradients too, 3 the parameters
  // too. Stage 1 has one ShardUnit, the whole model, and its flat parameter and gradient buffers are
  // padded to n chunks (the padding stays zero); stages 2 and 3 a unit per gradient bucket (one per
  // parameterised layer without --bucket-kb), the gradient buffer the device's chunks alone (and at
  // stage 3 the parameter buffer too).
  virtual int zero_stage() const { return 0; }

  // What each device holds: whether `rank` steps the optimizer (and so holds its state), then its
  // batch, input and output buffers (b: rows of the largest local batch, at least 1).
  virtual bool steps_optimizer(int rank) const = 0;
  virtual void allocate(Device& dev, Replica& rep, const ModelSpec& spec, const EngineConfig& c, int rank,
                        int b) const = 0;
  // The rows of a global batch of n that device `rank` of the job (of `devices`) uploads: the first
  // and how many, within the rows of the engine's process from row 0 of its first device's share.
  virtual std::pair<int, int> upload_rows(const std::vector<int>& sizes, int first_device, int rank) const = 0;
  // One device's step, phase by phase; the loss of the step ends up in the stats of the devices that
  // compute it (computes_loss).
  virtual void step(StepContext& s) const = 0;
  virtual bool computes_loss(int rank) const = 0;
  // Before an evaluation, on every device: what makes each replica hold device 0's model.
  virtual void before_evaluation(Communicator& /*comm*/, int /*rank*/, Replica& /*rep*/,
                                 const ModelSpec& /*spec*/) const {}

  // The phases it runs, their names in its vocabulary, and which of them are communication.
  virtual bool has_phase(Phase p) const = 0;
  virtual const char* phase_name(Phase p) const;
  virtual bool communicates(Phase p) const = 0;
  // "scatter", "allreduce (ring)": the strategy with what configures it.
  virtual std::string describe(const EngineConfig& /*c*/) const { return name(); }
  // A device the split leaves without samples: what it does.
  virtual const char* idle_device() const = 0;

  // The byte model: the collectives of one full step, in order (byte_model.h).
  virtual std::vector<CollectiveTraffic> step_collectives(const StepShape& s) const = 0;
  // The memory model: what device 0 holds beyond every replica's parameters, gradients, activations
  // and workspace, after a heading; and in a sentence, for the end-of-run skew line.
  virtual std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int devices,
                                        std::string& heading) const = 0;
  virtual std::string memory_note(const EngineConfig& c) const = 0;
  // Whether device 0 holds more than the others (dp_bench skew checks skew > 1, else skew within 2% of 1).
  virtual bool skewed(const EngineConfig& c) const = 0;
};

// --clip-grad-norm (EngineConfig::clip_grad_norm; nothing at 0), between the gradient's reduction and
// the optimizer, on a device that steps it: the n floats at `grads` times PyTorch's clip coefficient of
// the whole averaged gradient (math::clip_coefficient). `shard`: the device holds its share of the
// gradient alone (zero1-3), so the shares' sums of squares are all-reduced first (one float each: the
// norm costs the sharded strategies one more collective a step, a latency rather than bytes); the
// others hold the whole gradient and square it there (two more passes over it, no collective).
// The finiteness check after it (in the optimizer's kernel) sees what it would have seen before: a NaN
// norm leaves the gradient as it was (the coefficient is 1), an infinite one turns an infinity into a
// NaN (times 0) and a finite gradient into zeros.
void clip_gradients(StepContext& s, float* grads, int64_t n, bool shard);

// The type the gradients' collectives carry on `devices` devices of the job: --grad-dtype's
// (EngineConfig::grad_dtype) where there is more than one; a single device sends nothing, and fp32.
DType wire_dtype(const EngineConfig& c, int devices);
// UsageError, naming the strategy and what to use instead, for a 16-bit --grad-dtype under a strategy
// that does not take it (Strategy::takes_grad_dtype: scatter).
void check_grad_dtype(const Strategy& s, DType t);

// A step that fails with collectives still queued on its communication thread ends them before their
// buffers go: the communicator is aborted (every rank's step fails) and the rank waits for them; their
// failure is not reported (the step's own is). For the destructors of what such collectives read.
void end_queued_collectives(StepContext& s) noexcept;

// The gradients as their collective carries them (wire_dtype): in fp32 the float
// gradient buffer itself; in bf16 or fp16 a buffer of `count` elements of the type (Category::comm),
// filled from the floats before the collective and widened back into floats after it, as DDP's
// bf16_compress_hook and fp16_compress_hook do (the sum is of the rounded gradients, its partial sums
// rounded too, and arrives rounded). No division by the device count is needed before the cast, as
// fp16_compress_hook makes: dp's gradients are already each device's share of the global mean (the
// loss is weighted by 1/B on every device), so the values on the wire are as large as the mean's.
class WireGradients {
 public:
  WireGradients(StepContext& s, int64_t count);  // count 0: nothing allocated (a step that sends none)
  // A step that fails with buckets of this buffer still queued must not free it under them
  // (end_queued_collectives).
  ~WireGradients();
  WireGradients(const WireGradients&) = delete;
  WireGradients& operator=(const WireGradients&) = delete;
  DType type() const { return type_; }
  // Floats [offset, offset + n) of `grads` as the collective sends them: narrowed into this buffer at
  // offset, or (fp32) grads + offset itself.
  void* narrow(float* grads, int64_t offset, int64_t n);
  // Elements [offset, offset + n) of the collective's result back into the floats at `out`; nothing
  // in fp32 when `out` is where they are.
  void widen(int64_t offset, int64_t n, float* out);
  void* at(int64_t offset) const;

 private:
  StepContext& s_;
  DType type_;
  Buffer wire_;
  int unwinding_ = std::uncaught_exceptions();  // at construction: more at the end means a failure
};

// The gradient buckets a strategy's engine uses for --bucket-kb (0: none), in backward order: layers
// from the last, a bucket closed once it holds bucket_kb KiB or more (the buckets DDP makes); zero2
// without --bucket-kb closes one at every layer, so each layer's gradient is freed as soon as it is
// reduce-scattered; none for a strategy that takes no buckets. layer_bucket, when given: each layer's
// bucket (-1: a layer without parameters).
std::vector<Bucket> gradient_buckets(const ModelSpec& spec, const Strategy& strategy, int64_t bucket_kb,
                                     std::vector<int>* layer_bucket = nullptr);

// The registry: every strategy, in the order help and dp_bench list them.
const std::vector<const Strategy*>& strategies();
// The strategy named `name`; UsageError naming --sync and the accepted values for another.
const Strategy& find_strategy(const std::string& name);
// "scatter or allreduce": the accepted --sync values, for messages.
std::string strategy_names(const char* last_separator = " or ");
// "scatter (nn.DataParallel) | allreduce (DDP)": each with what it is in PyTorch, for --help.
std::string strategy_choices();

}  // namespace dp
