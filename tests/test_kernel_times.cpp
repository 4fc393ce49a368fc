// scripts/kernel_times.py, the GPU check's per-kernel table (scripts/gpu_check.sh's profile step), on
// files written the way `ncu --csv --print-units base --metrics gpu__time_duration.sum` writes them:
// a step is the longer run less the shorter one, over the steps between them.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "tests/util.h"

namespace dp::test {
namespace {

const std::string kScript = "/usr/bin/python3 " + std::string(DP_SOURCE_DIR) + "/scripts/kernel_times.py ";

// An ncu CSV log: the tool's own lines, then one row per kernel launch.
void write_ncu(const std::string& path, int gemms, int relus) {
  std::ofstream f(path);
  f << "==PROF== Connected to process 1 (dp_train)\n"
    << "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\"Stream\",\"Block Size\","
       "\"Grid Size\",\"Device\",\"CC\",\"Section Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"\n";
  int id = 0;
  auto row = [&](const std::string& name, const std::string& value) {
    f << '"' << id++ << "\",\"1\",\"dp_train\",\"h\",\"" << name << "\",\"1\",\"7\",\"(256, 1, 1)\",\"(8, 1, 1)\","
      << "\"0\",\"9.0\",\"Command line profiler metrics\",\"gpu__time_duration.sum\",\"nsecond\",\"" << value << "\"\n";
  };
  row("void cudnn::plan_kernel<float>(int)", "500,000");  // the start: in both runs, cancels
  for (int i = 0; i < gemms; ++i) row("cutlass::Kernel2<sgemm>(Params)", "12,000");
  for (int i = 0; i < relus; ++i) row("void dp::relu_forward_kernel(long, const float *, float *)", "3000");
}

TEST_CASE("kernel_times.py: a step is the longer run less the shorter over the steps between, longest first") {
  TempDir dir;
  const std::string a = dir / "ncu-10.csv", b = dir / "ncu-30.csv", out = dir / "k.json";
  write_ncu(a, 10, 30);  // 10 steps: one GEMM (12 us) and three ReLUs (3 us each) a step
  write_ncu(b, 30, 90);
  const CommandResult r = run_command(kScript + a + " " + b + " --steps 20 --json " + out);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = read_json(out);
  CHECK(j["total_us"].get<double>() == doctest::Approx(21.0));
  CHECK(j["launches"].get<double>() == doctest::Approx(4.0));
  REQUIRE(j["kernels"].size() == 2);  // the planning kernel ran as often in both: not a step's
  CHECK(j["kernels"][0]["name"] == "cutlass::Kernel2<sgemm>");
  CHECK(j["kernels"][0]["us"].get<double>() == doctest::Approx(12.0));
  CHECK(j["kernels"][1]["name"] == "dp::relu_forward_kernel");
  CHECK(j["kernels"][1]["calls"].get<double>() == doctest::Approx(3.0));
  CHECK(r.output.find("all kernels of one step") != std::string::npos);
}

TEST_CASE("kernel_times.py: a file that is not ncu's CSV, or --steps 0, exits 1 naming it") {
  TempDir dir;
  const std::string a = dir / "ncu.csv", junk = dir / "junk.txt";
  write_ncu(a, 1, 1);
  std::ofstream(junk) << "no kernels here\n";
  CommandResult r = run_command(kScript + a + " " + junk + " --steps 20");
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("no kernel times in " + junk) != std::string::npos);
  r = run_command(kScript + a + " " + a + " --steps 0");
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("--steps must be at least 1") != std::string::npos);
}

}  // namespace
}  // namespace dp::test
