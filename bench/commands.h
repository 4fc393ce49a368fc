// dp_bench's subcommands (compare, comm, skew, bn, ops, scale): their options as parsed by dp_bench.cpp, and the
// functions that run them. Each returns the process exit code: 0 fine, 1 a check failed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/engine.h"
#include "engine/process_group.h"

namespace dp::bench {

struct CompareOptions {
  DeviceConfig devices;
  std::string model = "lenet";
  int width = 1;  // --width (make_model)
  int batch = 256, steps = 20, warmup = 3;
  int64_t bucket_kb = 0;  // the allreduce engine's buckets (scatter has none)
  Split split = Split::even;
  uint64_t seed = 0;
  float lr = 0.1f, momentum = 0.9f;           // dp_train's defaults
  float clip_grad_norm = 0;                   // --clip-grad-norm (0: off)
  int accumulate = 1;                         // --accumulate: micro-batches of `batch` per optimizer step
  DType grad_dtype = DType::fp32;             // --grad-dtype: the gradients' collectives (scatter's stay fp32)
  std::vector<int> sweep;                     // --sweep-devices: device counts
  std::optional<double> alpha_us, beta_gbps;  // given, or fitted here
  int repeats = 5;  // all_reduce sweeps for the alpha-beta fit, each fitted alone: the median is used
  std::string json, trace, plot;
  std::string command;  // as typed, for the records
};

struct CommOptions {
  DeviceConfig devices;
  int64_t min_bytes = 8, max_bytes = 256ll << 20;
  int iters = 20;
  int repeats = 5;  // all_reduce sweeps for the alpha-beta fit: the median and the spread
  double budget_seconds = 0.1;
  std::string json, plot;
  std::string command;
  ProcessGroup* group = nullptr;  // started by mpirun: comm measures across the job's processes
};

struct SkewOptions {
  DeviceConfig devices;
  std::string model = "lenet";
  int width = 1;  // --width (make_model)
  int batch = 256, steps = 2;
  // --optimizer: momentum (SGD, momentum 0.9: one buffer of P), sgd (momentum 0: none), adam and adamw (two of P)
  Optimizer optimizer = Optimizer::sgd;
  float momentum = 0.9f;
  Split split = Split::even;
  uint64_t seed = 0;
  std::string json, plot;
  std::string command;
};

// bn: local BatchNorm vs SyncBatchNorm on lenet-bn, per per-device batch, on real data. The device
// count of a run is batch / per-device; the reference is one device on the whole batch.
struct BnOptions {
  std::string backend = "cpu";  // cpu: simulated devices (the default) | cuda | auto
  std::vector<int> per_device{2, 4, 8, 16, 32, 64};
  int batch = 128, steps = 80;  // the default run (13 runs) takes 3.5-5 min on 2 shared cores
  std::string sync = "allreduce";
  // Not dp_train's 0.1: at 0.1 the first hundred steps are so chaotic that runs differing only in float
  // rounding (sync and the reference) end several points of accuracy apart, hiding the effect shown.
  float lr = 0.01f, momentum = 0.9f;
  uint64_t seed = 0;
  std::string data = "/usr/share/datasets/fashion-mnist";
  int64_t limit_train = 0, limit_test = 2000;  // 0: all
  std::string json, plot;
  std::string command;
};

// ops: one step's time op by op, on one simulated CPU device (bench/ops.cpp).
struct OpsOptions {
  std::string backend = "cpu";  // only cpu: a CUDA op's call returns before the op is done
  std::string model = "lenet";
  int batch = 256, steps = 20, warmup = 3;
  uint64_t seed = 0;
  std::string json;
  std::string command;
};

// scale: every strategy's step on many devices, modelled (bench/scale_model.h), with its validation.
struct ScaleOptions {
  std::string preset = "h100-ndr";
  std::vector<int> devices{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  std::string model = "lenet";
  int per_device = 256;              // images per device (weak scaling: the global batch grows with the devices)
  int64_t bucket_kb = 0;             // the engine's gradient buckets, for the strategies that take them
  std::optional<double> compute_us;  // a one-device step; not given: measured (sim) or the preset's figure
  std::optional<double> alpha_us, beta_gbps;  // sim: the collectives' alpha-beta, given or fitted here
  // sim: the device counts the model is checked against, measured here (empty: none)
  std::vector<int> validate{1, 2, 4};
  int steps = 10, warmup = 2;
  int repeats = 3;  // all_reduce sweeps for the sim preset's alpha-beta fit
  uint64_t seed = 0;
  std::string json, plot;
  std::string command;
};

int run_compare(const CompareOptions& o);
int run_scale(const ScaleOptions& o);
int run_comm(const CommOptions& o);
struct CommSweep;
// comm under mpirun (comm_processes.cpp): dp's all-reduce across processes beside a bare MPI_Allreduce.
int run_comm_processes(const CommOptions& o, const CommSweep& sw, ProcessGroup& group);
int run_skew(const SkewOptions& o);
int run_bn(const BnOptions& o);
int run_ops(const OpsOptions& o);

}  // namespace dp::bench
