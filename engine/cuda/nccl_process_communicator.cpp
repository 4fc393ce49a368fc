// make_process_communicator for CUDA builds: in a job of several processes (mpirun -np P dp_train --sync
// allreduce --gpus ...), one NCCL communicator over every GPU of every process, as PyTorch's
// ProcessGroupNCCL and Horovod make it; NCCL finds the topology (NVLink, PCIe, shared memory between
// the processes of a host, the network between hosts). Simulated devices keep ProcessCommunicator's
// hierarchical ring over MPI. OpenMPI here is not CUDA-aware: no GPU buffer ever goes to MPI, so where
// NCCL cannot start across processes there is no fallback: every process fails with the same message.
//
// Ranks. NCCL's ranks are the job's device ranks: process p's local device k is rank p*K + k of P*K
// (Engine::first_device() + k). Everything after the start is NcclCommunicator's (nccl_communicator.cpp):
// one thread per GPU calls ncclAllReduce (or ncclBroadcast) on its own communicator, after the
// process's local barrier; host waits on the GPU poll ncclCommGetAsyncError and the local barrier's
// abort flag and give up after --timeout; recover() aborts every communicator (ncclCommAbort). A failed
// step ends the whole job (dp_train's MPI_Abort), so a clique is never started twice.
//
// The start, at the first collective, as the one-process form (the clique costs nothing for a run that
// fails earlier), in three meetings of the process's ranks:
//   1. local rank 0, on the host channel: process 0 makes the ncclUniqueId (ncclGetUniqueId), MPI_Bcast
//      sends it to every process (ProcessGroup::broadcast, kHostChannel); then every process's problem
//      (none, or why it cannot join) and the PCI bus ids of its GPUs are gathered (all_gather), so that
//      every process learns the same verdict, including two processes that would share one GPU on a
//      host (NCCL refuses a GPU twice in one communicator; the test build asks it anyway), before any
//      NCCL init begins;
//   2. every local rank, on its own thread and all at once (NCCL's recipe for several GPUs of one
//      process): ncclCommInitRankConfig with blocking = 0, then ncclCommGetAsyncError polled until the
//      init is through, so the start has a deadline: max(--timeout, 600 s), as the one-process start's
//      meeting (a slow start is not a stuck one). A rank whose peer failed to init waits up to it.
//   3. local rank 0 gathers every process's init errors (all_gather again): all ranks agree, and on a
//      failure each aborts its half-made communicator and throws the same message, which names every
//      process that failed and why. Nothing hangs: every wait of the start has a deadline.
// The communicators are nonblocking (the price of the deadline on init): any NCCL call may answer
// ncclInProgress, and NcclCommunicator::call polls until it is through before the next call. Every
// collective of two or more ranks does: NCCL starts a thread for it (group.cc, 2.28 and 2.30), a cost
// per bucket not yet measured (one-process cliques stay blocking: nccl_communicator.cpp).
//
// Bytes. Counted as NCCL's ring over the P*K ranks in job-rank order would move them (the ring model of
// ring_all_reduce_traffic, over P*K; NCCL may pick another ring order, a tree or NVLS, and the count
// stays the ring's, as nccl-tests' bus bandwidth does). Each rank sends to the next job rank and
// receives from the previous one; the link from a process's last GPU to the next process's first GPU
// (and the last process's to process 0's, which closes the ring) crosses a process boundary. So a
// local rank's sent bytes count as inter-process (Communicator::inter_process) when it is the process's
// last GPU, its received bytes when it is the first; everything else is between the process's own GPUs
// (Communicator::total). With one GPU per process every byte crosses. The broadcast from job rank 0 is
// counted as NCCL's ring broadcast: a chain along the ring, every rank but the root receiving the
// buffer once and every rank but the last sending it once, split between the books the same way.
//
// Replicas stay bitwise identical: each element of NCCL's all-reduce is reduced once along the ring (or
// tree) and the result is copied to every rank, so every GPU of every process ends with the same bits;
// the trainer's end-of-run check across processes (job.cpp) compares them.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "engine/cuda/nccl_communicator.h"
#include "engine/error.h"
#include "engine/failpoint.h"
#include "engine/process_communicator.h"
#include "kernels/cuda/check.h"

namespace dp {
namespace {

class NcclProcessCommunicator final : public NcclCommunicator {
 public:
  NcclProcessCommunicator(std::vector<Device*> devices, ProcessGroup& group)
      : NcclCommunicator(std::move(devices)),
        group_(group),
        first_(group.rank() * size()),
        init_errors_(size_t(size())) {
    world_ = group.size() * size();
  }

  // From job rank 0 (device 0 of process 0) to every GPU of every process: ncclBroadcast.
  void broadcast(int rank, float* buf, int64_t count, int root) override;
  // Only the all-reduce strategy runs across processes (job.cpp refuses the others first).
  void scatter(int, const float*, float*, const std::vector<int64_t>&, int) override { refuse("scatter"); }
  void gather(int, const float*, float*, const std::vector<int64_t>&, int) override { refuse("gather"); }
  void reduce(int, void*, int64_t, int, DType) override { refuse("reduce"); }
  int shard(int rank) const override { return first_ + rank; }  // the NCCL rank

 private:
  void start_clique(int rank) override;
  void tally_all_reduce(int rank, int64_t count, DType type) override;
  // Rank `rank`'s traffic t in a collective over the ring: sent to the next job rank, received from the
  // previous one, each booked inside or across processes (the header says which).
  void tally_ring(int rank, Collective c, Traffic t) override;
  // Local rank 0, step 1: the id from process 0, and every process's verdict on its GPUs.
  std::string exchange_id(const Deadline& deadline);
  // Step 2, on the rank's thread: its communicator; the error, or empty.
  std::string init_rank(int rank, const Deadline& deadline);
  // Every process's `mine` (empty: nothing wrong), gathered: the job's verdict, empty when every one is.
  std::string agree(const std::string& mine, const Deadline& deadline);
  [[noreturn]] void refuse(const char* what) const {
    throw std::logic_error(std::string(what) + " across processes: not supported (--sync allreduce with the ring is)");
  }

  ProcessGroup& group_;
  const int first_;  // job rank of local rank 0
  ncclUniqueId id_{};
  // Why NCCL could not start across processes, the same on every process; written by local rank 0
  // between meetings. Once set, every later collective throws it again.
  std::string failure_;
  std::vector<std::string> init_errors_;  // per local rank, step 2
};

void NcclProcessCommunicator::start_clique(int rank) {
  Device& dev = *devices_[rank];
  if (!failure_.empty()) throw DeviceError(dev.id(), failure_);
  if (all_reduce_algorithm() != AllReduceAlgorithm::ring) refuse("--allreduce naive");  // job.cpp refuses it first
  const double start = std::max(timeout_, kDefaultTimeout);
  const std::string what = "the start of NCCL across processes";
  meet(rank, what, Deadline::after(start));
  if (rank == 0) failure_ = exchange_id(Deadline::after(start));
  meet(rank, what, Deadline::after(start));
  if (!failure_.empty()) throw DeviceError(dev.id(), failure_);

  init_errors_[size_t(rank)] = init_rank(rank, Deadline::after(start));
  // A rank whose init failed at once meets one still polling its own, for up to `start`: the meetings
  // after the inits wait twice that, so that the slow rank's answer arrives before the fast one gives up.
  // Whatever ends this rank's start from here (the agreed failure, every local rank at once; a meeting
  // that expired or was aborted; MPI's failure in agree) aborts the communicator its init made, half
  // made or not (ncclCommAbort is an intra-node collective call), before it goes on.
  try {
    meet(rank, what, Deadline::after(2 * start));
    if (rank == 0) {
      std::string mine;
      for (int r = 0; r < size(); ++r)
        if (!init_errors_[size_t(r)].empty()) mine += (mine.empty() ? "" : "; ") + init_errors_[size_t(r)];
      failure_ = agree(mine, Deadline::after(start));
      if (failure_.empty()) {
        watch_clique();
        clique_ = Clique::ready;
      }
    }
    meet(rank, what, Deadline::after(2 * start));
    if (!failure_.empty()) throw DeviceError(dev.id(), failure_);
  } catch (...) {
    end_comm(std::exchange(comms_[rank], nullptr), /*abort=*/true);
    DP_CUDA_CHECK_PRINT(cudaSetDevice(dev.id()));
    throw;
  }
}

std::string NcclProcessCommunicator::exchange_id(const Deadline& deadline) {
  std::string problem;
  if (group_.rank() == 0) {
    try {
      DP_NCCL_CHECK(ncclGetUniqueId(&id_));
    } catch (const std::exception& e) {
      problem = e.what();  // still broadcast (zeros): the verdict below tells every process
    }
  }
  group_.broadcast(kHostChannel, &id_, int64_t(sizeof(id_)), 0, deadline, "the broadcast of NCCL's unique id", nullptr);
  // This process's GPUs by PCI bus id (what names a GPU on a host whatever CUDA_VISIBLE_DEVICES says),
  // or what went wrong.
  std::string gpus;
  for (int r = 0; r < size() && problem.empty(); ++r) {
    char bus[32] = {};
    try {
      DP_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, int(sizeof(bus)), devices_[r]->id()));
      gpus += std::string(bus) + " ";
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  const std::vector<std::string> all = group_.all_gather(problem.empty() ? "gpus " + gpus : "error " + problem,
                                                         deadline, "the start of NCCL across processes");
  std::string why;
  auto add = [&why](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  std::map<std::string, int> owner;  // "host bus" -> the first process using it
  for (int p = 0; p < int(all.size()); ++p) {
    const std::string& s = all[size_t(p)];
    if (s.rfind("error ", 0) == 0) {
      add(group_.who(p) + ": " + s.substr(6));
      continue;
    }
    std::istringstream in(s.substr(5));
    for (std::string bus; in >> bus;) {
      const std::string key = group_.hosts()[size_t(p)] + " " + bus;
      const auto [it, fresh] = owner.emplace(key, p);
      // The test build asks NCCL anyway (failpoint::nccl_always, the same in every process of a job):
      // it refuses (2.28: "Duplicate GPU detected"; 2.30: "Multiple Ranks are using the same GPU"), or
      // from 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 ranks two processes on one GPU, the only NCCL
      // across processes a machine of one GPU can run.
      if (!fresh && !failpoint::nccl_always())
        add(group_.who(it->second) + " and " + group_.who(p) + " both use the GPU at PCI " + bus +
            " (NCCL ranks each GPU once: give each process its own GPUs, e.g. CUDA_VISIBLE_DEVICES per local rank)");
    }
  }
  return why.empty() ? "" : "NCCL across processes could not start: " + why;
}

std::string NcclProcessCommunicator::init_rank(int rank, const Deadline& deadline) {
  const CudaDevice& d = gpu(rank);
  const int me = first_ + rank;
  // Nonblocking init answers ncclInProgress at once; its progress and outcome come from
  // ncclCommGetAsyncError, asked here until the init is through, the deadline passes, or the barrier
  // was aborted (a local rank failed outside its init, so its init will never come, and NCCL's would
  // wait for it). A rank whose own init fails does not abort it: its error reaches the others in the
  // meeting and agree() after their polls end, so that all agree on one message (up to `start` later).
  auto finished = [&](ncclResult_t st) {
    if (st != ncclInProgress) return st;
    poll_until(
        [&] {
          DP_NCCL_CHECK(ncclCommGetAsyncError(comms_[rank], &st));
          return st != ncclInProgress;
        },
        [this] { return barrier_.aborted(); }, deadline, d.id(),
        [&] {
          return "NCCL's start on " + d.name() + " (rank " + std::to_string(me) + " of " + std::to_string(world_) + ")";
        });
    return st;
  };
  try {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    DP_NCCL_CHECK(finished(ncclCommInitRankConfig(&comms_[rank], world_, id_, me, &config)));
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string NcclProcessCommunicator::agree(const std::string& mine, const Deadline& deadline) {
  const std::vector<std::string> all = group_.all_gather(mine, deadline, "the start of NCCL across processes");
  std::string why;
  for (int p = 0; p < int(all.size()); ++p)
    if (!all[size_t(p)].empty()) why += (why.empty() ? "" : "; ") + group_.who(p) + ": " + all[size_t(p)];
  return why.empty() ? "" : "NCCL across processes could not start: " + why;
}

void NcclProcessCommunicator::tally_ring(int rank, Collective c, Traffic t) {
  Traffic inside, across;
  (rank == size() - 1 ? across : inside).sent = t.sent;  // to the next process's first GPU
  (rank == 0 ? across : inside).received = t.received;   // from the previous process's last GPU
  tally(rank, c, inside.sent, inside.received);
  tally_inter(rank, across);
}

void NcclProcessCommunicator::tally_all_reduce(int rank, int64_t count, DType type) {
  tally_ring(rank, Collective::all_reduce, ring_all_reduce_traffic(first_ + rank, world_, count, type));
}

void NcclProcessCommunicator::broadcast(int rank, float* buf, int64_t count, int root) {
  if (root != 0) throw std::logic_error("NCCL broadcast across processes: only from device 0 of process 0");
  if (count == 0) return;
  (void)use_nccl(rank);  // starts the clique at the first collective; throws if it cannot start
  const int64_t bytes = count * int64_t(sizeof(float));
  const int me = first_ + rank;
  tally_ring(rank, Collective::broadcast, Traffic{me < world_ - 1 ? bytes : 0, me > 0 ? bytes : 0});
  meet(rank, Collective::broadcast);
  DP_NCCL_CHECK(call(
      rank, [&] { return ncclBroadcast(buf, buf, size_t(count), ncclFloat, 0, comms_[rank], gpu(rank).stream()); }));
}

}  // namespace

std::unique_ptr<Communicator> make_process_communicator(std::vector<Device*> devices, ProcessGroup& group) {
  std::set<int> ids;
  size_t gpus = 0;
  for (Device* d : devices) {
    if (d->kind() == DeviceKind::cuda && dynamic_cast<CudaDevice*>(d)) ++gpus;
    ids.insert(d->id());
  }
  if (gpus == 0) return std::make_unique<ProcessCommunicator>(std::move(devices), group);
  if (gpus != devices.size()) throw std::logic_error("make_process_communicator: GPUs mixed with other devices");
  if (ids.size() != devices.size())
    throw UsageError(
        "a GPU shared by several replicas across processes: NCCL ranks each GPU once, and GPU memory never goes "
        "to MPI; give each device its own GPU");
  return std::make_unique<NcclProcessCommunicator>(std::move(devices), group);
}

}  // namespace dp
