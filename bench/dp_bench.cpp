// dp_bench: measurements of the dp engine, on the same library dp_train uses.
//   compare  scatter vs naive (d2l's all-reduce) vs allreduce vs ZeRO 1-3: step time, phases,
//            bytes against the byte model, memory
//   comm     the collectives alone: time, algbw, busbw (nccl-tests' definitions), alpha-beta fit; under
//            mpirun the all-reduce across processes beside a bare MPI_Allreduce (comm_processes.cpp)
//   skew     memory per device by category: device 0's extra under scatter; with --device-memory,
//            the largest batch each strategy fits
//   bn       BatchNorm across replicas (lenet-bn, real data): local BatchNorm vs SyncBatchNorm at
//            per-device batches 2..64 of one global batch, against one device on the whole batch:
//            test accuracy, running statistics' distance, bytes (against the model) and time per step
//   ops      where one training step's time goes on one simulated CPU device: per kernel op and layer,
//            calls, microseconds and share of the step, GFLOP/s, and the host's part outside every op
//   scale    every strategy's step on 1 to 1,024 devices, modelled: compute, communication (exposed and
//            overlapped), memory per device, over a preset topology; checked against dp's own runs
//            (sim) or published nccl-tests figures (the GPU presets)
// Exit codes: 0 done, 1 a check failed (bytes off the model, skew out of bounds) or a device failed
// or --plot could not plot, 2 bad arguments, 3 a run diverged (a non-finite loss: bn).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "bench/bench.h"
#include "bench/commands.h"
#include "engine/error.h"
#include "engine/optimizer.h"
#include "train/cli.h"
#include "train/job.h"
#include "train/options.h"
#include "train/report.h"

namespace {

using namespace dp;
using namespace dp::bench;

std::vector<int> parse_counts(const std::string& text, const char* flag = "--sweep-devices") {
  std::vector<int> counts = parse_ids(text, flag);
  for (int c : counts)
    if (c < 1)
      throw UsageError(std::string(flag) + ": '" + text + "': a device count must be at least 1, e.g. 1,2,4,8");
  for (int c : counts)
    if (std::count(counts.begin(), counts.end(), c) > 1)  // as bn's --per-device
      throw UsageError(std::string(flag) + ": '" + text + "': " + std::to_string(c) +
                       " is given twice; give each device count once, e.g. 1,2,4,8");
  return counts;
}

// skew's --optimizer: momentum is SGD's with 0.9 (one buffer of P), adam and adamw keep two.
void set_skew_optimizer(const std::string& name, SkewOptions& so) {
  if (name == "sgd")
    so.momentum = 0.0f;
  else if (name == "momentum")
    so.momentum = 0.9f;
  else if (name == "adam" || name == "adamw")
    so.optimizer = parse_optimizer(name);
  else
    throw UsageError("--optimizer: '" + name + "' is not an optimizer; use sgd, momentum, adam or adamw");
}

// --seed as text, read by parse_seed: CLI11 alone wraps "-1" to 2^64-1.
void add_seed(CLI::App& c, std::string& seed) {
  c.add_option("--seed", seed, "Seed of the weights and the synthetic data (0 to 2^64-1)")
      ->capture_default_str()
      ->type_name("UINT");
}

// compare and skew train on made-up data: say so where their flags are listed.
constexpr const char* kSyntheticNote =
    "The data is synthetic: random images (uniform in [0, 1)) with random labels, so loss and accuracy mean "
    "nothing; what this measures is time, bytes moved and memory. No data set is needed.";

// --repeats: how many all_reduce sweeps the alpha-beta fit takes the median of.
void add_repeats(CLI::App& c, int& repeats) {
  c.add_option("--repeats", repeats,
               "all_reduce sweeps for the alpha-beta fit, each fitted alone; the median and the spread (min-max) "
               "are reported")
      ->capture_default_str()
      ->transform(exact_integer<int>());
}

// A subcommand: its flags on the parser, and what runs when it was the one given. The options live
// in the closure; `command` is dp_train-style provenance, filled in after parsing.
struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int(const std::string& command)> run;
};

// compare's options that change what a step does, as dp_train's do; the texts parsed when it runs.
void add_step_options(CLI::App& c, CompareOptions& co, std::string& split, std::string& clip, std::string& grad_dtype) {
  c.add_option("--split", split, "even | chunk (torch.chunk)")->capture_default_str();
  c.add_option("--clip-grad-norm", clip,
               "dp_train's --clip-grad-norm (the sharded strategies all-reduce one float more a step)");
  c.add_option("--accumulate", co.accumulate,
               "dp_train's --accumulate: micro-batches of --batch per step, the gradients communicated once")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  c.add_option("--grad-dtype", grad_dtype,
               "dp_train's --grad-dtype: fp32 | bf16 | fp16, the gradients' collectives (scatter's stay fp32)")
      ->capture_default_str();
}

Subcommand add_compare(CLI::App& app) {
  auto co = std::make_shared<CompareOptions>();
  auto dev = std::make_shared<DeviceFlags>();
  auto split = std::make_shared<std::string>("even"), grad_dtype = std::make_shared<std::string>("fp32");
  auto sweep = std::make_shared<std::string>(), seed = std::make_shared<std::string>("0");
  auto clip = std::make_shared<std::string>();
  dev->gpus = "0,1,2,3";
  CLI::App* c = app.add_subcommand(
      "compare",
      "scatter vs naive (d2l's all-reduce) vs allreduce vs ZeRO 1-3 on the same devices, model, batch and "
      "(synthetic) data");
  c->footer(kSyntheticNote);
  dev->add(*c);
  c->add_option("--model", co->model, "lenet | lenet5")->capture_default_str();
  c->add_option("--width", co->width, "Every conv's channels and hidden layer's width times K (dp_train's --width)")
      ->capture_default_str()
      ->type_name("K")
      ->transform(exact_integer<int>());
  c->add_option("--batch", co->batch, "Global batch size")->capture_default_str()->transform(exact_integer<int>());
  c->add_option("--steps", co->steps, "Measured steps per strategy")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  c->add_option("--warmup", co->warmup, "Steps run before measuring")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  c->add_option("--bucket-kb", co->bucket_kb, "naive and allreduce: gradient bucket size in KiB (0: one all-reduce)")
      ->capture_default_str()
      ->transform(exact_integer<int64_t>());
  add_step_options(*c, *co, *split, *clip, *grad_dtype);
  add_seed(*c, *seed);
  c->add_option("--alpha-us", co->alpha_us, "Latency for the alpha-beta model, µs (default: fit it here)");
  c->add_option("--beta-gbps", co->beta_gbps, "Bandwidth for the alpha-beta model, GB/s (with --alpha-us)");
  add_repeats(*c, co->repeats);
  c->add_option("--sweep-devices", *sweep, "Repeat for each device count (ids 0..N-1), e.g. 1,2,4,8")
      ->excludes("--gpus")
      ->excludes("--devices");
  c->add_option("--json", co->json, "Write everything as JSON");
  c->add_option("--trace", co->trace, "Write a Chrome trace: one process per strategy, one lane per device");
  c->add_option("--plot", co->plot, "Write the data and PNGs into this directory (needs python3-matplotlib)");
  return {c, [=](const std::string& command) {
            co->devices = dev->finish(*c);
            co->seed = parse_seed(*seed, "--seed");
            co->split = parse_split(*split);
            co->grad_dtype = parse_grad_dtype(*grad_dtype);
            if (!clip->empty()) co->clip_grad_norm = parse_clip_grad_norm(*clip);
            if (!sweep->empty()) co->sweep = parse_counts(*sweep);
            co->command = command;
            return run_compare(*co);
          }};
}

Subcommand add_comm(CLI::App& app, ProcessGroup* group) {
  auto mo = std::make_shared<CommOptions>();
  auto dev = std::make_shared<DeviceFlags>();
  auto min_bytes = std::make_shared<std::string>("8"), max_bytes = std::make_shared<std::string>("256M");
  dev->gpus = "0,1,2,3";
  CLI::App* c =
      app.add_subcommand("comm", "the collectives alone: time, algbw, busbw over message sizes; alpha-beta fit");
  dev->add(*c);
  c->add_option("--min-bytes", *min_bytes, "Smallest message (bytes, or 4K, 1M, ...)")->capture_default_str();
  c->add_option("--max-bytes", *max_bytes, "Largest message (bytes, or 64M, 1G, ...)")->capture_default_str();
  c->add_option("--iters", mo->iters, "Timed ops per size at most (fewer when one op is slow)")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  add_repeats(*c, mo->repeats);
  c->add_option("--json", mo->json, "Write the measurements and the fit as JSON");
  c->add_option("--plot", mo->plot, "Write the data and a busbw plot into this directory (needs python3-matplotlib)");
  return {c, [=](const std::string& command) {
            mo->devices = dev->finish(*c);
            // One float is the smallest message.
            mo->min_bytes = parse_bytes(*min_bytes, "--min-bytes", 4);
            mo->max_bytes = parse_bytes(*max_bytes, "--max-bytes", 4);
            mo->command = command;
            mo->group = group;
            return run_comm(*mo);
          }};
}

Subcommand add_skew(CLI::App& app) {
  auto so = std::make_shared<SkewOptions>();
  auto dev = std::make_shared<DeviceFlags>();
  auto optimizer = std::make_shared<std::string>("momentum"), split = std::make_shared<std::string>("even");
  auto seed = std::make_shared<std::string>("0");
  dev->gpus = "0,1,2,3";
  CLI::App* c =
      app.add_subcommand("skew", "memory per device by category: device 0's skew under scatter (synthetic data)");
  c->footer(kSyntheticNote);
  dev->add(*c);
  c->add_option("--model", so->model, "lenet | lenet5")->capture_default_str();
  c->add_option("--width", so->width, "Every conv's channels and hidden layer's width times K (dp_train's --width)")
      ->capture_default_str()
      ->type_name("K")
      ->transform(exact_integer<int>());
  c->add_option("--batch", so->batch, "Global batch size")->capture_default_str()->transform(exact_integer<int>());
  c->add_option("--optimizer", *optimizer,
                "sgd | momentum | adam | adamw (the state: none, one buffer of P floats, Adam's two moments)")
      ->capture_default_str();
  c->add_option("--split", *split, "even | chunk (torch.chunk)")->capture_default_str();
  add_seed(*c, *seed);
  c->add_option("--json", so->json, "Write the ledgers and the skew as JSON");
  c->add_option("--plot", so->plot, "Write the data and a memory plot into this directory (needs python3-matplotlib)");
  return {c, [=](const std::string& command) {
            so->devices = dev->finish(*c);
            so->seed = parse_seed(*seed, "--seed");
            so->split = parse_split(*split);
            set_skew_optimizer(*optimizer, *so);
            so->command = command;
            return run_skew(*so);
          }};
}

Subcommand add_bn(CLI::App& app) {
  auto bo = std::make_shared<BnOptions>();
  auto per_device = std::make_shared<std::string>("2,4,8,16,32,64"), sync = std::make_shared<std::string>("allreduce");
  auto seed = std::make_shared<std::string>("0"), lr = std::make_shared<std::string>("0.01"),
       momentum = std::make_shared<std::string>("0.9");
  CLI::App* c = app.add_subcommand(
      "bn",
      "BatchNorm across replicas: local BatchNorm vs SyncBatchNorm (lenet-bn, real data) at each per-device batch, "
      "against one device on the whole batch");
  c->footer(
      "The same lenet-bn (same initial weights, data order and global batch) is trained --steps steps with local "
      "BatchNorm (each replica normalises its own shard; device 0's running statistics are broadcast each step) and "
      "with SyncBatchNorm (the statistics of the global batch), on batch / per-device devices, and once on one device "
      "on the whole batch (the reference, which SyncBatchNorm equals up to float rounding). The data is real "
      "(--data, Fashion-MNIST by default); each epoch is shuffled and its last partial batch dropped. A per-device "
      "batch must divide --batch and be at least 2 (BatchNorm needs more than 1 value per channel).");
  c->add_option("--per-device", *per_device, "Per-device batches, comma-separated; each divides --batch, each >= 2")
      ->capture_default_str();
  c->add_option("--batch", bo->batch, "Global batch size")->capture_default_str()->transform(exact_integer<int>());
  c->add_option("--steps", bo->steps, "Training steps per run")->capture_default_str()->transform(exact_integer<int>());
  c->add_option("--sync", *sync, strategy_choices())->capture_default_str();
  c->add_option("--backend", bo->backend,
                "cpu: simulated devices | cuda: the replicas round-robin over the GPUs | auto: cuda where usable")
      ->capture_default_str();
  c->add_option("--data", bo->data, "IDX data directory (gzip'd or raw)")->capture_default_str();
  c->add_option("--limit-train", bo->limit_train, "Use the first N training images (0: all)")
      ->capture_default_str()
      ->transform(exact_integer<int64_t>());
  c->add_option("--limit-test", bo->limit_test, "Evaluate on the first N test images (0: all)")
      ->capture_default_str()
      ->transform(exact_integer<int64_t>());
  c->add_option("--lr", *lr, "Learning rate (SGD)")->capture_default_str();
  c->add_option("--momentum", *momentum, "SGD momentum")->capture_default_str();
  c->add_option("--seed", *seed, "Seed of the weights and of the data order (0 to 2^64-1)")
      ->capture_default_str()
      ->type_name("UINT");
  c->add_option("--json", bo->json, "Write every run, the sync-vs-local costs and the conclusion as JSON");
  c->add_option("--plot", bo->plot,
                "Write the data and a PNG (accuracy and running-statistics distance vs per-device batch) into this "
                "directory (needs python3-matplotlib)");
  return {c, [=](const std::string& command) {
            bo->per_device = parse_int_list(*per_device, "--per-device", "batch size", "2,4,8,16,32,64");
            bo->sync = find_strategy(*sync).name();
            bo->seed = parse_seed(*seed, "--seed");
            bo->lr = parse_float(*lr, "--lr");
            bo->momentum = parse_float(*momentum, "--momentum");
            bo->command = command;
            return run_bn(*bo);
          }};
}

Subcommand add_ops(CLI::App& app) {
  auto oo = std::make_shared<OpsOptions>();
  auto seed = std::make_shared<std::string>("0");
  CLI::App* c = app.add_subcommand(
      "ops", "where a training step's time goes, op by op, on one simulated CPU device (synthetic data)");
  c->footer(std::string(kSyntheticNote) +
            " The CPU kernels are the best this CPU runs, or those DP_CPU_KERNELS names (reference, avx2, avx512).");
  c->add_option("--backend", oo->backend, "cpu (the only one: a CUDA op's call returns before the op is done)")
      ->capture_default_str();
  c->add_option("--model", oo->model, "lenet | lenet5 | lenet-bn")->capture_default_str();
  c->add_option("--batch", oo->batch, "Batch size")->capture_default_str()->transform(exact_integer<int>());
  c->add_option("--steps", oo->steps, "Timed steps")->capture_default_str()->transform(exact_integer<int>());
  c->add_option("--warmup", oo->warmup, "Steps run before timing")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  add_seed(*c, *seed);
  c->add_option("--json", oo->json, "Write the table as JSON");
  return {c, [=](const std::string& command) {
            oo->seed = parse_seed(*seed, "--seed");
            oo->command = command;
            return run_ops(*oo);
          }};
}

Subcommand add_scale(CLI::App& app) {
  auto so = std::make_shared<ScaleOptions>();
  auto devices = std::make_shared<std::string>("1,2,4,8,16,32,64,128,256,512,1024");
  auto validate = std::make_shared<std::string>("1,2,4");
  auto seed = std::make_shared<std::string>("0");
  CLI::App* c = app.add_subcommand(
      "scale", "every strategy's step on 1 to 1,024 devices, modelled from dp's byte and memory models (a model)");
  c->footer(
      "Weak scaling: every device trains --per-device images, so the global batch grows with the devices. "
      "Presets: sim (this machine's simulated devices: dp's alpha-beta fit and a step measured here, and the "
      "model set beside dp's measured steps at --validate's device counts), h100-ndr, a100-hdr, pcie (NCCL's "
      "tuning model over the preset's links; each figure's source printed with it).");
  c->add_option("--preset", so->preset, "sim | h100-ndr | a100-hdr | pcie")->capture_default_str();
  c->add_option("--devices", *devices, "Device counts, e.g. 8,64,1024 (past one node: whole nodes)")
      ->capture_default_str();
  c->add_option("--model", so->model, "lenet | lenet5 | lenet-bn")->capture_default_str();
  c->add_option("--per-device", so->per_device, "Images per device and step")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  c->add_option("--bucket-kb", so->bucket_kb, "Gradient buckets overlapped with backward (allreduce, zero2), KiB")
      ->capture_default_str()
      ->transform(exact_integer<int64_t>());
  c->add_option("--compute-us", so->compute_us,
                "One device's step in microseconds (default: measured for sim, dp's H200 lenet step otherwise)");
  c->add_option("--alpha-us", so->alpha_us,
                "sim: the collectives' latency, µs (with --beta-gbps; default: fit it here)");
  c->add_option("--beta-gbps", so->beta_gbps, "sim: the collectives' bandwidth, GB/s (with --alpha-us)");
  c->add_option("--validate", *validate, "sim: device counts measured here beside the model ('none': skip)")
      ->capture_default_str();
  c->add_option("--steps", so->steps, "sim: timed steps of each measurement")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  c->add_option("--warmup", so->warmup, "sim: steps run before timing")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  add_repeats(*c, so->repeats);
  add_seed(*c, *seed);
  c->add_option("--json", so->json, "Write every number as JSON");
  c->add_option("--plot", so->plot, "Directory for the figure (step time and communication share against devices)");
  return {c, [=](const std::string& command) {
            so->devices = parse_counts(*devices, "--devices");
            so->validate = *validate == "none" ? std::vector<int>{} : parse_counts(*validate, "--validate");
            so->seed = parse_seed(*seed, "--seed");
            so->command = command;
            return run_scale(*so);
          }};
}

int run(int argc, char** argv, ProcessGroup* group) {
  CLI::App app(
      "dp_bench: measure the dp engine (scatter vs allreduce, collectives, memory skew, BatchNorm across replicas, "
      "time per op) and model it on many devices (scale)",
      "dp_bench");
  app.set_version_flag("--version", std::string("dp_bench ") + dp::version());
  app.require_subcommand(1);
  const Subcommand subcommands[] = {add_compare(app), add_comm(app, group), add_skew(app),
                                    add_bn(app),      add_ops(app),         add_scale(app)};
  bool parsed = false;
  const Subcommand* chosen = subcommands;  // CLI11 requires one
  auto read = [&] {
    parsed = run_parser(app, argc, argv);
    for (const Subcommand& s : subcommands)
      if (s.app->parsed()) chosen = &s;
    if (parsed && group && chosen->app->get_name() != "comm")
      throw UsageError(chosen->app->get_name() +
                       " measures the devices of one process; under mpirun only comm measures across processes "
                       "(mpirun -np 2 dp_bench comm --devices 1)");
  };
  // Under mpirun a mistyped option is every process's refusal, said once by rank 0.
  if (group)
    refuse_together(*group, kDefaultTimeout, read);
  else
    read();
  return parsed ? chosen->run(shell_command_line(argc, argv)) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Under mpirun (comm across processes) rank 0 alone prints; a refusal every process met together
  // (refuse_together) ends each normally, any other error on any rank ends the job with its exit code
  // (MPI_Abort), since the others may be waiting for it in a collective.
  std::unique_ptr<dp::ProcessGroup> group = dp::join_if_launched("dp_bench");
  const std::string who = group && group->size() > 1 ? group->who() + ": " : "";
  auto fail = [&](int code, const char* prefix, const char* what) {
    std::fprintf(stderr, "%sdp_bench: %s%s\n", who.c_str(), prefix, what);
    if (!who.empty()) {
      std::fflush(stderr);
      group->abort(code);
    }
    return code;
  };
  try {
    return run(argc, argv, group.get());
  } catch (const dp::JobMismatch& e) {  // every process refused alike: rank 0 says why, no MPI_Abort
    if (group->rank() == 0) std::fprintf(stderr, "%sdp_bench: %s\n", who.c_str(), e.what());
    return 2;
  } catch (const dp::UsageError& e) {
    return fail(2, "", e.what());
  } catch (const dp::NumericalError& e) {  // a run diverged: its figures would be NaN
    return fail(3, "", e.what());
  } catch (const dp::bench::PlotUnavailable& e) {
    return fail(1, "", e.what());
  } catch (const std::exception& e) {
    return fail(1, "error: ", e.what());
  }
}
