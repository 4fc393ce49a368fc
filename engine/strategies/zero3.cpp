// --sync zero3: ZeRO stage 3 (Rajbhandari et al., arXiv 1910.02054; DeepSpeed's stage 3; PyTorch
// FSDP's FULL_SHARD and FSDP2's fully_shard). As zero2, and each device keeps only its chunks of the
// parameters too: a layer's weights are all-gathered from every device's chunk just before forward
// uses them and freed after, and gathered again for backward (LayerGatherer, sharded.h); the
// gradients are reduce-scattered bucket by bucket on the communication thread as in zero2, and each
// device steps the optimizer on its chunks, which are all it keeps. Backward's gathers queue behind
// the reduce-scatters there, so a bucket's reduce-scatter overlaps backward only until the next layer
// needs its weights (its bucket is then freed before the layer is gathered): gathering the next layer
// ahead (FSDP's backward prefetch) is not built. An evaluation, a
// checkpoint, --verify and the report's hashes gather the whole model for the moment they need it (FSDP's
// summon_full_params), every process of a job taking part. Across processes (mpirun) hierarchically, as zero1 and
// zero2.
//
// A device holds its 1/n of the parameters, gradients and optimizer state, plus the layers being
// gathered (the prefix's convolutions together, each other layer alone) and the buckets of zero2's
// gradients. Per step each device sends and receives (n-1) chunks of every unit in each of three
// collectives (two all-gathers, one reduce-scatter): 3(n-1)/n·P and the padding, half as much again
// as the ring all-reduce, the price the ZeRO paper gives for stage 3.
#include <algorithm>

#include "engine/optimizer.h"
#include "engine/strategies/own_batch.h"
#include "engine/strategies/sharded.h"

namespace dp {
namespace {

class Zero3 final : public OwnBatch {
 public:
  const char* name() const override { return "zero3"; }
  const char* mirrors() const override { return "ZeRO-3, FSDP FULL_SHARD"; }
  const char* reduces() const override { return "reduce-scatters its gradients bucket by bucket"; }
  bool takes_buckets() const override { return true; }
  int zero_stage() const override { return 3; }

  void step(StepContext& s) const override {
    {
      BucketReducer reduce(s);
      LayerGatherer gather(s, &reduce);  // forward's layers, then backward's, each gathered and freed in turn
      forward_backward(s, reduce.ready(), &reduce.blocks(), &gather.blocks());
      if (!s.last_micro()) return;  // --accumulate: as zero2; the weights are gathered every micro-batch
      s.phase(Phase::reduce, [&] { reduce.finish(); });
      s.close_buckets();
    }
    s.phase(Phase::optimizer, [&] {
      // The device's chunks are all it keeps: the padding steps too, zeros with zero gradients.
      Replica& rep = s.replica();
      Ops& ops = s.device().ops();
      const int64_t owned = owned_floats(s.units());
      clip_gradients(s, rep.grads.f(), owned, true);
      optimizer_step(ops, s.config(), owned, rep.params.f(), rep.grads.f(), rep.state_pointers(),
                     rep.optimizer_scalars(), rep.stats.f() + kNonfinite);
    });
  }

  bool has_phase(Phase p) const override { return p != Phase::scatter && p != Phase::gather; }
  const char* phase_name(Phase p) const override {
    if (p == Phase::gather_loss) return "loss";
    if (p == Phase::reduce) return "reduce-scatter";  // the last bucket's; the others' overlap backward
    if (p == Phase::forward) return "all-gather+forward";
    if (p == Phase::backward) return "all-gather+backward";
    return Strategy::phase_name(p);
  }
  bool communicates(Phase p) const override { return p == Phase::reduce || p == Phase::broadcast; }

  // Per unit of c floats (a bucket): an all-gather before forward, another before backward and a
  // reduce-scatter after it, each of n chunks of ceil(c / n), each device sending and receiving (n-1)
  // of them. BatchNorm's collectives interleave with them in time; the bytes are the same.
  std::vector<CollectiveTraffic> step_collectives(const StepShape& s) const override {
    ByteModel m(s.devices(), s.all_reduce);
    if (s.devices() == 1) return m.take();
    const std::vector<ShardUnit> units = shard_units(s.buckets, s.devices());
    // --accumulate: the weights are gathered for every micro-batch's passes, the gradients
    // reduce-scattered in the last's backward alone
    for (int k = 0; k < s.micro_batches; ++k) {
      m.micro_batch(k, s.micro_batches);
      m.batchnorm(s.spec, s.sync_bn, false);
      m.batchnorm(s.spec, s.sync_bn, true);
      for (size_t u = units.size(); u-- > 0;)
        m.sharded(Collective::all_gather, "forward's parameters of bucket " + std::to_string(u), units[u].chunk);
      for (size_t u = 0; u < units.size(); ++u) {
        m.sharded(Collective::all_gather, "backward's parameters of bucket " + std::to_string(u), units[u].chunk);
        if (k + 1 == s.micro_batches)
          m.sharded(Collective::reduce_scatter, "gradient bucket " + std::to_string(u), units[u].chunk, s.grad_dtype);
      }
    }
    m.micro_batch(-1, s.micro_batches);
    if (s.clip_norm) m.all_reduce("the gradient's squared norm", 1);
    return m.take();
  }

  std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int n,
                                std::string& heading) const override {
    const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);
    heading =
        "every device holds the same: activations and workspace for its own " + std::to_string(b) + " images, and";
    std::vector<Holding> h = batch_holdings(spec, c, n);
    for (Holding& s : sharded_holdings(spec, c, n, true)) h.push_back(std::move(s));
    return h;
  }
  std::string memory_note(const EngineConfig&) const override {
    return "zero3: every device holds its own 1/n of each bucket's parameters, gradients and optimizer state, and "
           "the layers it is gathering";
  }
  bool skewed(const EngineConfig&) const override { return false; }
};

}  // namespace

const Strategy& zero3_strategy() {
  static const Zero3 s;
  return s;
}

}  // namespace dp
