// What a run decides before its first step: its options checked, how long it is, its data, the
// engine's configuration, BatchNorm's batch checks, the notes it prints, and the state it starts
// from. Shared by training (trainer.cpp) and --eval (eval.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/engine.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/lr_schedule.h"
#include "train/resume.h"
#include "train/trainer.h"

namespace dp {

// Every option on its own and against the others; lead: this process writes the outputs (rank 0 of a
// job, or the only process), whose paths are checked before training.
void check_options(const TrainOptions& o, bool lead = true);

// How long the run is, in steps. The position is the global step alone: epoch global_step / per_epoch,
// step global_step % per_epoch within it.
// The run's steps and its learning rate at each (refused where --warmup or --lr-step-size cannot run).
struct Schedule {
  int64_t per_epoch = 0, total_steps = 0;
  int epochs = 0;
  LrSchedule lr;
};

Schedule schedule(const TrainOptions& o, int64_t train_count);

struct DataSets {
  Dataset train, test;
};

// The training and test sets; a set is refused where it does not fit the model.
Dataset load_set(const TrainOptions& o, const ModelSpec& spec, const char* prefix, int64_t limit);
DataSets load_data(const TrainOptions& o, const ModelSpec& spec);

EngineConfig engine_config(const TrainOptions& o, int64_t train_count);
// Whether each step is started before the loss of the one before is read (--run-ahead): by default on
// CUDA devices, whose host would otherwise leave the GPU idle while it reads the loss and prepares the
// next step; off on simulated devices, which compute as the host calls them (nothing to overlap; on
// there runs the same loop, the CUDA path's twin). Never across processes (every step's loss and any
// signal are agreed before the next) nor where the phases are timed (--log, --trace: a wait each step).
bool runs_ahead(const TrainOptions& o, DeviceKind kind, bool in_job);
// A model whose state (parameters, gradients, optimizer state, activations) would not fit a device: UsageError
// naming the estimate, the bound (--device-memory, or the host memory simulated devices share) and
// the largest --width that fits, before any device allocates.
void check_model_fits(const TrainOptions& o, const ModelSpec& spec, const DeviceSet& devs, int job_devices,
                      int64_t train_count);
// Before any device is made: more simulated devices than this process's memory holds (each a thread
// holding at least the model's state), UsageError naming how many fit. `processes`: of the job.
void check_simulated_devices(const TrainOptions& o, const ModelSpec& spec, int processes, int64_t train_count);
// --accumulate with a micro-batch smaller than the job's devices: UsageError (a device would idle in
// every micro-batch of every step, which accumulation exists to avoid: give it the larger --batch).
void check_accumulate(const TrainOptions& o, int job_devices);
// What --accumulate does under the run's strategy, in a line ("" without it): printed and reported.
std::string accumulation_note(const TrainOptions& o);
void check_batchnorm(const TrainOptions& o, const ModelSpec& spec, const Schedule& plan, int64_t train_count,
                     int devices);
std::vector<Device*> pointers(const DeviceSet& set);

void note_idle_devices(const TrainOptions& o, int batch, int devices);
void note_clamped_sizes(const TrainOptions& o, const DataSets& d);
void print_resuming(const TrainOptions& o, const Schedule& s, int64_t global_step);

Checkpoint initial_state(const TrainOptions& o, const ModelSpec& spec, const Resumed& resumed);
void place(Engine& engine, const Checkpoint& state);

}  // namespace dp
