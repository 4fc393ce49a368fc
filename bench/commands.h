// dp_bench's subcommands (compare, comm, skew): their options as parsed by dp_bench.cpp, and the
// functions that run them. Each returns the process exit code: 0 fine, 1 a check failed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/engine.h"

namespace dp::bench {

struct CompareOptions {
  DeviceConfig devices;
  std::string model = "lenet";
  int batch = 256, steps = 20, warmup = 3;
  int64_t bucket_kb = 0;  // the allreduce engine's buckets (scatter has none)
  Split split = Split::even;
  uint64_t seed = 0;
  float lr = 0.1f, momentum = 0.9f;  // dp_train's defaults
  std::vector<int> sweep;            // --sweep-devices: device counts
  double alpha_us = -1, beta_gbps = -1;
  int repeats = 5;  // all_reduce sweeps for the alpha-beta fit, each fitted alone: the median is used
  std::string json, trace, plot;
  std::string command;  // as typed, for the records
};

struct CommOptions {
  DeviceConfig devices;
  int64_t min_bytes = 8, max_bytes = 256ll << 20;
  int iters = 20;
  int repeats = 5;  // all_reduce sweeps for the alpha-beta fit: the median and the spread
  double budget_seconds = 0.1;
  std::string json, plot;
  std::string command;
};

struct SkewOptions {
  DeviceConfig devices;
  std::string model = "lenet";
  int batch = 256, steps = 2;
  float momentum = 0.9f;  // --optimizer momentum; sgd sets 0 (no momentum buffer at all)
  Split split = Split::even;
  uint64_t seed = 0;
  std::string json, plot;
  std::string command;
};

int run_compare(const CompareOptions& o);
int run_comm(const CommOptions& o);
int run_skew(const SkewOptions& o);

}  // namespace dp::bench
