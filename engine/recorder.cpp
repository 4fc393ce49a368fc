#include "engine/recorder.h"

namespace dp {

Recorder::Recorder(int devices, bool trace, bool timing)
    : trace_(trace),
      timing_(timing || trace),
      t0_(std::chrono::steady_clock::now()),
      phase_seconds_(size_t(devices)),
      host_{std::vector<HostSeconds::PerDevice>(size_t(devices)), 0.0},
      open_phases_(size_t(devices)),
      set_(size_t(devices), 0),
      spans_(size_t(devices)),
      bucket_spans_(size_t(devices)),
      eval_spans_(size_t(devices)),
      step_traffic_(size_t(devices)),
      step_inter_traffic_(size_t(devices)) {}

void Recorder::set_buckets(int buckets) {
  if (trace_) bucket_timing_.assign(phase_seconds_.size(), std::vector<Interval>(size_t(buckets)));
}

void Recorder::phase(Device& dev, int rank, Phase p, const std::function<void()>& work) {
  if (!timing_) return work();
  const int start = dev.mark();
  work();
  marking(rank).push_back({p, start, dev.mark()});
}

void Recorder::begin_step(Device& dev, int rank, int set) {
  dev.clear_marks(set);  // also after a failed step, which left its marks behind
  set_[size_t(rank)] = set;
  marking(rank).clear();
}

void Recorder::close_phases(Device& dev, int rank, int set, int64_t step) {
  for (const OpenPhase& o : open_phases_[size_t(rank)][size_t(set)]) {
    const auto start = dev.mark_time(set, o.start), end = dev.mark_time(set, o.end);
    phase_seconds_[size_t(rank)][int(o.phase)] += std::chrono::duration<double>(end - start).count();
    if (trace_) spans_[size_t(rank)].push_back({o.phase, step, us(start), us(end)});
  }
}

void Recorder::close_buckets(int rank, int64_t step) {
  if (!trace_) return;
  std::vector<Interval>& timing = bucket_timing_[size_t(rank)];
  for (size_t b = 0; b < timing.size(); ++b) {
    Interval& t = timing[b];
    if (t.end != std::chrono::steady_clock::time_point{})
      bucket_spans_[size_t(rank)].push_back({step, int(b), us(t.start), us(t.end)});
    t = {};
  }
}

void Recorder::evaluation(int rank, int64_t step, int images, double start_us) {
  if (trace_) eval_spans_[size_t(rank)].push_back({step, images, start_us, now_us()});
}

void Recorder::host_span(std::string name, double start_us, double end_us,
                         std::vector<std::pair<std::string, double>> args) {
  if (trace_) host_spans_.push_back({std::move(name), start_us, end_us, std::move(args)});
}

void Recorder::reset_timing() {
  for (auto& p : phase_seconds_) p = {};
  for (auto& d : host_.device) d = {};
  host_.in_step = 0;
  for (auto& s : spans_) s.clear();
  for (auto& s : bucket_spans_) s.clear();
  for (auto& s : eval_spans_) s.clear();
  host_spans_.clear();
}

std::vector<std::pair<Traffic, Traffic>> Recorder::before(const Communicator& comm) const {
  std::vector<std::pair<Traffic, Traffic>> t;
  for (int r = 0; r < int(step_traffic_.size()); ++r) t.emplace_back(comm.total(r), comm.inter_process(r));
  return t;
}

void Recorder::after(const Communicator& comm, const std::vector<std::pair<Traffic, Traffic>>& before, bool full) {
  if (!full) return;
  for (int r = 0; r < int(step_traffic_.size()); ++r) {
    const Traffic t = comm.total(r), i = comm.inter_process(r);
    const auto& [t0, i0] = before[size_t(r)];
    step_traffic_[size_t(r)] = {t.sent - t0.sent, t.received - t0.received};
    step_inter_traffic_[size_t(r)] = {i.sent - i0.sent, i.received - i0.received};
  }
}

}  // namespace dp
