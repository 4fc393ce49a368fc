// Running dp_bench from a test: a scratch directory, the simulated devices, its exit code and output,
// and its JSON records (test_bench.cpp, test_bench_inputs.cpp).
#pragma once

#include <doctest/doctest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/util.h"

#ifdef DP_BENCH_BIN

namespace dp::test::bench_runner {

namespace fs = std::filesystem;
using nlohmann::json;

using dp::test::slurp;
using dp::test::TempDir;

// `args` on the simulated CPU devices: --backend cpu after the subcommand, so --gpus 0,1,2 means three
// devices on any machine (auto, the default, takes the GPUs where there are some). Unchanged where the
// args name a backend themselves (CLI11 refuses a repeated --backend) or start with no subcommand.
inline std::string on_cpu(const std::string& args) {
  const std::string sub = args.substr(0, args.find(' '));
  if (sub != "compare" && sub != "comm" && sub != "skew" && sub != "bn") return args;
  if (args.find("--backend") != std::string::npos) return args;
  return sub + " --backend cpu" + args.substr(sub.size());
}

// Runs dp_bench with `args` (on_cpu) and an optional environment prefix; returns its exit code. Output
// goes to `log` so a failure can show it.
inline int bench(const std::string& args, const std::string& log, const std::string& env = "") {
  std::string cmd = env + " '" + std::string(DP_BENCH_BIN) + "' " + on_cpu(args) + " > '" + log + "' 2>&1";
  int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline json load(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// A --json's alpha_beta of a median fit over `repeats` sweeps: each of alpha_us and beta_gbps the
// median of the repeats that fitted, between their min and max as "spread" says.
inline void check_median_fit(const json& ab, int repeats) {
  CHECK(ab["fit"] == "median");
  CHECK(ab["repeats"] == repeats);
  REQUIRE(ab["per_repeat"].size() == size_t(repeats));
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
}

}  // namespace dp::test::bench_runner

#endif  // DP_BENCH_BIN
