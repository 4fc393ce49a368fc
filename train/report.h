// Machine-readable records of a run: the JSON report (--report) and the run configuration every JSON
// record shares (dp_bench's too). The Chrome trace (--trace) is trace.h's.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"
#include "models/model.h"
#include "train/trainer.h"

namespace dp {

// dp's version, CMake's project(VERSION): --version prints it, the report and checkpoints record it.
const char* version();
// A float setting as the double with the float's shortest decimal (0.1f -> 0.1, not the widened
// 0.10000000149011612), so a JSON record shows the value as it was given and reads back to the same
// float. Every float-typed value in a record goes through it.
double json_float(float v);
// "2024-05-01T12:34:56Z": a time in UTC, ISO 8601, to the second.
std::string utc_timestamp(std::chrono::system_clock::time_point t);

// The "config" object of every JSON record (dp_train --report, dp_bench compare and skew --json):
// model, parameters, batch, steps, lr, momentum, weight_decay, seed, split, bucket_kb, backend and
// device_memory, under the same keys everywhere so one script reads them all. `steps` is the steps
// the run takes. A record adds what only it has: dp_train its data and strategy, compare its
// warm-up, skew its categories.
nlohmann::json run_config(const TrainOptions& o, const ModelSpec& spec, int64_t steps);

// dp_train's --report: the config (run_config plus epochs, data, workers, devices and strategy, with
// the backend the run resolved to in place of the requested one), the version, command line and start
// time, the epochs, the final figures (load_wait_seconds among them), every device's memory and
// traffic, and the --verify result.
nlohmann::json train_report(const TrainOptions& o, const ModelSpec& spec, int epochs, int64_t steps,
                            const TrainResult& result, Engine& engine);

// Per device: rank, id, name, kind, peak_bytes, peak_by_category (every category at the moment the
// total peaked: they sum to peak_bytes), category_peaks (each category's own peak over the run, at
// different moments: they need not sum to anything), bytes_sent_per_step, bytes_received_per_step;
// on CUDA devices reserved_peak_bytes (Device::reserved_peak: what the memory pool held at most).
nlohmann::json device_report(Engine& engine);
// The per-device table dp_train prints at the end: the peak and, in one column per category, the
// bytes at that moment (peak_by_category: the columns add up to the peak), then bytes per step; a
// "pool held" column after the peak where a device reports reserved_peak_bytes.
// In a job, every process's devices (gather_devices' records, named "p<process> <device>") and the skew
// over all of them.
std::string device_table(Engine& engine);
std::string device_table(const nlohmann::json& devices, const std::string& memory_note);
// Writes beside the target then renames (write_file_atomically), so a reader never sees half a file.
void write_json(const std::string& path, const nlohmann::json& j);

}  // namespace dp
