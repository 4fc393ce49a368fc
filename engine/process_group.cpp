#include "engine/process_group.h"

#include <cstdlib>

namespace dp {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"})
    if (const char* s = std::getenv(v); s && *s) return true;
  return false;
}

std::string ProcessGroup::who(int rank) const {
  const std::string host = size_t(rank) < hosts_.size() ? hosts_[size_t(rank)] : host_;
  return "rank " + std::to_string(rank) + " (" + host + ")";
}

}  // namespace dp
