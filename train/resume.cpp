#include "train/resume.h"

#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "train/report.h"

namespace dp {
namespace {

// A float as text that reads back to the same bits (9 significant digits suffice for a float).
std::string exact(float v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", double(v));
  return b;
}

int64_t meta_int(const Checkpoint& c, const std::string& key, const std::string& path) {
  auto it = c.metadata.find(key);
  if (it == c.metadata.end())
    throw UsageError(path + ": not a resumable checkpoint (no '" + key +
                     "' in its metadata); use --load to start from its weights");
  size_t used = 0;
  int64_t v = -1;
  try {
    v = std::stoll(it->second, &used);
  } catch (...) {
    used = 0;
  }
  if (used == 0 || used != it->second.size() || v < 0)
    throw UsageError(path + ": metadata '" + key + "' is '" + it->second + "', not a step count");
  return v;
}

// A key of the identity in words, for the refusal: "a training set of 600 samples (--limit-train 600)".
std::string describe(const std::string& key, const std::string& v, const std::string& limit) {
  if (key == "train_samples") return "a training set of " + v + " samples (--limit-train " + limit + ")";
  if (key == "train_labels_crc32") return "training labels with CRC-32 " + v;
  if (key == "shuffle") return v == "1" ? "shuffling" : "--no-shuffle";
  return "--" + key + " " + v;
}

// Throws on the first required difference; warns once, listing them all, on exact-only ones. A key
// an older checkpoint lacks is trusted.
void check_identity(const TrainOptions& o, const RunIdentity& id, const Checkpoint& c) {
  auto saved = [&](const std::string& key) {
    auto it = c.metadata.find(key);
    return it == c.metadata.end() ? std::string() : it->second;
  };
  for (auto& [key, now] : id.required) {
    std::string then = saved(key);
    if (then.empty() || then == now) continue;
    throw UsageError(
        "--resume " + o.resume + ": saved with " + describe(key, then, saved("limit_train")) + ", this run (--data " +
        o.data + ") has " + describe(key, now, std::to_string(o.limit_train)) +
        "; resuming would replay different samples, not continue the run (use --load to start afresh from its "
        "weights)");
  }
  std::string differs;
  for (auto& [key, now] : id.exact_only) {
    std::string then = saved(key);
    // compared as floats: "0.1" is 0.1f
    bool number = key == "lr" || key == "momentum" || key == "weight_decay" || key.rfind("beta", 0) == 0 ||
                  key == "eps" || key == "lr_gamma" || key == "clip_grad_norm";
    if (then.empty() || then == now ||
        (number && std::strtof(then.c_str(), nullptr) == std::strtof(now.c_str(), nullptr)))
      continue;
    differs += (differs.empty() ? "" : ", ") + key + " " + then + " -> " + now;
  }
  if (!differs.empty())
    std::fprintf(stderr, "dp_train: warning: --resume %s: %s; the continuation is not guaranteed bit-exact\n",
                 o.resume.c_str(), differs.c_str());
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace

RunIdentity run_identity(const TrainOptions& o, const Dataset& train_set, const std::string& backend, int devices,
                         const LrSchedule& lr) {
  const uint32_t labels_crc = uint32_t(crc32(0L, reinterpret_cast<const Bytef*>(train_set.labels.data()),
                                             uInt(train_set.labels.size() * sizeof(int32_t))));
  RunIdentity id;
  id.required = {{"seed", std::to_string(o.seed)},
                 {"shuffle", o.shuffle ? "1" : "0"},
                 {"batch", std::to_string(o.batch)},
                 {"accumulate", std::to_string(o.accumulate)},
                 {"train_samples", std::to_string(train_set.count)},
                 {"train_labels_crc32", std::to_string(labels_crc)}};
  id.exact_only = {{"sync", o.sync},
                   {"allreduce", all_reduce_name(o.all_reduce)},
                   {"grad_dtype", dtype_name(o.grad_dtype)},
                   {"devices", std::to_string(devices)},
                   {"split", split_name(o.split)},
                   {"bucket_kb", std::to_string(o.bucket_kb)},
                   {"sync_bn", o.sync_bn ? "1" : "0"},
                   {"backend", backend},
                   {"optimizer", optimizer_name(o.optimizer)},
                   {"lr", exact(o.lr)},
                   {"lr_schedule", lr_schedule_name(lr.kind)},
                   {"warmup", std::to_string(lr.warmup)},
                   {"weight_decay", exact(o.weight_decay)}};
  // What else the rate of a later step depends on: the decays' size and factor, cosine's end.
  if (lr.kind == LrScheduleKind::step)
    id.exact_only.insert(id.exact_only.end(),
                         {{"lr_step_size", std::to_string(lr.step_size)}, {"lr_gamma", exact(o.lr_gamma)}});
  if (lr.kind == LrScheduleKind::cosine) id.exact_only.push_back({"lr_schedule_steps", std::to_string(lr.total_steps)});
  if (o.clip_grad_norm > 0) id.exact_only.push_back({"clip_grad_norm", exact(o.clip_grad_norm)});
  if (o.optimizer == Optimizer::sgd)
    id.exact_only.push_back({"momentum", exact(o.momentum)});
  else
    id.exact_only.insert(id.exact_only.end(),
                         {{"beta1", exact(o.beta1)}, {"beta2", exact(o.beta2)}, {"eps", exact(o.eps)}});
  return id;
}

Resumed resume_checkpoint(const TrainOptions& o, const ModelSpec& spec, const RunIdentity& id) {
  Resumed r;
  if (o.resume.empty()) return r;
  r.checkpoint = load_checkpoint(o.resume, spec);  // refuses another model
  r.global_step = meta_int(r.checkpoint, "global_step", o.resume);
  check_identity(o, id, r.checkpoint);
  return r;
}

// Called between steps only: Engine::step returns after every device has finished the optimizer,
// so the replicas agree. params() reads device 0, which is the right source under every strategy:
// under allreduce and zero1 every replica holds the same bits (the same update everywhere, or the
// updated shards all-gathered); under scatter only device 0 runs the optimizer and holds the weights,
// the others get them by broadcast at the next step. The optimizer state is device 0's, or gathered
// from every device's shard (Engine::optimizer_state).
void CheckpointSaver::save(Engine& engine, int64_t global_step, std::vector<float> weights,
                           std::vector<std::vector<float>> state) {
  if (saved_step_ == global_step) return;
  std::map<std::string, std::string> position(id_.required.begin(), id_.required.end());
  position.insert(id_.exact_only.begin(), id_.exact_only.end());
  position["epoch"] = std::to_string(global_step / per_epoch_);
  position["step_in_epoch"] = std::to_string(global_step % per_epoch_);
  position["global_step"] = std::to_string(global_step);
  position["limit_train"] = std::to_string(o_.limit_train);
  position["dp_version"] = version();  // informational: loading neither needs nor checks it
  Checkpoint c;
  c.params = std::move(weights);
  const std::vector<std::string> names = optimizer_state_names(engine.config());
  bool finite = all_finite(c.params);
  for (size_t i = 0; i < names.size(); ++i) {
    finite = finite && all_finite(state[i]);
    c.optimizer_state[names[i]] = std::move(state[i]);
  }
  c.optimizer_steps = engine.optimizer_steps();
  c.buffers = engine.running_stats();
  c.batches_tracked = engine.batches_tracked();
  c.metadata = position;
  // Finite gradients times a huge --lr can still overflow the weights.
  if (!finite || !all_finite(c.buffers))
    throw NumericalError("step " + std::to_string(global_step) +
                         ": the weights are no longer finite after the update; not saving them, " + kept() +
                         divergence_hint(o_));
  save_checkpoint(o_.save, spec_, c);
  saved_step_ = global_step;
}

std::string CheckpointSaver::kept() const {
  if (saved_step_ >= 0)
    return "the last good checkpoint (step " + std::to_string(saved_step_) + ") in " + o_.save + " is kept";
  std::error_code err;
  return std::filesystem::exists(o_.save, err) ? o_.save + " is left as it was" : "nothing was saved";
}

}  // namespace dp
