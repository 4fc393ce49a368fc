#include "engine/engine.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <stdexcept>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "engine/process_communicator.h"

namespace dp {

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
  scalars_.resize(kStepsInFlight);
  // A CUDA lock serves every GPU of the process.
  scalars_locked_ = devices_[0]->pin_host(scalars_.data(), scalars_.size() * sizeof(OptimizerScalars));
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
  require_no_step_in_flight("evaluate");
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
