#include "engine/process_group.h"

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "engine/error.h"

namespace dp {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"})
    if (const char* s = std::getenv(v); s && *s) return true;
  return false;
}

std::unique_ptr<ProcessGroup> join_if_launched(const char* program) {
  if (!launched_by_mpi()) return nullptr;
  std::unique_ptr<ProcessGroup> group;
  try {
    group = join_process_group();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    std::exit(2);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: could not join the other processes: %s\n", program, e.what());
    std::exit(1);
  }
  if (group->rank() != 0 && !std::freopen("/dev/null", "w", stdout)) {
    std::fprintf(stderr, "%s: %s: error: cannot silence stdout\n", group->who().c_str(), program);
    group->abort(1);
  }
  return group;
}

std::string ProcessGroup::who(int rank) const {
  const std::string host = size_t(rank) < hosts_.size() ? hosts_[size_t(rank)] : host_;
  return "rank " + std::to_string(rank) + " (" + host + ")";
}

}  // namespace dp
