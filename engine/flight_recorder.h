// The flight recorder of a job's collectives across processes, as PyTorch's NCCL flight recorder
// (TORCH_NCCL_TRACE_BUFFER_SIZE) keeps one: each process remembers its last N collectives (sequence
// number per channel, kind, bytes, the training step, start and end, state) in a ring buffer, and
// writes them as JSON when the job fails (a timeout, a local failure that aborts the job), so that the
// ranks' records side by side (scripts/flight.py) show which collective each was in, and where they
// first differ.
//
// It also gives each step's fingerprint: a sum of a hash of every collective begun since the last
// fingerprint (channel, sequence number, kind, bytes), which the trainer folds into the step's
// exchange across processes (reduce_step): processes whose collectives differ in any of these are
// found at the end of the step they differ in, the cost a hash per collective.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dp {

inline constexpr int kDefaultFlightRecords = 256;  // PyTorch's default is 2000 entries; a LeNet step is ~3

struct FlightRecord {
  enum class State { pending, done, timed_out, aborted };
  int64_t id = 0;   // the process's count of collectives, from 1
  int64_t seq = 0;  // the channel's count, from 1: the same collective has the same seq on every process
  int channel = 0;  // a local device's (0..K-1) or the host's (kHostChannel)
  std::string kind;
  int64_t bytes = 0;
  int64_t step = 0;  // the training step under way (1-based; 0 before the first)
  std::string what;
  double start_s = 0, end_s = -1;  // seconds since the recorder started; end -1 while pending
  State state = State::pending;
};
const char* state_name(FlightRecord::State s);

class FlightRecorder {
 public:
  explicit FlightRecorder(int capacity = kDefaultFlightRecords);
  // 0 turns the recorder off (begin returns 0, nothing is kept, every fingerprint is 0).
  void set_capacity(int capacity);
  int capacity() const { return capacity_; }
  void set_step(int64_t step);
  int64_t step() const {
    std::lock_guard<std::mutex> lock(m_);
    return step_;
  }

  // A collective begins; returns its id (0 when off) for end(). Thread-safe: every device thread calls it.
  int64_t begin(int channel, const char* kind, int64_t bytes, const std::string& what);
  void end(int64_t id, FlightRecord::State state);

  // The kept records, oldest first.
  std::vector<FlightRecord> records() const;
  // The fingerprint of the collectives begun since the last call (0 for none), 52 bits so that a double
  // holds it exactly; and their records, as to_line gives them, for naming a difference.
  uint64_t take_fingerprint(std::vector<std::string>* lines = nullptr);
  nlohmann::json json() const;

 private:
  double now_s() const;

  mutable std::mutex m_;
  int capacity_;
  std::vector<FlightRecord> ring_;  // ring_[(id - 1) % capacity_]
  int64_t begun_ = 0;
  std::map<int, int64_t> seq_;  // per channel
  int64_t step_ = 0;
  uint64_t fingerprint_ = 0;
  std::vector<std::string> since_;  // the lines behind fingerprint_ (to_line)
  double t0_;
};

// "all_reduce #12 on channel 0 (3,072 B, step 4)": how messages name a collective.
std::string describe(const FlightRecord& r);
// A record as a line of text, "channel seq kind bytes step" (what the fingerprint hashes), and the
// records of such lines: what the desync check gathers and the stall inspector sends to the others.
std::string to_line(const FlightRecord& r);
std::vector<FlightRecord> from_lines(const std::string& text);

}  // namespace dp
