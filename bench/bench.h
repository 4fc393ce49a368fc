// dp_bench's shared parts: synthetic data, the byte model across processes, the collective sweep
// with nccl-tests' bandwidth definitions, the alpha-beta fit, the plot hand-off and table helpers.
// Everything runs on the same dp_engine library dp_train uses; nothing here computes a layer.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/byte_model.h"
#include "engine/communicator.h"
#include "engine/engine.h"
#include "models/model.h"
#include "train/host_memory.h"

namespace dp::bench {

// --- synthetic data -------------------------------------------------------------------------------

// A few deterministic batches: images uniform in [0, 1), labels uniform over the classes, drawn from
// splitmix64 seeded with `seed` (no data set needed; identical on every machine and library).
struct SyntheticData {
  int batch = 0, batches = 0;
  int64_t image_size = 0;
  std::vector<float> x;    // (batches, batch, D)
  std::vector<int32_t> y;  // (batches, batch)
  const float* images(int64_t step) const { return x.data() + (step % batches) * batch * image_size; }
  const int32_t* labels(int64_t step) const { return y.data() + (step % batches) * batch; }
};
SyntheticData make_synthetic(const ModelSpec& spec, int batch, int batches, uint64_t seed);

// --- the byte model across processes -------------------------------------------------------------

// The hierarchical all-reduce across processes (ProcessCommunicator, Horovod's): P processes of K
// devices each, device k of process p. Inside the process a ring over the K devices (its reduce-scatter,
// then its all-gather: ring_all_reduce_traffic over K); across processes the chunk k owns after the
// reduce-scatter (even_chunks(count, K)[(k + 1) mod K], the whole buffer when K = 1) all-reduced with
// the same device of every other process, counted as a ring over P.
struct HierarchicalTraffic {
  Traffic local, inter;
};
HierarchicalTraffic hierarchical_all_reduce_traffic(int64_t count, int K, int P, int k, int p);

// --- the alpha-beta model -------------------------------------------------------------------------

// t = alpha + S / beta, with S the bytes the busiest rank moves (for the ring: 2 (n-1)/n of the
// buffer). alpha in seconds, beta in bytes per second.
struct AlphaBeta {
  double alpha = 0, beta = 0;
  std::string source;  // "fitted: ..." or "given: --alpha-us/--beta-gbps"
  // A fit over repeated sweeps (median_fit): each repeat's own (alpha, beta), beta 0 where that
  // sweep gave no fit; empty for one fit or given values.
  std::vector<std::pair<double, double>> repeats;
  bool valid() const { return beta > 0; }
  double seconds(double bytes) const { return alpha + bytes / beta; }
  // Each collective of the step costs one alpha plus its busiest rank's bytes over beta.
  double step_seconds(const std::vector<CollectiveTraffic>& collectives) const;
  // "α = 12.3 µs, β = 3.21 GB/s", and for a median fit "(median over 5 repeats; min–max α 8.1–40.2 µs,
  // β 2.90–3.50 GB/s)".
  std::string describe() const;
  // null when not valid; alpha_us, beta_gbps, source, and for a median fit: fit "median", repeats,
  // fitted, spread {alpha_us, beta_gbps: {min, max}}, per_repeat [{alpha_us, beta_gbps} or null].
  nlohmann::json json() const;
};
// --alpha-us and --beta-gbps: both or neither, a finite latency >= 0 µs and a finite bandwidth > 0 GB/s
// (else a UsageError naming which). The pair as an AlphaBeta "given: --alpha-us/--beta-gbps", or
// nothing when neither was given (fitted, then).
std::optional<AlphaBeta> given_alpha_beta(std::optional<double> alpha_us, std::optional<double> beta_gbps);
// Least squares of t = alpha + x / beta in relative error (see bench.cpp for why relative).
AlphaBeta fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds);
// One fit per repeated sweep -> alpha and beta each the median over the repeats that fitted (so
// the pair need not be any one repeat's); invalid when none fitted.
AlphaBeta median_fit(const std::vector<AlphaBeta>& fits);
// The fit as comm prints it: "  " describe() (or "  no fit (...)"), then each repeat's own line.
std::string fit_lines(const AlphaBeta& ab);

// --- the collective sweep -------------------------------------------------------------------------

// nccl-tests' bus bandwidth factor: busbw = algbw * factor.
double busbw_factor(Collective c, int n);

struct CommPoint {
  Collective collective;
  int64_t bytes = 0;       // S: the buffer (all_reduce, broadcast, reduce) or the root's whole buffer (scatter, gather)
  int64_t rank_bytes = 0;  // the busiest rank's bytes for this size (the alpha-beta model's x)
  int iters = 0;
  double seconds = 0;           // per op, averaged over iters, the slowest rank
  double algbw = 0, busbw = 0;  // bytes per second
};

struct CommSweep {
  int64_t min_bytes = 8, max_bytes = 256ll << 20;
  int max_iters = 20;
  double budget_seconds = 0.1;  // per collective and size: fewer iterations when one op is slow
  std::vector<Collective> collectives{Collective::all_reduce, Collective::broadcast, Collective::reduce,
                                      Collective::scatter,    Collective::gather,    Collective::reduce_scatter,
                                      Collective::all_gather};
};

// Sizes from min to max doubling (max included), rounded down to whole floats.
std::vector<int64_t> sweep_sizes(int64_t min_bytes, int64_t max_bytes);
// The device memory run_comm_sweep takes, summed over n devices: each rank's buffer and chunk, and
// the communicator's scratch (the root's (n-1) buffers for reduce, a chunk elsewhere).
int64_t sweep_bytes(const CommSweep& sweep, int n);
// Each collective over each size through a communicator over `devices`, SPMD from each device's
// thread; one warm-up op, then timed ops.
std::vector<CommPoint> run_comm_sweep(const std::vector<Device*>& devices, const CommSweep& sweep);
AlphaBeta fit_from_sweep(const std::vector<CommPoint>& points);
// The alpha-beta fit over `repeats` all_reduce sweeps over sweep's sizes, each fitted alone, then
// median_fit. `first`, when not empty, is the first repeat already measured (comm's full sweep).
AlphaBeta fit_repeated(const std::vector<Device*>& devices, CommSweep sweep, int repeats,
                       const std::vector<CommPoint>& first = {});

// Runs fn(rank) on every device's compute thread at once and waits; a failure aborts the
// communicator (no rank waits forever) and is rethrown here.
void spmd(Communicator& comm, const std::vector<Device*>& devices, const std::function<void(int)>& fn);

// --- memory, checked before a run ---------------------------------------------------------------

// The host memory a run may count on: MemAvailable (/proc/meminfo), or less where a cgroup (v2)
// limits this process; $DP_BENCH_MEM_AVAILABLE (a size, e.g. 64M) replaces it, for tests.

// The ledgers' peaks summed over a set of devices, as a line in the global batch: an engine built
// and stepped at 32 and 64 images per device. Both are past the CPU's 16-image conv chunk, beyond
// which every buffer grows linearly with the batch (were the chunk larger, the line would
// overestimate: the safe side), and small, so measuring costs little even over many devices. CUDA
// devices hold no host memory (host false); under --device-memory no device holds more than its cap.
struct DeviceBytes {
  int n = 1;
  bool host = true;
  double fixed = 0, per_sample = 0;
  int64_t cap_total = 0;  // n x --device-memory; 0: no cap
  int64_t at(int64_t batch) const;
};
DeviceBytes measure_device_bytes(const std::vector<Device*>& devices, const ModelSpec& spec, EngineConfig config);

// n devices' caps, cap x n, held under 2^62 (parse_bytes takes caps up to 2^63 - 1): sums of it and
// the data set stay within int64.
int64_t caps_total(int64_t cap, int n);
// The synthetic data set's bytes: `batches` batches of `batch` images and labels.
int64_t synthetic_bytes(const ModelSpec& spec, int64_t batch, int64_t batches);
// The largest x in [0, hi] with need(x) <= bound (need grows with x); 0 when none.
int64_t largest_fitting(int64_t hi, int64_t bound, const std::function<int64_t(int64_t)>& need);
// Prints "memory: about <need> of host memory (<parts>), within <the bound>" when need fits it,
// else throws UsageError "<what>: this run needs about <need> of host memory (<parts>), more than
// <the bound>; <advice>".
void require_host_memory(const HostMemory& mem, int64_t need, const std::string& parts, const std::string& what,
                         const std::string& advice);

// --- plots ----------------------------------------------------------------------------------------

// Throws PlotUnavailable when /usr/bin/python3 (or $DP_BENCH_PYTHON) cannot import matplotlib or
// bench/plot.py is missing; the message says what to install.
struct PlotUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void check_plotting();
// Runs bench/plot.py KIND DATA.json DIR; returns the PNGs it wrote (one per line of its stdout).
std::vector<std::string> run_plot(const std::string& kind, const std::string& json_path, const std::string& dir);
// A subcommand's record: to json_path where given, and with a plot directory to DIR/KIND.json, which
// run_plot then draws there (each PNG's path printed).
void write_record(const std::string& kind, const nlohmann::json& j, const std::string& json_path,
                  const std::string& plot_dir);

// --- small helpers --------------------------------------------------------------------------------

// A plain-text table: the first column left-aligned, the others right-aligned; a row of one cell is
// a heading printed as is (and not counted in the widths).
class Table {
 public:
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  std::string str(int gap = 3) const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string fixed(double v, int decimals);         // "%.*f"
std::string ms(double seconds, int decimals = 2);  // seconds as milliseconds, "%.*f"
std::string pad(const std::string& s, int width, bool right = true);
double median(std::vector<double> v);

// What a record says of its devices, as dp_train's report does (train/report.cpp): "backend" what
// --backend resolved to ("cpu": simulated devices, "cuda"), "backend_requested" as given,
// "device_names". Plots put the kind in their titles from it.
void record_backend(nlohmann::json& into, const std::string& requested, DeviceKind kind,
                    const std::vector<std::string>& names);
// The devices' names, as every bench table and record shows them: several replicas on one device
// (--allow-shared-device) share its name, so each gets its rank added ("cuda:0#1").
std::vector<std::string> replica_names(const std::vector<Device*>& devices);

}  // namespace dp::bench
