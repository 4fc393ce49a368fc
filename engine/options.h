// Command-line parsing shared by the front ends (dp_train, dp_bench): CLI11 underneath, every bad
// argument turned into a UsageError that says what is wrong and what is accepted.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/trainer.h"

namespace dp {

// "512M", "2G", "1.5GiB", "4096" -> bytes. Throws UsageError naming the flag.
int64_t parse_bytes(const std::string& text, const std::string& flag);
// "12345" -> 12345: a seed, exactly 0..2^64-1; a sign, a fraction, an exponent or a larger value
// throws UsageError naming the flag (nothing wraps).
uint64_t parse_seed(const std::string& text, const std::string& flag);
// "0.1", "1e-3" -> the float; a value float cannot hold (underflows to 0, overflows to infinity) or
// text that is not a number throws UsageError naming the flag. NaN, infinity and negative values
// pass: the range checks after parsing name those.
float parse_float(const std::string& text, const std::string& flag);
// "0,1,2" -> {0, 1, 2}. Throws UsageError naming the flag.
std::vector<int> parse_ids(const std::string& text, const std::string& flag);

// The device flags every front end shares: --gpus, --devices, --backend,
// --device-memory, --allow-shared-device. finish() turns their text into a DeviceConfig.
struct DeviceFlags {
  std::string gpus = "0", backend = "auto", memory;
  int devices = 0;
  bool allow_shared = false;
  void add(CLI::App& app);
  DeviceConfig finish(const CLI::App& app) const;
};

// Parses dp_train's arguments. Returns false when --help or --version was printed.
bool parse_train_args(int argc, const char* const* argv, TrainOptions& out);

// Runs a CLI11 parse and rethrows its errors as UsageError (help and version return false).
bool run_parser(CLI::App& app, int argc, const char* const* argv);

}  // namespace dp
