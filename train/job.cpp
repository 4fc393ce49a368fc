#include "train/job.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "engine/ledger.h"  // commas
#include "train/report.h"

namespace dp {

void print_world(const ProcessGroup& g, int local_devices) {
  std::vector<std::pair<std::string, int>> hosts;  // in rank order, with their process counts
  for (const std::string& h : g.hosts()) {
    auto it = std::find_if(hosts.begin(), hosts.end(), [&](const auto& e) { return e.first == h; });
    if (it == hosts.end())
      hosts.push_back({h, 1});
    else
      ++it->second;
  }
  std::string where;
  for (const auto& [host, n] : hosts)
    where += (where.empty() ? "" : ", ") + host + " (" + std::to_string(n) + (n == 1 ? " process)" : " processes)");
  std::printf("job: %d processes x %d device%s = %d replicas, on host%s %s\n", g.size(), local_devices,
              local_devices == 1 ? "" : "s", g.size() * local_devices, hosts.size() == 1 ? "" : "s", where.c_str());
}

void check_job_options(const TrainOptions& o, int processes) {
  const std::string across = " across processes (mpirun -np " + std::to_string(processes) + ")";
  if (o.eval) throw UsageError("--eval" + across + ": evaluate in one process (dp_train --eval --load FILE)");
  if (const char* why = find_strategy(o.sync).one_process_only())
    throw UsageError(
        "--sync " + o.sync + across + ": " + why +
        "; across processes use --sync allreduce (as DDP and Horovod do) or a ZeRO stage (zero1, zero2, zero3)");
  if (o.run_ahead.value_or(false))
    throw UsageError("--run-ahead" + across +
                     ": the processes agree on every step's loss and on any signal before the next step; drop "
                     "--run-ahead");
  if (o.all_reduce != AllReduceAlgorithm::ring)
    throw UsageError("--allreduce naive" + across +
                     ": not supported; the ring is (NCCL's over every GPU of every process on GPUs, the hierarchical "
                     "ring over MPI on simulated devices): drop --allreduce");
}

void refuse_together(ProcessGroup& g, double timeout, const std::function<void()>& check) {
  std::string mine;
  try {
    check();
  } catch (const UsageError& e) {
    mine = e.what();
    if (mine.empty()) mine = "refused";
  }
  const std::vector<std::string> all =
      g.all_gather(mine, Deadline::after(timeout), "the start-up check of the options");
  if (std::all_of(all.begin(), all.end(), [](const std::string& s) { return s.empty(); })) return;
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) throw JobMismatch(all[0]);
  std::string msg;
  for (int r = 0; r < g.size(); ++r)
    if (!all[size_t(r)].empty())
      msg += (msg.empty() ? "" : "; ") + g.who(r) + " refuses its options: " + all[size_t(r)];
  throw JobMismatch(msg +
                    " (the other processes accepted their options: start every process with the same options; "
                    "mpirun runs one command line)");
}

void check_agreement(ProcessGroup& g, const Settings& mine, double timeout) {
  std::string line;
  for (const auto& [k, v] : mine) line += k + "=" + v + "\n";
  const std::vector<std::string> all = g.all_gather(line, Deadline::after(timeout), "the start-up check");
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) return;
  // Parsed back: every rank's value of each of rank 0's settings.
  auto value = [](const std::string& text, const std::string& key) {
    for (size_t p = 0; p < text.size();) {
      const size_t end = text.find('\n', p);
      if (text.compare(p, key.size() + 1, key + "=") == 0)
        return text.substr(p + key.size() + 1, end - p - key.size() - 1);
      p = end + 1;
    }
    return std::string("(none)");
  };
  std::string msg;
  for (const auto& [k, v0] : mine) {
    const std::string ref = value(all[0], k);
    bool same = true;
    for (const std::string& s : all) same = same && value(s, k) == ref;
    if (same) continue;
    msg += (msg.empty() ? "" : "; ") + k + ":";
    for (int r = 0; r < g.size(); ++r) msg += (r ? ", " : " ") + g.who(r) + " has " + value(all[size_t(r)], k);
  }
  throw JobMismatch("the processes of this job disagree: " + msg +
                    ". Start every process with the same options and data (mpirun runs one command line)");
}

namespace {

void broadcast_floats(ProcessGroup& g, std::vector<float>& v, double timeout, const char* what) {
  double n = double(v.size());
  g.broadcast(kHostChannel, &n, sizeof n, 0, Deadline::after(timeout), what, nullptr);
  v.resize(size_t(n));
  if (!v.empty())
    g.broadcast(kHostChannel, v.data(), int64_t(v.size() * sizeof(float)), 0, Deadline::after(timeout), what, nullptr);
}

// FNV-1a, 64 bits, over the bytes of a replica's weights.
std::string fnv1a(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", (unsigned long long)h);
  return s;
}

// Rank 0's string into every process's.
std::string broadcast_string(ProcessGroup& g, std::string s, double timeout, const std::string& what) {
  int64_t n = int64_t(s.size());
  g.broadcast(kHostChannel, &n, sizeof n, 0, Deadline::after(timeout), what, nullptr);
  s.resize(size_t(n));
  if (n > 0) g.broadcast(kHostChannel, s.data(), n, 0, Deadline::after(timeout), what, nullptr);
  return s;
}

}  // namespace

void on_rank0(ProcessGroup& g, double timeout, const std::string& what, const std::function<void()>& read) {
  // "ok", or "error " and the refusal (plain bytes: a path need not be UTF-8).
  std::string status = "ok";
  if (g.rank() == 0) try {
      read();
    } catch (const UsageError& e) {
      status = std::string("error ") + e.what();
    }
  status = broadcast_string(g, status, timeout, what);
  if (status.rfind("error ", 0) == 0) throw JobMismatch(status.substr(6));
}

Resumed resume_on_rank0(ProcessGroup& g, const TrainOptions& o, const ModelSpec& spec, const RunIdentity& id) {
  Resumed r;  // a warning on an exact-only difference: rank 0's stderr alone
  on_rank0(g, o.timeout, "rank 0's reading of --resume", [&] { r = resume_checkpoint(o, spec, id); });
  g.broadcast(kHostChannel, &r.global_step, sizeof r.global_step, 0, Deadline::after(o.timeout),
              "the broadcast of rank 0's resumed step", nullptr);
  return r;
}

void broadcast_verify(ProcessGroup& g, VerifyResult& v, double timeout) {
  double f[4] = {double(v.steps), v.max_diff, v.tolerance, v.ok ? 1.0 : 0.0};
  g.broadcast(kHostChannel, f, sizeof f, 0, Deadline::after(timeout), "the broadcast of rank 0's --verify", nullptr);
  v.steps = int64_t(f[0]), v.max_diff = f[1], v.tolerance = f[2], v.ok = f[3] != 0;
}

void broadcast_state(ProcessGroup& g, Checkpoint& state, double timeout) {
  broadcast_floats(g, state.params, timeout, "the broadcast of rank 0's weights");
  // The optimizer's state by name: how many, then each name and its values.
  double states = double(state.optimizer_state.size());
  g.broadcast(kHostChannel, &states, sizeof states, 0, Deadline::after(timeout), "the broadcast of rank 0's optimizer",
              nullptr);
  std::vector<std::string> names;
  for (const auto& [name, values] : state.optimizer_state) names.push_back(name);
  names.resize(size_t(states));
  for (std::string& name : names) {
    name = broadcast_string(g, name, timeout, "the broadcast of rank 0's optimizer");
    broadcast_floats(g, state.optimizer_state[name], timeout, "the broadcast of rank 0's optimizer state");
  }
  g.broadcast(kHostChannel, &state.optimizer_steps, sizeof state.optimizer_steps, 0, Deadline::after(timeout),
              "the broadcast of rank 0's optimizer steps", nullptr);
  broadcast_floats(g, state.buffers, timeout, "the broadcast of rank 0's running statistics");
  g.broadcast(kHostChannel, &state.batches_tracked, sizeof state.batches_tracked, 0, Deadline::after(timeout),
              "the broadcast of rank 0's step count", nullptr);
}

namespace {

// A process's collectives of the step (FlightRecorder::take_fingerprint's lines), by channel in order.
std::map<int, std::vector<FlightRecord>> by_channel(const std::string& lines) {
  std::map<int, std::vector<FlightRecord>> out;
  for (const FlightRecord& r : from_lines(lines)) out[r.channel].push_back(r);
  return out;
}

// "all_reduce #4 of 258,136 B"; "nothing" where a process ran none.
std::string collective(const FlightRecord* r) {
  return r ? r->kind + " #" + std::to_string(r->seq) + " of " + commas(r->bytes) + " B" : "nothing";
}

// The fingerprints differed: every process's collectives of the step gathered, the first that differs
// from rank 0's named. Collective (every process found the difference in the same exchange).
[[noreturn]] void name_desync(ProcessGroup& g, const std::vector<std::string>& mine, int64_t step, double timeout) {
  std::string text;
  for (const std::string& l : mine) text += l + "\n";
  const std::vector<std::string> all = g.all_gather(text, Deadline::after(timeout), "the desync check's records");
  const auto ref = by_channel(all[0]);
  std::string msg = "the processes ran different collectives in step " + std::to_string(step) + ": ";
  for (int r = 1; r < g.size(); ++r) {
    auto theirs = by_channel(all[size_t(r)]);
    for (const auto& [channel, records] : ref) theirs[channel];  // every channel of either side
    for (const auto& [channel, records] : theirs) {
      const std::vector<FlightRecord>& a = ref.count(channel) ? ref.at(channel) : std::vector<FlightRecord>{};
      for (size_t i = 0; i < std::max(a.size(), records.size()); ++i) {
        const FlightRecord *x = i < a.size() ? &a[i] : nullptr, *y = i < records.size() ? &records[i] : nullptr;
        if (x && y && to_line(*x) == to_line(*y)) continue;
        const std::string where = channel < 0 ? "the host channel" : "channel " + std::to_string(channel);
        const std::string path = g.write_flight_record("the processes ran different collectives");
        throw JobDesync(msg + "collective #" + std::to_string(i + 1) + " of the step on " + where + ": " + g.who(0) +
                        " ran " + collective(x) + ", " + g.who(r) + " " + collective(y) +
                        "; each rank's records: " + path.substr(0, path.rfind('/') + 1));
      }
    }
  }
  throw JobDesync(msg + "their fingerprints differ, though the collectives each recorded agree");
}

}  // namespace

int reduce_step(ProcessGroup& g, StepResult& r, int pending_signal, double timeout) {
  double sums[2] = {r.loss, double(r.correct)};
  g.all_reduce_sum(sums, 2, Deadline::after(timeout), "the step's loss across processes");
  // The desync check, folded into the step's exchange: the fingerprint of this process's collectives
  // since the last step (flight_recorder.h) and its negation, whose maxima are equal only where every
  // process's fingerprint is the same.
  std::vector<std::string> lines;
  const double fingerprint = double(g.flight().take_fingerprint(&lines));
  double maxes[4] = {double(pending_signal), r.finite_gradients ? 0.0 : 1.0, fingerprint, -fingerprint};
  g.all_reduce_max(maxes, 4, Deadline::after(timeout), "the step's stop flag and gradient check across processes");
  if (maxes[2] != -maxes[3]) name_desync(g, lines, g.flight().step(), timeout);
  r.loss = sums[0], r.correct = int64_t(sums[1]), r.finite_gradients = maxes[1] == 0;
  return int(maxes[0]);
}

std::pair<int64_t, int64_t> evaluation_slice(const ProcessGroup& g, int64_t n) {
  // As Engine::evaluate splits over its devices: even shares, larger first.
  const std::vector<int> sizes = split_batch(int(n), g.size(), Split::even);
  int64_t lo = 0;
  for (int r = 0; r < g.rank(); ++r) lo += sizes[size_t(r)];
  return {lo, lo + sizes[size_t(g.rank())]};
}

void reduce_evaluation(ProcessGroup& g, StepResult& r, int64_t n, double timeout) {
  double sums[2] = {r.loss * r.n, double(r.correct)};
  g.all_reduce_sum(sums, 2, Deadline::after(timeout), "the evaluation's sums across processes");
  r.n = int(n), r.loss = n > 0 ? sums[0] / double(n) : 0, r.correct = int64_t(sums[1]);
}

nlohmann::json gather_devices(ProcessGroup& g, Engine& engine, double timeout) {
  nlohmann::json mine = device_report(engine);
  for (int r = 0; r < engine.size(); ++r) {
    nlohmann::json& d = mine[size_t(r)];
    const Traffic t = engine.recorder().step_inter_traffic(r);
    d["job_rank"] = engine.first_device() + r;
    d["process"] = g.rank();
    d["host"] = g.host();
    d["inter_process_bytes_sent_per_step"] = t.sent;
    d["inter_process_bytes_received_per_step"] = t.received;
    d["parameters_fnv1a"] = fnv1a(engine.params(r));
  }
  const std::vector<std::string> all = g.all_gather(mine.dump(), Deadline::after(timeout), "the report's devices");
  nlohmann::json devices = nlohmann::json::array();
  for (const std::string& s : all)
    for (auto& d : nlohmann::json::parse(s)) devices.push_back(d);
  for (const auto& d : devices)
    if (d["parameters_fnv1a"] != devices[0]["parameters_fnv1a"])
      throw std::runtime_error("replicas differ after training: " + g.who(d["process"].get<int>()) + "'s " +
                               d["name"].get<std::string>() + " holds other weights than rank 0's " +
                               devices[0]["name"].get<std::string>() + " (a bug in dp: please report it)");
  return devices;
}

}  // namespace dp
