// dp_bench bn's runs: bn.cpp trains them; bn_report.cpp prints them, sets sync against local, draws the
// conclusion from the numbers and writes the record.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/commands.h"
#include "train/data.h"

namespace dp::bench {

struct BnRun {
  int per_device = 0, devices = 1;
  std::string mode;  // "reference", "local", "sync"
  double test_accuracy = 0, test_loss = 0;
  double train_loss = 0;  // the mean over the last (up to) 10 steps
  std::vector<float> running;
  double distance = 0;  // ||running - reference's|| / ||reference's||, over every running mean and variance
  std::vector<double> distance_by_buffer;  // the same per ModelSpec::buffers entry
  std::vector<double> step_ms;
  std::vector<std::string> names;
  std::vector<Traffic> measured, predicted, bn_model;  // per rank; bn_model: BatchNorm's part of predicted
  bool match = true;
  double seconds = 0;  // the whole run: engine, steps, evaluation
  double median_ms() const { return median(step_ms); }
  const Traffic* peer(const std::vector<Traffic>& t) const { return t.size() > 1 ? &t[1] : nullptr; }
};

struct BnData {
  Dataset train, test;
  int64_t per_epoch = 0;  // full batches per epoch; the epoch's last partial batch is dropped
};

// What SyncBatchNorm moves and costs beyond local BatchNorm at one per-device batch.
struct BnExtra {
  int per_device = 0, devices = 0;
  Traffic dev0, peer;
  bool has_peer = false;
  double ms = 0;
};

struct Conclusion {
  std::string text;
  double sync_mean = 0, noise = 0, threshold = 0;  // accuracies, fractions of 1
  int within_from = 0;        // the smallest per-device batch from which local is within the threshold; 0: none
  std::map<int, double> gap;  // per-device batch -> sync_mean - local's accuracy
};

// The table of every run beside the reference.
void print_runs(const BnRun& ref, const std::vector<BnRun>& runs);
std::vector<BnExtra> extras(const std::vector<BnRun>& runs);
void print_extras(const std::vector<BnExtra>& ex, const ModelSpec& spec);
// False when a run's bytes are off the model.
bool print_bytes_check(const BnRun& ref, const std::vector<BnRun>& runs);
Conclusion conclude(const BnRun& ref, const std::vector<BnRun>& runs, int steps);
// The record (--json, the plot's input).
nlohmann::json bn_json(const BnOptions& o, const ModelSpec& spec, const BnData& data, const BnRun& ref,
                       const std::vector<BnRun>& runs, const std::vector<BnExtra>& ex, const Conclusion& c, bool ok,
                       bool cuda);

}  // namespace dp::bench
