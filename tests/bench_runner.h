// Running dp_bench from a test: a scratch directory, the simulated devices, its exit code and output,
// and its JSON records (test_bench.cpp, test_bench_inputs.cpp).
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

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

}  // namespace dp::test::bench_runner

#endif  // DP_BENCH_BIN
