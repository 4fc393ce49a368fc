#include "engine/trace.h"

#include <algorithm>
#include <string>

namespace dp {
namespace {

// Builds the event list lane by lane; every lane is named and given its place in the view.
class TraceBuilder {
 public:
  explicit TraceBuilder(double offset_us) : offset_us_(offset_us) {}

  void process(const std::string& name) {
    meta_.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", name}}}});
  }
  void lane(int tid, const std::string& name, int sort_index) {
    meta_.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", tid}, {"args", {{"name", name}}}});
    meta_.push_back(
        {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", tid}, {"args", {{"sort_index", sort_index}}}});
  }
  void span(const std::string& name, const char* cat, int tid, double start_us, double end_us, nlohmann::json args) {
    spans_.push_back({{"name", name},
                      {"cat", cat},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", tid},
                      {"ts", start_us + offset_us_},
                      {"dur", end_us - start_us},
                      {"args", std::move(args)}});
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
  nlohmann::json meta_ = nlohmann::json::array();
  std::vector<nlohmann::json> spans_;
};

void device_lanes(Engine& e, int r, TraceBuilder& t) {
  const int n = e.size();
  t.lane(r, e.device(r).name(), 2 * r);
  for (const Span& s : e.spans()[r])
    t.span(phase_name(s.phase, e.config().sync), "phase", r, s.start_us, s.end_us, {{"step", s.step}});
  for (const EvalSpan& s : e.eval_spans()[r])
    t.span("evaluate", "evaluate", r, s.start_us, s.end_us, {{"step", s.step}, {"images", s.images}});
  if (e.buckets().empty()) return;  // one all-reduce after backward: the device lane's "all-reduce"
  t.lane(n + r, e.device(r).name() + " comm", 2 * r + 1);
  for (const BucketSpan& s : e.bucket_spans()[r]) {
    const Bucket& b = e.buckets()[size_t(s.bucket)];
    t.span("all-reduce bucket " + std::to_string(s.bucket), "all-reduce", n + r, s.start_us, s.end_us,
           {{"step", s.step}, {"bucket", s.bucket}, {"bytes", b.count * int64_t(sizeof(float))}, {"layers", b.layers}});
  }
}

}  // namespace

nlohmann::json trace_json(Engine& e, double offset_us) {
  TraceBuilder t(offset_us);
  t.process(
      std::string("dp ") + sync_name(e.config().sync) +
      (e.config().sync == Sync::allreduce ? std::string(" (") + all_reduce_name(e.config().all_reduce) + ")" : ""));
  for (int r = 0; r < e.size(); ++r) device_lanes(e, r, t);
  if (!e.host_spans().empty()) {
    const int host = 2 * e.size();
    t.lane(host, "host", host);
    for (const HostSpan& s : e.host_spans()) {
      nlohmann::json args = nlohmann::json::object();
      for (const auto& [key, value] : s.args) args[key] = value;
      t.span(s.name, "host", host, s.start_us, s.end_us, std::move(args));
    }
  }
  return t.finish();
}

}  // namespace dp
