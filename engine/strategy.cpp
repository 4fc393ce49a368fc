#include "engine/strategy.h"

#include <cstddef>

#include "engine/engine.h"
#include "engine/error.h"

namespace dp {

// Each strategy's file defines its one instance.
const Strategy& scatter_strategy();
const Strategy& allreduce_strategy();
const Strategy& zero1_strategy();
const Strategy& zero2_strategy();
const Strategy& zero3_strategy();

void clip_gradients(StepContext& s, float* grads, int64_t n, bool shard) {
  const float max_norm = s.config().clip_grad_norm;
  if (max_norm <= 0) return;
  Replica& rep = s.replica();
  Ops& ops = s.device().ops();
  ops.fill(1, 0.0f, rep.norm.f());
  ops.sum_squares(n, grads, rep.norm.f());
  if (shard) s.comm().all_reduce(s.rank(), rep.norm.f(), 1);
  ops.clip_scale(n, rep.norm.f(), max_norm, grads);
}

DType wire_dtype(const EngineConfig& c, int devices) { return devices > 1 ? c.grad_dtype : DType::fp32; }

void check_grad_dtype(const Strategy& s, DType t) {
  if (t == DType::fp32 || s.takes_grad_dtype()) return;
  throw UsageError(std::string("--grad-dtype ") + dtype_name(t) + ": --sync " + s.name() + " (" + s.mirrors() + ") " +
                   s.reduces() +
                   " and has no communication hook to compress them; use --sync allreduce, zero1, zero2 or zero3, "
                   "or drop --grad-dtype");
}

void end_queued_collectives(StepContext& s) noexcept {
  s.comm().abort();
  try {
    s.comm().wait(s.rank());
  } catch (...) {  // the step's own failure is the one reported
  }
}

WireGradients::WireGradients(StepContext& s, int64_t count) : s_(s), type_(wire_dtype(s.config(), s.comm().world())) {
  if (type_ != DType::fp32 && count > 0) wire_ = s.device().alloc(size_t(count * dtype_size(type_)), Category::comm);
}

WireGradients::~WireGradients() {
  if (wire_ && std::uncaught_exceptions() > unwinding_) end_queued_collectives(s_);
}

void* WireGradients::at(int64_t offset) const {
  return static_cast<std::byte*>(wire_.data()) + offset * dtype_size(type_);
}

void* WireGradients::narrow(float* grads, int64_t offset, int64_t n) {
  if (type_ == DType::fp32) return grads + offset;
  s_.device().ops().narrow(type_, n, grads + offset, at(offset));
  return at(offset);
}

void WireGradients::widen(int64_t offset, int64_t n, float* out) {
  if (type_ != DType::fp32) s_.device().ops().widen(type_, n, at(offset), out);
}

// The registry: a new strategy is one line here.
const std::vector<const Strategy*>& strategies() {
  static const std::vector<const Strategy*> all = {&scatter_strategy(), &allreduce_strategy(), &zero1_strategy(),
                                                   &zero2_strategy(), &zero3_strategy()};
  return all;
}

std::string strategy_names(const char* last_separator) {
  std::string s;
  const auto& all = strategies();
  for (size_t i = 0; i < all.size(); ++i)
    s += (i == 0 ? "" : i + 1 == all.size() ? last_separator : ", ") + std::string(all[i]->name());
  return s;
}

std::string strategy_choices() {
  std::string help;
  for (const Strategy* s : strategies())
    help += (help.empty() ? "" : " | ") + std::string(s->name()) + " (" + s->mirrors() + ")";
  return help;
}

const Strategy& find_strategy(const std::string& name) {
  for (const Strategy* s : strategies())
    if (name == s->name()) return *s;
  throw UsageError("--sync: '" + name + "' is not a strategy; use " + strategy_names());
}

const char* Strategy::phase_name(Phase p) const {
  static const char* names[kPhases] = {"load",     "scatter", "broadcast", "forward",   "gather+loss",
                                       "backward", "reduce",  "optimizer", "all-gather"};
  return names[int(p)];
}

StepContext::StepContext(Engine& engine, int rank, const StagedBatch& batch, const std::vector<int>& sizes,
                         const MicroBatch& micro)
    : engine_(engine), rank_(rank), batch_rows_(batch), sizes_(sizes), batch_(0), micro_(micro) {
  for (int s : sizes) batch_ += s;
}

std::vector<float*> Replica::state_pointers() const {
  std::vector<float*> p;
  for (const Buffer& b : state) p.push_back(b.f());
  return p;
}

const std::vector<ShardUnit>& StepContext::units() const { return engine_.units_; }
int StepContext::shard() const { return engine_.comm().shard(rank_); }

void gather_unit(Communicator& comm, int rank, const ShardUnit& u, const float* chunks, float* whole, bool queued) {
  comm.device(rank).copy(whole + u.chunk * comm.shard(rank), chunks + u.owned, size_t(u.chunk) * sizeof(float));
  if (!queued) return comm.all_gather(rank, whole, u.chunk);
  comm.all_gather_async(rank, whole, u.chunk);
  comm.wait(rank);
}

std::vector<ShardUnit> shard_units(const std::vector<Bucket>& ranges, int n) {
  std::vector<ShardUnit> units;
  int64_t owned = 0;
  for (const Bucket& b : ranges) {
    units.push_back({b.offset, b.count, shard_chunk(b.count, n), owned});
    owned += units.back().chunk;
  }
  return units;
}

Device& StepContext::device() const { return engine_.device(rank_); }
Replica& StepContext::replica() const { return *engine_.replicas_[size_t(rank_)]; }
Communicator& StepContext::comm() const { return engine_.comm(); }
const ModelSpec& StepContext::spec() const { return engine_.spec(); }
const EngineConfig& StepContext::config() const { return engine_.config(); }
int StepContext::mine() const { return sizes_[size_t(engine_.first_device() + rank_)]; }
const Replica::Upload& StepContext::upload() const { return replica().batch[size_t(batch_rows_.slot)]; }

void StepContext::phase(Phase p, const std::function<void()>& work) {
  engine_.recorder_.phase(device(), rank_, p, work);
}

void StepContext::load() { engine_.load(rank_, batch_rows_); }
BatchNormPass StepContext::batchnorm() const { return engine_.batchnorm_pass(rank_, batch_); }
bool StepContext::broadcasts_buffers() const { return engine_.broadcasts_buffers(); }
const std::vector<Bucket>& StepContext::buckets() const { return engine_.buckets(); }
int StepContext::layer_bucket(int layer) const { return engine_.layer_bucket_[size_t(layer)]; }
Interval* StepContext::bucket_timing(int bucket) { return engine_.recorder_.bucket_timing(rank_, bucket); }
void StepContext::close_buckets() { engine_.recorder_.close_buckets(rank_, engine_.steps()); }

std::vector<Bucket> gradient_buckets(const ModelSpec& spec, const Strategy& strategy, int64_t bucket_kb,
                                     std::vector<int>* layer_bucket) {
  std::vector<Bucket> buckets;
  std::vector<int> which(spec.layers.size(), -1);
  const int64_t close_at = bucket_kb > 0 ? bucket_kb * 1024 : strategy.zero_stage() >= 2 ? 1 : 0;
  if (strategy.takes_buckets() && close_at > 0) {
    Bucket cur;
    int64_t hi = spec.param_count;
    for (int i = int(spec.layers.size()) - 1; i >= 0; --i) {
      const Layer& l = spec.layers[size_t(i)];
      if (l.weight < 0) continue;
      const int64_t lo = spec.params[size_t(l.weight)].offset;
      cur.offset = lo;
      cur.count = hi - lo;
      cur.layers++;
      which[size_t(i)] = int(buckets.size());
      if (cur.count * int64_t(sizeof(float)) >= close_at) {
        buckets.push_back(cur);
        hi = lo;
        cur = Bucket();
      }
    }
    if (cur.layers > 0) buckets.push_back(cur);
  }
  if (layer_bucket) *layer_bucket = std::move(which);
  return buckets;
}

}  // namespace dp
