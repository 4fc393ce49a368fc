// dp_bench ops: where a training step's time goes, op by op. One simulated CPU device trains the
// model on synthetic data through ProfilingOps (bench/profiling_ops.h), which times every kernel
// call; after the warm-up steps, --steps steps are timed and each (op, shape) row gets its calls,
// microseconds and share of a step, and GFLOP/s where the FLOPs are known (convolutions and linear
// layers). What the step spends outside every op (uploads, the engine's bookkeeping, waiting on the
// device thread) is the host row.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/commands.h"
#include "bench/profiling_ops.h"
#include "engine/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "train/output_files.h"
#include "train/report.h"

namespace dp::bench {
namespace {

struct Row {
  std::string op, layer, shape;
  OpTotal total;
};

const char* kind_word(LayerKind k) {
  switch (k) {
    case LayerKind::relu:
      return "relu";
    case LayerKind::sigmoid:
      return "sigmoid";
    case LayerKind::avgpool:
      return "avgpool";
    case LayerKind::maxpool:
      return "maxpool";
    default:
      return "layer";
  }
}

// A layer without parameters (and so without a name) as "relu after fc1".
std::string unnamed(const ModelSpec& spec, int i) {
  std::string after;
  for (int j = i - 1; j >= 0 && after.empty(); --j) after = spec.layers[size_t(j)].name;
  return std::string(kind_word(spec.layers[size_t(i)].kind)) + (after.empty() ? "" : " after " + after);
}

// The layer of the model a call belongs to, found by its shape; "" where none or several match.
std::string layer_of(const ModelSpec& spec, const OpKey& k, int batch) {
  const auto& d = k.dims;
  std::vector<std::string> found;
  for (int i = 0; i < int(spec.layers.size()); ++i) {
    const Layer& l = spec.layers[size_t(i)];
    bool match = false;
    if (k.op.starts_with("conv2d"))
      match = l.kind == LayerKind::conv && l.in_c == d[0] && l.in_h == d[1] && l.in_w == d[2] && l.out_c == d[3] &&
              l.kernel == d[4] && l.pad == d[6];
    else if (k.op.starts_with("linear"))
      match = l.kind == LayerKind::linear && l.in_size() == d[0] && l.out_c == d[1];
    else if (k.op.starts_with("avgpool") || k.op.starts_with("maxpool"))
      match = (l.kind == LayerKind::avgpool) == k.op.starts_with("avgpool") &&
              (l.kind == LayerKind::avgpool || l.kind == LayerKind::maxpool) && l.in_c == d[0] && l.in_h == d[1] &&
              l.in_w == d[2] && l.kernel == d[3];
    else if (k.op.starts_with("activation"))  // d: the activation, the element count (a chunk's or the batch's)
      match = l.kind == (d[0] == int(Activation::relu) ? LayerKind::relu : LayerKind::sigmoid) &&
              d[1] % l.out_size() == 0 && d[1] / l.out_size() <= batch;
    else if (k.op.starts_with("bn_"))
      match = l.kind == LayerKind::batchnorm && l.out_c == d[0] &&
              (k.op == "bn_update_running" || l.out_h * l.out_w == d[1]);  // its key is C alone
    if (match) found.push_back(l.name.empty() ? unnamed(spec, i) : l.name);
  }
  if (k.op == "softmax_xent") return "loss";
  if (k.op == "sgd_step" && d[0] == spec.param_count) return "all parameters";
  if (k.op == "fill" && d[0] == spec.param_count) return "all gradients";
  if (k.op == "add" || k.op == "fill")  // a parameter's gradient (summed over chunks, or zeroed)
    for (const Param& p : spec.params)
      if (p.size == d[0]) found.push_back(p.name);
  return found.size() == 1 ? found[0] : "";
}

std::string shape_of(const OpKey& k) {
  const auto& d = k.dims;
  auto n = [](int64_t v) { return std::to_string(v); };
  if (k.op.starts_with("conv2d")) {
    const int64_t oh = d[1] + 2 * d[6] - d[4] + 1, ow = d[2] + 2 * d[6] - d[5] + 1;
    std::string s = n(d[0]) + "x" + n(d[1]) + "x" + n(d[2]) + " -> " + n(d[3]) + "x" + n(oh) + "x" + n(ow) + ", " +
                    n(d[4]) + "x" + n(d[5]) + (d[6] ? " pad " + n(d[6]) : "");
    if (d[7] >= 0)
      s += ", " + std::string(d[7] / 16 == int(Activation::relu) ? "relu" : "sigmoid") + ", pool " + n(d[7] % 16);
    return s;
  }
  if (k.op.starts_with("linear")) return n(d[0]) + " -> " + n(d[1]);
  if (k.op.starts_with("avgpool") || k.op.starts_with("maxpool"))
    return n(d[0]) + "x" + n(d[1]) + "x" + n(d[2]) + ", " + n(d[3]) + "x" + n(d[3]);
  if (k.op.starts_with("activation"))
    return std::string(d[0] == int(Activation::relu) ? "relu" : "sigmoid") + ", " + commas(d[1]) + " values";
  if (k.op.starts_with("bn_")) return "C " + n(d[0]) + (k.op == "bn_update_running" ? "" : ", HW " + n(d[1]));
  if (k.op == "softmax_xent") return n(d[0]) + " classes";
  if (k.op == "gemm") return n(d[0]) + "x" + n(d[1]) + "x" + n(d[2]) + (d[3] ? " A^T" : "") + (d[4] ? " B^T" : "");
  return commas(d[0]) + " floats";
}

// The host memory of the run: the synthetic batches and the device's ledger at its peak.
void check_memory(const ModelSpec& spec, const EngineConfig& ec, int batches) {
  std::unique_ptr<Device> probe = make_simulated_device(0, 0, 0);
  const DeviceBytes line = measure_device_bytes({probe.get()}, spec, ec);
  auto need = [&](int64_t b) { return synthetic_bytes(spec, b, batches) + line.at(b); };
  const HostMemory mem = host_memory();
  const int64_t fits = largest_fitting(ec.batch, mem.bound(), need);
  require_host_memory(
      mem, need(ec.batch),
      "the synthetic data " + format_bytes(synthetic_bytes(spec, ec.batch, batches)) + ", the simulated device " +
          format_bytes(line.at(ec.batch)) + " at its peak",
      "--batch " + std::to_string(ec.batch),
      fits > 0 ? "the largest batch that fits is " + std::to_string(fits) : "not even a batch of 1 fits");
}

void check_options(const OpsOptions& o) {
  if (o.backend != "cpu")
    throw UsageError("--backend: '" + o.backend +
                     "': ops profiles the simulated CPU device only (a CUDA op's call returns when it is queued, "
                     "not when it is done); give --backend cpu");
  if (o.batch <= 0)
    throw UsageError("--batch: " + std::to_string(o.batch) +
                     " is not a batch size; give a positive number of images, e.g. 256");
  if (o.steps <= 0) throw UsageError("--steps: " + std::to_string(o.steps) + " measured steps; give at least 1");
  if (o.warmup < 0) throw UsageError("--warmup: " + std::to_string(o.warmup) + "; give 0 or more steps");
  check_output_file("--json", o.json);
}

// The steps, timed whole after the warm-up (the profile counts the timed steps' ops); their seconds.
double time_steps(const OpsOptions& o, const ModelSpec& spec, const EngineConfig& ec, Device& device,
                  ProfilingOps& profile, int batches) {
  using clock = std::chrono::steady_clock;
  const SyntheticData data = make_synthetic(spec, o.batch, batches, o.seed);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, o.seed, init.data());
  Engine engine({&device}, spec, ec);
  engine.set_params(init);
  int64_t step = 0;
  for (int i = 0; i < o.warmup; ++i, ++step) engine.step(data.images(step), data.labels(step), o.batch);
  profile.reset();
  double step_seconds = 0;
  for (int i = 0; i < o.steps; ++i, ++step) {
    const auto t0 = clock::now();
    engine.step(data.images(step), data.labels(step), o.batch);
    step_seconds += std::chrono::duration<double>(clock::now() - t0).count();
  }
  return step_seconds;
}

// The rows, slowest first: the table printed, the rows for --json returned; op_seconds their sum.
nlohmann::json print_rows(const std::vector<Row>& rows, double steps, double step_seconds, double& op_seconds) {
  auto us = [&](double seconds) { return seconds / steps * 1e6; };
  auto share = [&](double seconds) { return fixed(100.0 * seconds / step_seconds, 1) + "%"; };
  size_t layer_width = 5;
  for (const Row& r : rows) layer_width = std::max(layer_width, r.layer.size());
  Table t;
  t.row({pad("layer", int(layer_width), false) + "  op", "shape", "calls/step", "us/step", "share", "GFLOP/s"});
  nlohmann::json jrows = nlohmann::json::array();
  op_seconds = 0;
  for (const Row& r : rows) {
    const double gflops = r.total.flops > 0 ? r.total.flops / r.total.seconds / 1e9 : 0;
    t.row({pad(r.layer.empty() ? "-" : r.layer, int(layer_width), false) + "  " + r.op, r.shape,
           fixed(double(r.total.calls) / steps, 1), fixed(us(r.total.seconds), 1), share(r.total.seconds),
           r.total.flops > 0 ? fixed(gflops, 1) : "-"});
    jrows.push_back({{"op", r.op},
                     {"layer", r.layer},
                     {"shape", r.shape},
                     {"calls_per_step", double(r.total.calls) / steps},
                     {"us_per_step", us(r.total.seconds)},
                     {"share", r.total.seconds / step_seconds},
                     {"flops_per_step", r.total.flops / steps},
                     {"gflops", r.total.flops > 0 ? nlohmann::json(gflops) : nlohmann::json(nullptr)}});
    op_seconds += r.total.seconds;
  }
  const double host_seconds = step_seconds - op_seconds;
  t.row({"all ops", "", "", fixed(us(op_seconds), 1), share(op_seconds), ""});
  t.row({"host (outside every op)", "", "", fixed(us(host_seconds), 1), share(host_seconds), ""});
  t.row({"step", "", "", fixed(us(step_seconds), 1), "100.0%", ""});
  std::printf("\n%s", t.str().c_str());
  return jrows;
}

}  // namespace

int run_ops(const OpsOptions& o) {
  check_options(o);
  const ModelSpec spec = make_model(o.model);
  if (spec.has_batchnorm() && o.batch == 1)  // as dp_train refuses it (check_batchnorm), before any step
    throw UsageError("--model " + spec.name +
                     ": a batch of 1 sample, and BatchNorm needs more than 1 value per channel in training "
                     "(PyTorch's rule); give --batch 2 or more");
  EngineConfig ec;
  ec.sync = "allreduce", ec.batch = o.batch;  // one device: no collective, only the step
  const int batches = std::min(o.warmup + o.steps, 8);
  check_memory(spec, ec, batches);

  auto owned = std::make_unique<ProfilingOps>(make_cpu_ops());
  ProfilingOps& profile = *owned;
  std::unique_ptr<Device> device = make_simulated_device(0, 0, 0, std::move(owned));
  const std::string variant = profile.variant();
  std::printf("ops: %s, batch %d, one simulated device (%s), CPU kernels %s; %d warm-up + %d timed steps\n",
              spec.name.c_str(), o.batch, device->name().c_str(), variant.c_str(), o.warmup, o.steps);
  const double step_seconds = time_steps(o, spec, ec, *device, profile, batches);

  std::vector<Row> rows;
  for (const auto& [key, total] : profile.totals())
    rows.push_back({std::string(key.op), layer_of(spec, key, o.batch), shape_of(key), total});
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return a.total.seconds > b.total.seconds; });
  const double steps = o.steps, step_us = step_seconds / steps * 1e6;
  double op_seconds = 0;
  const nlohmann::json jrows = print_rows(rows, steps, step_seconds, op_seconds);
  std::printf(
      "\nstep: %.1f us, %.0f images/s; GFLOP/s counts 2 per multiply-add (a backward's: weight gradient, and "
      "data gradient but for the first layer)\n",
      step_us, o.batch / (step_seconds / steps));
  if (o.json.empty()) return 0;
  nlohmann::json j = {{"command", o.command},
                      {"config",
                       {{"model", spec.name},
                        {"batch", o.batch},
                        {"steps", o.steps},
                        {"warmup", o.warmup},
                        {"seed", o.seed},
                        {"cpu_kernels", variant}}},
                      {"step_us", step_us},
                      {"ops_us", op_seconds / steps * 1e6},
                      {"host_us", (step_seconds - op_seconds) / steps * 1e6},
                      {"images_per_second", o.batch / (step_seconds / steps)},
                      {"ops", jrows}};
  record_backend(j["config"], o.backend, DeviceKind::simulated, {device->name()});
  write_json(o.json, j);
  return 0;
}

}  // namespace dp::bench
