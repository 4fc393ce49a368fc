// dp_bench scale: every strategy's step on 1 to 1,024 devices, modelled (scale_model.h) from what dp
// measures, and checked: on this machine's simulated devices against dp's own measured steps and
// collectives; on the GPU presets, the model's all-reduce bus bandwidth against published nccl-tests
// figures.
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <thread>

#include "bench/compare.h"
#include "bench/scale_model.h"
#include "engine/error.h"
#include "train/output_files.h"
#include "train/report.h"

namespace dp::bench {
namespace {

// The LeNet step the GPU presets take where --compute-us is not given: dp on one H200 at batch 256
// (docs/gpu.md, 2026-11-27: dp_train at 465,811 images/s, so 550 us a step, 410 us of it kernels;
// eager steps: the several devices this models cannot take --graphs).
constexpr double kGpuLenetStepUs = 550;

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

void check_options(const ScaleOptions& o, const Topology& t) {
  if (o.per_device < 1)
    throw UsageError("--per-device: at least 1 image per device, not " + std::to_string(o.per_device));
  if (o.devices.empty()) throw UsageError("--devices: give at least one device count, e.g. 8,64,1024");
  for (int n : o.devices) {
    if (n < 1) throw UsageError("--devices: a device count must be at least 1, not " + std::to_string(n));
    if (t.nccl && n > t.per_node && n % t.per_node != 0)
      throw UsageError("--devices: " + std::to_string(n) + " devices do not fill whole nodes of " +
                       std::to_string(t.per_node) + " (" + t.name + "); give at most " + std::to_string(t.per_node) +
                       " or a multiple of it");
  }
  if (o.compute_us && !(*o.compute_us > 0 && std::isfinite(*o.compute_us)))
    throw UsageError("--compute-us: a one-device step in microseconds, finite and more than 0");
  if (t.nccl && !o.compute_us && (o.model != "lenet" || o.per_device != 256))
    throw UsageError("--compute-us: the " + t.name +
                     " preset knows dp's step for lenet at --per-device 256 only; give "
                     "the one-device step of " +
                     o.model + " at " + std::to_string(o.per_device) + " images");
  for (int n : o.validate)
    if (n < 1) throw UsageError("--validate: a device count must be at least 1, not " + std::to_string(n));
  if (given_alpha_beta(o.alpha_us, o.beta_gbps) && t.nccl)
    throw UsageError("--alpha-us/--beta-gbps: the sim preset's collectives; the " + t.name +
                     " preset's are its published figures");
  if (o.steps < 1 || o.warmup < 0 || o.repeats < 1)
    throw UsageError("--steps and --repeats: at least 1, --warmup: at least 0");
  check_output_file("--json", o.json);
  check_output_directory("--plot", o.plot);
  if (!o.plot.empty()) check_plotting();
}

// Backward's share of a step by the FLOP count (the weight and data gradients against the forward).
double flop_backward_share(const ModelSpec& spec) {
  const std::vector<double> backward = backward_macs(spec);
  double forward = 0, back = 0;
  for (size_t i = 0; i < spec.layers.size(); ++i) forward += layer_macs(spec.layers[i]), back += backward[i];
  return forward + back > 0 ? back / (forward + back) : 0;
}

// The sim preset: dp's engine on n simulated devices, every strategy at n x per_device images (the
// measurements the model is checked against; the one-device run gives the compute and backward's share).
std::map<int, DeviceCountRun> measure(const ScaleOptions& o, const ModelSpec& spec, std::vector<int> counts) {
  std::map<int, DeviceCountRun> runs;
  if (std::find(counts.begin(), counts.end(), 1) == counts.end()) counts.insert(counts.begin(), 1);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, o.seed, init.data());
  for (int n : counts) {
    CompareOptions co;
    co.model = o.model, co.batch = o.per_device * n, co.steps = o.steps, co.warmup = o.warmup, co.seed = o.seed;
    co.bucket_kb = o.bucket_kb, co.repeats = o.repeats;
    co.devices.backend = "cpu";
    co.devices.ids.clear();
    for (int i = 0; i < n; ++i) co.devices.ids.push_back(i);
    DeviceSet set = make_devices(co.devices);
    std::vector<Device*> devices;
    for (auto& d : set.devices) devices.push_back(d.get());
    const SyntheticData data = make_synthetic(spec, co.batch, std::min(o.warmup + o.steps, 4), o.seed);
    std::printf("measuring %d simulated device%s, %d images each...\n", n, n > 1 ? "s" : "", o.per_device);
    std::fflush(stdout);
    runs[n] = run_devices(devices, spec, co, data, init, 0);
  }
  return runs;
}

const StrategyRun* find_run(const DeviceCountRun& r, const std::string& name) {
  for (const StrategyRun& s : r.strategies)
    if (s.design.name == name) return &s;
  return nullptr;
}

double median_step(const StrategyRun& s) { return median(s.step_seconds); }

std::string mib(int64_t bytes) { return fixed(double(bytes) / (1 << 20), 2); }

// The one-device step the model scales: measured on one simulated device (sim), given, or the GPU
// presets' lenet figure. Sets t's alpha-beta fit from the measurements for sim.
ComputeTime compute_time(const ScaleOptions& o, const ModelSpec& spec, Topology& t,
                         const std::map<int, DeviceCountRun>& measured) {
  ComputeTime compute;
  compute.backward_share = flop_backward_share(spec);
  if (!t.nccl && o.alpha_us) {
    t.ab = *given_alpha_beta(o.alpha_us, o.beta_gbps);
    t.ab.source = "(" + t.ab.source + ")";
    t.source = "given: --alpha-us/--beta-gbps";
  }
  if (!t.nccl) {
    for (auto& [n, r] : measured)  // the fit of the first run over more than one device
      if (n > 1 && r.ab.valid() && !t.ab.valid()) t.ab = r.ab;
    if (!t.ab.valid()) throw std::runtime_error("scale: no alpha-beta fit on this machine's simulated devices");
  }
  if (!t.nccl && measured.count(1)) {
    const StrategyRun& one = *find_run(measured.at(1), "allreduce");
    compute.seconds = median_step(one);
    double total = 0;
    for (int p = 0; p < kPhases; ++p) total += one.phase_seconds[0][size_t(p)];
    if (total > 0) compute.backward_share = one.phase_seconds[0][size_t(Phase::backward)] / total;
    compute.source = "dp, one simulated device, measured here (median of " + std::to_string(o.steps) + " steps)";
  }
  if (o.compute_us) {
    compute.seconds = *o.compute_us * 1e-6;
    compute.source = "given: --compute-us";
  } else if (t.nccl) {
    compute.seconds = kGpuLenetStepUs * 1e-6;
    compute.source = "dp's lenet step at batch 256 on one H200 (docs/gpu.md), 550 us";
  }
  return compute;
}

void print_header(const ScaleOptions& o, const Topology& t, const ComputeTime& compute, int machine_cores) {
  std::printf("dp_bench scale: %s, %d images per device, preset %s\n  %s\n  collectives: %s\n", o.model.c_str(),
              o.per_device, t.name.c_str(), t.what.c_str(),
              t.nccl ? ("NCCL's tuning model (ring/tree x LL/Simple); " + t.source).c_str()
                     : (t.ab.describe() + " (" + t.source + ")").c_str());
  std::printf("  compute: %s ms a step (%s); backward %.0f%% of it\n", ms(compute.seconds, 3).c_str(),
              compute.source.c_str(), 100 * compute.backward_share);
  if (!t.nccl)
    std::printf("  simulated devices share this machine's %d cores: past %d devices each computes that much slower\n",
                machine_cores, machine_cores);
  std::printf("A MODEL, not a measurement (the validation at the end sets it beside measurements).\n");
}

// The compute a device of the preset takes at n devices: simulated devices share the machine's cores.
ComputeTime at(const ComputeTime& c, const Topology& t, int n, int machine_cores) {
  ComputeTime out = c;
  if (!t.nccl) out.seconds *= std::max(1.0, double(n) / machine_cores);
  return out;
}

// One strategy over the device counts: printed, and as JSON.
nlohmann::json strategy_table(const ScaleOptions& o, const ModelSpec& spec, const Topology& t, const Design& d,
                              const ComputeTime& compute, int machine_cores) {
  Table table;
  table.row({"devices", "nodes", "compute ms", "comm ms", "exposed ms", "step ms", "images/s", "comm share",
             "memory MiB", "all-reduce"});
  nlohmann::json points = nlohmann::json::array();
  for (int n : o.devices) {
    const ScalePoint p =
        predict_step(*d.strategy, spec, t, at(compute, t, n, machine_cores), o.per_device, o.bucket_kb, n);
    table.row({std::to_string(n), std::to_string(p.nodes), ms(p.compute, 3), ms(p.comm, 3), ms(p.exposed, 3),
               ms(p.step, 3), fixed(p.images_per_second(o.per_device), 0), fixed(100 * p.comm_share(), 1) + "%",
               mib(p.memory), p.how.empty() ? "-" : p.how});
    points.push_back({{"devices", n},
                      {"nodes", p.nodes},
                      {"compute_seconds", p.compute},
                      {"comm_seconds", p.comm},
                      {"exposed_seconds", p.exposed},
                      {"step_seconds", p.step},
                      {"images_per_second", p.images_per_second(o.per_device)},
                      {"comm_share", p.comm_share()},
                      {"bytes", p.bytes},
                      {"memory_bytes", p.memory},
                      {"all_reduce", p.how}});
  }
  std::printf("\n%s (%s)\n%s", d.name.c_str(), d.strategy->mirrors(), table.str().c_str());
  return {{"strategy", d.name}, {"mirrors", d.strategy->mirrors()}, {"points", points}};
}

// The GPU presets against published figures: the model's all-reduce bus bandwidth (nccl-tests'
// definition) at 1 GiB on one node and on two.
nlohmann::json published_check(const Topology& t) {
  const int64_t S = int64_t(1) << 30;
  std::printf("\nvalidation: the model's all-reduce bus bandwidth at 1 GiB (nccl-tests' busbw)\n");
  nlohmann::json out = nlohmann::json::array();
  for (int n : {t.per_node, 2 * t.per_node}) {
    const int64_t busiest = ring_all_reduce_traffic(S / 4, n)[0].sent;  // 2 (n - 1) / n of the buffer
    const CollectiveCost c = collective_cost(t, Collective::all_reduce, busiest, n);
    const double busbw = double(busiest) / c.seconds / 1e9;
    const bool one_node = n == t.per_node;
    const double published = t.name == "h100-ndr" ? (one_node ? 370.0 : 48.0) : 0;
    std::printf("  %4d devices (%d node%s): %6.1f GB/s, %s", n, nodes_of(t, n), one_node ? "" : "s", busbw,
                c.how.c_str());
    if (published > 0)
      std::printf("; published: about %.0f GB/s (%s), %+.1f%%\n", published,
                  one_node ? "8 x H100, NVIDIA/nccl-tests issue 212" : "an NDR NIC, NVIDIA/nccl-tests issue 267",
                  100 * (busbw - published) / published);
    else
      std::printf("; no published figure at hand for this preset\n");
    out.push_back({{"devices", n}, {"busbw_gbps", busbw}, {"algorithm", c.how}, {"published_gbps", published}});
  }
  std::printf(
      "  (the preset's bandwidths are those figures: this checks that the latency terms do not distort "
      "them at 1 GiB)\n");
  return out;
}

// The sim preset against dp's own runs: measured step (median) and communication phases beside the
// model's, per strategy and device count.
nlohmann::json measured_check(const ScaleOptions& o, const ModelSpec& spec, const Topology& t,
                              const ComputeTime& compute, const std::map<int, DeviceCountRun>& measured,
                              int machine_cores) {
  if (o.validate.empty()) return nlohmann::json::array();  // measured for the fit alone
  std::printf("\nvalidation: the model against dp's measured steps on this machine's simulated devices\n");
  Table table;
  // The measured communication phases are what the step waited for: the model's exposed part.
  table.row({"strategy", "devices", "step ms", "model ms", "error", "comm ms", "model exposed ms", "error"});
  nlohmann::json out = nlohmann::json::array();
  auto err = [](double model, double meas) { return meas > 0 ? (model - meas) / meas : 0.0; };
  for (const auto& [n, run] : measured)
    for (const StrategyRun& s : run.strategies) {
      if (s.design.all_reduce == AllReduceAlgorithm::naive) continue;
      const ScalePoint p =
          predict_step(*s.design.strategy, spec, t, at(compute, t, n, machine_cores), o.per_device, o.bucket_kb, n);
      const double step = median_step(s), comm = s.comm_measured_seconds;
      table.row({s.design.name, std::to_string(n), ms(step, 3), ms(p.step, 3), fixed(100 * err(p.step, step), 0) + "%",
                 ms(comm, 3), ms(p.exposed, 3), n > 1 ? fixed(100 * err(p.exposed, comm), 0) + "%" : "-"});
      out.push_back({{"strategy", s.design.name},
                     {"devices", n},
                     {"step_seconds", step},
                     {"model_step_seconds", p.step},
                     {"comm_seconds", comm},
                     {"model_exposed_seconds", p.exposed}});
    }
  std::printf("%s", table.str().c_str());
  return out;
}

}  // namespace

int run_scale(const ScaleOptions& o) {
  Topology t = find_topology(o.preset);
  check_options(o, t);
  const ModelSpec spec = make_model(o.model);
  const int machine_cores = cores();
  std::map<int, DeviceCountRun> measured;
  // sim measures what it validates, and what it is not given: the one-device step, the fit (two devices)
  std::vector<int> counts = o.validate;  // measure() adds the one-device run
  if (!o.alpha_us && std::none_of(counts.begin(), counts.end(), [](int n) { return n > 1; })) counts.push_back(2);
  if (!t.nccl && (!o.validate.empty() || !o.compute_us || !o.alpha_us)) measured = measure(o, spec, counts);
  const ComputeTime compute = compute_time(o, spec, t, measured);
  print_header(o, t, compute, machine_cores);
  nlohmann::json j = {
      {"command", o.command},
      {"model", o.model},
      {"per_device", o.per_device},
      {"bucket_kb", o.bucket_kb},
      {"preset",
       {{"name", t.name},
        {"what", t.what},
        {"source", t.source},
        {"nccl", t.nccl},
        {"per_node", t.nccl ? t.per_node : 0},
        {"intra_busbw_gbps", t.intra_busbw},
        {"inter_busbw_gbps", t.inter_busbw},
        {"alpha_beta", t.ab.json()}}},
      {"compute",
       {{"seconds", compute.seconds}, {"backward_share", compute.backward_share}, {"source", compute.source}}}};
  j["strategies"] = nlohmann::json::array();
  for (const Design& d : designs())
    if (d.all_reduce != AllReduceAlgorithm::naive)  // the model costs the ring
      j["strategies"].push_back(strategy_table(o, spec, t, d, compute, machine_cores));
  j["validation"] = t.nccl ? published_check(t) : measured_check(o, spec, t, compute, measured, machine_cores);
  write_record("scale", j, o.json, o.plot);
  return 0;
}

}  // namespace dp::bench
