#include "engine/flight_recorder.h"

#include <chrono>
#include <sstream>

#include "engine/ledger.h"  // commas

namespace dp {
namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr size_t kMaxLines = 4096;

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

const char* state_name(FlightRecord::State s) {
  switch (s) {
    case FlightRecord::State::pending:
      return "pending";
    case FlightRecord::State::done:
      return "done";
    case FlightRecord::State::timed_out:
      return "timed out";
    case FlightRecord::State::aborted:
      return "aborted";
  }
  return "?";
}

std::string describe(const FlightRecord& r) {
  return r.kind + " #" + std::to_string(r.seq) + " on " +
         (r.channel < 0 ? std::string("the host channel") : "channel " + std::to_string(r.channel)) + " (" +
         commas(r.bytes) + " B, step " + std::to_string(r.step) + ")";
}

std::string to_line(const FlightRecord& r) {
  return std::to_string(r.channel) + " " + std::to_string(r.seq) + " " + r.kind + " " + std::to_string(r.bytes) + " " +
         std::to_string(r.step);
}

std::vector<FlightRecord> from_lines(const std::string& text) {
  std::istringstream in(text);
  std::vector<FlightRecord> out;
  for (FlightRecord r; in >> r.channel >> r.seq >> r.kind >> r.bytes >> r.step;) out.push_back(r);
  return out;
}

FlightRecorder::FlightRecorder(int capacity) : t0_(seconds_now()) { set_capacity(capacity); }

void FlightRecorder::set_capacity(int capacity) {
  std::lock_guard<std::mutex> lock(m_);
  capacity_ = capacity < 0 ? 0 : capacity;
  ring_.assign(size_t(capacity_), FlightRecord{});
  // The ids start again, the sequence numbers go on; every process sets it at the same point.
  begun_ = 0, fingerprint_ = 0;
  since_.clear();
}

void FlightRecorder::set_step(int64_t step) {
  std::lock_guard<std::mutex> lock(m_);
  step_ = step;
}

double FlightRecorder::now_s() const { return seconds_now() - t0_; }

int64_t FlightRecorder::begin(int channel, const char* kind, int64_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(m_);
  if (capacity_ == 0) return 0;
  FlightRecord r;
  r.id = ++begun_;
  r.seq = ++seq_[channel];
  r.channel = channel, r.kind = kind, r.bytes = bytes, r.step = step_, r.what = what, r.start_s = now_s();
  std::string line = to_line(r);
  fingerprint_ += fnv1a(line);  // a sum: the channels' threads interleave differently on every process
  if (since_.size() < kMaxLines) since_.push_back(std::move(line));  // a step's; more only where none takes them
  ring_[size_t((r.id - 1) % capacity_)] = std::move(r);
  return begun_;
}

void FlightRecorder::end(int64_t id, FlightRecord::State state) {
  std::lock_guard<std::mutex> lock(m_);
  if (id <= 0 || id <= begun_ - capacity_) return;  // off, or overwritten since
  FlightRecord& r = ring_[size_t((id - 1) % capacity_)];
  r.state = state, r.end_s = now_s();
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::lock_guard<std::mutex> lock(m_);
  std::vector<FlightRecord> out;
  for (int64_t id = std::max<int64_t>(1, begun_ - capacity_ + 1); id <= begun_; ++id)
    out.push_back(ring_[size_t((id - 1) % capacity_)]);
  return out;
}

uint64_t FlightRecorder::take_fingerprint(std::vector<std::string>* lines) {
  std::lock_guard<std::mutex> lock(m_);
  const uint64_t f = fingerprint_ & ((uint64_t(1) << 52) - 1);
  if (lines) *lines = std::move(since_);
  since_.clear();
  fingerprint_ = 0;
  return f;
}

nlohmann::json FlightRecorder::json() const {
  nlohmann::json out = nlohmann::json::array();
  for (const FlightRecord& r : records())
    out.push_back({{"id", r.id},
                   {"seq", r.seq},
                   {"channel", r.channel},
                   {"kind", r.kind},
                   {"bytes", r.bytes},
                   {"step", r.step},
                   {"what", r.what},
                   {"start_s", r.start_s},
                   {"end_s", r.end_s < 0 ? nlohmann::json() : nlohmann::json(r.end_s)},
                   {"state", state_name(r.state)}});
  return out;
}

}  // namespace dp
