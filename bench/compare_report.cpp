// dp_bench compare's report: the table per set of devices, the scaling table, the JSON record.
#include <algorithm>
#include <cstdio>

#include "bench/compare.h"
#include "train/report.h"

namespace dp::bench {
namespace {

std::string device_range(const std::vector<std::string>& names) {
  if (names.size() == 1) return names[0];
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? "," : "") + names[i];
  return s;
}

std::string sizes_text(const std::vector<int>& sizes) {
  std::string s;
  for (size_t i = 0; i < sizes.size(); ++i) {  // two appends: GCC 12 warns (-Wrestrict) at "+" + to_string
    if (i) s += '+';
    s += std::to_string(sizes[i]);
  }
  return s;
}

}  // namespace

namespace {

// A table with a column per strategy: each row's cells come from asking every strategy's run.
class StrategyTable {
 public:
  explicit StrategyTable(const DeviceCountRun& run) : run_(run) {
    std::vector<std::string> head{""};
    for (auto& s : run.strategies) head.push_back(s.design.name);
    t_.row(head);
  }
  template <class Cell>
  void add(const std::string& label, Cell cell) {
    std::vector<std::string> r{label};
    for (auto& s : run_.strategies) r.push_back(cell(s));
    t_.row(r);
  }
  void heading(const std::string& text) { t_.row({text}); }
  std::string str() const { return t_.str(); }

 private:
  const DeviceCountRun& run_;
  Table t_;
};

void add_phases(StrategyTable& t) {
  t.heading("time per step by phase, ms (device 0 / max over devices)");
  for (int p = 0; p < kPhases; ++p) {
    // The phase as each strategy names it: "reduce | all-reduce".
    std::string label;
    for (const Strategy* s : strategies())
      if (const std::string name = s->phase_name(Phase(p)); label.find(name) == std::string::npos)
        label += (label.empty() ? "" : " | ") + name;
    t.add("  " + label, [&](const StrategyRun& s) -> std::string {
      if (!s.design.strategy->has_phase(Phase(p))) return "-";
      double worst = 0;
      for (auto& d : s.phase_seconds) worst = std::max(worst, d[p]);
      return ms(s.phase_seconds[0][p]) + " / " + ms(worst);
    });
  }
}

void add_bytes_and_memory(StrategyTable& t, const DeviceCountRun& run) {
  t.heading("bytes per device per step, sent / received (measured, then the byte model)");
  for (int r = 0; r < run.n; ++r) {
    t.add("  " + run.names[r] + " measured",
          [&](const StrategyRun& s) { return commas(s.measured[r].sent) + " / " + commas(s.measured[r].received); });
    t.add("  " + run.names[r] + " model", [&](const StrategyRun& s) {
      bool ok = s.measured[r].sent == s.predicted[r].sent && s.measured[r].received == s.predicted[r].received;
      return commas(s.predicted[r].sent) + " / " + commas(s.predicted[r].received) + (ok ? " match" : " MISMATCH");
    });
  }
  t.heading("peak memory per device (ledger)");
  for (int r = 0; r < run.n; ++r)
    t.add("  " + run.names[r], [&](const StrategyRun& s) { return format_bytes(s.ledgers[r].total_peak); });
}

}  // namespace

void print_run(const DeviceCountRun& run, const ModelSpec& spec, const CompareOptions& o) {
  const int n = run.n;
  const char* kind = run.kind == DeviceKind::cuda ? "CUDA" : "simulated";
  std::printf(
      "\n%s (P = %s parameters), global batch %d = %s over %d %s device%s (%s)%s, %d measured steps after %d "
      "warm-up, seed %llu%s%s%s; no prefetch (dp_train --no-prefetch: each step's upload is its load phase)\n\n",
      spec.title().c_str(), commas(spec.param_count).c_str(), o.batch, sizes_text(run.sizes).c_str(), n, kind,
      n > 1 ? "s" : "", device_range(run.names).c_str(),
      o.accumulate > 1 ? (", " + std::to_string(o.accumulate) + " micro-batches a step (--accumulate; bytes and " +
                          "time per optimizer step; scatter reduces every micro-batch)")
                             .c_str()
                       : "",
      o.steps, o.warmup, (unsigned long long)o.seed,
      o.bucket_kb > 0 ? (", naive and allreduce buckets of " + std::to_string(o.bucket_kb) + " KiB").c_str() : "",
      o.clip_grad_norm > 0 ? (", --clip-grad-norm " + fixed(o.clip_grad_norm, 3)).c_str() : "",
      o.grad_dtype != DType::fp32
          ? (std::string(", gradients in ") + dtype_name(o.grad_dtype) + " (--grad-dtype; scatter's in fp32)").c_str()
          : "");
  StrategyTable t(run);
  t.add("step time, median / min / max (ms)", [&](const StrategyRun& s) {
    auto [lo, hi] = std::minmax_element(s.step_seconds.begin(), s.step_seconds.end());
    return ms(median(s.step_seconds)) + " / " + ms(*lo) + " / " + ms(*hi);
  });
  t.add("images/s", [&](const StrategyRun& s) { return commas(int64_t(s.images_per_second + 0.5)); });
  t.add("loss of the last step", [&](const StrategyRun& s) { return fixed(s.loss, 6); });
  add_phases(t);
  t.heading("communication per step, ms");
  t.add(run.ab.repeats.empty() ? "  α-β model (below)" : "  α-β model, median fit (below)",
        [&](const StrategyRun& s) { return run.ab.valid() ? ms(s.comm_model_seconds, 3) : std::string("-"); });
  t.add("  measured: communication phases, max over devices",
        [&](const StrategyRun& s) { return ms(s.comm_measured_seconds, 3); });
  add_bytes_and_memory(t, run);
  std::printf("%s", t.str().c_str());
  if (run.ab.valid())
    std::printf(
        "α-β model: each collective of the step costs α + (bytes its busiest rank sends or receives) / β, with\n"
        "%s\n%s\n",
        run.ab.describe().c_str(), run.ab.source.c_str());
}

namespace {

// The steps this benchmark times as a training run's options, for the record's "config" (the
// devices are --gpus; --sweep-devices adds runs over others).
TrainOptions as_training(const CompareOptions& o) {
  TrainOptions t;
  t.model = o.model, t.width = o.width, t.batch = o.batch, t.lr = o.lr, t.momentum = o.momentum, t.seed = o.seed;
  t.devices = o.devices, t.split = o.split, t.bucket_kb = o.bucket_kb, t.clip_grad_norm = o.clip_grad_norm;
  t.accumulate = o.accumulate, t.grad_dtype = o.grad_dtype;
  return t;
}

// A strategy's phases, each on device 0, the slowest device and every device.
nlohmann::json phases_json(const StrategyRun& s) {
  nlohmann::json phases = nlohmann::json::array();
  for (int p = 0; p < kPhases; ++p) {
    if (!s.design.strategy->has_phase(Phase(p))) continue;
    nlohmann::json per = nlohmann::json::array();
    double worst = 0;
    for (auto& d : s.phase_seconds) per.push_back(d[p] * 1e3), worst = std::max(worst, d[p]);
    phases.push_back({{"phase", s.design.strategy->phase_name(Phase(p))},
                      {"device0_ms", s.phase_seconds[0][p] * 1e3},
                      {"max_ms", worst * 1e3},
                      {"per_device_ms", per}});
  }
  return phases;
}

// Each device's bytes against the model, and its memory at its peak.
nlohmann::json devices_json(const DeviceCountRun& run, const StrategyRun& s) {
  nlohmann::json devices = nlohmann::json::array();
  for (int r = 0; r < run.n; ++r) {
    nlohmann::json cats = nlohmann::json::object();
    for (int c = 0; c < kCategories; ++c) cats[category_name(Category(c))] = s.ledgers[r].at_peak[c];
    devices.push_back(
        {{"rank", r},
         {"name", run.names[r]},
         {"bytes_sent", s.measured[r].sent},
         {"bytes_received", s.measured[r].received},
         {"predicted_sent", s.predicted[r].sent},
         {"predicted_received", s.predicted[r].received},
         {"match", s.measured[r].sent == s.predicted[r].sent && s.measured[r].received == s.predicted[r].received},
         {"peak_bytes", s.ledgers[r].total_peak},
         {"peak_by_category", cats}});
  }
  return devices;
}

nlohmann::json collectives_json(const std::vector<CollectiveTraffic>& collectives) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& c : collectives) {
    nlohmann::json per = nlohmann::json::array();
    for (const auto& t : c.per_rank) per.push_back({{"sent", t.sent}, {"received", t.received}});
    out.push_back({{"collective", collective_name(c.collective)}, {"what", c.what}, {"per_rank", per}});
  }
  return out;
}

nlohmann::json run_json(const DeviceCountRun& run) {
  nlohmann::json strategies = nlohmann::json::array();
  for (const auto& s : run.strategies) {
    nlohmann::json buckets = nlohmann::json::array();
    for (const auto& b : s.buckets) buckets.push_back({{"offset", b.offset}, {"count", b.count}, {"layers", b.layers}});
    auto [lo, hi] = std::minmax_element(s.step_seconds.begin(), s.step_seconds.end());
    nlohmann::json steps_ms = nlohmann::json::array();
    for (double x : s.step_seconds) steps_ms.push_back(x * 1e3);
    strategies.push_back(
        {{"strategy", s.design.name},
         {"sync", s.design.strategy->name()},
         {"allreduce", s.design.strategy->takes_all_reduce_algorithm()
                           ? nlohmann::json(all_reduce_name(s.design.all_reduce))
                           : nlohmann::json()},
         {"step_ms",
          {{"median", median(s.step_seconds) * 1e3}, {"min", *lo * 1e3}, {"max", *hi * 1e3}, {"all", steps_ms}}},
         {"images_per_second", s.images_per_second},
         {"loss", s.loss},
         {"phases", phases_json(s)},
         {"comm_model_ms", run.ab.valid() ? nlohmann::json(s.comm_model_seconds * 1e3) : nlohmann::json()},
         {"comm_measured_ms", s.comm_measured_seconds * 1e3},
         {"collectives", collectives_json(s.collectives)},
         {"buckets", buckets},
         {"bytes_match", s.match},
         {"devices", devices_json(run, s)}});
  }
  return {{"devices", run.n},
          {"names", run.names},
          {"split_sizes", run.sizes},
          {"alpha_beta", run.ab.json()},
          {"strategies", strategies}};
}

}  // namespace

void print_scaling(const std::vector<DeviceCountRun>& runs, int batch) {
  std::printf("\nscaling: images/s at global batch %d (total over the measured steps)\n", batch);
  Table t;
  std::vector<std::string> head{"devices"};
  for (const Design& d : designs()) head.push_back(d.name);
  head.push_back("allreduce / scatter");
  t.row(head);
  auto rate = [](const DeviceCountRun& r, const std::string& name) {
    for (const auto& s : r.strategies)
      if (s.design.name == name) return s.images_per_second;
    return 0.0;
  };
  for (const auto& r : runs) {
    std::vector<std::string> row{std::to_string(r.n)};
    for (const auto& s : r.strategies) row.push_back(commas(int64_t(s.images_per_second + 0.5)));
    row.push_back(fixed(rate(r, "allreduce") / rate(r, "scatter"), 2));
    t.row(row);
  }
  std::printf("%s", t.str().c_str());
}

nlohmann::json compare_json(const CompareOptions& o, const ModelSpec& spec, const std::vector<DeviceCountRun>& runs,
                            bool all_match) {
  nlohmann::json config = run_config(as_training(o), spec, o.steps);
  config["warmup"] = o.warmup;
  // --sweep-devices: the largest set's names (every run lists its own under "names").
  const auto widest = std::max_element(runs.begin(), runs.end(), [](auto& a, auto& b) { return a.n < b.n; });
  record_backend(config, o.devices.backend, widest->kind, widest->names);
  nlohmann::json j = {
      {"command", o.command}, {"config", config}, {"runs", nlohmann::json::array()}, {"match", all_match}};
  for (const auto& r : runs) j["runs"].push_back(run_json(r));
  if (runs.size() > 1) {
    nlohmann::json sc = nlohmann::json::array();
    for (const auto& r : runs) {
      nlohmann::json row = {{"devices", r.n}};
      for (const auto& s : r.strategies) row[std::string(s.design.name) + "_images_per_second"] = s.images_per_second;
      sc.push_back(row);
    }
    j["scaling"] = sc;
  }
  return j;
}

}  // namespace dp::bench
