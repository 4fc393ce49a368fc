#include "engine/report.h"

#include <cstdio>

#include "engine/error.h"
#include "engine/paths.h"

namespace dp {

nlohmann::json run_config(const TrainOptions& o, const ModelSpec& spec, int64_t steps) {
  return {{"model", spec.name},
          {"parameters", spec.param_count},
          {"batch", o.batch},
          {"steps", steps},
          {"lr", o.lr},
          {"momentum", o.momentum},
          {"weight_decay", o.weight_decay},
          {"seed", o.seed},
          {"split", split_name(o.split)},
          {"bucket_kb", o.bucket_kb},
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
                 {"gpus", o.devices.ids},
                 {"strategy", sync_name(o.sync)}});
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
  nlohmann::json j = {{"config", config},
                      {"strategy", sync_name(o.sync)},
                      {"split", split_name(o.split)},
                      {"bucket_kb", o.bucket_kb},
                      {"epochs", epochs_json},
                      {"train_loss", result.train_loss},
                      {"test_accuracy", result.test_accuracy},
                      {"images_per_second", result.images_per_second},
                      {"devices", device_report(engine)}};
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
    Traffic t = e.step_traffic(r);
    out.push_back({{"rank", r},
                   {"id", d.id()},
                   {"name", d.name()},
                   {"peak_bytes", s.total_peak},
                   {"peak_by_category", cats},
                   {"category_peaks", peaks},
                   {"bytes_sent_per_step", t.sent},
                   {"bytes_received_per_step", t.received}});
  }
  return out;
}

std::string device_table(Engine& e) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-8s %12s %12s %12s %12s %12s %12s %12s %14s %14s\n", "device", "peak",
                "parameters", "gradients", "optimizer", "activations", "inputs", "comm", "sent/step", "received/step");
  out += line;
  for (int r = 0; r < e.size(); ++r) {
    Device& d = e.device(r);
    LedgerSnapshot s = d.ledger().snapshot();
    auto at = [&](Category c) { return format_bytes(s.at_peak[int(c)]); };
    Traffic t = e.step_traffic(r);
    std::snprintf(line, sizeof line, "%-8s %12s %12s %12s %12s %12s %12s %12s %14s %14s\n", d.name().c_str(),
                  format_bytes(s.total_peak).c_str(), at(Category::parameters).c_str(), at(Category::gradients).c_str(),
                  at(Category::optimizer).c_str(), at(Category::activations).c_str(),
                  format_bytes(s.at_peak[int(Category::inputs)] + s.at_peak[int(Category::outputs)]).c_str(),
                  at(Category::comm).c_str(), format_bytes(t.sent).c_str(), format_bytes(t.received).c_str());
    out += line;
  }
  return out;
}

nlohmann::json trace_json(Engine& e) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", 0},
                    {"args", {{"name", std::string("dp ") + sync_name(e.config().sync)}}}});
  for (int r = 0; r < e.size(); ++r) {
    events.push_back(
        {{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"name", e.device(r).name()}}}});
    for (const Span& s : e.spans()[r])
      events.push_back({{"name", phase_name(s.phase, e.config().sync)},
                        {"cat", "phase"},
                        {"ph", "X"},
                        {"pid", 0},
                        {"tid", r},
                        {"ts", s.start_us},
                        {"dur", s.end_us - s.start_us},
                        {"args", {{"step", s.step}}}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::string text = j.dump(2) + "\n";
  write_file_atomically(path, {text});
}

}  // namespace dp
