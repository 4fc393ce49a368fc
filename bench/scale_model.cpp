#include "bench/scale_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/error.h"

namespace dp::bench {
namespace {

// NCCL's tuning model, src/graph/tuning.cc (NVIDIA/nccl as of NCCL 2.8: the base latencies and the
// per-hop latencies of the Simple and LL protocols, in µs; LL128, off by default outside Volta and
// Ampere, and CollNet left out). Newer NCCL retunes the numbers, not the form.
enum Algo { kTree = 0, kRing = 1 };
enum Proto { kLL = 0, kSimple = 1 };
enum Hw { kNvlink = 0, kPci = 1, kNet = 2 };
constexpr double kBaseLat[2][2] = {{4.4, 0.0}, {3.6, 8.4}};     // [algo][proto]
constexpr double kHwLat[3][2][2] = {{{0.52, 28}, {0.47, 3.4}},  // NVLink: tree, ring
                                    {{1.0, 28}, {1.0, 5.7}},    // PCIe
                                    {{5.0, 50}, {2.7, 9.6}}};   // network

// A device's bus bandwidth in bytes/s: its node's links inside one node, its NIC across nodes.
double bus_bandwidth(const Topology& t, int nodes) { return (nodes == 1 ? t.intra_busbw : t.inter_busbw) * 1e9; }

int log2i(int n) {
  int l = 0;
  while (n >>= 1) ++l;
  return l;
}

// One algorithm and protocol of an all-reduce, reduce-scatter or all-gather, in seconds.
double nccl_seconds(const Topology& t, Collective c, int64_t busiest, int n, Algo a, Proto p) {
  const int nodes = nodes_of(t, n);
  const bool all_reduce = c == Collective::all_reduce;
  const int nsteps = all_reduce ? 2 * (n - 1) : n - 1, inter_steps = all_reduce ? 2 * (nodes - 1) : nodes - 1;
  const double busbw = bus_bandwidth(t, nodes);
  double intra_lat = kHwLat[t.nvlink ? kNvlink : kPci][a][p], inter_lat = kHwLat[kNet][a][p];
  if (nodes > 1 && p == kLL) intra_lat *= 1.8;
  double lat = kBaseLat[a][p], bw = busbw;
  if (a == kRing) {
    lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat;
    if (p == kLL) bw /= 4;
    // the buffer NCCL sizes its plateau rule by: busiest = 2 (n - 1) / n of it
    const double buffer = all_reduce ? double(busiest) * n / (2.0 * (n - 1)) : double(busiest) * n / (n - 1);
    if (p == kSimple && nodes > 1 && all_reduce && buffer >= n / 16.0 * 65536) lat *= 1.9;  // "plateau effect of ring"
    return lat * 1e-6 + double(busiest) / bw;
  }
  // tree: all-reduce only; algorithm bandwidth half the bus bandwidth, capped
  lat += 2 * ((n / nodes - 1) * intra_lat + log2i(nodes) * inter_lat);
  bw = std::min(0.9 * busbw, (nodes > 2 ? 80.0 : 110.0) * 1e9);
  if (p == kLL) bw /= 3.8;
  const double buffer = double(busiest) * n / (2.0 * (n - 1));
  return lat * 1e-6 + buffer / (0.5 * bw);
}

}  // namespace

const std::vector<Topology>& topology_presets() {
  static const std::vector<Topology> presets = [] {
    std::vector<Topology> v;
    Topology sim;
    sim.name = "sim";
    sim.what = "this machine's simulated devices, one thread each, one flat level";
    sim.source = "dp's own alpha-beta fit of its all-reduce, measured by this run";
    sim.nccl = false;
    sim.per_node = std::numeric_limits<int>::max();
    v.push_back(sim);
    v.push_back({"h100-ndr",
                 "8 x H100 SXM per node (NVLink 4), NDR 400G InfiniBand between nodes, a NIC per GPU",
                 "intra: about 370 GB/s all-reduce bus bandwidth on 8 H100s without NVLink SHARP (nccl-tests, "
                 "NVIDIA/nccl-tests issue 212); inter: about 48 GB/s per NDR NIC (issue 267)",
                 true,
                 8,
                 true,
                 370,
                 48,
                 {}});
    v.push_back({"a100-hdr",
                 "8 x A100 SXM per node (NVLink 3), HDR 200G InfiniBand between nodes, a NIC per GPU",
                 "intra: 235 GB/s, the cap NCCL's own tuning model puts on A100 bus bandwidth (tuning.cc); inter: "
                 "HDR's 25 GB/s line rate less 5%",
                 true,
                 8,
                 true,
                 235,
                 23.75,
                 {}});
    v.push_back({"pcie",
                 "8 GPUs per node on PCIe 4.0 x16, no NVLink, 100 Gb Ethernet between nodes",
                 "line rates less 15%: PCIe 4.0 x16 32 GB/s -> 27, 100 GbE 12.5 GB/s -> 10.6",
                 true,
                 8,
                 false,
                 27,
                 10.6,
                 {}});
    return v;
  }();
  return presets;
}

Topology find_topology(const std::string& name) {
  std::string names;
  for (const Topology& t : topology_presets()) {
    if (t.name == name) return t;
    names += (names.empty() ? "" : ", ") + t.name;
  }
  throw UsageError("--preset: unknown '" + name + "'; the presets are " + names);
}

int nodes_of(const Topology& t, int n) { return t.nccl ? (n + t.per_node - 1) / t.per_node : 1; }

CollectiveCost collective_cost(const Topology& t, Collective c, int64_t busiest, int n) {
  if (n <= 1) return {0.0, "none"};
  if (!t.nccl) return {t.ab.seconds(double(busiest)), "alpha-beta"};
  if (c == Collective::all_reduce || c == Collective::reduce_scatter || c == Collective::all_gather) {
    CollectiveCost best{std::numeric_limits<double>::infinity(), ""};
    for (Algo a : {kRing, kTree})
      for (Proto p : {kLL, kSimple}) {
        if (a == kTree && c != Collective::all_reduce) continue;
        const double s = nccl_seconds(t, c, busiest, n, a, p);
        if (s < best.seconds) best = {s, std::string(a == kRing ? "ring/" : "tree/") + (p == kLL ? "LL" : "Simple")};
      }
    return best;
  }
  // dp's rooted collectives: device 0 copies to (or from) each other device in turn on its own link
  const int nodes = nodes_of(t, n);
  const double hop = kHwLat[nodes == 1 ? (t.nvlink ? kNvlink : kPci) : kNet][kRing][kSimple];
  const double busbw = bus_bandwidth(t, nodes);
  return {(kBaseLat[kRing][kSimple] + (n - 1) * hop) * 1e-6 + double(busiest) / busbw, "device 0's link"};
}

namespace {

// When each of the step's bucketed collectives may start: backward's seconds until it has written
// every layer of the bucket, each layer's share of backward by its multiply-adds (backward_macs).
std::vector<double> bucket_ready(const ModelSpec& spec, const std::vector<Bucket>& buckets, double backward) {
  const std::vector<double> cost = backward_macs(spec);
  double total = 0;
  for (double c : cost) total += c;
  std::vector<double> ready;
  double done = 0;
  size_t b = 0;
  for (int i = int(spec.layers.size()) - 1; i >= 0 && b < buckets.size(); --i) {
    done += cost[size_t(i)];
    const Layer& l = spec.layers[size_t(i)];
    if (l.weight >= 0 && spec.params[size_t(l.weight)].offset == buckets[b].offset) {
      ready.push_back(total > 0 ? backward * done / total : backward);
      ++b;
    }
  }
  while (ready.size() < buckets.size()) ready.push_back(backward);
  return ready;
}

// Device 0's bytes by the strategy's memory model, beyond activations and workspace.
int64_t model_memory(const Strategy& s, const ModelSpec& spec, const EngineConfig& c, int n) {
  std::string heading;
  int64_t bytes = 0;
  bool params = false, grads = false;
  for (const Holding& h : s.holdings(spec, c, n, heading)) {
    if (h.category == Category::activations || h.category == Category::workspace) continue;
    bytes += h.bytes;
    params = params || h.category == Category::parameters;
    grads = grads || h.category == Category::gradients;
  }
  const int64_t whole = spec.param_count * int64_t(sizeof(float));
  return bytes + (params ? 0 : whole) + (grads ? 0 : whole);
}

}  // namespace

ScalePoint predict_step(const Strategy& s, const ModelSpec& spec, const Topology& t, const ComputeTime& compute,
                        int per_device, int64_t bucket_kb, int n) {
  ScalePoint p;
  p.n = n;
  p.nodes = nodes_of(t, n);
  p.compute = compute.seconds;
  EngineConfig c;
  c.sync = s.name(), c.batch = per_device * n, c.bucket_kb = bucket_kb;
  const std::vector<Bucket> buckets = gradient_buckets(spec, s, bucket_kb);
  const StepShape shape{spec, split_batch(c.batch, n, Split::even), buckets, false, AllReduceAlgorithm::ring};
  const std::vector<CollectiveTraffic> collectives =
      n > 1 ? s.step_collectives(shape) : std::vector<CollectiveTraffic>{};
  const double backward = compute.seconds * compute.backward_share;
  const std::vector<double> ready = bucket_ready(spec, buckets, backward);
  double queue_end = 0, exposed = 0;
  size_t bucket = 0;
  for (const CollectiveTraffic& ct : collectives) {
    const CollectiveCost cost = collective_cost(t, ct.collective, ct.busiest(), n);
    p.comm += cost.seconds;
    if (ct.collective == Collective::all_reduce) p.how = cost.how;
    if (ct.what.rfind("gradient bucket", 0) == 0 && bucket < ready.size()) {  // overlaps backward
      queue_end = std::max(queue_end, ready[bucket++]) + cost.seconds;
    } else {
      exposed += cost.seconds;
    }
  }
  exposed += std::max(0.0, queue_end - backward);
  for (const Traffic& tr : total_traffic(collectives, n)) p.bytes = std::max(p.bytes, tr.sent + tr.received);
  p.exposed = exposed;
  p.step = p.compute + p.exposed;
  p.memory = model_memory(s, spec, c, n);
  return p;
}

}  // namespace dp::bench
