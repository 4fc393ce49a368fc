#include "train/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "train/report.h"

namespace dp {
namespace {

// Per phase the strategy has, by its name for it: the mean milliseconds per step of `steps` on device 0
// ("device0") and the largest over the devices ("max"): the device the others wait for.
nlohmann::ordered_json phase_ms(const PhaseSeconds& now, const PhaseSeconds& before, int64_t steps,
                                const Strategy& strategy) {
  nlohmann::ordered_json device0, most;
  for (int p = 0; p < kPhases; ++p) {
    if (!strategy.has_phase(Phase(p))) continue;
    double top = 0;
    for (size_t r = 0; r < now.size(); ++r) top = std::max(top, now[r][p] - before[r][p]);
    const char* name = strategy.phase_name(Phase(p));
    device0[name] = 1e3 * (now[0][p] - before[0][p]) / double(steps);
    most[name] = 1e3 * top / double(steps);
  }
  return {{"device0", device0}, {"max", most}};
}

// The host's milliseconds per step of `steps` that took `seconds` of wall time: the trainer's inside
// Engine::step, device 0's thread enqueueing and waiting within it, and the trainer's between the steps.
nlohmann::ordered_json host_ms(const HostSeconds& now, const HostSeconds& before, int64_t steps, double seconds) {
  const double per_step = 1e3 / double(steps), in_step = (now.in_step - before.in_step) * per_step;
  return {{"step", in_step},
          {"enqueue", (now.device[0].enqueue - before.device[0].enqueue) * per_step},
          {"wait", (now.device[0].wait - before.device[0].wait) * per_step},
          {"between", seconds * per_step - in_step}};
}

}  // namespace

TrainLog::TrainLog(const std::string& path, int64_t every, const Strategy& strategy, const Recorder& times,
                   int64_t resumed)
    : path_(path),
      every_(every),
      strategy_(strategy),
      interval_phases_(times.phase_seconds()),
      interval_host_(times.host_seconds()) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | (resumed > 0 ? 0 : O_TRUNC) | O_CLOEXEC, 0666);
  if (fd_ < 0) throw IoError(path + ": cannot open the log: " + std::strerror(errno));
  if (resumed > 0) keep_records_through(resumed);
}

// The whole lines at the file's start that are records of steps up to `step`: kept, the rest cut (a
// last line without its newline is what a killed run left). A whole line that is not a record says the
// file is not a log dp_train wrote: refused before anything is cut.
void TrainLog::keep_records_through(int64_t step) {
  std::string text;
  char buf[1 << 16];
  for (ssize_t got; (got = ::read(fd_, buf, sizeof buf)) != 0;) {
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw IoError(path_ + ": cannot read the log to resume it: " + std::strerror(errno));
    text.append(buf, size_t(got));
  }
  auto record = [&](size_t begin, size_t end) {
    nlohmann::json j = nlohmann::json::parse(text.begin() + off_t(begin), text.begin() + off_t(end), nullptr, false);
    const bool is = j.is_object() && j.contains("kind") && j["kind"].is_string() && j.contains("step") &&
                    j["step"].is_number_integer();
    return is ? j : nlohmann::json();
  };
  int64_t line = 1;
  for (size_t begin = 0, end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1, ++line)
    if (record(begin, end).is_null())
      throw UsageError(path_ + ": line " + std::to_string(line) + " is not a dp_train --log record, so the file " +
                       "is not this run's log; --resume goes on with the log the run wrote: give that file, or a " +
                       "new one (this one is left as it is)");
  for (size_t end; (end = text.find('\n', size_t(written_))) != std::string::npos; written_ = off_t(end + 1)) {
    const nlohmann::json j = record(size_t(written_), end);
    if (j["step"].get<int64_t>() > step) break;
    if (j["kind"] == "step" && j.contains("elapsed_s") && j["elapsed_s"].is_number())
      elapsed_before_ = j["elapsed_s"].get<double>(), recorded_step_ = j["step"].get<int64_t>();
  }
  if (::ftruncate(fd_, written_) != 0 || ::lseek(fd_, written_, SEEK_SET) < 0)
    throw IoError(path_ + ": cannot cut the log back to step " + std::to_string(step) + ": " + std::strerror(errno));
}

TrainLog::~TrainLog() { ::close(fd_); }

// Each record reaches the file (unbuffered) before training goes on: a reader (tail -f, a crashed
// run's owner) sees every record written so far. A record the system refuses part of is cut off
// again, so the file stays whole lines that all parse.
void TrainLog::write_line(const std::string& line) {
  for (size_t done = 0; done < line.size();) {
    const ssize_t w = ::write(fd_, line.data() + done, line.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      if (::ftruncate(fd_, written_) == 0) ::lseek(fd_, written_, SEEK_SET);
      throw IoError(path_ + ": writing the log failed: " + std::strerror(err) + " (the records before it are kept)");
    }
    done += size_t(w);
  }
  written_ += off_t(line.size());
}

void TrainLog::step(int64_t step, int epoch, const StepResult& r, double lr, const Recorder& times, bool last) {
  ++steps_, images_ += r.n, micro_batches_ += r.micro_batches, loss_sum_ += r.loss * r.n;
  lr_ = json_float(float(lr));
  last_step_ = step, epoch_ = epoch;
  if (last || step % every_ == 0) flush(times);
}

void TrainLog::flush(const Recorder& times) {
  if (steps_ == 0) return;
  const Clock::time_point now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - interval_start_).count() - paused_;
  nlohmann::ordered_json j = {{"kind", "step"},
                              {"step", last_step_},
                              {"epoch", epoch_},
                              {"loss", images_ ? loss_sum_ / double(images_) : 0.0},
                              {"images", images_},                // since the record before
                              {"micro_batches", micro_batches_},  // --accumulate's, likewise
                              {"images_per_second", seconds > 0 ? double(images_) / seconds : 0.0},
                              {"elapsed_s", elapsed_before_ + std::chrono::duration<double>(now - start_).count()},
                              {"lr", lr_},
                              {"phase_ms", phase_ms(times.phase_seconds(), interval_phases_, steps_, strategy_)},
                              {"host_ms", host_ms(times.host_seconds(), interval_host_, steps_, seconds)}};
  failpoint::at("log", last_step_);
  write_line(j.dump() + "\n");
  recorded_step_ = last_step_;
  steps_ = images_ = micro_batches_ = 0;
  loss_sum_ = paused_ = 0;
  interval_start_ = now;
  interval_phases_ = times.phase_seconds();
  interval_host_ = times.host_seconds();
}

void TrainLog::epoch(const EpochRecord& rec, int64_t step, double eval_seconds) {
  // NaN (an empty test set) is written as null, as the report writes it.
  nlohmann::ordered_json j = {{"kind", "epoch"},
                              {"step", step},
                              {"epoch", rec.epoch},
                              {"train_loss", rec.train_loss},
                              {"train_accuracy", rec.train_accuracy},
                              {"test_loss", rec.test_loss},
                              {"test_accuracy", rec.test_accuracy},
                              {"images_per_second", rec.images_per_second},
                              {"seconds", rec.seconds},
                              {"eval_seconds", eval_seconds}};
  write_line(j.dump() + "\n");
  paused_ += eval_seconds;  // inside the interval under way, or at the start of the next one
}

}  // namespace dp
