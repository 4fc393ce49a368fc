// The run (run.h): the epochs a step at a time, and the safe points between everything it writes.
#include "train/run.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "engine/failpoint.h"
#include "train/job.h"
#include "train/signals.h"

namespace dp {
namespace {

// An epoch that ran fewer steps than an epoch has (--steps ended it, or a resumed run began mid-way)
// says how many, so that it does not read as a full pass over the data.
void print_epoch(const EpochRecord& rec, int epochs, int64_t per_epoch) {
  char test[48] = "n/a (empty test set)";
  if (!std::isnan(rec.test_accuracy)) std::snprintf(test, sizeof test, "%.4f", rec.test_accuracy);
  const std::string part = rec.steps < per_epoch ? "  (" + std::to_string(rec.steps) + " of the epoch's " +
                                                       std::to_string(per_epoch) + " steps)"
                                                 : "";
  std::printf("epoch %d/%d  train loss %.4f  train acc %.4f  test acc %s  %.0f img/s  %.1f s%s\n", rec.epoch, epochs,
              rec.train_loss, rec.train_accuracy, test, rec.images_per_second, rec.seconds, part.c_str());
}

// What went wrong in a step whose loss or gradients are not finite; "" for a good step. The check
// came back with the step's loss (StepResult::finite_gradients); only a bad step looks for the layer,
// in the gradients on the devices, which are the next step's where it had started (--run-ahead).
std::string nonfinite_step(const StepResult& r, Engine& engine, int64_t global_step, int64_t epoch) {
  if (std::isfinite(r.loss) && r.finite_gradients) return "";
  std::string what = "step " + std::to_string(global_step) + " (epoch " + std::to_string(epoch + 1) + "): non-finite " +
                     (std::isfinite(r.loss) ? std::string("gradients") : "loss (" + std::to_string(r.loss) + ")");
  if (engine.in_flight() > 0)
    return what + "; step " + std::to_string(global_step + 1) +
           " had started before this one's loss was read (--run-ahead), so the layer is not named (--no-run-ahead "
           "names it)";
  std::string layer = engine.first_nonfinite_gradient();
  return what + (layer.empty() ? std::string() : "; the first layer with a non-finite gradient is " + layer);
}

}  // namespace

void evaluate(Engine& engine, const Dataset& test_set, EpochRecord& rec, ProcessGroup* group) {
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

// An epoch's running sums, and its record once the last step is in; the clock runs from construction.
class Run::EpochMeter {
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

// The batches staged on the engine: the loader's thread fills them ahead; with prefetch the next
// step's batch is staged (its upload started) before this step trains, so the trainer holds two
// batches: this step's (which --verify reads after the step) and the next.
class Run::Staging {
 public:
  Staging(Engine& engine, const Dataset& train, const LoaderPlan& plan, int workers, int ahead, int64_t first_step)
      : loader(train, plan, workers), ahead(ahead), next(first_step), engine_(engine) {}
  // The staged batches' uploads may still read the loader's buffers (a step that threw, or a loader
  // that failed for the batch after a staged one): they finish before the loader and its buffers go.
  ~Staging() { engine_.drop_staged(); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  BatchLoader loader;                   // its thread is joined when the run returns or throws, after at most one batch
  std::deque<const HostBatch*> staged;  // oldest first
  int ahead;
  int64_t next;  // the step whose batch is staged next

 private:
  Engine& engine_;
};

Run::Run(const TrainOptions& o, const Schedule& plan, Engine& engine, CheckpointSaver& saver, SignalGuard& signals,
         TrainLog* log, int64_t step, ProcessGroup* group)
    : o_(o),
      plan_(plan),
      engine_(engine),
      saver_(saver),
      signals_(signals),
      log_(log),
      first_step_(step),
      step_(step),
      run_ahead_(runs_ahead(o, engine.device(0).kind(), group != nullptr)),
      group_(group) {
  signals_.kept(kept());
}

void Run::save() {
  signals_.doing(Activity::save);
  // A sharded optimizer state (and zero3's weights) is gathered from every process's devices: every
  // rank takes part.
  const int stage = engine_.strategy().zero_stage();
  std::vector<std::vector<float>> state;
  std::vector<float> weights;
  if (lead() || stage > 0) state = engine_.optimizer_state();
  if (lead() || stage == 3) weights = engine_.params();
  if (lead()) io([&] { saver_.save(engine_, step_, std::move(weights), std::move(state)); });
  if (group_) group_->barrier(Deadline::after(o_.timeout), "the barrier after rank 0's checkpoint");
  signals_.kept(kept());
}

void Run::output(Activity p, const std::function<void()>& write) {
  signals_.doing(p);
  failpoint::at(p == Activity::report ? "report" : "trace");
  io(write);
  (p == Activity::report ? report_written_ : trace_written_) = true;
  stop_if_signalled();
}

void Run::stop_if_signalled() {
  if (int sig = group_ ? agreed_signal_ : signals_.pending()) throw interrupted(sig);
}

void Run::io(const std::function<void()>& work) {
  try {
    work();
  } catch (const IoError& e) {
    if (int sig = signals_.pending())
      throw IoError(std::string(e.what()) + "; " + describe_signal(sig) + " " + position() +
                    ", and this write failed; " + kept());
    throw;
  }
}

void Run::log(const std::function<void(TrainLog&)>& write) {
  if (!log_) return;
  try {
    write(*log_);
  } catch (const IoError& e) {
    log_failure_ = std::string(e.what()) + "; the log stopped after step " + std::to_string(log_->last_step());
    log_ = nullptr;
    std::fprintf(stderr,
                 "dp_train: warning: %s; training goes on (dp_train will exit 1 once it has written the rest)\n",
                 log_failure_.c_str());
  }
}

std::string Run::position() const {
  if (step_ == first_step_) return "before the first step";
  return step_ >= plan_.total_steps ? "after the last step (step " + std::to_string(step_) + ")"
                                    : "after step " + std::to_string(step_);
}

std::string Run::kept() const { return o_.save.empty() ? "no checkpoint saved (no --save given)" : saver_.kept(); }

// The batch of `step` (0-based), and the trainer's wait for it: the report's load_wait_seconds and,
// when tracing, a "load wait" span on the host lane per batch (with --workers 0 the wait is the
// batch's assembly).
const HostBatch& Run::next_batch(BatchLoader& loader, int64_t step) {
  const double start_us = engine_.recorder().now_us();
  failpoint::at("batch", step);
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
  // The log's records are on disk as they come; the steps since the last one get theirs now.
  log([&](TrainLog& l) { l.flush(engine_.recorder()); });
  if (log_)
    what += "; log " + log_->path() +
            (log_->last_step() > 0 ? " kept up to step " + std::to_string(log_->last_step()) : " has no step records");
  else if (!log_failure_.empty())
    what += "; " + log_failure_;
  return Interrupted(sig, what);
}

void Run::epochs(const DataSets& data, Verifier* verify, TrainResult& result) {
  Progress progress(!o_.quiet);  // cleared when this returns or throws
  LoaderPlan lp{int(o_.step_images()), plan_.per_epoch, step_, plan_.total_steps, o_.seed, o_.shuffle, {}, {}};
  // Across processes, this process's rows only; but rank 0 under --verify (the one process with a
  // Verifier) loads the whole batch for the reference, of which its engine's rows are the first
  // (Engine::slice starts at row 0 on rank 0).
  if (group_ && !verify) lp.rows = [this](int n) { return engine_.slice(n); };
  lp.pin = [this](void* p, size_t bytes) { return engine_.pin_host(p, bytes); };
  const int ahead = o_.prefetch ? 1 : 0;
  lp.held = 1 + ahead + (run_ahead_ ? 1 : 0);  // a step in flight keeps its batch (--verify reads it at its finish)
  result.run_ahead = run_ahead_;
  Staging staging(engine_, data.train, lp, o_.workers, ahead, step_);
  for (int64_t epoch = step_ / plan_.per_epoch; epoch < plan_.epochs && step_ < plan_.total_steps; ++epoch) {
    EpochMeter meter(int(epoch) + 1);
    const double start_us = engine_.recorder().now_us();
    // The bar counts to the epoch's last step this run takes: --steps may end it early.
    const int64_t last = std::min(plan_.per_epoch, plan_.total_steps - epoch * plan_.per_epoch);
    progress.begin_epoch(meter.epoch(), plan_.epochs, last, step_ % plan_.per_epoch);
    // A resumed run starts mid-epoch; every later epoch starts at a multiple of per_epoch, at step 0.
    for (int64_t s = step_ % plan_.per_epoch; s < plan_.per_epoch && step_ < plan_.total_steps; ++s)
      step(staging, meter, progress, verify, epoch, s);
    end_epoch(meter, start_us, data, progress, result);
  }
}

void Run::step(Staging& staging, EpochMeter& meter, Progress& progress, Verifier* verify, int64_t epoch, int64_t s) {
  // A signal stops the run after the step in flight: none starts past it.
  if (!started_.empty() && signals_.pending()) finish_step(meter, progress, verify);
  signals_.doing(Activity::step);
  const int64_t index = step_ + int64_t(started_.size());  // the global step this starts, 0-based
  failpoint::at("step", index + 1);
  for (; staging.next <= index + staging.ahead && staging.next < plan_.total_steps; ++staging.next) {
    const HostBatch& b = next_batch(staging.loader, staging.next);
    engine_.stage(b.x.data(), b.y.data(), b.n);
    staging.staged.push_back(&b);
  }
  const HostBatch& batch = *staging.staged.front();
  staging.staged.pop_front();
  if (group_) group_->flight().set_step(index + 1);
  const float lr = float(plan_.lr.at(index));  // --lr-schedule's, of this global step
  engine_.set_lr(lr);
  engine_.start_step();
  started_.push_back({&batch, lr, epoch, s});
  while (started_.size() > (stays_in_flight(s, index + 1) ? 1u : 0u)) finish_step(meter, progress, verify);
}

bool Run::stays_in_flight(int64_t s, int64_t g) const {
  return run_ahead_ && s + 1 < plan_.per_epoch && g < plan_.total_steps &&
         !(o_.save_every > 0 && g % o_.save_every == 0);
}

void Run::finish_step(EpochMeter& meter, Progress& progress, Verifier* verify) {
  const Started st = started_.front();
  started_.pop_front();
  StepResult r = engine_.finish_step();
  if (group_) agreed_signal_ = reduce_step(*group_, r, signals_.pending(), o_.timeout);
  if (verify) {
    verify->set_lr(st.lr);
    verify->step(st.batch->x.data(), st.batch->y.data(), st.batch->n);
  }
  ++step_;
  // Checked before anything is saved: a bad step never reaches a checkpoint.
  if (std::string bad = nonfinite_step(r, engine_, step_, st.epoch); !bad.empty()) {
    std::string kept = o_.save.empty() ? "" : ", " + saver_.kept();
    throw NumericalError(bad + "; training stopped" + kept + divergence_hint(o_));
  }
  meter.add(r);
  progress.update(st.s + 1, r.n, meter.loss());
  log([&](TrainLog& l) { l.step(step_, meter.epoch(), r, st.lr, engine_.recorder(), step_ >= plan_.total_steps); });
  if (o_.save_every > 0 && step_ % o_.save_every == 0) save();
  if (started_.empty()) stop_if_signalled();  // else after the step in flight (Run::step)
}

void Run::end_epoch(EpochMeter& meter, double start_us, const DataSets& data, Progress& progress, TrainResult& result) {
  EpochRecord rec = meter.finish();
  // The trace's host lane: the epoch's steps (its evaluation is a span on each device's lane).
  engine_.recorder().host_span("epoch " + std::to_string(rec.epoch), start_us, engine_.recorder().now_us(),
                               {{"steps", double(rec.steps)}, {"images", double(rec.images)}});
  signals_.doing(Activity::evaluation);
  if (step_ >= plan_.total_steps) failpoint::at("final-eval");
  const auto eval_start = std::chrono::steady_clock::now();
  evaluate(engine_, data.test, rec, group_);
  const double eval_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - eval_start).count();
  log([&](TrainLog& l) { l.epoch(rec, step_, eval_seconds); });
  progress.clear();
  if (speak()) print_epoch(rec, plan_.epochs, plan_.per_epoch);
  std::fflush(stdout);
  result.epochs.push_back(rec);
  result.load_wait_seconds = load_wait_us_ / 1e6;
  stop_if_signalled();
}

}  // namespace dp
