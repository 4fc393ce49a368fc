// The trainer's side of a job of several processes (mpirun -np P dp_train; process_group.h): what
// runs before the first step (the options that cannot run across processes, every process's settings
// against rank 0's, rank 0's state to every process), each step's statistics and stop flag, the
// evaluation's sums, and what the report gathers.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "engine/process_group.h"
#include "engine/trainer.h"

namespace dp {

// Processes disagree on a setting: every process knows it from the same gathered settings, so every
// process exits 2 and rank 0 alone prints the message.
struct JobMismatch : UsageError {
  using UsageError::UsageError;
};

// Refuses (UsageError) what does not run across processes, naming what does.
void check_job_options(const TrainOptions& o, int processes);

using Settings = std::vector<std::pair<std::string, std::string>>;
// Every process's settings, gathered, against rank 0's: a difference is a JobMismatch naming each
// differing setting with every process's value. Collective.
void check_agreement(ProcessGroup& g, const Settings& mine, double timeout);

// Rank 0's weights, momentum, running statistics and step count to every process. Collective.
void broadcast_state(ProcessGroup& g, Checkpoint& state, double timeout);

// The step's shares summed over the processes (loss, correct count); returns the largest signal
// pending on any process (0: none), so that every process stops after the same step. Collective.
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
