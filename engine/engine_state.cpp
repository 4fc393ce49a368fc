// What the engine reads and writes of its replicas between steps: the weights, the optimizer's
// state (gathered from and split into the shards of a sharded strategy), BatchNorm's running
// statistics, and where a bad step's gradient stopped being finite.
#include <algorithm>
#include <stdexcept>

#include "engine/engine.h"

namespace dp {

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

std::vector<std::vector<float>> Engine::optimizer_state() {
  const size_t states = replicas_[0]->state.size();
  std::vector<std::vector<float>> host(states, std::vector<float>(size_t(spec_.param_count)));
  if (chunk_ == 0) {
    devices_[0]
        ->run([&] {
          for (size_t i = 0; i < states; ++i)
            devices_[0]->download(host[i].data(), replicas_[0]->state[i].f(), host[i].size() * sizeof(float));
        })
        .get();
    return host;
  }
  // Sharded: each device's chunk goes to its place in a whole buffer, all-gathered (as PyTorch's
  // ZeroRedundancyOptimizer.consolidate_state_dict gathers the shards), and device 0 reads it.
  run_all([&](int r) {
    Device& dev = *devices_[r];
    Buffer whole = dev.alloc_floats(chunk_ * world_, Category::comm);
    const int64_t offset = chunk_ * comm_->shard(r);
    for (size_t i = 0; i < states; ++i) {
      dev.copy(whole.f() + offset, replicas_[r]->state[i].f(), size_t(chunk_) * sizeof(float));
      comm_->all_gather(r, whole.f(), chunk_);
      if (r == 0) dev.download(host[i].data(), whole.f(), host[i].size() * sizeof(float));
    }
    dev.synchronize();
  });
  return host;
}

void Engine::set_optimizer_state(const std::vector<std::vector<float>>& host) {
  if (host.size() != replicas_[0]->state.size())
    throw std::invalid_argument("set_optimizer_state: " + std::to_string(host.size()) +
                                " buffers for an optimizer of " + std::to_string(replicas_[0]->state.size()));
  for (const auto& h : host)
    if (int64_t(h.size()) != spec_.param_count) throw std::invalid_argument("set_optimizer_state: wrong size");
  run_all([&](int r) {
    // Sharded: the device's chunk of each, the padding past P zero.
    const int64_t first = chunk_ * comm_->shard(r), P = spec_.param_count;
    const int64_t count = chunk_ > 0 ? std::clamp<int64_t>(P - first, 0, chunk_) : P;
    for (size_t i = 0; i < replicas_[r]->state.size(); ++i) {
      if (chunk_ > 0) devices_[r]->ops().fill(chunk_, 0.0f, replicas_[r]->state[i].f());
      if (count > 0)
        devices_[r]->upload(replicas_[r]->state[i].f(), host[i].data() + first, size_t(count) * sizeof(float));
    }
    devices_[r]->synchronize();
  });
}

std::vector<float> Engine::running_stats(int rank) {
  std::vector<float> host(size_t(spec_.buffer_count));
  if (host.empty()) return host;
  devices_[rank]
      ->run([&] { devices_[rank]->download(host.data(), replicas_[rank]->running.f(), host.size() * sizeof(float)); })
      .get();
  return host;
}

void Engine::set_running_stats(const std::vector<float>& host) {
  if (int64_t(host.size()) != spec_.buffer_count)
    throw std::invalid_argument("set_running_stats: " + std::to_string(host.size()) + " values for a model of " +
                                std::to_string(spec_.buffer_count));
  if (host.empty()) return;
  run_all([&](int r) {
    devices_[r]->upload(replicas_[r]->running.f(), host.data(), host.size() * sizeof(float));
    devices_[r]->synchronize();
  });
}

std::string Engine::first_nonfinite_gradient() {
  // Device 0's whole gradient, or under a sharded strategy each device's own chunk of it (the rest of
  // its buffer holds partial sums): the tensors of each range that are not finite.
  std::vector<std::vector<bool>> bad(size_t(size()), std::vector<bool>(spec_.params.size()));
  run_all([&](int r) {
    if (chunk_ == 0 && r > 0) return;
    Replica& rep = *replicas_[r];
    Ops& ops = devices_[r]->ops();
    const int64_t lo = chunk_ > 0 ? chunk_ * comm_->shard(r) : 0, hi = chunk_ > 0 ? lo + chunk_ : spec_.param_count;
    // Called for a bad step only (a good one says so in its stats): the whole range, then tensor by tensor.
    if (ops.all_finite(hi - lo, rep.grads.f() + lo)) return;
    for (size_t p = 0; p < spec_.params.size(); ++p) {
      const int64_t a = std::max(lo, spec_.params[p].offset),
                    b = std::min(hi, spec_.params[p].offset + spec_.params[p].size);
      bad[size_t(r)][p] = a < b && !ops.all_finite(b - a, rep.grads.f() + a);
    }
  });
  // In backward order: the layer where the non-finite values entered, not where they ended up.
  for (size_t p = spec_.params.size(); p-- > 0;)
    for (const auto& device : bad)
      if (device[p]) return spec_.params[p].name;
  return "";
}

}  // namespace dp
