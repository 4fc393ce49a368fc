// dp_bench scale end to end (bench/scale_model.h): the model's closed forms as its records show them
// (the ring and the tree each where NCCL's model takes it, scatter's device 0 growing linearly with
// the devices, the sharded strategies' 2x and 3x bytes, what sharding saves), the validation's
// records, and bad input. Whether the model is near this machine's measured steps is the bench's to
// say (it prints the errors), not a timed assertion here.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>

#include "models/model.h"
#include "tests/bench_runner.h"

#ifdef DP_BENCH_BIN

using namespace dp::test::bench_runner;

namespace {

// strategy -> devices -> its point
std::map<std::string, std::map<int, json>> points(const json& j) {
  std::map<std::string, std::map<int, json>> out;
  for (const json& s : j["strategies"])
    for (const json& p : s["points"]) out[s["strategy"].get<std::string>()][p["devices"].get<int>()] = p;
  return out;
}

}  // namespace

TEST_CASE("bench: scale models every strategy on 1 to 1024 GPUs by NCCL's tuning model and dp's byte models") {
  TempDir dir;
  const std::string log = dir / "out.log", out = dir / "scale.json";
  REQUIRE(bench("scale --devices 1,8,16,64,512,1024 --json '" + out + "'", log) == 0);
  const json j = load(out);
  auto p = points(j);
  INFO(slurp(log));
  CHECK(j["preset"]["name"] == "h100-ndr");
  CHECK(p.size() == 5);  // scatter, allreduce, zero1, zero2, zero3 (the naive all-reduce is not modelled)
  // One device: no collective, the step is the compute.
  for (auto& kv : p) {  // (clang 14 refuses a structured binding inside CAPTURE's lambda)
    const std::string name = kv.first;
    CAPTURE(name);
    CHECK(kv.second[1]["comm_seconds"] == 0.0);
    CHECK(kv.second[1]["step_seconds"] == j["compute"]["seconds"]);
  }
  // LeNet's 1.7 MB all-reduce: the ring inside one node, the tree (log2 of the nodes in latency)
  // across 64 nodes and more: NCCL's model picks it.
  CHECK(p["allreduce"][8]["all_reduce"].get<std::string>().rfind("ring/", 0) == 0);
  CHECK(p["allreduce"][1024]["all_reduce"].get<std::string>().rfind("tree/", 0) == 0);
  // At 1 GiB the ring's bandwidth wins again at two nodes, within 2% of the figures the preset quotes.
  for (const json& v : j["validation"]) {
    CHECK(v["algorithm"] == "ring/Simple");
    CHECK(v["busbw_gbps"].get<double>() == doctest::Approx(v["published_gbps"].get<double>()).epsilon(0.02));
  }
  // scatter: device 0 sends and receives every other device's share, so its bytes and time grow with n
  const double bytes_ratio = p["scatter"][1024]["bytes"].get<double>() / p["scatter"][512]["bytes"].get<double>();
  const double time_ratio =
      p["scatter"][1024]["comm_seconds"].get<double>() / p["scatter"][512]["comm_seconds"].get<double>();
  CHECK(bytes_ratio == doctest::Approx(2.0).epsilon(0.01));
  CHECK(time_ratio == doctest::Approx(2.0).epsilon(0.05));
  // the ring's bytes do not: 2 (n - 1) / n of P each way
  CHECK(p["allreduce"][1024]["bytes"].get<double>() ==
        doctest::Approx(p["allreduce"][512]["bytes"].get<double>()).epsilon(0.01));
  // ZeRO-1 and -2 move what the all-reduce moves (a reduce-scatter and an all-gather); ZeRO-3 gathers
  // the parameters twice, forward and backward: 3 halves, 1.5x
  for (int n : {8, 64}) {
    CAPTURE(n);
    const double ring = p["allreduce"][n]["bytes"].get<double>();
    CHECK(p["zero1"][n]["bytes"].get<double>() / ring == doctest::Approx(1.0).epsilon(0.02));
    CHECK(p["zero2"][n]["bytes"].get<double>() / ring == doctest::Approx(1.0).epsilon(0.02));
    CHECK(p["zero3"][n]["bytes"].get<double>() / ring == doctest::Approx(1.5).epsilon(0.02));
  }
  // What each stage saves per device: zero1 the optimizer state, zero3 the parameters too. zero2's
  // chunks of the gradient save nothing on LeNet: while fc1's bucket (four fifths of the model, one
  // layer, so no --bucket-kb splits it) is reduce-scattered, backward writes the convolutions' whole,
  // about as much as zero1's whole gradient (dp_bench skew measures the same on 64 devices).
  const int64_t m_all = p["allreduce"][64]["memory_bytes"], m1 = p["zero1"][64]["memory_bytes"],
                m2 = p["zero2"][64]["memory_bytes"], m3 = p["zero3"][64]["memory_bytes"];
  CHECK(m1 < m_all);
  CHECK(std::abs(double(m2 - m1)) < 0.01 * double(m1));
  CHECK(m3 < m1);
  // One device has no ring: allreduce and zero1 hold the same, no chunk of the gradient for it.
  CHECK(p["allreduce"][1]["memory_bytes"] == p["zero1"][1]["memory_bytes"]);
  CHECK(p["allreduce"][1]["memory_bytes"].get<int64_t>() < p["allreduce"][8]["memory_bytes"].get<int64_t>());
  // The exposed share grows with the devices under every strategy but allreduce's latency-bound tree.
  CHECK(p["zero3"][1024]["comm_share"].get<double>() > p["zero3"][8]["comm_share"].get<double>());
}

TEST_CASE("bench: scale on this machine's simulated devices measures the step and sets the model beside it") {
  TempDir dir;
  const std::string log = dir / "out.log", out = dir / "scale.json";
  REQUIRE(bench("scale --preset sim --devices 1,2,4 --validate 1,2 --per-device 8 --steps 2 --repeats 1 --json '" +
                    out + "'",
                log) == 0);
  const json j = load(out);
  INFO(slurp(log));
  CHECK(j["preset"]["nccl"] == false);
  CHECK(j["preset"]["alpha_beta"]["beta_gbps"].get<double>() > 0);  // fitted here
  CHECK(j["compute"]["seconds"].get<double>() > 0);
  std::map<std::string, int> per_strategy;
  for (const json& v : j["validation"]) {
    per_strategy[v["strategy"].get<std::string>()]++;
    CHECK(v["step_seconds"].get<double>() > 0);
    CHECK(v["model_step_seconds"].get<double>() > 0);
    // one device: the model's step is the measured allreduce step it started from
    if (v["devices"] == 1 && v["strategy"] == "allreduce")
      CHECK(v["model_step_seconds"].get<double>() == doctest::Approx(v["step_seconds"].get<double>()));
  }
  CHECK(per_strategy.size() == 5);
  for (const auto& kv : per_strategy) CHECK(kv.second == 2);  // at 1 and at 2 devices
  CHECK(slurp(log).find("A MODEL, not a measurement") != std::string::npos);
}

TEST_CASE(
    "bench: scale on sim with the collectives and the step given measures nothing and costs alpha + bytes / beta") {
  TempDir dir;
  const std::string log = dir / "out.log", out = dir / "scale.json";
  REQUIRE(bench("scale --preset sim --alpha-us 10 --beta-gbps 1 --compute-us 1000 --validate none --devices 1,2 "
                "--json '" +
                    out + "'",
                log) == 0);
  const json j = load(out);
  INFO(slurp(log));
  CHECK(slurp(log).find("measuring") == std::string::npos);
  CHECK(j["validation"].empty());
  const auto p = points(j);
  // the ring over 2 devices: each sends and receives the whole gradient, P floats, once
  const double P = double(dp::make_model("lenet").param_count);
  const json& two = p.at("allreduce").at(2);
  CHECK(two["comm_seconds"].get<double>() == doctest::Approx(10e-6 + P * 4 / 1e9).epsilon(1e-9));
  CHECK(two["step_seconds"].get<double>() == doctest::Approx(1000e-6 + 10e-6 + P * 4 / 1e9).epsilon(1e-9));
}

TEST_CASE("bench: scale refuses a count below 1 or given twice, nodes it cannot fill and an unknown preset: exit 2") {
  TempDir dir;
  const std::string log = dir / "out.log";
  struct Case {
    std::string args, words;
  };
  const Case cases[] = {
      {"scale --devices 0,8", "--devices: '0,8': a device count must be at least 1"},
      {"scale --devices 12", "12 devices do not fill whole nodes of 8"},
      {"scale --devices 8,16,8", "--devices: '8,16,8': 8 is given twice; give each device count once"},
      {"scale --preset tpu", "--preset: unknown 'tpu'; the presets are sim, h100-ndr, a100-hdr, pcie"},
      {"scale --model lenet5", "--compute-us: the h100-ndr preset knows dp's step for lenet at --per-device 256 only"},
      {"scale --per-device 0", "--per-device: at least 1 image per device"},
      {"scale --compute-us -5", "--compute-us: a one-device step in microseconds, finite and more than 0"},
      // -1 given is refused, not read as not given (it was the sentinel); nan likewise
      {"scale --compute-us -1", "--compute-us: a one-device step in microseconds, finite and more than 0"},
      {"scale --preset sim --compute-us nan",
       "--compute-us: a one-device step in microseconds, finite and more than 0"},
      {"scale --preset sim --alpha-us 3", "--alpha-us and --beta-gbps: give both"},
      // given, and negative: refused as such, not read as not given
      {"scale --preset sim --alpha-us 3 --beta-gbps -8.3",
       "--beta-gbps: must be a finite bandwidth > 0 in GB/s, not -8.3"},
      {"scale --preset sim --alpha-us -1 --beta-gbps 2", "--alpha-us: must be a finite latency >= 0 in µs, not -1"},
      {"scale --alpha-us 3 --beta-gbps 1", "--alpha-us/--beta-gbps: the sim preset's collectives"},
      {"scale --preset sim --alpha-us 3 --beta-gbps nan",
       "--beta-gbps: must be a finite bandwidth > 0 in GB/s, not nan"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args);
    CHECK(bench(c.args, log) == 2);
    CHECK(slurp(log).find(c.words) != std::string::npos);
  }
}

#endif  // DP_BENCH_BIN
