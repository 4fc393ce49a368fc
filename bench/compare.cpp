// dp_bench compare: scatter, naive (d2l's all-reduce) and allreduce on the same devices, model, batch,
// seeds and synthetic data; step time, throughput, time per phase, bytes per device against the byte
// model, the alpha-beta model's communication time, peak memory; optionally over several device counts.
#include "bench/compare.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "train/output_files.h"
#include "train/report.h"
#include "train/trace.h"

namespace dp::bench {

std::vector<Design> designs() {
  std::vector<Design> all;
  for (const Strategy* s : strategies()) {
    if (s->takes_all_reduce_algorithm()) all.push_back({s, AllReduceAlgorithm::naive, "naive"});
    all.push_back({s, AllReduceAlgorithm::ring, s->name()});
  }
  return all;
}

namespace {

EngineConfig engine_config(const Design& d, const CompareOptions& o) {
  EngineConfig ec;
  ec.sync = d.strategy->name(), ec.split = o.split, ec.batch = o.batch, ec.lr = o.lr, ec.momentum = o.momentum;
  ec.bucket_kb = d.strategy->takes_buckets() ? o.bucket_kb : 0;
  ec.all_reduce = d.all_reduce;
  ec.clip_grad_norm = o.clip_grad_norm;
  ec.accumulate = o.accumulate;
  ec.grad_dtype = d.strategy->takes_grad_dtype() ? o.grad_dtype : DType::fp32;
  ec.trace = !o.trace.empty();
  return ec;
}

StrategyRun run_strategy(const std::vector<Device*>& devices, const Design& design, const ModelSpec& spec,
                         const CompareOptions& o, const SyntheticData& data, const std::vector<float>& init,
                         const AlphaBeta& ab, int pid) {
  using clock = std::chrono::steady_clock;
  const int n = int(devices.size());
  // The previous engine has freed everything: its peaks must not count for this one.
  for (Device* d : devices) d->ledger().reset_peak();
  const EngineConfig ec = engine_config(design, o);
  Engine engine(devices, spec, ec);
  engine.set_params(init);

  StepResult last;
  int64_t step = 0;
  const int images = o.batch * o.accumulate;  // a step's: --accumulate micro-batches of --batch
  for (int i = 0; i < o.warmup; ++i, ++step) engine.step(data.images(step), data.labels(step), images);
  engine.recorder().reset_timing();
  StrategyRun run;
  run.design = design, run.origin = engine.recorder().start_time();  // the origin of the engine's span times
  for (int i = 0; i < o.steps; ++i, ++step) {
    auto t0 = clock::now();
    last = engine.step(data.images(step), data.labels(step), images);
    run.step_seconds.push_back(std::chrono::duration<double>(clock::now() - t0).count());
  }
  double total = 0;
  for (double s : run.step_seconds) total += s;
  run.images_per_second = double(images) * o.steps / total;
  run.loss = last.loss;  // the mean over the batch

  run.buckets = engine.buckets();
  run.collectives =
      design.strategy->step_collectives({spec, split_batch(o.batch, n, o.split), run.buckets, ec.sync_bn,
                                         design.all_reduce, ec.clip_grad_norm > 0, o.accumulate, ec.grad_dtype});
  run.predicted = total_traffic(run.collectives, n);
  for (int r = 0; r < n; ++r) {
    Traffic t = engine.recorder().step_traffic(r);
    run.measured.push_back(t);
    run.match = run.match && t.sent == run.predicted[r].sent && t.received == run.predicted[r].received;
    std::array<double, kPhases> per_step{};
    for (int p = 0; p < kPhases; ++p) per_step[p] = engine.recorder().phase_seconds()[r][p] / o.steps;
    run.phase_seconds.push_back(per_step);
    double comm = 0;
    for (int p = 0; p < kPhases; ++p)
      if (design.strategy->communicates(Phase(p))) comm += per_step[p];
    run.comm_measured_seconds = std::max(run.comm_measured_seconds, comm);
    run.ledgers.push_back(devices[r]->ledger().snapshot());
  }
  if (ab.valid()) run.comm_model_seconds = ab.step_seconds(run.collectives);
  if (!o.trace.empty()) {
    run.trace = trace_json(engine)["traceEvents"];
    for (auto& e : run.trace) {
      e["pid"] = pid;
      if (e["name"] == "process_name")
        e["args"]["name"] = std::string(design.name) + ", " + std::to_string(n) + " device" + (n > 1 ? "s" : "");
    }
  }
  return run;
}
void check_options(const CompareOptions& o) {
  check_step_images(o.batch, o.accumulate);
  if (o.steps <= 0) throw UsageError("--steps: " + std::to_string(o.steps) + " measured steps; give at least 1");
  if (o.warmup < 0) throw UsageError("--warmup: must be >= 0");
  if (o.repeats < 1) throw UsageError("--repeats: " + std::to_string(o.repeats) + " sweeps; give at least 1");
  if (o.bucket_kb < 0) throw UsageError("--bucket-kb: must be >= 0 (0: one all-reduce after backward)");
  given_alpha_beta(o.alpha_us, o.beta_gbps);
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
  if (const std::optional<AlphaBeta> given = given_alpha_beta(o.alpha_us, o.beta_gbps)) {
    ab = *given;
    ab.source = "(" + ab.source + ")";
  } else if (devices.size() > 1) {
    ab = fit_repeated(devices, quick_sweep(), o.repeats);
    ab.source = "(" + ab.source + ", on these devices; dp_bench comm sweeps the full range)";
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
    for (const Design& s : designs()) lines.push_back(measure_device_bytes(devices, spec, engine_config(s, o)));
    if (!o.alpha_us && devices.size() > 1 && lines.back().host)
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

// Each engine times its spans from its own start: shifted by how long after the first engine's
// start each started, the strategies lie one after the other on one time line.
void append_trace(nlohmann::json& trace, const StrategyRun& s, std::chrono::steady_clock::time_point first) {
  const double shift_us = std::chrono::duration<double, std::micro>(s.origin - first).count();
  for (nlohmann::json e : s.trace) {
    if (e.contains("ts")) e["ts"] = e["ts"].get<double>() + shift_us;
    trace.push_back(std::move(e));
  }
}

}  // namespace

DeviceCountRun run_devices(const std::vector<Device*>& devices, const ModelSpec& spec, const CompareOptions& o,
                           const SyntheticData& data, const std::vector<float>& init, int first_pid) {
  DeviceCountRun run;
  run.n = int(devices.size());
  run.names = replica_names(devices);
  run.kind = devices[0]->kind();
  run.sizes = split_batch(o.batch, run.n, o.split);
  run.ab = alpha_beta(devices, o);
  for (const Design& s : designs())
    run.strategies.push_back(
        run_strategy(devices, s, spec, o, data, init, run.ab, first_pid + int(run.strategies.size())));
  return run;
}
int run_compare(const CompareOptions& o) {
  check_options(o);
  const ModelSpec spec = make_model(o.model, o.width);
  const MemoryEstimate memory = check_memory(o, spec);
  // Every strategy sees the same initial weights and the same batches in the same order.
  const SyntheticData data =
      make_synthetic(spec, o.batch * o.accumulate, int(std::min<int64_t>(int64_t(o.warmup) + o.steps, 8)), o.seed);
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
    DeviceCountRun run = run_devices(devices, spec, o, data, init, int(runs.size() * designs().size()));
    print_run(run, spec, o);
    for (auto& s : run.strategies) {
      all_match = all_match && s.match;
      append_trace(trace, s, runs.empty() ? run.strategies[0].origin : runs[0].strategies[0].origin);
    }
    runs.push_back(std::move(run));
  }
  if (runs.size() > 1) print_scaling(runs, o.batch);
  std::printf("\nbytes: %s\n",
              all_match ? "measured == model, to the byte, on every device for every strategy"
                        : "MISMATCH between the measured bytes and the model (see the rows marked MISMATCH)");

  nlohmann::json j = compare_json(o, spec, runs, all_match);
  j["memory"] = {{"estimate_bytes", memory.total}, {"devices_estimate_bytes", memory.devices}};
  if (!o.trace.empty()) write_json(o.trace, {{"traceEvents", trace}, {"displayTimeUnit", "ms"}});
  write_record("compare", j, o.json, o.plot);
  return all_match ? 0 : 1;
}

}  // namespace dp::bench