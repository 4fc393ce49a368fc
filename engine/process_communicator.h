// The communicator of one process's devices inside a job of several processes (process_group.h), for
// --sync allreduce and the ZeRO stages on simulated devices. All-reduce is hierarchical, as Horovod's: a ring
// reduce-scatter among the process's K devices, then each device all-reduces the chunk it holds
// across the processes (MPI_Allreduce on its own channel, the K devices at once), then a ring
// all-gather among the K devices. Every replica of every process ends with the same bits: each chunk
// is summed in one place per process and MPI's sum is the same on every process.
//
// Bytes are counted in two books: between the process's devices (Communicator::total, the ring's
// model over K) and to and from other processes (Communicator::inter_process, the ring's model of the
// chunk over the P processes: what MPI's ring all-reduce moves; MPI may pick another algorithm, as
// NCCL may, and the count stays the ring's).
#pragma once

#include <memory>
#include <vector>

#include "engine/communicator.h"
#include "engine/process_group.h"

namespace dp {

class ProcessCommunicator : public Communicator {
 public:
  // Opens one channel per device in `group` (every process must have as many devices).
  ProcessCommunicator(std::vector<Device*> devices, ProcessGroup& group);

  void all_reduce(int rank, void* buf, int64_t count, DType type = DType::fp32) override;
  // Hierarchical too. The job's P·K chunks are laid out so that the bytes across processes are the
  // fewest: device k of process p owns chunk k·P + p. reduce_scatter: a ring reduce-scatter among the
  // process's K devices over K blocks of P chunks (device k ends with block k's sum over the process),
  // then device k reduce-scatters its block across the processes on its channel (process p ends with
  // chunk p of it). all_gather: the reverse, across processes first, then the ring among the K.
  // Bytes: (K-1)·P chunks each way inside the process, (P-1) across.
  void reduce_scatter(int rank, void* buf, int64_t chunk, DType type = DType::fp32) override;
  void all_gather(int rank, float* buf, int64_t chunk) override;
  int world() const override { return size() * group_.size(); }
  std::string transport() const override { return "peer copies and MPI"; }
  int shard(int rank) const override { return rank * group_.size() + group_.rank(); }
  // From the job's device 0 (root 0: device 0 of process 0) to every device of every process: across
  // processes on device 0's channel (MPI_Bcast; counted as process 0 sending the buffer to each other
  // process), then within each process.
  void broadcast(int rank, float* buf, int64_t count, int root) override;
  // scatter's collectives, refused: nn.DataParallel is one process by design (the trainer refuses
  // --sync scatter across processes before any step).
  void scatter(int rank, const float* send, float* recv, const std::vector<int64_t>& counts, int root) override;
  void gather(int rank, const float* send, float* recv, const std::vector<int64_t>& counts, int root) override;
  void reduce(int rank, void* buf, int64_t count, int root, DType type = DType::fp32) override;

 private:
  [[noreturn]] void refuse(const char* what) const;
  ProcessGroup& group_;
};

// The communicator of a job's process (Engine, with a group of more than one process), beside
// make_communicator: on GPUs, one NCCL communicator over every GPU of every process (engine/cuda/
// nccl_process_communicator.cpp; it starts at the first collective, and where it cannot start every
// process fails with the same message: GPU memory never goes to MPI); on simulated devices, and in a
// build without CUDA (engine/stub/), ProcessCommunicator. Throws UsageError for a GPU shared by
// several local replicas.
std::unique_ptr<Communicator> make_process_communicator(std::vector<Device*> devices, ProcessGroup& group);

}  // namespace dp
