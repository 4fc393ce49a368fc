// scripts/kernel_times.py, the GPU check's per-kernel table (scripts/gpu_check.sh's profile step), on
// files written the way `ncu --csv --print-units base --metrics gpu__time_duration.sum` writes them:
// a step is the longer run less the shorter one, over the steps between them. And
// scripts/ncu_stalls.py, the stalls step's summary of why the longest kernels take their time, on
// both of ncu's CSV layouts, and the kernels it picks for ncu from kernel_times.py's table.
#include <doctest/doctest.h>

#include <fstream>
#include <regex>
#include <string>

#include "tests/util.h"

namespace dp::test {
namespace {

const std::string kKernelTimes = "/usr/bin/python3 " + std::string(DP_SOURCE_DIR) + "/scripts/kernel_times.py ";
const std::string kStalls = "/usr/bin/python3 " + std::string(DP_SOURCE_DIR) + "/scripts/ncu_stalls.py ";

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
  const CommandResult r = run_command(kKernelTimes + a + " " + b + " --steps 20 --json " + out);
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
  CommandResult r = run_command(kKernelTimes + a + " " + junk + " --steps 20");
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("no kernel times in " + junk) != std::string::npos);
  r = run_command(kKernelTimes + a + " " + a + " --steps 0");
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("--steps must be at least 1") != std::string::npos);
}

// `ncu --import R --page raw --csv --print-units base`: a column a metric, their units in the row under
// the header, a row a launch. The filter-gradient kernel runs once, the GEMM twice.
void write_raw(const std::string& path) {
  std::ofstream f(path);
  const std::string stall = "smsp__average_warps_issue_stalled_", per = "_per_issue_active.ratio";
  f << "==PROF== Disconnected from process 1\n"
    << "\"ID\",\"Process ID\",\"Kernel Name\",\"Grid "
       "Size\",\"gpu__time_duration.sum\",\"launch__registers_per_thread\","
    << "\"sm__throughput.avg.pct_of_peak_sustained_elapsed\",\"sm__warps_active.avg.pct_of_peak_sustained_active\",\""
    << stall << "long_scoreboard" << per << "\",\"" << stall << "barrier" << per << "\",\"" << stall << "wait" << per
    << "\"\n"
    << "\"\",\"\",\"\",\"\",\"ns\",\"register/thread\",\"%\",\"%\",\"ratio\",\"ratio\",\"ratio\"\n"
    << "\"0\",\"1\",\"void dp::<unnamed>::direct_filter_grad_kernel<9, 4, 1>(dp::ConvShape)\",\"(5, 64, 1)\","
    << "\"42,500\",\"64\",\"12.5\",\"25\",\"10.5\",\"3.25\",\"1\"\n"
    << "\"1\",\"1\",\"void cutlass::Kernel2<sgemm_nn>(T1::Params)\",\"(8, 1, "
       "1)\",\"20,000\",\"128\",\"50\",\"10\",\"2\","
    << "\"0.5\",\"4\"\n"
    << "\"2\",\"1\",\"void cutlass::Kernel2<sgemm_nn>(T1::Params)\",\"(8, 1, "
       "1)\",\"18,000\",\"128\",\"60\",\"20\",\"4\","
    << "\"0.5\",\"8\"\n";
}

TEST_CASE("ncu_stalls.py: a kernel's launches add up, its shares are their mean, its warp stalls longest first") {
  TempDir dir;
  const std::string raw = dir / "raw.csv", out = dir / "stalls.json";
  write_raw(raw);
  const CommandResult r = run_command(kStalls + raw + " --json " + out);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = read_json(out);
  REQUIRE(j["kernels"].size() == 2);
  const nlohmann::json& first = j["kernels"][0];  // 42.5 us against the GEMM's 38
  CHECK(first["name"] == "dp::<unnamed>::direct_filter_grad_kernel<9, 4, 1>");
  CHECK(first["us"].get<double>() == doctest::Approx(42.5));
  CHECK(first["stalls"][0] == nlohmann::json::array({"long_scoreboard", 10.5}));
  CHECK(first["stalls"][1][0] == "barrier");
  const nlohmann::json& gemm = j["kernels"][1];
  CHECK(gemm["launches"] == 2);
  CHECK(gemm["us"].get<double>() == doctest::Approx(38.0));
  CHECK(gemm["sm_pct"].get<double>() == doctest::Approx(55.0));
  CHECK(gemm["occupancy_pct"].get<double>() == doctest::Approx(15.0));
  CHECK(gemm["stalls"][0] == nlohmann::json::array({"wait", 6.0}));  // (4 + 8) / 2, before scoreboard's 3
  CHECK(gemm["memory_pct"].is_null());                               // not in the report: unknown, not 0
  CHECK(r.output.find("the longest: direct_filter_grad_kernel<9, 4, 1> 42.5 us, SM 12%") != std::string::npos);
}

TEST_CASE("ncu_stalls.py: the details page (a row a metric, ncu's display names) reads as the raw page") {
  TempDir dir;
  const std::string details = dir / "details.csv", junk = dir / "junk.csv";
  {
    std::ofstream f(details);
    f << "\"ID\",\"Kernel Name\",\"Section Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"\n";
    for (const char* row : {"\"GPU Speed Of Light Throughput\",\"Duration\",\"usecond\",\"7.25\"",
                            "\"GPU Speed Of Light Throughput\",\"Compute (SM) Throughput\",\"%\",\"33.5\"",
                            "\"Occupancy\",\"Achieved Occupancy\",\"%\",\"80\""})
      f << "\"0\",\"void dp::<unnamed>::sgd_kernel(long)\"," << row << "\n";
  }
  std::ofstream(junk) << "\"ID\",\"Kernel Name\"\n";
  const CommandResult r = run_command(kStalls + details);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("the longest: sgd_kernel 7.2 us, SM 34%, occupancy 80%") != std::string::npos);
  const CommandResult none = run_command(kStalls + junk);
  CHECK(none.exit_code == 1);
  CHECK(none.output.find("no kernel launch with a duration in " + junk) != std::string::npos);
}

TEST_CASE("ncu_stalls.py --pick: the launches a step of the longest kernels, and a pattern of their names alone") {
  TempDir dir;
  const std::string kernels = dir / "kernels.json";
  std::ofstream(kernels) << R"({"kernels": [
    {"name": "dp::<unnamed>::act_pool_backward_rows_kernel<0>", "calls": 2.0, "us": 24.9},
    {"name": "cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>", "calls": 1.0, "us": 20.0},
    {"name": "sm80_xmma_fprop_implicit_gemm_f32f32_tilesize128x32x8...", "calls": 1.0, "us": 19.0},
    {"name": "cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>", "calls": 1.0, "us": 8.1}]})";
  const CommandResult r = run_command(kStalls + "--pick " + kernels + " --top 3");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const size_t space = r.output.find(' ');
  CHECK(r.output.substr(0, space) == "4");  // 2 + 1 + 1 launches a step
  std::string pattern = r.output.substr(space + 1);
  pattern.erase(pattern.find_last_not_of('\n') + 1);
  const std::regex re(pattern);  // as ncu's --kernel-name regex: over the demangled names
  CHECK(std::regex_match("void dp::<unnamed>::act_pool_backward_rows_kernel<0>(int, int, cuda::Divider)", re));
  CHECK(std::regex_match("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(T1::Params)", re));
  CHECK(std::regex_match("sm80_xmma_fprop_implicit_gemm_f32f32_tilesize128x32x8_stage3_warpsize2x2x1", re));
  CHECK_FALSE(std::regex_match("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>(T1::Params)", re));
  CHECK_FALSE(std::regex_match("void dp::<unnamed>::act_pool_backward_rows_kernel<1>(int)", re));
}

}  // namespace
}  // namespace dp::test
