// The CLI11 side of the front ends' parsing (options.h holds the rest): an exact integer transform,
// the device flags every front end shares, and a parse whose errors become UsageErrors. Included by
// train/options.cpp and bench/dp_bench.cpp only.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "engine/device.h"

namespace dp {

// A CLI11 transform that reads an integer flag as a decimal T exactly, refusing what does not fit
// (CLI11 alone saturates at the type's limit and reads "010" as octal). T: int or int64_t.
template <typename T>
CLI::Validator exact_integer();

// The device flags every front end shares: --gpus, --devices, --backend,
// --device-memory, --allow-shared-device. finish() turns their text into a DeviceConfig.
struct DeviceFlags {
  std::string gpus = "all", backend = "auto", memory;
  int devices = 0;
  bool allow_shared = false;
  void add(CLI::App& app);
  DeviceConfig finish(const CLI::App& app) const;
};

// Runs a CLI11 parse and rethrows its errors as UsageError. --help and --version (set_version_flag)
// print to stdout and return false.
bool run_parser(CLI::App& app, int argc, const char* const* argv);

}  // namespace dp
