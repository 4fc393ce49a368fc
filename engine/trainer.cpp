#include "engine/trainer.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "engine/checkpoint.h"
#include "engine/data.h"
#include "engine/error.h"
#include "engine/report.h"

namespace dp {

// Where two runs differ only in the order a gradient element's B per-sample contributions c_j are
// summed (one device vs several, ring vs reduce-to-root), each ordering's rounding error is at most
// (B - 1) u sum_j |c_j| (u = 2^-24, Higham's bound for recursive summation). With the mean loss,
// c_j = per-sample gradient / B and LeNet's per-sample gradients are O(1) (inputs in [0, 1],
// |dlogits| <= 1), so sum_j |c_j| <= 1 and a gradient element differs by at most 2 B u between two
// orders. Momentum carries the step-k error into every later step with weight
// 1 + mu + ... + mu^(j-k); the weight change is lr times that. Summed over K steps, doubled for the
// dynamics (the gradient depends on weights that already differ), that is the bound below.
double summation_tolerance(int64_t steps, int batch, float lr, float momentum) {
  const double u = std::ldexp(1.0, -24);
  double carried = 0;
  for (int64_t k = 0; k < steps; ++k) {
    double geometric = 0, p = 1;
    for (int64_t j = 0; j <= k; ++j, p *= momentum) geometric += p;
    carried += geometric;
  }
  return 2.0 * (2.0 * batch * u) * lr * carried;
}

namespace {

std::atomic<int> g_signal{0};  // the one process-wide flag: set by the handler, read between steps

extern "C" void on_signal(int sig) {
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // a second signal: leave at once
}

struct SignalGuard {
  struct sigaction old_int {}, old_term {};
  SignalGuard() {
    g_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

// The host side of one batch: rows gathered from the data set in epoch order.
struct HostBatch {
  std::vector<float> x;    // (B, D)
  std::vector<int32_t> y;  // (B)
  int n = 0;
  void fill(const Dataset& d, const std::vector<int64_t>& order, int64_t first, int count) {
    const int64_t D = d.image_size();
    x.resize(size_t(count * D));
    y.resize(size_t(count));
    for (int i = 0; i < count; ++i) {
      int64_t s = order[size_t(first + i)];
      std::copy_n(d.images.begin() + s * D, D, x.begin() + i * D);
      y[i] = d.labels[s];
    }
    n = count;
  }
};

class Progress {
 public:
  Progress(bool enabled) : tty_(enabled && isatty(fileno(stderr))) {}
  void update(int epoch, int epochs, int64_t done, int64_t total, double loss) {
    if (!tty_) return;
    const int width = 30;
    int filled = total > 0 ? int(width * done / total) : width;
    std::fprintf(stderr, "\repoch %d/%d [%s%s] %lld/%lld loss %.4f", epoch, epochs, std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), (long long)done, (long long)total, loss);
    std::fflush(stderr);
  }
  void clear() {
    if (tty_) std::fprintf(stderr, "\r%80s\r", "");
  }

 private:
  bool tty_;
};

void check_options(const TrainOptions& o) {
  if (o.batch <= 0) throw UsageError("--batch: " + std::to_string(o.batch) + " is not a batch size; give a positive number of images, e.g. 256");
  if (o.epochs <= 0 && o.steps <= 0) throw UsageError("--epochs: must be at least 1 (or give --steps)");
  if (o.steps < 0) throw UsageError("--steps: must be positive");
  if (!std::isfinite(o.lr) || o.lr <= 0) throw UsageError("--lr: must be a positive finite number, e.g. 0.1");
  if (!std::isfinite(o.momentum) || o.momentum < 0 || o.momentum >= 1) throw UsageError("--momentum: must be in [0, 1)");
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) throw UsageError("--weight-decay: must be >= 0");
  if (o.limit_train < 0 || o.limit_test < 0) throw UsageError("--limit-train/--limit-test: must be >= 0 (0 keeps every sample)");
  if (o.bucket_kb < 0) throw UsageError("--bucket-kb: must be >= 0 (0: one all-reduce after backward)");
  if (o.bucket_kb > 0 && o.sync != Sync::allreduce) throw UsageError("--bucket-kb: buckets are an all-reduce feature; add --sync allreduce");
  if (o.save_every < 0) throw UsageError("--save-every: must be >= 0");
  if (o.save_every > 0 && o.save.empty()) throw UsageError("--save-every: needs --save FILE to say where");
  for (const std::string* p : {&o.save, &o.report, &o.trace}) {
    if (p->empty()) continue;
    auto dir = std::filesystem::path(*p).parent_path();
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::is_directory(dir, ec))
      throw UsageError(*p + ": the directory " + dir.string() + " does not exist");
  }
}

std::map<std::string, std::string> position(const TrainOptions& o, int64_t epoch, int64_t step_in_epoch, int64_t global_step,
                                            int devices) {
  return {{"epoch", std::to_string(epoch)},
          {"step_in_epoch", std::to_string(step_in_epoch)},
          {"global_step", std::to_string(global_step)},
          {"seed", std::to_string(o.seed)},
          {"shuffle", o.shuffle ? "1" : "0"},
          {"batch", std::to_string(o.batch)},
          {"sync", sync_name(o.sync)},
          {"split", split_name(o.split)},
          {"devices", std::to_string(devices)},
          {"lr", std::to_string(o.lr)},
          {"momentum", std::to_string(o.momentum)},
          {"weight_decay", std::to_string(o.weight_decay)}};
}

int64_t meta_int(const Checkpoint& c, const std::string& key, const std::string& path) {
  auto it = c.metadata.find(key);
  if (it == c.metadata.end()) throw UsageError(path + ": not a resumable checkpoint (no '" + key + "' in its metadata); use --load to start from its weights");
  try {
    return std::stoll(it->second);
  } catch (...) {
    throw UsageError(path + ": metadata '" + key + "' is not a number");
  }
}

}  // namespace

TrainResult train(const TrainOptions& opt) {
  check_options(opt);
  if (!opt.load.empty() && !opt.resume.empty()) throw UsageError("--load and --resume: give one (--resume also restores the optimizer and position)");
  ModelSpec spec = make_model(opt.model);
  Dataset train_set = load_idx(opt.data, "train", opt.limit_train, spec.classes);
  Dataset test_set = load_idx(opt.data, "t10k", opt.limit_test, spec.classes);
  if (train_set.rows != spec.in_h || train_set.cols != spec.in_w)
    throw UsageError(opt.data + ": images are " + std::to_string(train_set.rows) + "x" + std::to_string(train_set.cols) + ", " +
                     spec.name + " takes 28x28");
  Checkpoint resume;
  int64_t start_epoch = 0, start_step = 0, global_step = 0;
  if (!opt.resume.empty()) {
    resume = load_checkpoint(opt.resume, spec);
    global_step = meta_int(resume, "global_step", opt.resume);
    if (global_step < 0) throw UsageError(opt.resume + ": negative global_step in its metadata");
    auto same = [&](const std::string& key, const std::string& now, const char* flag) {
      auto it = resume.metadata.find(key);
      if (it != resume.metadata.end() && it->second != now)
        throw UsageError(opt.resume + ": saved with " + flag + " " + it->second + ", this run has " + now +
                         "; exact resume needs the same value");
    };
    same("seed", std::to_string(opt.seed), "--seed");
    same("batch", std::to_string(opt.batch), "--batch");
    same("shuffle", opt.shuffle ? "1" : "0", "shuffle (--no-shuffle)");
  }

  DeviceSet devs = make_devices(opt.devices);
  if (!opt.quiet) std::printf("%s\n", devs.notice.c_str());
  std::vector<Device*> ptrs;
  for (auto& d : devs.devices) ptrs.push_back(d.get());
  EngineConfig ec;
  ec.sync = opt.sync, ec.split = opt.split, ec.batch = opt.batch, ec.lr = opt.lr, ec.momentum = opt.momentum;
  ec.weight_decay = opt.weight_decay, ec.bucket_kb = opt.bucket_kb, ec.trace = !opt.trace.empty();
  Engine engine(ptrs, spec, ec);
  if (!opt.quiet && opt.sync == Sync::scatter && opt.batch < engine.size())
    std::printf("note: batch %d is smaller than the %d devices; under scatter the devices without samples idle\n", opt.batch, engine.size());

  std::vector<float> init(size_t(spec.param_count));
  if (!opt.resume.empty()) {
    init = resume.params;
  } else if (!opt.load.empty()) {
    init = load_checkpoint(opt.load, spec).params;
  } else {
    init_params(spec, opt.seed, init.data());
  }
  engine.set_params(init);
  if (!resume.momentum.empty()) engine.set_momentum(resume.momentum);

  // --verify: the same steps on one device with the full batch, alongside.
  DeviceSet ref_devs;
  std::unique_ptr<Engine> ref;
  if (opt.verify) {
    DeviceConfig rc = opt.devices;
    rc.ids = {opt.devices.ids.at(0)};
    ref_devs = make_devices(rc);
    EngineConfig rec = ec;
    rec.sync = Sync::allreduce, rec.bucket_kb = 0, rec.trace = false;
    ref = std::make_unique<Engine>(std::vector<Device*>{ref_devs.devices[0].get()}, spec, rec);
    ref->set_params(init);
    if (!resume.momentum.empty()) ref->set_momentum(resume.momentum);
  }

  const int64_t per_epoch = (train_set.count + opt.batch - 1) / opt.batch;
  start_epoch = global_step / per_epoch;
  start_step = global_step % per_epoch;
  const int64_t total_steps = opt.steps > 0 ? opt.steps : per_epoch * opt.epochs;
  const int epochs = int((total_steps + per_epoch - 1) / per_epoch);
  TrainResult result;
  Progress progress(!opt.quiet);
  SignalGuard signals;
  HostBatch batch;
  double train_seconds = 0;
  int64_t train_images = 0, verify_steps = 0;

  // The position is derived from the global step: epoch = step / steps per epoch.
  auto save = [&] {
    Checkpoint c{engine.params(), engine.momentum(),
                 position(opt, global_step / per_epoch, global_step % per_epoch, global_step, engine.size())};
    save_checkpoint(opt.save, spec, c);
  };

  for (int64_t epoch = start_epoch; epoch < epochs && global_step < total_steps; ++epoch) {
    auto order = epoch_order(train_set.count, opt.seed, epoch, opt.shuffle);
    EpochRecord rec;
    rec.epoch = int(epoch) + 1;
    double loss_sum = 0;
    int64_t correct = 0;
    auto t0 = std::chrono::steady_clock::now();
    int64_t first_step = epoch == start_epoch ? start_step : 0;
    for (int64_t s = first_step; s < per_epoch && global_step < total_steps; ++s) {
      int64_t first = s * opt.batch;
      int n = int(std::min<int64_t>(opt.batch, train_set.count - first));
      batch.fill(train_set, order, first, n);
      StepResult r = engine.step(batch.x.data(), batch.y.data(), n);
      if (ref) {
        ref->step(batch.x.data(), batch.y.data(), n);
        ++verify_steps;
      }
      ++global_step;
      if (!std::isfinite(r.loss) || !engine.first_nonfinite_gradient().empty()) {
        progress.clear();
        std::string layer = engine.first_nonfinite_gradient();
        throw NumericalError("step " + std::to_string(global_step) + " (epoch " + std::to_string(epoch + 1) + "): non-finite " +
                             (std::isfinite(r.loss) ? std::string("gradients") : "loss (" + std::to_string(r.loss) + ")") +
                             (layer.empty() ? std::string() : "; the first layer with a non-finite gradient is " + layer) +
                             "; training stopped" + (opt.save.empty() ? "" : ", the last good checkpoint " + opt.save + " is kept") +
                             " (try a smaller --lr)");
      }
      loss_sum += r.loss * r.n;
      correct += r.correct;
      rec.images += r.n;
      rec.steps++;
      progress.update(rec.epoch, epochs, s + 1, per_epoch, loss_sum / double(rec.images));
      if (opt.save_every > 0 && global_step % opt.save_every == 0) save();
      if (int sig = g_signal.load()) {
        progress.clear();
        std::string what = std::string(sig == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)") + " after step " +
                           std::to_string(global_step);
        if (!opt.save.empty()) {
          save();
          what += "; checkpoint saved to " + opt.save + " (continue with --resume " + opt.save + ")";
        } else {
          what += "; no --save given, nothing saved";
        }
        throw Interrupted(sig, what);
      }
    }
    rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    train_seconds += rec.seconds;
    train_images += rec.images;
    rec.train_loss = rec.images ? loss_sum / double(rec.images) : 0;
    rec.train_accuracy = rec.images ? double(correct) / double(rec.images) : 0;
    rec.images_per_second = rec.seconds > 0 ? double(rec.images) / rec.seconds : 0;
    StepResult t = engine.evaluate(test_set.images.data(), test_set.labels.data(), int(test_set.count));
    rec.test_loss = t.loss;
    rec.test_accuracy = test_set.count ? double(t.correct) / double(test_set.count) : 0;
    progress.clear();
    if (!opt.quiet)
      std::printf("epoch %d/%d  train loss %.4f  train acc %.4f  test acc %.4f  %.0f img/s  %.1f s\n", rec.epoch, epochs, rec.train_loss,
                  rec.train_accuracy, rec.test_accuracy, rec.images_per_second, rec.seconds);
    std::fflush(stdout);
    result.epochs.push_back(rec);
  }
  if (!result.epochs.empty()) {
    result.train_loss = result.epochs.back().train_loss;
    result.test_accuracy = result.epochs.back().test_accuracy;
  }
  result.images_per_second = train_seconds > 0 ? double(train_images) / train_seconds : 0;

  if (ref) {
    auto a = engine.params(), b = ref->params();
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
    result.verify_max_diff = worst;
    result.verify_tolerance = summation_tolerance(verify_steps, opt.batch, opt.lr, opt.momentum);
    result.verify_ok = worst <= result.verify_tolerance;
    std::printf("verify: largest weight difference from 1 device after %lld steps: %.3g (tolerance %.3g) %s\n", (long long)verify_steps, worst,
                result.verify_tolerance, result.verify_ok ? "ok" : "FAILED");
  }
  if (!opt.quiet) std::printf("%s", device_table(engine).c_str());
  if (!opt.save.empty()) {
    save();
    if (!opt.quiet) std::printf("saved %s\n", opt.save.c_str());
  }
  if (!opt.report.empty()) {
    nlohmann::json cfg = {{"model", opt.model}, {"batch", opt.batch}, {"epochs", epochs}, {"steps", total_steps}, {"lr", opt.lr},
                          {"momentum", opt.momentum}, {"weight_decay", opt.weight_decay}, {"seed", opt.seed}, {"shuffle", opt.shuffle},
                          {"data", opt.data}, {"limit_train", opt.limit_train}, {"limit_test", opt.limit_test},
                          {"backend", opt.devices.backend}, {"gpus", opt.devices.ids}, {"threads_per_device", devs.threads_per_device},
                          {"strategy", sync_name(opt.sync)}, {"split", split_name(opt.split)}, {"bucket_kb", opt.bucket_kb},
                          {"parameters", spec.param_count}};
    nlohmann::json epochs_json = nlohmann::json::array();
    for (auto& e : result.epochs)
      epochs_json.push_back({{"epoch", e.epoch}, {"steps", e.steps}, {"images", e.images}, {"train_loss", e.train_loss},
                             {"train_accuracy", e.train_accuracy}, {"test_loss", e.test_loss}, {"test_accuracy", e.test_accuracy},
                             {"seconds", e.seconds}, {"images_per_second", e.images_per_second}});
    nlohmann::json j = {{"config", cfg},
                        {"strategy", sync_name(opt.sync)},
                        {"split", split_name(opt.split)},
                        {"bucket_kb", opt.bucket_kb},
                        {"epochs", epochs_json},
                        {"train_loss", result.train_loss},
                        {"test_accuracy", result.test_accuracy},
                        {"images_per_second", result.images_per_second},
                        {"devices", device_report(engine)}};
    if (ref) j["verify"] = {{"max_abs_diff", result.verify_max_diff}, {"tolerance", result.verify_tolerance}, {"ok", result.verify_ok}};
    write_json(opt.report, j);
  }
  if (!opt.trace.empty()) write_json(opt.trace, trace_json(engine));
  return result;
}

}  // namespace dp
