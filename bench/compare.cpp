// dp_bench compare: scatter and allreduce on the same devices, model, batch, seeds and synthetic
// data; step time, throughput, time per phase, bytes per device against the byte model, the
// alpha-beta model's communication time, peak memory; optionally over several device counts.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "engine/paths.h"
#include "engine/report.h"

namespace dp::bench {
namespace {

constexpr Sync kStrategies[] = {Sync::scatter, Sync::allreduce};

bool has_phase(Sync s, Phase p) { return s == Sync::scatter || (p != Phase::scatter && p != Phase::broadcast); }

// The phases whose time is communication (gather+loss also holds the loss on device 0).
bool is_comm_phase(Sync s, Phase p) {
  if (s == Sync::allreduce) return p == Phase::reduce;
  return p == Phase::scatter || p == Phase::broadcast || p == Phase::gather_loss || p == Phase::reduce;
}

struct StrategyRun {
  Sync sync;
  std::vector<double> step_seconds;
  double images_per_second = 0, loss = 0;
  std::vector<std::array<double, kPhases>> phase_seconds;  // per device, per step
  std::vector<CollectiveTraffic> collectives;              // the byte model
  std::vector<Traffic> measured, predicted;
  std::vector<LedgerSnapshot> ledgers;
  std::vector<Bucket> buckets;
  double comm_model_seconds = 0, comm_measured_seconds = 0;
  bool match = true;
  nlohmann::json trace;
};

struct DeviceCountRun {
  int n = 0;
  std::vector<std::string> names;
  std::vector<int> sizes;
  AlphaBeta ab;
  std::vector<StrategyRun> strategies;
};

EngineConfig engine_config(Sync sync, const CompareOptions& o) {
  EngineConfig ec;
  ec.sync = sync, ec.split = o.split, ec.batch = o.batch, ec.lr = o.lr, ec.momentum = o.momentum;
  ec.bucket_kb = sync == Sync::allreduce ? o.bucket_kb : 0;
  ec.trace = !o.trace.empty();
  return ec;
}

StrategyRun run_strategy(const std::vector<Device*>& devices, Sync sync, const ModelSpec& spec, const CompareOptions& o,
                         const SyntheticData& data, const std::vector<float>& init, const AlphaBeta& ab, int pid) {
  using clock = std::chrono::steady_clock;
  const int n = int(devices.size());
  // The previous engine has freed everything: its peaks must not count for this one.
  for (Device* d : devices) d->ledger().reset_peak();
  Engine engine(devices, spec, engine_config(sync, o));
  engine.set_params(init);

  StepResult last;
  int64_t step = 0;
  for (int i = 0; i < o.warmup; ++i, ++step) engine.step(data.images(step), data.labels(step), o.batch);
  engine.reset_timing();
  StrategyRun run;
  run.sync = sync;
  for (int i = 0; i < o.steps; ++i, ++step) {
    auto t0 = clock::now();
    last = engine.step(data.images(step), data.labels(step), o.batch);
    run.step_seconds.push_back(std::chrono::duration<double>(clock::now() - t0).count());
  }
  double total = 0;
  for (double s : run.step_seconds) total += s;
  run.images_per_second = double(o.batch) * o.steps / total;
  run.loss = last.loss;  // the mean over the batch

  run.buckets = engine.buckets();
  run.collectives = step_collectives(sync, spec, split_batch(o.batch, n, o.split), run.buckets);
  run.predicted = total_traffic(run.collectives, n);
  for (int r = 0; r < n; ++r) {
    Traffic t = engine.step_traffic(r);
    run.measured.push_back(t);
    run.match = run.match && t.sent == run.predicted[r].sent && t.received == run.predicted[r].received;
    std::array<double, kPhases> per_step{};
    for (int p = 0; p < kPhases; ++p) per_step[p] = engine.phase_seconds()[r][p] / o.steps;
    run.phase_seconds.push_back(per_step);
    double comm = 0;
    for (int p = 0; p < kPhases; ++p)
      if (is_comm_phase(sync, Phase(p))) comm += per_step[p];
    run.comm_measured_seconds = std::max(run.comm_measured_seconds, comm);
    run.ledgers.push_back(devices[r]->ledger().snapshot());
  }
  if (ab.valid()) run.comm_model_seconds = ab.step_seconds(run.collectives);
  if (!o.trace.empty()) {
    run.trace = trace_json(engine)["traceEvents"];
    for (auto& e : run.trace) {
      e["pid"] = pid;
      if (e["name"] == "process_name")
        e["args"]["name"] = std::string(sync_name(sync)) + ", " + std::to_string(n) + " device" + (n > 1 ? "s" : "");
    }
  }
  return run;
}

std::string ms(double seconds, int decimals = 2) { return fixed(seconds * 1e3, decimals); }

std::string device_range(const std::vector<std::string>& names) {
  if (names.size() == 1) return names[0];
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? "," : "") + names[i];
  return s;
}

std::string sizes_text(const std::vector<int>& sizes) {
  std::string s;
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? "+" : "") + std::to_string(sizes[i]);
  return s;
}

void print_run(const DeviceCountRun& run, const ModelSpec& spec, const CompareOptions& o, const std::string& kind) {
  const int n = run.n;
  std::printf(
      "\n%s (P = %s parameters), global batch %d = %s over %d %s device%s (%s), %d measured steps after %d "
      "warm-up, seed %llu%s\n\n",
      spec.name.c_str(), commas(spec.param_count).c_str(), o.batch, sizes_text(run.sizes).c_str(), n, kind.c_str(),
      n > 1 ? "s" : "", device_range(run.names).c_str(), o.steps, o.warmup, (unsigned long long)o.seed,
      o.bucket_kb > 0 ? (", allreduce buckets of " + std::to_string(o.bucket_kb) + " KiB").c_str() : "");
  Table t;
  std::vector<std::string> head{""};
  for (auto& s : run.strategies) head.push_back(sync_name(s.sync));
  t.row(head);
  auto add = [&](const std::string& label, auto cell) {
    std::vector<std::string> r{label};
    for (auto& s : run.strategies) r.push_back(cell(s));
    t.row(r);
  };
  add("step time, median / min / max (ms)", [&](const StrategyRun& s) {
    auto [lo, hi] = std::minmax_element(s.step_seconds.begin(), s.step_seconds.end());
    return ms(median(s.step_seconds)) + " / " + ms(*lo) + " / " + ms(*hi);
  });
  add("images/s", [&](const StrategyRun& s) { return commas(int64_t(s.images_per_second + 0.5)); });
  add("loss of the last step", [&](const StrategyRun& s) { return fixed(s.loss, 6); });
  t.row({"time per step by phase, ms (device 0 / max over devices)"});
  for (int p = 0; p < kPhases; ++p) {
    std::string label = phase_name(Phase(p), Sync::scatter);
    std::string other = phase_name(Phase(p), Sync::allreduce);
    if (other != label) label += " | " + other;
    add("  " + label, [&](const StrategyRun& s) -> std::string {
      if (!has_phase(s.sync, Phase(p))) return "-";
      double worst = 0;
      for (auto& d : s.phase_seconds) worst = std::max(worst, d[p]);
      return ms(s.phase_seconds[0][p]) + " / " + ms(worst);
    });
  }
  t.row({"communication per step, ms"});
  add("  α-β model (below)",
      [&](const StrategyRun& s) { return run.ab.valid() ? ms(s.comm_model_seconds, 3) : std::string("-"); });
  add("  measured: communication phases, max over devices",
      [&](const StrategyRun& s) { return ms(s.comm_measured_seconds, 3); });
  t.row({"bytes per device per step, sent / received (measured, then the byte model)"});
  for (int r = 0; r < n; ++r) {
    add("  " + run.names[r] + " measured",
        [&](const StrategyRun& s) { return commas(s.measured[r].sent) + " / " + commas(s.measured[r].received); });
    add("  " + run.names[r] + " model", [&](const StrategyRun& s) {
      bool ok = s.measured[r].sent == s.predicted[r].sent && s.measured[r].received == s.predicted[r].received;
      return commas(s.predicted[r].sent) + " / " + commas(s.predicted[r].received) + (ok ? " match" : " MISMATCH");
    });
  }
  t.row({"peak memory per device (ledger)"});
  for (int r = 0; r < n; ++r)
    add("  " + run.names[r], [&](const StrategyRun& s) { return format_bytes(s.ledgers[r].total_peak); });
  std::printf("%s", t.str().c_str());
  if (run.ab.valid())
    std::printf(
        "α-β model: each collective of the step costs α + (bytes its busiest rank sends or receives) / β, with\n"
        "α = %.1f µs, β = %.2f GB/s %s\n",
        run.ab.alpha * 1e6, run.ab.beta / 1e9, run.ab.source.c_str());
}

// The steps this benchmark times as a training run's options, for the record's "config" (the
// devices are --gpus; --sweep-devices adds runs over others).
TrainOptions as_training(const CompareOptions& o) {
  TrainOptions t;
  t.model = o.model, t.batch = o.batch, t.lr = o.lr, t.momentum = o.momentum, t.seed = o.seed;
  t.devices = o.devices, t.split = o.split, t.bucket_kb = o.bucket_kb;
  return t;
}

nlohmann::json run_json(const DeviceCountRun& run) {
  nlohmann::json strategies = nlohmann::json::array();
  for (const auto& s : run.strategies) {
    nlohmann::json phases = nlohmann::json::array();
    for (int p = 0; p < kPhases; ++p) {
      if (!has_phase(s.sync, Phase(p))) continue;
      nlohmann::json per = nlohmann::json::array();
      double worst = 0;
      for (auto& d : s.phase_seconds) per.push_back(d[p] * 1e3), worst = std::max(worst, d[p]);
      phases.push_back({{"phase", phase_name(Phase(p), s.sync)},
                        {"device0_ms", s.phase_seconds[0][p] * 1e3},
                        {"max_ms", worst * 1e3},
                        {"per_device_ms", per}});
    }
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
    nlohmann::json collectives = nlohmann::json::array();
    for (const auto& c : s.collectives) {
      nlohmann::json per = nlohmann::json::array();
      for (const auto& t : c.per_rank) per.push_back({{"sent", t.sent}, {"received", t.received}});
      collectives.push_back({{"collective", collective_name(c.collective)}, {"what", c.what}, {"per_rank", per}});
    }
    nlohmann::json buckets = nlohmann::json::array();
    for (const auto& b : s.buckets) buckets.push_back({{"offset", b.offset}, {"count", b.count}, {"layers", b.layers}});
    auto [lo, hi] = std::minmax_element(s.step_seconds.begin(), s.step_seconds.end());
    nlohmann::json steps_ms = nlohmann::json::array();
    for (double x : s.step_seconds) steps_ms.push_back(x * 1e3);
    strategies.push_back(
        {{"strategy", sync_name(s.sync)},
         {"step_ms",
          {{"median", median(s.step_seconds) * 1e3}, {"min", *lo * 1e3}, {"max", *hi * 1e3}, {"all", steps_ms}}},
         {"images_per_second", s.images_per_second},
         {"loss", s.loss},
         {"phases", phases},
         {"comm_model_ms", run.ab.valid() ? nlohmann::json(s.comm_model_seconds * 1e3) : nlohmann::json()},
         {"comm_measured_ms", s.comm_measured_seconds * 1e3},
         {"collectives", collectives},
         {"buckets", buckets},
         {"bytes_match", s.match},
         {"devices", devices}});
  }
  nlohmann::json ab = nullptr;
  if (run.ab.valid())
    ab = {{"alpha_us", run.ab.alpha * 1e6}, {"beta_gbps", run.ab.beta / 1e9}, {"source", run.ab.source}};
  return {{"devices", run.n},
          {"names", run.names},
          {"split_sizes", run.sizes},
          {"alpha_beta", ab},
          {"strategies", strategies}};
}

void check_options(const CompareOptions& o) {
  if (o.batch <= 0)
    throw UsageError("--batch: " + std::to_string(o.batch) +
                     " is not a batch size; give a positive number of images, e.g. 256");
  if (o.steps <= 0) throw UsageError("--steps: " + std::to_string(o.steps) + " measured steps; give at least 1");
  if (o.warmup < 0) throw UsageError("--warmup: must be >= 0");
  if (o.bucket_kb < 0) throw UsageError("--bucket-kb: must be >= 0 (0: one all-reduce after backward)");
  if ((o.alpha_us >= 0) != (o.beta_gbps >= 0))
    throw UsageError("--alpha-us and --beta-gbps: give both (or neither, to fit them here)");
  if (o.alpha_us >= 0 && !(o.beta_gbps > 0)) throw UsageError("--beta-gbps: must be a positive bandwidth in GB/s");
  check_output_file("--json", o.json);
  check_output_file("--trace", o.trace);
  check_output_directory("--plot", o.plot);
  check_distinct_outputs({{"--json", o.json}, {"--trace", o.trace}});
  if (!o.plot.empty()) check_plotting();
}

// --gpus, or with --sweep-devices the first 1, 2, ... devices.
std::vector<std::vector<int>> device_id_sets(const CompareOptions& o) {
  if (o.sweep.empty()) return {o.devices.ids};
  std::vector<std::vector<int>> id_sets;
  for (int count : o.sweep) {
    std::vector<int> ids;
    for (int i = 0; i < count; ++i) ids.push_back(i);
    id_sets.push_back(ids);
  }
  return id_sets;
}

// Several replicas on one device (--allow-shared-device) share its name: add the rank.
std::vector<std::string> replica_names(const std::vector<Device*>& devices) {
  std::vector<std::string> names;
  for (Device* d : devices) {
    int same = 0;
    for (Device* e : devices) same += e->name() == d->name();
    names.push_back(same > 1 ? d->name() + "#" + std::to_string(d->rank()) : d->name());
  }
  return names;
}

// A quick all-reduce sweep around the model's size, for the alpha-beta fit; `dp_bench comm` does
// the full range and every collective.
CommSweep quick_sweep() {
  CommSweep quick;
  quick.collectives = {Collective::all_reduce};
  quick.min_bytes = 1 << 10, quick.max_bytes = 4 << 20, quick.max_iters = 20, quick.budget_seconds = 0.02;
  return quick;
}

// Given by --alpha-us/--beta-gbps, or fitted on these devices (none for a single device).
AlphaBeta alpha_beta(const std::vector<Device*>& devices, const CompareOptions& o) {
  AlphaBeta ab;
  if (o.alpha_us >= 0) {
    ab.alpha = o.alpha_us * 1e-6, ab.beta = o.beta_gbps * 1e9;
    ab.source = "(given: --alpha-us/--beta-gbps)";
  } else if (devices.size() > 1) {
    ab = fit_from_sweep(run_comm_sweep(devices, quick_sweep()));
    ab.source = "(" + ab.source + " on these devices; dp_bench comm sweeps the full range)";
  }
  return ab;
}

struct MemoryEstimate {
  int64_t total = 0, devices = 0;  // bytes of host memory; the simulated devices' part of it
};

// The host memory the run takes: the synthetic data, and on simulated devices the ledgers' peak
// (engines and the alpha-beta sweep run one at a time: the largest of them). Printed, or refused
// past the bound with the largest batch that fits.
MemoryEstimate check_memory(const CompareOptions& o, const ModelSpec& spec) {
  const int64_t batches = std::min<int64_t>(int64_t(o.warmup) + o.steps, 8);  // make_synthetic's, below
  std::vector<DeviceBytes> lines;
  int64_t sweeps = 0;
  for (const auto& ids : device_id_sets(o)) {
    DeviceConfig dc = o.devices;
    dc.ids = ids;
    DeviceSet set = make_devices(dc);
    std::vector<Device*> devices;
    for (auto& d : set.devices) devices.push_back(d.get());
    for (Sync s : kStrategies) lines.push_back(measure_device_bytes(devices, spec, engine_config(s, o)));
    if (o.alpha_us < 0 && devices.size() > 1 && lines.back().host)
      sweeps = std::max(sweeps, sweep_bytes(quick_sweep(), int(devices.size())));
  }
  auto on_devices = [&](int64_t b) {
    int64_t m = sweeps;
    for (const DeviceBytes& l : lines) m = std::max(m, l.at(b));
    return m;
  };
  auto need = [&](int64_t b) { return synthetic_bytes(spec, b, batches) + on_devices(b); };
  const HostMemory mem = host_memory();
  const int64_t fits = largest_fitting(o.batch, mem.bound(), need);
  const std::string parts =
      "the synthetic data " + format_bytes(synthetic_bytes(spec, o.batch, batches)) + ", " + std::to_string(batches) +
      " batches of " + commas(o.batch) + " images; " +
      (lines[0].host ? "the simulated devices " + format_bytes(on_devices(o.batch)) + " at their peak, by their ledgers"
                     : "the CUDA devices' memory is their own");
  require_host_memory(mem, need(o.batch), parts, "--batch " + std::to_string(o.batch),
                      fits > 0 ? "the largest batch that fits is " + std::to_string(fits)
                               : "not even a batch of 1 fits; give fewer devices");
  return {need(o.batch), on_devices(o.batch)};
}

// Both strategies on one set of devices; their trace lanes are processes first_pid and first_pid + 1.
DeviceCountRun run_devices(const std::vector<Device*>& devices, const ModelSpec& spec, const CompareOptions& o,
                           const SyntheticData& data, const std::vector<float>& init, int first_pid) {
  DeviceCountRun run;
  run.n = int(devices.size());
  run.names = replica_names(devices);
  run.sizes = split_batch(o.batch, run.n, o.split);
  run.ab = alpha_beta(devices, o);
  for (Sync s : kStrategies)
    run.strategies.push_back(
        run_strategy(devices, s, spec, o, data, init, run.ab, first_pid + int(run.strategies.size())));
  return run;
}

void print_scaling(const std::vector<DeviceCountRun>& runs, int batch) {
  std::printf("\nscaling: images/s at global batch %d (total over the measured steps)\n", batch);
  Table t;
  t.row({"devices", "scatter", "allreduce", "allreduce / scatter"});
  for (const auto& r : runs)
    t.row({std::to_string(r.n), commas(int64_t(r.strategies[0].images_per_second + 0.5)),
           commas(int64_t(r.strategies[1].images_per_second + 0.5)),
           fixed(r.strategies[1].images_per_second / r.strategies[0].images_per_second, 2)});
  std::printf("%s", t.str().c_str());
}

nlohmann::json compare_json(const CompareOptions& o, const ModelSpec& spec, const std::vector<DeviceCountRun>& runs,
                            bool all_match) {
  nlohmann::json config = run_config(as_training(o), spec, o.steps);
  config["warmup"] = o.warmup;
  nlohmann::json j = {
      {"command", o.command}, {"config", config}, {"runs", nlohmann::json::array()}, {"match", all_match}};
  for (const auto& r : runs) j["runs"].push_back(run_json(r));
  if (runs.size() > 1) {
    nlohmann::json sc = nlohmann::json::array();
    for (const auto& r : runs)
      sc.push_back({{"devices", r.n},
                    {"scatter_images_per_second", r.strategies[0].images_per_second},
                    {"allreduce_images_per_second", r.strategies[1].images_per_second}});
    j["scaling"] = sc;
  }
  return j;
}

}  // namespace

int run_compare(const CompareOptions& o) {
  check_options(o);
  const ModelSpec spec = make_model(o.model);
  const MemoryEstimate memory = check_memory(o, spec);
  // Both strategies see the same initial weights and the same batches in the same order.
  const SyntheticData data =
      make_synthetic(spec, o.batch, int(std::min<int64_t>(int64_t(o.warmup) + o.steps, 8)), o.seed);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, o.seed, init.data());

  std::vector<DeviceCountRun> runs;
  nlohmann::json trace = nlohmann::json::array();
  bool all_match = true;
  for (const auto& ids : device_id_sets(o)) {
    DeviceConfig dc = o.devices;
    dc.ids = ids;
    DeviceSet set = make_devices(dc);
    if (runs.empty()) std::printf("%s\n", set.notice.c_str());
    std::vector<Device*> devices;
    for (auto& d : set.devices) devices.push_back(d.get());
    DeviceCountRun run = run_devices(devices, spec, o, data, init, int(runs.size() * 2));
    print_run(run, spec, o, devices[0]->kind() == DeviceKind::cuda ? "CUDA" : "simulated");
    for (auto& s : run.strategies) {
      all_match = all_match && s.match;
      for (auto& e : s.trace) trace.push_back(e);
    }
    runs.push_back(std::move(run));
  }
  if (runs.size() > 1) print_scaling(runs, o.batch);
  std::printf("\nbytes: %s\n",
              all_match ? "measured == model, to the byte, on every device for both strategies"
                        : "MISMATCH between the measured bytes and the model (see the rows marked MISMATCH)");

  nlohmann::json j = compare_json(o, spec, runs, all_match);
  j["memory"] = {{"estimate_bytes", memory.total}, {"devices_estimate_bytes", memory.devices}};
  if (!o.json.empty()) write_json(o.json, j);
  if (!o.trace.empty()) write_json(o.trace, {{"traceEvents", trace}, {"displayTimeUnit", "ms"}});
  if (!o.plot.empty()) {
    std::filesystem::create_directories(o.plot);
    std::string data_path = (std::filesystem::path(o.plot) / "compare.json").string();
    write_json(data_path, j);
    for (const auto& png : run_plot("compare", data_path, o.plot)) std::printf("plot: %s\n", png.c_str());
  }
  return all_match ? 0 : 1;
}

}  // namespace dp::bench
