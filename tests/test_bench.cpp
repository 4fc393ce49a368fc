// dp_bench end to end: compare's bytes against the byte model (recomputed here from the formulas,
// not from bench/), its Chrome trace, skew's ledgers, comm's bandwidth definitions, and the exit
// codes for bad arguments and a missing matplotlib. Small runs: a few seconds in all. The test names
// avoid ';' and ',' (ctest's list separator and doctest's filter separator).
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/engine.h"
#include "models/model.h"

#ifdef DP_BENCH_BIN

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("dp_bench_test_" + std::to_string(getpid()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// `args` on the simulated CPU devices: --backend cpu after the subcommand, so --gpus 0,1,2 means three
// devices on any machine (auto, the default, takes the GPUs where there are some). Unchanged where the
// args name a backend themselves (CLI11 refuses a repeated --backend) or start with no subcommand.
std::string on_cpu(const std::string& args) {
  const std::string sub = args.substr(0, args.find(' '));
  if (sub != "compare" && sub != "comm" && sub != "skew" && sub != "bn") return args;
  if (args.find("--backend") != std::string::npos) return args;
  return sub + " --backend cpu" + args.substr(sub.size());
}

// Runs dp_bench with `args` (on_cpu) and an optional environment prefix; returns its exit code. Output
// goes to `log` so a failure can show it.
int bench(const std::string& args, const std::string& log, const std::string& env = "") {
  std::string cmd = env + " '" + std::string(DP_BENCH_BIN) + "' " + on_cpu(args) + " > '" + log + "' 2>&1";
  int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

json load(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// The byte model written out again from its definition (bench.cpp has the same formulas).
std::vector<dp::Traffic> expected_traffic(const std::string& strategy, int64_t P, int64_t D, int64_t C,
                                          const std::vector<int>& n_i) {
  const int n = int(n_i.size());
  std::vector<dp::Traffic> t(static_cast<size_t>(n));
  if (strategy == "naive") {  // d2l's allreduce: every gradient buffer into device 0, the sum back out
    for (int i = 1; i < n; ++i) {
      t[0].received += P * 4, t[0].sent += P * 4;
      t[i].sent = P * 4, t[i].received = P * 4;
    }
  } else if (strategy == "scatter") {
    for (int i = 1; i < n; ++i) {
      t[0].sent += n_i[i] * D * 4 + P * 4 + n_i[i] * C * 4;
      t[0].received += n_i[i] * C * 4 + P * 4;
      t[i].received = n_i[i] * D * 4 + P * 4 + n_i[i] * C * 4;
      t[i].sent = n_i[i] * C * 4 + P * 4;
    }
  } else {
    std::vector<int64_t> chunk = dp::even_chunks(P, n);
    auto c = [&](int k) { return chunk[size_t(((k % n) + n) % n)] * 4; };
    for (int r = 0; r < n; ++r)
      for (int s = 0; s < n - 1; ++s) {
        t[r].sent += c(r - s) + c(r + 1 - s);
        t[r].received += c(r - 1 - s) + c(r - s);
      }
  }
  return t;
}

}  // namespace

TEST_CASE("dp_bench compare - measured bytes equal the byte model and the trace has every phase on every lane") {
  TempDir dir;
  const std::string log = dir / "compare.log";
  int rc = bench("compare --gpus 0,1,2 --batch 32 --steps 2 --warmup 1 --json '" + (dir / "c.json") + "' --trace '" +
                     (dir / "t.json") + "'",
                 log);
  INFO(slurp(log));
  REQUIRE(rc == 0);

  json j = load(dir / "c.json");
  CHECK(j["match"] == true);
  REQUIRE(j["runs"].size() == 1);
  const json& run = j["runs"][0];
  CHECK(run["devices"] == 3);
  const dp::ModelSpec spec = dp::make_model("lenet");
  const std::vector<int> sizes = dp::split_batch(32, 3, dp::Split::even);  // 11, 11, 10
  CHECK(run["split_sizes"].get<std::vector<int>>() == sizes);
  std::set<std::string> strategies;
  for (const json& s : run["strategies"]) {
    const std::string name = s["strategy"];
    strategies.insert(name);
    CAPTURE(name);
    auto expected = expected_traffic(name, spec.param_count, spec.input_size(), spec.classes, sizes);
    REQUIRE(s["devices"].size() == 3);
    for (const json& d : s["devices"]) {
      int r = d["rank"];
      CAPTURE(r);
      CHECK(d["bytes_sent"] == d["predicted_sent"]);
      CHECK(d["bytes_received"] == d["predicted_received"]);
      CHECK(d["bytes_sent"].get<int64_t>() == expected[r].sent);
      CHECK(d["bytes_received"].get<int64_t>() == expected[r].received);
      CHECK(d["match"] == true);
      CHECK(d["peak_bytes"].get<int64_t>() > 0);
    }
    CHECK(s["step_ms"]["all"].size() == 2);
    CHECK(s["images_per_second"].get<double>() > 0);
  }
  CHECK(strategies == std::set<std::string>{"scatter", "naive", "allreduce"});
  // The columns in their order: nn.DataParallel, d2l's hand-written all-reduce, DDP.
  REQUIRE(run["strategies"].size() == 3);
  CHECK(run["strategies"][1]["strategy"] == "naive");
  CHECK(run["strategies"][1]["sync"] == "allreduce");
  CHECK(run["strategies"][1]["allreduce"] == "naive");
  CHECK(run["strategies"][2]["allreduce"] == "ring");
  CHECK(run["strategies"][0]["allreduce"].is_null());
  const std::string out = slurp(log);
  // The table's heading: three columns in that order.
  const size_t heading = out.find(" scatter "), naive = out.find(" naive ", heading),
               allreduce = out.find(" allreduce\n", naive);
  REQUIRE(heading != std::string::npos);
  CHECK(out.find('\n', heading) > allreduce);
  CHECK(naive < allreduce);
  CHECK(out.find("on every device for every strategy") != std::string::npos);

  // Chrome trace: one process per strategy, one lane (tid) per device, a span per phase.
  json trace = load(dir / "t.json");
  std::map<int, std::string> process;                          // pid -> "scatter, 3 devices"
  std::map<std::pair<int, int>, std::set<std::string>> spans;  // (pid, tid) -> phase names
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") process[e["pid"]] = e["args"]["name"];
    if (e["ph"] == "X") spans[{e["pid"].get<int>(), e["tid"].get<int>()}].insert(e["name"].get<std::string>());
  }
  REQUIRE(process.size() == 3);
  const std::set<std::string> scatter_phases{"load",        "scatter",  "broadcast", "forward",
                                             "gather+loss", "backward", "reduce",    "optimizer"};
  const std::set<std::string> allreduce_phases{"load", "forward", "loss", "backward", "all-reduce", "optimizer"};
  for (auto& [pid, name] : process) {
    bool scatter = name.rfind("scatter", 0) == 0;
    CAPTURE(name);
    for (int tid = 0; tid < 3; ++tid) {
      CAPTURE(tid);
      CHECK(spans[{pid, tid}] == (scatter ? scatter_phases : allreduce_phases));
    }
  }
}

TEST_CASE("dp_bench compare - the naive column's bucketed bytes equal the model: a reduce and a broadcast per bucket") {
  TempDir dir;
  const std::string log = dir / "naive.log";
  int rc = bench(
      "compare --batch 16 --steps 1 --warmup 0 --bucket-kb 64 --alpha-us 5 --beta-gbps 10 "
      "--sweep-devices 2,3 --json '" +
          (dir / "c.json") + "'",
      log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  json j = load(dir / "c.json");
  CHECK(j["match"] == true);
  const int64_t P = dp::make_model("lenet").param_count;
  REQUIRE(j["runs"].size() == 2);
  for (const json& run : j["runs"]) {
    const int n = run["devices"];
    CAPTURE(n);
    const json& naive = run["strategies"][1];
    REQUIRE(naive["strategy"] == "naive");
    REQUIRE(naive["buckets"].size() > 1);
    CHECK(naive["collectives"].size() == 2 * naive["buckets"].size());
    for (const json& d : naive["devices"]) {
      const int64_t want = d["rank"] == 0 ? (n - 1) * P * 4 : P * 4;
      CHECK(d["bytes_sent"].get<int64_t>() == want);
      CHECK(d["bytes_received"].get<int64_t>() == want);
      CHECK(d["match"] == true);
    }
  }
  REQUIRE(j["scaling"].size() == 2);
  CHECK(j["scaling"][0]["naive_images_per_second"].get<double>() > 0);
}

TEST_CASE("dp_bench skew - device 0 holds more under scatter and the same under allreduce and the ledger adds up") {
  TempDir dir;
  const std::string log = dir / "skew.log";
  int rc = bench("skew --gpus 0,1,2 --batch 48 --json '" + (dir / "s.json") + "'", log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  json j = load(dir / "s.json");
  REQUIRE(j["strategies"].size() == 2);
  for (const json& s : j["strategies"]) {
    const std::string name = s["strategy"];
    CAPTURE(name);
    REQUIRE(s["fits"] == true);
    double skew = s["skew"];
    if (name == "scatter")
      CHECK(skew > 1.0);
    else
      CHECK(std::abs(skew - 1.0) < 0.02);
    for (const json& d : s["devices"]) {
      int64_t sum = 0;
      for (auto& [cat, bytes] : d["at_peak"].items()) sum += bytes.get<int64_t>();
      CHECK(sum == d["peak_bytes"].get<int64_t>());
    }
  }
  // Under scatter only device 0 keeps the reduce buffer and the optimizer state.
  const json& sc = j["strategies"][0];
  REQUIRE(sc["strategy"] == "scatter");
  CHECK(sc["devices"][0]["at_peak"]["comm"].get<int64_t>() > 0);
  CHECK(sc["devices"][0]["at_peak"]["optimizer"].get<int64_t>() > 0);
  CHECK(sc["devices"][1]["at_peak"]["comm"] == 0);
  CHECK(sc["devices"][1]["at_peak"]["optimizer"] == 0);
}

TEST_CASE("dp_bench comm - nccl-tests bandwidths and an alpha-beta fit") {
  TempDir dir;
  const std::string log = dir / "comm.log";
  int rc = bench("comm --gpus 0,1 --min-bytes 4K --max-bytes 4M --iters 3 --json '" + (dir / "m.json") + "'", log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  json j = load(dir / "m.json");
  std::map<std::string, double> factor{
      {"all_reduce", 1.0}, {"scatter", 0.5}, {"gather", 0.5}, {"broadcast", 1.0}, {"reduce", 1.0}};
  std::set<std::string> seen;
  for (const json& p : j["points"]) {
    seen.insert(p["collective"]);
    double algbw = p["algbw_gbps"], busbw = p["busbw_gbps"];
    CHECK(algbw == doctest::Approx(p["bytes"].get<double>() / (p["time_us"].get<double>() * 1e3)));
    CHECK(busbw == doctest::Approx(algbw * factor.at(p["collective"])));
  }
  CHECK(seen.size() == 5);
  CHECK(j["points"].size() == 5 * 11);  // 4K .. 4M
  // The fit exists unless the times did not grow with size (possible only on a badly overloaded
  // machine, so not asserted); when it exists it is physical.
  if (!j["alpha_beta"].is_null()) {
    CHECK(j["alpha_beta"]["alpha_us"].get<double>() >= 0);
    CHECK(j["alpha_beta"]["beta_gbps"].get<double>() > 0);
  }
}

TEST_CASE("dp_bench - bad arguments exit 2 with a message and --plot without matplotlib exits 1 and says so") {
  TempDir dir;
  const std::string log = dir / "bad.log";
  for (const char* args :
       {"", "frobnicate", "compare --batch 0", "compare --steps 0", "compare --split weird", "compare --gpus 0,x",
        "compare --sweep-devices 1,0", "compare --alpha-us 5", "compare --json /nonexistent-dir/x.json",
        "comm --max-bytes 12Q", "comm --gpus 0", "comm --min-bytes 1M --max-bytes 1K", "skew --optimizer adam",
        "skew --gpus 0", "skew --model resnet", "skew --device-memory lots"}) {
    CAPTURE(args);
    CHECK(bench(args, log) == 2);
    CHECK(slurp(log).rfind("dp_bench: ", 0) == 0);
  }
  CHECK(bench("skew --plot '" + (dir / "plots") + "'", log, "DP_BENCH_PYTHON=/nonexistent/python3") == 1);
  CHECK(slurp(log).find("matplotlib") != std::string::npos);
}

TEST_CASE("dp_bench ops - the ops' microseconds fit in the step and conv and linear rows are there with GFLOP/s") {
  TempDir dir;
  const std::string log = dir / "ops.log", out = dir / "ops.json";
  REQUIRE(bench("ops --model lenet5 --batch 32 --steps 2 --warmup 1 --json '" + out + "'", log) == 0);
  const json j = load(out);
  CHECK(j["config"]["model"] == "lenet5");
  CHECK(j["config"]["backend"] == "cpu");
  double sum = 0;
  std::set<std::string> layers;
  bool conv = false, linear = false;
  for (const json& r : j["ops"]) {
    sum += r["us_per_step"].get<double>();
    CHECK(r["calls_per_step"].get<double>() > 0);
    const std::string op = r["op"];
    if (op.rfind("conv2d", 0) == 0 || op.rfind("linear", 0) == 0) {
      (op[0] == 'c' ? conv : linear) = true;
      CHECK(r["gflops"].get<double>() > 0);  // FLOPs are known for these
      layers.insert(r["layer"].get<std::string>());
    }
  }
  CHECK(conv);
  CHECK(linear);
  CHECK(layers == std::set<std::string>{"conv1", "conv2", "fc1", "fc2", "fc3"});  // every row named by its layer
  // The ops run inside the step: their sum is at most the step's time, the rest is the host's.
  CHECK(sum <= j["step_us"].get<double>());
  CHECK(j["ops_us"].get<double>() == doctest::Approx(sum).epsilon(1e-9));
  CHECK(j["host_us"].get<double>() >= 0);
  for (const char* args : {"ops --steps 0", "ops --warmup -1", "ops --batch 0", "ops --backend cuda",
                           "ops --model resnet", "ops --frobnicate"}) {
    CAPTURE(args);
    CHECK(bench(args, log) == 2);
    CHECK(slurp(log).rfind("dp_bench: ", 0) == 0);
  }
  CHECK(slurp(log).find("--frobnicate") != std::string::npos);
}

TEST_CASE("bench: every output path of every subcommand is checked before the run, with exit 2") {
  TempDir dir;
  const std::string log = dir / "out.log", file = dir / "file.txt", missing = dir / "missing";
  std::ofstream(file) << "x";
  struct Case {
    std::string args, words;
  };
  std::vector<Case> cases;
  for (std::string sub : {"compare", "comm", "skew"}) {
    cases.push_back({sub + " --plot '" + file + "'", "is a file, not a directory"});
    cases.push_back({sub + " --plot '" + missing + "/plots'", "the directory " + missing + " does not exist"});
    cases.push_back({sub + " --json '" + missing + "/r.json'", "the directory " + missing + " does not exist"});
    cases.push_back({sub + " --json '" + dir.path.string() + "'", "is a directory; give a file name"});
    cases.push_back({sub + " --json '" + file + "/r.json'", file + " is not a directory"});
  }
  cases.push_back({"compare --trace '" + missing + "/t.json'", "does not exist"});
  cases.push_back({"compare --trace '" + dir.path.string() + "'", "is a directory"});
  cases.push_back({"compare --json '" + (dir / "same.json") + "' --trace '" + dir.path.string() + "/./same.json'",
                   "are the same file"});
  for (const Case& c : cases) {
    CAPTURE(c.args);
    // No matplotlib: a path checked only after the plotting check (or the run) would exit 1.
    CHECK(bench(c.args, log, "DP_BENCH_PYTHON=/nonexistent/python3") == 2);
    const std::string out = slurp(log);
    INFO(out);
    CHECK(out.find(c.words) != std::string::npos);
    CHECK(out.find("backend:") == std::string::npos);  // no device was made: nothing ran
  }
}

TEST_CASE("bench: comm measures whole floats and says so, and refuses a range holding none") {
  TempDir dir;
  const std::string log = dir / "comm.log";
  struct Case {
    std::string args, words;
  };
  const Case refused[] = {
      {"--min-bytes 5 --max-bytes 7", "--min-bytes 5 to --max-bytes 7: the range holds no whole number of floats"},
      {"--min-bytes 1M --max-bytes 1K", "is below --min-bytes"},
      {"--min-bytes 5 --max-bytes 7", "whole floats (multiples of 4 bytes)"},
      {"--min-bytes 3", "--min-bytes: '3' is 3 bytes; give a size of at least 4 bytes"},
      {"--max-bytes 0.5", "--max-bytes: '0.5' is 0 bytes"},
  };
  for (const Case& c : refused) {
    CAPTURE(c.args);
    CHECK(bench("comm --gpus 0,1 " + c.args, log) == 2);
    INFO(slurp(log));
    CHECK(slurp(log).find(c.words) != std::string::npos);
  }

  int rc = bench("comm --gpus 0,1,2 --min-bytes 6 --max-bytes 18 --iters 1 --json '" + (dir / "m.json") + "'", log);
  const std::string out = slurp(log);
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("--min-bytes 6 is measured as 8 B") != std::string::npos);
  CHECK(out.find("--max-bytes 18 is measured as 16 B") != std::string::npos);
  json j = load(dir / "m.json");
  CHECK(j["min_bytes"] == 8);
  CHECK(j["max_bytes"] == 16);
  std::set<int64_t> sizes;
  for (const json& p : j["points"]) sizes.insert(p["bytes"].get<int64_t>());
  CHECK(sizes == std::set<int64_t>{8, 16});
  // the memory estimate (checked against the machine's before the sweep) is the ledgers' peak
  CHECK(j["memory"]["estimate_bytes"] == j["memory"]["peak_bytes"]);
  REQUIRE(bench("comm --gpus 0,1,2 --min-bytes 4K --max-bytes 100K --iters 1 --json '" + (dir / "m.json") + "'", log) ==
          0);
  j = load(dir / "m.json");
  CHECK(j["memory"]["estimate_bytes"] == j["memory"]["peak_bytes"]);
}

TEST_CASE("bench: compare skew and comm estimate their memory up front and refuse past the machine's with exit 2") {
  TempDir dir;
  const std::string log = dir / "mem.log";
  auto output_has = [&](const std::string& words) {
    INFO(slurp(log));
    CHECK(slurp(log).find(words) != std::string::npos);
  };
  // Past any machine, refused before the synthetic data (54 TB of it) is made.
  CHECK(bench("compare --gpus 0,1 --batch 2147483647", log) == 2);
  output_has("--batch 2147483647: this run needs about ");
  output_has("the largest batch that fits is ");
  CHECK(bench("skew --gpus 0,1 --batch 2147483647", log) == 2);
  output_has("the largest batch that fits is ");
  CHECK(bench("comm --gpus 0,1 --max-bytes 1024T", log) == 2);
  output_has("or less");

  // Under a pretended 64 MiB: the largest batch named runs, one more is refused.
  const std::string env = "DP_BENCH_MEM_AVAILABLE=64M";
  const std::string base = "compare --gpus 0,1 --steps 1 --warmup 0 --alpha-us 5 --beta-gbps 10 --batch ";
  CHECK(bench(base + "100000", log, env) == 2);
  output_has("more than 80% of the 64.00 MiB available ($DP_BENCH_MEM_AVAILABLE)");
  const std::string out = slurp(log);
  const auto at = out.find("the largest batch that fits is ");
  REQUIRE(at != std::string::npos);
  const int fits = std::stoi(out.substr(at + 31));
  CHECK(fits > 64);
  CHECK(fits < 100000);
  CHECK(bench(base + std::to_string(fits + 1), log, env) == 2);
  REQUIRE(bench(base + std::to_string(fits) + " --json '" + (dir / "c.json") + "'", log, env) == 0);
  output_has("memory: about ");
  // the estimate covers what the ledgers then measured, and not by much more
  json j = load(dir / "c.json");
  int64_t measured = 0;
  for (const json& s : j["runs"][0]["strategies"]) {
    int64_t sum = 0;
    for (const json& d : s["devices"]) sum += d["peak_bytes"].get<int64_t>();
    measured = std::max(measured, sum);
  }
  const int64_t estimate = j["memory"]["devices_estimate_bytes"];
  CHECK(estimate >= measured);
  CHECK(double(estimate) <= 1.05 * double(measured));

  // skew's batch search fills every device to its cap: the cap is what is refused
  CHECK(bench("skew --gpus 0,1,2,3 --device-memory 1G", log, "DP_BENCH_MEM_AVAILABLE=1G") == 2);
  output_has("--device-memory 1.00 GiB on 4 devices: this run needs about 4.00 GiB");
  output_has("give --device-memory 204M or less");
}

TEST_CASE("bench: integer seed and bandwidth flags are read exactly or refused with exit 2") {
  TempDir dir;
  const std::string log = dir / "flags.log";
  struct Case {
    std::string args, words;
  };
  const Case cases[] = {
      {"compare --seed -1", "--seed: '-1' is not a seed"},
      {"skew --seed 18446744073709551616", "--seed"},
      {"compare --batch 0x10", "--batch"},
      {"compare --steps 1e3", "--steps"},
      {"skew --batch 2147483648", "out of range"},
      {"compare --bucket-kb 9223372036854775808", "out of range"},
      {"comm --iters 1.5", "--iters"},
      {"comm --iters 0", "--iters"},
      {"comm --repeats 0", "--repeats: 0 sweeps; give at least 1"},
      {"compare --repeats -1", "--repeats: -1 sweeps; give at least 1"},
      {"comm --repeats 2.5", "--repeats"},
      {"compare --warmup -1", "--warmup"},
      {"compare --alpha-us inf --beta-gbps 1", "--alpha-us"},
      {"compare --alpha-us 1 --beta-gbps inf", "--beta-gbps"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args);
    CHECK(bench(c.args, log) == 2);
    INFO(slurp(log));
    CHECK(slurp(log).find(c.words) != std::string::npos);
  }
}

namespace {

// What --backend auto resolves to here: cuda where a GPU is usable, else the simulated cpu devices.
std::string auto_backend() { return dp::probe_cuda().count > 0 ? "cuda" : "cpu"; }

// The recorded command run through /bin/sh's word splitting: the arguments it gives back, one a
// line (argv[0] first).
std::vector<std::string> shell_words(const std::string& command, const std::string& out) {
  CHECK(std::system(("set -- " + command + "; printf '%s\n' \"$@\" > '" + out + "'").c_str()) == 0);
  std::vector<std::string> words;
  std::ifstream f(out);
  for (std::string line; std::getline(f, line);) words.push_back(line);
  return words;
}

// The "backend", "backend_requested", "device_names" a record keeps (in its config, or at the top).
void check_backend(const json& rec, const std::vector<std::string>& names) {
  CHECK(rec["backend"] == auto_backend());
  CHECK(rec["backend_requested"] == "auto");
  CHECK(rec["device_names"].get<std::vector<std::string>>() == names);
}

}  // namespace

TEST_CASE("bench: records say the resolved backend and devices and a command that re-runs as typed") {
  TempDir dir;
  const std::string log = dir / "rec.log", spaced = dir / "with space";
  fs::create_directories(spaced);
  const std::string prefix = auto_backend() == "cuda" ? "cuda:" : "sim:";
  std::vector<std::string> names{prefix + "0", prefix + "1"};
  std::string devices = "--backend auto --gpus 0,1";
  if (dp::probe_cuda().count == 1) {  // one GPU: two replicas share it
    devices = "--backend auto --gpus 0,0 --allow-shared-device";
    names = {"cuda:0", "cuda:0"};
  }
  struct Case {
    std::string args;
    bool in_config;  // compare and skew keep the backend in their config, comm at the top
  };
  const Case cases[] = {
      {"compare " + devices + " --batch 16 --steps 1 --warmup 0 --repeats 1", true},
      {"skew " + devices + " --batch 16", true},
      {"comm " + devices + " --min-bytes 4K --max-bytes 8K --iters 1 --repeats 1", false},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args);
    const std::string path = spaced + "/r.json";
    int rc = bench(c.args + " --json '" + path + "'", log);
    INFO(slurp(log));
    REQUIRE(rc == 0);
    json j = load(path);
    check_backend(c.in_config ? j["config"] : j, names);
    // the path with a space comes back as one argument, after --json
    const std::vector<std::string> words = shell_words(j["command"], dir / "words.txt");
    REQUIRE(words.size() >= 3);
    CHECK(words[0] == DP_BENCH_BIN);
    CHECK(words.back() == path);
    CHECK(words[words.size() - 2] == "--json");
  }
}

TEST_CASE("bench: comm fits alpha-beta on each repeat and reports the median with its spread") {
  TempDir dir;
  const std::string log = dir / "comm.log";
  int rc = bench(
      "comm --gpus 0,1 --min-bytes 4K --max-bytes 4M --iters 3 --repeats 3 --json '" + (dir / "m.json") + "'", log);
  const std::string out = slurp(log);
  INFO(out);
  REQUIRE(rc == 0);
  json j = load(dir / "m.json");
  CHECK(j["repeats"] == 3);
  CHECK(out.find("fitted to each of 3 sweeps") != std::string::npos);
  // As in the comm test above: no fit at all only on a badly overloaded machine.
  if (j["alpha_beta"].is_null()) return;
  const json& ab = j["alpha_beta"];
  CHECK(ab["fit"] == "median");
  CHECK(ab["repeats"] == 3);
  REQUIRE(ab["per_repeat"].size() == 3);
  for (const char* key : {"alpha_us", "beta_gbps"}) {
    CAPTURE(key);
    std::vector<double> v;
    for (const json& r : ab["per_repeat"])
      if (!r.is_null()) v.push_back(r[key].get<double>());
    REQUIRE(int(v.size()) == ab["fitted"].get<int>());
    std::sort(v.begin(), v.end());
    const double med = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    const double lo = ab["spread"][key]["min"], hi = ab["spread"][key]["max"], m = ab[key];
    CHECK(lo <= m);
    CHECK(m <= hi);
    CHECK(lo == doctest::Approx(v.front()));
    CHECK(hi == doctest::Approx(v.back()));
    CHECK(m == doctest::Approx(med));
  }
  CHECK(out.find("(median over 3 repeats; min–max α ") != std::string::npos);
  CHECK(out.find("repeat 3: ") != std::string::npos);
}

TEST_CASE("bench: compare's trace lays the strategies one after the other on one time line") {
  TempDir dir;
  const std::string log = dir / "trace.log";
  int rc =
      bench("compare --gpus 0,1 --batch 16 --steps 2 --warmup 1 --repeats 1 --trace '" + (dir / "t.json") + "'", log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  std::map<int, std::pair<double, double>> extent;  // pid -> (first start, last end), µs
  const json trace = load(dir / "t.json");
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const double ts = e["ts"], end = ts + e["dur"].get<double>();
    auto [it, fresh] = extent.try_emplace(e["pid"].get<int>(), ts, end);
    if (!fresh) it->second = {std::min(it->second.first, ts), std::max(it->second.second, end)};
  }
  REQUIRE(extent.size() == 3);
  CHECK(extent[0].first >= 0);
  CHECK(extent[1].first > extent[0].second);  // each strategy starts after the one before's last span
  CHECK(extent[2].first > extent[1].second);
}

TEST_CASE("bench: compare and skew say in their help that the data is synthetic") {
  TempDir dir;
  const std::string log = dir / "help.log";
  for (const char* sub : {"compare", "skew"}) {
    CAPTURE(sub);
    REQUIRE(bench(std::string(sub) + " --help", log) == 0);
    const std::string out = slurp(log);
    INFO(out);
    CHECK(out.find("The data is synthetic: random images") != std::string::npos);
    CHECK(out.find("loss and accuracy mean nothing") != std::string::npos);
  }
}

TEST_CASE("bench: every plot says in its title that the devices were simulated") {
  if (std::system("/usr/bin/python3 -c 'import matplotlib' > /dev/null 2>&1") != 0) {
    MESSAGE("SKIPPED: /usr/bin/python3 cannot import matplotlib, so no plot to check");
    return;
  }
  TempDir dir;
  const std::string log = dir / "plot.log";
  const std::string runs[] = {
      "compare --batch 16 --steps 1 --warmup 0 --repeats 1 --sweep-devices 1,2",
      "skew --gpus 0,1 --batch 16",
      "comm --gpus 0,1 --min-bytes 4K --max-bytes 16K --iters 1 --repeats 2",
  };
  int pngs = 0;
  for (const std::string& args : runs) {
    CAPTURE(args);
    const std::string plots = dir / ("plots" + std::to_string(pngs));
    fs::create_directories(plots);
    int rc = bench(args + " --plot '" + plots + "'", log);
    INFO(slurp(log));
    REQUIRE(rc == 0);
    for (const auto& f : fs::directory_iterator(plots)) {
      if (f.path().extension() != ".png") continue;
      ++pngs;
      CAPTURE(f.path().string());
      // plot.py keeps the titles in the PNG's "Title" text chunk (uncompressed)
      const std::string png = slurp(f.path().string());
      CHECK(png.find("Title") != std::string::npos);
      CHECK(png.find("simulated CPU devices (sim:0,sim:1)") != std::string::npos);
    }
  }
  CHECK(pngs == 4);  // compare_phases, compare_scaling, skew_memory, comm_busbw
}

#endif  // DP_BENCH_BIN
