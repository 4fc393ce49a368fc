#include "train/trace.h"

#include <algorithm>
#include <string>
#include <vector>

namespace dp {
namespace {

// Builds the event list lane by lane; every lane is named and given its place in the view.
class TraceBuilder {
 public:
  // pid: the process the events belong to (the rank across processes; 0 in one process).
  explicit TraceBuilder(double offset_us, int pid = 0) : offset_us_(offset_us), pid_(pid) {}

  void process(const std::string& name) {
    meta_.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid_}, {"args", {{"name", name}}}});
  }
  void process_order(int sort_index) {
    meta_.push_back(
        {{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid_}, {"args", {{"sort_index", sort_index}}}});
  }
  void lane(int tid, const std::string& name, int sort_index) {
    meta_.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid_}, {"tid", tid}, {"args", {{"name", name}}}});
    meta_.push_back({{"name", "thread_sort_index"},
                     {"ph", "M"},
                     {"pid", pid_},
                     {"tid", tid},
                     {"args", {{"sort_index", sort_index}}}});
  }
  void span(const std::string& name, const char* cat, int tid, double start_us, double end_us, nlohmann::json args) {
    spans_.push_back({{"name", name},
                      {"cat", cat},
                      {"ph", "X"},
                      {"pid", pid_},
                      {"tid", tid},
                      {"ts", start_us + offset_us_},
                      {"dur", end_us - start_us},
                      {"args", std::move(args)}});
  }

  // Another builder's finished trace (another rank's), its events kept as they are.
  void merge(const nlohmann::json& trace) {
    for (const nlohmann::json& e : trace.at("traceEvents")) {
      if (e.at("ph") == "M")
        meta_.push_back(e);
      else
        spans_.push_back(e);
    }
  }

  // The metadata, then the spans in time order (a stable sort: a lane's spans that start together
  // stay in the order they were recorded).
  nlohmann::json finish() {
    std::stable_sort(spans_.begin(), spans_.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
      return a["ts"].get<double>() < b["ts"].get<double>();
    });
    nlohmann::json events = std::move(meta_);
    for (auto& s : spans_) events.push_back(std::move(s));
    return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  }

 private:
  double offset_us_;
  int pid_;
  nlohmann::json meta_ = nlohmann::json::array();
  std::vector<nlohmann::json> spans_;
};

// A device's lane: its own name in one process; across processes named by its job rank, which is
// what the report and the messages call it (a simulated device's local index repeats on every rank).
std::string lane_name(Engine& e, int r, bool job) {
  const std::string name = e.device(r).name(), job_rank = std::to_string(e.first_device() + r);
  if (!job) return name;
  return e.device(r).kind() == DeviceKind::simulated ? "sim:" + job_rank : name + " (device " + job_rank + ")";
}

void device_lanes(Engine& e, int r, TraceBuilder& t, bool job) {
  const int n = e.size();
  const std::string name = lane_name(e, r, job);
  t.lane(r, name, 2 * r);
  const Recorder& rec = e.recorder();
  for (const Span& s : rec.spans()[r])
    t.span(e.strategy().phase_name(s.phase), "phase", r, s.start_us, s.end_us, {{"step", s.step}});
  for (const EvalSpan& s : rec.eval_spans()[r])
    t.span("evaluate", "evaluate", r, s.start_us, s.end_us, {{"step", s.step}, {"images", s.images}});
  if (e.buckets().empty()) return;  // one all-reduce after backward: the device lane's "all-reduce"
  t.lane(n + r, name + " comm", 2 * r + 1);
  // The bucket's collective by the strategy's name for its reduction: "all-reduce", "reduce-scatter".
  const std::string collective = e.strategy().phase_name(Phase::reduce);
  for (const BucketSpan& s : rec.bucket_spans()[r]) {
    const Bucket& b = e.buckets()[size_t(s.bucket)];
    t.span(collective + " bucket " + std::to_string(s.bucket), collective.c_str(), n + r, s.start_us, s.end_us,
           {{"step", s.step}, {"bucket", s.bucket}, {"bytes", b.count * int64_t(sizeof(float))}, {"layers", b.layers}});
  }
}

// The engine's lanes and spans; `job`: across processes, where lanes are named by job rank.
void engine_events(Engine& e, TraceBuilder& t, bool job) {
  for (int r = 0; r < e.size(); ++r) device_lanes(e, r, t, job);
  if (!e.recorder().host_spans().empty()) {
    const int host = 2 * e.size();
    t.lane(host, "host", host);
    for (const HostSpan& s : e.recorder().host_spans()) {
      nlohmann::json args = nlohmann::json::object();
      for (const auto& [key, value] : s.args) args[key] = value;
      t.span(s.name, "host", host, s.start_us, s.end_us, std::move(args));
    }
  }
}

}  // namespace

nlohmann::json trace_json(Engine& e, double offset_us) {
  TraceBuilder t(offset_us);
  t.process("dp " + e.strategy().describe(e.config()));
  engine_events(e, t, false);
  return t.finish();
}

double clock_offset_to_rank0(ProcessGroup& g, Engine& e, double timeout) {
  g.barrier(Deadline::after(timeout), "the trace's common instant");
  const double mine = e.recorder().now_us();
  double rank0 = mine;
  g.broadcast(kHostChannel, &rank0, sizeof rank0, 0, Deadline::after(timeout), "the broadcast of rank 0's clock",
              nullptr);
  return rank0 - mine;
}

nlohmann::json job_trace_json(ProcessGroup& g, Engine& e, double offset_us, double timeout) {
  TraceBuilder mine(offset_us, g.rank());
  mine.process(g.who());
  mine.process_order(g.rank());
  engine_events(e, mine, true);
  const std::vector<std::string> all =
      g.all_gather(mine.finish().dump(), Deadline::after(timeout), "the gather of every rank's trace");
  if (g.rank() != 0) return nullptr;
  TraceBuilder job(0);
  for (const std::string& s : all) job.merge(nlohmann::json::parse(s));
  return job.finish();
}

}  // namespace dp
