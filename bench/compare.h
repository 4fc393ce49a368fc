// dp_bench compare's results, measured in compare.cpp and reported (table, JSON) in
// compare_report.cpp.
#pragma once

#include <array>
#include <chrono>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/commands.h"

namespace dp::bench {

// A column of the comparison: a strategy and, where it takes one, its all-reduce algorithm.
struct Design {
  const Strategy* strategy;
  AllReduceAlgorithm all_reduce;
  std::string name;  // the column's heading and the record's "strategy"
};

// Every strategy of the registry in its order; one that takes an all-reduce algorithm twice: first
// d2l's hand-written one (reduce to device 0, broadcast back), named "naive", then the ring under
// its own name. Today: scatter (nn.DataParallel), naive, allreduce (DDP's ring).
std::vector<Design> designs();

struct StrategyRun {
  Design design;
  std::vector<double> step_seconds;
  double images_per_second = 0, loss = 0;
  std::vector<std::array<double, kPhases>> phase_seconds;  // per device, per step
  std::vector<CollectiveTraffic> collectives;              // the byte model
  std::vector<Traffic> measured, predicted;
  std::vector<LedgerSnapshot> ledgers;
  std::vector<Bucket> buckets;
  double comm_model_seconds = 0, comm_measured_seconds = 0;
  bool match = true;
  nlohmann::json trace;                          // its engine's events, times in µs from `origin`
  std::chrono::steady_clock::time_point origin;  // its engine's start_time()
};

struct DeviceCountRun {
  int n = 0;
  DeviceKind kind = DeviceKind::simulated;
  std::vector<std::string> names;
  std::vector<int> sizes;
  AlphaBeta ab;
  std::vector<StrategyRun> strategies;
};

// Every strategy on one set of devices, o.batch split over them (o.bucket_kb for those that take
// buckets); their trace lanes are processes first_pid, first_pid + 1, ...
DeviceCountRun run_devices(const std::vector<Device*>& devices, const ModelSpec& spec, const CompareOptions& o,
                           const SyntheticData& data, const std::vector<float>& init, int first_pid);

// One set of devices: the header line, then a table with a column per strategy (kStrategies' order).
void print_run(const DeviceCountRun& run, const ModelSpec& spec, const CompareOptions& o);
// --sweep-devices: images/s per device count.
void print_scaling(const std::vector<DeviceCountRun>& runs, int batch);
// The record: command, config (run_config, with the resolved backend and devices), every run,
// and the scaling over device counts.
nlohmann::json compare_json(const CompareOptions& o, const ModelSpec& spec, const std::vector<DeviceCountRun>& runs,
                            bool all_match);

}  // namespace dp::bench
