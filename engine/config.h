// What an engine is built with (EngineConfig), and the small vocabulary every part of a step shares:
// how a batch splits over the devices, the phases of a step, the gradient buckets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/wait.h"

namespace dp {

class ProcessGroup;

enum class Split { even, chunk };
Split parse_split(const std::string& s);
// --grad-dtype's value (fp32, bf16 or fp16); UsageError naming the flag and the accepted values.
DType parse_grad_dtype(const std::string& s);
const char* split_name(Split s);
// --batch and --accumulate (the images of a micro-batch, and micro-batches a step): UsageError naming
// the flag where either is not positive or a step would hold more than 2^31 - 1 images. The engine
// checks them; dp_train and dp_bench first, before any data is read.
void check_step_images(int64_t batch, int64_t accumulate);

// Per-device sample counts of a batch of b over n devices.
//   even:  sizes differ by at most one (256 over 3 -> 86/85/85)
//   chunk: torch.chunk's ceil(b/n) per device, the last smaller, trailing ones possibly 0
//          (256 over 3 -> 86/86/84, 9 over 4 -> 3/3/3/0)
std::vector<int> split_batch(int b, int n, Split split);

// The phases of a training step, in order. A strategy names them (Strategy::phase_name) and runs the
// ones it has; "reduce" is the gradient reduction of any strategy: reduce-to-root, all-reduce or
// reduce-scatter; "gather" is the sharded strategies' all-gather of the updated parameters.
enum class Phase { load, scatter, broadcast, forward, gather_loss, backward, reduce, optimizer, gather };
inline constexpr int kPhases = 9;

// A contiguous range of the flat gradient buffer that is communicated as one: gradients go in buckets
// from the last layer to the first, the order backward produces them (EngineConfig::bucket_kb).
struct Bucket {
  int64_t offset = 0, count = 0;
  int layers = 0;  // parameterised layers in it
};

// The optimizer (engine/optimizer.h): PyTorch's SGD (with momentum), Adam, AdamW.
enum class Optimizer { sgd, adam, adamw };

struct EngineConfig {
  std::string sync = "scatter";  // the strategy (strategy.h): a name the registry knows
  Split split = Split::even;
  int batch = 256;  // the largest global (micro-)batch a step will see; buffers are sized for it
  // Micro-batches per optimizer step (--accumulate; DDP's no_sync, DeepSpeed's gradient_accumulation_steps):
  // a step trains on up to batch·accumulate images, `batch` at a time; each device adds the gradients of
  // its rows of every micro-batch to its own and they are communicated once, with the last (scatter,
  // as nn.DataParallel, reduces them to device 0 every micro-batch). The loss is weighted by the whole
  // step's images, so a step equals one on all of them at once, up to float summation order.
  int accumulate = 1;
  Optimizer optimizer = Optimizer::sgd;
  float lr = 0.1f, momentum = 0.9f, weight_decay = 0.0f;  // momentum: SGD's
  // Gradient clipping by the norm of the whole averaged gradient before the optimizer, as PyTorch's
  // clip_grad_norm_(max_norm) (strategy.h's clip_gradients); 0: none.
  float clip_grad_norm = 0.0f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // Adam's and AdamW's
  int64_t bucket_kb = 0;  // where the strategy takes buckets: 0 = one collective after backward
  // BatchNorm across replicas. Off: each replica normalises its own samples, and device 0's running
  // statistics are broadcast to every replica before each step (nn.DataParallel's replicas copy
  // device 0's buffers; DDP's broadcast_buffers does the same): they are device 0's alone. On
  // (SyncBatchNorm): the statistics of the whole global batch, in every strategy.
  bool sync_bn = false;
  AllReduceAlgorithm all_reduce = AllReduceAlgorithm::ring;  // where the strategy takes it: ring or naive (d2l)
  // The type the gradients' collective carries them in (--grad-dtype; strategy.h's WireGradients):
  // fp32, or bf16 / fp16 at half the bytes, rounded (DDP's bf16_compress_hook / fp16_compress_hook).
  DType grad_dtype = DType::fp32;
  double timeout = kDefaultTimeout;  // seconds a collective waits for its peers (--timeout; wait.h)
  // Each batch uploaded during the step before it, on the devices' copy streams (Engine::stage;
  // dp_train's default, --no-prefetch turns it off): the load phase is then only the wait for that
  // upload, and every device that uploads holds two batch buffers instead of one.
  bool prefetch = false;
  // Step graphs (--graphs; CUDA graphs): the step captured once per upload slot and replayed
  // (Device::begin_capture), for one device in one process, with prefetch and no accumulation, not
  // under zero2 or zero3; the first step and a short last batch run eagerly (step_graph.cpp).
  bool graphs = false;
  bool trace = false;
  // Each phase of a step timed on the devices (Recorder::phase; on CUDA two events a phase, some
  // sixteen a step): dp_bench's and the tests' default; dp_train times them only for --log and
  // --trace, which show them.
  bool time_phases = true;
  // The job's processes (mpirun; process_group.h), for a strategy that runs across them. Null, or a
  // group of one: this process alone. Otherwise this engine's devices are the job's devices
  // rank·K .. rank·K + K-1 of P·K, a step's batch is split over all of them, and step() takes this
  // process's rows of it.
  ProcessGroup* group = nullptr;
};

}  // namespace dp
