// Linked instead of engine/mpi/ when dp is built without MPI (DP_MPI=OFF, or no MPI found): a process
// an MPI launcher started is told how to get a build that joins the others.
#include "engine/error.h"
#include "engine/process_group.h"

namespace dp {

bool mpi_built() { return false; }

std::unique_ptr<ProcessGroup> join_process_group() {
  throw UsageError(
      "this process was started by an MPI launcher, but this build of dp has no MPI backend; install OpenMPI "
      "(apt-get install libopenmpi-dev openmpi-bin) and rebuild with -DDP_MPI=ON");
}

}  // namespace dp
