// What the engine reads and writes of its replicas between steps: the weights, the optimizer's
// state (gathered from and split into the shards of a sharded strategy), BatchNorm's running
// statistics, and where a bad step's gradient stopped being finite.
#include <algorithm>
#include <stdexcept>
#include <tuple>

#include "engine/engine.h"

namespace dp {

// zero3's whole model, for an evaluation or a checkpoint: booked as gathered, as its layers are in a
// step, so that parameters stays the device's chunk.
Buffer Engine::gather_parameters(int rank) {
  Device& dev = *devices_[rank];
  Buffer whole = dev.alloc_floats(spec_.param_count, Category::gathered);
  for (const ShardUnit& u : units_) {
    Buffer unit = dev.alloc_floats(u.chunk * world_, Category::comm);
    gather_unit(*comm_, rank, u, replicas_[rank]->params.f(), unit.f());
    dev.copy(whole.f() + u.offset, unit.f(), size_t(u.count) * sizeof(float));
    dev.synchronize();
  }
  return whole;
}

std::vector<float> Engine::params(int rank) {
  require_no_step_in_flight("params");
  std::vector<float> host(size_t(spec_.param_count));
  if (strategy_.zero_stage() == 3) {  // a collective: every device gathers, `rank` reads
    run_all([&](int r) {
      Buffer whole = gather_parameters(r);
      if (r == rank) devices_[r]->download(host.data(), whole.f(), host.size() * sizeof(float));
    });
    return host;
  }
  devices_[rank]
      ->run([&] { devices_[rank]->download(host.data(), replicas_[rank]->params.f(), host.size() * sizeof(float)); })
      .get();
  return host;
}

void Engine::set_params(const std::vector<float>& host) {
  require_no_step_in_flight("set_params");
  if (int64_t(host.size()) != spec_.param_count)
    throw std::invalid_argument("set_params: " + std::to_string(host.size()) + " values for a model of " +
                                std::to_string(spec_.param_count));
  if (strategy_.zero_stage() == 3)  // each device its chunks
    return run_all([&](int r) { upload_chunks(r, replicas_[r]->params.f(), host); });
  run_all([&](int r) {
    if (r == 0) devices_[0]->upload(replicas_[0]->params.f(), host.data(), host.size() * sizeof(float));
    devices_[r]->synchronize();
    comm_->broadcast(r, replicas_[r]->params.f(), spec_.param_count, 0);
  });
}

std::vector<std::vector<float>> Engine::optimizer_state() {
  require_no_step_in_flight("optimizer_state");
  const size_t states = replicas_[0]->state.size();
  std::vector<std::vector<float>> host(states, std::vector<float>(size_t(spec_.param_count)));
  if (units_.empty()) {
    devices_[0]
        ->run([&] {
          for (size_t i = 0; i < states; ++i)
            devices_[0]->download(host[i].data(), replicas_[0]->state[i].f(), host[i].size() * sizeof(float));
        })
        .get();
    return host;
  }
  // Sharded: unit by unit, each device's chunk goes to its place in a buffer of the whole unit,
  // all-gathered (as PyTorch's ZeroRedundancyOptimizer.consolidate_state_dict gathers the shards),
  // and device 0 reads it.
  run_all([&](int r) {
    Device& dev = *devices_[r];
    for (const ShardUnit& u : units_) {
      Buffer whole = dev.alloc_floats(u.chunk * world_, Category::comm);
      for (size_t i = 0; i < states; ++i) {
        gather_unit(*comm_, r, u, replicas_[r]->state[i].f(), whole.f());
        if (r == 0) dev.download(host[i].data() + u.offset, whole.f(), size_t(u.count) * sizeof(float));
      }
      dev.synchronize();
    }
  });
  return host;
}

void Engine::set_optimizer_state(const std::vector<std::vector<float>>& host) {
  require_no_step_in_flight("set_optimizer_state");
  if (host.size() != replicas_[0]->state.size())
    throw std::invalid_argument("set_optimizer_state: " + std::to_string(host.size()) +
                                " buffers for an optimizer of " + std::to_string(replicas_[0]->state.size()));
  for (const auto& h : host)
    if (int64_t(h.size()) != spec_.param_count) throw std::invalid_argument("set_optimizer_state: wrong size");
  run_all([&](int r) {
    for (size_t i = 0; i < replicas_[r]->state.size(); ++i) {
      float* state = replicas_[r]->state[i].f();
      if (units_.empty())
        devices_[r]->upload(state, host[i].data(), host[i].size() * sizeof(float));
      else
        upload_chunks(r, state, host[i]);
    }
    devices_[r]->synchronize();
  });
}

void Engine::upload_chunks(int rank, float* chunks, const std::vector<float>& host) {
  Device& dev = *devices_[rank];
  dev.ops().fill(owned_, 0.0f, chunks);  // the padding past a unit's end stays zero
  for (const ShardUnit& u : units_) {
    const int64_t first = u.chunk * comm_->shard(rank), count = std::clamp<int64_t>(u.count - first, 0, u.chunk);
    if (count > 0) dev.upload(chunks + u.owned, host.data() + u.offset + first, size_t(count) * sizeof(float));
  }
  dev.synchronize();
}

std::vector<float> Engine::running_stats(int rank) {
  require_no_step_in_flight("running_stats");
  std::vector<float> host(size_t(spec_.buffer_count));
  if (host.empty()) return host;
  devices_[rank]
      ->run([&] { devices_[rank]->download(host.data(), replicas_[rank]->running.f(), host.size() * sizeof(float)); })
      .get();
  return host;
}

void Engine::set_running_stats(const std::vector<float>& host) {
  require_no_step_in_flight("set_running_stats");
  if (int64_t(host.size()) != spec_.buffer_count)
    throw std::invalid_argument("set_running_stats: " + std::to_string(host.size()) + " values for a model of " +
                                std::to_string(spec_.buffer_count));
  if (host.empty()) return;
  run_all([&](int r) {
    devices_[r]->upload(replicas_[r]->running.f(), host.data(), host.size() * sizeof(float));
    devices_[r]->synchronize();
  });
}

float* Engine::owned_gradient(int rank, const ShardUnit& u) const {
  float* grads = replicas_[size_t(rank)]->grads.f();
  return strategy_.zero_stage() == 1 ? grads + u.offset + u.chunk * comm_->shard(rank) : grads + u.owned;
}

std::string Engine::first_nonfinite_gradient() {
  require_no_step_in_flight("first_nonfinite_gradient");
  // Device 0's whole gradient, or under a sharded strategy each device's own chunks of it: the
  // tensors of each range that are not finite.
  std::vector<std::vector<bool>> bad(size_t(size()), std::vector<bool>(spec_.params.size()));
  run_all([&](int r) {
    if (units_.empty() && r > 0) return;
    Ops& ops = devices_[r]->ops();
    // (flat offset of the range, its gradient, its floats)
    std::vector<std::tuple<int64_t, const float*, int64_t>> ranges;
    if (units_.empty()) ranges.emplace_back(0, replicas_[r]->grads.f(), spec_.param_count);
    for (const ShardUnit& u : units_) {
      const int64_t first = u.offset + u.chunk * comm_->shard(r);
      ranges.emplace_back(first, owned_gradient(r, u), std::clamp<int64_t>(u.offset + u.count - first, 0, u.chunk));
    }
    for (const auto& [lo, g, n] : ranges) {
      // Called for a bad step only (a good one says so in its stats): the whole range, then tensor by tensor.
      if (n == 0 || ops.all_finite(n, g)) continue;
      for (size_t p = 0; p < spec_.params.size(); ++p) {
        const int64_t a = std::max(lo, spec_.params[p].offset),
                      b = std::min(lo + n, spec_.params[p].offset + spec_.params[p].size);
        if (a < b && !ops.all_finite(b - a, g + (a - lo))) bad[size_t(r)][p] = true;
      }
    }
  });
  // In backward order: the layer where the non-finite values entered, not where they ended up.
  for (size_t p = spec_.params.size(); p-- > 0;)
    for (const auto& device : bad)
      if (device[p]) return spec_.params[p].name;
  return "";
}

}  // namespace dp
