// The engine's step (engine.h): the batches staged and uploaded (ahead, with prefetch), and a step in
// two halves, start_step enqueueing it on every device and finish_step reading its result, which
// step() does at once and dp_train --run-ahead a step later.
#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/optimizer.h"

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

// The bytes of device `rank`'s stats a step reads: all of them where it computes the loss, else none
// (its download only marks the step's end).
size_t stats_bytes(const Strategy& strategy, int rank) {
  return strategy.computes_loss(rank) ? sizeof(float) * kStats : 0;
}

}  // namespace

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
  started_.clear();
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
  start_step();
  return finish_step();
}

void Engine::require_no_step_in_flight(const char* what) const {
  if (!started_.empty())
    throw std::logic_error(std::string("Engine::") + what + ": " + std::to_string(started_.size()) +
                           " started step(s) not finished; finish_step() first");
}

void Engine::start_step() {
  if (staged_.empty()) throw std::logic_error("Engine::start_step: no batch staged; stage() one first");
  if (started_.size() >= size_t(kStepsInFlight))
    throw std::logic_error("Engine::start_step: " + std::to_string(kStepsInFlight) +
                           " steps started and not finished, the most; finish_step() first");
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
  const bool graph = runs_as_graph(b);
  // The optimizer's scalars go to the devices that step it, ahead of the step's work: its kernels
  // read them there, so a replayed graph takes this step's learning rate and bias correction. Their
  // host copy is the step's own among kStepsInFlight: the upload may read it until the step is done,
  // and the next step may be started before that.
  const int slot = int(step_ % kStepsInFlight);
  OptimizerScalars& scalars = scalars_[size_t(slot)];
  scalars = optimizer_scalars(cfg_, optimizer_steps_ + 1);
  try {
    run_all([&](int r) {
      const Clock::time_point start = Clock::now();
      if (replicas_[r]->scalars) devices_[r]->upload(replicas_[r]->scalars.data(), &scalars, sizeof scalars);
      recorder_.begin_step(*devices_[r], r, slot);
      if (!graph || !graph_step(parts[0], sizes[0], slot))
        for (int k = 0; k < micros; ++k) {
          StepContext context(*this, r, parts[size_t(k)], sizes[size_t(k)], {k, micros, b.n});
          strategy_.step(context);
        }
      // The loss and the correct count, from the devices that compute them, each device that stepped
      // the optimizer also saying whether the gradient it stepped was finite, queued into page-locked
      // memory behind the step's work; every device marks the step's end so. finish_step waits for it,
      // and then reads the step's timed phases.
      devices_[r]->download_async(slot, replicas_[r]->stats.f(), stats_bytes(strategy_, r));
      recorder_.host_step(r, seconds(Clock::now() - start), 0);
    });
  } catch (...) {
    drop_staged();
    throw;
  }
  if (!started_.empty()) ++started_ahead_;
  started_.push_back({step_, b.n, micros, slot});
  count_started(b.n, micros);
  recorder_.after(*comm_, traffic_before, b.n == cfg_.batch * cfg_.accumulate);
  recorder_.step_seconds(seconds(Clock::now() - step_start));
}

void Engine::count_started(int n, int micros) {
  // Saturates at 2^63 - 1 rather than wrapping to a negative count, which a checkpoint could not hold.
  // BatchNorm's count goes on per micro-batch, each a forward in training (PyTorch's num_batches_tracked).
  if (spec_.has_batchnorm())
    batches_tracked_ = batches_tracked_ > std::numeric_limits<int64_t>::max() - micros
                           ? std::numeric_limits<int64_t>::max()
                           : batches_tracked_ + micros;
  ++optimizer_steps_;
  warm_ = warm_ || n == cfg_.batch * cfg_.accumulate;
  ++step_;
}

StepResult Engine::finish_step() {
  if (started_.empty()) throw std::logic_error("Engine::finish_step: no step started; start_step() one first");
  using Clock = std::chrono::steady_clock;
  const Clock::time_point finish_start = Clock::now();
  const Started s = started_.front();
  std::vector<std::array<float, kStats>> stats(size(), {0.0f, 0.0f, 0.0f});
  const bool timed = recorder_.timing();
  try {
    run_all([&](int r) {
      const Clock::time_point start = Clock::now();
      devices_[r]->download_wait(s.slot, stats[size_t(r)].data(), stats_bytes(strategy_, r));
      if (timed) recorder_.close_phases(*devices_[r], r, s.slot, s.step);
      recorder_.host_step(r, 0, seconds(Clock::now() - start));
    });
  } catch (...) {
    drop_staged();
    throw;
  }
  started_.pop_front();
  recorder_.step_seconds(seconds(Clock::now() - finish_start));
  return step_result(stats, s.n, s.micros);
}

}  // namespace dp
