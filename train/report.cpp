#include "train/report.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <vector>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "train/output_files.h"
#include "train/setup.h"

namespace dp {
namespace {

// Rows of cells as columns two spaces apart, each as wide as its widest cell: the first column
// left-aligned, the numbers right-aligned. Two spaces, because a cell ("1.5 KiB") holds one.
std::string columns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(rows.at(0).size(), 0);
  for (auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  std::string out;
  for (auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      std::string fill(width[i] - row[i].size(), ' ');
      out += i == 0 ? row[i] + fill : "  " + fill + row[i];
    }
    out += "\n";
  }
  return out;
}

// What the two per-device memory breakdowns are, in the report itself: they often hold the same
// numbers, and a reader should not have to guess why there are two.
nlohmann::json device_notes() {
  return {
      {"peak_by_category", "bytes of each category at the moment the device's total peaked: they sum to peak_bytes"},
      {"category_peaks",
       "each category's own peak over the run, reached at different moments: the most a category held, not a "
       "breakdown of peak_bytes; it equals peak_by_category where every category peaks at the same moment"},
      {"reserved_peak_bytes",
       "CUDA devices only: the most the device's memory pool held from the driver, what was allocated and what it "
       "kept for reuse (PyTorch's max_memory_reserved; peak_bytes is its max_memory_allocated)"}};
}

// The all-reduce algorithm beside the strategy: "ring" or "naive" under allreduce, null under scatter
// (which reduces to device 0 and runs no all-reduce).
nlohmann::json all_reduce_json(const TrainOptions& o) {
  return find_strategy(o.sync).takes_all_reduce_algorithm() ? nlohmann::json(all_reduce_name(o.all_reduce))
                                                            : nlohmann::json();
}

}  // namespace

const char* version() { return DP_VERSION; }

double json_float(float v) {
  if (!std::isfinite(v)) return double(v);  // nlohmann writes null, as for any non-finite double
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);  // the shortest text that reads back as v
  double d = double(v);
  if (ec == std::errc()) std::from_chars(buf, end, d);
  return d;
}

std::string utc_timestamp(std::chrono::system_clock::time_point t) {
  const std::time_t secs = std::chrono::system_clock::to_time_t(t);
  std::tm utc{};
  gmtime_r(&secs, &utc);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

nlohmann::json run_config(const TrainOptions& o, const ModelSpec& spec, int64_t steps) {
  return {{"model", spec.name},
          {"width", spec.width},
          {"parameters", spec.param_count},
          {"batch", o.batch},
          {"accumulate", o.accumulate},
          {"grad_dtype", dtype_name(o.grad_dtype)},
          {"step_images", o.step_images()},
          {"steps", steps},
          {"optimizer", optimizer_name(o.optimizer)},
          {"lr", json_float(o.lr)},
          {"lr_schedule", lr_schedule_name(o.lr_schedule)},
          {"warmup", o.warmup},
          {"momentum", o.optimizer == Optimizer::sgd ? nlohmann::json(json_float(o.momentum)) : nlohmann::json()},
          {"betas",
           o.optimizer == Optimizer::sgd ? nlohmann::json() : nlohmann::json{json_float(o.beta1), json_float(o.beta2)}},
          {"eps", o.optimizer == Optimizer::sgd ? nlohmann::json() : nlohmann::json(json_float(o.eps))},
          {"weight_decay", json_float(o.weight_decay)},
          {"clip_grad_norm", o.clip_grad_norm > 0 ? nlohmann::json(json_float(o.clip_grad_norm)) : nlohmann::json()},
          {"seed", o.seed},
          {"split", split_name(o.split)},
          {"bucket_kb", o.bucket_kb},
          {"sync_bn", o.sync_bn},
          {"backend", o.devices.backend},
          {"device_memory", o.devices.memory_cap}};
}

nlohmann::json train_report(const TrainOptions& o, const ModelSpec& spec, int epochs, int64_t steps,
                            const TrainResult& result, Engine& engine) {
  nlohmann::json config = run_config(o, spec, steps);
  config.update({{"epochs", epochs},
                 {"shuffle", o.shuffle},
                 {"data", o.data},
                 {"limit_train", o.limit_train},
                 {"limit_test", o.limit_test},
                 {"workers", o.workers},
                 {"prefetch", o.prefetch},
                 {"graphs", o.graphs},
                 {"gpus", o.devices.all ? nlohmann::json("all") : nlohmann::json(o.devices.ids)},
                 {"strategy", o.sync},
                 {"allreduce", all_reduce_json(o)}});
  // What --backend resolved to (auto picks cuda or the simulated cpu devices), not what was asked.
  nlohmann::json names = nlohmann::json::array();
  for (int r = 0; r < engine.size(); ++r) names.push_back(engine.device(r).name());
  config["backend_requested"] = o.devices.backend;
  config["backend"] = kind_name(engine.device(0).kind());
  config["device_names"] = names;
  config["collectives"] = engine.comm().transport();
  config["run_ahead"] = result.run_ahead;  // as resolved
  nlohmann::json epochs_json = nlohmann::json::array();
  for (auto& e : result.epochs)
    epochs_json.push_back({{"epoch", e.epoch},
                           {"steps", e.steps},
                           {"images", e.images},
                           {"train_loss", e.train_loss},
                           {"train_accuracy", e.train_accuracy},
                           {"test_loss", e.test_loss},
                           {"test_accuracy", e.test_accuracy},
                           {"seconds", e.seconds},
                           {"images_per_second", e.images_per_second}});
  nlohmann::json j = {{"version", version()},
                      {"command_line", o.command_line},
                      {"started_at", o.started_at},
                      {"config", config},
                      {"strategy", o.sync},
                      {"allreduce", all_reduce_json(o)},
                      {"split", split_name(o.split)},
                      {"bucket_kb", o.bucket_kb},
                      {"epochs", epochs_json},
                      {"train_loss", result.train_loss},
                      {"test_accuracy", result.test_accuracy},
                      {"images_per_second", result.images_per_second},
                      {"load_wait_seconds", result.load_wait_seconds},
                      {"devices", device_report(engine)},
                      {"notes", device_notes()}};
  if (o.accumulate > 1) j["accumulation"] = accumulation_note(o);  // what it does under this strategy
  if (o.graphs) j["graphs"] = {{"captures", engine.graph_captures()}, {"launches", engine.graph_launches()}};
  if (result.run_ahead) j["run_ahead"] = {{"steps_started_ahead", engine.steps_started_ahead()}};
  if (o.verify)
    j["verify"] = {
        {"max_abs_diff", result.verify_max_diff}, {"tolerance", result.verify_tolerance}, {"ok", result.verify_ok}};
  return j;
}

nlohmann::json device_report(Engine& e) {
  nlohmann::json out = nlohmann::json::array();
  for (int r = 0; r < e.size(); ++r) {
    Device& d = e.device(r);
    LedgerSnapshot s = d.ledger().snapshot();
    nlohmann::json cats = nlohmann::json::object(), peaks = nlohmann::json::object();
    for (int c = 0; c < kCategories; ++c) {
      cats[category_name(Category(c))] = s.at_peak[c];
      peaks[category_name(Category(c))] = s.peak[c];
    }
    Traffic t = e.recorder().step_traffic(r);
    nlohmann::json entry = {{"rank", r},
                            {"id", d.id()},
                            {"name", d.name()},
                            {"kind", kind_name(d.kind())},
                            {"peak_bytes", s.total_peak},
                            {"peak_by_category", cats},
                            {"category_peaks", peaks},
                            {"bytes_sent_per_step", t.sent},
                            {"bytes_received_per_step", t.received}};
    if (const int64_t reserved = d.reserved_peak(); reserved >= 0) entry["reserved_peak_bytes"] = reserved;
    out.push_back(std::move(entry));
  }
  return out;
}

std::string device_table(const nlohmann::json& devices, const std::string& memory_note) {
  const bool job = !devices.empty() && devices[0].contains("process");
  auto bytes = [](const nlohmann::json& d, const char* key, int c) {
    return d[key][category_name(Category(c))].get<int64_t>();
  };
  auto booked = [&](int c) {
    int64_t largest = 0;
    for (const nlohmann::json& d : devices) largest = std::max(largest, bytes(d, "category_peaks", c));
    return shown(Category(c), largest);
  };
  // CUDA devices: what their memory pools held at most, beside the peak (-: a device without one).
  const bool reserved = std::any_of(devices.begin(), devices.end(),
                                    [](const nlohmann::json& d) { return d.contains("reserved_peak_bytes"); });
  std::vector<std::vector<std::string>> rows = {{"device", "peak"}};
  if (reserved) rows[0].push_back("pool held");
  for (int c = 0; c < kCategories; ++c)
    if (booked(c)) rows[0].push_back(category_name(Category(c)));
  rows[0].insert(rows[0].end(), {"sent/step", "received/step"});
  for (const nlohmann::json& d : devices) {
    // In a job: "p1 sim:0", the process (mpirun's rank) before its device.
    std::string name;  // appended piece by piece: GCC 12 warns (-Wrestrict) at "p" + to_string(...)
    if (job) name += 'p' + std::to_string(d["process"].get<int>()) + ' ';
    name += d["name"].get<std::string>();
    std::vector<std::string> row = {name, format_bytes(d["peak_bytes"].get<int64_t>())};
    if (reserved)
      row.push_back(d.contains("reserved_peak_bytes") ? format_bytes(d["reserved_peak_bytes"].get<int64_t>()) : "-");
    for (int c = 0; c < kCategories; ++c)
      if (booked(c)) row.push_back(format_bytes(bytes(d, "peak_by_category", c)));
    row.insert(row.end(), {format_bytes(d["bytes_sent_per_step"].get<int64_t>()),
                           format_bytes(d["bytes_received_per_step"].get<int64_t>())});
    rows.push_back(row);
  }
  std::string out = columns(rows) + "(memory by category at each device's peak: the categories add up to the peak" +
                    (reserved ? "; pool held: the most its memory pool kept from the driver" : "") + ")\n";
  // Device 0's peak over the mean peak of the others: nn.DataParallel's burden in one number.
  if (devices.size() < 2) return out;
  double others = 0;
  for (size_t r = 1; r < devices.size(); ++r) others += devices[r]["peak_bytes"].get<double>();
  others /= double(devices.size() - 1);
  const double skew = others > 0 ? devices[0]["peak_bytes"].get<double>() / others : 0;
  char line[400];
  std::snprintf(line, sizeof line, "skew: %s's peak / the mean of the others' = %.3f (%s)\n", rows[1][0].c_str(), skew,
                memory_note.c_str());
  return out + line;
}

std::string device_table(Engine& e) { return device_table(device_report(e), e.strategy().memory_note(e.config())); }

void write_json(const std::string& path, const nlohmann::json& j) {
  std::string text = j.dump(2) + "\n";
  write_file_atomically(path, {text});
}

}  // namespace dp
