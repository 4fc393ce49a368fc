// dp_bench end to end, its inputs and records: every output path checked before a run, memory
// estimates, exact integer flags, the resolved backend and command in every record, the alpha-beta
// fit's repeats, compare's trace time line, skew's optimizers, the help and the plots' titles. The
// test names avoid ';' and ',' (ctest's list separator and doctest's filter separator).
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "engine/device.h"
#include "models/model.h"
#include "tests/bench_runner.h"

#ifdef DP_BENCH_BIN

using namespace dp::test::bench_runner;

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
    cases.push_back(
        {sub + " --json --plot '" + dir.path.string() + "'", "--json: needs a value, and got the option --plot"});
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
      // given and negative: refused as such (compare's check is scale's, given_alpha_beta)
      {"compare --alpha-us 1 --beta-gbps -2", "--beta-gbps: must be a finite bandwidth > 0 in GB/s, not -2"},
      {"compare --beta-gbps 2", "--alpha-us and --beta-gbps: give both"},
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
    names = {"cuda:0#0", "cuda:0#1"};  // a shared GPU's replicas are told apart
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
  check_median_fit(j["alpha_beta"], 3);
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
  REQUIRE(extent.size() == 6);  // scatter, naive, allreduce, zero1, zero2, zero3
  CHECK(extent[0].first >= 0);
  for (int pid = 1; pid < 6; ++pid) {
    CAPTURE(pid);
    CHECK(extent[pid].first > extent[pid - 1].second);  // each strategy starts after the one before's last span
  }
}

TEST_CASE("bench: skew --optimizer adamw books AdamW's two moments as adam does") {
  TempDir dir;
  const std::string log = dir / "skew.log";
  for (const std::string name : {"adam", "adamw"}) {
    CAPTURE(name);
    REQUIRE(bench("skew --gpus 0,1 --batch 16 --optimizer " + name + " --json '" + (dir / "s.json") + "'", log) == 0);
    const json j = load(dir / "s.json");
    const json& ar = j["strategies"][1];
    REQUIRE(ar["strategy"] == "allreduce");
    for (const json& d : ar["devices"])
      CHECK(d["at_peak"]["optimizer"].get<int64_t>() == 2 * dp::make_model("lenet").param_count * 4);
    CHECK(slurp(log).find(name == "adam" ? "Adam, 2 steps" : "AdamW, 2 steps") != std::string::npos);
  }
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
