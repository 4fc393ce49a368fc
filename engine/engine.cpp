#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <stdexcept>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "engine/process_communicator.h"

namespace dp {
namespace {

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A step of n images in `micros` micro-batches, from what each device's stats say: the loss and the
// correct count summed; finite where every device found what it checked finite (device 0 the whole
// gradient, or each device its own shard).
StepResult step_result(const std::vector<std::array<float, kStats>>& stats, int n, int micros) {
  StepResult res;
  res.n = n;
  res.micro_batches = micros;
  for (const auto& s : stats) {
    res.loss += s[0];
    res.correct += int64_t(s[1]);
    res.finite_gradients = res.finite_gradients && s[kNonfinite] == 0.0f;
  }
  return res;
}

}  // namespace

Split parse_split(const std::string& s) {
  if (s == "even") return Split::even;
  if (s == "chunk") return Split::chunk;
  throw UsageError("--split: '" + s + "' is not a split; use even or chunk");
}

void check_step_images(int64_t batch, int64_t accumulate) {
  if (batch <= 0)
    throw UsageError("--batch: " + std::to_string(batch) +
                     " is not a batch size; give a positive number of images, e.g. 256");
  if (accumulate <= 0)
    throw UsageError("--accumulate: " + std::to_string(accumulate) +
                     " is not a number of micro-batches; give at least 1 (1: every batch is a step)");
  if (batch * accumulate > std::numeric_limits<int>::max())
    throw UsageError("--accumulate " + std::to_string(accumulate) + " with --batch " + std::to_string(batch) +
                     ": a step of more than 2^31 - 1 images; give fewer micro-batches");
}

DType parse_grad_dtype(const std::string& s) {
  for (DType t : {DType::fp32, DType::bf16, DType::fp16})
    if (s == dtype_name(t)) return t;
  throw UsageError("--grad-dtype: '" + s +
                   "' is not a gradient type; use fp32 (as computed), bf16 (bf16_compress_hook) or fp16 "
                   "(fp16_compress_hook)");
}

const char* split_name(Split s) { return s == Split::even ? "even" : "chunk"; }

std::vector<int> split_batch(int b, int n, Split split) {
  std::vector<int> sizes(n, 0);
  if (split == Split::even) {
    for (int r = 0; r < n; ++r) sizes[r] = b / n + (r < b % n ? 1 : 0);
  } else {
    int per = (b + n - 1) / n, left = b;
    for (int r = 0; r < n; ++r) {
      sizes[r] = std::min(per, left);
      left -= sizes[r];
    }
  }
  return sizes;
}

Engine::Engine(std::vector<Device*> devices, const ModelSpec& spec, EngineConfig cfg)
    : devices_(std::move(devices)),
      spec_(spec),
      cfg_(cfg),
      strategy_(find_strategy(cfg_.sync)),
      recorder_(int(devices_.size()), cfg_.trace, cfg_.time_phases) {
  check_step_images(cfg_.batch, cfg_.accumulate);
  if (!(cfg_.timeout > 0)) throw UsageError("--timeout: must be a positive number of seconds");
  check_grad_dtype(strategy_, cfg_.grad_dtype);
  const int n = size();
  world_ = n;
  if (cfg_.group && cfg_.group->size() > 1) {
    if (const char* why = strategy_.one_process_only())
      throw UsageError("--sync " + std::string(strategy_.name()) + ": " + why +
                       "; across processes use --sync allreduce or a ZeRO stage (zero1, zero2, zero3)");
    world_ = cfg_.group->size() * n, first_ = cfg_.group->rank() * n;
    comm_ = make_process_communicator(devices_, *cfg_.group);  // NCCL on GPUs, MPI otherwise
  } else {
    comm_ = make_communicator(devices_);
  }
  comm_->set_all_reduce_algorithm(cfg_.all_reduce);
  comm_->set_timeout(cfg_.timeout);
  check_graphs();
  allocate_replicas();
  for (auto& d : devices_) d->run([&d] { d->prepare_steps(); }).get();
}

void Engine::allocate_replicas() {
  const int n = size();
  const int64_t P = spec_.param_count;
  // The units of a sharded strategy: zero1 the whole model (its flat buffers padded), zero2 and
  // zero3 the gradient buckets; the optimizer state, zero2's and zero3's gradients and zero3's
  // parameters the device's chunks alone.
  make_buckets();
  const int stage = strategy_.zero_stage();
  if (stage > 0) {
    units_ = shard_units(stage == 1 ? std::vector<Bucket>{{0, P, 0}} : buckets_, world_);
    owned_ = owned_floats(units_);
  }
  const int64_t flat = stage == 1 ? owned_ * world_ : stage == 3 ? owned_ : P, state = stage > 0 ? owned_ : P;
  const int64_t grads = stage >= 2 ? owned_ : flat;
  // Every device's buffers hold the largest share of any device.
  const int b = std::max(split_batch(cfg_.batch, world_, cfg_.split)[0], 1);
  replicas_.resize(n);
  run_all([&](int r) {
    Device& dev = *devices_[r];
    auto rep = std::make_unique<Replica>();
    // Zeros until set_params: no replica starts from whatever the memory held (a NaN there would last).
    rep->params = dev.alloc_floats(flat, Category::parameters);
    dev.ops().fill(flat, 0.0f, rep->params.f());
    rep->grads = dev.alloc_floats(grads, Category::gradients);
    dev.ops().fill(grads, 0.0f, rep->grads.f());  // backward writes [0, P); the padding stays zero
    if (cfg_.accumulate > 1 && stage >= 2) rep->accumulated = dev.alloc_floats(P, Category::gradients);
    if (strategy_.steps_optimizer(r))
      for (size_t i = 0; i < optimizer_state_names(cfg_).size(); ++i) {
        rep->state.push_back(dev.alloc_floats(state, Category::optimizer));
        dev.ops().fill(state, 0.0f, rep->state.back().f());
      }
    if (spec_.has_batchnorm()) {
      rep->running = dev.alloc_floats(spec_.buffer_count, Category::parameters);
      std::vector<float> init(size_t(spec_.buffer_count));
      init_buffers(spec_, init.data());
      dev.upload(rep->running.f(), init.data(), init.size() * sizeof(float));
      dev.synchronize();  // init is a local
    }
    rep->net = std::make_unique<Network>(spec_, dev, b, -1, /*accumulates=*/cfg_.accumulate > 1);
    rep->stats = dev.alloc_floats(kStats, Category::outputs);
    if (cfg_.clip_grad_norm > 0 && strategy_.steps_optimizer(r)) rep->norm = dev.alloc_floats(1, Category::workspace);
    if (strategy_.steps_optimizer(r)) rep->scalars = dev.alloc(sizeof(OptimizerScalars), Category::workspace);
    strategy_.allocate(dev, *rep, spec_, cfg_, r, b);
    // zero2's and zero3's reduce-scatters run on the communication thread: the ring's scratch sized
    // for the largest unit now, not grown there mid-step, where the ledger's peak would depend on
    // which thread allocated first. A job of one device has no ring.
    if (stage >= 2 && world_ > 1) {
      int64_t largest = 0;
      for (const ShardUnit& u : units_) largest = std::max(largest, u.chunk);
      comm_->reserve_scratch(r, largest);
    }
    dev.synchronize();
    replicas_[r] = std::move(rep);
  });
}

// The gradient buckets and each layer's (gradient_buckets, strategy.h: the rule dp_bench models too).
void Engine::make_buckets() {
  buckets_ = gradient_buckets(spec_, strategy_, cfg_.bucket_kb, &layer_bucket_);
  recorder_.set_buckets(int(buckets_.size()));
}

Engine::~Engine() {
  drop_staged();  // no upload may still be writing into a buffer freed below
  // Buffers are freed by their own device; the CUDA allocator wants its thread.
  for (int r = 0; r < size() && r < int(replicas_.size()); ++r)
    if (replicas_[r]) devices_[r]->run([&, r] { replicas_[r].reset(); }).wait();
}

void Engine::run_all(const std::function<void(int)>& fn) {
  std::vector<std::future<void>> futures;
  for (int r = 0; r < size(); ++r) {
    futures.push_back(devices_[r]->run([this, &fn, r] {
      try {
        fn(r);
      } catch (...) {
        comm_->abort();  // no rank may wait forever for this one
        throw;
      }
    }));
  }
  std::exception_ptr first, aborted;
  for (int r = 0; r < size(); ++r) {
    try {
      futures[r].get();
    } catch (const Aborted&) {
      if (!aborted) aborted = std::current_exception();
    } catch (const DeviceError&) {
      if (!first) first = std::current_exception();
    } catch (const std::bad_alloc&) {  // host memory outside the ledger (a library's, a thread's)
      if (!first)
        first = std::make_exception_ptr(DeviceError(devices_[r]->id(), "out of host memory (std::bad_alloc)"));
    } catch (const std::exception& e) {
      if (!first) first = std::make_exception_ptr(DeviceError(devices_[r]->id(), e.what()));
    }
  }
  if (first || aborted) {
    comm_->recover();
    std::rethrow_exception(first ? first : aborted);
  }
}

StepResult Engine::step(const float* x, const int32_t* y, int n) {
  if (!staged_.empty()) throw std::logic_error("Engine::step(x, y, n): a batch is already staged; step() trains on it");
  stage(x, y, n);
  return step();
}

std::pair<int, int> Engine::upload_rows(int r, int n) const {
  return strategy_.upload_rows(split_batch(n, world_, cfg_.split), first_, r);
}

StagedBatch Engine::micro_batch(const StagedBatch& b, int k) const {
  const int first = k * cfg_.batch;
  return {b.x + int64_t(first) * spec_.input_size(), b.y + first, std::min(cfg_.batch, b.n - first), b.slot,
          k == 0 && b.ahead};
}

void Engine::upload(int r, const StagedBatch& b, bool ahead) {
  auto [first, rows] = upload_rows(r, b.n);
  if (rows == 0) return;
  // With --accumulate the process holds every row of the step (slice): its own start after the others'.
  if (cfg_.accumulate > 1) first += process_rows(b.n).first;
  Device& dev = *devices_[r];
  const Replica::Upload& to = replicas_[r]->batch[size_t(b.slot)];
  const int64_t D = spec_.input_size();
  const float* x = b.x + int64_t(first) * D;
  const int32_t* y = b.y + first;
  const size_t x_bytes = size_t(int64_t(rows) * D) * sizeof(float), y_bytes = size_t(rows) * sizeof(int32_t);
  if (ahead) {
    dev.upload_ahead(b.slot, to.x.data(), x, x_bytes);
    dev.upload_ahead(b.slot, to.y.data(), y, y_bytes);
  } else {
    dev.upload(to.x.data(), x, x_bytes);
    dev.upload(to.y.data(), y, y_bytes);
  }
}

// With prefetch a step's first micro-batch was uploaded ahead; the others upload at their turn, into
// the same slot, on the compute stream after the micro-batch before them.
void Engine::load(int r, const StagedBatch& b) {
  if (!b.ahead)
    upload(r, b, /*ahead=*/false);
  else if (upload_rows(r, b.n).second > 0)
    devices_[r]->await_upload(b.slot);
}

// Every upload that may read the staged batches' host memory is done first: the copy stream's, and a
// failed step's on the compute stream (without prefetch, or a later micro-batch), whose page-locked
// source the loader may unregister and free next. A device whose stream failed reads nothing more.
void Engine::drop_staged() noexcept {
  staged_.clear();
  for (Device* d : devices_) {
    try {
      d->synchronize();
    } catch (...) {
      d->finish_uploads();
    }
  }
}

void Engine::stage(const float* x, const int32_t* y, int n) {
  if (n <= 0 || n > cfg_.batch * cfg_.accumulate)
    throw UsageError("step: batch of " + std::to_string(n) + " samples; this engine takes 1.." +
                     std::to_string(cfg_.batch * cfg_.accumulate) +
                     (cfg_.accumulate > 1 ? " (" + std::to_string(cfg_.accumulate) + " micro-batches)" : ""));
  const size_t capacity = cfg_.prefetch ? Device::kUploadSlots : 1;
  if (staged_.size() >= capacity)
    throw std::logic_error("Engine::stage: " + std::to_string(capacity) + " batch(es) staged already, the most " +
                           (cfg_.prefetch ? "prefetch allows" : "an engine without prefetch takes") + "; step() first");
  StagedBatch b{x, y, n, 0};
  if (cfg_.prefetch) {
    b.slot = next_slot_, b.ahead = true;
    try {
      for (int r = 0; r < size(); ++r) upload(r, micro_batch(b, 0), /*ahead=*/true);
    } catch (...) {
      drop_staged();
      throw;
    }
    next_slot_ = (next_slot_ + 1) % Device::kUploadSlots;
  }
  staged_.push_back(b);
}

StepResult Engine::step() {
  if (staged_.empty()) throw std::logic_error("Engine::step: no batch staged; stage() one first");
  using Clock = std::chrono::steady_clock;
  const Clock::time_point step_start = Clock::now();
  const StagedBatch b = staged_.front();
  staged_.pop_front();
  // The micro-batches of the step (--accumulate): `batch` rows each, the last what is left.
  const int micros = (b.n + cfg_.batch - 1) / cfg_.batch;
  std::vector<StagedBatch> parts;
  std::vector<std::vector<int>> sizes;
  for (int k = 0; k < micros; ++k) {
    parts.push_back(micro_batch(b, k));
    sizes.push_back(split_batch(parts.back().n, world_, cfg_.split));
  }
  const auto traffic_before = recorder_.before(*comm_);
  std::vector<std::array<float, kStats>> stats(size(), {0.0f, 0.0f, 0.0f});
  const bool graph = runs_as_graph(b);
  // The optimizer's scalars go to the devices that step it, ahead of the step's work: its kernels
  // read them there, so a replayed graph takes this step's learning rate and bias correction. A local:
  // each device's step below ends by waiting for its stream, so its upload has read them by then.
  const OptimizerScalars scalars = optimizer_scalars(cfg_, optimizer_steps_ + 1);
  try {
    run_all([&](int r) {
      const Clock::time_point start = Clock::now();
      if (replicas_[r]->scalars) devices_[r]->upload(replicas_[r]->scalars.data(), &scalars, sizeof scalars);
      recorder_.begin_step(*devices_[r], r);
      if (!graph || !graph_step(parts[0], sizes[0]))
        for (int k = 0; k < micros; ++k) {
          StepContext context(*this, r, parts[size_t(k)], sizes[size_t(k)], {k, micros, b.n});
          strategy_.step(context);
        }
      // The loss and the correct count, on the devices that compute it; each device that stepped the
      // optimizer also says whether the gradient it stepped was finite. The download waits for the
      // step's work (the step's one round trip); close_phases then waits for the copy stream too: the
      // next batch's upload, staged before this step, is done when the step returns.
      const Clock::time_point enqueued = Clock::now();
      if (strategy_.computes_loss(r))
        devices_[r]->download(stats[size_t(r)].data(), replicas_[r]->stats.f(), sizeof(float) * kStats);
      recorder_.close_phases(*devices_[r], r, step_);
      recorder_.host_step(r, seconds(enqueued - start), seconds(Clock::now() - enqueued));
    });
  } catch (...) {
    drop_staged();
    throw;
  }
  const StepResult res = step_result(stats, b.n, micros);
  // Saturates at 2^63 - 1 rather than wrapping to a negative count, which a checkpoint could not hold.
  // BatchNorm's count goes on per micro-batch, each a forward in training (PyTorch's num_batches_tracked).
  if (spec_.has_batchnorm())
    batches_tracked_ = batches_tracked_ > std::numeric_limits<int64_t>::max() - micros
                           ? std::numeric_limits<int64_t>::max()
                           : batches_tracked_ + micros;
  ++optimizer_steps_;
  warm_ = warm_ || b.n == cfg_.batch * cfg_.accumulate;
  recorder_.after(*comm_, traffic_before, b.n == cfg_.batch * cfg_.accumulate);
  ++step_;
  recorder_.step_seconds(seconds(Clock::now() - step_start));
  return res;
}

std::pair<int, int> Engine::slice(int n) const {
  return cfg_.accumulate > 1 ? std::pair<int, int>{0, n} : process_rows(n);
}

std::pair<int, int> Engine::process_rows(int n) const {
  const std::vector<int> sizes = split_batch(n, world_, cfg_.split);
  int lo = 0, hi = 0;
  for (int g = 0; g < first_ + size(); ++g) (g < first_ ? lo : hi) += sizes[size_t(g)];
  return {lo, lo + hi};
}

BatchNormPass Engine::batchnorm_pass(int r, int B) {
  BatchNormPass bn;
  bn.running = replicas_[r]->running.f();
  // On one device in the whole job the batch's statistics are the replica's own: no all-reduce (nor
  // the host wait before it, which a step graph cannot hold).
  if (cfg_.sync_bn && world_ > 1) {
    bn.global_n = B;
    // With buckets the gradient all-reduces of backward are queued on the communication thread; the
    // statistics' all-reduce joins that queue (every rank queues in the same order) and waits for it.
    bn.all_reduce = [this, r](float* buf, int64_t count) {
      if (buckets_.empty()) return comm_->all_reduce(r, buf, count);
      comm_->all_reduce_async(r, buf, count);
      comm_->wait(r);
    };
  }
  return bn;
}

// Evaluation borrows the training buffers: with prefetch, a batch slot no staged batch is uploading
// into (the trainer stages the next epoch's first batch before this epoch's evaluation).
int Engine::evaluation_slot() const {
  int slot = 0;
  if (cfg_.prefetch)
    while (std::any_of(staged_.begin(), staged_.end(), [&](const StagedBatch& b) { return b.slot == slot; }))
      if (++slot == Device::kUploadSlots) throw std::logic_error("Engine::evaluate: every batch buffer is staged");
  return slot;
}

StepResult Engine::evaluate(const float* x, const int32_t* y, int n) {
  const double start_us = recorder_.now_us();  // the span covers the strategy's preparation too
  const int64_t D = spec_.input_size(), C = spec_.classes;
  // Evaluation is device 0's model on every device: its parameters and its running statistics.
  run_all([&](int r) { strategy_.before_evaluation(*comm_, r, *replicas_[r], spec_); });
  if (broadcasts_buffers())
    run_all([&](int r) { comm_->broadcast(r, replicas_[r]->running.f(), spec_.buffer_count, 0); });
  const std::vector<int> sizes = split_batch(n, size(), Split::even);
  std::vector<double> loss(size(), 0.0);
  std::vector<int64_t> correct(size(), 0);
  const int slot = evaluation_slot();
  run_all([&](int r) {
    Device& dev = *devices_[r];
    Replica& rep = *replicas_[r];
    Network& net = *rep.net;
    BatchNormPass bn;
    bn.training = false;
    bn.running = rep.running.f();
    int first = 0;
    for (int q = 0; q < r; ++q) first += sizes[q];
    // zero3: the whole model gathered for the evaluation (FSDP's summon_full_params), freed after it.
    Buffer whole = strategy_.zero_stage() == 3 ? gather_parameters(r) : Buffer();
    const float* params = whole ? whole.f() : rep.params.f();
    // A device that uploads no rows in training has only its input buffer, and no labels.
    const Replica::Upload& up = rep.batch[size_t(slot)];
    float* in = up.x ? up.x.f() : rep.input.f();
    float* dl = rep.dlogits ? rep.dlogits.f() : rep.gathered_grad.f();
    int32_t* lab = up.y.i32();
    Buffer own_labels;
    if (!lab) {
      own_labels = dev.alloc(size_t(net.max_batch()) * sizeof(int32_t), Category::inputs);
      lab = own_labels.i32();
    }
    for (int done = 0; done < sizes[r];) {
      int m = std::min(net.max_batch(), sizes[r] - done);
      dev.upload(in, x + int64_t(first + done) * D, size_t(m * D) * sizeof(float));
      dev.upload(lab, y + first + done, size_t(m) * sizeof(int32_t));
      dev.ops().fill(2, 0.0f, rep.stats.f());
      dev.ops().softmax_xent(m, int(C), net.forward(params, in, m, &bn), lab, 1.0f, dl, rep.stats.f());
      float stats[2];
      dev.download(stats, rep.stats.f(), sizeof stats);
      loss[r] += stats[0];
      correct[r] += int64_t(stats[1]);
      done += m;
    }
    recorder_.evaluation(r, step_, sizes[r], start_us);
  });
  StepResult res;
  res.n = n;
  for (int r = 0; r < size(); ++r) res.loss += loss[r], res.correct += correct[r];
  if (n > 0) res.loss /= n;
  return res;
}

}  // namespace dp
