// --sync allreduce: PyTorch's DistributedDataParallel, Horovod. The parameters are broadcast once at
// the start; each device loads its own shard of the batch (DistributedSampler's rank slice); forward,
// the loss (weighted n_i/B so uneven shards stay exact) and backward run locally; the flat gradient
// buffer is all-reduced, optionally in buckets overlapped with backward (--bucket-kb); every device
// runs the same optimizer step, so every replica holds the same bits. The all-reduce is the ring's
// (reduce-scatter then all-gather; NCCL on distinct GPUs) or, with --allreduce naive, d2l's
// hand-written one (sum onto device 0, copy back): the communicator runs either (communicator.h).
// The one strategy that runs across processes (mpirun), hierarchically (process_communicator.h).
#include "engine/optimizer.h"
#include "engine/strategy.h"

namespace dp {
namespace {

class AllReduce final : public Strategy {
 public:
  const char* name() const override { return "allreduce"; }
  const char* mirrors() const override { return "DDP"; }
  const char* reduces() const override { return "all-reduces its gradients"; }
  bool takes_all_reduce_algorithm() const override { return true; }
  bool takes_buckets() const override { return true; }

  bool steps_optimizer(int) const override { return true; }

  // Each device: its own shard, (b, D) and (b), and its shard's logit gradients, (b, C).
  void allocate(Device& dev, Replica& rep, const ModelSpec& spec, const EngineConfig& c, int, int b) const override {
    const int64_t D = spec.input_size(), C = spec.classes;
    for (int s = 0; s < (c.prefetch ? Device::kUploadSlots : 1); ++s) {
      rep.batch[size_t(s)].x = dev.alloc_floats(int64_t(b) * D, Category::inputs);
      rep.batch[size_t(s)].y = dev.alloc(size_t(b) * sizeof(int32_t), Category::inputs);
    }
    rep.dlogits = dev.alloc_floats(int64_t(b) * C, Category::outputs);
  }

  // Each device reads its own shard straight from host memory, from the process's first device on.
  std::pair<int, int> upload_rows(const std::vector<int>& sizes, int first_device, int rank) const override {
    int first = 0;
    for (int q = first_device; q < first_device + rank; ++q) first += sizes[size_t(q)];
    return {first, sizes[size_t(first_device + rank)]};
  }

  void step(StepContext& s) const override {
    const int r = s.rank(), B = s.batch(), mine = s.mine();
    Replica& rep = s.replica();
    Communicator& comm = s.comm();
    Ops& ops = s.device().ops();
    const int64_t P = s.spec().param_count, C = s.spec().classes;
    const Replica::Upload& up = s.upload();
    const std::vector<Bucket>& buckets = s.buckets();

    s.phase(Phase::load, [&] { s.load(); });
    // DDP's broadcast_buffers: rank 0's running statistics to every replica before its forward.
    if (s.broadcasts_buffers())
      s.phase(Phase::broadcast, [&] { comm.broadcast(r, rep.running.f(), s.spec().buffer_count, 0); });
    const float* logits = nullptr;
    const BatchNormPass bn = s.batchnorm();
    s.phase(Phase::forward, [&] {
      if (mine > 0)
        logits = rep.net->forward(rep.params.f(), up.x.f(), mine, &bn);
      else
        rep.net->forward_without_samples(&bn);
    });
    // Scaled by 1/B, not 1/mine: the shards' gradients then sum to the full batch's exactly.
    s.phase(Phase::gather_loss, [&] {
      ops.fill(kStats, 0.0f, rep.stats.f());
      if (mine > 0) ops.softmax_xent(mine, int(C), logits, up.y.i32(), 1.0f / float(B), rep.dlogits.f(), rep.stats.f());
    });
    // A bucket's all-reduce starts on the communication thread once backward has written all its layers.
    std::vector<int> remaining;
    for (auto& b : buckets) remaining.push_back(b.layers);
    auto on_ready = [&](int layer) {
      const int b = s.layer_bucket(layer);
      if (b >= 0 && --remaining[size_t(b)] == 0)
        comm.all_reduce_async(r, rep.grads.f() + buckets[size_t(b)].offset, buckets[size_t(b)].count,
                              s.bucket_timing(b));
    };
    s.phase(Phase::backward, [&] {
      const auto ready = buckets.empty() ? std::function<void(int)>() : on_ready;
      if (mine > 0)
        rep.net->backward(rep.params.f(), rep.grads.f(), rep.dlogits.f(), mine, ready, &bn);
      else
        rep.net->backward_without_samples(rep.grads.f(), ready, &bn);
    });
    s.phase(Phase::reduce, [&] {
      if (buckets.empty())
        comm.all_reduce(r, rep.grads.f(), P);
      else
        comm.wait(r);
    });
    if (!buckets.empty()) s.close_buckets();
    s.phase(Phase::optimizer, [&] {
      // Every replica holds the same gradient now: device 0's check speaks for all.
      const EngineConfig& c = s.config();
      if (r == 0) ops.flag_nonfinite(P, rep.grads.f(), rep.stats.f() + kNonfinite);
      optimizer_step(ops, c, P, rep.params.f(), rep.grads.f(), rep.state_pointers(), s.optimizer_step());
    });
  }
  bool computes_loss(int) const override { return true; }

  bool has_phase(Phase p) const override { return p != Phase::scatter && p != Phase::broadcast; }
  const char* phase_name(Phase p) const override {
    if (p == Phase::reduce) return "all-reduce";
    if (p == Phase::gather_loss) return "loss";
    return Strategy::phase_name(p);
  }
  bool communicates(Phase p) const override { return p == Phase::reduce; }
  std::string describe(const EngineConfig& c) const override {
    return std::string(name()) + " (" + all_reduce_name(c.all_reduce) + ")";
  }
  const char* idle_device() const override { return "their shards are empty and they add zero gradients"; }

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
    m.batchnorm(s.spec, s.sync_bn, false);
    m.batchnorm(s.spec, s.sync_bn, true);
    std::vector<Bucket> bs = s.buckets;
    if (bs.empty()) bs.push_back({0, s.spec.param_count, 0});
    for (size_t b = 0; b < bs.size(); ++b)
      m.all_reduce(s.buckets.empty() ? "gradients" : "gradient bucket " + std::to_string(b), bs[b].count);
    return m.take();
  }

  std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int n,
                                std::string& heading) const override {
    const int64_t P = spec.param_count, D = spec.input_size(), C = spec.classes, F = sizeof(float);
    const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);
    const std::string sb = std::to_string(b), sD = std::to_string(D), sC = std::to_string(C);
    heading = "every device holds the same: parameters, gradients, activations and workspace for its own " + sb +
              " images, and";
    std::vector<Holding> h = {
        {Category::inputs, b * D * F + b * 4, "its own shard, " + sb + " x " + sD + " floats + " + sb + " labels"},
        {Category::outputs, b * C * F + 3 * F,
         "its shard's logit gradient, " + sb + " x " + sC + " floats + 12 B loss/correct/finite"},
        {Category::comm, even_chunks(P, n)[0] * F, "one ring chunk, ceil(P / " + std::to_string(n) + ") floats"}};
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
