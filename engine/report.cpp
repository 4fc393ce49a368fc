#include "engine/report.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "engine/error.h"

namespace dp {

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
    nlohmann::json by_collective = nlohmann::json::object();
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
  std::snprintf(line, sizeof line, "%-8s %12s %12s %12s %12s %12s %12s %12s %14s %14s\n", "device", "peak", "parameters",
                "gradients", "optimizer", "activations", "inputs", "comm", "sent/step", "received/step");
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
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", std::string("dp ") + sync_name(e.config().sync)}}}});
  for (int r = 0; r < e.size(); ++r) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"name", e.device(r).name()}}}});
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
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    if (!f) throw UsageError(path + ": cannot write (is the directory there and writable?)");
    f << j.dump(2) << "\n";
    if (!f) throw UsageError(path + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw UsageError(path + ": cannot move into place: " + ec.message());
}

}  // namespace dp
