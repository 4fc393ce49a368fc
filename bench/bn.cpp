// dp_bench bn: BatchNorm across replicas, the teaching demo. The same lenet-bn (same initial weights,
// same data order, same global batch) trained with local BatchNorm (each replica normalises its own
// shard; device 0's running statistics broadcast to every replica each step, as nn.DataParallel's
// replicas and DDP's broadcast_buffers do) and with SyncBatchNorm (the statistics of the whole global
// batch), at several per-device batches, next to one device on the whole batch, which SyncBatchNorm
// equals up to float rounding. Printed per run: test accuracy and loss (evaluation uses the running
// statistics), how far the running statistics are from the reference's, time and bytes per step
// (checked against the byte model), then what sync costs over local and a conclusion drawn from the
// numbers.
#include "bench/bn.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "engine/error.h"
#include "train/options.h"
#include "train/output_files.h"
#include "train/report.h"

namespace dp::bench {
namespace {

// A hundred replicas is already a lesson; thousands of simulated devices would be thousands of threads.
constexpr int kMaxDevices = 256;

double relative_distance(const float* a, const float* ref, int64_t count) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double d = double(a[i]) - double(ref[i]);
    diff += d * d, norm += double(ref[i]) * double(ref[i]);
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

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

// The run's steps on the data in --seed's order: each step's time, and the train loss (the mean of the
// last 10 steps'). A diverged run has nothing to compare: the comparison stops, as dp_train does (exit 3).
void train_steps(const BnOptions& o, const ModelSpec& spec, const BnData& data, Engine& engine, BnRun& run) {
  using clock = std::chrono::steady_clock;
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
    if (!std::isfinite(r.loss))
      throw NumericalError("bn: the " + run.mode + " run (" + std::to_string(run.devices) + " devices x " +
                           std::to_string(run.per_device) + " images) diverged: loss " + std::to_string(r.loss) +
                           " at step " + std::to_string(step + 1) + "; try a smaller --lr");
    losses.push_back(r.loss);
  }
  const size_t last = std::min<size_t>(10, losses.size());
  for (size_t i = losses.size() - last; i < losses.size(); ++i) run.train_loss += losses[i] / double(last);
}

BnRun train_run(const BnOptions& o, const ModelSpec& spec, const BnData& data, const std::vector<float>& init,
                int per_device, const std::string& mode, bool cuda, int gpus) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  BnRun run;
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

  train_steps(o, spec, data, engine, run);

  for (int r = 0; r < n; ++r) run.measured.push_back(engine.recorder().step_traffic(r));
  run.predicted = total_traffic(
      engine.strategy().step_collectives({spec, split_batch(o.batch, n, Split::even), engine.buckets(), ec.sync_bn}),
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

void set_distance(BnRun& run, const ModelSpec& spec, const std::vector<float>& ref) {
  run.distance = relative_distance(run.running.data(), ref.data(), spec.buffer_count);
  for (const BufferSpec& b : spec.buffers)
    run.distance_by_buffer.push_back(
        relative_distance(run.running.data() + b.offset, ref.data() + b.offset, b.channels));
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

// The real data set, every step a full batch; the notice and the data and model lines printed.
BnData load_data(const BnOptions& o, const ModelSpec& spec, const std::string& notice) {
  BnData data;
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
  return data;
}

}  // namespace

int run_bn(const BnOptions& o) {
  check_options(o);
  const ModelSpec spec = make_model("lenet-bn");
  int gpus = 0;
  std::string notice;
  const bool cuda = resolve_cuda(o.backend, gpus, notice);
  const BnData data = load_data(o, spec, notice);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, o.seed, init.data());
  const int total = 1 + 2 * int(o.per_device.size());
  int done = 0;
  auto train = [&](int per_device, const std::string& mode) {
    const int n = o.batch / per_device;
    std::printf("  run %d/%d: %-9s %3d device%s x %3d images ... ", ++done, total, mode.c_str(), n, n > 1 ? "s" : " ",
                per_device);
    std::fflush(stdout);
    BnRun r = train_run(o, spec, data, init, per_device, mode, cuda, gpus);
    std::printf("%.1f s\n", r.seconds);
    std::fflush(stdout);
    return r;
  };
  BnRun ref = train(o.batch, "reference");
  set_distance(ref, spec, ref.running);
  std::vector<BnRun> runs;
  for (int p : o.per_device)
    for (const char* mode : {"local", "sync"}) {
      runs.push_back(train(p, mode));
      set_distance(runs.back(), spec, ref.running);
    }

  print_runs(ref, runs);
  const std::vector<BnExtra> ex = extras(runs);
  print_extras(ex, spec);
  const bool ok = print_bytes_check(ref, runs);
  const Conclusion c = conclude(ref, runs, o.steps);
  std::printf("\nconclusion: %s\n", c.text.c_str());

  const nlohmann::json j = bn_json(o, spec, data, ref, runs, ex, c, ok, cuda);
  write_record("bn", j, o.json, o.plot);
  return ok ? 0 : 1;
}

}  // namespace dp::bench
