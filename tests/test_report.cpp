// What dp_train's records say about the run: --version, the --report's provenance (version, resolved
// backend, command line, start time), float settings as they were given, the device table adding
// up, and the version in checkpoints (which still load without it).
#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "engine/ledger.h"
#include "tests/util.h"
#include "train/checkpoint.h"
#include "train/options.h"
#include "train/report.h"

using namespace dp::test;

namespace {

// A line of the device table as its cells: columns are two or more spaces apart.
std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  static const std::regex gap(" {2,}");
  std::sregex_token_iterator it(line.begin(), line.end(), gap, -1), end;
  for (; it != end; ++it)
    if (!it->str().empty()) out.push_back(*it);
  return out;
}

}  // namespace

TEST_CASE("report: floats are written as given, times and command lines as a reader expects") {
  CHECK(nlohmann::json(dp::json_float(0.1f)).dump() == "0.1");
  CHECK(nlohmann::json(dp::json_float(0.9f)).dump() == "0.9");
  CHECK(nlohmann::json(dp::json_float(5e-4f)).dump() == "0.0005");
  for (float v : {0.1f, 1e-7f, 3.4e38f, 1.4e-45f, 0.3333333f}) CHECK(float(dp::json_float(v)) == v);
  CHECK(dp::utc_timestamp(std::chrono::system_clock::time_point{}) == "1970-01-01T00:00:00Z");
  CHECK(dp::shell_quote("--lr") == "--lr");
  CHECK(dp::shell_quote("/tmp/a b") == "'/tmp/a b'");
  CHECK(dp::shell_quote("it's") == "'it'\\''s'");
  CHECK(dp::shell_quote("") == "''");
  const char* argv[] = {"dp_train", "--report", "my run.json"};
  CHECK(dp::shell_command_line(3, argv) == "dp_train --report 'my run.json'");
}

TEST_CASE("report: --version prints the name and the version") {
  CommandResult r = run_command(kTrain + " --version");
  CHECK(r.exit_code == 0);
  CHECK(r.output == std::string("dp_train ") + dp::version() + "\n");
  CHECK(std::regex_match(std::string(dp::version()), std::regex(R"(\d+\.\d+\.\d+)")));
#ifdef DP_BENCH_BIN
  CommandResult b = run_command(std::string(DP_BENCH_BIN) + " --version");
  CHECK(b.exit_code == 0);
  CHECK(b.output == std::string("dp_bench ") + dp::version() + "\n");
#endif
}

TEST_CASE("report: the report records the version, the resolved backend, the command and the start") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  std::filesystem::create_directories(dir.path / "a b");
  const std::string report = dir / "a b/r.json";
  // the report's path has a space: quoted here as shell_quote quotes it. --backend auto (the default) on
  // one device, which every machine has: a GPU where one is usable, else a simulated device.
  const std::string args = " --batch 32 --steps 4 --devices 1 --lr 0.1 --momentum 0.9 --quiet --report '";
  const std::string command = kTrain + " --data " + dir.path.string() + args + report + "'";
  CommandResult r = run_command(command);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  nlohmann::json rep = read_json(report);
  CHECK(rep["version"] == dp::version());
  CHECK(rep["command_line"] == command);
  CHECK(std::regex_match(rep["started_at"].get<std::string>(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")));
  const nlohmann::json& config = rep["config"];
  CHECK(config["backend_requested"] == "auto");
  REQUIRE(config["device_names"].size() == 1);
  // auto resolves to the simulated devices here, or to cuda where a GPU is built in and present
  const bool simulated = config["device_names"][0].get<std::string>().rfind("sim:", 0) == 0;
  CHECK(config["backend"] == (simulated ? "cpu" : "cuda"));
  CHECK(rep["devices"][0]["kind"] == config["backend"]);
  // the settings as given, not widened from float (0.10000000149011612)
  const std::string text = slurp(report);
  CHECK(std::regex_search(text, std::regex(R"("lr": 0\.1[,\n])")));
  CHECK(std::regex_search(text, std::regex(R"("momentum": 0\.9[,\n])")));
  CHECK(std::regex_search(text, std::regex(R"("weight_decay": 0\.0[,\n])")));
  CHECK(rep["notes"].contains("peak_by_category"));
  CHECK(rep["notes"].contains("category_peaks"));
}

// zero3's gathered layers in a column of their own, which the other strategies' tables leave out.
TEST_CASE("report: the device table's categories add up to each device's peak") {
  int64_t whole_parameters = 0;  // allreduce's: the whole model on every device
  for (const std::string sync : {"allreduce", "zero3"}) {
    CAPTURE(sync);
    TempDir dir;
    write_synthetic_dataset(dir.path.string(), 256, 64);
    CommandResult r = run_command(kTrain + " --backend cpu --data " + dir.path.string() +
                                  " --batch 32 --steps 4 --devices 2 --sync " + sync + " --report " + dir / "r.json");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    nlohmann::json devices = read_json(dir / "r.json")["devices"];
    std::istringstream lines(r.output);
    std::string line;
    while (std::getline(lines, line) && line.rfind("device  ", 0) != 0) {
    }
    std::vector<std::string> header = cells(line);
    std::vector<std::string> want = {"device", "peak"};
    for (int c = 0; c < dp::kCategories; ++c)
      if (dp::Category(c) != dp::Category::gathered || sync == "zero3")
        want.push_back(dp::category_name(dp::Category(c)));
    want.insert(want.end(), {"sent/step", "received/step"});
    REQUIRE(header == want);  // every category has a column, under its own name
    for (auto& d : devices) {
      REQUIRE(std::getline(lines, line));
      std::vector<std::string> row = cells(line);
      REQUIRE(row.size() == header.size());
      CHECK(row[0] == d["name"].get<std::string>());
      CHECK(row[1] == dp::format_bytes(d["peak_bytes"].get<int64_t>()));
      int64_t sum = 0;
      for (size_t c = 2; c + 2 < header.size(); ++c) {
        int64_t bytes = d["peak_by_category"][header[c]].get<int64_t>();
        CHECK(row[c] == dp::format_bytes(bytes));  // the column shows that category, not a sum of two
        sum += bytes;
      }
      CHECK(sum == d["peak_bytes"].get<int64_t>());
      const int64_t parameters = d["category_peaks"]["parameters"];
      if (sync == "allreduce") whole_parameters = parameters;
      // zero3: the gathered layers, and the whole model gathered for the evaluation, under gathered;
      // parameters keeps the device's chunk, about half of the model on two devices
      if (sync == "zero3") {
        CHECK(d["category_peaks"]["gathered"].get<int64_t>() >= whole_parameters);
        CHECK(parameters * 3 < whole_parameters * 2);
      }
      CHECK_FALSE(d.contains("reserved_peak_bytes"));  // a simulated device allocates exactly
    }
  }
}

TEST_CASE("report: a CUDA device's memory pool shows beside its peak, as PyTorch's reserved beside allocated") {
  // Device records as device_report writes them; the second one a CUDA device with a pool.
  auto record = [](const std::string& name, int64_t peak) {
    nlohmann::json cats = nlohmann::json::object();
    for (int c = 0; c < dp::kCategories; ++c) cats[dp::category_name(dp::Category(c))] = 0;
    cats["parameters"] = peak;
    return nlohmann::json{{"name", name},           {"peak_bytes", peak},       {"peak_by_category", cats},
                          {"category_peaks", cats}, {"bytes_sent_per_step", 0}, {"bytes_received_per_step", 0}};
  };
  nlohmann::json devices = {record("sim:0", 4096), record("cuda:0", 8192)};
  const std::string plain = dp::device_table(devices, "note");
  CHECK(cells(plain.substr(0, plain.find('\n')))[2] == "parameters");  // no pool, no column
  CHECK(plain.find("pool held") == std::string::npos);
  devices[1]["reserved_peak_bytes"] = 2 << 20;
  std::istringstream lines(dp::device_table(devices, "note"));
  std::string line;
  std::vector<std::vector<std::string>> rows;
  while (std::getline(lines, line) && line.rfind("(", 0) != 0) rows.push_back(cells(line));
  REQUIRE(rows.size() == 3);
  CHECK(rows[0][1] == "peak");
  CHECK(rows[0][2] == "pool held");
  CHECK(rows[0][3] == "parameters");
  CHECK(rows[1][2] == "-");  // sim:0 has no pool
  CHECK(rows[2][1] == dp::format_bytes(8192));
  CHECK(rows[2][2] == dp::format_bytes(2 << 20));
  CHECK(rows[2][3] == dp::format_bytes(8192));  // the categories still add up to the peak
  CHECK(line.find("pool held: the most its memory pool kept from the driver") != std::string::npos);
}

TEST_CASE("report: checkpoints record dp_version, and one without it still resumes") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --quiet";
  REQUIRE(run_command(base + " --steps 2 --save " + dir / "ck.safetensors").exit_code == 0);
  dp::SafeTensors st = dp::read_safetensors(dir / "ck.safetensors");
  CHECK(st.metadata["dp_version"] == dp::version());
  st.metadata.erase("dp_version");  // as written before the version was recorded
  dp::write_safetensors(dir / "old.safetensors", st);
  CommandResult r = run_command(base + " --steps 4 --resume " + dir / "old.safetensors");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(run_command(base + " --steps 1 --load " + dir / "old.safetensors").exit_code == 0);
}

TEST_CASE("report: with no device flags a machine without a GPU trains on two simulated devices, the skew line") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 256, 64);
  const std::string base = kTrain + " --data " + dir.path.string() + " --batch 32 --steps 2 --backend cpu";
  CommandResult r = run_command(base + " --report " + dir / "r.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  nlohmann::json rep = read_json(dir / "r.json");
  CHECK(rep["devices"].size() == size_t(dp::kDefaultSimulatedDevices));
  CHECK(rep["config"]["gpus"] == "all");
  CHECK(r.output.find("2 simulated devices (--gpus all") != std::string::npos);
  // device 0's peak over the other's, as the ledgers in the report give them
  const double skew = rep["devices"][0]["peak_bytes"].get<double>() / rep["devices"][1]["peak_bytes"].get<double>();
  char want[64];
  std::snprintf(want, sizeof want, "skew: sim:0's peak / the mean of the others' = %.3f (scatter", skew);
  CHECK(skew > 1.0);  // under scatter device 0 holds more
  CHECK(r.output.find(want) != std::string::npos);

  r = run_command(base + " --sync allreduce");
  CHECK(r.output.find("= 1.000 (allreduce, ring: every replica holds the same)") != std::string::npos);
  r = run_command(base + " --gpus all --sync allreduce --report " + dir / "r.json");
  CHECK(read_json(dir / "r.json")["devices"].size() == size_t(dp::kDefaultSimulatedDevices));
  r = run_command(base + " --devices 1");
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("skew") == std::string::npos);  // one device: nothing to compare
}
