// dp_bench skew: the memory-skew demo. nn.DataParallel (scatter) keeps more on device 0 than on
// any other device: the whole input batch, the gathered logits and their gradient, the buffer that
// receives every replica's gradients, the optimizer state. DDP (allreduce) keeps the same on every
// device. Printed from each device's ledger at the moment its total peaked; with --device-memory,
// the largest batch each strategy fits, and device 0 running out first under scatter.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "train/options.h"
#include "train/output_files.h"
#include "train/report.h"

namespace dp::bench {
namespace {

struct StrategySkew {
  const Strategy* strategy;
  bool fits = true;
  std::string oom;  // why it did not fit at --batch
  std::vector<LedgerSnapshot> ledgers;
  double skew = 0;
  bool adds_up = true;
  std::vector<std::string> explanation;
};

EngineConfig engine_config(const Strategy* s, int batch, const SkewOptions& o) {
  EngineConfig ec;
  ec.sync = s->name(), ec.split = o.split, ec.batch = batch, ec.momentum = o.momentum, ec.optimizer = o.optimizer;
  return ec;
}

// What the strategy's memory model says device 0 holds, one line a holding: the bytes its formula
// gives and what they are; a category's last line also says whether the ledger booked the sum of its
// lines, where it did not.
void explain(StrategySkew& s, const ModelSpec& spec, const EngineConfig& ec, int n) {
  std::string heading;
  const std::vector<Holding> held = s.strategy->holdings(spec, ec, n, heading);
  s.explanation.push_back(heading);
  std::array<int64_t, kCategories> sum{}, left{};
  for (const Holding& h : held)
    if (h.checked) sum[size_t(h.category)] += h.bytes, ++left[size_t(h.category)];
  for (const Holding& h : held) {
    const size_t c = size_t(h.category);
    std::string line = pad(category_name(h.category), 11, false) + pad(commas(h.bytes) + " B", 13) + "  " + h.what;
    const int64_t booked = s.ledgers[0].at_peak[c];
    if (h.checked && --left[c] == 0 && sum[c] != booked) line += " [the ledger has " + commas(booked) + " B]";
    s.explanation.push_back(line);
  }
}

StrategySkew measure(const std::vector<Device*>& devices, const Strategy* strategy, const ModelSpec& spec,
                     const SkewOptions& o, const SyntheticData& data, const std::vector<float>& init) {
  StrategySkew s;
  s.strategy = strategy;
  // Peaks from the engine's construction on: its buffers are most of what a step holds.
  for (Device* d : devices) d->ledger().reset_peak();
  try {
    Engine engine(devices, spec, engine_config(strategy, o.batch, o));
    engine.set_params(init);
    for (int i = 0; i < o.steps; ++i) engine.step(data.images(i), data.labels(i), o.batch);
    for (Device* d : devices) s.ledgers.push_back(d->ledger().snapshot());
  } catch (const OutOfMemory& e) {
    s.fits = false;
    s.oom = e.what();
    return s;
  }
  const int n = int(devices.size());
  double others = 0;
  for (int r = 1; r < n; ++r) others += double(s.ledgers[r].total_peak);
  s.skew = double(s.ledgers[0].total_peak) / (others / (n - 1));
  for (const auto& l : s.ledgers) {
    int64_t sum = 0;
    for (int64_t v : l.at_peak) sum += v;
    s.adds_up = s.adds_up && sum == l.total_peak;
  }
  explain(s, spec, engine_config(strategy, o.batch, o), n);
  return s;
}

struct Trial {
  bool fits = true;
  int device = -1;  // the rank that ran out
  std::string message;
  int64_t peak0 = 0, peak_others = 0;  // device 0's peak, the largest of the others'
};

// Builds an engine at global batch b and steps it. The search steps a single sample: nearly every
// buffer is sized for b when the engine is built, and the communicator's scratch (allocated at the
// first reduce or all-reduce) depends on P only. `full` steps the whole batch.
Trial try_batch(const std::vector<Device*>& devices, const Strategy* strategy, const ModelSpec& spec, int b,
                const SkewOptions& o, const std::vector<float>& init, bool full) {
  Trial t;
  for (Device* d : devices) d->ledger().reset_peak();
  try {
    Engine engine(devices, spec, engine_config(strategy, b, o));
    engine.set_params(init);
    // BatchNorm needs more than one value per channel: two samples per device.
    int n = full ? b : std::min(b, spec.has_batchnorm() ? 2 * int(devices.size()) : 1);
    SyntheticData data = make_synthetic(spec, n, 1, o.seed);
    engine.step(data.images(0), data.labels(0), n);
    t.peak0 = devices[0]->ledger().snapshot().total_peak;
    for (size_t r = 1; r < devices.size(); ++r)
      t.peak_others = std::max(t.peak_others, devices[r]->ledger().snapshot().total_peak);
  } catch (const OutOfMemory& e) {
    t.fits = false;
    t.device = e.device;
    t.message = e.what();
  }
  return t;
}

struct Search {
  const Strategy* strategy;
  int largest = 0;         // 0: not even batch 1
  Trial at_largest, past;  // a full step at the largest batch; the first batch that does not fit
};

Search search_batches(const std::vector<Device*>& devices, const Strategy* strategy, const ModelSpec& spec,
                      const SkewOptions& o, const std::vector<float>& init) {
  Search s;
  s.strategy = strategy;
  constexpr int kLimit = 1 << 24;  // a cap this generous is not a demo
  int lo = 0, hi = 1;
  for (;;) {
    Trial t = try_batch(devices, strategy, spec, hi, o, init, false);
    if (!t.fits) {
      s.past = t;
      break;
    }
    lo = hi;
    if (hi >= kLimit)
      throw UsageError("--device-memory: " + format_bytes(devices[0]->ledger().cap()) +
                       " per device fits a batch of over " + commas(kLimit) + "; give a smaller cap");
    hi *= 2;
  }
  // Narrows lo (fits) and hi (does not) to neighbours, the trials at either end in s.
  auto bisect = [&](bool full) {
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      Trial t = try_batch(devices, strategy, spec, mid, o, init, full);
      if (t.fits)
        lo = mid, s.at_largest = t;
      else
        hi = mid, s.past = t;
    }
    s.largest = lo;
  };
  bisect(false);
  if (lo > 0) s.at_largest = try_batch(devices, strategy, spec, lo, o, init, true);
  if (lo == 0 || s.at_largest.fits) return s;
  // What a single sample does not allocate (zero2's gradient buckets alive at once depend on whether
  // the convolutions run in chunks, as a full batch does): the rest of the search steps full batches.
  s.past = s.at_largest, s.at_largest = Trial();
  hi = lo, lo = 0;
  bisect(true);
  return s;
}

// The steps this demo takes as a training run's options, for the record's "config" (the learning
// rate and buckets are the engine's defaults, as the demo's engines use them).
TrainOptions as_training(const SkewOptions& o) {
  TrainOptions t;
  t.model = o.model, t.width = o.width, t.batch = o.batch, t.momentum = o.momentum, t.seed = o.seed,
  t.optimizer = o.optimizer;
  t.devices = o.devices, t.split = o.split;
  return t;
}

nlohmann::json ledger_json(const LedgerSnapshot& l) {
  nlohmann::json cats = nlohmann::json::object();
  for (int c = 0; c < kCategories; ++c) cats[category_name(Category(c))] = l.at_peak[c];
  return cats;
}

void print_header(const ModelSpec& spec, const SkewOptions& o, int n) {
  std::string sizes;
  for (int v : split_batch(o.batch, n, o.split)) {  // two appends: GCC 12 warns (-Wrestrict) at "+" + to_string
    if (!sizes.empty()) sizes += '+';
    sizes += std::to_string(v);
  }
  const int64_t cap = o.devices.memory_cap;
  std::printf(
      "\nmemory per device at its peak, by category (%s, P = %s parameters, global batch %d = %s over %d devices, "
      "%s, %d steps%s; no prefetch: dp_train's default also holds the next step's batch, on device 0 alone under "
      "scatter, as dp_train --no-prefetch does not)\n",
      spec.title().c_str(), commas(spec.param_count).c_str(), o.batch, sizes.c_str(), n,
      o.optimizer == Optimizer::adam    ? "Adam"
      : o.optimizer == Optimizer::adamw ? "AdamW"
      : o.momentum != 0                 ? "SGD with momentum"
                                        : "plain SGD",
      o.steps, cap > 0 ? (", --device-memory " + format_bytes(cap)).c_str() : "");
}

// One strategy's ledgers, its skew and what makes it up; false when the categories do not add up.
bool print_strategy(const StrategySkew& s, const std::vector<std::string>& names, int batch) {
  std::printf("\n%s\n", s.strategy->name());
  if (!s.fits) {
    std::printf("  does not fit at batch %d: %s\n", batch, s.oom.c_str());
    return true;
  }
  Table t;
  std::vector<std::string> head{"  category"};
  for (auto& nm : names) head.push_back(nm);
  t.row(head);
  for (int c = 0; c < kCategories; ++c) {
    int64_t largest = 0;
    for (const LedgerSnapshot& l : s.ledgers) largest = std::max(largest, l.peak[c]);
    if (!shown(Category(c), largest)) continue;
    std::vector<std::string> r{"  " + std::string(category_name(Category(c)))};
    for (auto& l : s.ledgers) r.push_back(format_bytes(l.at_peak[c]));
    t.row(r);
  }
  std::vector<std::string> total{"  total at peak"};
  for (auto& l : s.ledgers) total.push_back(format_bytes(l.total_peak));
  t.row(total);
  std::printf("%s", t.str().c_str());
  const int n = int(s.ledgers.size());
  double others = 0;
  for (int r = 1; r < n; ++r) others += double(s.ledgers[r].total_peak);
  std::printf("  skew = device 0's peak / mean peak of the others = %s / %s = %.3f\n",
              format_bytes(s.ledgers[0].total_peak).c_str(), format_bytes(int64_t(others / (n - 1))).c_str(), s.skew);
  for (auto& line : s.explanation) std::printf("  %s\n", line.c_str());
  if (s.adds_up) return true;
  std::printf("  ERROR: the categories at the peak do not add up to the peak on some device\n");
  return false;
}

// A skewed strategy's skew above 1 (scatter's), a balanced one's within 2% of it; false when a check fails.
bool print_checks(const std::vector<StrategySkew>& results, const SkewOptions& o) {
  bool ok = true;
  std::printf("\nchecks:\n");
  for (const auto& s : results) {
    if (!s.fits) continue;
    const bool skewed = s.strategy->skewed(engine_config(s.strategy, o.batch, o));
    const bool pass = skewed ? s.skew > 1.0 : std::fabs(s.skew - 1.0) < 0.02;
    std::printf("  %-9s skew %.3f %s  categories add up to the peak on every device: %s\n", s.strategy->name(), s.skew,
                skewed ? (pass ? "> 1: yes" : "> 1: NO") : (pass ? "within 2% of 1: yes" : "within 2% of 1: NO"),
                s.adds_up ? "yes" : "NO");
    ok = ok && pass && s.adds_up;
  }
  return ok;
}

// found: every strategy's search. False when a full step at the largest batch found ran out.
bool print_search(const std::vector<Search>& found) {
  for (const auto& f : found) {
    std::printf("  %-10s %s\n", f.strategy->name(),
                f.largest > 0 ? ("fits up to batch " + commas(f.largest) + ", where device 0 peaks at " +
                                 format_bytes(f.at_largest.peak0) + " and the others at " +
                                 format_bytes(f.at_largest.peak_others))
                                    .c_str()
                              : "does not fit even batch 1");
    std::printf("  %-10s stops at %s: %s\n", "", commas(f.largest + 1).c_str(), f.past.message.c_str());
  }
  auto named = [&](const char* name) -> const Search& {
    for (const Search& f : found)
      if (std::string(f.strategy->name()) == name) return f;
    throw std::logic_error(std::string("skew: no search for ") + name);
  };
  const Search &sc = named("scatter"), &ar = named("allreduce");
  if (sc.largest < ar.largest && sc.past.device == 0)
    std::printf(
        "so at batch %s device 0 runs out under scatter, while allreduce still fits (up to %s): under scatter "
        "device 0 is the one that needs the bigger device.\n",
        commas(sc.largest + 1).c_str(), commas(ar.largest).c_str());
  else
    std::printf(
        "note: with this cap scatter does not run out on device 0 before allreduce does (scatter stops at %s on "
        "device %d, allreduce at %s)\n",
        commas(sc.largest + 1).c_str(), sc.past.device, commas(ar.largest + 1).c_str());
  if (std::all_of(found.begin(), found.end(), [](const Search& f) { return f.at_largest.fits; })) return true;
  std::printf(
      "ERROR: a full step at the largest batch found ran out of memory: the search's single-sample step missed an "
      "allocation\n");
  return false;
}

nlohmann::json search_json(const std::vector<Search>& found, int64_t cap) {
  nlohmann::json j = {{"cap_bytes", cap}};
  for (const auto& f : found)
    j[f.strategy->name()] = {{"largest_batch", f.largest},
                             {"device0_peak_at_largest", f.at_largest.peak0},
                             {"others_peak_at_largest", f.at_largest.peak_others},
                             {"stops_at", f.largest + 1},
                             {"out_of_memory_device", f.past.device},
                             {"out_of_memory", f.past.message}};
  return j;
}

nlohmann::json skew_json(const SkewOptions& o, const ModelSpec& spec, DeviceKind kind,
                         const std::vector<std::string>& names, const std::vector<StrategySkew>& results,
                         const nlohmann::json& search, bool ok) {
  nlohmann::json strategies = nlohmann::json::array();
  for (const auto& s : results) {
    nlohmann::json devs = nlohmann::json::array();
    for (size_t r = 0; r < s.ledgers.size(); ++r) {
      int64_t sum = 0;
      for (int64_t v : s.ledgers[r].at_peak) sum += v;
      devs.push_back({{"rank", r},
                      {"name", names[r]},
                      {"peak_bytes", s.ledgers[r].total_peak},
                      {"at_peak", ledger_json(s.ledgers[r])},
                      {"at_peak_sum", sum}});
    }
    strategies.push_back({{"strategy", s.strategy->name()},
                          {"fits", s.fits},
                          {"out_of_memory", s.oom},
                          {"skew", s.fits ? nlohmann::json(s.skew) : nlohmann::json()},
                          {"categories_add_up", s.adds_up},
                          {"explanation", s.explanation},
                          {"devices", devs}});
  }
  nlohmann::json config = run_config(as_training(o), spec, o.steps);
  for (int c = 0; c < kCategories; ++c) config["categories"].push_back(category_name(Category(c)));
  record_backend(config, o.devices.backend, kind, names);
  return {{"command", o.command},     {"config", config}, {"devices", names},
          {"strategies", strategies}, {"search", search}, {"ok", ok}};
}

// The host memory the demo takes: the synthetic data and, on simulated devices, the engines' peak
// or, with --device-memory, the batch search's, which fills every device up to its cap. Printed, or
// refused with the largest cap or batch that fits.
void check_memory(const std::vector<Device*>& devices, const ModelSpec& spec, const SkewOptions& o) {
  const int n = int(devices.size());
  const bool host = devices[0]->kind() != DeviceKind::cuda;
  const int64_t cap_total = caps_total(o.devices.memory_cap, n);
  std::vector<DeviceBytes> lines;
  if (host && cap_total == 0)
    for (const Strategy* s : strategies())
      lines.push_back(measure_device_bytes(devices, spec, engine_config(s, o.batch, o)));
  auto on_devices = [&](int64_t b) {
    int64_t m = host ? cap_total : 0;
    for (const DeviceBytes& l : lines) m = std::max(m, l.at(b));
    return m;
  };
  auto need = [&](int64_t b) { return synthetic_bytes(spec, b, o.steps) + on_devices(b); };
  const HostMemory mem = host_memory();
  const int64_t data = synthetic_bytes(spec, o.batch, o.steps);
  std::string what = "--batch " + std::to_string(o.batch), advice;
  if (host && cap_total > 0 && data < mem.bound()) {
    const int64_t cap_fits = (mem.bound() - data) / n >> 20;  // MiB
    what = "--device-memory " + format_bytes(o.devices.memory_cap) + " on " + std::to_string(n) + " devices";
    advice = cap_fits << 20 >= kMinDeviceMemory ? "give --device-memory " + std::to_string(cap_fits) + "M or less"
                                                : "give fewer devices";
  } else {
    const int64_t fits = largest_fitting(o.batch, mem.bound(), need);
    advice = fits > 0 ? "the largest batch that fits is " + std::to_string(fits)
                      : "not even a batch of 1 fits; give fewer devices or a smaller --device-memory";
  }
  const std::string parts =
      "the synthetic data " + format_bytes(data) + ", " + std::to_string(o.steps) + " batches of " + commas(o.batch) +
      " images; " +
      (!host ? std::string("the CUDA devices' memory is their own")
       : cap_total > 0
           ? "the batch search fills each of the " + std::to_string(n) + " simulated devices to its cap, " +
                 format_bytes(cap_total) + " in all"
           : "the simulated devices " + format_bytes(on_devices(o.batch)) + " at their peak, by their ledgers");
  require_host_memory(mem, need(o.batch), parts, what, advice);
}

}  // namespace

int run_skew(const SkewOptions& o) {
  if (o.batch <= 0)
    throw UsageError("--batch: " + std::to_string(o.batch) +
                     " is not a batch size; give a positive number of images, e.g. 256");
  check_output_file("--json", o.json);
  check_output_directory("--plot", o.plot);
  if (!o.plot.empty()) check_plotting();
  const ModelSpec spec = make_model(o.model, o.width);
  DeviceSet set = make_devices(o.devices);
  const int n = int(set.devices.size());
  if (n < 2)
    throw UsageError("--gpus: skew compares device 0 with the others; give at least two devices, e.g. --gpus 0,1,2,3");
  std::printf("%s\n", set.notice.c_str());
  std::vector<Device*> devices;
  for (auto& d : set.devices) devices.push_back(d.get());
  const std::vector<std::string> names = replica_names(devices);
  check_memory(devices, spec, o);
  const SyntheticData data = make_synthetic(spec, o.batch, o.steps, o.seed);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, o.seed, init.data());
  const int64_t cap = o.devices.memory_cap;

  print_header(spec, o, n);
  std::vector<StrategySkew> results;
  bool ok = true;
  for (const Strategy* s : strategies()) {
    results.push_back(measure(devices, s, spec, o, data, init));
    ok = print_strategy(results.back(), names, o.batch) && ok;
  }
  ok = print_checks(results, o) && ok;

  nlohmann::json search = nullptr;
  if (cap > 0) {
    std::printf(
        "\nthe largest global batch each strategy fits in %s per device (doubling, then bisecting; an engine is "
        "built and stepped at each batch):\n",
        format_bytes(cap).c_str());
    std::vector<Search> found;
    for (const Strategy* s : strategies()) found.push_back(search_batches(devices, s, spec, o, init));
    ok = print_search(found) && ok;
    search = search_json(found, cap);
  }

  const nlohmann::json j = skew_json(o, spec, devices[0]->kind(), names, results, search, ok);
  write_record("skew", j, o.json, o.plot);
  return ok ? 0 : 1;
}

}  // namespace dp::bench
