// The trainer's side of a job of several processes (mpirun -np P dp_train; process_group.h): what
// runs before the first step (the options that cannot run across processes, every process's settings
// against rank 0's, rank 0's state to every process), each step's statistics and stop flag, the
// evaluation's sums, and what the report gathers.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/process_group.h"
#include "train/checkpoint.h"
#include "train/resume.h"
#include "train/trainer.h"
#include "train/verify.h"

namespace dp {

// Processes disagree on a setting: every process knows it from the same gathered settings, so every
// process exits 2 and rank 0 alone prints the message. Also what every process throws when rank 0
// refused an input that it alone reads (--resume), with rank 0's message.
struct JobMismatch : UsageError {
  using UsageError::UsageError;
};

// The processes ran different collectives (the desync check of reduce_step): every process finds it in
// the same exchange, so every process exits 1 and rank 0 alone says which collective differed first.
struct JobDesync : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The job in a line, printed first: "job: 2 processes x 2 devices = 4 replicas, on host node7 (2
// processes)".
void print_world(const ProcessGroup& g, int local_devices);

// Refuses (UsageError) what does not run across processes, naming what does.
void check_job_options(const TrainOptions& o, int processes);

// Runs `check` (a check of the options, which throws UsageError) on every process, then tells every
// process how it went everywhere: a refusal on any process is thrown on every process as a JobMismatch,
// so that every process exits 2, rank 0 alone says why and no MPI_Abort ends the job. The message is
// the refusal where every process refused alike; otherwise each refusing process's, named. Collective.
void refuse_together(ProcessGroup& g, double timeout, const std::function<void()>& check);

using Settings = std::vector<std::pair<std::string, std::string>>;
// Every process's settings, gathered, against rank 0's: a difference is a JobMismatch naming each
// differing setting with every process's value. Collective.
void check_agreement(ProcessGroup& g, const Settings& mine, double timeout);

// Runs `read` (a checkpoint's reading) on rank 0 alone, then tells every process how it went: a
// refusal there (a UsageError: no such file, a corrupt one, another run's) is thrown on every process
// as a JobMismatch with rank 0's message, so every process exits 2, rank 0 alone saying why, and none
// waits. Collective: every process calls it alike.
void on_rank0(ProcessGroup& g, double timeout, const std::string& what, const std::function<void()>& read);

// --resume across processes: rank 0 alone reads and checks the checkpoint (resume_checkpoint), so that
// on several hosts only rank 0 needs the file; every process gets its global step, and its weights,
// momentum and statistics follow with broadcast_state. Rank 0 first broadcasts how the reading went:
// a refusal there (no such file, a corrupt one, another run's) is thrown on every process as a
// JobMismatch with rank 0's message, so every process exits 2, rank 0 alone saying why, and none waits.
// Collective, also without --resume (rank 0 then sends step 0), so that every process calls it alike.
Resumed resume_on_rank0(ProcessGroup& g, const TrainOptions& o, const ModelSpec& spec, const RunIdentity& id);

// --verify across processes: rank 0 alone keeps the one-device reference (it is given the whole
// batch) and compares its replica, which gather_devices finds bitwise equal to every other; its result
// to every process, so that every process exits alike. Collective.
void broadcast_verify(ProcessGroup& g, VerifyResult& v, double timeout);

// Rank 0's weights, momentum, running statistics and step count to every process. Collective.
void broadcast_state(ProcessGroup& g, Checkpoint& state, double timeout);

// The step's shares summed over the processes (loss, correct count); returns the largest signal
// pending on any process (0: none), so that every process stops after the same step. Throws JobDesync
// where the processes' collectives since the last step differ (their flight-record fingerprints).
// Collective.
int reduce_step(ProcessGroup& g, StepResult& r, int pending_signal, double timeout);

// The rows [first, second) of a set of n images this process evaluates.
std::pair<int64_t, int64_t> evaluation_slice(const ProcessGroup& g, int64_t n);
// A process's evaluation of its slice (loss: the mean over its images) summed into the set's.
void reduce_evaluation(ProcessGroup& g, StepResult& r, int64_t n, double timeout);

// Every process's devices for the report, in the job's device order, each with its process, host
// and a hash of its weights; throws if two replicas' weights differ (they never may under allreduce).
// Collective.
nlohmann::json gather_devices(ProcessGroup& g, Engine& engine, double timeout);

}  // namespace dp
