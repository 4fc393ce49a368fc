// The training loop: an epoch at a time, a step at a time, as a PyTorch script writes it. What
// surrounds the loop lives beside it: options and data here, resuming and saving in resume.cpp,
// --verify in verify.cpp, the progress line and signals in progress.cpp, the record in report.cpp.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "train/data.h"
#include "engine/error.h"
#include "engine/failpoint.h"
#include "train/job.h"
#include "train/loader.h"
#include "train/log.h"
#include "train/paths.h"
#include "train/progress.h"
#include "train/report.h"
#include "train/resume.h"
#include "train/trace.h"

namespace dp {
namespace {

// lead: this process writes the outputs (rank 0 of a job, or the only process).
void check_options(const TrainOptions& o, bool lead = true) {
  if (o.batch <= 0)
    throw UsageError("--batch: " + std::to_string(o.batch) +
                     " is not a batch size; give a positive number of images, e.g. 256");
  if (o.epochs <= 0 && o.steps <= 0) throw UsageError("--epochs: must be at least 1 (or give --steps)");
  if (o.steps < 0) throw UsageError("--steps: must be positive");
  if (!std::isfinite(o.lr) || o.lr <= 0) throw UsageError("--lr: must be a positive finite number, e.g. 0.1");
  if (!std::isfinite(o.momentum) || o.momentum < 0 || o.momentum >= 1)
    throw UsageError("--momentum: must be in [0, 1)");
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) throw UsageError("--weight-decay: must be >= 0");
  if (o.limit_train < 0 || o.limit_test < 0)
    throw UsageError("--limit-train/--limit-test: must be >= 0 (0 keeps every sample)");
  if (o.workers < 0)
    throw UsageError("--workers: " + std::to_string(o.workers) +
                     " is not a number of loader threads; give 0 (each batch assembled between steps) or 1");
  if (o.workers > kMaxWorkers)
    throw UsageError("--workers: " + std::to_string(o.workers) +
                     " loader threads would be no faster than 1: a batch is a gather from the data set in memory, "
                     "which one thread assembles well within a step; give 0 or 1");
  if (o.bucket_kb < 0) throw UsageError("--bucket-kb: must be >= 0 (0: one all-reduce after backward)");
  if (o.bucket_kb > 0 && !find_strategy(o.sync).takes_buckets())
    throw UsageError("--bucket-kb: buckets are an all-reduce feature; add --sync allreduce");
  if (o.save_every < 0) throw UsageError("--save-every: must be >= 0");
  if (o.save_every > 0 && o.save.empty()) throw UsageError("--save-every: needs --save FILE to say where");
  if (o.log_every < 1)
    throw UsageError("--log-every: " + std::to_string(o.log_every) + " is not a step count; give at least 1");
  // Everything written at the end is checked before training: an unwritable path must not cost a run,
  // and no output may destroy another output or an input.
  if (lead) check_output_paths(o);
  if (!o.load.empty() && !o.resume.empty())
    throw UsageError("--load and --resume: give one (--resume also restores the optimizer and position)");
}

// How long the run is, in steps. The position is the global step alone: epoch global_step / per_epoch,
// step global_step % per_epoch within it.
struct Schedule {
  int64_t per_epoch = 0, total_steps = 0;
  int epochs = 0;
};

// No product or sum here can overflow: per_epoch <= train_count < 2^32 and epochs < 2^31, so
// per_epoch * epochs < 2^63; the epoch count is a quotient, checked against the int the epoch
// records and the report count in.
Schedule schedule(const TrainOptions& o, int64_t train_count) {
  Schedule s;
  s.per_epoch = train_count / o.batch + (train_count % o.batch != 0);
  s.total_steps = o.steps > 0 ? o.steps : s.per_epoch * o.epochs;
  const int64_t epochs = s.total_steps / s.per_epoch + (s.total_steps % s.per_epoch != 0);
  if (epochs > std::numeric_limits<int>::max())
    throw UsageError("--steps: " + std::to_string(s.total_steps) + " steps of " + std::to_string(s.per_epoch) +
                     " per epoch are " + std::to_string(epochs) + " epochs, more than the " +
                     std::to_string(std::numeric_limits<int>::max()) + " a run can count; give fewer steps");
  s.epochs = int(epochs);
  return s;
}

struct DataSets {
  Dataset train, test;
};

// Either set, each held to the same checks: the model's image size and label range.
Dataset load_set(const TrainOptions& o, const ModelSpec& spec, const char* prefix, int64_t limit) {
  return load_idx(o.data, prefix, limit, spec.classes, ImageShape{spec.in_h, spec.in_w, spec.name});
}

DataSets load_data(const TrainOptions& o, const ModelSpec& spec) {
  DataSets d{load_set(o, spec, "train", o.limit_train), load_set(o, spec, "t10k", o.limit_test)};
  if (d.train.count == 0)
    throw UsageError(o.data + ": the training set has no images (--limit-train keeps the first N of them)");
  return d;
}

EngineConfig engine_config(const TrainOptions& o, int64_t train_count) {
  EngineConfig ec;
  // Buffers are sized for the largest batch a step will see: never more than the training set.
  ec.sync = o.sync, ec.split = o.split, ec.batch = int(std::min<int64_t>(o.batch, train_count)), ec.lr = o.lr;
  ec.momentum = o.momentum, ec.weight_decay = o.weight_decay, ec.bucket_kb = o.bucket_kb, ec.trace = !o.trace.empty();
  ec.sync_bn = o.sync_bn;
  ec.all_reduce = o.all_reduce;
  ec.timeout = o.timeout;
  ec.prefetch = o.prefetch && !o.eval;  // --eval stages nothing
  return ec;
}

// BatchNorm in training divides by the count's variance less one: a replica normalising one sample
// (PyTorch: "Expected more than 1 value per channel when training") is refused before any step, for
// the full batch and, where the run gets there, the epoch's last, smaller one. With --sync-bn only
// the global batch counts.
void check_batchnorm(const TrainOptions& o, const ModelSpec& spec, const Schedule& plan, int64_t train_count,
                     int devices) {
  if (o.sync_bn && !spec.has_batchnorm())
    throw UsageError("--sync-bn: model " + spec.name + " has no BatchNorm; the model with BatchNorm is lenet-bn");
  if (!spec.has_batchnorm() || o.eval) return;
  if (o.verify && !o.sync_bn && devices > 1)
    throw UsageError(
        "--verify: with BatchNorm each of the " + std::to_string(devices) +
        " devices normalises its own samples, which one device on the full batch does not: the runs differ by "
        "more than summation order. Add --sync-bn (then they match), or run --verify on one device");
  const int64_t batch = std::min<int64_t>(o.batch, train_count);
  const int64_t last = plan.total_steps >= plan.per_epoch ? train_count % batch : 0;
  for (int64_t b : {batch, last}) {
    if (b == 0) continue;
    const std::string which = (b == batch ? "a batch of " : "the epoch's last batch of ") + std::to_string(b);
    const auto sizes = split_batch(int(b), o.sync_bn ? 1 : devices, o.split);  // --sync-bn: the global batch
    for (size_t d = 0; d < sizes.size(); ++d)
      if (sizes[d] == 1)
        throw UsageError("--model " + spec.name + ": " + which +
                         (sizes.size() > 1 ? " over " + std::to_string(devices) + " devices gives device " +
                                                 std::to_string(d) + " a shard of 1 sample"
                                           : (b == 1 ? " sample" : "")) +
                         ", and BatchNorm needs more than 1 value per channel in training; give a --batch or "
                         "--limit-train that leaves " +
                         (sizes.size() > 1 ? "every device 0 or at least 2 samples, or add --sync-bn (statistics "
                                             "over the global batch)"
                                           : "at least 2 samples in every batch"));
  }
}

std::vector<Device*> pointers(const DeviceSet& set) {
  std::vector<Device*> out;
  for (auto& d : set.devices) out.push_back(d.get());
  return out;
}

// A device the split leaves without samples (batch < devices, or torch.chunk's trailing devices)
// idles under scatter, as in nn.DataParallel; said once, for the full batch.
void note_idle_devices(const TrainOptions& o, int batch, int devices) {
  auto sizes = split_batch(batch, devices, o.split);
  int idle = int(std::count(sizes.begin(), sizes.end(), 0));
  if (idle > 0)
    std::printf("note: a batch of %d over %d devices (--split %s) leaves %d device(s) without samples; %s\n", batch,
                devices, split_name(o.split), idle,
                find_strategy(o.sync).idle_device());
}

// Sizes past what the data holds are clamped, as a user asking for "at most N" expects, and said.
void note_clamped_sizes(const TrainOptions& o, const DataSets& d) {
  auto more_than = [&](const std::string& flag, int64_t asked, int64_t count, const std::string& images) {
    std::printf("note: %s %lld is more than the %lld %s; %s\n", flag.c_str(), (long long)asked, (long long)count,
                images.c_str(), flag == "--batch" ? "every step trains on all of them" : "all of them are used");
  };
  const std::string in = " images in " + o.data;
  if (o.limit_train > d.train.count) more_than("--limit-train", o.limit_train, d.train.count, "training" + in);
  if (o.limit_test > d.test.count) more_than("--limit-test", o.limit_test, d.test.count, "test" + in);
  if (o.batch > d.train.count)
    more_than("--batch", o.batch, d.train.count,
              o.limit_train == d.train.count ? "training images --limit-train keeps" : "training" + in);
}

// --resume's weights (with momentum), --load's, or fresh ones drawn from --seed, with BatchNorm's
// running statistics.
Checkpoint initial_state(const TrainOptions& o, const ModelSpec& spec, const Resumed& resumed) {
  if (!o.resume.empty()) return resumed.checkpoint;
  Checkpoint init;
  if (!o.load.empty()) {
    init = load_checkpoint(o.load, spec);
    init.momentum.clear();  // --load starts the optimizer afresh
    if (!init.note.empty() && !o.quiet) std::printf("note: %s\n", init.note.c_str());
    return init;
  }
  init.params.resize(size_t(spec.param_count));
  init_params(spec, o.seed, init.params.data());
  init.buffers.resize(size_t(spec.buffer_count));
  init_buffers(spec, init.buffers.data());
  return init;
}

// A state (weights, momentum, running statistics) onto every replica.
void place(Engine& engine, const Checkpoint& state) {
  engine.set_params(state.params);
  if (!state.momentum.empty()) engine.set_momentum(state.momentum);
  engine.set_running_stats(state.buffers);
  engine.set_batches_tracked(state.batches_tracked);
}

void print_resuming(const TrainOptions& o, const Schedule& s, int64_t global_step) {
  std::printf("resuming from %s at step %lld (epoch %lld, step %lld of %lld)%s\n", o.resume.c_str(),
              (long long)global_step, (long long)(global_step / s.per_epoch) + 1,
              (long long)(global_step % s.per_epoch), (long long)s.per_epoch,
              global_step >= s.total_steps ? "; that is already the last step, nothing to train" : "");
}

// An epoch's running sums, and its record once the last step is in; the clock runs from construction.
class EpochMeter {
 public:
  explicit EpochMeter(int epoch) { rec_.epoch = epoch; }
  void add(const StepResult& r) {
    loss_sum_ += r.loss * r.n;
    correct_ += r.correct;
    rec_.images += r.n;
    rec_.steps++;
  }
  int epoch() const { return rec_.epoch; }
  double loss() const { return loss_sum_ / double(rec_.images); }
  EpochRecord finish() {
    rec_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    rec_.train_loss = rec_.images ? loss_sum_ / double(rec_.images) : 0;
    rec_.train_accuracy = rec_.images ? double(correct_) / double(rec_.images) : 0;
    rec_.images_per_second = rec_.seconds > 0 ? double(rec_.images) / rec_.seconds : 0;
    return rec_;
  }

 private:
  EpochRecord rec_;
  double loss_sum_ = 0;
  int64_t correct_ = 0;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// An empty test set (a valid t10k file with no images) has no accuracy: NaN, which the report writes
// as null and the epoch line as "n/a".
// Across processes each process evaluates its slice of the set and the sums are added up.
void evaluate(Engine& engine, const Dataset& test_set, EpochRecord& rec, ProcessGroup* group = nullptr) {
  if (test_set.count == 0) {
    rec.test_loss = rec.test_accuracy = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  const auto [lo, hi] =
      group ? evaluation_slice(*group, test_set.count) : std::pair<int64_t, int64_t>{0, test_set.count};
  StepResult t =
      engine.evaluate(test_set.images.data() + lo * test_set.image_size(), test_set.labels.data() + lo, int(hi - lo));
  if (group) reduce_evaluation(*group, t, test_set.count, engine.config().timeout);
  rec.test_loss = t.loss;
  rec.test_accuracy = double(t.correct) / double(test_set.count);
}

void print_epoch(const EpochRecord& rec, int epochs) {
  char test[48] = "n/a (empty test set)";
  if (!std::isnan(rec.test_accuracy)) std::snprintf(test, sizeof test, "%.4f", rec.test_accuracy);
  std::printf("epoch %d/%d  train loss %.4f  train acc %.4f  test acc %s  %.0f img/s  %.1f s\n", rec.epoch, epochs,
              rec.train_loss, rec.train_accuracy, test, rec.images_per_second, rec.seconds);
}

// What went wrong in a step whose loss or gradients are not finite; "" for a good step. The check
// came back with the step's loss (StepResult::finite_gradients); only a bad step looks for the layer.
std::string nonfinite_step(const StepResult& r, Engine& engine, int64_t global_step, int64_t epoch) {
  if (std::isfinite(r.loss) && r.finite_gradients) return "";
  std::string layer = engine.first_nonfinite_gradient();
  return "step " + std::to_string(global_step) + " (epoch " + std::to_string(epoch + 1) + "): non-finite " +
         (std::isfinite(r.loss) ? std::string("gradients") : "loss (" + std::to_string(r.loss) + ")") +
         (layer.empty() ? std::string() : "; the first layer with a non-finite gradient is " + layer);
}

// One run between its setup and its return: the loop, and the outputs written after the last step,
// with a safe point for signals between any two of them. A signal stops the run at the next safe
// point: the weights of a finished step are saved (--save), the outputs not yet written are skipped,
// and Interrupted says what was and was not written.
class Run {
 public:
  Run(const TrainOptions& o, const Schedule& plan, Engine& engine, CheckpointSaver& saver, SignalGuard& signals,
      TrainLog* log, int64_t step, ProcessGroup* group)
      : o_(o),
        plan_(plan),
        engine_(engine),
        saver_(saver),
        signals_(signals),
        log_(log),
        first_step_(step),
        step_(step),
        group_(group) {
    signals_.kept(kept());
  }

  // stdout can go away (a closed pipe: dp_train | head); a write then fails with EPIPE, SIGPIPE being
  // ignored (dp_train.cpp), and the run stops printing but trains, saves and reports as asked.
  bool speak() const { return !o_.quiet && !std::ferror(stdout); }
  void epochs(const DataSets& data, Verifier* verify, TrainResult& result);
  // The checkpoint of the current step, once; across processes rank 0 writes it and every process
  // waits for it (a barrier), so none runs ahead of a checkpoint that may yet fail.
  void save() {
    signals_.stage(Stage::save);
    if (lead()) io([&] { saver_.save(engine_, step_); });
    if (group_) group_->barrier(Deadline::after(o_.timeout), "the barrier after rank 0's checkpoint");
    signals_.kept(kept());
  }
  bool lead() const { return !group_ || group_->rank() == 0; }
  // The report or the trace: written, then a safe point.
  void output(Stage p, const std::function<void()>& write) {
    signals_.stage(p);
    failpoint::at(p == Stage::report ? "report" : "trace");
    io(write);
    (p == Stage::report ? report_written_ : trace_written_) = true;
    stop_if_signalled();
  }
  // Across processes only the signal the step's collective agreed on counts, so that every process
  // stops after the same step.
  void stop_if_signalled() {
    if (int sig = group_ ? agreed_signal_ : signals_.pending()) throw interrupted(sig);
  }

 private:
  // An I/O error while a signal is pending names both; the exit stays 1, a failed write's.
  void io(const std::function<void()>& work) {
    try {
      work();
    } catch (const IoError& e) {
      if (int sig = signals_.pending())
        throw IoError(std::string(e.what()) + "; " + describe_signal(sig) + " " + position() +
                      ", and this write failed; " + kept());
      throw;
    }
  }
  std::string position() const {
    if (step_ == first_step_) return "before the first step";
    return step_ >= plan_.total_steps ? "after the last step (step " + std::to_string(step_) + ")"
                                      : "after step " + std::to_string(step_);
  }
  std::string kept() const { return o_.save.empty() ? "no checkpoint saved (no --save given)" : saver_.kept(); }
  Interrupted interrupted(int sig);
  const HostBatch& next_batch(BatchLoader& loader, int64_t step);

  const TrainOptions& o_;
  const Schedule& plan_;
  Engine& engine_;
  CheckpointSaver& saver_;
  SignalGuard& signals_;
  TrainLog* log_;  // null without --log
  int64_t first_step_, step_;
  bool report_written_ = false, trace_written_ = false;
  double load_wait_us_ = 0;
  ProcessGroup* group_;    // null in one process
  int agreed_signal_ = 0;  // across processes: the largest signal pending on any process after a step
};

// The batch of `step` (0-based), and the trainer's wait for it: the report's load_wait_seconds and,
// when tracing, a "load wait" span on the host lane per batch (with --workers 0 the wait is the
// batch's assembly).
const HostBatch& Run::next_batch(BatchLoader& loader, int64_t step) {
  const double start_us = engine_.recorder().now_us();
  const HostBatch& batch = loader.next();
  const double end_us = engine_.recorder().now_us();
  load_wait_us_ += end_us - start_us;
  if (engine_.config().trace) engine_.recorder().host_span("load wait", start_us, end_us, {{"step", double(step + 1)}});
  if (batch.step != step)  // the loader and the loop walk the same plan; a mismatch is a bug here
    throw std::logic_error("loader: batch of step " + std::to_string(batch.step) + " for step " + std::to_string(step));
  return batch;
}

// Saves the finished step's weights unless nothing was trained, then names what is written and not.
Interrupted Run::interrupted(int sig) {
  std::string what = describe_signal(sig) + " " + position();
  if (step_ == first_step_)
    what += "; nothing trained, nothing saved";
  else if (o_.save.empty())
    what += "; " + kept();
  else {
    save();
    what += "; checkpoint saved to " + o_.save;
    if (step_ < plan_.total_steps) what += " (continue with --resume " + o_.save + ")";
  }
  std::vector<std::string> skipped;
  for (auto [name, path, written] :
       {std::tuple{"report", &o_.report, report_written_}, {"trace", &o_.trace, trace_written_}}) {
    if (path->empty()) continue;
    if (written)
      what += std::string("; ") + name + " written to " + *path;
    else
      skipped.push_back(std::string(name) + " " + *path);
  }
  if (!skipped.empty()) what += "; " + skipped[0] + (skipped.size() > 1 ? " and " + skipped[1] : "") + " not written";
  if (log_) {  // its records are on disk as they come; the steps since the last one get theirs now
    io([&] { log_->flush(engine_.recorder().phase_seconds()); });
    what += "; log " + log_->path() +
            (log_->last_step() > 0 ? " kept up to step " + std::to_string(log_->last_step()) : " has no step records");
  }
  return Interrupted(sig, what);
}

void summarize(TrainResult& result) {
  double seconds = 0;
  int64_t images = 0;
  for (const EpochRecord& e : result.epochs) seconds += e.seconds, images += e.images;
  if (!result.epochs.empty()) {
    result.train_loss = result.epochs.back().train_loss;
    result.test_accuracy = result.epochs.back().test_accuracy;
  }
  result.images_per_second = seconds > 0 ? double(images) / seconds : 0;
}

// The epochs, a step at a time: after every step and every epoch's evaluation, a safe point.
void Run::epochs(const DataSets& data, Verifier* verify, TrainResult& result) {
  Progress progress(!o_.quiet);  // cleared when this returns or throws
  // Its thread is joined when this returns or throws, after at most the batch it is filling.
  LoaderPlan lp{o_.batch, plan_.per_epoch, step_, plan_.total_steps, o_.seed, o_.shuffle, {}, {}};
  // Across processes, this process's rows only; but rank 0 under --verify (the one process with a
  // Verifier) loads the whole batch for the reference, of which its engine's rows are the first
  // (Engine::slice starts at row 0 on rank 0).
  if (group_ && !verify) lp.rows = [this](int n) { return engine_.slice(n); };
  lp.pin = [this](void* p, size_t bytes) { return engine_.pin_host(p, bytes); };
  // With prefetch the next step's batch is staged (its upload started) before this step trains, so
  // the trainer holds two batches: this step's (which --verify reads after the step) and the next.
  const int ahead = o_.prefetch ? 1 : 0;
  lp.held = 1 + ahead;
  BatchLoader loader(data.train, lp, o_.workers);
  std::deque<const HostBatch*> staged;  // the batches staged on the engine, oldest first
  int64_t stage_next = step_;           // the step whose batch is staged next
  for (int64_t epoch = step_ / plan_.per_epoch; epoch < plan_.epochs && step_ < plan_.total_steps; ++epoch) {
    EpochMeter meter(int(epoch) + 1);
    const double epoch_start_us = engine_.recorder().now_us();
    progress.begin_epoch(meter.epoch(), plan_.epochs, plan_.per_epoch, step_ % plan_.per_epoch);
    // A resumed run starts mid-epoch; every later epoch starts at a multiple of per_epoch, at step 0.
    for (int64_t s = step_ % plan_.per_epoch; s < plan_.per_epoch && step_ < plan_.total_steps; ++s) {
      signals_.stage(Stage::step);
      failpoint::at("step", step_ + 1);
      for (; stage_next <= step_ + ahead && stage_next < plan_.total_steps; ++stage_next) {
        const HostBatch& b = next_batch(loader, stage_next);
        engine_.stage(b.x.data(), b.y.data(), b.n);
        staged.push_back(&b);
      }
      const HostBatch& batch = *staged.front();
      staged.pop_front();
      StepResult r = engine_.step();
      if (group_) agreed_signal_ = reduce_step(*group_, r, signals_.pending(), o_.timeout);
      if (verify) verify->step(batch.x.data(), batch.y.data(), batch.n);
      ++step_;
      // Checked before anything is saved: a bad step never reaches a checkpoint.
      if (std::string bad = nonfinite_step(r, engine_, step_, epoch); !bad.empty()) {
        std::string kept = o_.save.empty() ? "" : ", " + saver_.kept();
        throw NumericalError(bad + "; training stopped" + kept + divergence_hint(o_));
      }
      meter.add(r);
      progress.update(s + 1, r.n, meter.loss());
      if (log_) io([&] { log_->step(step_, meter.epoch(), r, engine_.recorder().phase_seconds(), step_ >= plan_.total_steps); });
      if (o_.save_every > 0 && step_ % o_.save_every == 0) save();
      stop_if_signalled();
    }
    EpochRecord rec = meter.finish();
    // The trace's host lane: the epoch's steps (its evaluation is a span on each device's lane).
    engine_.recorder().host_span("epoch " + std::to_string(rec.epoch), epoch_start_us, engine_.recorder().now_us(),
                      {{"steps", double(rec.steps)}, {"images", double(rec.images)}});
    signals_.stage(Stage::evaluation);
    if (step_ >= plan_.total_steps) failpoint::at("final-eval");
    const auto eval_start = std::chrono::steady_clock::now();
    evaluate(engine_, data.test, rec, group_);
    const double eval_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - eval_start).count();
    if (log_) io([&] { log_->epoch(rec, step_, eval_seconds); });
    progress.clear();
    if (speak()) print_epoch(rec, plan_.epochs);
    std::fflush(stdout);
    result.epochs.push_back(rec);
    result.load_wait_seconds = load_wait_us_ / 1e6;
    stop_if_signalled();
  }
}

}  // namespace

// The setting to blame for a diverged run. Weight decay alone is the heavy-ball iteration on
// wd/2 * w^2, stable exactly while lr * wd < 2 (1 + momentum): past that the decay makes the weights
// grow every step whatever the gradients, and --weight-decay is the setting out of range (a smaller
// --lr would mask it). Below it, the step size is the usual suspect.
std::string divergence_hint(const TrainOptions& o) {
  const double decay = double(o.lr) * double(o.weight_decay), bound = 2.0 * (1.0 + double(o.momentum));
  if (decay < bound) return " (try a smaller --lr)";
  char hint[200];
  std::snprintf(hint, sizeof hint,
                " (try a smaller --weight-decay: --lr * --weight-decay = %g is past 2 (1 + --momentum) = %g, where "
                "the decay alone makes the weights grow every step)",
                decay, bound);
  return hint;
}

TrainResult train(const TrainOptions& opt, ProcessGroup* group) {
  ProcessGroup* g = group && group->size() > 1 ? group : nullptr;  // a job of one process is no job
  const bool lead = !g || g->rank() == 0;
  // First: from here on a signal at any moment, even while the output paths are probed, stops the run
  // at its next safe point with 128 + signal and a line saying what was saved.
  SignalGuard signals(grace_seconds());
  failpoint::at("start");  // a test build reads DP_TEST_AT here: a malformed value is refused before anything runs
  check_options(opt, lead);
  if (g) check_job_options(opt, g->size());
  const ModelSpec spec = make_model(opt.model);
  const DataSets data = load_data(opt, spec);
  // Refuses a step count it cannot run before any device starts.
  const Schedule plan = schedule(opt, data.train.count);
  DeviceSet devs = make_devices(opt.devices);
  const int job_devices = int(devs.devices.size()) * (g ? g->size() : 1);
  check_batchnorm(opt, spec, plan, data.train.count, job_devices);
  const RunIdentity id = run_identity(opt, data.train, kind_name(devs.devices[0]->kind()), job_devices);
  // Step 0 and no weights without --resume. Across processes rank 0 alone reads the checkpoint; the
  // others get its step now and its state from broadcast_state.
  const Resumed resumed = g ? resume_on_rank0(*g, opt, spec, id) : resume_checkpoint(opt, spec, id);
  if (g) {  // every process's settings against rank 0's, before any collective that depends on them
    Settings s = id.required;
    s.insert(s.end(), id.exact_only.begin(), id.exact_only.end());
    s.insert(s.end(), {{"model", spec.name},
                       {"devices_per_process", std::to_string(devs.devices.size())},
                       {"steps", std::to_string(plan.total_steps)},
                       {"test_samples", std::to_string(data.test.count)},
                       {"resume", opt.resume.empty() ? "none" : "a checkpoint"},
                       // Each adds collectives at the end (verify's result, the trace's gather).
                       {"verify", opt.verify ? "on" : "off"},
                       {"trace", opt.trace.empty() ? "off" : "on"},
                       {"timeout", std::to_string(opt.timeout)}});
    check_agreement(*g, s, opt.timeout);
  }

  if (!opt.quiet) std::printf("%s\n", devs.notice.c_str());
  EngineConfig ec = engine_config(opt, data.train.count);
  ec.group = g;
  Engine engine(pointers(devs), spec, ec);
  if (!opt.quiet) note_clamped_sizes(opt, data);
  if (!opt.quiet) note_idle_devices(opt, ec.batch, engine.size());
  // Across processes rank 0 alone reads --load (the others take its state from broadcast_state).
  Checkpoint init;
  if (g && !opt.load.empty())
    on_rank0(*g, opt.timeout, "rank 0's reading of --load", [&] { init = initial_state(opt, spec, resumed); });
  else
    init = initial_state(opt, spec, resumed);
  if (g) broadcast_state(*g, init, opt.timeout);  // rank 0's: every replica of the job starts from it
  place(engine, init);
  std::optional<Verifier> verify;  // --verify: the same steps on one device with the full batch (rank 0's)
  if (opt.verify && lead) verify.emplace(opt.devices, spec, ec, init);
  // Across processes, every rank's trace onto rank 0's clock (read before the first span).
  const double trace_offset_us = g && ec.trace ? clock_offset_to_rank0(*g, engine, opt.timeout) : 0;

  if (!opt.resume.empty() && !opt.quiet) print_resuming(opt, plan, resumed.global_step);
  CheckpointSaver saver(opt, spec, id, plan.per_epoch);
  std::optional<TrainLog> log;  // opened (truncated) as training starts; rank 0's alone
  if (!opt.log.empty() && lead) log.emplace(opt.log, opt.log_every, opt.lr, engine.strategy(), engine.recorder().phase_seconds());
  Run run(opt, plan, engine, saver, signals, log ? &*log : nullptr, resumed.global_step, g);
  run.stop_if_signalled();  // one that came during the setup: nothing trained, nothing saved
  TrainResult result;
  run.epochs(data, verify ? &*verify : nullptr, result);
  summarize(result);

  if (opt.verify) {
    signals.stage(Stage::verify);
    VerifyResult v;
    if (verify) v = verify->compare(engine, ec.batch);  // the batch trained, not --batch
    if (g) broadcast_verify(*g, v, opt.timeout);
    result.verify_max_diff = v.max_diff, result.verify_tolerance = v.tolerance, result.verify_ok = v.ok;
  }
  run.stop_if_signalled();
  // Across processes: every device of every process, their weights checked identical; every rank's
  // trace, on rank 0.
  const nlohmann::json job_devices_json = g ? gather_devices(*g, engine, opt.timeout) : nlohmann::json();
  const nlohmann::json job_trace =
      g && ec.trace ? job_trace_json(*g, engine, trace_offset_us, opt.timeout) : nlohmann::json();
  if (run.speak()) std::printf("%s", device_table(engine).c_str());
  if (!opt.save.empty()) {
    signals.stage(Stage::save);
    failpoint::at("final-save");
    run.save();  // a signal from here on still lets it finish: the trained weights are worth keeping
    if (run.speak()) std::printf("saved %s\n", opt.save.c_str());
  }
  run.stop_if_signalled();
  if (!opt.report.empty() && lead)
    run.output(Stage::report, [&] {
      nlohmann::json j = train_report(opt, spec, plan.epochs, plan.total_steps, result, engine);
      if (g) {
        j["devices"] = job_devices_json;
        j["processes"] = {{"count", g->size()}, {"hosts", g->hosts()}};
      }
      write_json(opt.report, j);
    });
  if (!opt.trace.empty() && lead)
    run.output(Stage::trace, [&] { write_json(opt.trace, g ? job_trace : trace_json(engine)); });
  run.stop_if_signalled();
  return result;
}

namespace {

// --eval's --report: what was evaluated (the checkpoint, the config with the resolved backend and
// devices, the provenance a training report has) and the result, with each device's memory.
nlohmann::json eval_report(const TrainOptions& o, const ModelSpec& spec, Engine& engine, const EvalResult& r) {
  nlohmann::json config = run_config(o, spec, 0);  // no training steps
  nlohmann::json names = nlohmann::json::array();
  for (int d = 0; d < engine.size(); ++d) names.push_back(engine.device(d).name());
  config.update({{"data", o.data},
                 {"limit_test", o.limit_test},
                 {"gpus", o.devices.ids},
                 {"strategy", o.sync},
                 {"backend_requested", o.devices.backend},
                 {"backend", kind_name(engine.device(0).kind())},
                 {"device_names", names}});
  return {{"kind", "evaluation"},
          {"version", version()},
          {"command_line", o.command_line},
          {"started_at", o.started_at},
          {"checkpoint", o.load},
          {"config", config},
          {"images", r.images},
          {"test_loss", r.test_loss},
          {"test_accuracy", r.test_accuracy},
          {"devices", device_report(engine)}};
}

}  // namespace

EvalResult evaluate_checkpoint(const TrainOptions& opt) {
  SignalGuard signals(grace_seconds());  // a signal stops it before the report, with 128 + signal
  if (opt.load.empty())
    throw UsageError("--eval: evaluates a checkpoint without training; give --load FILE (one --save wrote)");
  check_options(opt);
  const ModelSpec spec = make_model(opt.model);
  const Checkpoint state = load_checkpoint(opt.load, spec);  // refused before any device starts
  if (!state.note.empty() && !opt.quiet) std::printf("note: %s\n", state.note.c_str());
  const Dataset test = load_set(opt, spec, "t10k", opt.limit_test);
  if (test.count == 0) throw UsageError(opt.data + ": the test set has no images; --eval has nothing to evaluate");
  DeviceSet devs = make_devices(opt.devices);
  if (!opt.quiet) std::printf("%s\n", devs.notice.c_str());
  // Evaluated in chunks of the batch a run with these options trains with (up to the set's size).
  Engine engine(pointers(devs), spec, engine_config(opt, test.count));
  engine.set_params(state.params);
  engine.set_running_stats(state.buffers);
  EpochRecord rec;
  evaluate(engine, test, rec);
  const EvalResult result{test.count, rec.test_loss, rec.test_accuracy};
  // Printed even with --quiet: it is what --eval was asked for.
  std::printf("test acc %.4f  test loss %.4f  (%lld images, %s, from %s)\n", result.test_accuracy, result.test_loss,
              (long long)result.images, spec.name.c_str(), opt.load.c_str());
  std::fflush(stdout);
  if (int sig = signals.pending())
    throw Interrupted(sig, describe_signal(sig) + " after the evaluation" +
                               (opt.report.empty() ? "" : "; report " + opt.report + " not written"));
  if (!opt.report.empty()) write_json(opt.report, eval_report(opt, spec, engine, result));
  return result;
}

}  // namespace dp
