#include "engine/engine.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <numeric>
#include <stdexcept>

#include "engine/error.h"
#include "engine/process_communicator.h"

namespace dp {

Sync parse_sync(const std::string& s) {
  if (s == "scatter") return Sync::scatter;
  if (s == "allreduce") return Sync::allreduce;
  throw UsageError("--sync: '" + s + "' is not a strategy; use scatter or allreduce");
}

Split parse_split(const std::string& s) {
  if (s == "even") return Split::even;
  if (s == "chunk") return Split::chunk;
  throw UsageError("--split: '" + s + "' is not a split; use even or chunk");
}

const char* sync_name(Sync s) { return s == Sync::scatter ? "scatter" : "allreduce"; }
const char* split_name(Split s) { return s == Split::even ? "even" : "chunk"; }

const char* phase_name(Phase p, Sync s) {
  static const char* names[kPhases] = {"load",        "scatter",  "broadcast", "forward",
                                       "gather+loss", "backward", "reduce",    "optimizer"};
  if (p == Phase::reduce && s == Sync::allreduce) return "all-reduce";
  if (p == Phase::gather_loss && s == Sync::allreduce) return "loss";
  return names[int(p)];
}

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

// A replica's stats: the loss sum, the correct count and, on device 0 after a step, 1 where the
// step's gradient held a value that is not finite (else 0).
constexpr int kStats = 3, kNonfinite = 2;

// Everything one device holds for its replica. Shapes use B (global batch), b (largest local
// batch), P (parameters), D (input size), C (classes).
struct Engine::Replica {
  Buffer params;    // (P)
  Buffer grads;     // (P)
  Buffer momentum;  // (P) scatter: device 0 only; allreduce: every device; none at momentum 0
  Buffer running;   // (R) BatchNorm's running statistics; none without BatchNorm
  std::unique_ptr<Network> net;
  // The batch as uploaded: under scatter device 0's whole batch, (B, D) and (B), its own chunk the
  // first rows; under allreduce each device's shard, (b, D) and (b). With prefetch two: the one a
  // step trains on and the next step's, uploading meanwhile (Engine::stage).
  struct Upload {
    Buffer x, y;
  };
  std::array<Upload, Device::kUploadSlots> batch;
  Buffer input;    // (b, D) scatter, devices 1..: the chunk scatter sends it
  Buffer dlogits;  // (b, C) this device's logit gradients (not on device 0 under scatter)
  Buffer stats;    // (kStats) loss sum, correct count, and on device 0 the step's gradient check
  // scatter, device 0 only: the gathered logits and their gradients
  Buffer gathered;       // (B, C)
  Buffer gathered_grad;  // (B, C)
};

Engine::Engine(std::vector<Device*> devices, const ModelSpec& spec, EngineConfig cfg)
    : devices_(std::move(devices)),
      spec_(spec),
      cfg_(cfg),
      phase_seconds_(devices_.size()),
      spans_(devices_.size()),
      open_phases_(devices_.size()),
      bucket_spans_(devices_.size()),
      eval_spans_(devices_.size()),
      step_traffic_(devices_.size()),
      step_inter_traffic_(devices_.size()),
      t0_(std::chrono::steady_clock::now()) {
  if (cfg_.batch <= 0) throw UsageError("--batch: must be at least 1");
  if (!(cfg_.timeout > 0)) throw UsageError("--timeout: must be a positive number of seconds");
  const int n = size();
  world_ = n;
  if (cfg_.group && cfg_.group->size() > 1) {
    if (cfg_.sync != Sync::allreduce)
      throw UsageError(
          "--sync scatter: nn.DataParallel is one process by design; across processes use --sync allreduce");
    world_ = cfg_.group->size() * n, first_ = cfg_.group->rank() * n;
    comm_ = make_process_communicator(devices_, *cfg_.group);  // NCCL on GPUs, MPI otherwise
  } else {
    comm_ = make_communicator(devices_);
  }
  comm_->set_all_reduce_algorithm(cfg_.all_reduce);
  comm_->set_timeout(cfg_.timeout);
  const int64_t P = spec_.param_count, D = spec_.input_size(), C = spec_.classes;
  const int b = split_batch(cfg_.batch, world_, cfg_.split)[0];  // the largest share of any device
  const int eval_b = std::max(b, 1);
  replicas_.resize(n);
  run_all([&](int r) {
    Device& dev = *devices_[r];
    auto rep = std::make_unique<Replica>();
    rep->params = dev.alloc_floats(P, Category::parameters);
    rep->grads = dev.alloc_floats(P, Category::gradients);
    bool owns_optimizer = cfg_.sync == Sync::allreduce || r == 0;
    if (cfg_.momentum != 0.0f && owns_optimizer) {
      rep->momentum = dev.alloc_floats(P, Category::optimizer);
      dev.ops().fill(P, 0.0f, rep->momentum.f());
    }
    if (spec_.has_batchnorm()) {
      rep->running = dev.alloc_floats(spec_.buffer_count, Category::parameters);
      std::vector<float> init(size_t(spec_.buffer_count));
      init_buffers(spec_, init.data());
      dev.upload(rep->running.f(), init.data(), init.size() * sizeof(float));
      dev.synchronize();  // init is a local
    }
    rep->net = std::make_unique<Network>(spec_, dev, eval_b);
    rep->stats = dev.alloc_floats(kStats, Category::outputs);
    const bool scatter_root = cfg_.sync == Sync::scatter && r == 0;
    if (scatter_root || cfg_.sync == Sync::allreduce) {
      const int rows = scatter_root ? cfg_.batch : eval_b;
      for (int s = 0; s < (cfg_.prefetch ? Device::kUploadSlots : 1); ++s) {
        rep->batch[size_t(s)].x = dev.alloc_floats(int64_t(rows) * D, Category::inputs);
        rep->batch[size_t(s)].y = dev.alloc(size_t(rows) * sizeof(int32_t), Category::inputs);
      }
    } else {
      rep->input = dev.alloc_floats(int64_t(eval_b) * D, Category::inputs);
    }
    if (scatter_root) {
      rep->gathered = dev.alloc_floats(int64_t(cfg_.batch) * C, Category::outputs);
      rep->gathered_grad = dev.alloc_floats(int64_t(cfg_.batch) * C, Category::outputs);
    } else {
      rep->dlogits = dev.alloc_floats(int64_t(eval_b) * C, Category::outputs);
    }
    dev.synchronize();
    replicas_[r] = std::move(rep);
  });

  // Buckets: parameterised layers from the last to the first (the order backward produces their
  // gradients), closed once they reach bucket_kb. Layers are contiguous in the flat buffer, so each
  // bucket is one contiguous range.
  layer_bucket_.assign(spec_.layers.size(), -1);
  if (cfg_.sync == Sync::allreduce && cfg_.bucket_kb > 0) {
    Bucket cur;
    int64_t hi = P;
    for (int i = int(spec_.layers.size()) - 1; i >= 0; --i) {
      const Layer& l = spec_.layers[i];
      if (l.weight < 0) continue;
      int64_t lo = spec_.params[l.weight].offset;
      cur.offset = lo;
      cur.count = hi - lo;
      cur.layers++;
      layer_bucket_[i] = int(buckets_.size());
      if (cur.count * int64_t(sizeof(float)) >= cfg_.bucket_kb * 1024) {
        buckets_.push_back(cur);
        hi = lo;
        cur = Bucket();
      }
    }
    if (cur.layers > 0) buckets_.push_back(cur);
  }
  if (cfg_.trace) bucket_timing_.assign(devices_.size(), std::vector<Interval>(buckets_.size()));
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

// A phase is two marks on the device (engine/device.h): on CUDA two events, so the host goes on
// enqueueing the next phase instead of waiting for this one; the step waits once, in close_phases.
template <class F>
void Engine::timed(int rank, Phase p, F&& f) {
  Device& dev = *devices_[rank];
  const int start = dev.mark();
  f();
  open_phases_[rank].push_back({p, start, dev.mark()});
}

// The step's one wait for the device: then each phase's marks become seconds (and trace spans). On
// CUDA a phase is the GPU's time from the end of the previous phase to the end of its own work,
// idle time waiting for the host's launches included, so the phases add up to the step.
void Engine::close_phases(int rank) {
  Device& dev = *devices_[rank];
  dev.synchronize();
  for (const OpenPhase& o : open_phases_[rank]) {
    const auto start = dev.mark_time(o.start), end = dev.mark_time(o.end);
    phase_seconds_[rank][int(o.phase)] += std::chrono::duration<double>(end - start).count();
    if (cfg_.trace) spans_[rank].push_back({o.phase, step_, us_since_start(start), us_since_start(end)});
  }
}

// After wait(): every bucket's all-reduce has returned and its stamps are this thread's to read. A
// bucket the communicator did not run (nothing to reduce) left its interval unstamped.
void Engine::record_buckets(int rank) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Interval& t = bucket_timing_[rank][b];
    if (t.end != std::chrono::steady_clock::time_point{})
      bucket_spans_[rank].push_back({step_, int(b), us_since_start(t.start), us_since_start(t.end)});
    t = {};
  }
}

void Engine::reset_timing() {
  for (auto& p : phase_seconds_) p = {};
  for (auto& s : spans_) s.clear();
  for (auto& s : bucket_spans_) s.clear();
  for (auto& s : eval_spans_) s.clear();
  host_spans_.clear();
}

void Engine::host_span(std::string name, double start_us, double end_us,
                       std::vector<std::pair<std::string, double>> args) {
  if (cfg_.trace) host_spans_.push_back({std::move(name), start_us, end_us, std::move(args)});
}

StepResult Engine::step(const float* x, const int32_t* y, int n) {
  if (!staged_.empty()) throw std::logic_error("Engine::step(x, y, n): a batch is already staged; step() trains on it");
  stage(x, y, n);
  return step();
}

std::pair<int, int> Engine::upload_rows(int r, int n) const {
  if (cfg_.sync == Sync::scatter) return {0, r == 0 ? n : 0};
  const std::vector<int> sizes = split_batch(n, world_, cfg_.split);
  // x holds this process's rows, from the job's device first_ on.
  int first = 0;
  for (int q = first_; q < first_ + r; ++q) first += sizes[size_t(q)];
  return {first, sizes[size_t(first_ + r)]};
}

void Engine::upload(int r, const Staged& b, bool ahead) {
  const auto [first, rows] = upload_rows(r, b.n);
  if (rows == 0) return;
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

// The load phase: the batch's upload on the compute stream or, with prefetch, the compute stream's
// wait for its upload on the copy stream, staged while the step before ran.
void Engine::load(int r, const Staged& b) {
  if (!cfg_.prefetch)
    upload(r, b, /*ahead=*/false);
  else if (upload_rows(r, b.n).second > 0)
    devices_[r]->await_upload(b.slot);
}

void Engine::drop_staged() noexcept {
  staged_.clear();
  for (Device* d : devices_) d->finish_uploads();
}

void Engine::stage(const float* x, const int32_t* y, int n) {
  if (n <= 0 || n > cfg_.batch)
    throw UsageError("step: batch of " + std::to_string(n) + " samples; this engine takes 1.." +
                     std::to_string(cfg_.batch));
  const size_t capacity = cfg_.prefetch ? Device::kUploadSlots : 1;
  if (staged_.size() >= capacity)
    throw std::logic_error("Engine::stage: " + std::to_string(capacity) + " batch(es) staged already, the most " +
                           (cfg_.prefetch ? "prefetch allows" : "an engine without prefetch takes") + "; step() first");
  Staged b{x, y, n, 0};
  if (cfg_.prefetch) {
    b.slot = next_slot_;
    try {
      for (int r = 0; r < size(); ++r) upload(r, b, /*ahead=*/true);
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
  const Staged b = staged_.front();
  staged_.pop_front();
  const int n = b.n;
  const std::vector<int> sizes = split_batch(n, world_, cfg_.split);
  std::vector<Traffic> before(size()), before_inter(size());
  for (int r = 0; r < size(); ++r) before[r] = comm_->total(r), before_inter[r] = comm_->inter_process(r);
  std::vector<std::array<float, kStats>> stats(size(), {0.0f, 0.0f, 0.0f});
  try {
    run_all([&](int r) {
      // A new set of marks each step, also after a failed one, which left its marks behind.
      devices_[r]->clear_marks();
      open_phases_[r].clear();
      if (cfg_.sync == Sync::scatter)
        step_scatter(r, b, sizes);
      else
        step_allreduce(r, b, sizes);
      // The loss and the correct count: on device 0 under scatter, a share on each device under
      // allreduce; device 0's also says whether the gradient was finite. The download waits for the
      // step's work (the step's one round trip); close_phases then waits for the copy stream too:
      // the next batch's upload, staged before this step, is done when the step returns.
      if (cfg_.sync == Sync::allreduce || r == 0)
        devices_[r]->download(stats[size_t(r)].data(), replicas_[r]->stats.f(), sizeof(float) * kStats);
      close_phases(r);
    });
  } catch (...) {
    drop_staged();
    throw;
  }
  StepResult res;
  res.n = n;
  for (const auto& s : stats) {
    res.loss += s[0];
    res.correct += int64_t(s[1]);
  }
  res.finite_gradients = stats[0][kNonfinite] == 0.0f;
  if (spec_.has_batchnorm()) ++batches_tracked_;
  if (n == cfg_.batch)
    for (int r = 0; r < size(); ++r) {
      Traffic t = comm_->total(r), i = comm_->inter_process(r);
      step_traffic_[r] = {t.sent - before[r].sent, t.received - before[r].received};
      step_inter_traffic_[r] = {i.sent - before_inter[r].sent, i.received - before_inter[r].received};
    }
  ++step_;
  return res;
}

std::pair<int, int> Engine::slice(int n) const {
  const std::vector<int> sizes = split_batch(n, world_, cfg_.split);
  int lo = 0, hi = 0;
  for (int g = 0; g < first_ + size(); ++g) (g < first_ ? lo : hi) += sizes[size_t(g)];
  return {lo, lo + hi};
}

BatchNormPass Engine::batchnorm_pass(int r, int B) {
  BatchNormPass bn;
  bn.running = replicas_[r]->running.f();
  if (cfg_.sync_bn) {
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

void Engine::step_scatter(int r, const Staged& batch, const std::vector<int>& sizes) {
  Device& dev = *devices_[r];
  Replica& rep = *replicas_[r];
  Ops& ops = dev.ops();
  const int64_t P = spec_.param_count, D = spec_.input_size(), C = spec_.classes;
  int B = 0;
  for (int s : sizes) B += s;
  std::vector<int64_t> in_counts, out_counts;
  for (int s : sizes) in_counts.push_back(s * D), out_counts.push_back(s * C);
  const int mine = sizes[r];
  const Replica::Upload& up = rep.batch[size_t(batch.slot)];  // device 0's

  // The whole batch lands on device 0 (DataParallel's input is on device_ids[0]).
  timed(r, Phase::load, [&] { load(r, batch); });
  timed(r, Phase::scatter, [&] { comm_->scatter(r, r == 0 ? up.x.f() : nullptr, rep.input.f(), in_counts, 0); });
  timed(r, Phase::broadcast, [&] {
    comm_->broadcast(r, rep.params.f(), P, 0);
    if (broadcasts_buffers()) comm_->broadcast(r, rep.running.f(), spec_.buffer_count, 0);
  });
  const float* logits = nullptr;
  const BatchNormPass bn = batchnorm_pass(r, B);
  timed(r, Phase::forward, [&] {
    if (mine > 0)
      logits = rep.net->forward(rep.params.f(), r == 0 ? up.x.f() : rep.input.f(), mine, &bn);
    else
      rep.net->forward_without_samples(&bn);
  });
  timed(r, Phase::gather_loss, [&] {
    comm_->gather(r, logits, rep.gathered.f(), out_counts, 0);
    if (r == 0) {
      ops.fill(kStats, 0.0f, rep.stats.f());
      ops.softmax_xent(B, int(C), rep.gathered.f(), up.y.i32(), 1.0f / float(B), rep.gathered_grad.f(), rep.stats.f());
    }
    comm_->scatter(r, r == 0 ? rep.gathered_grad.f() : nullptr, rep.dlogits.f(), out_counts, 0);
  });
  timed(r, Phase::backward, [&] {
    // A device without samples (batch smaller than the device count) contributes zeros.
    if (mine > 0)
      rep.net->backward(rep.params.f(), rep.grads.f(), r == 0 ? rep.gathered_grad.f() : rep.dlogits.f(), mine, {}, &bn);
    else
      rep.net->backward_without_samples(rep.grads.f(), {}, &bn);
  });
  timed(r, Phase::reduce, [&] { comm_->reduce(r, rep.grads.f(), P, 0); });
  timed(r, Phase::optimizer, [&] {
    if (r == 0) {
      ops.flag_nonfinite(P, rep.grads.f(), rep.stats.f() + kNonfinite);
      ops.sgd_step(P, rep.params.f(), rep.grads.f(), rep.momentum.f(), cfg_.lr, cfg_.momentum, cfg_.weight_decay);
    }
  });
}

void Engine::step_allreduce(int r, const Staged& batch, const std::vector<int>& sizes) {
  Device& dev = *devices_[r];
  Replica& rep = *replicas_[r];
  Ops& ops = dev.ops();
  const int64_t P = spec_.param_count, C = spec_.classes;
  // sizes are the job's devices'; this device is the job's device first_ + r.
  int B = 0;
  for (int s : sizes) B += s;
  const int mine = sizes[size_t(first_ + r)];
  const Replica::Upload& up = rep.batch[size_t(batch.slot)];

  // Each device reads its own shard straight from host memory (DistributedSampler's rank slice).
  timed(r, Phase::load, [&] { load(r, batch); });
  // DDP's broadcast_buffers: rank 0's running statistics to every replica before its forward.
  if (broadcasts_buffers())
    timed(r, Phase::broadcast, [&] { comm_->broadcast(r, rep.running.f(), spec_.buffer_count, 0); });
  const float* logits = nullptr;
  const BatchNormPass bn = batchnorm_pass(r, B);
  timed(r, Phase::forward, [&] {
    if (mine > 0)
      logits = rep.net->forward(rep.params.f(), up.x.f(), mine, &bn);
    else
      rep.net->forward_without_samples(&bn);
  });
  // Scaled by 1/B, not 1/mine: the shards' gradients then sum to the full batch's exactly.
  timed(r, Phase::gather_loss, [&] {
    ops.fill(kStats, 0.0f, rep.stats.f());
    if (mine > 0) ops.softmax_xent(mine, int(C), logits, up.y.i32(), 1.0f / float(B), rep.dlogits.f(), rep.stats.f());
  });
  std::vector<int> remaining;
  for (auto& b : buckets_) remaining.push_back(b.layers);
  auto on_ready = [&](int layer) {
    int b = layer_bucket_[layer];
    if (b >= 0 && --remaining[b] == 0)
      comm_->all_reduce_async(r, rep.grads.f() + buckets_[b].offset, buckets_[b].count,
                              cfg_.trace ? &bucket_timing_[r][b] : nullptr);
  };
  timed(r, Phase::backward, [&] {
    const auto ready = buckets_.empty() ? std::function<void(int)>() : on_ready;
    if (mine > 0)
      rep.net->backward(rep.params.f(), rep.grads.f(), rep.dlogits.f(), mine, ready, &bn);
    else
      rep.net->backward_without_samples(rep.grads.f(), ready, &bn);
  });
  timed(r, Phase::reduce, [&] {
    if (buckets_.empty())
      comm_->all_reduce(r, rep.grads.f(), P);
    else
      comm_->wait(r);
  });
  if (cfg_.trace && !buckets_.empty()) record_buckets(r);
  timed(r, Phase::optimizer, [&] {
    // Every replica holds the same gradient now: device 0's check speaks for all.
    if (r == 0) ops.flag_nonfinite(P, rep.grads.f(), rep.stats.f() + kNonfinite);
    ops.sgd_step(P, rep.params.f(), rep.grads.f(), rep.momentum.f(), cfg_.lr, cfg_.momentum, cfg_.weight_decay);
  });
}

StepResult Engine::evaluate(const float* x, const int32_t* y, int n) {
  const double start_us = now_us();  // the span covers scatter's broadcast too
  const int64_t D = spec_.input_size(), C = spec_.classes;
  if (cfg_.sync == Sync::scatter)
    run_all([&](int r) { comm_->broadcast(r, replicas_[r]->params.f(), spec_.param_count, 0); });
  // Evaluation is device 0's model on every device: its running statistics too.
  if (broadcasts_buffers())
    run_all([&](int r) { comm_->broadcast(r, replicas_[r]->running.f(), spec_.buffer_count, 0); });
  const std::vector<int> sizes = split_batch(n, size(), Split::even);
  std::vector<double> loss(size(), 0.0);
  std::vector<int64_t> correct(size(), 0);
  // Evaluation borrows the training buffers: with prefetch, a batch slot no staged batch is uploading
  // into (the trainer stages the next epoch's first batch before this epoch's evaluation).
  int slot = 0;
  if (cfg_.prefetch)
    while (std::any_of(staged_.begin(), staged_.end(), [&](const Staged& b) { return b.slot == slot; }))
      if (++slot == Device::kUploadSlots) throw std::logic_error("Engine::evaluate: every batch buffer is staged");
  run_all([&](int r) {
    Device& dev = *devices_[r];
    Replica& rep = *replicas_[r];
    Network& net = *rep.net;
    BatchNormPass bn;
    bn.training = false;
    bn.running = rep.running.f();
    int first = 0;
    for (int q = 0; q < r; ++q) first += sizes[q];
    // Under scatter the devices but device 0 have only their chunk's input, no labels.
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
      dev.ops().softmax_xent(m, int(C), net.forward(rep.params.f(), in, m, &bn), lab, 1.0f, dl, rep.stats.f());
      float stats[2];
      dev.download(stats, rep.stats.f(), sizeof stats);
      loss[r] += stats[0];
      correct[r] += int64_t(stats[1]);
      done += m;
    }
    if (cfg_.trace) eval_spans_[r].push_back({step_, sizes[r], start_us, now_us()});
  });
  StepResult res;
  res.n = n;
  for (int r = 0; r < size(); ++r) res.loss += loss[r], res.correct += correct[r];
  if (n > 0) res.loss /= n;
  return res;
}

std::vector<float> Engine::params(int rank) {
  std::vector<float> host(size_t(spec_.param_count));
  devices_[rank]
      ->run([&] { devices_[rank]->download(host.data(), replicas_[rank]->params.f(), host.size() * sizeof(float)); })
      .get();
  return host;
}

void Engine::set_params(const std::vector<float>& host) {
  if (int64_t(host.size()) != spec_.param_count)
    throw std::invalid_argument("set_params: " + std::to_string(host.size()) + " values for a model of " +
                                std::to_string(spec_.param_count));
  run_all([&](int r) {
    if (r == 0) devices_[0]->upload(replicas_[0]->params.f(), host.data(), host.size() * sizeof(float));
    devices_[r]->synchronize();
    comm_->broadcast(r, replicas_[r]->params.f(), spec_.param_count, 0);
  });
}

std::vector<float> Engine::momentum() {
  if (!replicas_[0]->momentum) return {};
  std::vector<float> host(size_t(spec_.param_count));
  devices_[0]
      ->run([&] { devices_[0]->download(host.data(), replicas_[0]->momentum.f(), host.size() * sizeof(float)); })
      .get();
  return host;
}

void Engine::set_momentum(const std::vector<float>& host) {
  if (!replicas_[0]->momentum) return;
  if (int64_t(host.size()) != spec_.param_count) throw std::invalid_argument("set_momentum: wrong size");
  run_all([&](int r) {
    if (!replicas_[r]->momentum) return;
    devices_[r]->upload(replicas_[r]->momentum.f(), host.data(), host.size() * sizeof(float));
    devices_[r]->synchronize();
  });
}

std::vector<float> Engine::buffers(int rank) {
  std::vector<float> host(size_t(spec_.buffer_count));
  if (host.empty()) return host;
  devices_[rank]
      ->run([&] { devices_[rank]->download(host.data(), replicas_[rank]->running.f(), host.size() * sizeof(float)); })
      .get();
  return host;
}

void Engine::set_buffers(const std::vector<float>& host) {
  if (int64_t(host.size()) != spec_.buffer_count)
    throw std::invalid_argument("set_buffers: " + std::to_string(host.size()) + " values for a model of " +
                                std::to_string(spec_.buffer_count));
  if (host.empty()) return;
  run_all([&](int r) {
    devices_[r]->upload(replicas_[r]->running.f(), host.data(), host.size() * sizeof(float));
    devices_[r]->synchronize();
  });
}

std::string Engine::first_nonfinite_gradient() {
  std::string bad;
  devices_[0]
      ->run([&] {
        Replica& rep = *replicas_[0];
        // Called for a bad step only (a good one says so in its stats): the whole buffer, then
        // tensor by tensor.
        if (devices_[0]->ops().all_finite(spec_.param_count, rep.grads.f())) return;
        // In backward order: the layer where the non-finite values entered, not where they ended up.
        for (auto p = spec_.params.rbegin(); p != spec_.params.rend(); ++p)
          if (!devices_[0]->ops().all_finite(p->size, rep.grads.f() + p->offset)) {
            bad = p->name;
            return;
          }
      })
      .get();
  return bad;
}

}  // namespace dp
