// The failpoints of the test build (engine/failpoint.h): armed by the tests' own calls
// (failpoints.h) and, in a dp_train a test starts, from its environment. Linked into dp_tests and
// dp_train_failpoints only; a release binary links engine/failpoint/none.cpp instead.
#include "tests/failpoint/failpoints.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "engine/wait.h"

namespace dp::failpoint {
namespace {

// Everything armed, by the object it is armed on. Objects die and their addresses come back, so
// every entry is one-shot (consumed when it fires) or scoped (SlowDevices).
struct Armed {
  std::mutex m;
  std::map<const Device*, std::string> faults;
  std::map<std::pair<DelayPoint, const Device*>, std::chrono::milliseconds> delays;  // SlowDevices
  std::map<std::pair<const Communicator*, int>, Collective> stalls;
  std::set<const Communicator*> stalled_processes;  // DP_TEST_STALL_RANK fires once per communicator
  std::atomic<bool> nccl_always{false};
};
Armed& armed() {
  static Armed* a = new Armed;  // lives for the process: a hook may fire until _exit
  return *a;
}

// The delay SlowDevices armed for `dev` at `point`, else `otherwise`.
std::chrono::milliseconds armed_delay(DelayPoint point, const Device& dev, std::chrono::milliseconds otherwise) {
  std::lock_guard<std::mutex> lock(armed().m);
  auto it = armed().delays.find({point, &dev});
  return it == armed().delays.end() ? otherwise : it->second;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// A non-negative number of at most six digits, or -1.
int small_number(const std::string& s) {
  if (s.empty() || s.size() > 6 || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(s);
}

// DP_TEST_AT="point:action,...": raise a signal at this process (SIGINT, SIGTERM, SIGHUP), hang for
// good (after a line on stderr), fail as a refused write does (IoError) or sleep N milliseconds
// (sleepN: a slow host between steps) the first time the run reaches `point`.
constexpr int kHang = 0, kFail = -1, kSleep = -2;
struct AtHook {
  std::string point;
  int action = kHang;  // a signal number, kHang, kFail or kSleep
  int sleep_ms = 0;
  bool fired = false;
};

std::vector<AtHook> parse_at(const std::string& spec) {
  std::vector<AtHook> hooks;
  for (size_t at = 0; at < spec.size();) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, comma - at);
    const size_t colon = item.find(':');
    const std::string action = colon == std::string::npos ? "" : item.substr(colon + 1);
    AtHook hook{item.substr(0, colon)};
    if (action == "SIGINT" || action == "SIGTERM" || action == "SIGHUP")
      hook.action = action == "SIGINT" ? SIGINT : action == "SIGTERM" ? SIGTERM : SIGHUP;
    else if (action == "fail")
      hook.action = kFail;
    else if (const int ms = action.starts_with("sleep") ? small_number(action.substr(5)) : -1; ms >= 0)
      hook.action = kSleep, hook.sleep_ms = ms;
    else if (action != "hang")
      throw UsageError("DP_TEST_AT=" + spec + ": " + item + " is not point:SIGINT|SIGTERM|SIGHUP|hang|fail|sleepN");
    hooks.push_back(hook);
    at = comma + 1;
  }
  return hooks;
}

}  // namespace

void at(const char* point, int64_t n) {
  static std::vector<AtHook>* const hooks = new std::vector<AtHook>(parse_at(env("DP_TEST_AT")));
  if (hooks->empty()) return;
  const std::string name = n >= 0 ? std::string(point) + "-" + std::to_string(n) : std::string(point);
  std::vector<AtHook> fired;
  {
    std::lock_guard<std::mutex> lock(armed().m);
    for (AtHook& hook : *hooks)
      if (!hook.fired && hook.point == name) hook.fired = true, fired.push_back(hook);
  }
  for (const AtHook& hook : fired) {
    if (hook.action == kFail) throw IoError("DP_TEST_AT: " + name + ": the write failed on purpose");
    if (hook.action == kSleep) {
      std::this_thread::sleep_for(std::chrono::milliseconds(hook.sleep_ms));
      continue;
    }
    if (hook.action != kHang) {
      std::raise(hook.action);
      continue;
    }
    std::fprintf(stderr, "dp_train: DP_TEST_AT: hanging at %s\n", name.c_str());
    std::fflush(stderr);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

void inject_fault(const Device& dev, std::string what) {
  std::lock_guard<std::mutex> lock(armed().m);
  armed().faults[&dev] = std::move(what);
}

void device_call(const Device& dev, const char* where) {
  std::string what;
  {
    std::lock_guard<std::mutex> lock(armed().m);
    auto it = armed().faults.find(&dev);
    if (it == armed().faults.end()) return;
    what = std::move(it->second);
    armed().faults.erase(it);
  }
  throw DeviceError(dev.id(), std::string("injected fault in ") + where + ": " + what);
}

SlowDevices::SlowDevices(DelayPoint point, const std::vector<Device*>& devices, std::chrono::milliseconds delay)
    : point_(point), devices_(devices.begin(), devices.end()) {
  std::lock_guard<std::mutex> lock(armed().m);
  for (const Device* d : devices_) armed().delays[{point_, d}] = delay;
}

SlowDevices::~SlowDevices() {
  std::lock_guard<std::mutex> lock(armed().m);
  for (const Device* d : devices_) armed().delays.erase({point_, d});
}

std::chrono::milliseconds step_end_delay(const Device& dev) {
  return armed_delay(DelayPoint::step_end, dev, std::chrono::milliseconds(0));
}

std::chrono::milliseconds peer_copy_delay(const Device& dev) {
  return armed_delay(DelayPoint::peer_copy, dev, std::chrono::milliseconds(0));
}

std::chrono::milliseconds upload_delay(const Device& dev) {
  // DP_TEST_SLOW_UPLOADS=<ms>: every device of a dp_train the tests start, as SlowUploads arms some
  static const int every = [] {
    const std::string v = env("DP_TEST_SLOW_UPLOADS");
    if (!v.empty() && small_number(v) < 0)
      throw UsageError("DP_TEST_SLOW_UPLOADS=" + v + ": not a number of milliseconds (0 to 999999)");
    return v.empty() ? 0 : small_number(v);
  }();
  return armed_delay(DelayPoint::upload, dev, std::chrono::milliseconds(every));
}

bool nccl_always() {
  static const bool from_env = [] {
    const std::string v = env("DP_TEST_NCCL");
    if (!v.empty() && v != "always") throw UsageError("DP_TEST_NCCL=" + v + ": the one value is 'always'");
    return v == "always";
  }();
  return from_env || armed().nccl_always.load();
}

NcclAlways::NcclAlways() { armed().nccl_always.store(true); }
NcclAlways::~NcclAlways() { armed().nccl_always.store(false); }

void stall_once(const Communicator& comm, int rank, Collective c) {
  std::lock_guard<std::mutex> lock(armed().m);
  armed().stalls[{&comm, rank}] = c;
}

// DP_TEST_STALL=<collective>:<rank> arms a stall on every communicator built (dp_train's end-to-end
// tests). A rank past this communicator's size never enters it (--verify's one-device engine), so it
// is no error.
void communicator_built(const Communicator& comm) {
  const std::string spec = env("DP_TEST_STALL");
  {
    std::lock_guard<std::mutex> lock(armed().m);  // a new communicator at an old one's address
    for (int r = 0; r < comm.size(); ++r) armed().stalls.erase({&comm, r});
    armed().stalled_processes.erase(&comm);
  }
  if (spec.empty()) return;
  const size_t colon = spec.find(':');
  int c = 0;
  while (c < kCollectives && spec.substr(0, colon) != collective_name(Collective(c))) ++c;
  const int rank = colon == std::string::npos ? -1 : small_number(spec.substr(colon + 1));
  if (c == kCollectives || rank < 0)
    throw UsageError("DP_TEST_STALL=" + spec +
                     ": give <collective>:<rank>, e.g. all_reduce:1 (collectives: scatter, gather, broadcast, "
                     "reduce, all_reduce, reduce_scatter, all_gather)");
  if (rank < comm.size()) stall_once(comm, rank, Collective(c));
}

void collective(const Communicator& comm, int rank, Collective c, const std::function<bool()>& aborted,
                double timeout) {
  {
    std::lock_guard<std::mutex> lock(armed().m);
    auto it = armed().stalls.find({&comm, rank});
    if (it == armed().stalls.end() || it->second != c) return;
    armed().stalls.erase(it);
  }
  // Bounded too, at twice the timeout: the peers' own deadline passes first and they abort.
  const Device& dev = comm.device(rank);
  poll_until([] { return false; }, aborted, Deadline::after(2 * timeout + 1), dev.id(),
             [&] { return std::string("the test stall in ") + collective_name(c) + " on " + dev.name(); });
}

// DP_TEST_STALL_RANK=<process rank>: that process stops answering at its first all-reduce across
// processes (its device 0 sleeps for twice the timeout), so that the others' --timeout trips.
void across_processes(const Communicator& comm, int process, int rank, double timeout) {
  const std::string spec = env("DP_TEST_STALL_RANK");
  if (spec.empty() || rank != 0) return;
  const int stalled = small_number(spec);
  if (stalled < 0) throw UsageError("DP_TEST_STALL_RANK=" + spec + ": give a process rank, e.g. 1");
  if (process != stalled) return;
  {
    std::lock_guard<std::mutex> lock(armed().m);
    if (!armed().stalled_processes.insert(&comm).second) return;
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(2 * timeout + 1));
}

// DP_TEST_VERIFY_OFFSET=<x> moves --verify's reference's first weight by x before the comparison.
double verify_offset() {
  const std::string v = env("DP_TEST_VERIFY_OFFSET");
  if (v.empty()) return 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (*end != '\0' || !std::isfinite(x))
    throw UsageError("DP_TEST_VERIFY_OFFSET=" + v + ": give a finite number, e.g. 0.5");
  return x;
}

int64_t recorded_bytes(int process, int64_t step, int64_t bytes) {
  static const std::pair<int, int64_t> armed = [] {
    const std::string v = env("DP_TEST_DESYNC");
    if (v.empty()) return std::pair<int, int64_t>{-1, -1};
    const size_t colon = v.find(':');
    const int p = small_number(v.substr(0, colon)),
              s = colon == std::string::npos ? -1 : small_number(v.substr(colon + 1));
    if (p < 0 || s < 1) throw UsageError("DP_TEST_DESYNC=" + v + ": give <process>:<step>, e.g. 1:3");
    return std::pair<int, int64_t>{p, s};
  }();
  static std::atomic<bool> fired{false};
  if (process != armed.first || step != armed.second || fired.exchange(true)) return bytes;
  return bytes + 4;
}

}  // namespace dp::failpoint
