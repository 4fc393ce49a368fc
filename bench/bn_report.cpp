// dp_bench bn's report: the runs' table, what sync costs over local, the bytes against the model, the
// conclusion drawn from the numbers, and the JSON record.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "bench/bn.h"
#include "train/options.h"
#include "train/report.h"

namespace dp::bench {
namespace {

std::string signed_bytes(int64_t v) { return (v > 0 ? "+" : "") + commas(v); }
std::string distance_text(double d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, d == 0 ? "0" : d < 1e-3 ? "%.1e" : "%.4f", d);
  return buf;
}

}  // namespace

void print_runs(const BnRun& ref, const std::vector<BnRun>& runs) {
  Table t;
  t.row({"per-device", "devices", "BatchNorm", "test acc", "test loss", "stats dist", "ms/step", "dev0 sent",
         "dev0 recv", "peer sent", "peer recv"});
  auto row = [&](const BnRun& r) {
    const Traffic* p = r.peer(r.measured);
    t.row({std::to_string(r.per_device), std::to_string(r.devices), r.mode, fixed(r.test_accuracy, 4),
           fixed(r.test_loss, 4), distance_text(r.distance), fixed(r.median_ms(), 1), commas(r.measured[0].sent),
           commas(r.measured[0].received), p ? commas(p->sent) : "-", p ? commas(p->received) : "-"});
  };
  row(ref);
  for (const BnRun& r : runs) row(r);
  std::printf("\n%s", t.str().c_str());
  std::printf(
      "(test acc and loss: Engine::evaluate, with device 0's running statistics; stats dist: ||r - r_ref|| / "
      "||r_ref|| over every running mean and variance, r_ref the reference's; ms/step: median; bytes per step, "
      "the peer is device 1)\n");
}

std::vector<BnExtra> extras(const std::vector<BnRun>& runs) {
  std::vector<BnExtra> out;
  for (const BnRun& s : runs) {
    if (s.mode != "sync") continue;
    for (const BnRun& l : runs) {
      if (l.mode != "local" || l.per_device != s.per_device) continue;
      BnExtra e;
      e.per_device = s.per_device, e.devices = s.devices;
      e.dev0 = {s.measured[0].sent - l.measured[0].sent, s.measured[0].received - l.measured[0].received};
      e.has_peer = s.devices > 1;
      if (e.has_peer)
        e.peer = {s.measured[1].sent - l.measured[1].sent, s.measured[1].received - l.measured[1].received};
      e.ms = s.median_ms() - l.median_ms();
      out.push_back(e);
    }
  }
  return out;
}

void print_extras(const std::vector<BnExtra>& ex, const ModelSpec& spec) {
  std::string layers;
  for (const Layer& l : spec.layers)
    if (l.kind == LayerKind::batchnorm)
      layers += (layers.empty() ? "" : ", ") + l.name + " C = " + std::to_string(l.out_c);
  std::printf(
      "\nsync vs local, per step: what SyncBatchNorm moves and costs beyond local BatchNorm. Sync all-reduces (ring) "
      "per BatchNorm layer the sums of the mean and of the variance (C floats each) in forward and backward's two "
      "gradient sums (2C) (%s); local instead broadcasts device 0's R = %lld running statistics: device 0 sends "
      "(n-1)·R·4 bytes, each peer receives R·4\n",
      layers.c_str(), (long long)spec.buffer_count);
  Table t;
  t.row({"per-device", "devices", "dev0 sent", "dev0 recv", "peer sent", "peer recv", "ms/step"});
  for (const BnExtra& e : ex) {
    char ms[32];
    std::snprintf(ms, sizeof ms, "%+.1f", e.ms);
    t.row({std::to_string(e.per_device), std::to_string(e.devices), signed_bytes(e.dev0.sent),
           signed_bytes(e.dev0.received), e.has_peer ? signed_bytes(e.peer.sent) : "-",
           e.has_peer ? signed_bytes(e.peer.received) : "-", ms});
  }
  std::printf("%s", t.str().c_str());
}

// False when a run's bytes are off the model.
bool print_bytes_check(const BnRun& ref, const std::vector<BnRun>& runs) {
  bool ok = true;
  auto check = [&](const BnRun& r) {
    for (size_t k = 0; k < r.measured.size(); ++k)
      if (r.measured[k].sent != r.predicted[k].sent || r.measured[k].received != r.predicted[k].received) {
        std::printf("MISMATCH: %s, per-device %d, %s: measured %s sent / %s received, model %s / %s\n", r.mode.c_str(),
                    r.per_device, r.names[k].c_str(), commas(r.measured[k].sent).c_str(),
                    commas(r.measured[k].received).c_str(), commas(r.predicted[k].sent).c_str(),
                    commas(r.predicted[k].received).c_str());
        ok = false;
      }
  };
  check(ref);
  for (const BnRun& r : runs) check(r);
  if (ok) std::printf("bytes: measured == model, to the byte, on every device of every run\n");
  return ok;
}

// Drawn from the numbers. The reference and every sync run are one computation up to float rounding,
// which training amplifies step by step (ReLU's kink turns a rounding difference into a different
// gradient): the spread of their test accuracies is the noise of a run of this length, and their mean
// is SyncBatchNorm's accuracy. Local BatchNorm counts as good as sync from the smallest per-device batch
// at which it, and every larger one tried, is no more than 1 point (or the noise, if larger) below it.
Conclusion conclude(const BnRun& ref, const std::vector<BnRun>& runs, int steps) {
  Conclusion c;
  std::map<int, const BnRun*> local;
  double lo = ref.test_accuracy, hi = ref.test_accuracy, sum = ref.test_accuracy, sync_max = 0;
  int count = 1;
  for (const BnRun& r : runs) {
    if (r.mode == "local") {
      local[r.per_device] = &r;
      continue;
    }
    lo = std::min(lo, r.test_accuracy), hi = std::max(hi, r.test_accuracy), sum += r.test_accuracy, ++count;
    sync_max = std::max(sync_max, r.distance);
  }
  c.sync_mean = sum / count, c.noise = hi - lo, c.threshold = std::max(0.01, c.noise);
  for (auto& [p, r] : local) c.gap[p] = c.sync_mean - r->test_accuracy;
  for (auto it = c.gap.rbegin(); it != c.gap.rend() && it->second <= c.threshold; ++it) c.within_from = it->first;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%.1f points", 100 * c.threshold);
  const std::string within =
      c.threshold > 0.01 ? "within the noise (" + std::string(buf) + ")" : std::string("within 1 point");
  std::snprintf(buf, sizeof buf,
                "SyncBatchNorm's test accuracy is %.4f (the mean of the sync runs and the reference, which agree "
                "within %.1f points: one computation up to float rounding, amplified over %d steps); ",
                c.sync_mean, 100 * c.noise, steps);
  c.text = buf;
  std::string below;  // the per-device batches under within_from, with their gaps
  for (auto& [p, g] : c.gap)
    if (c.within_from == 0 || p < c.within_from) {
      std::snprintf(buf, sizeof buf, "%s%.1f at %d", below.empty() ? "" : ", ", 100 * g, p);
      below += buf;
    }
  if (c.within_from == c.gap.begin()->first)
    c.text += "local BatchNorm's is " + within + " of it at every per-device batch tried, down to " +
              std::to_string(c.within_from);
  else if (c.within_from == 0)
    c.text += "local BatchNorm's is below it by more than " + within.substr(within.find(' ') + 1) +
              " at every per-device batch tried (points below: " + below + ")";
  else
    c.text += "local BatchNorm's is " + within + " of it from a per-device batch of " + std::to_string(c.within_from) +
              " on, and below it by " + below + " points";
  double local_lo = 1e300, local_hi = 0;
  for (auto& [p, r] : local) local_lo = std::min(local_lo, r->distance), local_hi = std::max(local_hi, r->distance);
  c.text += "; the running statistics are within " + distance_text(sync_max) +
            " of the reference's under SyncBatchNorm (relative), " + distance_text(local_lo) + " to " +
            distance_text(local_hi) + " off under local BatchNorm (device 0's shard alone)";
  return c;
}

namespace {

nlohmann::json traffic_json(const Traffic& t) { return {{"sent", t.sent}, {"received", t.received}}; }

nlohmann::json run_json(const BnRun& r, const ModelSpec& spec) {
  nlohmann::json by_buffer = nlohmann::json::object();
  for (size_t b = 0; b < spec.buffers.size(); ++b) by_buffer[spec.buffers[b].name] = r.distance_by_buffer[b];
  nlohmann::json devices = nlohmann::json::array();
  for (size_t k = 0; k < r.measured.size(); ++k)
    devices.push_back({{"rank", k},
                       {"name", r.names[k]},
                       {"bytes_sent", r.measured[k].sent},
                       {"bytes_received", r.measured[k].received},
                       {"predicted_sent", r.predicted[k].sent},
                       {"predicted_received", r.predicted[k].received},
                       {"batchnorm_sent", r.bn_model[k].sent},
                       {"batchnorm_received", r.bn_model[k].received}});
  const Traffic* peer = r.peer(r.measured);
  return {
      {"per_device", r.per_device},
      {"devices", r.devices},
      {"mode", r.mode},
      {"test_accuracy", r.test_accuracy},
      {"test_loss", r.test_loss},
      {"train_loss", r.train_loss},
      {"running_distance", r.distance},
      {"running_distance_by_buffer", by_buffer},
      {"step_ms", {{"median", r.median_ms()}, {"all", r.step_ms}}},
      {"bytes_per_step", {{"device0", traffic_json(r.measured[0])}, {"peer", peer ? traffic_json(*peer) : nullptr}}},
      {"bytes_match_model", r.match},
      {"device_bytes", devices},
      {"seconds", r.seconds}};
}

nlohmann::json verdict_json(const Conclusion& c) {
  nlohmann::json gaps = nlohmann::json::array();
  for (auto& [p, g] : c.gap) gaps.push_back({{"per_device", p}, {"points_below_sync", 100 * g}});
  return {{"sync_accuracy", c.sync_mean},
          {"sync_spread_points", 100 * c.noise},
          {"threshold_points", 100 * c.threshold},
          {"local_within_from", c.within_from ? nlohmann::json(c.within_from) : nlohmann::json()},
          {"local", gaps}};
}

}  // namespace

nlohmann::json bn_json(const BnOptions& o, const ModelSpec& spec, const BnData& data, const BnRun& ref,
                       const std::vector<BnRun>& runs, const std::vector<BnExtra>& ex, const Conclusion& c, bool ok,
                       bool cuda) {
  nlohmann::json rows = nlohmann::json::array(), extra = nlohmann::json::array();
  for (const BnRun& r : runs) rows.push_back(run_json(r, spec));
  for (const BnExtra& e : ex)
    extra.push_back({{"per_device", e.per_device},
                     {"devices", e.devices},
                     {"device0", traffic_json(e.dev0)},
                     {"peer", e.has_peer ? traffic_json(e.peer) : nlohmann::json()},
                     {"ms_per_step", e.ms}});
  TrainOptions t;
  t.model = spec.name, t.batch = o.batch, t.lr = o.lr, t.momentum = o.momentum, t.seed = o.seed;
  t.devices.backend = o.backend, t.sync = o.sync;
  nlohmann::json config = run_config(t, spec, o.steps);
  config.update({{"strategy", o.sync},
                 {"per_device", o.per_device},
                 {"data", o.data},
                 {"limit_train", o.limit_train},
                 {"limit_test", o.limit_test},
                 {"train_images", data.train.count},
                 {"test_images", data.test.count},
                 {"last_partial_batch", "dropped"},
                 {"buffers", spec.buffer_count}});
  config.erase("sync_bn");  // both, per row
  // The devices of the largest run; every row names its own.
  const BnRun* widest = &ref;
  for (const BnRun& r : runs)
    if (r.devices > widest->devices) widest = &r;
  record_backend(config, o.backend, cuda ? DeviceKind::cuda : DeviceKind::simulated, widest->names);
  return {{"command", o.command},   {"config", config},     {"reference", run_json(ref, spec)}, {"runs", rows},
          {"sync_vs_local", extra}, {"conclusion", c.text}, {"verdict", verdict_json(c)},       {"match", ok}};
}

}  // namespace dp::bench
