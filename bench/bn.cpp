// dp_bench bn: BatchNorm across replicas, the teaching demo. The same lenet-bn (same initial weights,
// same data order, same global batch) trained with local BatchNorm (each replica normalises its own
// shard; device 0's running statistics broadcast to every replica each step, as nn.DataParallel's
// replicas and DDP's broadcast_buffers do) and with SyncBatchNorm (the statistics of the whole global
// batch), at several per-device batches, next to one device on the whole batch, which SyncBatchNorm
// equals up to float rounding. Printed per run: test accuracy and loss (evaluation uses the running
// statistics), how far the running statistics are from the reference's, time and bytes per step
// (checked against the byte model), then what sync costs over local and a conclusion drawn from the
// numbers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "bench/bench.h"
#include "bench/commands.h"
#include "train/data.h"
#include "engine/error.h"
#include "train/options.h"
#include "train/paths.h"
#include "train/report.h"

namespace dp::bench {
namespace {

// A hundred replicas is already a lesson; thousands of simulated devices would be thousands of threads.
constexpr int kMaxDevices = 256;

struct Run {
  int per_device = 0, devices = 1;
  std::string mode;  // "reference", "local", "sync"
  double test_accuracy = 0, test_loss = 0;
  double train_loss = 0;  // the mean over the last (up to) 10 steps
  std::vector<float> running;
  double distance = 0;  // ||running - reference's|| / ||reference's||, over every running mean and variance
  std::vector<double> distance_by_buffer;  // the same per ModelSpec::buffers entry
  std::vector<double> step_ms;
  std::vector<std::string> names;
  std::vector<Traffic> measured, predicted, bn_model;  // per rank; bn_model: BatchNorm's part of predicted
  bool match = true;
  double seconds = 0;  // the whole run: engine, steps, evaluation
  double median_ms() const { return median(step_ms); }
  const Traffic* peer(const std::vector<Traffic>& t) const { return t.size() > 1 ? &t[1] : nullptr; }
};

double relative_distance(const float* a, const float* ref, int64_t count) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double d = double(a[i]) - double(ref[i]);
    diff += d * d, norm += double(ref[i]) * double(ref[i]);
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

struct Data {
  Dataset train, test;
  int64_t per_epoch = 0;  // full batches per epoch; the epoch's last partial batch is dropped
};

// The replicas' devices: simulated ones, or on CUDA every replica round-robin over the GPUs there are
// (several replicas sharing a GPU talk through peer copies, as --allow-shared-device does).
DeviceSet make_replicas(bool cuda, int gpus, int n) {
  DeviceConfig c;
  c.backend = cuda ? "cuda" : "cpu";
  c.ids.clear();
  for (int r = 0; r < n; ++r) c.ids.push_back(cuda ? r % gpus : r);
  c.allow_shared_device = cuda;
  return make_devices(c);
}

Run train_run(const BnOptions& o, const ModelSpec& spec, const Data& data, const std::vector<float>& init,
              int per_device, const std::string& mode, bool cuda, int gpus) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  Run run;
  run.per_device = per_device, run.devices = o.batch / per_device, run.mode = mode;
  const int n = run.devices;
  DeviceSet set = make_replicas(cuda, gpus, n);
  std::vector<Device*> devices;
  for (auto& d : set.devices) devices.push_back(d.get()), run.names.push_back(d->name());
  EngineConfig ec;
  ec.sync = o.sync, ec.split = Split::even, ec.batch = o.batch, ec.lr = o.lr, ec.momentum = o.momentum;
  ec.sync_bn = mode == "sync";
  Engine engine(devices, spec, ec);
  engine.set_params(init);
  std::vector<float> buffers(size_t(spec.buffer_count));
  init_buffers(spec, buffers.data());
  engine.set_running_stats(buffers);

  const int64_t D = spec.input_size();
  std::vector<float> x(size_t(o.batch * D));  // (B, 1, 28, 28)
  std::vector<int32_t> y(size_t(o.batch));    // (B)
  std::vector<int64_t> order;
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    const int64_t epoch = step / data.per_epoch, at = step % data.per_epoch * o.batch;
    if (at == 0) order = epoch_order(data.train.count, o.seed, epoch, true);
    for (int i = 0; i < o.batch; ++i) {
      const int64_t s = order[size_t(at + i)];
      std::copy_n(data.train.images.data() + s * D, D, x.data() + int64_t(i) * D);
      y[size_t(i)] = data.train.labels[size_t(s)];
    }
    const auto t0 = clock::now();
    const StepResult r = engine.step(x.data(), y.data(), o.batch);
    run.step_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    losses.push_back(r.loss);
  }
  const size_t last = std::min<size_t>(10, losses.size());
  for (size_t i = losses.size() - last; i < losses.size(); ++i) run.train_loss += losses[i] / double(last);

  for (int r = 0; r < n; ++r) run.measured.push_back(engine.recorder().step_traffic(r));
  run.predicted = total_traffic(engine.strategy().step_collectives({spec, split_batch(o.batch, n, Split::even),
                                                                    engine.buckets(), ec.sync_bn}),
                                n);
  // BatchNorm's part alone: what it adds to the step.
  ByteModel bn(n, AllReduceAlgorithm::ring);
  if (n > 1) bn.batchnorm(spec, ec.sync_bn, false), bn.batchnorm(spec, ec.sync_bn, true);
  run.bn_model = total_traffic(bn.take(), n);
  for (int r = 0; r < n; ++r) {
    run.match = run.match && run.measured[r].sent == run.predicted[r].sent &&
                run.measured[r].received == run.predicted[r].received;
  }
  run.running = engine.running_stats();
  if (data.test.count > 0) {
    const StepResult e = engine.evaluate(data.test.images.data(), data.test.labels.data(), int(data.test.count));
    run.test_accuracy = double(e.correct) / double(data.test.count);
    run.test_loss = e.loss;
  }
  run.seconds = std::chrono::duration<double>(clock::now() - start).count();
  return run;
}

void set_distance(Run& run, const ModelSpec& spec, const std::vector<float>& ref) {
  run.distance = relative_distance(run.running.data(), ref.data(), spec.buffer_count);
  for (const BufferSpec& b : spec.buffers)
    run.distance_by_buffer.push_back(
        relative_distance(run.running.data() + b.offset, ref.data() + b.offset, b.channels));
}

std::string signed_bytes(int64_t v) { return (v > 0 ? "+" : "") + commas(v); }
std::string distance_text(double d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, d == 0 ? "0" : d < 1e-3 ? "%.1e" : "%.4f", d);
  return buf;
}

void print_runs(const Run& ref, const std::vector<Run>& runs) {
  Table t;
  t.row({"per-device", "devices", "BatchNorm", "test acc", "test loss", "stats dist", "ms/step", "dev0 sent",
         "dev0 recv", "peer sent", "peer recv"});
  auto row = [&](const Run& r) {
    const Traffic* p = r.peer(r.measured);
    t.row({std::to_string(r.per_device), std::to_string(r.devices), r.mode, fixed(r.test_accuracy, 4),
           fixed(r.test_loss, 4), distance_text(r.distance), fixed(r.median_ms(), 1), commas(r.measured[0].sent),
           commas(r.measured[0].received), p ? commas(p->sent) : "-", p ? commas(p->received) : "-"});
  };
  row(ref);
  for (const Run& r : runs) row(r);
  std::printf("\n%s", t.str().c_str());
  std::printf(
      "(test acc and loss: Engine::evaluate, with device 0's running statistics; stats dist: ||r - r_ref|| / "
      "||r_ref|| over every running mean and variance, r_ref the reference's; ms/step: median; bytes per step, "
      "the peer is device 1)\n");
}

struct Extra {
  int per_device = 0, devices = 0;
  Traffic dev0, peer;
  bool has_peer = false;
  double ms = 0;
};

std::vector<Extra> extras(const std::vector<Run>& runs) {
  std::vector<Extra> out;
  for (const Run& s : runs) {
    if (s.mode != "sync") continue;
    for (const Run& l : runs) {
      if (l.mode != "local" || l.per_device != s.per_device) continue;
      Extra e;
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

void print_extras(const std::vector<Extra>& ex, const ModelSpec& spec) {
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
  for (const Extra& e : ex) {
    char ms[32];
    std::snprintf(ms, sizeof ms, "%+.1f", e.ms);
    t.row({std::to_string(e.per_device), std::to_string(e.devices), signed_bytes(e.dev0.sent),
           signed_bytes(e.dev0.received), e.has_peer ? signed_bytes(e.peer.sent) : "-",
           e.has_peer ? signed_bytes(e.peer.received) : "-", ms});
  }
  std::printf("%s", t.str().c_str());
}

// False when a run's bytes are off the model.
bool print_bytes_check(const Run& ref, const std::vector<Run>& runs) {
  bool ok = true;
  auto check = [&](const Run& r) {
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
  for (const Run& r : runs) check(r);
  if (ok) std::printf("bytes: measured == model, to the byte, on every device of every run\n");
  return ok;
}

struct Conclusion {
  std::string text;
  double sync_mean = 0, noise = 0, threshold = 0;  // accuracies, fractions of 1
  int within_from = 0;        // the smallest per-device batch from which local is within the threshold; 0: none
  std::map<int, double> gap;  // per-device batch -> sync_mean - local's accuracy
};

// Drawn from the numbers. The reference and every sync run are one computation up to float rounding,
// which training amplifies step by step (ReLU's kink turns a rounding difference into a different
// gradient): the spread of their test accuracies is the noise of a run of this length, and their mean
// is SyncBatchNorm's accuracy. Local BatchNorm counts as good as sync from the smallest per-device batch
// at which it, and every larger one tried, is no more than 1 point (or the noise, if larger) below it.
Conclusion conclude(const Run& ref, const std::vector<Run>& runs, int steps) {
  Conclusion c;
  std::map<int, const Run*> local;
  double lo = ref.test_accuracy, hi = ref.test_accuracy, sum = ref.test_accuracy, sync_max = 0;
  int count = 1;
  for (const Run& r : runs) {
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

nlohmann::json traffic_json(const Traffic& t) { return {{"sent", t.sent}, {"received", t.received}}; }

nlohmann::json run_json(const Run& r, const ModelSpec& spec) {
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

void check_options(const BnOptions& o) {
  if (o.batch <= 0)
    throw UsageError("--batch: " + std::to_string(o.batch) +
                     " is not a batch size; give a positive number of images, e.g. 128");
  if (o.steps <= 0) throw UsageError("--steps: " + std::to_string(o.steps) + " steps; give at least 1");
  if (!(o.lr > 0) || !std::isfinite(o.lr)) throw UsageError("--lr: must be a finite learning rate > 0");
  if (!(o.momentum >= 0 && o.momentum < 1)) throw UsageError("--momentum: must be in [0, 1)");
  if (o.limit_train < 0 || o.limit_test < 0) throw UsageError("--limit-train / --limit-test: must be >= 0 (0: all)");
  if (o.per_device.empty()) throw UsageError("--per-device: give at least one per-device batch, e.g. 2,4,8");
  for (int p : o.per_device) {
    const std::string what = "--per-device " + std::to_string(p) + ": ";
    if (p < 2)
      throw UsageError(what +
                       "BatchNorm needs more than 1 value per channel in training (PyTorch: \"Expected more than 1 "
                       "value per channel when training\"), so local BatchNorm cannot normalise a shard of " +
                       (p == 1 ? "1 sample" : "no samples") +
                       "; SyncBatchNorm could (its statistics are the global batch's), but the demo compares both at "
                       "the same per-device batches, so each must be at least 2");
    if (o.batch % p != 0)
      throw UsageError(what + "does not divide --batch " + std::to_string(o.batch) +
                       "; every device gets the same shard, so give divisors of the global batch (e.g. 2,4,8,16,32,64 "
                       "for 128)");
    if (o.batch / p > kMaxDevices)
      throw UsageError(what + "--batch " + std::to_string(o.batch) + " over shards of " + std::to_string(p) + " is " +
                       std::to_string(o.batch / p) + " devices, more than the " + std::to_string(kMaxDevices) +
                       " this demo makes; give a larger per-device batch or a smaller --batch");
    if (std::count(o.per_device.begin(), o.per_device.end(), p) > 1)
      throw UsageError(what + "given twice; give each per-device batch once");
  }
  check_output_file("--json", o.json);
  check_output_directory("--plot", o.plot);
  if (!o.plot.empty()) check_plotting();
}

// --backend: cpu (the default) is simulated devices; auto picks CUDA where a GPU is usable.
bool resolve_cuda(const std::string& backend, int& gpus, std::string& notice) {
  if (backend != "cpu" && backend != "cuda" && backend != "auto")
    throw UsageError("--backend: '" + backend + "' is not a backend; use cpu (the default), cuda or auto");
  if (backend == "cpu") {
    notice = "backend: simulated CPU devices (--backend cpu): a CPU thread per replica, devices = --batch / per-device";
    return false;
  }
  const CudaProbe probe = probe_cuda();
  if (probe.count == 0) {
    if (backend == "cuda")
      throw UsageError("--backend cuda: no CUDA device is usable (" + probe.reason + "); use --backend cpu");
    notice = "backend: simulated CPU devices (" + probe.reason + "): a CPU thread per replica";
    return false;
  }
  gpus = probe.count;
  notice = "backend: cuda (" + std::to_string(gpus) +
           " CUDA device(s); the replicas are placed on them round-robin, several to a GPU where there are more "
           "replicas than GPUs)";
  return true;
}

}  // namespace

int run_bn(const BnOptions& o) {
  check_options(o);
  const ModelSpec spec = make_model("lenet-bn");
  int gpus = 0;
  std::string notice;
  const bool cuda = resolve_cuda(o.backend, gpus, notice);
  Data data;
  const ImageShape shape{spec.in_h, spec.in_w, spec.name};
  data.train = load_idx(o.data, "train", o.limit_train, spec.classes, shape);
  data.test = load_idx(o.data, "t10k", o.limit_test, spec.classes, shape);
  if (data.train.count < o.batch)
    throw UsageError("--batch " + std::to_string(o.batch) + ": more than the " + commas(data.train.count) +
                     " training images" + (o.limit_train > 0 ? " --limit-train keeps" : " in " + o.data) +
                     "; a step takes a full batch");
  data.per_epoch = data.train.count / o.batch;
  std::printf("%s\n", notice.c_str());
  const int64_t dropped = data.train.count % o.batch;
  std::printf("data: %s: %s training images, shuffled each epoch (one epoch = %s steps of %d%s), %s test images\n",
              o.data.c_str(), commas(data.train.count).c_str(), commas(data.per_epoch).c_str(), o.batch,
              dropped ? ("; its last " + commas(dropped) + " images, short of a batch, are dropped").c_str() : "",
              commas(data.test.count).c_str());
  std::string bns;
  for (const Layer& l : spec.layers)
    if (l.kind == LayerKind::batchnorm)
      bns += (bns.empty() ? "" : ", ") + l.name + " (" + std::to_string(l.out_c) + ")";
  std::printf(
      "%s (P = %s parameters; BatchNorm %s: R = %s running statistics), global batch %d, %d steps, --sync %s, SGD lr "
      "%g momentum %g, seed %llu\n",
      spec.name.c_str(), commas(spec.param_count).c_str(), bns.c_str(), commas(spec.buffer_count).c_str(), o.batch,
      o.steps, o.sync.c_str(), double(o.lr), double(o.momentum), (unsigned long long)o.seed);

  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, o.seed, init.data());
  const int total = 1 + 2 * int(o.per_device.size());
  int done = 0;
  auto train = [&](int per_device, const std::string& mode) {
    const int n = o.batch / per_device;
    std::printf("  run %d/%d: %-9s %3d device%s x %3d images ... ", ++done, total, mode.c_str(), n, n > 1 ? "s" : " ",
                per_device);
    std::fflush(stdout);
    Run r = train_run(o, spec, data, init, per_device, mode, cuda, gpus);
    std::printf("%.1f s\n", r.seconds);
    std::fflush(stdout);
    return r;
  };
  Run ref = train(o.batch, "reference");
  set_distance(ref, spec, ref.running);
  std::vector<Run> runs;
  for (int p : o.per_device)
    for (const char* mode : {"local", "sync"}) {
      runs.push_back(train(p, mode));
      set_distance(runs.back(), spec, ref.running);
    }

  print_runs(ref, runs);
  const std::vector<Extra> ex = extras(runs);
  print_extras(ex, spec);
  const bool ok = print_bytes_check(ref, runs);
  const Conclusion c = conclude(ref, runs, o.steps);
  std::printf("\nconclusion: %s\n", c.text.c_str());

  nlohmann::json rows = nlohmann::json::array(), extra = nlohmann::json::array();
  for (const Run& r : runs) rows.push_back(run_json(r, spec));
  for (const Extra& e : ex)
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
  const Run* widest = &ref;
  for (const Run& r : runs)
    if (r.devices > widest->devices) widest = &r;
  record_backend(config, o.backend, cuda ? DeviceKind::cuda : DeviceKind::simulated, widest->names);
  const nlohmann::json j = {
      {"command", o.command},   {"config", config},     {"reference", run_json(ref, spec)}, {"runs", rows},
      {"sync_vs_local", extra}, {"conclusion", c.text}, {"verdict", verdict_json(c)},       {"match", ok}};
  if (!o.json.empty()) write_json(o.json, j);
  if (!o.plot.empty()) {
    std::filesystem::create_directories(o.plot);
    const std::string data_path = (std::filesystem::path(o.plot) / "bn.json").string();
    write_json(data_path, j);
    for (const auto& png : run_plot("bn", data_path, o.plot)) std::printf("plot: %s\n", png.c_str());
  }
  return ok ? 0 : 1;
}

}  // namespace dp::bench
