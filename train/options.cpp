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
#include "engine/strategy.h"
#include "train/cli.h"
#include "train/report.h"

namespace dp {
namespace {

// A float default as the shortest text that reads back as it ("0.1", not "0.100000001").
std::string fmt_float(float v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

// Sizes in messages: "1 byte", "4 bytes", "64 KiB", exact (format_bytes would round).
std::string exact_size(int64_t bytes) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  int u = -1;
  while (u < 3 && bytes >= 1024 && bytes % 1024 == 0) bytes /= 1024, ++u;
  if (u >= 0) return std::to_string(bytes) + " " + units[u];
  return std::to_string(bytes) + (bytes == 1 ? " byte" : " bytes");
}

}  // namespace

// CLI11 reads integers with strtoll in base 0, which saturates at 2^63-1 (a --steps of 2^63 trained
// 2^63-1 steps unsaid) and takes "010" as octal 8. This check reads the text as a decimal T, refuses
// what does not fit, and hands CLI11 back the decimal it read.
template <typename T>
CLI::Validator exact_integer() {
  return CLI::Validator(
      [](std::string& t) {
        T v = 0;
        const char *first = t.data(), *last = first + t.size();
        auto [end, ec] = std::from_chars(first, last, v);
        if (ec == std::errc::result_out_of_range)
          return "'" + t + "' is out of range (" + std::to_string(std::numeric_limits<T>::min()) + " to " +
                 std::to_string(std::numeric_limits<T>::max()) + ")";
        if (ec != std::errc() || end != last) return "'" + t + "' is not a whole number";
        t = std::to_string(v);
        return std::string();
      },
      "", "integer");
}

template CLI::Validator exact_integer<int>();
template CLI::Validator exact_integer<int64_t>();

std::string size_forms(int64_t min_bytes) {
  return "give a size of at least " + exact_size(min_bytes) +
         ": a number of bytes, whole or with a suffix K, M, G or T (powers of 1024; k, KB, KiB read the same), "
         "e.g. 4096, 512M, 1.5G";
}

int64_t parse_bytes(const std::string& text, const std::string& flag, int64_t min_bytes) {
  auto bad = [&](const std::string& why) {
    return UsageError(flag + ": '" + text + "' " + why + "; " + size_forms(min_bytes));
  };
  // Digits with an optional fraction, then the suffix: no sign, space, exponent or hex (strtod, used
  // before, also read " 5", "0x10" and "1e3").
  auto digit = [&](size_t i) { return i < text.size() && text[i] >= '0' && text[i] <= '9'; };
  size_t used = 0;
  while (digit(used)) ++used;
  bool any_digit = used > 0;
  if (used < text.size() && text[used] == '.')
    for (++used; digit(used); ++used) any_digit = true;
  if (used == 0 && text.size() > 1 && text[0] == '-' && (digit(1) || (text[1] == '.' && digit(2))))
    throw bad("is negative");
  if (!any_digit) throw bad("is not a size");
  std::string suffix = text.substr(used);
  for (auto& c : suffix) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (suffix.size() > 1 && suffix.back() == 'B') suffix.pop_back();  // KB, KIB
  if (suffix.size() == 2 && suffix[1] == 'I') suffix.pop_back();     // KI(B)
  const std::string units = "KMGT";
  long double scale = 1;
  if (suffix.size() == 1 && units.find(suffix[0]) != std::string::npos)
    scale = std::ldexp(1.0L, 10 * int(units.find(suffix[0]) + 1));
  else if (!suffix.empty() && suffix != "B")
    throw bad("is not a size (the suffix '" + text.substr(used) + "' is none of K, M, G, T)");
  // long double (80 or 128 bits on Linux) holds every integer up to 2^64: the bound is exact.
  const long double bytes = std::strtold(text.substr(0, used).c_str(), nullptr) * scale;
  if (bytes >= std::ldexp(1.0L, 63)) throw bad("is too large: a size is less than 2^63 bytes (8 EiB)");
  const int64_t whole = int64_t(bytes);  // a fraction of a byte is dropped
  if (whole < min_bytes)
    throw bad("is " + (whole == 0 ? std::string("0 bytes") : exact_size(whole)) +
              (bytes != (long double)whole ? " (rounded down to whole bytes)" : ""));
  return whole;
}

uint64_t parse_seed(const std::string& text, const std::string& flag) {
  uint64_t v = 0;
  const char *first = text.data(), *last = first + text.size();
  // Digits only: from_chars takes no sign, no space, no exponent, and says when the value is past 2^64-1
  // (strtoull, which CLI11 uses, wraps "-1" to 2^64-1 and saturates larger values there).
  auto [end, ec] = std::from_chars(first, last, v);
  bool digits = !text.empty() && std::all_of(first, last, [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || ec != std::errc() || end != last)
    throw UsageError(flag + ": '" + text + "' is not a seed; give a whole number from 0 to " +
                     std::to_string(UINT64_MAX) + (digits ? " (it is larger)" : ""));
  return v;
}

float parse_float(const std::string& text, const std::string& flag) {
  auto bad = [&](const std::string& why) { return UsageError(flag + ": '" + text + "' " + why); };
  const char* first = text.c_str();
  char* end = nullptr;
  errno = 0;
  long double v = std::strtold(first, &end);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || end != first + text.size())
    throw bad("is not a number");
  const bool range = errno == ERANGE;
  const float f = float(v);
  // A value float cannot hold is refused rather than rounded to 0 or infinity, where the checks after
  // parsing would call it "not positive" or "not finite" when it is neither.
  if ((range && std::fabs(v) < 1) || (v != 0 && f == 0))
    throw bad("is too small for a float (it would round to 0; the smallest positive float is 1.4e-45)");
  if ((range && std::fabs(v) >= 1) || (std::isfinite(v) && !std::isfinite(f)))
    throw bad("is too large for a float (at most 3.4e38)");
  return f;
}

std::vector<int> parse_int_list(const std::string& text, const std::string& flag, const std::string& what,
                                const std::string& example) {
  std::vector<int> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0)
      throw UsageError(flag + ": '" + item + "' in '" + text + "' is not a " + what + "; give comma-separated " + what +
                       "s >= 0, e.g. " + example);
    out.push_back(v);
  }
  if (out.empty()) throw UsageError(flag + ": the list is empty; give at least one " + what + ", e.g. " + example);
  return out;
}

std::vector<int> parse_ids(const std::string& text, const std::string& flag) {
  return parse_int_list(text, flag, "device id", "0,1");
}

void DeviceFlags::add(CLI::App& app) {
  // In a "Devices" group of --help; the front end's own options keep the group they had.
  const std::string group = app.option_defaults()->get_group();
  app.option_defaults()->group("Devices");
  app.add_option("--gpus", gpus,
                 "Device ids, comma-separated, or all: every GPU (simulated devices where there is no GPU; all is " +
                     std::to_string(kDefaultSimulatedDevices) + " of them)")
      ->capture_default_str();
  app.add_option("--devices", devices, "Shorthand for --gpus 0,1,...,N-1")
      ->excludes("--gpus")
      ->transform(exact_integer<int>());
  app.add_option("--backend", backend, "auto | cpu | cuda")->capture_default_str();
  app.add_option("--device-memory", memory,
                 "Memory cap per device: bytes, or with a suffix K, M, G, T (512M, 1.5G). On CUDA it counts dp's own "
                 "buffers only, not the CUDA context or what cuBLAS, cuDNN and NCCL allocate for themselves");
  app.add_flag("--allow-shared-device", allow_shared, "Allow a repeated id: several replicas on one device");
  app.option_defaults()->group(group);
}

DeviceConfig DeviceFlags::finish(const CLI::App& app) const {
  DeviceConfig c;
  c.backend = backend;
  if (app.count("--devices")) {
    if (devices <= 0)
      throw UsageError("--devices: " + std::to_string(devices) + " is not a device count; give at least 1");
    c.ids.clear();
    for (int i = 0; i < devices; ++i) c.ids.push_back(i);
  } else if (gpus == "all") {
    c.all = true;
  } else {
    c.ids = parse_ids(gpus, "--gpus");
  }
  if (!memory.empty()) c.memory_cap = parse_bytes(memory, "--device-memory", kMinDeviceMemory);
  c.allow_shared_device = allow_shared;
  return c;
}

std::string shell_quote(const std::string& arg) {
  auto plain = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           std::string_view("_@%+=:,./-").find(c) != std::string_view::npos;
  };
  if (!arg.empty() && std::all_of(arg.begin(), arg.end(), plain)) return arg;
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string shell_command_line(int argc, const char* const* argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) out += (i ? " " : "") + shell_quote(argv[i]);
  return out;
}

bool run_parser(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return false;
  } catch (const CLI::CallForAllHelp&) {
    std::printf("%s", app.help("", CLI::AppFormatMode::All).c_str());
    return false;
  } catch (const CLI::CallForVersion& e) {
    std::printf("%s\n", e.what());
    return false;
  } catch (const CLI::ParseError& e) {
    throw UsageError(std::string(e.what()) + " (see --help)");
  }
  return true;
}

namespace {

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
}

void add_training(CLI::App& app, TrainOptions& o, TrainText& t) {
  app.add_option("--model", o.model, "lenet | lenet5 | lenet-bn (lenet with BatchNorm)")->capture_default_str();
  app.add_option("--batch", o.batch, "Global batch size")->capture_default_str()->transform(exact_integer<int>());
  auto* epochs =
      app.add_option("--epochs", o.epochs, "Epochs to train")->capture_default_str()->transform(exact_integer<int>());
  app.add_option("--steps", o.steps, "Train this many steps instead of whole epochs")
      ->excludes(epochs)
      ->transform(exact_integer<int64_t>());
  t.lr = fmt_float(o.lr), t.momentum = fmt_float(o.momentum), t.weight_decay = fmt_float(o.weight_decay);
  t.seed = std::to_string(o.seed);
  app.add_option("--lr", t.lr, "Learning rate")->capture_default_str()->type_name("FLOAT");
  app.add_option("--momentum", t.momentum, "SGD momentum")->capture_default_str()->type_name("FLOAT");
  app.add_option("--weight-decay", t.weight_decay, "L2 weight decay (PyTorch SGD's)")
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

// Each add_* above in its --help group, in the order they are shown.
void add_train_options(CLI::App& app, TrainOptions& o, TrainText& t, DeviceFlags& dev) {
  dev.add(app);
  app.option_defaults()->group("Strategy");
  add_strategy(app, o, t);
  app.option_defaults()->group("Training");
  add_training(app, o, t);
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
    for (const char* f : {"--save", "--save-every", "--resume", "--verify", "--steps", "--epochs", "--log",
                          "--log-every", "--trace", "--workers", "--no-prefetch"})
      if (app.count(f)) given += std::string(n++ ? ", " : "") + f;
    if (n > 0)
      throw UsageError("--eval: " + given + (n > 1 ? " only make" : " only makes") +
                       " sense for training; --eval evaluates the --load checkpoint without training: drop " +
                       (n > 1 ? "them" : "it"));
  }
  if (app.count("--log-every") && o.log.empty()) throw UsageError("--log-every: needs --log FILE to say where");
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
  o.lr = parse_float(t.lr, "--lr");
  o.momentum = parse_float(t.momentum, "--momentum");
  o.weight_decay = parse_float(t.weight_decay, "--weight-decay");
  o.seed = parse_seed(t.seed, "--seed");
  o.devices = dev.finish(app);
  o.sync = find_strategy(t.sync).name();
  o.all_reduce = parse_all_reduce(t.allreduce);
  o.split = parse_split(t.split);
  o.timeout = parse_timeout(t.timeout);
  o.shuffle = !t.no_shuffle;
  if (app.count("--steps") == 0)
    o.steps = 0;
  else if (o.steps <= 0)
    throw UsageError("--steps: " + std::to_string(o.steps) + " is not a step count; give at least 1");
  check_combinations(app, o);
  return true;
}

}  // namespace dp
