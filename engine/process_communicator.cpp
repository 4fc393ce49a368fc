#include "engine/process_communicator.h"

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "engine/error.h"
#include "engine/failpoint.h"

namespace dp {

ProcessCommunicator::ProcessCommunicator(std::vector<Device*> devices, ProcessGroup& group)
    : Communicator(std::move(devices)), group_(group) {
  group_.open_channels(size());
}

void ProcessCommunicator::all_reduce(int rank, void* buf, int64_t count, DType type) {
  if (all_reduce_algorithm() != AllReduceAlgorithm::ring) refuse("--allreduce naive");
  if (count == 0) return;
  const int n = size();
  const std::vector<int64_t> chunk = even_chunks(count, n);
  const int mine = n > 1 ? ring_owned_chunk(rank, n) : 0;
  const int64_t offset = chunk_offsets(chunk)[size_t(mine)];
  if (n > 1) ring_reduce_scatter(rank, buf, chunk, 1, Collective::all_reduce, type);
  failpoint::across_processes(*this, group_.rank(), rank, timeout());
  if (chunk[size_t(mine)] > 0) {
    devices_[rank]->synchronize();  // the chunk's adds are done before MPI reads it
    group_.all_reduce(rank, at(buf, offset, type), chunk[size_t(mine)], type, Deadline::after(timeout()),
                      "the all-reduce of " + devices_[rank]->name() + "'s chunk across processes",
                      [this] { return barrier_.aborted(); });
    tally_inter(rank, ring_all_reduce_traffic(group_.rank(), group_.size(), chunk[size_t(mine)], type));
  }
  if (n > 1) {
    // Every chunk summed across processes before any is read. A peer may spend up to the timeout in
    // its own wait across processes, so this meeting waits twice that: where another process stopped
    // answering, the error names that wait, not a local peer still inside it.
    meet(rank, "the all-reduce", Deadline::after(2 * timeout()));
    ring_all_gather(rank, buf, chunk, 1, Collective::all_reduce, /*publish=*/false, type);
  }
}

void ProcessCommunicator::reduce_scatter(int rank, void* buf, int64_t chunk, DType type) {
  if (chunk == 0) return;
  const int K = size(), P = group_.size();
  if (K > 1)
    ring_reduce_scatter(rank, buf, std::vector<int64_t>(size_t(K), P * chunk), 0, Collective::reduce_scatter, type);
  devices_[rank]->synchronize();  // the block's adds are done before MPI reads it
  group_.reduce_scatter(rank, at(buf, int64_t(rank) * P * chunk, type), chunk, type, Deadline::after(timeout()),
                        "the reduce-scatter of " + devices_[rank]->name() + "'s block across processes",
                        [this] { return barrier_.aborted(); });
  const int64_t bytes = (P - 1) * chunk * dtype_size(type);
  tally_inter(rank, {bytes, bytes});
}

void ProcessCommunicator::all_gather(int rank, float* buf, int64_t chunk) {
  if (chunk == 0) return;
  const int K = size(), P = group_.size();
  devices_[rank]->synchronize();  // the owned chunk is written before MPI reads it
  group_.all_gather(rank, buf + int64_t(rank) * P * chunk, chunk, Deadline::after(timeout()),
                    "the all-gather of " + devices_[rank]->name() + "'s block across processes",
                    [this] { return barrier_.aborted(); });
  const int64_t bytes = (P - 1) * chunk * int64_t(sizeof(float));
  tally_inter(rank, {bytes, bytes});
  if (K == 1) return;
  // Every block gathered across processes before a local peer reads it; a peer may spend up to the
  // timeout in its own wait across processes (as in all_reduce).
  meet(rank, "the all-gather", Deadline::after(2 * timeout()));
  ring_all_gather(rank, buf, std::vector<int64_t>(size_t(K), P * chunk), 0, Collective::all_gather, true, DType::fp32);
}

void ProcessCommunicator::broadcast(int rank, float* buf, int64_t count, int root) {
  if (root != 0) throw std::logic_error("ProcessCommunicator::broadcast: only from device 0 of process 0");
  if (count == 0) return;
  if (rank == 0) {
    const int64_t bytes = count * int64_t(sizeof(float));
    devices_[0]->synchronize();
    group_.broadcast(0, buf, bytes, 0, Deadline::after(timeout()),
                     "the broadcast from rank 0's " + devices_[0]->name() + " across processes",
                     [this] { return barrier_.aborted(); });
    const int P = group_.size();
    tally_inter(0, group_.rank() == 0 ? Traffic{(P - 1) * bytes, 0} : Traffic{0, bytes});
  }
  Communicator::broadcast(rank, buf, count, 0);
}

void ProcessCommunicator::scatter(int, const float*, float*, const std::vector<int64_t>&, int) { refuse("scatter"); }
void ProcessCommunicator::gather(int, const float*, float*, const std::vector<int64_t>&, int) { refuse("gather"); }
void ProcessCommunicator::reduce(int, void*, int64_t, int, DType) { refuse("reduce"); }

void ProcessCommunicator::refuse(const char* what) const {
  // The trainer refuses these options up front (exit 2); reaching here is a bug in a caller.
  throw std::logic_error(std::string(what) +
                         " across processes: not supported (--sync allreduce and the ZeRO stages are)");
}

}  // namespace dp
