// What a run decides before its first step (setup.h).
#include "train/setup.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "engine/strategy.h"
#include "train/host_memory.h"
#include "train/loader.h"
#include "train/output_files.h"

namespace dp {

// lead: this process writes the outputs (rank 0 of a job, or the only process).
void check_options(const TrainOptions& o, bool lead) {
  check_step_images(o.batch, o.accumulate);
  if (o.epochs <= 0 && o.steps <= 0) throw UsageError("--epochs: must be at least 1 (or give --steps)");
  if (o.steps < 0) throw UsageError("--steps: must be positive");
  if (!std::isfinite(o.lr) || o.lr <= 0) throw UsageError("--lr: must be a positive finite number, e.g. 0.1");
  if (!std::isfinite(o.momentum) || o.momentum < 0 || o.momentum >= 1)
    throw UsageError(
        std::string("--momentum: must be in [0, 1)") +
        (o.momentum == 1.0f ? " as a float, and it rounds to 1 (the largest float below 1 is 0.99999994)" : ""));
  for (float beta : {o.beta1, o.beta2})
    if (!std::isfinite(beta) || beta < 0 || beta >= 1)
      throw UsageError("--betas: each must be in [0, 1), as PyTorch's Adam requires; e.g. 0.9,0.999");
  if (!std::isfinite(o.eps) || o.eps <= 0) throw UsageError("--eps: must be a positive finite number, e.g. 1e-08");
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) throw UsageError("--weight-decay: must be >= 0");
  if (o.limit_train < 0 || o.limit_test < 0)
    throw UsageError("--limit-train/--limit-test: must be >= 0 (0 keeps every sample)");
  if (o.workers < 0)
    throw UsageError("--workers: " + std::to_string(o.workers) +
                     " is not a number of loader threads; give 0 (each batch assembled between steps) or 1");
  if (o.workers > kMaxWorkers)
    throw UsageError("--workers: " + std::to_string(o.workers) +
                     " loader threads would be no faster than 1: a batch is a gather from the data set in memory, "
                     "which one thread assembles well within a step; give 0 or 1");
  if (o.bucket_kb < 0) throw UsageError("--bucket-kb: must be >= 0 (0: one all-reduce after backward)");
  if (o.bucket_kb > 0 && !find_strategy(o.sync).takes_buckets())
    throw UsageError("--bucket-kb: buckets are a feature of --sync allreduce, zero2 and zero3; add one");
  check_grad_dtype(find_strategy(o.sync), o.grad_dtype);
  if (o.save_every < 0) throw UsageError("--save-every: must be >= 0");
  if (o.save_every > 0 && o.save.empty()) throw UsageError("--save-every: needs --save FILE to say where");
  if (o.log_every < 1)
    throw UsageError("--log-every: " + std::to_string(o.log_every) + " is not a step count; give at least 1");
  // Everything written at the end is checked before training: an unwritable path must not cost a run,
  // and no output may destroy another output or an input.
  if (lead) check_output_paths(o);
  if (!o.load.empty() && !o.resume.empty())
    throw UsageError("--load and --resume: give one (--resume also restores the optimizer and position)");
}

namespace {

// --lr-schedule's plan for a run of total_steps, refused where it cannot run.
LrSchedule lr_schedule(const TrainOptions& o, int64_t total_steps) {
  LrSchedule l;
  l.kind = o.lr_schedule;
  l.lr = o.lr, l.warmup = o.warmup, l.gamma = o.lr_gamma, l.total_steps = total_steps;
  if (o.warmup < 0) throw UsageError("--warmup: " + std::to_string(o.warmup) + " steps; give 0 (none) or more");
  if (o.warmup > total_steps)
    throw UsageError("--warmup " + std::to_string(o.warmup) + ": past the run's " + std::to_string(total_steps) +
                     " steps; give at most that many");
  if (o.lr_step_size != 0 && l.kind != LrScheduleKind::step)
    throw UsageError("--lr-step-size: only --lr-schedule step decays in steps; add it, or drop --lr-step-size");
  if (o.lr_step_size < 0)
    throw UsageError("--lr-step-size: " + std::to_string(o.lr_step_size) + " steps; give at least 1");
  if (!std::isfinite(o.lr_gamma) || o.lr_gamma <= 0 || o.lr_gamma > 1)
    throw UsageError("--lr-gamma: must be in (0, 1], the factor each decay multiplies the rate by, e.g. 0.1");
  l.step_size = o.lr_step_size > 0 ? o.lr_step_size : std::max<int64_t>(1, (total_steps - o.warmup) / 3);
  return l;
}

}  // namespace

// No product or sum here can overflow: per_epoch <= train_count < 2^32 and epochs < 2^31, so
// per_epoch * epochs < 2^63; the epoch count is a quotient, checked against the int the epoch
// records and the report count in.
Schedule schedule(const TrainOptions& o, int64_t train_count) {
  Schedule s;
  // A step trains on batch·accumulate images (the epoch's last on what is left).
  const int64_t step = o.step_images();
  s.per_epoch = train_count / step + (train_count % step != 0);
  s.total_steps = o.steps > 0 ? o.steps : s.per_epoch * o.epochs;
  const int64_t epochs = s.total_steps / s.per_epoch + (s.total_steps % s.per_epoch != 0);
  if (epochs > std::numeric_limits<int>::max())
    throw UsageError("--steps: " + std::to_string(s.total_steps) + " steps of " + std::to_string(s.per_epoch) +
                     " per epoch are " + std::to_string(epochs) + " epochs, more than the " +
                     std::to_string(std::numeric_limits<int>::max()) + " a run can count; give fewer steps");
  s.epochs = int(epochs);
  s.lr = lr_schedule(o, s.total_steps);
  return s;
}

// Either set, each held to the same checks: the model's image size and label range.
Dataset load_set(const TrainOptions& o, const ModelSpec& spec, const char* prefix, int64_t limit) {
  return load_idx(o.data, prefix, limit, spec.classes, ImageShape{spec.in_h, spec.in_w, spec.name});
}

DataSets load_data(const TrainOptions& o, const ModelSpec& spec) {
  DataSets d{load_set(o, spec, "train", o.limit_train), load_set(o, spec, "t10k", o.limit_test)};
  if (d.train.count == 0)
    throw UsageError(o.data + ": the training set has no images (--limit-train keeps the first N of them)");
  return d;
}

EngineConfig engine_config(const TrainOptions& o, int64_t train_count) {
  EngineConfig ec;
  // Buffers are sized for the largest batch a step will see: never more than the training set.
  ec.sync = o.sync, ec.split = o.split, ec.batch = int(std::min<int64_t>(o.batch, train_count)), ec.lr = o.lr;
  ec.optimizer = o.optimizer, ec.beta1 = o.beta1, ec.beta2 = o.beta2, ec.eps = o.eps;
  ec.momentum = o.momentum, ec.weight_decay = o.weight_decay, ec.bucket_kb = o.bucket_kb, ec.trace = !o.trace.empty();
  ec.sync_bn = o.sync_bn;
  ec.accumulate = o.accumulate;
  ec.clip_grad_norm = o.clip_grad_norm;
  ec.all_reduce = o.all_reduce;
  ec.grad_dtype = o.grad_dtype;
  ec.timeout = o.timeout;
  ec.prefetch = o.prefetch && !o.eval;  // --eval stages nothing
  ec.graphs = o.graphs;
  ec.time_phases = !o.log.empty() || !o.trace.empty();
  return ec;
}

bool runs_ahead(const TrainOptions& o, DeviceKind kind, bool in_job) {
  if (in_job) return false;
  return o.run_ahead.value_or(kind == DeviceKind::cuda);
}

namespace {

// Less than what one device holds for the model, on any backend: its parameters and gradients (its
// chunk of the gradients under zero2, of both under zero3), the optimizer state it keeps (all of it,
// or its chunk under a sharded strategy; under scatter device 0 keeps all of it), and for its share of
// the batch the outputs Network keeps for backward (every layer's but a view's and a convolution's,
// which a fused or chunked backend keeps only a chunk of) and its two gradient buffers, each at least
// an input wide (engine/network.cpp). No workspace, no batch, no scratch. Without `state`: less the
// optimizer state.
int64_t model_bytes(const TrainOptions& o, const ModelSpec& spec, int job_devices, int64_t share, bool state = true) {
  EngineConfig c;
  c.optimizer = o.optimizer, c.momentum = o.momentum;
  const int64_t P = spec.param_count, states = int64_t(optimizer_state_names(c).size());
  const int stage = find_strategy(o.sync).zero_stage();
  const int64_t kept = stage > 0 ? shard_chunk(P, job_devices) : P;
  int64_t per_sample = 2 * spec.input_size();
  for (const Layer& l : spec.layers)
    if (l.kind != LayerKind::flatten && l.kind != LayerKind::conv) per_sample += l.out_size();
  const int64_t params = stage >= 3 ? kept : P, grads = stage >= 2 ? kept : P;
  return int64_t(sizeof(float)) * (params + grads + (state ? states * kept : 0) + per_sample * share);
}

}  // namespace

void check_simulated_devices(const TrainOptions& o, const ModelSpec& spec, int processes, int64_t train_count) {
  const DeviceConfig& d = o.devices;
  const int64_t n = d.all ? 0 : int64_t(d.ids.size());
  if (n <= kDefaultSimulatedDevices || d.backend == "cuda" || (d.backend == "auto" && probe_cuda().count > 0)) return;
  const int64_t batch = std::min<int64_t>(o.batch, std::max<int64_t>(train_count, 1));
  // k devices of this process, each at least model_bytes (under scatter device 0 alone the optimizer state).
  const bool every_state = find_strategy(o.sync).steps_optimizer(1);
  auto total = [&](int64_t k) {
    const int64_t job = k * processes, share = (batch + job - 1) / job;
    const int j = int(std::min<int64_t>(job, std::numeric_limits<int>::max()));
    return model_bytes(o, spec, j, share) + (k - 1) * model_bytes(o, spec, j, share, every_state);
  };
  const HostMemory host = host_memory();
  if (total(n) <= host.bound()) return;
  int64_t fits = 1;
  for (int64_t hi = n; hi - fits > 1;) {
    const int64_t mid = fits + (hi - fits) / 2;
    (total(mid) <= host.bound() ? fits : hi) = mid;
  }
  throw UsageError("--devices " + std::to_string(n) +
                   ": each simulated device is a thread of this process holding at least " +
                   format_bytes(total(n) / n) + " of its memory (" + spec.name +
                   "'s parameters, gradients, optimizer state and activations), " + format_bytes(total(n)) +
                   " in all, more than " + host.describe() + "; at most " + std::to_string(fits) + " fit");
}

void check_model_fits(const TrainOptions& o, const ModelSpec& spec, const DeviceSet& devs, int job_devices,
                      int64_t train_count) {
  Device& d = *devs.devices[0];
  int64_t bound = d.ledger().cap();
  std::string against = "--device-memory " + format_bytes(bound), who = "a device holds";
  // Without a cap, this process's simulated devices share the host's memory: all of them against it,
  // the optimizer state on device 0 alone under scatter (as check_simulated_devices counts them).
  const int64_t k = int64_t(devs.devices.size());
  const bool shared_host = bound == 0 && d.kind() == DeviceKind::simulated;
  if (shared_host) {
    const HostMemory host = host_memory();
    bound = host.bound();
    against = host.describe();
    who = k > 1 ? "its " + std::to_string(k) + " simulated devices hold" : "its simulated device holds";
  }
  // A GPU without --device-memory: its allocator's refusal names the device and the category.
  if (bound == 0) return;
  // Each device's share of the batch a step trains (--batch, clamped to the training set).
  const int64_t batch = std::min<int64_t>(o.batch, std::max<int64_t>(train_count, 1));
  const int64_t share = (batch + job_devices - 1) / job_devices;
  const bool every_state = find_strategy(o.sync).steps_optimizer(1);
  auto need = [&](int width) {
    const ModelSpec m = make_model(o.model, width);
    const int64_t first = model_bytes(o, m, job_devices, share);
    return shared_host ? first + (k - 1) * model_bytes(o, m, job_devices, share, every_state) : first;
  };
  const int64_t bytes = need(spec.width);
  if (bytes <= bound) return;
  int fits = 0;
  while (fits < spec.width && need(fits + 1) <= bound) ++fits;
  throw UsageError("--width " + std::to_string(spec.width) + ": " + spec.name + " has " + commas(spec.param_count) +
                   " parameters there, and " + who + " at least " + format_bytes(bytes) +
                   " (parameters, gradients, the optimizer state kept and the activations of " + std::to_string(share) +
                   " images a device), more than " + against + "; " +
                   (fits > 0 ? "the largest width that fits is " + std::to_string(fits)
                             : "not even width 1 fits; give more memory"));
}

void check_accumulate(const TrainOptions& o, int job_devices) {
  if (o.accumulate > 1 && o.batch < job_devices)
    throw UsageError("--accumulate " + std::to_string(o.accumulate) + ": micro-batches of --batch " +
                     std::to_string(o.batch) + " leave some of the " + std::to_string(job_devices) +
                     " devices without samples in every one; give --batch " + std::to_string(job_devices) +
                     " or more (the step's images are --batch x --accumulate)");
}

std::string accumulation_note(const TrainOptions& o) {
  if (o.accumulate <= 1) return "";
  const Strategy& s = find_strategy(o.sync);
  const std::string step = "a step is " + std::to_string(o.accumulate) + " micro-batches of " +
                           std::to_string(o.batch) + " images, " + std::to_string(o.step_images()) + " in all; ";
  if (!s.steps_optimizer(1))  // scatter: nn.DataParallel
    return step +
           "scatter reduces the gradients to device 0 every micro-batch, as nn.DataParallel's backward does, "
           "and device 0 adds them up and steps the optimizer once";
  return step + "each device adds its gradients up over them and " + s.name() + " " + s.reduces() +
         " once a step, at the last micro-batch (DDP's no_sync)" +
         (s.zero_stage() >= 2 ? "; meanwhile each device holds the whole gradient, as FSDP's no_sync does" : "");
}

// BatchNorm in training divides by the count's variance less one: a replica normalising one sample
// (PyTorch: "Expected more than 1 value per channel when training") is refused before any step, for
// the full batch and, where the run gets there, the epoch's last, smaller one. With --sync-bn only
// the global batch counts.
void check_batchnorm(const TrainOptions& o, const ModelSpec& spec, const Schedule& plan, int64_t train_count,
                     int devices) {
  if (o.sync_bn && !spec.has_batchnorm())
    throw UsageError("--sync-bn: model " + spec.name + " has no BatchNorm; the model with BatchNorm is lenet-bn");
  if (!spec.has_batchnorm() || o.eval) return;
  if (o.verify && o.optimizer != Optimizer::sgd)
    throw UsageError(
        "--verify: with BatchNorm a value within rounding of a ReLU's or max-pool's threshold goes either way, and "
        "under Adam that can turn a weight's normalised update around: no bound covers the runs' difference. "
        "Verify BatchNorm with --optimizer sgd, or Adam on lenet");
  if (o.verify && !o.sync_bn && devices > 1)
    throw UsageError(
        "--verify: with BatchNorm each of the " + std::to_string(devices) +
        " devices normalises its own samples, which one device on the full batch does not: the runs differ by "
        "more than summation order. Add --sync-bn (then they match), or run --verify on one device");
  // The micro-batches (--accumulate): --batch's, and the last of the epoch's last step.
  const int64_t batch = std::min<int64_t>(o.batch, train_count);
  const int64_t last = plan.total_steps >= plan.per_epoch ? train_count % o.step_images() % batch : 0;
  for (int64_t b : {batch, last}) {
    if (b == 0) continue;
    const std::string which = (b == batch ? "a batch of " : "the epoch's last batch of ") + std::to_string(b);
    const auto sizes = split_batch(int(b), o.sync_bn ? 1 : devices, o.split);  // --sync-bn: the global batch
    for (size_t d = 0; d < sizes.size(); ++d)
      if (sizes[d] == 1)
        throw UsageError("--model " + spec.name + ": " + which +
                         (sizes.size() > 1 ? " over " + std::to_string(devices) + " devices gives device " +
                                                 std::to_string(d) + " a shard of 1 sample"
                                           : (b == 1 ? " sample" : "")) +
                         ", and BatchNorm needs more than 1 value per channel in training; give a --batch or "
                         "--limit-train that leaves " +
                         (sizes.size() > 1 ? "every device 0 or at least 2 samples, or add --sync-bn (statistics "
                                             "over the global batch)"
                                           : "at least 2 samples in every batch"));
  }
}

std::vector<Device*> pointers(const DeviceSet& set) {
  std::vector<Device*> out;
  for (auto& d : set.devices) out.push_back(d.get());
  return out;
}

// A device the split leaves without samples (batch < devices, or torch.chunk's trailing devices)
// idles under scatter, as in nn.DataParallel; said once, for the full batch.
void note_idle_devices(const TrainOptions& o, int batch, int devices) {
  auto sizes = split_batch(batch, devices, o.split);
  int idle = int(std::count(sizes.begin(), sizes.end(), 0));
  if (idle > 0)
    std::printf("note: a batch of %d over %d devices (--split %s) leaves %d device(s) without samples; %s\n", batch,
                devices, split_name(o.split), idle, find_strategy(o.sync).idle_device());
}

// Sizes past what the data holds are clamped, as a user asking for "at most N" expects, and said.
void note_clamped_sizes(const TrainOptions& o, const DataSets& d) {
  auto more_than = [&](const std::string& flag, int64_t asked, int64_t count, const std::string& images) {
    std::printf("note: %s %lld is more than the %lld %s; %s\n", flag.c_str(), (long long)asked, (long long)count,
                images.c_str(), flag == "--batch" ? "every step trains on all of them" : "all of them are used");
  };
  const std::string in = " images in " + o.data;
  if (o.limit_train > d.train.count) more_than("--limit-train", o.limit_train, d.train.count, "training" + in);
  if (o.limit_test > d.test.count) more_than("--limit-test", o.limit_test, d.test.count, "test" + in);
  if (o.batch > d.train.count)
    more_than("--batch", o.batch, d.train.count,
              o.limit_train == d.train.count ? "training images --limit-train keeps" : "training" + in);
}

// --resume's weights (with the optimizer's state), --load's, or fresh ones drawn from --seed, with BatchNorm's
// running statistics.
Checkpoint initial_state(const TrainOptions& o, const ModelSpec& spec, const Resumed& resumed) {
  if (!o.resume.empty()) return resumed.checkpoint;
  Checkpoint init;
  if (!o.load.empty()) {
    init = load_checkpoint(o.load, spec);
    init.optimizer_state.clear();  // --load starts the optimizer afresh
    init.optimizer_steps = 0;
    if (!init.note.empty() && !o.quiet) std::printf("note: %s\n", init.note.c_str());
    return init;
  }
  init.params.resize(size_t(spec.param_count));
  init_params(spec, o.seed, init.params.data());
  init.buffers.resize(size_t(spec.buffer_count));
  init_buffers(spec, init.buffers.data());
  return init;
}

// A state (weights, the optimizer's state, running statistics) onto every replica. The optimizer's
// buffers the checkpoint lacks (it was saved by another optimizer, or at momentum 0) start as zeros,
// as a fresh optimizer's do; the resume check has warned about the change.
void place(Engine& engine, const Checkpoint& state) {
  engine.set_params(state.params);
  std::vector<std::vector<float>> optimizer;
  for (const std::string& name : optimizer_state_names(engine.config())) {
    auto it = state.optimizer_state.find(name);
    optimizer.push_back(it != state.optimizer_state.end() ? it->second : std::vector<float>(state.params.size(), 0.0f));
  }
  engine.set_optimizer_state(optimizer);
  engine.set_optimizer_steps(state.optimizer_steps);
  engine.set_running_stats(state.buffers);
  engine.set_batches_tracked(state.batches_tracked);
}

void print_resuming(const TrainOptions& o, const Schedule& s, int64_t global_step) {
  const std::string done = global_step == s.total_steps ? "; that is already the last step, nothing to train"
                           : global_step > s.total_steps
                               ? "; past the run's " + std::to_string(s.total_steps) + " steps, nothing to train"
                               : "";
  std::printf("resuming from %s at step %lld (epoch %lld, step %lld of %lld)%s\n", o.resume.c_str(),
              (long long)global_step, (long long)(global_step / s.per_epoch) + 1,
              (long long)(global_step % s.per_epoch), (long long)s.per_epoch, done.c_str());
}

}  // namespace dp
