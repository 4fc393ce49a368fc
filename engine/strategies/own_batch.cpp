#include "engine/strategies/own_batch.h"

#include <algorithm>

namespace dp {

void OwnBatch::allocate(Device& dev, Replica& rep, const ModelSpec& spec, const EngineConfig& c, int, int b) const {
  const int64_t D = spec.input_size(), C = spec.classes;
  for (int s = 0; s < (c.prefetch ? Device::kUploadSlots : 1); ++s) {
    rep.batch[size_t(s)].x = dev.alloc_floats(int64_t(b) * D, Category::inputs);
    rep.batch[size_t(s)].y = dev.alloc(size_t(b) * sizeof(int32_t), Category::inputs);
  }
  rep.dlogits = dev.alloc_floats(int64_t(b) * C, Category::outputs);
}

std::pair<int, int> OwnBatch::upload_rows(const std::vector<int>& sizes, int first_device, int rank) const {
  int first = 0;
  for (int q = first_device; q < first_device + rank; ++q) first += sizes[size_t(q)];
  return {first, sizes[size_t(first_device + rank)]};
}

void OwnBatch::forward_backward(StepContext& s, const std::function<void(int)>& ready, const GradientBlocks* blocks,
                                const ParameterBlocks* params) {
  const int r = s.rank(), mine = s.mine();
  Replica& rep = s.replica();
  Ops& ops = s.device().ops();
  const int64_t C = s.spec().classes;
  const Replica::Upload& up = s.upload();

  s.phase(Phase::load, [&] { s.load(); });
  // DDP's broadcast_buffers: rank 0's running statistics to every replica before its forward.
  if (s.broadcasts_buffers())
    s.phase(Phase::broadcast, [&] { s.comm().broadcast(r, rep.running.f(), s.spec().buffer_count, 0); });
  const float* logits = nullptr;
  const BatchNormPass bn = s.batchnorm();
  s.phase(Phase::forward, [&] {
    if (mine > 0)
      logits = params ? rep.net->forward(*params, up.x.f(), mine, &bn)
                      : rep.net->forward(rep.params.f(), up.x.f(), mine, &bn);
    else
      rep.net->forward_without_samples(&bn, params);
  });
  // Scaled by 1/B, not 1/mine: the shards' gradients then sum to the full batch's exactly (B: the
  // optimizer step's images, every micro-batch's; the loss and correct count add up over them).
  s.phase(Phase::gather_loss, [&] {
    if (s.micro().index == 0) ops.fill(kStats, 0.0f, rep.stats.f());
    if (mine > 0)
      ops.softmax_xent(mine, int(C), logits, up.y.i32(), 1.0f / float(s.images()), rep.dlogits.f(), rep.stats.f());
  });
  // After the first micro-batch each layer's gradients add to the step's so far, wherever they are.
  rep.net->set_accumulating(s.micro().index > 0);
  s.phase(Phase::backward, [&] {
    if (blocks && params && mine > 0)
      rep.net->backward(*params, *blocks, rep.dlogits.f(), mine, ready, &bn);
    else if (blocks && mine > 0)
      rep.net->backward(rep.params.f(), *blocks, rep.dlogits.f(), mine, ready, &bn);
    else if (blocks)
      rep.net->backward_without_samples(*blocks, ready, &bn, params);
    else if (mine > 0)
      rep.net->backward(rep.params.f(), rep.grads.f(), rep.dlogits.f(), mine, ready, &bn);
    else
      rep.net->backward_without_samples(rep.grads.f(), ready, &bn);
  });
}

std::vector<Holding> OwnBatch::batch_holdings(const ModelSpec& spec, const EngineConfig& c, int n) {
  const int64_t D = spec.input_size(), C = spec.classes, F = sizeof(float);
  const int b = std::max(1, split_batch(c.batch, n, c.split)[0]);
  const std::string sb = std::to_string(b), sD = std::to_string(D), sC = std::to_string(C);
  return {{Category::inputs, b * D * F + b * 4, "its own shard, " + sb + " x " + sD + " floats + " + sb + " labels"},
          {Category::outputs, b * C * F + 3 * F,
           "its shard's logit gradient, " + sb + " x " + sC + " floats + 12 B loss/correct/finite"}};
}

}  // namespace dp
