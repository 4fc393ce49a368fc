// The training loop behind dp_train: data, devices, engine, per-epoch evaluation, checkpoints,
// the report and the trace. The loop is trainer.cpp; resuming and saving are resume.h, --verify is
// verify.h, the progress line and signals progress.h, the report report.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/engine.h"
#include "engine/process_group.h"
#include "train/lr_schedule.h"
#include "train/verify.h"  // summation_tolerance, the bound --verify holds a run to

namespace dp {

struct TrainOptions {
  std::string model = "lenet";
  int width = 1;  // --width: the model's channels and hidden widths times this (make_model)
  int batch = 256;
  // --accumulate: micro-batches of `batch` images per optimizer step (EngineConfig::accumulate); a step,
  // --steps, --save-every and every count of steps are optimizer steps of batch·accumulate images
  int accumulate = 1;
  int64_t step_images() const { return int64_t(batch) * accumulate; }
  int epochs = 10;
  int64_t steps = 0;                     // when > 0, train this many steps instead of `epochs`
  Optimizer optimizer = Optimizer::sgd;  // --optimizer (engine/optimizer.h)
  // lr and weight_decay take the optimizer's PyTorch defaults where not given: SGD 0.1 (dp's) and 0,
  // Adam 1e-3 and 0, AdamW 1e-3 and 1e-2. momentum is SGD's, the betas and eps Adam's and AdamW's.
  float lr = 0.1f, momentum = 0.9f, weight_decay = 0.0f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  // --lr-schedule, --warmup, --lr-step-size (0: a third of the run), --lr-gamma (train/lr_schedule.h)
  LrScheduleKind lr_schedule = LrScheduleKind::constant;
  int64_t warmup = 0, lr_step_size = 0;
  float lr_gamma = 0.1f;
  float clip_grad_norm = 0.0f;  // --clip-grad-norm; 0: none (EngineConfig::clip_grad_norm)
  uint64_t seed = 0;
  bool shuffle = true;
  std::string data = "/usr/share/datasets/fashion-mnist";
  int64_t limit_train = 0, limit_test = 0;
  int workers = 1;       // --workers: 0 assembles each batch between steps, 1 on a loader thread (loader.h)
  bool prefetch = true;  // off with --no-prefetch: each batch uploads at its own step (EngineConfig::prefetch)
  bool graphs = false;   // --graphs: the step captured and replayed (EngineConfig::graphs)
  // --run-ahead / --no-run-ahead: step k+1 enqueued before step k's loss is read (Engine::start_step);
  // unset: on CUDA devices, off on simulated ones (runs_ahead, setup.h)
  std::optional<bool> run_ahead;
  DeviceConfig devices;
  std::string sync = "scatter";  // --sync: a strategy's name (engine/strategy.h)
  Split split = Split::even;
  int64_t bucket_kb = 0;
  bool sync_bn = false;                                      // --sync-bn: SyncBatchNorm (EngineConfig::sync_bn)
  AllReduceAlgorithm all_reduce = AllReduceAlgorithm::ring;  // --allreduce (only with --sync allreduce)
  DType grad_dtype = DType::fp32;                            // --grad-dtype (EngineConfig::grad_dtype)
  double timeout = kDefaultTimeout;                          // --timeout: seconds a collective waits for peers
  int flight_records = kDefaultFlightRecords;  // --flight-records: across processes (engine/flight_recorder.h)
  std::string flight_dir;                      // --flight-dir: where they go when the job fails
  std::string load, save, resume, report, trace;
  int64_t save_every = 0;
  std::string log;         // --log: JSON Lines records of the run (log.h)
  int64_t log_every = 10;  // a step record every this many steps
  bool eval = false;       // --eval: evaluate the --load checkpoint on the test set instead of training
  bool verify = false;
  bool quiet = false;
  // Provenance for the report, set by parse_train_args: the command as a shell would re-run it and
  // when it started (UTC, ISO 8601).
  std::string command_line, started_at;
};

struct EpochRecord {
  int epoch = 0;
  int64_t steps = 0, images = 0;
  double train_loss = 0, train_accuracy = 0;
  double test_loss = 0, test_accuracy = 0;  // NaN for an empty test set (the report writes null)
  double seconds = 0, images_per_second = 0;
};

struct TrainResult {
  std::vector<EpochRecord> epochs;
  double train_loss = 0, test_accuracy = 0, images_per_second = 0;  // test_accuracy: NaN as above
  double verify_max_diff = -1, verify_tolerance = 0;                // -1: not verified
  double load_wait_seconds = 0;  // the trainer's wait for its batches (--workers 0: their assembly)
  bool verify_ok = true;
  bool run_ahead = false;   // each step started before the one before it finished (runs_ahead, setup.h)
  std::string log_failure;  // why --log stopped early (Run::log_failure), or empty
};

// Throws UsageError for bad input, DeviceError / NumericalError for failures during training.
// group: the job's processes when an MPI launcher started this one (process_group.h); null in one
// process. Across processes rank 0 alone writes the checkpoint, report, trace (every rank's events) and
// log, reads --resume and runs --verify's one-device reference.
TrainResult train(const TrainOptions& opt, ProcessGroup* group = nullptr);

struct EvalResult {
  int64_t images = 0;
  double test_loss = 0, test_accuracy = 0;
};

// --eval: the --load checkpoint evaluated on the test set by the devices and engine a run would
// train on (data-parallel inference), without training. Prints "test acc ... test loss ..." and
// writes the --report of the evaluation where one is asked for. Throws as train() does.
EvalResult evaluate_checkpoint(const TrainOptions& opt);

// The hint a diverged run's message ends with: " (try a smaller --lr)", or the --weight-decay one
// when lr * weight_decay is past 2 (1 + momentum), where the decay alone makes the weights grow.
std::string divergence_hint(const TrainOptions& o);

}  // namespace dp
