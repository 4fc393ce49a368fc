// --sync zero2: ZeRO stage 2 (Rajbhandari et al., arXiv 1910.02054; DeepSpeed's stage 2; PyTorch
// FSDP's SHARD_GRAD_OP keeps the gradients sharded likewise). As zero1, and each device keeps only
// its chunks of the gradients too. The gradients go in buckets (one per parameterised layer, or
// --bucket-kb's), each a unit cut into n chunks: backward writes a bucket's gradients into a buffer of
// that bucket alone, which is reduce-scattered as soon as backward has finished it; the device keeps
// its chunk of the sum and frees the buffer. Each device then steps the optimizer on its chunks, and
// the updated parameters are all-gathered unit by unit.
//
// What a device's gradients take at their peak is its chunks, 1/n of the model, plus the bucket
// backward is writing and the one before it being reduce-scattered: at least the largest layer's. The ZeRO paper's P/n
// holds for a model of many layers of like size; LeNet's fc1 is four fifths of it, so here zero2 holds about as much
// gradient memory as zero1 (dp_bench skew shows it).
//
// The reduce-scatters overlap backward on the communication thread (NCCL's comm stream on GPUs), as
// allreduce's buckets do, two buckets alive at most (BucketReducer): backward waits for a bucket's
// reduce-scatter only when the next bucket is ready, and the step's reduce-scatter phase is the wait
// for the last. The trace shows each as its bucket's span.
//
// Per step each device sends and receives (n-1) chunks of every unit in either collective: 2(n-1)/n·P
// floats and each unit's padding, as zero1.
#include <algorithm>

#include "engine/optimizer.h"
#include "engine/strategies/own_batch.h"
#include "engine/strategies/sharded.h"

namespace dp {
namespace {

class Zero2 final : public OwnBatch {
 public:
  const char* name() const override { return "zero2"; }
  const char* mirrors() const override { return "ZeRO-2, FSDP SHARD_GRAD_OP"; }
  const char* reduces() const override { return "reduce-scatters its gradients bucket by bucket"; }
  bool takes_buckets() const override { return true; }
  int zero_stage() const override { return 2; }

  void step(StepContext& s) const override {
    {
      BucketReducer reduce(s);  // each bucket's gradient buffer freed once its reduce-scatter is done
      forward_backward(s, reduce.ready(), &reduce.blocks());
      if (!s.last_micro()) return;  // --accumulate: reduce-scattered once, in the last micro-batch's backward
      s.phase(Phase::reduce, [&] { reduce.finish(); });
      s.close_buckets();
    }
    const std::vector<ShardUnit>& units = s.units();
    Replica& rep = s.replica();
    s.phase(Phase::optimizer, [&] {
      Ops& ops = s.device().ops();
      clip_gradients(s, rep.grads.f(), owned_floats(units), true);
      for (const ShardUnit& u : units) {
        const int64_t first = u.offset + u.chunk * s.shard();
        const int64_t count = std::clamp<int64_t>(u.offset + u.count - first, 0, u.chunk);
        std::vector<float*> state = rep.state_pointers();
        for (float*& p : state) p += u.owned;
        if (count > 0)  // each chunk it owns checked as it is stepped
          optimizer_step(ops, s.config(), count, rep.params.f() + first, rep.grads.f() + u.owned, state,
                         rep.optimizer_scalars(), rep.stats.f() + kNonfinite);
      }
    });
    s.phase(Phase::gather, [&] { gather_parameters(s); });
  }

  bool has_phase(Phase p) const override { return p != Phase::scatter; }
  const char* phase_name(Phase p) const override {
    if (p == Phase::gather_loss) return "loss";
    if (p == Phase::reduce) return "reduce-scatter";  // the last bucket's; the others' overlap backward
    return Strategy::phase_name(p);
  }
  bool communicates(Phase p) const override {
    return p == Phase::reduce || p == Phase::gather || p == Phase::broadcast;
  }

  // Per unit of c floats (a bucket), in backward's order: a reduce-scatter of n chunks of ceil(c / n),
  // each device sending and receiving (n-1) of them; then, after the optimizer, an all-gather of the
  // same. BatchNorm's collectives interleave with the reduce-scatters in time; the bytes are the same.
  std::vector<CollectiveTraffic> step_collectives(const StepShape& s) const override {
    ByteModel m(s.devices(), s.all_reduce);
    if (s.devices() == 1) return m.take();
    const std::vector<ShardUnit> units = shard_units(s.buckets, s.devices());
    m.batchnorm_per_micro_batch(s);  // --accumulate: the gradients' collectives below come once
    for (size_t u = 0; u < units.size(); ++u)
      m.sharded(Collective::reduce_scatter, "gradient bucket " + std::to_string(u), units[u].chunk, s.grad_dtype);
    if (s.clip_norm) m.all_reduce("the gradient's squared norm", 1);
    for (size_t u = 0; u < units.size(); ++u)
      m.sharded(Collective::all_gather, "parameters of bucket " + std::to_string(u), units[u].chunk);
    return m.take();
  }

  std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int n,
                                std::string& heading) const override {
    const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);
    heading = "every device holds the same: parameters, activations and workspace for its own " + std::to_string(b) +
              " images, and";
    std::vector<Holding> h = batch_holdings(spec, c, n);
    for (Holding& s : sharded_holdings(spec, c, n, false)) h.push_back(std::move(s));
    return h;
  }
  std::string memory_note(const EngineConfig&) const override {
    return "zero2: every device holds the optimizer state and the gradients of its own 1/n of each bucket, and "
           "the bucket backward is writing";
  }
  bool skewed(const EngineConfig&) const override { return false; }

 private:
  // Each unit's parameters through a buffer of n chunks, all-gathered: every device's updated chunk
  // into every replica.
  static void gather_parameters(StepContext& s) {
    const int n = s.comm().world();
    Device& dev = s.device();
    float* params = s.replica().params.f();
    for (const ShardUnit& u : s.units()) {
      Buffer whole = dev.alloc_floats(u.chunk * n, Category::comm);
      dev.copy(whole.f(), params + u.offset, size_t(u.count) * sizeof(float));
      dev.ops().fill(u.chunk * n - u.count, 0.0f, whole.f() + u.count);
      s.comm().all_gather(s.rank(), whole.f(), u.chunk);
      dev.copy(params + u.offset, whole.f(), size_t(u.count) * sizeof(float));
    }
  }
};

}  // namespace

const Strategy& zero2_strategy() {
  static const Zero2 s;
  return s;
}

}  // namespace dp
