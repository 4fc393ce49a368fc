// Machine-readable records of a run: the JSON report (--report), the run configuration every JSON
// record shares (dp_bench's too), and the Chrome trace (--trace).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"
#include "engine/trainer.h"
#include "models/model.h"

namespace dp {

// The "config" object of every JSON record (dp_train --report, dp_bench compare and skew --json):
// model, parameters, batch, steps, lr, momentum, weight_decay, seed, split, bucket_kb, backend and
// device_memory, under the same keys everywhere so one script reads them all. `steps` is the steps
// the run takes. A record adds what only it has: dp_train its data and strategy, compare its
// warm-up, skew its categories.
nlohmann::json run_config(const TrainOptions& o, const ModelSpec& spec, int64_t steps);

// dp_train's --report: the config (run_config plus epochs, data, devices and strategy), the epochs,
// the final figures, every device's memory and traffic, and the --verify result.
nlohmann::json train_report(const TrainOptions& o, const ModelSpec& spec, int epochs, int64_t steps,
                            const TrainResult& result, Engine& engine);

// Per device: id, kind, peak_bytes, peak_by_category, bytes_sent_per_step, bytes_received_per_step.
nlohmann::json device_report(Engine& engine);
// The per-device table dp_train prints at the end: peak memory by category, bytes per step.
std::string device_table(Engine& engine);
// Chrome trace-event JSON: one process, one lane (tid) per device, one complete event per phase.
nlohmann::json trace_json(Engine& engine);
// Writes beside the target then renames (write_file_atomically), so a reader never sees half a file.
void write_json(const std::string& path, const nlohmann::json& j);

}  // namespace dp
