// Linked instead of kernels/cuda/ when dp is built without CUDA: the probe reports why there are no
// CUDA devices, and the communicator is the peer ring for every device set (across processes, the
// hierarchical ring over MPI).
#include "engine/communicator.h"
#include "engine/error.h"
#include "engine/process_communicator.h"

namespace dp {

bool cuda_built() { return false; }

CudaProbe probe_cuda() { return {0, "this build of dp has no CUDA backend (DP_CUDA=OFF)"}; }

std::unique_ptr<Device> make_cuda_device(int, int id, int64_t) {
  throw UsageError("device " + std::to_string(id) +
                   ": this build of dp has no CUDA backend; rebuild with -DDP_CUDA=ON");
}

std::unique_ptr<Communicator> make_communicator(std::vector<Device*> devices) {
  return std::make_unique<Communicator>(std::move(devices));
}

std::unique_ptr<Communicator> make_process_communicator(std::vector<Device*> devices, ProcessGroup& group) {
  return std::make_unique<ProcessCommunicator>(std::move(devices), group);
}

}  // namespace dp
