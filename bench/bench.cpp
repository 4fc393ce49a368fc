#include "bench/bench.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/error.h"
#include "train/options.h"
#include "train/report.h"

extern char** environ;

namespace dp::bench {

// --- synthetic data -------------------------------------------------------------------------------

namespace {
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

SyntheticData make_synthetic(const ModelSpec& spec, int batch, int batches, uint64_t seed) {
  SyntheticData d;
  d.batch = batch, d.batches = std::max(1, batches), d.image_size = spec.input_size();
  d.x.resize(size_t(d.batches) * size_t(batch) * size_t(d.image_size));
  d.y.resize(size_t(d.batches) * size_t(batch));
  uint64_t state = seed ^ 0x5DEECE66Dull;
  for (auto& v : d.x) v = float(splitmix64(state) >> 40) * 0x1.0p-24f;  // 24 random bits: exact in a float, < 1
  for (auto& v : d.y) v = int32_t(splitmix64(state) % uint64_t(spec.classes));
  return d;
}

// --- the byte model across processes -------------------------------------------------------------

HierarchicalTraffic hierarchical_all_reduce_traffic(int64_t count, int K, int P, int k, int p) {
  HierarchicalTraffic t;
  if (K > 1) t.local = dp::ring_all_reduce_traffic(k, K, count);
  const int64_t chunk = K > 1 ? even_chunks(count, K)[size_t(ring_owned_chunk(k, K))] : count;
  if (P > 1) t.inter = dp::ring_all_reduce_traffic(p, P, chunk);
  return t;
}

// --- the alpha-beta model -------------------------------------------------------------------------

double AlphaBeta::step_seconds(const std::vector<CollectiveTraffic>& collectives) const {
  double s = 0;
  for (const auto& c : collectives) s += seconds(double(c.busiest()));
  return s;
}

// Ordinary least squares on t would let the few largest sizes (seconds) decide everything and leave
// alpha (microseconds) as the residue of their noise, often negative. Minimising the relative error
// Σ ((t_i − α − x_i/β) / t_i)² weighs every size alike, so the small sizes pin α and the large
// ones β. A negative α (no measurable latency) is clamped to 0 and β refitted alone.
AlphaBeta fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t) {
  double sw = 0, sx = 0, sxx = 0, st = 0, sxt = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!(t[i] > 0)) continue;
    double w = 1.0 / (t[i] * t[i]);
    sw += w, sx += w * x[i], sxx += w * x[i] * x[i], st += w * t[i], sxt += w * x[i] * t[i];
  }
  AlphaBeta ab;
  double det = sw * sxx - sx * sx;
  if (sw == 0 || det <= 0) return ab;
  double a = (st * sxx - sx * sxt) / det, b = (sw * sxt - sx * st) / det;
  if (a < 0) a = 0, b = sxt / sxx;
  if (b <= 0) return ab;
  ab.alpha = a, ab.beta = 1.0 / b;
  return ab;
}

std::optional<AlphaBeta> given_alpha_beta(std::optional<double> alpha_us, std::optional<double> beta_gbps) {
  auto value = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  if (alpha_us && !(*alpha_us >= 0 && std::isfinite(*alpha_us)))
    throw UsageError("--alpha-us: must be a finite latency >= 0 in µs, not " + value(*alpha_us));
  if (beta_gbps && !(*beta_gbps > 0 && std::isfinite(*beta_gbps)))
    throw UsageError("--beta-gbps: must be a finite bandwidth > 0 in GB/s, not " + value(*beta_gbps));
  if (alpha_us.has_value() != beta_gbps.has_value())
    throw UsageError("--alpha-us and --beta-gbps: give both (or neither, to fit them here)");
  if (!alpha_us) return std::nullopt;
  AlphaBeta ab;
  ab.alpha = *alpha_us * 1e-6, ab.beta = *beta_gbps * 1e9;
  ab.source = "given: --alpha-us/--beta-gbps";
  return ab;
}

AlphaBeta median_fit(const std::vector<AlphaBeta>& fits) {
  AlphaBeta m;
  std::vector<double> alphas, betas;
  for (const AlphaBeta& f : fits) {
    m.repeats.emplace_back(f.alpha, f.valid() ? f.beta : 0.0);
    if (f.valid()) alphas.push_back(f.alpha), betas.push_back(f.beta);
  }
  if (betas.empty()) return m;
  m.alpha = median(alphas), m.beta = median(betas);
  m.source = "median of " + std::to_string(fits.size()) + " repeats, each " + fits.front().source;
  return m;
}

namespace {
// The repeats that fitted: their alphas (seconds) and betas (B/s), each sorted.
std::pair<std::vector<double>, std::vector<double>> fitted(const AlphaBeta& ab) {
  std::vector<double> a, b;
  for (auto [alpha, beta] : ab.repeats)
    if (beta > 0) a.push_back(alpha), b.push_back(beta);
  std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
  return {a, b};
}
}  // namespace

std::string AlphaBeta::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "α = %.1f µs, β = %.2f GB/s", alpha * 1e6, beta / 1e9);
  std::string s = buf;
  if (repeats.empty()) return s;
  auto [a, b] = fitted(*this);
  const std::string fits = a.size() == repeats.size() ? "" : ", of which " + std::to_string(a.size()) + " gave a fit";
  std::snprintf(buf, sizeof buf, "; min–max α %.1f–%.1f µs, β %.2f–%.2f GB/s)", a.front() * 1e6, a.back() * 1e6,
                b.front() / 1e9, b.back() / 1e9);
  return s + " (median over " + std::to_string(repeats.size()) + " repeats" + fits + buf;
}

std::string fit_lines(const AlphaBeta& ab) {
  std::string s =
      ab.valid() ? "  " + ab.describe() + "\n" : "  no fit (too few sizes or times that do not grow with size)\n";
  char buf[128];
  for (size_t i = 0; i < ab.repeats.size(); ++i) {
    auto [alpha, beta] = ab.repeats[i];
    if (beta > 0)
      std::snprintf(buf, sizeof buf, "  repeat %zu: α = %.1f µs, β = %.2f GB/s\n", i + 1, alpha * 1e6, beta / 1e9);
    else
      std::snprintf(buf, sizeof buf, "  repeat %zu: no fit\n", i + 1);
    s += buf;
  }
  return s;
}

nlohmann::json AlphaBeta::json() const {
  if (!valid()) return nullptr;
  nlohmann::json j = {{"alpha_us", alpha * 1e6}, {"beta_gbps", beta / 1e9}, {"source", source}};
  if (repeats.empty()) return j;
  auto [a, b] = fitted(*this);
  nlohmann::json per = nlohmann::json::array();
  for (auto [alpha_s, beta_bps] : repeats)
    per.push_back(beta_bps > 0 ? nlohmann::json{{"alpha_us", alpha_s * 1e6}, {"beta_gbps", beta_bps / 1e9}}
                               : nlohmann::json());
  j["fit"] = "median";
  j["repeats"] = repeats.size();
  j["fitted"] = a.size();
  j["spread"] = {{"alpha_us", {{"min", a.front() * 1e6}, {"max", a.back() * 1e6}}},
                 {"beta_gbps", {{"min", b.front() / 1e9}, {"max", b.back() / 1e9}}}};
  j["per_repeat"] = per;
  return j;
}

// --- memory, checked before a run ---------------------------------------------------------------

int64_t DeviceBytes::at(int64_t batch) const {
  if (!host) return 0;
  const int64_t whole = (batch + n - 1) / n * n;  // every device's buffers hold the largest shard
  const int64_t bytes = int64_t(std::ceil(fixed + per_sample * double(whole)));
  return cap_total > 0 ? std::min(bytes, cap_total) : bytes;
}

DeviceBytes measure_device_bytes(const std::vector<Device*>& devices, const ModelSpec& spec, EngineConfig config) {
  DeviceBytes line;
  line.n = int(devices.size());
  line.cap_total = caps_total(devices[0]->ledger().cap(), line.n);
  line.host = devices[0]->kind() != DeviceKind::cuda;
  if (!line.host) return line;
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 0, init.data());
  // Buffers are sized for the batch when the engine is built; a small step adds the communicator's
  // scratch, which depends on P only (skew's batch search relies on the same). One image, or with
  // BatchNorm two per device (it needs more than one value per channel).
  const int small = spec.has_batchnorm() ? 2 * line.n : 1;
  const SyntheticData one = make_synthetic(spec, small, 1, 0);
  auto peak = [&](int per_device) {
    for (Device* d : devices) d->ledger().reset_peak();
    config.batch = per_device * line.n;
    {
      Engine engine(devices, spec, config);
      engine.set_params(init);
      engine.step(one.images(0), one.labels(0), small);
    }
    int64_t sum = 0;
    for (Device* d : devices) sum += d->ledger().snapshot().total_peak;
    return double(sum);
  };
  try {
    const double lo = peak(32), hi = peak(64);
    line.per_sample = (hi - lo) / (32.0 * line.n);
    line.fixed = lo - line.per_sample * 32 * line.n;
  } catch (const OutOfMemory&) {
    line.fixed = double(line.cap_total);  // a cap too small for the measurement bounds the devices anyway
  }
  for (Device* d : devices) d->ledger().reset_peak();
  return line;
}

int64_t caps_total(int64_t cap, int n) { return std::min<int64_t>(cap, (int64_t(1) << 62) / n) * n; }

int64_t synthetic_bytes(const ModelSpec& spec, int64_t batch, int64_t batches) {
  return std::max<int64_t>(1, batches) * batch *
         (spec.input_size() * int64_t(sizeof(float)) + int64_t(sizeof(int32_t)));
}

int64_t largest_fitting(int64_t hi, int64_t bound, const std::function<int64_t(int64_t)>& need) {
  int64_t lo = 0;  // need(lo) fits or lo == 0
  if (need(hi) <= bound) return hi;
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    (need(mid) <= bound ? lo : hi) = mid;
  }
  return need(lo) <= bound ? lo : 0;
}

void require_host_memory(const HostMemory& mem, int64_t need, const std::string& parts, const std::string& what,
                         const std::string& advice) {
  if (need > mem.bound())
    throw UsageError(what + ": this run needs about " + format_bytes(need) + " of host memory (" + parts +
                     "), more than " + mem.describe() + "; " + advice);
  std::printf("memory: about %s of host memory (%s), within %s\n", format_bytes(need).c_str(), parts.c_str(),
              mem.describe().c_str());
}

// --- plots ----------------------------------------------------------------------------------------

namespace {

std::string python() {
  const char* env = std::getenv("DP_BENCH_PYTHON");  // lets a test point at a python without matplotlib
  return env && *env ? env : "/usr/bin/python3";
}

std::string plot_script() { return std::string(DP_SOURCE_DIR) + "/bench/plot.py"; }

// Runs argv[0] with argv (no shell); returns its exit status, -1 when it could not start. stdout
// is captured into *out when given, else discarded with stderr.
int run_process(const std::vector<std::string>& args, std::string* out) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  if (!out) posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return -1;
  }
  char chunk[4096];
  ssize_t got;
  while ((got = read(fds[0], chunk, sizeof chunk)) > 0)
    if (out) out->append(chunk, size_t(got));
  close(fds[0]);
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

void check_plotting() {
  const std::string py = python();
  if (access(py.c_str(), X_OK) != 0)
    throw PlotUnavailable("--plot needs " + py + " with matplotlib, and there is no " + py +
                          " (Debian: apt install python3 python3-matplotlib). Plots are optional: leave out --plot, or "
                          "keep the --json and plot elsewhere.");
  if (run_process({py, "-c", "import matplotlib"}, nullptr) != 0)
    throw PlotUnavailable("--plot needs matplotlib, and " + py +
                          " cannot import it (Debian: apt install python3-matplotlib). Plots are optional: leave "
                          "out --plot, or keep the --json and plot elsewhere.");
  if (!std::filesystem::exists(plot_script()))
    throw PlotUnavailable("--plot: the plotting script " + plot_script() +
                          " is missing (dp_bench looks for it in the "
                          "source tree it was built from)");
}

std::vector<std::string> run_plot(const std::string& kind, const std::string& json_path, const std::string& dir) {
  std::string out;
  int rc = run_process({python(), plot_script(), kind, json_path, dir}, &out);
  if (rc != 0)
    throw PlotUnavailable("--plot: " + plot_script() + " " + kind + " failed (exit " + std::to_string(rc) +
                          "); the data is in " + json_path);
  std::vector<std::string> pngs;
  size_t at = 0;
  while (at < out.size()) {
    size_t nl = out.find('\n', at);
    if (nl == std::string::npos) nl = out.size();
    if (nl > at) pngs.push_back(out.substr(at, nl - at));
    at = nl + 1;
  }
  return pngs;
}

void write_record(const std::string& kind, const nlohmann::json& j, const std::string& json_path,
                  const std::string& plot_dir) {
  if (!json_path.empty()) write_json(json_path, j);
  if (plot_dir.empty()) return;
  std::filesystem::create_directories(plot_dir);
  const std::string data_path = (std::filesystem::path(plot_dir) / (kind + ".json")).string();
  write_json(data_path, j);
  for (const auto& png : run_plot(kind, data_path, plot_dir)) std::printf("plot: %s\n", png.c_str());
}

// --- small helpers --------------------------------------------------------------------------------

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string ms(double seconds, int decimals) { return fixed(seconds * 1e3, decimals); }

namespace {
int shown_width(const std::string& s) {
  int w = 0;
  for (unsigned char ch : s) w += (ch & 0xC0) != 0x80;
  return w;
}
}  // namespace

std::string pad(const std::string& s, int width, bool right) {
  // Width in characters on screen: count UTF-8 lead bytes only (Σ, α, β, ≈ are multi-byte).
  int shown = shown_width(s);
  if (shown >= width) return s;
  std::string fill(size_t(width - shown), ' ');
  return right ? fill + s : s + fill;
}

std::string Table::str(int gap) const {
  std::vector<int> width;
  for (const auto& r : rows_) {
    if (r.size() < 2) continue;
    if (width.size() < r.size()) width.resize(r.size(), 0);
    for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], shown_width(r[c]));
  }
  std::string out;
  for (const auto& r : rows_) {
    if (r.size() < 2) {
      out += (r.empty() ? "" : r[0]) + "\n";
      continue;
    }
    std::string line = pad(r[0], width[0], false);
    for (size_t c = 1; c < r.size(); ++c) line += std::string(size_t(gap), ' ') + pad(r[c], width[c]);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

void record_backend(nlohmann::json& into, const std::string& requested, DeviceKind kind,
                    const std::vector<std::string>& names) {
  into["backend"] = kind_name(kind);
  into["backend_requested"] = requested;
  into["device_names"] = names;
}

std::vector<std::string> replica_names(const std::vector<Device*>& devices) {
  std::vector<std::string> names;
  for (Device* d : devices) {
    int same = 0;
    for (Device* e : devices) same += e->name() == d->name();
    names.push_back(same > 1 ? d->name() + "#" + std::to_string(d->rank()) : d->name());
  }
  return names;
}

}  // namespace dp::bench
