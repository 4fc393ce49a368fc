// dp_bench comm: the collectives alone through dp::Communicator, over message sizes doubling from
// --min-bytes to --max-bytes, reported with nccl-tests' definitions (algbw = S/t, busbw = algbw
// times 2(n-1)/n for all_reduce, (n-1)/n for scatter, gather, reduce_scatter and all_gather, 1 for
// broadcast and reduce), and
// the alpha-beta fit of the all-reduce times.
#include <cstdio>
#include <filesystem>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "train/job.h"
#include "train/output_files.h"
#include "train/report.h"

namespace dp::bench {

namespace {

// The sweep as a table, one row per size, and the alpha-beta fit.
void print_comm(const std::vector<CommPoint>& points, const AlphaBeta& ab, const CommSweep& sw,
                const std::vector<std::string>& names, const CommOptions& o) {
  const int n = int(names.size());
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) list += (i ? "," : "") + names[i];
  std::printf(
      "\ncollectives over %d devices (%s): time per op = the slowest rank's mean over up to %d ops after one "
      "warm-up (fewer when an op takes over %.0f ms / %d)\n",
      n, list.c_str(), o.iters, o.budget_seconds * 1e3, o.iters);
  std::printf(
      "S = message size; algbw = S / time; busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (scatter, gather, "
      "reduce_scatter, all_gather), "
      "1 (broadcast, reduce); GB/s = 1e9 B/s\n\n");
  Table t;
  std::vector<std::string> head{"S"};
  for (Collective c : sw.collectives) {
    std::string name = collective_name(c);
    head.push_back(name + " µs");
    head.push_back("algbw");
    head.push_back("busbw");
    if (c == Collective::all_reduce) head.push_back("α-β model µs");
  }
  t.row(head);
  for (int64_t bytes : sweep_sizes(sw.min_bytes, sw.max_bytes)) {
    std::vector<std::string> r{format_bytes(bytes)};
    for (Collective c : sw.collectives)
      for (const CommPoint& p : points)
        if (p.collective == c && p.bytes == bytes) {
          r.push_back(fixed(p.seconds * 1e6, p.seconds < 1e-3 ? 1 : 0));
          r.push_back(fixed(p.algbw / 1e9, 2));
          r.push_back(fixed(p.busbw / 1e9, 2));
          if (c == Collective::all_reduce)
            r.push_back(ab.valid() ? fixed(ab.seconds(double(p.rank_bytes)) * 1e6, 1) : "-");
        }
    t.row(r);
  }
  std::printf("%s", t.str(2).c_str());
  std::printf(
      "\nα-β fit of all_reduce: t = α + S_rank / β with S_rank = the ring's bytes per rank (2(n-1)/n x S), fitted "
      "to each of %d sweeps of all_reduce alone (the first is the table's); the model column uses the median:\n",
      o.repeats);
  std::printf("%s", fit_lines(ab).c_str());
}

}  // namespace

namespace {

// Messages are whole floats: --min-bytes rounds up and --max-bytes down to a multiple of 4, and the
// rounding is said, not done silently; a range holding no multiple of 4 is refused.
CommSweep sweep_of(const CommOptions& o) {
  if (o.min_bytes < 4)
    throw UsageError("--min-bytes: " + std::to_string(o.min_bytes) + " is less than one float; give at least 4");
  if (o.max_bytes < o.min_bytes)
    throw UsageError("--max-bytes: " + commas(o.max_bytes) + " B is below --min-bytes " + commas(o.min_bytes) +
                     " B; the sweep doubles from --min-bytes up to --max-bytes");
  CommSweep sw;
  sw.min_bytes = (o.min_bytes + 3) / 4 * 4, sw.max_bytes = o.max_bytes / 4 * 4;
  sw.max_iters = o.iters, sw.budget_seconds = o.budget_seconds;
  if (sw.min_bytes > sw.max_bytes)
    throw UsageError("--min-bytes " + commas(o.min_bytes) + " to --max-bytes " + commas(o.max_bytes) +
                     ": the range holds no whole number of floats; messages are whole floats (multiples of 4 "
                     "bytes), so give a range containing a multiple of 4, e.g. --min-bytes " +
                     commas(sw.max_bytes) + " or --max-bytes " + commas(sw.min_bytes));
  if (sw.min_bytes != o.min_bytes)
    std::printf("comm: messages are whole floats: --min-bytes %s is measured as %s B\n", commas(o.min_bytes).c_str(),
                commas(sw.min_bytes).c_str());
  if (sw.max_bytes != o.max_bytes)
    std::printf("comm: messages are whole floats: --max-bytes %s is measured as %s B\n", commas(o.max_bytes).c_str(),
                commas(sw.max_bytes).c_str());
  return sw;
}

// The sweep's buffers live in the host's memory on simulated devices: refused past the bound,
// naming the largest --max-bytes that fits.
void check_memory(const CommSweep& sw, int n, bool simulated) {
  if (!simulated) return;
  const HostMemory mem = host_memory();
  auto need = [&](int64_t max_bytes) {
    CommSweep s = sw;
    s.max_bytes = std::max(s.min_bytes, max_bytes / 4 * 4);
    return sweep_bytes(s, n);
  };
  const int64_t fits = largest_fitting(sw.max_bytes, mem.bound(), need) / 4 * 4;
  require_host_memory(mem, sweep_bytes(sw, n),
                      std::to_string(n) +
                          " simulated devices: each a buffer of --max-bytes and a chunk of it, and "
                          "reduce's root (n-1) more buffers",
                      "--max-bytes " + format_bytes(sw.max_bytes),
                      fits >= sw.min_bytes ? "give --max-bytes " + std::to_string(fits) + " or less"
                                           : "even --min-bytes does not fit; give fewer devices");
}

void check_counts(const CommOptions& o) {
  if (o.iters < 1) throw UsageError("--iters: must be at least 1");
  if (o.repeats < 1) throw UsageError("--repeats: " + std::to_string(o.repeats) + " sweeps; give at least 1");
}

// Under mpirun: the options checked on every process, a refusal anywhere every process's.
int run_across_processes(const CommOptions& o, ProcessGroup& group) {
  CommSweep sw;
  refuse_together(group, kDefaultTimeout, [&] {
    check_counts(o);
    if (!o.plot.empty())
      throw UsageError("--plot: comm across processes prints its table and writes --json; it does not plot");
    if (group.rank() == 0) check_output_file("--json", o.json);
    sw = sweep_of(o);
  });
  return run_comm_processes(o, sw, group);
}

}  // namespace

int run_comm(const CommOptions& o) {
  if (o.group) return run_across_processes(o, *o.group);
  check_counts(o);
  check_output_file("--json", o.json);
  check_output_directory("--plot", o.plot);
  if (!o.plot.empty()) check_plotting();
  const CommSweep sw = sweep_of(o);
  DeviceSet set = make_devices(o.devices);
  const int n = int(set.devices.size());
  if (n < 2)
    throw UsageError("--gpus: comm measures collectives between devices; give at least two, e.g. --gpus 0,1,2,3");
  std::printf("%s\n", set.notice.c_str());
  check_memory(sw, n, set.devices[0]->kind() != DeviceKind::cuda);
  std::vector<Device*> devices;
  for (auto& d : set.devices) devices.push_back(d.get());
  const std::vector<std::string> names = replica_names(devices);

  const std::vector<CommPoint> points = run_comm_sweep(devices, sw);
  const AlphaBeta ab = fit_repeated(devices, sw, o.repeats, points);
  int64_t peak = 0;  // the ledgers' (device memory, whatever the backend), against the estimate
  for (Device* d : devices) peak += d->ledger().snapshot().total_peak;

  print_comm(points, ab, sw, names, o);

  nlohmann::json pts = nlohmann::json::array();
  for (const CommPoint& p : points)
    pts.push_back({{"collective", collective_name(p.collective)},
                   {"bytes", p.bytes},
                   {"rank_bytes", p.rank_bytes},
                   {"iters", p.iters},
                   {"time_us", p.seconds * 1e6},
                   {"algbw_gbps", p.algbw / 1e9},
                   {"busbw_gbps", p.busbw / 1e9},
                   {"busbw_factor", busbw_factor(p.collective, n)}});
  nlohmann::json j = {{"command", o.command},
                      {"devices", n},
                      {"names", names},
                      {"backend_notice", set.notice},
                      {"min_bytes", sw.min_bytes},  // as measured: whole floats
                      {"max_bytes", sw.max_bytes},
                      {"memory", {{"estimate_bytes", sweep_bytes(sw, n)}, {"peak_bytes", peak}}},
                      {"max_iters", o.iters},
                      {"repeats", o.repeats},
                      {"points", pts},
                      {"alpha_beta", ab.json()}};
  record_backend(j, o.devices.backend, devices[0]->kind(), names);
  write_record("comm", j, o.json, o.plot);
  return 0;
}

}  // namespace dp::bench
