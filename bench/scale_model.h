// dp_bench scale's model: every strategy's step on 1 to thousands of devices, on paper. What it rests
// on is dp's own: the strategies' byte models (Strategy::step_collectives) and memory models
// (Strategy::holdings), the engine's gradient buckets, and a step measured on one device. What it
// adds is how long each collective takes on a machine (a Topology) and when the bucketed ones can
// overlap backward. Nothing here runs a device.
//
// Collective time, for the GPU presets: NCCL's own tuning model (src/graph/tuning.cc, the version
// quoted in scale_model.cpp): per algorithm (ring, tree) and protocol (LL, Simple) a latency, a base
// plus a per-hop term inside the node and across nodes, and a bus bandwidth; NCCL takes the fastest
// for each call, and so does the model. For this machine's simulated devices: dp's own alpha-beta
// fit (bench.h), one level, t = alpha + bytes / beta per collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "engine/strategy.h"

namespace dp::bench {

struct Topology {
  std::string name;                         // the --preset value
  std::string what;                         // "8 x H100 SXM per node (NVLink 4), NDR 400G InfiniBand between nodes"
  std::string source;                       // where its figures come from
  bool nccl = true;                         // false: the alpha-beta fit below, one flat level (simulated devices)
  int per_node = 8;                         // devices per node
  bool nvlink = true;                       // inside a node: NVLink (else PCIe), for NCCL's latency table
  double intra_busbw = 0, inter_busbw = 0;  // GB/s, nccl-tests' bus bandwidth per device
  AlphaBeta ab;                             // nccl false: the fit
};

// The presets (sim's alpha-beta is measured by dp_bench scale itself), and one by name (UsageError
// listing them otherwise).
const std::vector<Topology>& topology_presets();
Topology find_topology(const std::string& name);

// What one collective costs: seconds, and the algorithm/protocol NCCL's model picks ("ring/Simple",
// "tree/LL"; "alpha-beta" for the fit).
struct CollectiveCost {
  double seconds = 0;
  std::string how;
};
// Collective c moving `busiest` bytes on its busiest device (the byte model's figure) over n devices.
// For an all-reduce that is 2 (n - 1) / n of the buffer, for a reduce-scatter or all-gather (n - 1) / n
// of the whole; a rooted collective (scatter, gather, broadcast, reduce) is dp's own, device 0 sending
// or receiving every other device's share on its link: its busiest bytes grow with n.
CollectiveCost collective_cost(const Topology& t, Collective c, int64_t busiest, int n);
// The nodes n devices take (ceil(n / per_node); 1 for the flat simulated level).
int nodes_of(const Topology& t, int n);

// A step measured on one device, at the per-device batch: seconds, and the share of it backward takes
// (the bucketed collectives overlap that share).
struct ComputeTime {
  double seconds = 0;
  double backward_share = 0;
  std::string source;
};

struct ScalePoint {
  int n = 0, nodes = 1;
  double compute = 0;  // seconds a step
  double comm = 0;     // every collective of the step, one after another
  double exposed = 0;  // of which the step waits for (the rest overlaps backward)
  double step = 0;     // compute + exposed
  int64_t bytes = 0;   // the busiest device's bytes a step, sent + received
  int64_t memory = 0;  // device 0's model state and strategy buffers (below)
  std::string how;     // the all-reduce's algorithm, where the step has one
  double images_per_second(int per_device) const { return step > 0 ? double(n) * per_device / step : 0; }
  double comm_share() const { return step > 0 ? exposed / step : 0; }
};

// A strategy's step on n devices of `t` at `per_device` images each (weak scaling: the global batch
// n x per_device), with the engine's buckets for bucket_kb. Compute is the one-device step (every
// device computes on its own images alike); communication is the byte model's collectives, each
// costed above: the gradient buckets' collectives start as backward finishes their layers (each
// layer's share of backward by its multiply-adds) and queue one after another, everything else waits
// for the step. Memory: what the strategy's memory model says device 0 holds (Strategy::holdings),
// with the whole parameters and gradients where it does not list them, activations and workspace
// left out (they do not change with n at a fixed per-device batch).
ScalePoint predict_step(const Strategy& s, const ModelSpec& spec, const Topology& t, const ComputeTime& compute,
                        int per_device, int64_t bucket_kb, int n);

}  // namespace dp::bench
