// --sync scatter: PyTorch's nn.DataParallel. Each step the whole batch lands on device 0, which
// scatters it in chunks and broadcasts its parameters to every replica; each device runs forward on
// its chunk; the logits are gathered to device 0, where the loss over the full batch and its gradient
// are computed; the logit gradients are scattered back; each device runs backward; the gradients are
// reduced (summed) onto device 0; only device 0 steps the optimizer. Device 0 is the root of every
// collective, so it holds and moves more than the others: the memory skew this project shows.
#include "engine/optimizer.h"
#include "engine/strategy.h"

namespace dp {
namespace {

class Scatter final : public Strategy {
 public:
  const char* name() const override { return "scatter"; }
  const char* mirrors() const override { return "nn.DataParallel"; }
  const char* reduces() const override { return "reduces its gradients to device 0"; }
  const char* one_process_only() const override {
    return "nn.DataParallel is one process by design (the batch lands on one device, which alone steps the "
           "optimizer)";
  }

  bool steps_optimizer(int rank) const override { return rank == 0; }

  // Device 0: the whole batch, (B, D) and (B), its own chunk the first rows, and the gathered logits
  // and their gradients, (B, C) each. Every other device: the chunk scatter sends it, (b, D), and its
  // logit gradients, (b, C).
  void allocate(Device& dev, Replica& rep, const ModelSpec& spec, const EngineConfig& c, int rank,
                int b) const override {
    const int64_t D = spec.input_size(), C = spec.classes;
    if (rank == 0) {
      for (int s = 0; s < (c.prefetch ? Device::kUploadSlots : 1); ++s) {
        rep.batch[size_t(s)].x = dev.alloc_floats(int64_t(c.batch) * D, Category::inputs);
        rep.batch[size_t(s)].y = dev.alloc(size_t(c.batch) * sizeof(int32_t), Category::inputs);
      }
      rep.gathered = dev.alloc_floats(int64_t(c.batch) * C, Category::outputs);
      rep.gathered_grad = dev.alloc_floats(int64_t(c.batch) * C, Category::outputs);
    } else {
      rep.input = dev.alloc_floats(int64_t(b) * D, Category::inputs);
      rep.dlogits = dev.alloc_floats(int64_t(b) * C, Category::outputs);
    }
  }

  // The whole batch lands on device 0 (DataParallel's input is on device_ids[0]).
  std::pair<int, int> upload_rows(const std::vector<int>& sizes, int, int rank) const override {
    int n = 0;
    for (int s : sizes) n += s;
    return {0, rank == 0 ? n : 0};
  }

  void step(StepContext& s) const override {
    const int r = s.rank(), B = s.batch(), mine = s.mine();
    Replica& rep = s.replica();
    Communicator& comm = s.comm();
    Ops& ops = s.device().ops();
    const int64_t P = s.spec().param_count, D = s.spec().input_size(), C = s.spec().classes;
    std::vector<int64_t> in_counts, out_counts;
    for (int n : s.sizes()) in_counts.push_back(n * D), out_counts.push_back(n * C);
    const Replica::Upload& up = s.upload();  // device 0's

    s.phase(Phase::load, [&] { s.load(); });
    s.phase(Phase::scatter, [&] { comm.scatter(r, r == 0 ? up.x.f() : nullptr, rep.input.f(), in_counts, 0); });
    s.phase(Phase::broadcast, [&] {
      comm.broadcast(r, rep.params.f(), P, 0);
      if (s.broadcasts_buffers()) comm.broadcast(r, rep.running.f(), s.spec().buffer_count, 0);
    });
    const float* logits = nullptr;
    const BatchNormPass bn = s.batchnorm();
    s.phase(Phase::forward, [&] {
      if (mine > 0)
        logits = rep.net->forward(rep.params.f(), r == 0 ? up.x.f() : rep.input.f(), mine, &bn);
      else
        rep.net->forward_without_samples(&bn);
    });
    s.phase(Phase::gather_loss, [&] {
      comm.gather(r, logits, rep.gathered.f(), out_counts, 0);
      if (r == 0) {  // weighted by the optimizer step's images, every micro-batch's (--accumulate)
        if (s.micro().index == 0) ops.fill(kStats, 0.0f, rep.stats.f());
        ops.softmax_xent(B, int(C), rep.gathered.f(), up.y.i32(), 1.0f / float(s.images()), rep.gathered_grad.f(),
                         rep.stats.f());
      }
      comm.scatter(r, r == 0 ? rep.gathered_grad.f() : nullptr, rep.dlogits.f(), out_counts, 0);
    });
    // --accumulate: every micro-batch's gradients are reduced to device 0, as nn.DataParallel's are at
    // each backward, where they add to the step's so far; the others' start afresh each time.
    rep.net->set_accumulating(r == 0 && s.micro().index > 0);
    s.phase(Phase::backward, [&] {
      // A device without samples (batch smaller than the device count) contributes zeros.
      if (mine > 0)
        rep.net->backward(rep.params.f(), rep.grads.f(), r == 0 ? rep.gathered_grad.f() : rep.dlogits.f(), mine, {},
                          &bn);
      else
        rep.net->backward_without_samples(rep.grads.f(), {}, &bn);
    });
    s.phase(Phase::reduce, [&] { comm.reduce(r, rep.grads.f(), P, 0); });
    if (!s.last_micro()) return;
    s.phase(Phase::optimizer, [&] {
      if (r != 0) return;
      const EngineConfig& c = s.config();
      clip_gradients(s, rep.grads.f(), P, false);
      optimizer_step(ops, c, P, rep.params.f(), rep.grads.f(), rep.state_pointers(), rep.optimizer_scalars(),
                     rep.stats.f() + kNonfinite);
    });
  }
  bool computes_loss(int rank) const override { return rank == 0; }

  // Only device 0 steps the optimizer: the replicas evaluate with its parameters.
  void before_evaluation(Communicator& comm, int rank, Replica& rep, const ModelSpec& spec) const override {
    comm.broadcast(rank, rep.params.f(), spec.param_count, 0);
  }

  // nn.DataParallel has no communication hook: its reduce is float32, and --grad-dtype is refused.
  bool takes_grad_dtype() const override { return false; }
  bool has_phase(Phase p) const override { return p != Phase::gather; }
  bool communicates(Phase p) const override {
    return p == Phase::scatter || p == Phase::broadcast || p == Phase::gather_loss || p == Phase::reduce;
  }
  const char* idle_device() const override { return "they idle in compute (as nn.DataParallel's unused devices do)"; }

  // Bytes per step, with P parameters, D input floats per image, C classes, n devices, n_i the split
  // sizes and 4 bytes a float (device 0 is the root of every collective):
  //   scatter the input chunks   device 0 sends Σ_{i≥1} n_i·D·4         device i receives n_i·D·4
  //   broadcast the parameters   device 0 sends (n−1)·P·4              device i receives P·4
  //   gather the logits          device 0 receives Σ_{i≥1} n_i·C·4     device i sends n_i·C·4
  //   scatter the logit grads    device 0 sends Σ_{i≥1} n_i·C·4        device i receives n_i·C·4
  //   reduce the gradients       device 0 receives (n−1)·P·4           device i sends P·4
  // so device 0 sends Σ n_i·D·4 + (n−1)·P·4 + Σ n_i·C·4 and receives Σ n_i·C·4 + (n−1)·P·4; device i
  // receives n_i·D·4 + P·4 + n_i·C·4 and sends n_i·C·4 + P·4. No collective runs on one device.
  std::vector<CollectiveTraffic> step_collectives(const StepShape& s) const override {
    ByteModel m(s.devices(), AllReduceAlgorithm::ring);
    if (s.devices() == 1) return m.take();
    std::vector<int64_t> inputs, logits;
    for (int n : s.sizes) inputs.push_back(n * s.spec.input_size()), logits.push_back(n * int64_t(s.spec.classes));
    for (int k = 0; k < s.micro_batches; ++k) {  // --accumulate: all of it every micro-batch, as DataParallel
      m.micro_batch(k, s.micro_batches);
      m.rooted(Collective::scatter, "input chunks", true, inputs);
      m.rooted(Collective::broadcast, "parameters", true, s.spec.param_count);
      m.batchnorm(s.spec, s.sync_bn, false);
      m.rooted(Collective::gather, "logits", false, logits);
      m.rooted(Collective::scatter, "logit gradients", true, logits);
      m.batchnorm(s.spec, s.sync_bn, true);
      m.rooted(Collective::reduce, "gradients", false, s.spec.param_count);
    }
    return m.take();
  }

  std::vector<Holding> holdings(const ModelSpec& spec, const EngineConfig& c, int n,
                                std::string& heading) const override {
    const int64_t P = spec.param_count, D = spec.input_size(), C = spec.classes, F = sizeof(float), B = c.batch;
    const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);  // every replica's buffers hold the largest chunk
    const std::string sB = std::to_string(B), sb = std::to_string(b), sD = std::to_string(D), sC = std::to_string(C);
    heading =
        "what device 0 holds beyond every replica's parameters, gradients, activations and workspace (for its own " +
        sb + " images):";
    std::vector<Holding> h = {
        {Category::inputs, B * D * F + B * 4,
         "the whole batch, " + sB + " x " + sD + " floats + " + sB +
             " labels: it lands on device 0 before it is scattered (the others: their " + sb + " images, " +
             commas(b * D * F) + " B)"},
        {Category::outputs, 2 * B * C * F + 3 * F,
         "the gathered logits and their gradient, 2 x " + sB + " x " + sC +
             " floats + 12 B loss/correct/finite: the loss runs on device 0 (the others: " + sb + " x " + sC +
             " floats + 12 B)"},
        {Category::comm, (n - 1) * P * F,
         "the reduce buffer, " + std::to_string(n - 1) +
             " x P floats: every other replica's whole gradient lands here before the sum (the others only send)"}};
    const int64_t states = int64_t(optimizer_state_names(c).size());
    if (states > 0)
      h.push_back({Category::optimizer, states * P * F,
                   "the " + optimizer_state_text(c) + ": only device 0 runs the optimizer"});
    else
      h.push_back({Category::optimizer, 0, "plain SGD (--optimizer sgd) keeps no state", false});
    return h;
  }
  std::string memory_note(const EngineConfig& c) const override {
    return std::string("scatter: device 0 also holds the whole batch") +
           (c.prefetch ? ", twice with prefetch: this step's and the next's," : ",") +
           " the gathered logits, the gradients it reduces and the optimizer state";
  }
  bool skewed(const EngineConfig&) const override { return true; }
};

}  // namespace

const Strategy& scatter_strategy() {
  static const Scatter s;
  return s;
}

}  // namespace dp
