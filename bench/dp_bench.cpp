// dp_bench: measurements of the dp engine, on the same library dp_train uses.
//   compare  scatter vs allreduce: step time, phases, bytes against the byte model, memory
//   comm     the collectives alone: time, algbw, busbw (nccl-tests' definitions), alpha-beta fit
//   skew     memory per device by category: device 0's extra under scatter; with --device-memory,
//            the largest batch each strategy fits
// Exit codes: 0 done, 1 a check failed (bytes off the model, skew out of bounds) or a device failed
// or --plot could not plot, 2 bad arguments.
#include <cstdio>
#include <exception>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "engine/options.h"

namespace {

using namespace dp;
using namespace dp::bench;

std::vector<int> parse_counts(const std::string& text) {
  std::vector<int> counts = parse_ids(text, "--sweep-devices");
  for (int c : counts)
    if (c < 1) throw UsageError("--sweep-devices: '" + text + "': a device count must be at least 1, e.g. 1,2,4,8");
  return counts;
}

int run(int argc, char** argv) {
  CLI::App app("dp_bench: measure the dp engine (scatter vs allreduce, collectives, memory skew)", "dp_bench");
  app.require_subcommand(1);

  // compare
  CompareOptions co;
  DeviceFlags cdev;
  cdev.gpus = "0,1,2,3";
  std::string csplit = "even", csweep;
  CLI::App* compare = app.add_subcommand("compare", "scatter vs allreduce on the same devices, model, batch and data");
  cdev.add(*compare);
  compare->add_option("--model", co.model, "lenet | lenet5")->capture_default_str();
  compare->add_option("--batch", co.batch, "Global batch size")->capture_default_str();
  compare->add_option("--steps", co.steps, "Measured steps per strategy")->capture_default_str();
  compare->add_option("--warmup", co.warmup, "Steps run before measuring")->capture_default_str();
  compare->add_option("--bucket-kb", co.bucket_kb, "allreduce: gradient bucket size in KiB (0: one all-reduce)")
      ->capture_default_str();
  compare->add_option("--split", csplit, "even | chunk (torch.chunk)")->capture_default_str();
  compare->add_option("--seed", co.seed, "Seed of the weights and the synthetic data")->capture_default_str();
  compare->add_option("--alpha-us", co.alpha_us, "Latency for the alpha-beta model, µs (default: fit it here)");
  compare->add_option("--beta-gbps", co.beta_gbps, "Bandwidth for the alpha-beta model, GB/s (with --alpha-us)");
  auto* sweep =
      compare->add_option("--sweep-devices", csweep, "Repeat for each device count (ids 0..N-1), e.g. 1,2,4,8");
  sweep->excludes("--gpus")->excludes("--devices");
  compare->add_option("--json", co.json, "Write everything as JSON");
  compare->add_option("--trace", co.trace, "Write a Chrome trace: one process per strategy, one lane per device");
  compare->add_option("--plot", co.plot, "Write the data and PNGs into this directory (needs python3-matplotlib)");

  // comm
  CommOptions mo;
  DeviceFlags mdev;
  mdev.gpus = "0,1,2,3";
  std::string min_bytes = "8", max_bytes = "256M";
  CLI::App* comm =
      app.add_subcommand("comm", "the collectives alone: time, algbw, busbw over message sizes; alpha-beta fit");
  mdev.add(*comm);
  comm->add_option("--min-bytes", min_bytes, "Smallest message (bytes, or 4K, 1M, ...)")->capture_default_str();
  comm->add_option("--max-bytes", max_bytes, "Largest message (bytes, or 64M, 1G, ...)")->capture_default_str();
  comm->add_option("--iters", mo.iters, "Timed ops per size at most (fewer when one op is slow)")
      ->capture_default_str();
  comm->add_option("--json", mo.json, "Write the measurements and the fit as JSON");
  comm->add_option("--plot", mo.plot, "Write the data and a busbw plot into this directory (needs python3-matplotlib)");

  // skew
  SkewOptions so;
  DeviceFlags sdev;
  sdev.gpus = "0,1,2,3";
  std::string optimizer = "momentum", ssplit = "even";
  CLI::App* skew = app.add_subcommand("skew", "memory per device by category: device 0's skew under scatter");
  sdev.add(*skew);
  skew->add_option("--model", so.model, "lenet | lenet5")->capture_default_str();
  skew->add_option("--batch", so.batch, "Global batch size")->capture_default_str();
  skew->add_option("--optimizer", optimizer, "sgd | momentum (momentum 0.9: a momentum buffer per optimizer)")
      ->capture_default_str();
  skew->add_option("--split", ssplit, "even | chunk (torch.chunk)")->capture_default_str();
  skew->add_option("--seed", so.seed, "Seed of the weights and the synthetic data")->capture_default_str();
  skew->add_option("--json", so.json, "Write the ledgers and the skew as JSON");
  skew->add_option("--plot", so.plot,
                   "Write the data and a memory plot into this directory (needs python3-matplotlib)");

  if (!run_parser(app, argc, argv)) return 0;
  const std::string cmd = command_line(argc, argv);
  if (compare->parsed()) {
    co.devices = cdev.finish(*compare);
    if (compare->count("--alpha-us") && !(co.alpha_us >= 0))
      throw UsageError("--alpha-us: must be a latency >= 0 in µs");
    if (compare->count("--beta-gbps") && !(co.beta_gbps > 0))
      throw UsageError("--beta-gbps: must be a bandwidth > 0 in GB/s");
    co.split = parse_split(csplit);
    if (!csweep.empty()) co.sweep = parse_counts(csweep);
    co.command = cmd;
    return run_compare(co);
  }
  if (comm->parsed()) {
    mo.devices = mdev.finish(*comm);
    mo.min_bytes = parse_bytes(min_bytes, "--min-bytes");
    mo.max_bytes = parse_bytes(max_bytes, "--max-bytes");
    mo.command = cmd;
    return run_comm(mo);
  }
  so.devices = sdev.finish(*skew);
  so.split = parse_split(ssplit);
  if (optimizer == "sgd")
    so.momentum = 0.0f;
  else if (optimizer == "momentum")
    so.momentum = 0.9f;
  else
    throw UsageError("--optimizer: '" + optimizer + "' is not an optimizer; use sgd or momentum");
  so.command = cmd;
  return run_skew(so);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const dp::UsageError& e) {
    std::fprintf(stderr, "dp_bench: %s\n", e.what());
    return 2;
  } catch (const dp::bench::PlotUnavailable& e) {
    std::fprintf(stderr, "dp_bench: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_bench: error: %s\n", e.what());
    return 1;
  }
}
