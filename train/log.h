// --log: the run as JSON Lines (one object per line), written and flushed record by record so that
// `tail -f` follows it, an interrupted run keeps what was written, and pandas reads it whole with
// pd.read_json(path, lines=True). Two kinds of record, told apart by "kind":
//   step:  every N global steps and after the last: the mean loss and the images per second over the
//          steps since the previous record, the time since training started, the learning rate of
//          its last step (--lr-schedule's),
//          per phase the mean milliseconds per step on device 0 and the largest mean over the devices,
//          and the host's milliseconds per step: inside Engine::step, of it device 0's thread enqueueing
//          and waiting for its device, and the trainer's between the steps (the rest of the wall time);
//   epoch: at each epoch's end, the figures of its epoch line (a missing test accuracy as null).
#pragma once

#include <sys/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "train/trainer.h"

namespace dp {

class TrainLog {
 public:
  // Opens `path`, truncating it; the clock of elapsed_s starts here, and the phase and host times
  // count from the recorder's now. Throws IoError naming the path and the OS's reason where the system refuses.
  // A run resumed at global step `resumed` > 0 keeps the file's records up to that step (the run it
  // resumes wrote them; those after it are of steps that run again, and go), and its elapsed_s goes on
  // from the last kept step record's; the rest of the file (a line cut short, another file) goes too.
  TrainLog(const std::string& path, int64_t every, const Strategy& strategy, const Recorder& times,
           int64_t resumed = 0);
  ~TrainLog();
  TrainLog(const TrainLog&) = delete;
  TrainLog& operator=(const TrainLog&) = delete;

  // After global step `step` (1-based, in 1-based `epoch`): a step record when `step` is a multiple of
  // `every` or the run's last. Throws IoError (disk full, ...) naming the path and the reason.
  void step(int64_t step, int epoch, const StepResult& r, double lr, const Recorder& times, bool last);
  // The step record of the steps since the last record, if there are any: a run stopped between two.
  void flush(const Recorder& times);
  // After an epoch's evaluation, which took `eval_seconds`: those are not training time, so the next
  // step record's images per second leaves them out.
  void epoch(const EpochRecord& rec, int64_t step, double eval_seconds);

  const std::string& path() const { return path_; }
  int64_t last_step() const { return recorded_step_; }  // of the last step record; 0 before the first

 private:
  void keep_records_through(int64_t step);
  void write_line(const std::string& line);

  using Clock = std::chrono::steady_clock;
  std::string path_;
  int fd_ = -1;
  off_t written_ = 0;  // bytes of the whole records written
  int64_t every_;
  double lr_ = 0;             // of the last step
  const Strategy& strategy_;  // names the phases
  Clock::time_point start_ = Clock::now(), interval_start_ = start_;
  PhaseSeconds interval_phases_;  // the recorder's at the interval's start
  HostSeconds interval_host_;
  // The interval since the last step record: its steps, images, sum of loss * images, and the
  // evaluation time inside it.
  int64_t steps_ = 0, images_ = 0, micro_batches_ = 0, last_step_ = 0, recorded_step_ = 0;
  int epoch_ = 0;
  double loss_sum_ = 0, paused_ = 0;
  double elapsed_before_ = 0;  // a resumed run's: the kept records' training time
};

}  // namespace dp
