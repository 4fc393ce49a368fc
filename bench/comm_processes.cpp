// dp_bench comm under mpirun: the all-reduce across processes beside MPI's own, in the same run.
//
//   mpirun -np P dp_bench comm --devices K ...
//
// For each message size S (doubling from --min-bytes to --max-bytes, plus LeNet's gradient, the size a
// training step all-reduces), two measurements one after the other:
//   dp    the all-reduce a training job runs (ProcessCommunicator: reduce-scatter among the process's K
//         devices, each device's chunk all-reduced with the same device of every other process, then
//         all-gather among the K), on every device of every process: n = P·K ranks.
//   MPI   a bare MPI_Allreduce of S bytes between the P processes, from one thread each (no deadline,
//         no polling of ours): the reference dp's path is measured against. n = P.
// Each is reported as nccl-tests does: time per op = the slowest rank's mean over the timed ops (every
// rank's clock starts after a barrier), algbw = S / time, busbw = algbw × 2(n-1)/n. With K = 1 both
// move the same bytes over the same links, so their busbw ratio is what dp's path costs over MPI's.
//
// Then one all-reduce of LeNet's gradient on every device, its bytes (inside the process and across
// processes) against hierarchical_all_reduce_traffic; a device off the model fails the run (exit 1).
// Then the α-β fit of dp's all-reduce across processes, as the one-process comm's (each of --repeats
// sweeps fitted alone, the median; the first sweep is the table's, the others time dp's all-reduce alone):
// the α and β a model of the job takes (dp_bench scale --alpha-us --beta-gbps; bench/scale_processes.sh).
// Rank 0 prints (the others' stdout is silenced) and writes --json; --plot is the one-process comm's.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "engine/process_communicator.h"
#include "engine/process_group.h"
#include "models/model.h"
#include "train/job.h"
#include "train/output_files.h"
#include "train/report.h"

namespace dp::bench {

namespace {

using clock = std::chrono::steady_clock;

double since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

struct Measured {
  double seconds = 0;  // per op, the slowest rank of every process
  int iters = 0;
  double algbw = 0, busbw = 0;
};

// The largest of every process's value (the host channel's max).
double job_max(ProcessGroup& group, double v, double timeout) {
  group.all_reduce_max(&v, 1, Deadline::after(timeout), "dp_bench comm's timing");
  return v;
}

// Times one collective across processes as time_op does in one process: `run(iters)` runs this
// process's part of `iters` back-to-back ops and returns its seconds (its slowest thread's). A warm-up
// op sizes the run to the budget (its slowest time over the job, so every process runs as many ops),
// then every process starts after a barrier; the op takes as long as the slowest process.
Measured measure(ProcessGroup& group, const CommOptions& o, double timeout, int64_t bytes, int n,
                 const std::function<double(int)>& run) {
  const double warm = job_max(group, run(1), timeout);
  Measured m;
  m.iters = std::clamp(int(o.budget_seconds / std::max(warm, 1e-9)), 1, std::max(1, o.iters));
  group.barrier(Deadline::after(timeout), "dp_bench comm's start barrier");
  m.seconds = job_max(group, run(m.iters), timeout) / m.iters;
  m.algbw = double(bytes) / m.seconds;
  m.busbw = m.algbw * busbw_factor(Collective::all_reduce, n);
  return m;
}

// "vm" or "node1, node2": the job's hosts, each once, in rank order.
std::string comm_hosts(const ProcessGroup& group) {
  std::vector<std::string> seen;
  std::string out;
  for (const std::string& h : group.hosts())
    if (std::find(seen.begin(), seen.end(), h) == seen.end()) out += (seen.empty() ? "" : ", ") + h, seen.push_back(h);
  return out;
}

nlohmann::json json_of(const Measured& m, int n) {
  return {{"ranks", n},
          {"iters", m.iters},
          {"time_us", m.seconds * 1e6},
          {"algbw_gbps", m.algbw / 1e9},
          {"busbw_gbps", m.busbw / 1e9}};
}

// The devices of this process in a communicator across the job, with one buffer each of the largest size.
struct Job {
  ProcessGroup& group;
  const CommOptions& o;
  std::vector<Device*> devices;
  ProcessCommunicator comm;
  int K, P, n;
  double timeout;
  std::vector<Buffer> buf;  // per device: (max_count)

  Job(ProcessGroup& g, const CommOptions& options, std::vector<Device*> devs, int64_t max_count)
      : group(g),
        o(options),
        devices(std::move(devs)),
        comm(devices, g),
        K(int(devices.size())),
        P(g.size()),
        n(P * K),
        timeout(comm.timeout()),
        buf(devices.size()) {
    spmd(comm, devices, [&](int k) {
      buf[size_t(k)] = devices[size_t(k)]->alloc_floats(max_count, Category::workspace);
      devices[size_t(k)]->ops().fill(max_count, 0.0f, buf[size_t(k)].f());  // zeros: repeated sums stay finite
      devices[size_t(k)]->synchronize();
    });
  }
  ~Job() {
    for (int k = 0; k < K; ++k) devices[size_t(k)]->run([&, k] { buf[size_t(k)].reset(); }).get();
  }

  // dp's all-reduce of `bytes` on every device of every process, its ops back to back on each device's
  // thread, as in a training step (the hand-off to the threads is paid once per run, not per op).
  Measured time_dp(int64_t bytes);
  // dp's all-reduce beside a bare MPI_Allreduce at every size: the table, and its points for --json;
  // dp's time per size in `dp_seconds` (the fit's first sweep).
  nlohmann::json sweep(const std::vector<int64_t>& sizes, int64_t lenet_bytes, std::vector<double>& dp_seconds);
  // t = α + x / β fitted to each of --repeats sweeps of dp's all-reduce over `sizes` (the first:
  // `first`, the table's), x the busiest rank's bytes of a ring over the job's n devices, 2(n-1)/n of S
  // (with K > 1 the hierarchical all-reduce moves other bytes; the fit stands for it as a flat ring);
  // the median (median_fit), printed.
  AlphaBeta fit(const std::vector<int64_t>& sizes, const std::vector<double>& first);
  // One all-reduce of LeNet's gradient on every device, its bytes against the hierarchical model;
  // every process's records, in rank order (every process judges and prints alike).
  nlohmann::json check_bytes(int64_t lenet_bytes, bool& any_off);
  // ZeRO's collectives on LeNet's gradient padded to n chunks: device g of the job fills its buffer with
  // g + 1, so every element is n(n+1)/2 after a reduce-scatter (the owned chunk) and an all-gather (all
  // of it); their bytes against the hierarchical model. This device's record.
  nlohmann::json check_sharded(int k, int64_t chunk);
};

Measured Job::time_dp(int64_t bytes) {
  const int64_t count = bytes / 4;
  return measure(group, o, timeout, bytes, n, [&](int iters) {
    std::vector<double> elapsed(static_cast<size_t>(K));
    spmd(comm, devices, [&](int k) {
      const clock::time_point t0 = clock::now();
      for (int i = 0; i < iters; ++i) comm.all_reduce(k, buf[size_t(k)].f(), count);
      devices[size_t(k)]->synchronize();
      elapsed[size_t(k)] = since(t0);
    });
    return *std::max_element(elapsed.begin(), elapsed.end());
  });
}

nlohmann::json Job::sweep(const std::vector<int64_t>& sizes, int64_t lenet_bytes, std::vector<double>& dp_seconds) {
  std::vector<float> host(size_t(sizes.back() / 4), 0.0f);  // MPI's buffer, in this process's memory
  std::printf(
      "\nall-reduce across %d processes (%s): dp over %d devices (%d per process) vs a bare MPI_Allreduce over "
      "the %d processes; time per op = the slowest rank's mean over up to %d ops after one warm-up\n",
      P, comm_hosts(group).c_str(), n, K, P, o.iters);
  std::printf("algbw = S / time; busbw = algbw x 2(n-1)/n, n = %d for dp and %d for MPI; GB/s = 1e9 B/s\n\n", n, P);
  Table t;
  t.row({"S", "dp µs", "algbw", "busbw", "MPI µs", "algbw", "busbw", "dp/MPI busbw"});
  nlohmann::json pts = nlohmann::json::array();
  dp_seconds.clear();
  for (int64_t bytes : sizes) {
    const int64_t count = bytes / 4;
    const Measured dp = time_dp(bytes);
    dp_seconds.push_back(dp.seconds);
    const Measured mpi = measure(group, o, timeout, bytes, P, [&](int iters) {
      const clock::time_point t0 = clock::now();
      for (int i = 0; i < iters; ++i) group.all_reduce_blocking(host.data(), count);
      return since(t0);
    });
    const double ratio = dp.busbw / mpi.busbw;
    t.row({format_bytes(bytes) + (bytes == lenet_bytes ? " (lenet)" : ""), fixed(dp.seconds * 1e6, 1),
           fixed(dp.algbw / 1e9, 2), fixed(dp.busbw / 1e9, 2), fixed(mpi.seconds * 1e6, 1), fixed(mpi.algbw / 1e9, 2),
           fixed(mpi.busbw / 1e9, 2), fixed(ratio, 2) + "x"});
    pts.push_back({{"bytes", bytes},
                   {"lenet_gradient", bytes == lenet_bytes},
                   {"dp", json_of(dp, n)},
                   {"mpi", json_of(mpi, P)},
                   {"busbw_ratio", ratio}});
  }
  std::printf("%s", t.str(2).c_str());
  return pts;
}

AlphaBeta Job::fit(const std::vector<int64_t>& sizes, const std::vector<double>& first) {
  std::vector<double> x;
  for (int64_t bytes : sizes) x.push_back(double(bytes) * busbw_factor(Collective::all_reduce, n));
  std::vector<AlphaBeta> fits;
  for (int r = 0; r < o.repeats; ++r) {
    std::vector<double> t = first;
    if (r > 0) std::transform(sizes.begin(), sizes.end(), t.begin(), [&](int64_t b) { return time_dp(b).seconds; });
    fits.push_back(fit_alpha_beta(x, t));
    fits.back().source = "fitted to dp's all_reduce across " + std::to_string(P) + " processes over " +
                         format_bytes(sizes.front()) + " .. " + format_bytes(sizes.back());
  }
  const AlphaBeta ab = median_fit(fits);
  std::printf(
      "\nα-β fit of dp's all-reduce across the processes: t = α + S_rank / β with S_rank = a ring's bytes per rank "
      "(2(n-1)/n x S, n = %d), fitted to each of %d sweeps of dp's all-reduce (the first is the table's); the "
      "median:\n%s",
      n, o.repeats, fit_lines(ab).c_str());
  return ab;
}

nlohmann::json Job::check_sharded(int k, int64_t chunk) {
  Device& dev = *devices[size_t(k)];
  const int job_rank = group.rank() * K + k;
  std::vector<float> host(size_t(n * chunk), float(job_rank + 1));
  dev.upload(buf[size_t(k)].f(), host.data(), host.size() * sizeof(float));
  dev.synchronize();
  const Traffic before_inter = comm.inter_process(k);
  comm.reduce_scatter(k, buf[size_t(k)].f(), chunk);
  const float want = float(n * (n + 1) / 2);
  const int64_t mine = comm.shard(k) * chunk;
  dev.download(host.data() + mine, buf[size_t(k)].f() + mine, size_t(chunk) * sizeof(float));
  bool right = std::all_of(host.begin() + mine, host.begin() + mine + chunk, [&](float v) { return v == want; });
  comm.all_gather(k, buf[size_t(k)].f(), chunk);
  dev.download(host.data(), buf[size_t(k)].f(), host.size() * sizeof(float));
  right = right && std::all_of(host.begin(), host.end(), [&](float v) { return v == want; });
  const Traffic rs = comm.traffic(k, Collective::reduce_scatter), ag = comm.traffic(k, Collective::all_gather);
  const Traffic inter = comm.inter_process(k);
  // Inside: the ring over the K devices of K blocks of P chunks; across: a ring over P of one chunk.
  const int64_t local = (K - 1) * P * chunk * 4, across = 2 * (P - 1) * chunk * 4;
  const bool on_model = rs.sent == local && rs.received == local && ag.sent == local && ag.received == local &&
                        inter.sent - before_inter.sent == across && inter.received - before_inter.received == across;
  return {{"chunk", chunk}, {"values_right", right}, {"matches_model", on_model}};
}

nlohmann::json Job::check_bytes(int64_t lenet_bytes, bool& any_off) {
  const int64_t count = lenet_bytes / 4, chunk = (count + n - 1) / n;
  comm.reset_traffic();
  spmd(comm, devices, [&](int k) { comm.all_reduce(k, buf[size_t(k)].f(), count); });
  std::vector<Traffic> all_reduce_inter(static_cast<size_t>(K));
  for (int k = 0; k < K; ++k) all_reduce_inter[size_t(k)] = comm.inter_process(k);
  std::vector<nlohmann::json> sharded(static_cast<size_t>(K));
  spmd(comm, devices, [&](int k) { sharded[size_t(k)] = check_sharded(k, chunk); });
  nlohmann::json mine = nlohmann::json::array();
  for (int k = 0; k < K; ++k) {
    const HierarchicalTraffic model = hierarchical_all_reduce_traffic(count, K, P, k, group.rank());
    const Traffic local = comm.traffic(k, Collective::all_reduce), inter = all_reduce_inter[size_t(k)];
    mine.push_back({{"process", group.rank()},
                    {"device", devices[size_t(k)]->name()},
                    {"job_rank", group.rank() * K + k},
                    {"local_sent", local.sent},
                    {"local_received", local.received},
                    {"inter_sent", inter.sent},
                    {"inter_received", inter.received},
                    {"model_local_sent", model.local.sent},
                    {"model_local_received", model.local.received},
                    {"model_inter_sent", model.inter.sent},
                    {"model_inter_received", model.inter.received},
                    {"matches_model", local.sent == model.local.sent && local.received == model.local.received &&
                                          inter.sent == model.inter.sent && inter.received == model.inter.received},
                    {"sharded", sharded[size_t(k)]}});
  }
  nlohmann::json records = nlohmann::json::array();
  for (const std::string& s : group.all_gather(mine.dump(), Deadline::after(timeout), "dp_bench comm's byte records"))
    for (auto& d : nlohmann::json::parse(s)) records.push_back(d);
  std::printf("\nbytes of one all-reduce of lenet's gradient (%s), sent / received, against the hierarchical model:\n",
              format_bytes(lenet_bytes).c_str());
  any_off = false;
  bool sharded_off = false;
  for (const nlohmann::json& d : records) {
    sharded_off |= !d["sharded"]["values_right"].get<bool>() || !d["sharded"]["matches_model"].get<bool>();
    auto b = [&](const char* key) { return commas(d[key].get<int64_t>()); };
    const bool ok = d["matches_model"];
    any_off |= !ok;
    std::printf("  %-18s %-8s in the process %s / %s B (model %s / %s), across %s / %s B (model %s / %s)%s\n",
                group.who(d["process"].get<int>()).c_str(), d["device"].get<std::string>().c_str(),
                b("local_sent").c_str(), b("local_received").c_str(), b("model_local_sent").c_str(),
                b("model_local_received").c_str(), b("inter_sent").c_str(), b("inter_received").c_str(),
                b("model_inter_sent").c_str(), b("model_inter_received").c_str(), ok ? "" : "  OFF THE MODEL");
  }
  std::printf("%s\n", any_off ? "bytes: OFF the model (see the lines marked)" : "bytes: every device equals the model");
  std::printf("reduce-scatter and all-gather of lenet's gradient in %d chunks of %s floats: %s\n", n,
              commas(records[0]["sharded"]["chunk"].get<int64_t>()).c_str(),
              sharded_off ? "a device's sums or bytes are OFF (see --json's \"sharded\")"
                          : "every device's sums right, its bytes on the hierarchical model");
  any_off |= sharded_off;
  return records;
}

// Every process runs the same sweep on as many devices, checked before any channel opens (a process
// with fewer devices would leave the others waiting in a collective).
void check_job(ProcessGroup& group, const CommSweep& sw, const CommOptions& o, const DeviceSet& set) {
  const int K = int(set.devices.size());
  check_agreement(group,
                  {{"devices per process (--gpus/--devices)", std::to_string(K)},
                   {"--min-bytes", std::to_string(sw.min_bytes)},
                   {"--max-bytes", std::to_string(sw.max_bytes)},
                   {"--iters", std::to_string(o.iters)},
                   {"--repeats", std::to_string(o.repeats)}},
                  kDefaultTimeout);
  if (group.size() * K < 2)
    throw UsageError(
        "comm across processes: one process of one device has no collective to measure; run more "
        "processes (mpirun -np 2) or give more devices");
  if (set.devices[0]->kind() == DeviceKind::cuda)
    throw UsageError(
        "comm across processes: GPUs across processes go through NCCL, which this measurement does not cover yet; "
        "use --backend cpu (simulated devices)");
  // Every process on this host holds K device buffers of --max-bytes, MPI's host buffer of it and the
  // all-reduce's staging (measured here: K + 1.5 buffers' worth of resident memory, so K + 2 is the bound).
  // Refused on any host, refused everywhere (run_comm_processes asks every process at once).
  const int64_t here = std::count(group.hosts().begin(), group.hosts().end(), group.hosts()[size_t(group.rank())]);
  auto need = [&](int64_t max_bytes) { return here * (K + 2) * std::max(sw.min_bytes, max_bytes); };
  const int64_t fits = largest_fitting(sw.max_bytes, host_memory().bound(), need) / 4 * 4;
  require_host_memory(host_memory(), need(sw.max_bytes),
                      std::to_string(here) + " processes on " + group.hosts()[size_t(group.rank())] + ", each " +
                          std::to_string(K + 2) + " buffers of --max-bytes: its " + std::to_string(K) +
                          " simulated devices', MPI's and the staging",
                      "--max-bytes " + format_bytes(sw.max_bytes),
                      fits >= sw.min_bytes ? "give --max-bytes " + std::to_string(fits) + " or less"
                                           : "even --min-bytes does not fit; run fewer processes on a host");
}

}  // namespace

int run_comm_processes(const CommOptions& o, const CommSweep& sw, ProcessGroup& group) {
  DeviceSet set = make_devices(o.devices);
  // A refusal on any process (its host's memory) is every process's, said once by rank 0.
  refuse_together(group, kDefaultTimeout, [&] { check_job(group, sw, o, set); });
  std::vector<Device*> devices;
  for (auto& d : set.devices) devices.push_back(d.get());
  std::printf("%s\n", set.notice.c_str());
  // The sweep's sizes and LeNet's gradient, ascending; each device holds one buffer of the largest.
  const int64_t lenet_bytes = make_model("lenet").param_count * int64_t(sizeof(float));
  std::vector<int64_t> sizes = sweep_sizes(sw.min_bytes, sw.max_bytes);
  if (std::find(sizes.begin(), sizes.end(), lenet_bytes) == sizes.end()) sizes.push_back(lenet_bytes);
  std::sort(sizes.begin(), sizes.end());
  // The buffers hold the largest size, and LeNet's gradient padded to a chunk per device of the job.
  const int64_t n = int64_t(group.size()) * int64_t(devices.size()), lenet = lenet_bytes / 4;
  Job job(group, o, devices, std::max(sizes.back() / 4, (lenet + n - 1) / n * n));
  std::vector<double> dp_seconds;
  const nlohmann::json pts = job.sweep(sizes, lenet_bytes, dp_seconds);
  const AlphaBeta ab = job.fit(sizes, dp_seconds);
  bool any_off = false;
  const nlohmann::json bytes_check = job.check_bytes(lenet_bytes, any_off);
  nlohmann::json j = {{"command", o.command},         {"processes", job.P},
                      {"devices_per_process", job.K}, {"hosts", group.hosts()},
                      {"min_bytes", sw.min_bytes},    {"max_bytes", sw.max_bytes},
                      {"max_iters", o.iters},         {"lenet_gradient_bytes", lenet_bytes},
                      {"repeats", o.repeats},         {"points", pts},
                      {"alpha_beta", ab.json()},      {"bytes_check", bytes_check},
                      {"bytes_match_model", !any_off}};
  if (group.rank() == 0 && !o.json.empty()) write_json(o.json, j);
  return any_off ? 1 : 0;
}

}  // namespace dp::bench
