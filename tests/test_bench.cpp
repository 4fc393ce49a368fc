// dp_bench end to end: compare's bytes against the byte model (recomputed here from the formulas,
// not from the strategies), its Chrome trace, skew's ledgers, comm's bandwidth definitions, and the exit
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

#include "tests/bench_runner.h"

namespace {

using namespace dp::test::bench_runner;

// The byte model written out again from its definition (each strategy's file has the same formulas).
std::vector<dp::Traffic> expected_traffic(const std::string& strategy, const dp::ModelSpec& spec,
                                          const std::vector<int>& n_i) {
  const int64_t P = spec.param_count, D = spec.input_size(), C = spec.classes;
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
  } else if (strategy == "zero1") {  // reduce-scatter and all-gather: (n-1) chunks of ceil(P / n) in each
    for (int r = 0; r < n; ++r) t[r].sent = t[r].received = 2 * (n - 1) * dp::shard_chunk(P, n) * 4;
  } else if (strategy == "zero2" || strategy == "zero3") {  // per layer: (n-1) chunks of ceil(c / n) in
    // each collective, c the layer's; zero3 gathers the parameters twice
    const int collectives = strategy == "zero3" ? 3 : 2;
    for (const dp::Layer& l : spec.layers)
      if (l.weight >= 0) {
        const int64_t c = spec.params[size_t(l.weight)].size + spec.params[size_t(l.bias)].size;
        for (int r = 0; r < n; ++r) t[r].sent += collectives * (n - 1) * dp::shard_chunk(c, n) * 4;
      }
    for (int r = 0; r < n; ++r) t[r].received = t[r].sent;
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
    auto expected = expected_traffic(name, spec, sizes);
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
  CHECK(strategies == std::set<std::string>{"scatter", "naive", "allreduce", "zero1", "zero2", "zero3"});
  // The columns in their order: nn.DataParallel, d2l's hand-written all-reduce, DDP, ZeRO-1, -2, -3.
  REQUIRE(run["strategies"].size() == 6);
  CHECK(run["strategies"][1]["strategy"] == "naive");
  CHECK(run["strategies"][1]["sync"] == "allreduce");
  CHECK(run["strategies"][1]["allreduce"] == "naive");
  CHECK(run["strategies"][2]["allreduce"] == "ring");
  CHECK(run["strategies"][0]["allreduce"].is_null());
  const std::string out = slurp(log);
  // The table's heading: three columns in that order.
  const size_t heading = out.find(" scatter "), naive = out.find(" naive ", heading),
               allreduce = out.find(" allreduce ", naive), zero1 = out.find(" zero1 ", allreduce),
               zero2 = out.find(" zero2 ", zero1), zero3 = out.find(" zero3\n", zero2);
  REQUIRE(heading != std::string::npos);
  CHECK(out.find('\n', heading) > zero3);
  CHECK(zero2 < zero3);
  CHECK(naive < allreduce);
  CHECK(allreduce < zero1);
  CHECK(zero1 < zero2);
  CHECK(out.find("on every device for every strategy") != std::string::npos);

  // Chrome trace: one process per strategy, one lane (tid) per device, a span per phase.
  json trace = load(dir / "t.json");
  std::map<int, std::string> process;                          // pid -> "scatter, 3 devices"
  std::map<std::pair<int, int>, std::set<std::string>> spans;  // (pid, tid) -> phase names
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") process[e["pid"]] = e["args"]["name"];
    if (e["ph"] == "X") spans[{e["pid"].get<int>(), e["tid"].get<int>()}].insert(e["name"].get<std::string>());
  }
  REQUIRE(process.size() == 6);
  const std::set<std::string> scatter_phases{"load",        "scatter",  "broadcast", "forward",
                                             "gather+loss", "backward", "reduce",    "optimizer"};
  const std::set<std::string> allreduce_phases{"load", "forward", "loss", "backward", "all-reduce", "optimizer"};
  const std::set<std::string> zero1_phases{"load",           "forward",   "loss",      "backward",
                                           "reduce-scatter", "optimizer", "all-gather"};
  const std::set<std::string> zero2_phases{"load",           "forward",   "loss",      "backward",
                                           "reduce-scatter", "optimizer", "all-gather"};
  const std::set<std::string> zero3_phases{"load",           "all-gather+forward", "loss", "all-gather+backward",
                                           "reduce-scatter", "optimizer"};
  for (auto& entry : process) {  // no structured binding: doctest's CAPTURE captures it, which clang 14 refuses
    const int pid = entry.first;
    const std::string& name = entry.second;
    const std::set<std::string>& phases = name.rfind("scatter", 0) == 0 ? scatter_phases
                                          : name.rfind("zero1", 0) == 0 ? zero1_phases
                                          : name.rfind("zero2", 0) == 0 ? zero2_phases
                                          : name.rfind("zero3", 0) == 0 ? zero3_phases
                                                                        : allreduce_phases;
    CAPTURE(name);
    for (int tid = 0; tid < 3; ++tid) {
      CAPTURE(tid);
      CHECK(spans[{pid, tid}] == phases);
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

TEST_CASE("dp_bench compare - with --clip-grad-norm the sharded strategies' one more float equals the model") {
  // zero1-3 hold their shares of the gradient alone, so the norm needs their squared norms summed: an
  // all-reduce of one float a step, in the model (Strategy::step_collectives) as in the engine
  TempDir dir;
  const std::string log = dir / "clip.log";
  int rc = bench(
      "compare --batch 16 --steps 1 --warmup 0 --alpha-us 5 --beta-gbps 10 --clip-grad-norm 0.5 "
      "--sweep-devices 2,3 --json '" +
          (dir / "c.json") + "'",
      log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  json j = load(dir / "c.json");
  CHECK(j["match"] == true);
  CHECK(j["config"]["clip_grad_norm"] == 0.5);
  for (const json& run : j["runs"])
    for (const json& s : run["strategies"]) {
      int norms = 0;
      for (const json& c : s["collectives"]) norms += c["what"] == "the gradient's squared norm";
      CAPTURE(s["strategy"].get<std::string>());
      CHECK(norms == (s["strategy"].get<std::string>().rfind("zero", 0) == 0 ? 1 : 0));
    }
}

TEST_CASE(
    "dp_bench skew - device 0 holds more under scatter, the same under allreduce and ZeRO-1 to 3, their shares of "
    "the optimizer state, gradients and parameters in closed form, and the ledger adds up") {
  TempDir dir;
  const std::string log = dir / "skew.log";
  int rc = bench("skew --gpus 0,1,2 --batch 48 --json '" + (dir / "s.json") + "'", log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  json j = load(dir / "s.json");
  REQUIRE(j["strategies"].size() == 5);
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
    // The memory model explains every category device 0 booked at its peak, in the heading or on a
    // line of its own, and each line's category the bytes its ledger booked.
    const std::vector<std::string> lines = s["explanation"];
    REQUIRE(!lines.empty());
    for (const auto& item : s["devices"][0]["at_peak"].items()) {
      const std::string cat = item.key();  // a plain variable: clang 14's lambdas (CAPTURE) cannot take a binding
      CAPTURE(cat);
      bool named = item.value().get<int64_t>() == 0 || lines[0].find(cat) != std::string::npos;
      for (const std::string& line : lines) named = named || line.rfind(cat + " ", 0) == 0;
      CHECK(named);
    }
    for (const std::string& line : lines) CHECK(line.find("[the ledger has") == std::string::npos);
  }
  // Under scatter only device 0 keeps the reduce buffer and the optimizer state.
  const json& sc = j["strategies"][0];
  REQUIRE(sc["strategy"] == "scatter");
  CHECK(sc["devices"][0]["at_peak"]["comm"].get<int64_t>() > 0);
  CHECK(sc["devices"][0]["at_peak"]["optimizer"].get<int64_t>() > 0);
  CHECK(sc["devices"][1]["at_peak"]["comm"] == 0);
  CHECK(sc["devices"][1]["at_peak"]["optimizer"] == 0);
  // Under zero1 every device keeps the momentum of its own chunk, ceil(P / 3) floats; under allreduce all
  // P; under zero2 its chunk of every layer, ceil(c / 3) each.
  const dp::ModelSpec spec = dp::make_model("lenet");
  const int64_t P = spec.param_count;
  int64_t layer_chunks = 0, largest_chunk = 0, conv_chunks = 0, fc1_chunk = 0;
  for (const dp::Layer& l : spec.layers)
    if (l.weight >= 0) {
      const int64_t chunk = dp::shard_chunk(spec.params[size_t(l.weight)].size + spec.params[size_t(l.bias)].size, 3);
      layer_chunks += chunk, largest_chunk = std::max(largest_chunk, chunk);
      if (l.kind == dp::LayerKind::conv) conv_chunks += chunk;
      if (l.kind == dp::LayerKind::linear && fc1_chunk == 0) fc1_chunk = chunk;
    }
  const json &ar = j["strategies"][1], &z1 = j["strategies"][2], &z2 = j["strategies"][3], &z3 = j["strategies"][4];
  REQUIRE(z1["strategy"] == "zero1");
  REQUIRE(z2["strategy"] == "zero2");
  REQUIRE(z3["strategy"] == "zero3");
  for (int r = 0; r < 3; ++r) {
    CHECK(ar["devices"][r]["at_peak"]["optimizer"].get<int64_t>() == P * 4);
    CHECK(z1["devices"][r]["at_peak"]["optimizer"].get<int64_t>() == dp::shard_chunk(P, 3) * 4);
    CHECK(z2["devices"][r]["at_peak"]["optimizer"].get<int64_t>() == layer_chunks * 4);
    // its chunks and, at its peak, three layers' gradients whole, padded to 3 chunks: fc1's being
    // reduce-scattered while backward writes the convolutions'
    CHECK(z2["devices"][r]["at_peak"]["gradients"].get<int64_t>() ==
          (layer_chunks + 3 * (fc1_chunk + conv_chunks)) * 4);
    // zero3: its chunks of everything, and at its peak the largest layer's weights (gathered) and
    // gradient whole (the bucket before freed as the layer is gathered)
    CHECK(z3["devices"][r]["at_peak"]["optimizer"].get<int64_t>() == layer_chunks * 4);
    CHECK(z3["devices"][r]["at_peak"]["gradients"].get<int64_t>() == (layer_chunks + 3 * largest_chunk) * 4);
    CHECK(z3["devices"][r]["at_peak"]["parameters"].get<int64_t>() == layer_chunks * 4);
    CHECK(z3["devices"][r]["at_peak"]["gathered"].get<int64_t>() == 3 * largest_chunk * 4);
    CHECK(z2["devices"][r]["at_peak"]["gathered"] == 0);
  }
}

TEST_CASE("dp_bench comm - nccl-tests bandwidths and an alpha-beta fit") {
  TempDir dir;
  const std::string log = dir / "comm.log";
  int rc = bench("comm --gpus 0,1 --min-bytes 4K --max-bytes 4M --iters 3 --json '" + (dir / "m.json") + "'", log);
  INFO(slurp(log));
  REQUIRE(rc == 0);
  json j = load(dir / "m.json");
  std::map<std::string, double> factor{{"all_reduce", 1.0}, {"scatter", 0.5}, {"gather", 0.5},
                                       {"broadcast", 1.0},  {"reduce", 1.0},  {"reduce_scatter", 0.5},
                                       {"all_gather", 0.5}};
  std::set<std::string> seen;
  for (const json& p : j["points"]) {
    seen.insert(p["collective"]);
    double algbw = p["algbw_gbps"], busbw = p["busbw_gbps"];
    CHECK(algbw == doctest::Approx(p["bytes"].get<double>() / (p["time_us"].get<double>() * 1e3)));
    CHECK(busbw == doctest::Approx(algbw * factor.at(p["collective"])));
  }
  CHECK(seen.size() == 7);
  CHECK(j["points"].size() == 7 * 11);  // 4K .. 4M
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
  for (const char* args : {"", "frobnicate", "compare --batch 0", "compare --steps 0", "compare --split weird",
                           "compare --gpus 0,x", "compare --sweep-devices 1,0", "compare --sweep-devices 2,1,2",
                           "compare --alpha-us 5", "compare --json /nonexistent-dir/x.json", "comm --max-bytes 12Q",
                           "comm --gpus 0", "comm --min-bytes 1M --max-bytes 1K", "skew --optimizer rmsprop",
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
                           "ops --model resnet", "ops --model lenet-bn --batch 1", "ops --frobnicate"}) {
    CAPTURE(args);
    CHECK(bench(args, log) == 2);
    CHECK(slurp(log).rfind("dp_bench: ", 0) == 0);
  }
  CHECK(slurp(log).find("--frobnicate") != std::string::npos);
}

#endif  // DP_BENCH_BIN

TEST_CASE("dp_bench compare - --grad-dtype bf16: the gradients' bytes halve on the model, scatter's stay fp32") {
  TempDir dir;
  std::vector<json> runs;
  for (const std::string dtype : {"fp32", "bf16"}) {
    const std::string log = dir / (dtype + ".log"), out = dir / (dtype + ".json");
    int rc = bench("compare --devices 2 --batch 12 --steps 1 --warmup 0 --alpha-us 5 --beta-gbps 10 --grad-dtype " +
                       dtype + " --json '" + out + "'",
                   log);
    INFO(slurp(log));
    REQUIRE(rc == 0);
    runs.push_back(load(out));
    CHECK(runs.back()["match"] == true);  // measured bytes equal the byte model in either type
    CHECK(runs.back()["config"]["grad_dtype"] == dtype);
  }
  const json &f = runs[0]["runs"][0]["strategies"], &b = runs[1]["runs"][0]["strategies"];
  REQUIRE(f.size() == b.size());
  for (size_t i = 0; i < f.size(); ++i) {
    const std::string name = f[i]["strategy"];
    CAPTURE(name);
    const int64_t sent_f = f[i]["devices"][1]["bytes_sent"], sent_b = b[i]["devices"][1]["bytes_sent"];
    if (name == "scatter")
      CHECK(sent_b == sent_f);
    else if (name == "allreduce" || name == "naive")
      CHECK(2 * sent_b == sent_f);
    else
      CHECK(sent_b < sent_f);  // the parameters' all-gathers stay float32
  }
}

TEST_CASE(
    "dp_bench compare - --accumulate: the gradients travel once a step, scatter's every micro-batch, on the model") {
  TempDir dir;
  std::vector<json> runs;
  for (int accumulate : {1, 3}) {
    const std::string log = dir / ("acc" + std::to_string(accumulate) + ".log");
    const std::string out = dir / ("a" + std::to_string(accumulate) + ".json");
    int rc = bench("compare --devices 3 --batch 12 --steps 1 --warmup 0 --alpha-us 5 --beta-gbps 10 --accumulate " +
                       std::to_string(accumulate) + " --json '" + out + "'",
                   log);
    INFO(slurp(log));
    REQUIRE(rc == 0);
    runs.push_back(load(out));
    CHECK(runs.back()["match"] == true);  // measured bytes equal the byte model, micro-batches and all
    CHECK(runs.back()["config"]["step_images"] == 12 * accumulate);
  }
  const json &one = runs[0]["runs"][0]["strategies"], &three = runs[1]["runs"][0]["strategies"];
  REQUIRE(one.size() == three.size());
  for (size_t i = 0; i < one.size(); ++i) {
    const std::string name = one[i]["strategy"];
    CAPTURE(name);
    const int64_t sent1 = one[i]["devices"][1]["bytes_sent"], sent3 = three[i]["devices"][1]["bytes_sent"];
    CHECK(sent3 == (name == "scatter" ? 3 * sent1 : name == "zero3" ? sent3 : sent1));
    if (name == "zero3") CHECK(sent3 > sent1);  // its weights gathered for every micro-batch's passes
  }
  int rc = bench("compare --devices 2 --batch 12 --steps 1 --accumulate 0", dir / "bad.log");
  CHECK(rc == 2);
  CHECK(slurp(dir / "bad.log").find("--accumulate: 0 is not a number of micro-batches; give at least 1") !=
        std::string::npos);
}
