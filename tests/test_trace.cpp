// The Chrome trace (--trace): a lane per device with its phases and evaluations, a communication
// lane under it with one span per bucket all-reduce inside the step that produced it, a host lane
// for the trainer's spans, and trace_json's offset moving every event by the same amount.
#include <doctest/doctest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/engine.h"
#include "tests/backends.h"
#include "tests/util.h"
#include "train/trace.h"

using namespace dp;
using namespace dp::test;
using nlohmann::json;

namespace {

constexpr int kBatch = 64, kTest = 64, kSteps = 3, kBucketKb = 16;
// The sums ts + dur carry one rounding each: far below a microsecond at the times of a short run.
constexpr double kRounding = 0.01;

struct Trace {
  std::map<int, std::string> lanes;  // tid -> thread_name
  std::map<int, int> order;          // tid -> thread_sort_index
  std::vector<json> spans;           // the "X" events, in file order
};

// Parses a trace and checks what every trace must be: metadata first, then spans with int pid/tid,
// ts >= 0, dur >= 0, in time order.
Trace parse(const json& t) {
  Trace out;
  CHECK(t["displayTimeUnit"] == "ms");
  double last_ts = 0;
  for (const json& e : t["traceEvents"]) {
    CHECK(e["pid"].is_number_integer());
    if (e["ph"] == "M") {
      CHECK(out.spans.empty());  // metadata before every span
      if (e["name"] == "thread_name") out.lanes[e["tid"].get<int>()] = e["args"]["name"];
      if (e["name"] == "thread_sort_index") out.order[e["tid"].get<int>()] = e["args"]["sort_index"];
      continue;
    }
    REQUIRE(e["ph"] == "X");
    CHECK(e["tid"].is_number_integer());
    CHECK(e["ts"].get<double>() >= 0);
    CHECK(e["dur"].get<double>() >= 0);
    CHECK(e["ts"].get<double>() >= last_ts);
    last_ts = e["ts"].get<double>();
    out.spans.push_back(e);
  }
  return out;
}

Trace train_trace(const std::string& dir, const std::string& extra, const std::string& sync = "allreduce") {
  const std::string path = dir + "/t.json";
  CommandResult r =
      run_command(kTrain + " --data " + dir + " --backend cpu --devices 2 --sync " + sync + " --batch " +
                  std::to_string(kBatch) + " --steps " + std::to_string(kSteps) + extra + " --quiet --trace " + path);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  return parse(read_json(path));
}

EngineConfig bucketed(int batch, bool trace) {
  EngineConfig cfg;
  cfg.sync = "allreduce";
  cfg.batch = batch;
  cfg.bucket_kb = kBucketKb;
  cfg.trace = trace;
  return cfg;
}

// The buckets dp_train makes for lenet at kBucketKb, from an engine built the same way.
std::vector<Bucket> lenet_buckets() {
  auto devs = dp::test::make_test_devices("cpu", 2);
  return Engine(raw(devs), make_model("lenet"), bucketed(kBatch, false)).buckets();
}

// The spans on lane tid of one step, by name.
std::map<std::string, json> step_spans(const Trace& t, int tid, int64_t step) {
  std::map<std::string, json> out;
  for (const json& e : t.spans)
    if (e["tid"] == tid && e["args"].contains("step") && e["args"]["step"] == step) out[e["name"]] = e;
  return out;
}

double end_of(const json& e) { return e["ts"].get<double>() + e["dur"].get<double>(); }

}  // namespace

// allreduce's buckets and zero2's alike: each bucket's collective on the device's communication lane,
// started as backward hands the bucket over, the last waited for by the step's phase of that name.
TEST_CASE("trace: bucket all-reduces and reduce-scatters on a comm lane per device, inside the step that made them") {
  for (const std::string collective : {"all-reduce", "reduce-scatter"}) {
    CAPTURE(collective);
    const std::string sync = collective == "all-reduce" ? "allreduce" : "zero2";
    TempDir dir;
    write_synthetic_dataset(dir.path.string(), 4 * kBatch, kTest);
    const std::vector<Bucket> buckets = lenet_buckets();
    REQUIRE(buckets.size() >= 2);  // else nothing could overlap
    Trace t = train_trace(dir.path.string(), " --bucket-kb " + std::to_string(kBucketKb), sync);
    int overlapped = 0;
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      const int comm = 2 + r;
      CHECK(t.lanes[r] == "sim:" + std::to_string(r));
      CHECK(t.lanes[comm] == "sim:" + std::to_string(r) + " comm");
      CHECK(t.order[comm] == t.order[r] + 1);  // right below its device
      for (int64_t s = 0; s < kSteps; ++s) {
        CAPTURE(s);
        std::map<std::string, json> phases = step_spans(t, r, s), comms = step_spans(t, comm, s);
        REQUIRE(phases.count("load"));
        REQUIRE(phases.count("backward"));
        REQUIRE(phases.count(collective));
        REQUIRE(phases.count("optimizer"));
        REQUIRE(comms.size() == buckets.size());
        double prev_end = 0;
        for (size_t b = 0; b < buckets.size(); ++b) {
          CAPTURE(b);
          const json& e = comms[collective + " bucket " + std::to_string(b)];
          REQUIRE(e.is_object());
          CHECK(e["args"]["bucket"] == b);
          CHECK(e["args"]["bytes"] == buckets[b].count * 4);
          CHECK(e["args"]["layers"] == buckets[b].layers);
          // Backward hands the bucket over, and the all-reduce (reduce-scatter) phase waits for it.
          CHECK(e["ts"].get<double>() >= phases["backward"]["ts"].get<double>());
          CHECK(end_of(e) <= end_of(phases[collective]) + kRounding);
          CHECK(end_of(e) <= phases["optimizer"]["ts"].get<double>() + kRounding);
          // One communication thread per device: the buckets run one after another, in order.
          CHECK(e["ts"].get<double>() >= prev_end - kRounding);
          prev_end = end_of(e);
        }
        if (comms[collective + " bucket 0"]["ts"].get<double>() < end_of(phases["backward"])) ++overlapped;
      }
      std::map<std::string, json> eval = step_spans(t, r, kSteps);
      REQUIRE(eval.count("evaluate"));
      CHECK(eval["evaluate"]["args"]["images"] == kTest / 2);
      CHECK(eval["evaluate"]["ts"].get<double>() >= end_of(step_spans(t, r, kSteps - 1)["optimizer"]) - kRounding);
    }
    // The overlap itself is likely but not guaranteed: bucket 0 is handed over while the conv layers'
    // backward still runs, yet on a loaded machine the communication thread may not get a core until
    // backward is done. Reported, not required (it held in 6 of 6 steps in every run at a load of 8 on
    // 2 cores).
    WARN_MESSAGE(overlapped > 0,
                 "no bucket " << collective << " started before its backward ended, in " << 2 * kSteps << " steps");
  }
}

TEST_CASE("trace: without --bucket-kb the all-reduce is one phase span, and there is no comm lane") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 4 * kBatch, kTest);
  Trace t = train_trace(dir.path.string(), "");
  for (auto& [tid, name] : t.lanes) CHECK(name.find("comm") == std::string::npos);
  int all_reduces = 0, evaluates = 0, epochs = 0, load_waits = 0;
  for (const json& e : t.spans) {
    CHECK(e["name"].get<std::string>().find("bucket") == std::string::npos);
    if (t.lanes.at(e["tid"].get<int>()) == "host" && e["name"] == "load wait") {  // the trainer's, one a step
      CHECK(e["args"]["step"] == ++load_waits);
      continue;
    }
    if (t.lanes.at(e["tid"].get<int>()) == "host") {  // the trainer's epoch spans, on the host lane
      CHECK(e["name"] == "epoch " + std::to_string(++epochs));
      CHECK(e["args"]["steps"].get<int>() > 0);
      continue;
    }
    CHECK(e["tid"].get<int>() < 2);
    all_reduces += e["name"] == "all-reduce";
    evaluates += e["name"] == "evaluate";
  }
  CHECK(all_reduces == 2 * kSteps);
  CHECK(evaluates == 2);
  CHECK(epochs == 1);  // 3 steps of the 4 an epoch has
  CHECK(load_waits == kSteps);
}

TEST_CASE("trace: trace_json shifts every ts by the offset, and host spans get a lane of their own") {
  auto devs = dp::test::make_test_devices("cpu", 2);
  const ModelSpec spec = make_model("lenet");
  Engine e(raw(devs), spec, bucketed(16, true));
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 1, init.data());
  e.set_params(init);
  const std::vector<float> x = dp::test::random_floats(16 * 784, 3);
  const std::vector<int32_t> y(16, 4);
  const double t0 = e.recorder().now_us();
  for (int s = 0; s < 2; ++s) e.step(x.data(), y.data(), 16);
  e.evaluate(x.data(), y.data(), 10);
  e.recorder().host_span("epoch 1", t0, e.recorder().now_us(), {{"images", 32}});
  const double now = e.recorder().now_us();  // the engine's clock: since start_time()
  CHECK(
      now <=
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - e.recorder().start_time()).count());
  for (int r = 0; r < 2; ++r) {
    CHECK(e.recorder().bucket_spans()[r].size() == 2 * e.buckets().size());
    REQUIRE(e.recorder().eval_spans()[r].size() == 1);
    CHECK(e.recorder().eval_spans()[r][0].images == 5);
  }

  const double offset = 1500.25;
  json plain = trace_json(e), shifted = trace_json(e, offset);
  Trace t = parse(shifted);
  CHECK(t.lanes[4] == "host");
  CHECK(t.order[4] > t.order[3]);
  REQUIRE(plain["traceEvents"].size() == shifted["traceEvents"].size());
  int host = 0;
  for (size_t i = 0; i < plain["traceEvents"].size(); ++i) {
    json a = plain["traceEvents"][i], b = shifted["traceEvents"][i];
    if (a["ph"] == "X") {
      CHECK(b["ts"].get<double>() == a["ts"].get<double>() + offset);
      b["ts"] = a["ts"];
    }
    CHECK(a == b);  // nothing else moves
    if (a["tid"] == 4 && a["ph"] == "X") {
      ++host;
      CHECK(a["name"] == "epoch 1");
      CHECK(a["args"]["images"] == 32);
      CHECK(a["ts"].get<double>() == t0);
    }
  }
  CHECK(host == 1);

  e.recorder().reset_timing();  // dp_bench compare drops its warm-up steps this way
  CHECK(parse(trace_json(e)).spans.empty());
}

TEST_CASE("trace: without --trace the engine keeps no spans") {
  auto devs = dp::test::make_test_devices("cpu", 2);
  Engine e(raw(devs), make_model("lenet"), bucketed(8, false));
  const std::vector<float> x = dp::test::random_floats(8 * 784, 5);
  const std::vector<int32_t> y(8, 1);
  e.step(x.data(), y.data(), 8);
  e.evaluate(x.data(), y.data(), 8);
  e.recorder().host_span("epoch 1", 0, e.recorder().now_us());
  for (int r = 0; r < 2; ++r) {
    CHECK(e.recorder().spans()[r].empty());
    CHECK(e.recorder().bucket_spans()[r].empty());
    CHECK(e.recorder().eval_spans()[r].empty());
  }
  CHECK(e.recorder().host_spans().empty());
}

TEST_CASE("trace: without phase timing a step marks nothing on the device and trains the same bits") {
  // dp_train times the phases only for --log and --trace (EngineConfig::time_phases): on CUDA some
  // sixteen events a step otherwise. Timed or not, the same steps; untimed, no phase has a second.
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 6, init.data());
  Batches data = make_batches(3, 12, 8);
  std::vector<std::vector<float>> params;
  for (bool timed : {true, false}) {
    CAPTURE(timed);
    EngineConfig c;
    c.batch = 12, c.sync = "allreduce", c.time_phases = timed;
    auto devs = make_test_devices("cpu", 2);
    Engine e(raw(devs), spec, c);
    e.set_params(init);
    for (int s = 0; s < 3; ++s) e.step(data.x[size_t(s)].data(), data.y[size_t(s)].data(), 12);
    double seconds = 0;
    for (const auto& device : e.recorder().phase_seconds())
      for (double t : device) seconds += t;
    CHECK((seconds > 0) == timed);
    params.push_back(e.params());
  }
  CHECK(params[0] == params[1]);
}
