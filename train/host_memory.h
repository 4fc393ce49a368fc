// The host memory a run may take, read before it starts: MemAvailable, or the cgroup's limit where
// that is lower (a container's kernel kills the run there). dp_bench sizes its runs by it, and
// dp_train checks that simulated devices' model state fits in it.
#pragma once

#include <cstdint>
#include <string>

namespace dp {

struct HostMemory {
  int64_t available = 0;
  std::string source;            // "MemAvailable in /proc/meminfo", ...
  int64_t bound() const;         // what one run may take: 80% of it
  std::string describe() const;  // "80% of the 21.85 GiB available (MemAvailable ...)"
};
HostMemory host_memory();

}  // namespace dp
