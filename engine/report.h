// Machine-readable records of a run: the JSON report (--report) and the Chrome trace (--trace).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"

namespace dp {

// Per device: id, kind, peak_bytes, peak_by_category, bytes_sent_per_step, bytes_received_per_step.
nlohmann::json device_report(Engine& engine);
// The per-device table dp_train prints at the end: peak memory by category, bytes per step.
std::string device_table(Engine& engine);
// Chrome trace-event JSON: one process, one lane (tid) per device, one complete event per phase.
nlohmann::json trace_json(Engine& engine);
// Writes beside the target then renames, so a reader never sees half a file.
void write_json(const std::string& path, const nlohmann::json& j);

}  // namespace dp
