#include "train/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "engine/ledger.h"
#include "train/parse.h"

namespace dp {

namespace {

// The first number in a file ("max" and unreadable files: -1).
int64_t read_number(const std::string& path) {
  std::ifstream f(path);
  int64_t v = -1;
  if (!(f >> v)) return -1;
  return v;
}

}  // namespace

// 80%: the ledger counts buffers, not the heap's overhead, the threads' stacks or the program, and
// the estimate is a line through two measured points; a run that needs the last fifth of the
// machine is one to ask about first.
int64_t HostMemory::bound() const { return available / 5 * 4; }

std::string HostMemory::describe() const {
  return "80% of the " + format_bytes(available) + " available (" + source + ")";
}

HostMemory host_memory() {
  HostMemory m;
  if (const char* env = std::getenv("DP_BENCH_MEM_AVAILABLE"); env && *env) {
    m.available = parse_bytes(env, "DP_BENCH_MEM_AVAILABLE");
    m.source = "$DP_BENCH_MEM_AVAILABLE";
    return m;
  }
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream(line.substr(13)) >> m.available;
      m.available *= 1024;  // kB
      m.source = "MemAvailable in /proc/meminfo";
    }
  if (m.available <= 0) {
    m.available = int64_t(sysconf(_SC_AVPHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
    m.source = "free pages, sysconf";
  }
  // In a container the cgroup's limit comes first: the kernel kills the run there.
  const int64_t limit = read_number("/sys/fs/cgroup/memory.max"), used = read_number("/sys/fs/cgroup/memory.current");
  if (limit > 0 && used >= 0 && limit - used < m.available) {
    m.available = std::max<int64_t>(0, limit - used);
    m.source = "the cgroup's memory.max less memory.current";
  }
  return m;
}

}  // namespace dp
