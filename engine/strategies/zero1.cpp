// --sync zero1: ZeRO stage 1 (Rajbhandari et al., arXiv 1910.02054), DeepSpeed's stage 1, PyTorch's
// ZeroRedundancyOptimizer. Each device trains on its own rows as under allreduce, but keeps the
// optimizer state of 1/n of the flat parameters only: the chunk it owns (Communicator::shard). After
// backward the gradients are reduce-scattered, so each device holds the global gradient of its chunk;
// it steps the optimizer on that chunk alone, and the updated chunks are all-gathered into every
// replica's parameters, which then hold the same bits everywhere. Per step each device sends and
// receives 2(n-1)/n·P floats, what the ring all-reduce moves (its two halves, with the optimizer
// between them). PyTorch's ZeroRedundancyOptimizer under DDP all-reduces the gradients instead of
// reduce-scattering them and then all-gathers the parameters: 3(n-1)/n·P, a half more than this.
// Across processes (mpirun) hierarchically, as allreduce (process_communicator.h).
#include <algorithm>

#include "engine/optimizer.h"
#include "engine/strategies/own_batch.h"

namespace dp {
namespace {

class Zero1 final : public OwnBatch {
 public:
  const char* name() const override { return "zero1"; }
  const char* mirrors() const override { return "ZeRO-1, ZeroRedundancyOptimizer"; }
  const char* reduces() const override { return "reduce-scatters its gradients"; }
  int zero_stage() const override { return 1; }

  void step(StepContext& s) const override {
    const int r = s.rank();
    Replica& rep = s.replica();
    Communicator& comm = s.comm();
    const ShardUnit& unit = s.units()[0];  // the whole model, its flat buffers padded to n chunks
    const int64_t chunk = unit.chunk, first = chunk * s.shard();
    forward_backward(s, {});
    if (!s.last_micro()) return;  // --accumulate: reduce-scattered once, after the last micro-batch
    s.phase(Phase::reduce, [&] {
      const int64_t padded = chunk * comm.world();
      WireGradients wire(s, padded);  // --grad-dtype: narrowed whole, the owned chunk of the sum widened back
      comm.reduce_scatter(r, wire.narrow(rep.grads.f(), 0, padded), chunk, wire.type());
      wire.widen(first, chunk, rep.grads.f() + first);
    });
    s.phase(Phase::optimizer, [&] {
      // Each device checks the chunk it owns, the one chunk of the global gradient it holds.
      Ops& ops = s.device().ops();
      clip_gradients(s, rep.grads.f() + first, chunk, true);
      optimizer_step(ops, s.config(), chunk, rep.params.f() + first, rep.grads.f() + first, rep.state_pointers(),
                     rep.optimizer_scalars(), rep.stats.f() + kNonfinite);
    });
    s.phase(Phase::gather, [&] { comm.all_gather(r, rep.params.f(), chunk); });
  }

  bool has_phase(Phase p) const override { return p != Phase::scatter; }
  const char* phase_name(Phase p) const override {
    if (p == Phase::reduce) return "reduce-scatter";
    if (p == Phase::gather_loss) return "loss";
    return Strategy::phase_name(p);
  }
  bool communicates(Phase p) const override {
    return p == Phase::reduce || p == Phase::gather || p == Phase::broadcast;
  }

  // The gradients reduce-scattered and the parameters all-gathered, n chunks of ceil(P / n) each:
  // each device sends and receives (n-1)·ceil(P / n)·4 bytes in either, 2(n-1)/n·P·4 in all (exact
  // when n divides P; the padding's zeros travel too).
  std::vector<CollectiveTraffic> step_collectives(const StepShape& s) const override {
    ByteModel m(s.devices(), s.all_reduce);
    if (s.devices() == 1) return m.take();
    const int64_t chunk = shard_chunk(s.spec.param_count, s.devices());
    m.batchnorm_per_micro_batch(s);  // --accumulate: the gradients' collectives below come once
    m.sharded(Collective::reduce_scatter, "gradients", chunk, s.grad_dtype);
    if (s.clip_norm) m.all_reduce("the gradient's squared norm", 1);
    m.sharded(Collective::all_gather, "parameters", chunk);
    return m.take();
  }

  std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int n,
                                std::string& heading) const override {
    const int64_t P = spec.param_count, F = sizeof(float), chunk = shard_chunk(P, n), pad = chunk * n - P;
    const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);
    const std::string sn = std::to_string(n);
    heading = "every device holds the same: parameters and gradients (padded to " + sn + " chunks of " + commas(chunk) +
              " floats: " + std::to_string(pad) + " floats more each), activations and workspace for its own " +
              std::to_string(b) + " images, and";
    std::vector<Holding> h = batch_holdings(spec, c, n);
    const DType t = wire_dtype(c, n);
    if (n > 1)  // one device has no ring
      h.push_back(
          {Category::comm, chunk * dtype_size(t), "one ring chunk, ceil(P / " + sn + ") elements of " + dtype_name(t)});
    if (t != DType::fp32)
      h.push_back(
          {Category::comm, chunk * n * dtype_size(t),
           std::string("--grad-dtype: the padded gradients in ") + dtype_name(t) + " for their reduce-scatter"});
    if (const int64_t states = int64_t(optimizer_state_names(c).size()); states > 0)
      h.push_back({Category::optimizer, states * chunk * F,
                   "1/" + sn + " of the " + optimizer_state_text(c) + ": the chunk it owns and updates"});
    return h;
  }
  std::string memory_note(const EngineConfig&) const override {
    return "zero1: every device holds the optimizer state of its own 1/n of the parameters";
  }
  bool skewed(const EngineConfig&) const override { return false; }
};

}  // namespace

const Strategy& zero1_strategy() {
  static const Zero1 s;
  return s;
}

}  // namespace dp
