#include "engine/trainer.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
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
    // SA_RESTART: the handler only sets a flag, so a read or write on any thread (the signal may land
    // on a device worker) resumes instead of failing with EINTR.
    sa.sa_flags = SA_RESTART;
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
  // Everything written at the end is checked before training: an unwritable path must not cost a run.
  for (const std::string* p : {&o.save, &o.report, &o.trace}) {
    if (p->empty()) continue;
    auto dir = std::filesystem::path(*p).parent_path();
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::is_directory(dir, ec))
      throw UsageError(*p + ": the directory " + dir.string() + " does not exist");
    if (std::filesystem::is_directory(*p, ec)) throw UsageError(*p + ": is a directory; give a file name");
    // The files are written beside and renamed into place: probe exactly that.
    std::string probe = *p + ".tmp." + std::to_string(::getpid());
    int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) throw UsageError(*p + ": cannot write there: " + std::strerror(errno));
    ::close(fd);
    ::unlink(probe.c_str());
  }
}

// A float as text that reads back to the same bits (9 significant digits suffice for a float).
std::string exact(float v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", double(v));
  return b;
}

// What a checkpoint must agree on with the run that resumes it. The sample order of every later step
// is a function of (seed, epoch, shuffle, training set) and the position of (global step, steps per
// epoch = ceil(samples / batch)): any of these differing makes --resume a different run, so it is
// refused. The strategy, device count, split, buckets, backend and optimizer settings change only
// how the same steps are computed (float summation order) or deliberately change them (lr): those
// resume with a warning that the continuation is not bit-exact.
struct RunIdentity {
  std::vector<std::pair<std::string, std::string>> required, exact_only;  // checked in this order
};

RunIdentity identity(const TrainOptions& o, const Dataset& train_set, const std::string& backend, int devices) {
  const uint32_t labels_crc = uint32_t(crc32(0L, reinterpret_cast<const Bytef*>(train_set.labels.data()),
                                             uInt(train_set.labels.size() * sizeof(int32_t))));
  RunIdentity id;
  id.required = {{"seed", std::to_string(o.seed)},
                 {"shuffle", o.shuffle ? "1" : "0"},
                 {"batch", std::to_string(o.batch)},
                 {"train_samples", std::to_string(train_set.count)},
                 {"train_labels_crc32", std::to_string(labels_crc)}};
  id.exact_only = {{"sync", sync_name(o.sync)},
                   {"devices", std::to_string(devices)},
                   {"split", split_name(o.split)},
                   {"bucket_kb", std::to_string(o.bucket_kb)},
                   {"backend", backend},
                   {"lr", exact(o.lr)},
                   {"momentum", exact(o.momentum)},
                   {"weight_decay", exact(o.weight_decay)}};
  return id;
}

std::map<std::string, std::string> position(const RunIdentity& id, const TrainOptions& o, int64_t global_step,
                                            int64_t per_epoch) {
  std::map<std::string, std::string> m(id.required.begin(), id.required.end());
  m.insert(id.exact_only.begin(), id.exact_only.end());
  m["epoch"] = std::to_string(global_step / per_epoch);
  m["step_in_epoch"] = std::to_string(global_step % per_epoch);
  m["global_step"] = std::to_string(global_step);
  m["limit_train"] = std::to_string(o.limit_train);
  return m;
}

int64_t meta_int(const Checkpoint& c, const std::string& key, const std::string& path) {
  auto it = c.metadata.find(key);
  if (it == c.metadata.end()) throw UsageError(path + ": not a resumable checkpoint (no '" + key + "' in its metadata); use --load to start from its weights");
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

bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

const char* backend_name(const Device& d) { return d.kind() == DeviceKind::cuda ? "cuda" : "cpu"; }

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
  if (train_set.count == 0)
    throw UsageError(opt.data + ": the training set has no images (--limit-train keeps the first N of them)");

  DeviceSet devs = make_devices(opt.devices);
  std::vector<Device*> ptrs;
  for (auto& d : devs.devices) ptrs.push_back(d.get());
  const RunIdentity id = identity(opt, train_set, backend_name(*ptrs[0]), int(ptrs.size()));

  Checkpoint resume;
  int64_t global_step = 0;
  if (!opt.resume.empty()) {
    resume = load_checkpoint(opt.resume, spec);  // refuses another model
    global_step = meta_int(resume, "global_step", opt.resume);
    auto saved = [&](const std::string& key) {
      auto it = resume.metadata.find(key);
      return it == resume.metadata.end() ? std::string() : it->second;
    };
    auto describe = [](const std::string& key, const std::string& v, const std::string& limit) -> std::string {
      if (key == "train_samples") return "a training set of " + v + " samples (--limit-train " + limit + ")";
      if (key == "train_labels_crc32") return "training labels with CRC-32 " + v;
      if (key == "shuffle") return v == "1" ? "shuffling" : "--no-shuffle";
      return "--" + key + " " + v;
    };
    for (auto& [key, now] : id.required) {
      std::string then = saved(key);
      if (then.empty() || then == now) continue;  // an older checkpoint without the key: trust it
      throw UsageError(
          "--resume " + opt.resume + ": saved with " + describe(key, then, saved("limit_train")) +
          ", this run (--data " + opt.data + ") has " + describe(key, now, std::to_string(opt.limit_train)) +
          "; resuming would replay different samples, not continue the run (use --load to start afresh from its "
          "weights)");
    }
    std::string differs;
    for (auto& [key, now] : id.exact_only) {
      std::string then = saved(key);
      bool number = key == "lr" || key == "momentum" || key == "weight_decay";  // compared as floats: "0.1" is 0.1f
      if (then.empty() || then == now ||
          (number && std::strtof(then.c_str(), nullptr) == std::strtof(now.c_str(), nullptr)))
        continue;
      differs += (differs.empty() ? "" : ", ") + key + " " + then + " -> " + now;
    }
    if (!differs.empty())
      std::fprintf(stderr, "dp_train: warning: --resume %s: %s; the continuation is not guaranteed bit-exact\n",
                   opt.resume.c_str(), differs.c_str());
  }

  if (!opt.quiet) std::printf("%s\n", devs.notice.c_str());
  EngineConfig ec;
  // Buffers are sized for the largest batch a step will see: never more than the training set.
  ec.sync = opt.sync, ec.split = opt.split, ec.batch = int(std::min<int64_t>(opt.batch, train_set.count)),
  ec.lr = opt.lr;
  ec.momentum = opt.momentum, ec.weight_decay = opt.weight_decay, ec.bucket_kb = opt.bucket_kb,
  ec.trace = !opt.trace.empty();
  Engine engine(ptrs, spec, ec);
  // A device the split leaves without samples (batch < devices, or torch.chunk's trailing devices)
  // idles under scatter, as in nn.DataParallel; said once, for the full batch.
  if (!opt.quiet) {
    auto sizes = split_batch(ec.batch, engine.size(), opt.split);
    int idle = int(std::count(sizes.begin(), sizes.end(), 0));
    if (idle > 0)
      std::printf("note: a batch of %d over %d devices (--split %s) leaves %d device(s) without samples; %s\n", ec.batch,
                  engine.size(), split_name(opt.split), idle,
                  opt.sync == Sync::scatter ? "they idle in compute (as nn.DataParallel's unused devices do)"
                                            : "their shards are empty and they add zero gradients");
  }

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
  const int64_t start_epoch = global_step / per_epoch, start_step = global_step % per_epoch;
  const int64_t total_steps = opt.steps > 0 ? opt.steps : per_epoch * opt.epochs;
  const int epochs = int((total_steps + per_epoch - 1) / per_epoch);
  if (!opt.resume.empty() && !opt.quiet)
    std::printf("resuming from %s at step %lld (epoch %lld, step %lld of %lld)%s\n", opt.resume.c_str(),
                (long long)global_step, (long long)start_epoch + 1, (long long)start_step, (long long)per_epoch,
                global_step >= total_steps ? "; that is already the last step, nothing to train" : "");
  TrainResult result;
  Progress progress(!opt.quiet);
  SignalGuard signals;
  HostBatch batch;
  double train_seconds = 0;
  int64_t train_images = 0, verify_steps = 0;
  int64_t saved_step = -1;  // the step of the last checkpoint this run wrote

  // Called between steps only: Engine::step returns after every device has finished the optimizer,
  // so the replicas agree. params() and momentum() read device 0, which is the right source under
  // both strategies: under allreduce every replica holds the same bits (identical all-reduced
  // gradients, the same update everywhere); under scatter only device 0 runs the optimizer and
  // holds the weights and the momentum, the others get them by broadcast at the next step.
  // Weights that overflowed in the update (finite gradients times a huge --lr) are never written:
  // the previous checkpoint is kept instead. The position is the global step alone (epoch = step /
  // steps per epoch); identity() says what else must match to resume it.
  auto kept_checkpoint = [&]() -> std::string {
    if (saved_step >= 0)
      return "the last good checkpoint (step " + std::to_string(saved_step) + ") in " + opt.save + " is kept";
    std::error_code err;
    return std::filesystem::exists(opt.save, err) ? opt.save + " is left as it was" : "nothing was saved";
  };
  auto save = [&] {
    if (saved_step == global_step) return;
    Checkpoint c{engine.params(), engine.momentum(), position(id, opt, global_step, per_epoch)};
    if (!all_finite(c.params) || !all_finite(c.momentum))
      throw NumericalError("step " + std::to_string(global_step) +
                           ": the weights are no longer finite after the update; not saving them, " +
                           kept_checkpoint() + " (try a smaller --lr)");
    save_checkpoint(opt.save, spec, c);
    saved_step = global_step;
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
      // Checked before anything is saved: a bad step never reaches a checkpoint.
      std::string layer = engine.first_nonfinite_gradient();
      if (!std::isfinite(r.loss) || !layer.empty()) {
        progress.clear();
        std::string kept = opt.save.empty() ? "" : ", " + kept_checkpoint();
        throw NumericalError(
            "step " + std::to_string(global_step) + " (epoch " + std::to_string(epoch + 1) + "): non-finite " +
            (std::isfinite(r.loss) ? std::string("gradients") : "loss (" + std::to_string(r.loss) + ")") +
            (layer.empty() ? std::string() : "; the first layer with a non-finite gradient is " + layer) +
            "; training stopped" + kept + " (try a smaller --lr)");
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
