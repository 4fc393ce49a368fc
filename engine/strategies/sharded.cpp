#include "engine/strategies/sharded.h"

#include <algorithm>

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

namespace {

// BucketReducer's buckets, one per layer, in backward's order: each allocated when backward first
// writes it, the one before it freed when it is ready (`gathers`: freed before, as zero3 gathers the
// layer's weights); the prefix's (Network::prefix_layers) all allocated together. The most floats
// alive at once.
int64_t gradient_buckets_alive(const ModelSpec& spec, int n, bool gathers) {
  const int prefix = Network::prefix_layers(spec);
  const std::vector<ShardUnit> units = layer_units(spec, n);  // the parameterised layers, in this loop's order
  size_t next = 0;
  int64_t most = 0, in_flight = 0, writing = 0;
  for (int i = int(spec.layers.size()) - 1; i >= 0; --i) {
    if (spec.layers[size_t(i)].weight < 0) continue;
    const int64_t whole = units[next++].chunk * n;
    writing += whole;
    most = std::max(most, in_flight + writing);
    if (i >= prefix) in_flight = gathers ? 0 : whole, writing = 0;  // ready: the bucket before it freed
  }
  return most;
}

}  // namespace

std::vector<Holding> sharded_holdings(const ModelSpec& spec, const EngineConfig& c, int n, bool parameters) {
  const int64_t F = sizeof(float);
  const std::vector<ShardUnit> units = layer_units(spec, n);
  const int64_t owned = owned_floats(units);
  // With zero3's gathers, the buckets alive at once are the layers gathered at once: one at a time but
  // the prefix's, all together.
  const int64_t alive = gradient_buckets_alive(spec, n, parameters);
  const std::string share = "its 1/" + std::to_string(n) + " of every layer's ", floats = commas(owned) + " floats";
  std::vector<Holding> h;
  if (parameters) {
    const int64_t R = spec.buffer_count;  // BatchNorm's running statistics, whole on every device
    h.push_back({Category::parameters, (owned + R) * F,
                 share + "parameters, " + floats +
                     (R > 0 ? ", and BatchNorm's running statistics, " + commas(R) + " floats" : std::string())});
    h.push_back({Category::gathered, alive * F,
                 "the layers forward or backward uses at once, whole: the largest, or the convolutions together, " +
                     commas(alive) + " floats (padded)"});
  }
  h.push_back({Category::gradients, (owned + alive) * F,
               share + "gradient, " + floats +
                   (parameters ? ", and the buckets backward writes at once"
                               : ", and the buckets alive at once: the one being reduce-scattered and those "
                                 "backward writes") +
                   " (the convolutions' together), " + commas(alive) + " floats (padded)"});
  int64_t largest_chunk = 0;
  for (const ShardUnit& u : units) largest_chunk = std::max(largest_chunk, u.chunk);
  if (n > 1)  // one device has no ring
    h.push_back({Category::comm, largest_chunk * F,
                 "one ring chunk of the largest layer, " + commas(largest_chunk) +
                     " floats, reserved before the first step (the reduce-scatters run on the communication thread)"});
  if (const DType t = wire_dtype(c, n); t != DType::fp32) {
    const int64_t largest = largest_chunk * n;
    h.push_back({Category::comm, largest * dtype_size(t),
                 std::string("--grad-dtype: the bucket being reduce-scattered, in ") + dtype_name(t) +
                     ": the largest, " + commas(largest) + " elements (padded)"});
  }
  if (c.accumulate > 1)
    h.push_back({Category::gradients, spec.param_count * F,
                 "--accumulate: the whole gradient of the step's micro-batches so far, " + commas(spec.param_count) +
                     " floats, as FSDP's no_sync holds it"});
  if (const int64_t states = int64_t(optimizer_state_names(c).size()); states > 0)
    h.push_back({Category::optimizer, states * owned * F,
                 "1/" + std::to_string(n) + " of every layer's " + optimizer_state_text(c) +
                     ": the chunks it owns and updates"});
  return h;
}

// With --accumulate backward writes every micro-batch's gradients into the device's whole
// accumulated gradient (Replica::accumulated), the second and later adding on; in the last
// micro-batch's backward a bucket, once ready, is copied from there into its buffer and
// reduce-scattered as without.
BucketReducer::BucketReducer(StepContext& s)
    : s_(s), bucket_(s.units().size()), prefix_(Network::prefix_layers(s.spec())) {
  for (const Bucket& b : s.buckets()) remaining_.push_back(b.layers);
  auto offset = [this](int layer) { return s_.spec().params[size_t(s_.spec().layers[size_t(layer)].weight)].offset; };
  float* whole = s.config().accumulate > 1 ? s.replica().accumulated.f() : nullptr;
  blocks_ = [this, whole, offset](int layer) {
    if (whole) return whole + offset(layer);
    const size_t u = size_t(s_.layer_bucket(layer));
    // The prefix's buckets all at once, as its first chunk needs them when the prefix runs in chunks:
    // what a device holds is then the same whether it does or not.
    if (layer < prefix_)
      for (int i = 0; i < prefix_; ++i)
        if (s_.spec().layers[size_t(i)].weight >= 0) allocate(size_t(s_.layer_bucket(i)));
    allocate(u);
    return bucket_[u].f() + (offset(layer) - s_.units()[u].offset);
  };
  if (whole && !s.last_micro()) return;  // nothing communicated until the step's last micro-batch
  ready_ = [this, whole](int layer) {
    const int u = s_.layer_bucket(layer);
    if (--remaining_[size_t(u)] > 0) return;
    finish();
    const ShardUnit& unit = s_.units()[size_t(u)];
    if (whole) {
      allocate(size_t(u));
      s_.device().copy(bucket_[size_t(u)].f(), whole + unit.offset, size_t(unit.count) * sizeof(float));
    }
    // --grad-dtype in 16 bits: the bucket narrowed on the compute stream, reduce-scattered in place in
    // the type, and the owned chunk of the sum widened into the gradient chunks by finish(); in fp32
    // the bucket itself, its owned chunk of the sum straight into the gradient chunks.
    const int64_t padded = unit.chunk * s_.comm().world();
    wire_ = std::make_unique<WireGradients>(s_, padded);
    float* owned = s_.replica().grads.f() + unit.owned;
    void* out = wire_->type() == DType::fp32 ? owned : wire_->at(unit.chunk * s_.shard());
    s_.comm().reduce_scatter_async(s_.rank(), wire_->narrow(bucket_[size_t(u)].f(), 0, padded), unit.chunk, out,
                                   s_.bucket_timing(u), wire_->type());
    in_flight_ = u;
  };
}

void BucketReducer::allocate(size_t u) {
  if (bucket_[u]) return;
  const ShardUnit& unit = s_.units()[u];
  const int64_t whole = unit.chunk * s_.comm().world();
  bucket_[u] = s_.device().alloc_floats(whole, Category::gradients);
  s_.device().ops().fill(whole - unit.count, 0.0f, bucket_[u].f() + unit.count);  // the padding
}

void BucketReducer::finish() {
  if (in_flight_ < 0) return;
  s_.comm().wait(s_.rank());
  const ShardUnit& unit = s_.units()[size_t(in_flight_)];
  wire_->widen(unit.chunk * s_.shard(), unit.chunk, s_.replica().grads.f() + unit.owned);  // fp32: nothing
  wire_.reset();
  bucket_[size_t(in_flight_)] = Buffer();  // its chunk of the sum is in the device's gradient chunks
  in_flight_ = -1;
}

// Left with a reduce-scatter in flight only when the step failed.
BucketReducer::~BucketReducer() {
  if (in_flight_ >= 0) end_queued_collectives(s_);
}

LayerGatherer::LayerGatherer(StepContext& s, BucketReducer* reduce)
    : s_(s), reduce_(reduce), gathered_(s.units().size()), released_(s.units().size(), 0) {
  blocks_.acquire = [this](int layer) -> const float* {
    const size_t u = size_t(s_.layer_bucket(layer));
    const ShardUnit& unit = s_.units()[u];
    if (!gathered_[u]) {
      if (reduce_) reduce_->finish();
      gathered_[u] = s_.device().alloc_floats(unit.chunk * s_.comm().world(), Category::gathered);
      gather_unit(s_.comm(), s_.rank(), unit, s_.replica().params.f(), gathered_[u].f(), /*queued=*/true);
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
