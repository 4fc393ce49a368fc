#include "train/options.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string_view>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "engine/strategy.h"
#include "train/cli.h"
#include "train/lr_schedule.h"
#include "train/report.h"

namespace dp {
namespace {

// A float default as the shortest text that reads back as it ("0.1", not "0.100000001").
std::string fmt_float(float v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

// What --help ends with: what a script needs besides the flags.
constexpr const char* kTrainFooter = R"(Exit codes:
  0      done
  1      a device failed, --verify failed, or a write failed (disk full, permission: the OS's reason is named)
  2      bad input: the message says what is wrong and what is accepted
  3      non-finite loss or gradients
  128+N  stopped by signal N: 130 SIGINT, 143 SIGTERM, 129 SIGHUP

Environment:
  DP_CPU_KERNELS=reference|avx2|avx512
         the CPU kernel set to use at most (default: the best this CPU runs; asking for more gets that)
  DP_CUDA_CONV=library|implicit
         on CUDA, the convolutions of many taps (lenet's conv2; first layers have kernels of their own):
         cuDNN and cuBLAS (default), or dp's implicit GEMMs (slower on an H200: docs/gpu.md)
  DP_CUDA_STREAMS=1|2
         on CUDA, 2 computes the weight gradients of linear layers of over 16 outputs and of convolutions
         of many taps on a second stream while the input gradient runs on the first (default 1; not yet
         run on a GPU)
  DP_CUDA_PDL=0|1
         on CUDA, 1 launches each kernel programmatically dependent on the one before it, so that its
         blocks launch while that one runs and wait for it (compute capability 9.0 on; default 0; not
         yet run on a GPU)
  DP_CUDA_FUSE=1|0
         on CUDA, 0 runs the passes dp fuses into one kernel each (a first convolution with its
         activation and pooling, a linear layer of at most 16 outputs, a convolution's bias gradient)
         on separate kernels, to measure the fusion (default 1; the fused kernels not yet run on a GPU)
  DP_GRACE_SECONDS=S
         seconds a signalled run gets to finish its step and save before it exits anyway (default 10)

Examples:
  dp_train --gpus 0,1 --batch 256 --epochs 10                 # nn.DataParallel style on two devices
  dp_train --gpus 0,1 --sync allreduce --bucket-kb 64         # DDP style, buckets overlapped with backward
  dp_train --model lenet-bn --gpus 0,1 --sync allreduce --sync-bn   # DDP with SyncBatchNorm
  dp_train --gpus 0,1 --sync allreduce --allreduce naive      # d2l's hand-written allreduce (reduce + broadcast)
  dp_train --epochs 1 --save ck.st && dp_train --eval --load ck.st   # train and save, then evaluate)";

// Flags CLI11 would wrap or round silently, taken as text and parsed exactly after it is done.
struct TrainText {
  std::string sync = "scatter", split = "even", allreduce = "ring", lr, momentum, weight_decay, seed, timeout;
  std::string optimizer = "sgd", betas = "0.9,0.999", eps = "1e-08", lr_schedule = "constant", lr_gamma = "0.1";
  std::string clip_grad_norm, grad_dtype = "fp32";
  bool no_shuffle = false;
};

// --timeout's seconds: a positive finite number (0.5 is fine). There is no "never": a timeout of
// decades is --timeout 1e9.
double parse_timeout(const std::string& text) {
  const float v = parse_float(text, "--timeout");
  if (!std::isfinite(v) || v <= 0)
    throw UsageError("--timeout: '" + text + "' is not a timeout; give a positive number of seconds, e.g. " +
                     fmt_float(float(kDefaultTimeout)) + " (the default: 10 minutes, PyTorch's for NCCL)");
  return double(v);
}

void add_strategy(CLI::App& app, TrainOptions& o, TrainText& t) {
  app.add_option("--sync", t.sync, strategy_choices())->capture_default_str();
  app.add_option("--allreduce", t.allreduce,
                 "allreduce: ring (reduce-scatter + all-gather, DDP) | naive (reduce to device 0 + broadcast, d2l)")
      ->capture_default_str();
  app.add_option("--split", t.split, "even | chunk (torch.chunk)")->capture_default_str();
  app.add_option("--grad-dtype", t.grad_dtype,
                 "fp32 | bf16 | fp16: the gradients' collective in this type, half the bytes in 16 bits, rounded "
                 "(DDP's bf16_compress_hook / fp16_compress_hook); not scatter")
      ->capture_default_str();
  app.add_option("--bucket-kb", o.bucket_kb,
                 "allreduce: gradient bucket size in KiB, overlapped with backward (0: off)")
      ->transform(exact_integer<int64_t>());
  app.add_flag("--sync-bn", o.sync_bn,
               "BatchNorm over the whole global batch (SyncBatchNorm), in either strategy; lenet-bn");
  t.timeout = fmt_float(float(kDefaultTimeout));
  app.add_option("--timeout", t.timeout,
                 "Seconds a device waits in a collective for a peer before the run fails (a peer that stopped "
                 "answering; PyTorch's NCCL default)")
      ->capture_default_str()
      ->type_name("SECONDS");
  app.add_option("--flight-records", o.flight_records,
                 "Under mpirun: the collectives across processes each keeps, written to --flight-dir when the job "
                 "fails, and checked to agree every step (0: off)")
      ->capture_default_str()
      ->type_name("N")
      ->transform(exact_integer<int>());
  app.add_option("--flight-dir", o.flight_dir,
                 "Under mpirun: where each rank writes its flight records (default $TMPDIR/dp-flight-<host>-<pid>)")
      ->type_name("DIR");
}

void add_training(CLI::App& app, TrainOptions& o, TrainText& t) {
  app.add_option("--model", o.model, "lenet | lenet5 | lenet-bn (lenet with BatchNorm)")->capture_default_str();
  app.add_option("--width", o.width,
                 "Every conv's channels and hidden layer's width times K (about K^2 the parameters): where the "
                 "optimizer state and the gradients outweigh the activations, so that sharding shows")
      ->capture_default_str()
      ->type_name("K")
      ->transform(exact_integer<int>());
  app.add_option("--batch", o.batch, "Global batch size")->capture_default_str()->transform(exact_integer<int>());
  app.add_option("--accumulate", o.accumulate,
                 "Micro-batches of --batch images per optimizer step: the gradients add up on each device and are "
                 "communicated once per step (DDP's no_sync; scatter reduces every micro-batch)")
      ->capture_default_str()
      ->type_name("N")
      ->transform(exact_integer<int>());
  auto* epochs =
      app.add_option("--epochs", o.epochs, "Epochs to train")->capture_default_str()->transform(exact_integer<int>());
  app.add_option("--steps", o.steps, "Train this many steps instead of whole epochs")
      ->excludes(epochs)
      ->transform(exact_integer<int64_t>());
  t.lr = fmt_float(o.lr), t.momentum = fmt_float(o.momentum), t.weight_decay = fmt_float(o.weight_decay);
  t.seed = std::to_string(o.seed);
  app.add_option("--optimizer", t.optimizer, "sgd | adam | adamw (PyTorch's torch.optim.SGD, Adam, AdamW)")
      ->capture_default_str();
  app.add_option("--lr", t.lr, "Learning rate (default: 0.1 for sgd, 0.001 for adam and adamw, as PyTorch's)")
      ->type_name("FLOAT");
  app.add_option("--momentum", t.momentum, "SGD's momentum")->capture_default_str()->type_name("FLOAT");
  app.add_option("--weight-decay", t.weight_decay,
                 "Weight decay: L2 in the gradient (sgd, adam), decoupled (adamw); default 0, adamw's 0.01")
      ->type_name("FLOAT");
  app.add_option("--betas", t.betas, "adam and adamw: the moments' decay rates beta1,beta2")
      ->capture_default_str()
      ->type_name("B1,B2");
  app.add_option("--eps", t.eps, "adam and adamw: the term added to the denominator")
      ->capture_default_str()
      ->type_name("FLOAT");
  app.add_option("--seed", t.seed, "Seed for initialisation and shuffling (0 to 2^64-1)")
      ->capture_default_str()
      ->type_name("UINT");
  app.add_flag("--no-shuffle", t.no_shuffle, "Keep the file order");
  app.add_flag("--verify", o.verify, "Also run the steps on one device and compare the weights at the end");
}

void add_data(CLI::App& app, TrainOptions& o) {
  app.add_option("--data", o.data, "Directory of IDX files (gzip'd or raw)")->capture_default_str();
  app.add_option("--limit-train", o.limit_train, "Use only the first N training images (0: all)")
      ->transform(exact_integer<int64_t>());
  app.add_option("--limit-test", o.limit_test, "Use only the first N test images (0: all)")
      ->transform(exact_integer<int64_t>());
  app.add_option("--workers", o.workers,
                 "Batches assembled by a loader thread while the step before trains (1), or between steps (0)")
      ->capture_default_str()
      ->transform(exact_integer<int>());
  app.add_flag_callback(
      "--no-prefetch", [&o] { o.prefetch = false; },
      "Upload each batch at its own step instead of during the step before, on a copy stream");
  app.add_flag("--graphs", o.graphs,
               "Capture the step once per batch buffer and replay it, one launch a step (CUDA graphs; simulated "
               "devices replay their recorded calls): one device, prefetch, scatter/allreduce/zero1");
  app.add_flag_callback(
      "--run-ahead", [&o] { o.run_ahead = true; },
      "Enqueue each step before the loss of the one before is read, so a GPU does not idle while the host reads it "
      "(default on CUDA devices; not across processes)");
  app.add_flag_callback(
      "--no-run-ahead", [&o] { o.run_ahead = false; }, "Read each step's loss before the next step is enqueued");
}

// --optimizer and its settings: lr and weight decay default to the optimizer's PyTorch defaults where
// not given; a setting of another optimizer is refused rather than ignored.
void read_optimizer(const CLI::App& app, const TrainText& t, TrainOptions& o) {
  o.optimizer = parse_optimizer(t.optimizer);
  const bool sgd = o.optimizer == Optimizer::sgd;
  o.lr = app.count("--lr") ? parse_float(t.lr, "--lr") : sgd ? 0.1f : 1e-3f;
  o.weight_decay = app.count("--weight-decay")       ? parse_float(t.weight_decay, "--weight-decay")
                   : o.optimizer == Optimizer::adamw ? 1e-2f
                                                     : 0.0f;
  o.momentum = parse_float(t.momentum, "--momentum");
  if (!sgd && app.count("--momentum"))
    throw UsageError("--momentum: SGD's; --optimizer " + t.optimizer + " has --betas (default 0.9,0.999)");
  if (sgd && (app.count("--betas") || app.count("--eps")))
    throw UsageError(std::string(app.count("--betas") ? "--betas" : "--eps") +
                     ": Adam's and AdamW's; add --optimizer adam or adamw (--optimizer sgd has --momentum)");
  const size_t comma = t.betas.find(',');
  if (comma == std::string::npos || t.betas.find(',', comma + 1) != std::string::npos)
    throw UsageError("--betas: '" + t.betas + "' is not two numbers; give beta1,beta2, e.g. 0.9,0.999");
  o.beta1 = parse_float(t.betas.substr(0, comma), "--betas");
  o.beta2 = parse_float(t.betas.substr(comma + 1), "--betas");
  o.eps = parse_float(t.eps, "--eps");
}

// An empty path given explicitly ("--save ''", an unset shell variable) is refused, not taken as "not given".
const CLI::Validator kPath(
    [](std::string& p) { return p.empty() ? std::string("an empty path; give a file name") : std::string(); }, "",
    "non-empty path");

void add_checkpoints(CLI::App& app, TrainOptions& o) {
  app.add_option("--load", o.load, "Initialise the weights from a safetensors checkpoint")->check(kPath);
  app.add_flag("--eval", o.eval, "Evaluate the --load checkpoint on the test set and exit; no training");
  app.add_option("--save", o.save, "Write a safetensors checkpoint at the end (and with --save-every)")->check(kPath);
  app.add_option("--save-every", o.save_every, "Also save every N steps")->transform(exact_integer<int64_t>());
  app.add_option("--resume", o.resume, "Continue exactly from a checkpoint written by --save")->check(kPath);
}

void add_output(CLI::App& app, TrainOptions& o) {
  app.add_option("--report", o.report, "Write a JSON report of the run")->check(kPath);
  app.add_option("--trace", o.trace, "Write a Chrome trace (one lane per device, a span per phase)")->check(kPath);
  app.add_option("--log", o.log, "Stream JSON Lines records as training goes (pd.read_json(FILE, lines=True))")
      ->check(kPath);
  app.add_option("--log-every", o.log_every, "With --log: a step record every N steps")
      ->capture_default_str()
      ->transform(exact_integer<int64_t>());
  app.add_flag("--quiet", o.quiet, "Print only errors (and --eval's result line)");
}

// The learning rate's schedule (train/lr_schedule.h), PyTorch's schedulers by name.
void add_schedule(CLI::App& app, TrainOptions& o, TrainText& t) {
  app.add_option("--lr-schedule", t.lr_schedule,
                 "constant | step (StepLR) | cosine (CosineAnnealingLR to 0 at the run's end), after --warmup")
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "Steps of linear warmup to --lr first (LinearLR, as Goyal et al.)")
      ->capture_default_str()
      ->type_name("STEPS")
      ->transform(exact_integer<int64_t>());
  app.add_option("--lr-step-size", o.lr_step_size, "step: the steps between decays (default: a third of the run)")
      ->type_name("STEPS")
      ->transform(exact_integer<int64_t>());
  app.add_option("--lr-gamma", t.lr_gamma, "step: the factor of each decay")->capture_default_str()->type_name("FLOAT");
  app.add_option("--clip-grad-norm", t.clip_grad_norm,
                 "Scale the averaged gradient to this norm where it is larger (clip_grad_norm_; default: none)")
      ->type_name("NORM");
}

// Each add_* above in its --help group, in the order they are shown.
void add_train_options(CLI::App& app, TrainOptions& o, TrainText& t, DeviceFlags& dev) {
  dev.add(app);
  app.option_defaults()->group("Strategy");
  add_strategy(app, o, t);
  app.option_defaults()->group("Training");
  add_training(app, o, t);
  add_schedule(app, o, t);
  app.option_defaults()->group("Data");
  add_data(app, o);
  app.option_defaults()->group("Checkpoints");
  add_checkpoints(app, o);
  app.option_defaults()->group("Output");
  add_output(app, o);
}

// The flag-to-flag rules CLI11 cannot say: --log-every needs --log, --allreduce needs --sync allreduce,
// and --eval, which trains nothing, refuses the options of a training run rather than ignoring them.
void check_combinations(const CLI::App& app, const TrainOptions& o) {
  if (o.eval) {
    std::string given;
    int n = 0;
    for (const char* f :
         {"--save",       "--save-every",  "--resume",      "--verify",       "--steps",        "--epochs",
          "--log",        "--log-every",   "--trace",       "--workers",      "--no-prefetch",  "--graphs",
          "--accumulate", "--optimizer",   "--lr",          "--momentum",     "--weight-decay", "--betas",
          "--eps",        "--lr-schedule", "--warmup",      "--lr-step-size", "--lr-gamma",     "--clip-grad-norm",
          "--seed",       "--no-shuffle",  "--split",       "--sync-bn",      "--bucket-kb",    "--grad-dtype",
          "--allreduce",  "--run-ahead",   "--no-run-ahead"})
      if (app.count(f)) given += std::string(n++ ? ", " : "") + f;
    if (n > 0)
      throw UsageError("--eval: " + given + (n > 1 ? " only make" : " only makes") +
                       " sense for training; --eval evaluates the --load checkpoint without training: drop " +
                       (n > 1 ? "them" : "it"));
  }
  if (app.count("--log-every") && o.log.empty()) throw UsageError("--log-every: needs --log FILE to say where");
  if (app.count("--run-ahead") && app.count("--no-run-ahead"))
    throw UsageError("--run-ahead and --no-run-ahead: give one of them");
  // Given, 0 is not the default it stands for, and a factor without the schedule that uses it is ignored.
  if (app.count("--lr-step-size") && o.lr_step_size <= 0)
    throw UsageError("--lr-step-size: " + std::to_string(o.lr_step_size) + " steps; give at least 1");
  if (app.count("--lr-gamma") && o.lr_schedule != LrScheduleKind::step)
    throw UsageError("--lr-gamma: only --lr-schedule step decays by a factor; add it, or drop --lr-gamma");
  if (const Strategy& s = find_strategy(o.sync); app.count("--allreduce") && !s.takes_all_reduce_algorithm())
    throw UsageError("--allreduce: applies to --sync allreduce only (" + std::string(s.name()) + " " + s.reduces() +
                     "); add --sync allreduce or drop --allreduce");
}

}  // namespace

bool parse_train_args(int argc, const char* const* argv, TrainOptions& o) {
  CLI::App app("dp_train: data-parallel training of LeNet on (Fashion-)MNIST", "dp_train");
  app.set_version_flag("--version", std::string("dp_train ") + version());
  app.footer(kTrainFooter);
  DeviceFlags dev;
  TrainText t;
  add_train_options(app, o, t, dev);
  if (!run_parser(app, argc, argv)) return false;
  o.command_line = shell_command_line(argc, argv);
  o.started_at = utc_timestamp(std::chrono::system_clock::now());
  read_optimizer(app, t, o);
  o.seed = parse_seed(t.seed, "--seed");
  o.devices = dev.finish(app);
  o.sync = find_strategy(t.sync).name();
  o.all_reduce = parse_all_reduce(t.allreduce);
  o.split = parse_split(t.split);
  o.grad_dtype = parse_grad_dtype(t.grad_dtype);
  o.timeout = parse_timeout(t.timeout);
  o.lr_gamma = parse_float(t.lr_gamma, "--lr-gamma");
  if (!t.clip_grad_norm.empty()) o.clip_grad_norm = parse_clip_grad_norm(t.clip_grad_norm);
  o.lr_schedule = parse_lr_schedule(t.lr_schedule);
  o.shuffle = !t.no_shuffle;
  if (o.flight_records < 0)
    throw UsageError("--flight-records: " + std::to_string(o.flight_records) +
                     " is not a number of records; give 0 (off) or more, e.g. " +
                     std::to_string(kDefaultFlightRecords));
  if (app.count("--steps") == 0)
    o.steps = 0;
  else if (o.steps <= 0)
    throw UsageError("--steps: " + std::to_string(o.steps) + " is not a step count; give at least 1");
  check_combinations(app, o);
  return true;
}

}  // namespace dp
