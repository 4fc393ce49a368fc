// One training run between its setup and its return (trainer.cpp builds it): the epochs a step at a
// time, the evaluation after each, the checkpoints, and the outputs written after the last step, with
// a safe point for signals between any two of them. With --run-ahead a step is started before the one
// before it is finished (its loss read): the two halves of Engine::step, the safe point after both. A signal stops the
// run at the next safe point: the weights of a finished step are saved (--save), the outputs not yet written are
// skipped, and Interrupted says what was and was not written.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/process_group.h"
#include "train/data.h"
#include "train/loader.h"
#include "train/log.h"
#include "train/progress.h"
#include "train/resume.h"
#include "train/setup.h"
#include "train/signals.h"
#include "train/trainer.h"
#include "train/verify.h"

namespace dp {

// The test set evaluated by the engine into rec's test loss and accuracy. An empty test set (a valid
// t10k file with no images) has no accuracy: NaN, which the report writes as null and the epoch line
// as "n/a". Across processes each process evaluates its slice of the set and the sums are added up.
void evaluate(Engine& engine, const Dataset& test_set, EpochRecord& rec, ProcessGroup* group = nullptr);

// The run's final figures from its epochs.
void summarize(TrainResult& result);

class Run {
 public:
  Run(const TrainOptions& o, const Schedule& plan, Engine& engine, CheckpointSaver& saver, SignalGuard& signals,
      TrainLog* log, int64_t step, ProcessGroup* group);

  // stdout can go away (a closed pipe: dp_train | head); a write then fails with EPIPE, SIGPIPE being
  // ignored (dp_train.cpp), and the run stops printing but trains, saves and reports as asked.
  bool speak() const { return !o_.quiet && !std::ferror(stdout); }
  bool lead() const { return !group_ || group_->rank() == 0; }
  // The epochs, a step at a time: after every step and every epoch's evaluation, a safe point.
  void epochs(const DataSets& data, Verifier* verify, TrainResult& result);
  // The checkpoint of the current step, once; across processes rank 0 writes it and every process
  // waits for it (a barrier), so none runs ahead of a checkpoint that may yet fail.
  void save();
  // The report or the trace: written, then a safe point.
  void output(Activity p, const std::function<void()>& write);
  // Across processes only the signal the step's collective agreed on counts, so that every process
  // stops after the same step.
  void stop_if_signalled();
  // Why the --log stopped before the run ended (a write the system refused), or empty: training went
  // on and every other output was written; dp_train exits 1 saying so.
  const std::string& log_failure() const { return log_failure_; }

 private:
  class Staging;
  class EpochMeter;
  // Starts step s of the epoch (0-based), global step step_ + in flight + 1, on the engine; finishes it
  // too, unless it may stay in flight while the next one starts (stays_in_flight).
  void step(Staging& staging, EpochMeter& meter, Progress& progress, Verifier* verify, int64_t epoch, int64_t s);
  // --run-ahead: whether the step just started, step s of its epoch and global step g, may stay in
  // flight: not where what follows it needs its weights or its end (the epoch's evaluation, the run's
  // end, a --save-every checkpoint). A signal's stop finishes it first too (Run::step), as the next
  // step begins.
  bool stays_in_flight(int64_t s, int64_t g) const;
  // Finishes the oldest step in flight: its loss, checks, records and checkpoint, then a safe point
  // where no other step is in flight.
  void finish_step(EpochMeter& meter, Progress& progress, Verifier* verify);
  // After an epoch's last step: its evaluation, log record and line.
  void end_epoch(EpochMeter& meter, double start_us, const DataSets& data, Progress& progress, TrainResult& result);
  // An I/O error while a signal is pending names both; the exit stays 1, a failed write's.
  void io(const std::function<void()>& work);
  // A --log record: a write the system refuses stops the log (a warning on stderr, log_failure()) and
  // not the run, whose weights are worth more than its log.
  void log(const std::function<void(TrainLog&)>& write);
  std::string position() const;
  std::string kept() const;
  Interrupted interrupted(int sig);
  const HostBatch& next_batch(BatchLoader& loader, int64_t step);

  const TrainOptions& o_;
  const Schedule& plan_;
  Engine& engine_;
  CheckpointSaver& saver_;
  SignalGuard& signals_;
  TrainLog* log_;  // null without --log, and once a write to it failed
  std::string log_failure_;
  int64_t first_step_, step_;  // step_: the global steps finished
  bool run_ahead_;             // runs_ahead (setup.h)
  // A step started on the engine and not finished yet: what finishing it needs.
  struct Started {
    const HostBatch* batch;
    float lr;
    int64_t epoch, s;
  };
  std::deque<Started> started_;  // oldest first; at most two with run-ahead, else one between the halves
  bool report_written_ = false, trace_written_ = false;
  double load_wait_us_ = 0;
  ProcessGroup* group_;    // null in one process
  int agreed_signal_ = 0;  // across processes: the largest signal pending on any process after a step
};

}  // namespace dp
