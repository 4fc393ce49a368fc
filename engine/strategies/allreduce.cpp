// --sync allreduce: PyTorch's DistributedDataParallel, Horovod. The parameters are broadcast once at
// the start; each device loads its own shard of the batch (DistributedSampler's rank slice); forward,
// the loss (weighted n_i/B so uneven shards stay exact) and backward run locally; the flat gradient
// buffer is all-reduced, optionally in buckets overlapped with backward (--bucket-kb); every device
// runs the same optimizer step, so every replica holds the same bits. The all-reduce is the ring's
// (reduce-scatter then all-gather; NCCL on distinct GPUs) or, with --allreduce naive, d2l's
// hand-written one (sum onto device 0, copy back): the communicator runs either (communicator.h).
// Runs across processes (mpirun), hierarchically (process_communicator.h), as zero1 does.
#include "engine/optimizer.h"
#include "engine/strategies/own_batch.h"

namespace dp {
namespace {

class AllReduce final : public OwnBatch {
 public:
  const char* name() const override { return "allreduce"; }
  const char* mirrors() const override { return "DDP"; }
  const char* reduces() const override { return "all-reduces its gradients"; }
  bool takes_all_reduce_algorithm() const override { return true; }
  bool takes_buckets() const override { return true; }

  void step(StepContext& s) const override {
    const int r = s.rank();
    Replica& rep = s.replica();
    Communicator& comm = s.comm();
    const int64_t P = s.spec().param_count;
    const std::vector<Bucket>& buckets = s.buckets();
    // --grad-dtype: each bucket narrowed to the type as it is ready, the sum widened back once all are done.
    WireGradients wire(s, s.last_micro() ? P : 0);
    // A bucket's all-reduce starts on the communication thread once backward has written all its layers.
    std::vector<int> remaining;
    for (auto& b : buckets) remaining.push_back(b.layers);
    auto on_ready = [&](int layer) {
      const int b = s.layer_bucket(layer);
      if (b >= 0 && --remaining[size_t(b)] == 0) {
        const Bucket& k = buckets[size_t(b)];
        comm.all_reduce_async(r, wire.narrow(rep.grads.f(), k.offset, k.count), k.count, s.bucket_timing(b),
                              wire.type());
      }
    };
    // --accumulate (DDP's no_sync): the gradients stay on the device until the step's last micro-batch.
    forward_backward(s, buckets.empty() || !s.last_micro() ? std::function<void(int)>() : on_ready);
    if (!s.last_micro()) return;
    s.phase(Phase::reduce, [&] {
      if (buckets.empty())
        comm.all_reduce(r, wire.narrow(rep.grads.f(), 0, P), P, wire.type());
      else
        comm.wait(r);
      wire.widen(0, P, rep.grads.f());
    });
    if (!buckets.empty()) s.close_buckets();
    s.phase(Phase::optimizer, [&] {
      // Every replica holds the same gradient now: each checks it (in the optimizer's kernel), all alike.
      const EngineConfig& c = s.config();
      Ops& ops = s.device().ops();
      clip_gradients(s, rep.grads.f(), P, false);  // the same bits on every replica: the same coefficient
      optimizer_step(ops, c, P, rep.params.f(), rep.grads.f(), rep.state_pointers(), rep.optimizer_scalars(),
                     rep.stats.f() + kNonfinite);
    });
  }

  bool has_phase(Phase p) const override { return p != Phase::scatter && p != Phase::gather; }
  const char* phase_name(Phase p) const override {
    if (p == Phase::reduce) return "all-reduce";
    if (p == Phase::gather_loss) return "loss";
    return Strategy::phase_name(p);
  }
  bool communicates(Phase p) const override { return p == Phase::reduce || p == Phase::broadcast; }
  std::string describe(const EngineConfig& c) const override {
    return std::string(name()) + " (" + all_reduce_name(c.all_reduce) + ")";
  }

  // One all-reduce per bucket of c floats (one bucket of P when not bucketed).
  //   ring, over even_chunks(c, n): at reduce-scatter step s (0 ≤ s < n−1) rank r sends chunk (r−s) mod n
  //   and receives chunk (r−1−s) mod n; at all-gather step s it sends chunk (r+1−s) mod n and receives
  //   chunk (r−s) mod n. Each way ≈ 2(n−1)/n·c·4 bytes (exact when n divides c).
  //   naive (d2l's), two phases, each an α-β collective of its own, both counted as the all_reduce:
  //     reduce to device 0         device 0 receives (n−1)·c·4               device i sends c·4
  //     broadcast from device 0    device 0 sends (n−1)·c·4                  device i receives c·4
  //   so device 0 sends and receives (n−1)·c·4 bytes, every other device c·4 each way: device 0's share
  //   grows with n, as under scatter.
  // BatchNorm's collectives are interleaved with the buckets in time; the bytes are the same.
  std::vector<CollectiveTraffic> step_collectives(const StepShape& s) const override {
    ByteModel m(s.devices(), s.all_reduce);
    if (s.devices() == 1) return m.take();
    m.batchnorm_per_micro_batch(s);  // --accumulate: the gradients' collectives below come once
    std::vector<Bucket> bs = s.buckets;
    if (bs.empty()) bs.push_back({0, s.spec.param_count, 0});
    for (size_t b = 0; b < bs.size(); ++b)
      m.all_reduce(s.buckets.empty() ? "gradients" : "gradient bucket " + std::to_string(b), bs[b].count, s.grad_dtype);
    return m.take();
  }

  std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int n,
                                std::string& heading) const override {
    const int64_t P = spec.param_count, F = sizeof(float);
    const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);
    heading = "every device holds the same: parameters, gradients, activations and workspace for its own " +
              std::to_string(b) + " images, and";
    std::vector<Holding> h = batch_holdings(spec, c, n);
    const DType t = wire_dtype(c, n);
    if (n > 1)  // one device has no ring
      h.push_back({Category::comm, even_chunks(P, n)[0] * dtype_size(t),
                   "one ring chunk, ceil(P / " + std::to_string(n) + ") elements of " + dtype_name(t)});
    if (t != DType::fp32)
      h.push_back({Category::comm, P * dtype_size(t),
                   std::string("--grad-dtype: the gradients in ") + dtype_name(t) + " for their all-reduce"});
    if (const int64_t states = int64_t(optimizer_state_names(c).size()); states > 0)
      h.push_back({Category::optimizer, states * P * F,
                   "its own " + optimizer_state_text(c) + ": every device runs the same optimizer step"});
    return h;
  }
  std::string memory_note(const EngineConfig& c) const override {
    if (c.all_reduce == AllReduceAlgorithm::naive)
      return "allreduce, naive: device 0 also holds every other replica's gradients, which it sums and sends back";
    return "allreduce, ring: every replica holds the same";
  }
  bool skewed(const EngineConfig& c) const override { return c.all_reduce == AllReduceAlgorithm::naive; }
};

}  // namespace

const Strategy& allreduce_strategy() {
  static const AllReduce s;
  return s;
}

}  // namespace dp
