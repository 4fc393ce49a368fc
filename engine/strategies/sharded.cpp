#include "engine/strategies/sharded.h"

#include <algorithm>
#include <chrono>

#include "engine/optimizer.h"

namespace dp {

std::vector<ShardUnit> layer_units(const ModelSpec& spec, int n) {
  std::vector<Bucket> layers;
  for (int i = int(spec.layers.size()) - 1; i >= 0; --i)
    if (const Layer& l = spec.layers[size_t(i)]; l.weight >= 0) {
      const Param &w = spec.params[size_t(l.weight)], *b = l.bias >= 0 ? &spec.params[size_t(l.bias)] : nullptr;
      layers.push_back({w.offset, w.size + (b ? b->size : 0), 1});
    }
  return shard_units(layers, n);
}

std::vector<Holding> sharded_holdings(const ModelSpec& spec, const EngineConfig& c, int n, bool parameters) {
  const int64_t F = sizeof(float);
  const std::vector<ShardUnit> units = layer_units(spec, n);
  const int64_t owned = owned_floats(units);
  int64_t largest = 0;
  for (const ShardUnit& u : units) largest = std::max(largest, u.chunk * n);
  const std::string share = "its 1/" + std::to_string(n) + " of every layer's ", floats = commas(owned) + " floats";
  std::vector<Holding> h;
  if (parameters)
    h.push_back({Category::parameters, (owned + largest) * F,
                 share + "parameters, " + floats +
                     ", and the whole of the largest layer while forward or backward uses "
                     "it, " +
                     commas(largest) + " floats (padded)"});
  h.push_back({Category::gradients, (owned + largest) * F,
               share + "gradient, " + floats + ", and at most the largest layer's whole while backward writes it, " +
                   commas(largest) + " floats (padded)"});
  if (const int64_t states = int64_t(optimizer_state_names(c).size()); states > 0)
    h.push_back({Category::optimizer, states * owned * F,
                 "1/" + std::to_string(n) + " of every layer's " + optimizer_state_text(c) +
                     ": the chunks it owns and updates"});
  return h;
}

BucketReducer::BucketReducer(StepContext& s) : s_(s), bucket_(s.units().size()) {
  for (const Bucket& b : s.buckets()) remaining_.push_back(b.layers);
  blocks_ = [this](int layer) {
    const size_t u = size_t(s_.layer_bucket(layer));
    const ShardUnit& unit = s_.units()[u];
    if (!bucket_[u]) {
      const int64_t whole = unit.chunk * s_.comm().world();
      bucket_[u] = s_.device().alloc_floats(whole, Category::gradients);
      s_.device().ops().fill(whole - unit.count, 0.0f, bucket_[u].f() + unit.count);  // the padding
    }
    return bucket_[u].f() + (s_.spec().params[size_t(s_.spec().layers[size_t(layer)].weight)].offset - unit.offset);
  };
  ready_ = [this](int layer) {
    const int u = s_.layer_bucket(layer);
    if (--remaining_[size_t(u)] > 0) return;
    const ShardUnit& unit = s_.units()[size_t(u)];
    Interval* t = s_.bucket_timing(u);
    if (t) t->start = std::chrono::steady_clock::now();
    s_.comm().reduce_scatter(s_.rank(), bucket_[size_t(u)].f(), unit.chunk);
    s_.device().copy(s_.replica().grads.f() + unit.owned, bucket_[size_t(u)].f() + unit.chunk * s_.shard(),
                     size_t(unit.chunk) * sizeof(float));
    if (t) t->end = std::chrono::steady_clock::now();
    bucket_[size_t(u)] = Buffer();  // the chunk alone is kept
  };
}

LayerGatherer::LayerGatherer(StepContext& s) : s_(s), gathered_(s.units().size()), released_(s.units().size(), 0) {
  blocks_.acquire = [this](int layer) -> const float* {
    const size_t u = size_t(s_.layer_bucket(layer));
    const ShardUnit& unit = s_.units()[u];
    if (!gathered_[u]) {
      gathered_[u] = s_.device().alloc_floats(unit.chunk * s_.comm().world(), Category::parameters);
      gather_unit(s_.comm(), s_.rank(), unit, s_.replica().params.f(), gathered_[u].f());
    }
    return gathered_[u].f() + (s_.spec().params[size_t(s_.spec().layers[size_t(layer)].weight)].offset - unit.offset);
  };
  blocks_.release = [this](int layer) {
    const size_t u = size_t(s_.layer_bucket(layer));
    if (++released_[u] < s_.buckets()[u].layers) return;
    gathered_[u] = Buffer();
    released_[u] = 0;
  };
}

}  // namespace dp
