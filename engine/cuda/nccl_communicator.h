// The NCCL communicator of the CUDA build (its design: nccl_communicator.cpp), shared by its two forms:
// one process whose GPUs form the whole clique (nccl_communicator.cpp, ncclCommInitAll), and one
// process's GPUs inside a job of several processes, the clique over every GPU of every process
// (nccl_process_communicator.cpp, ncclCommInitRank bootstrapped over MPI). Internal to engine/cuda/.
#pragma once

#include <nccl.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/cuda/cuda_device.h"

namespace dp {

class NcclCommunicator : public Communicator {
 public:
  explicit NcclCommunicator(std::vector<Device*> devices);
  ~NcclCommunicator() override;

  void all_reduce(int rank, void* buf, int64_t count, DType type = DType::fp32) override;
  void all_reduce_async(int rank, void* buf, int64_t count, Interval* timing = nullptr,
                        DType type = DType::fp32) override;
  void wait(int rank) override;
  void recover() override;
  // ncclReduceScatter and ncclAllGather in place, on the compute stream: NCCL rank r owns chunk r.
  void reduce_scatter(int rank, void* buf, int64_t chunk, DType type = DType::fp32) override;
  void all_gather(int rank, float* buf, int64_t chunk) override;
  // On the comm stream, after the compute stream's work so far (submit_ordered); the reduce-scatter
  // out of place, into `out`.
  void reduce_scatter_async(int rank, void* buf, int64_t chunk, void* out, Interval* timing = nullptr,
                            DType type = DType::fp32) override;
  void all_gather_async(int rank, float* buf, int64_t chunk, Interval* timing = nullptr) override;
  int world() const override { return world_; }
  std::string transport() const override {
    return clique_ == Clique::ready         ? "nccl"
           : clique_ == Clique::unavailable ? "peer copies (NCCL could not start)"
                                            : "nccl (not started: no collective yet)";
  }

 protected:
  enum class Clique { none, ready, unavailable };

  CudaDevice& gpu(int rank) const { return static_cast<CudaDevice&>(*devices_[rank]); }
  // Counts one all-reduce of count elements of `type` on local rank `rank` (the ring's or naive's model
  // over the clique; the job's form splits it into bytes inside and across processes).
  virtual void tally_all_reduce(int rank, int64_t count, DType type);
  // Counts a ring collective's bytes `t` on local rank `rank` under c (the job's form splits them).
  virtual void tally_ring(int rank, Collective c, Traffic t) { tally(rank, c, t.sent, t.received); }
  // The all-reduce of all_reduce_algorithm(), enqueued on `stream`; the sharded collectives counted,
  // the ranks met and enqueued on `stream` (the reduce-scatter's owned chunk of the sum into `out`).
  // ncclBfloat16 and ncclHalf for the 16-bit types of --grad-dtype: NCCL's reductions in these types
  // round every partial sum to the type, as the peer ring does.
  static ncclDataType_t nccl_type(DType t) {
    return t == DType::fp32 ? ncclFloat : t == DType::bf16 ? ncclBfloat16 : ncclHalf;
  }
  void enqueue_all_reduce(int rank, void* buf, int64_t count, DType type, cudaStream_t stream);
  void enqueue_reduce_scatter(int rank, const void* buf, int64_t chunk, void* out, DType type, cudaStream_t stream);
  void enqueue_all_gather(int rank, float* buf, int64_t chunk, cudaStream_t stream);
  // An asynchronous collective: an event on the compute stream now; on the communication thread the
  // comm stream waits on it and `nccl` enqueues the collective there, or `peer` runs the peer copies
  // where the clique did not start. wait() orders the compute stream after the comm stream.
  void submit_ordered(int rank, Collective kind, Interval* timing, std::function<void()> peer,
                      std::function<void(cudaStream_t)> nccl);
  // Whether this all-reduce goes through NCCL; the first call on every rank starts the clique.
  bool use_nccl(int rank);
  // Every local rank calls it at its first collective; it leaves clique_ ready or unavailable (the
  // one-process form then falls back to peer copies) or throws (the job's form: no fallback).
  virtual void start_clique(int rank);
  // Once comms_ are made: every GPU's host waits poll the communicators (CudaDevice::Watch).
  void watch_clique();
  // One NCCL call on rank's communicator (a collective), made under api_[rank]. Its result on a
  // nonblocking communicator (the job's form: its init has a deadline) may be ncclInProgress: then
  // ncclCommGetAsyncError is polled, each poll under the lock, until the call is through, up to the
  // timeout; the final result is returned for DP_NCCL_CHECK. Blocking communicators never answer
  // ncclInProgress.
  ncclResult_t call(int rank, const std::function<ncclResult_t()>& nccl);
  // The watch's questions (CudaDevice::Watch), asked on the rank's thread while it waits.
  bool failed(int rank);
  std::string outstanding(int rank);
  // Ends the clique: the watches off, then the communicators destroyed once every stream drained,
  // or aborted (`failure`, or a drain that did not finish) and the streams drained after. Only when
  // no rank thread uses the communicator.
  void end_clique(bool failure) noexcept;
  // ncclCommDestroy or ncclCommAbort of every local rank's communicator, each on its GPU's own thread
  // and all at once: both are intra-node collective calls in NCCL's API (every rank on the node calls
  // them, or they may hang). Leaves comms_ null.
  void end_comms(bool abort) noexcept;
  // One communicator's end on the calling thread (null: nothing); a failure is printed.
  void end_comm(ncclComm_t comm, bool abort) const noexcept;
  // Waits, up to the timeout, until both streams of every GPU are idle; says so on stderr if not.
  bool drain() noexcept;
  void release_events() noexcept;

  // An asynchronous collective of a rank: `ready` recorded on the compute stream before it, `finished`
  // on the comm stream after it (for a timeout's message: the oldest one not finished).
  struct Queued {
    cuda::Event ready, finished;
    Collective kind = Collective::all_reduce;
    uint64_t number = 0;  // the rank's collectives queued before it, plus one
  };
  struct RankEvents {
    // Oldest first, those that may still run: across waits and steps (--run-ahead queues step k+1's
    // behind step k's). submit_ordered moves the finished ones from the front, once waited, to spare.
    std::deque<Queued> queued;
    std::vector<Queued> spare;
    uint64_t count = 0;     // collectives queued on this rank so far
    uint64_t waited = 0;    // count at the last wait(): the comm-thread tasks of those up to it have run
    uint64_t enqueued = 0;  // the last whose comm-thread task recorded `finished`: see note_enqueued()
    cuda::Event done;       // recorded on the comm stream after the last bucket
  };
  // Collective `number`'s comm-thread task recorded its `finished`: until then that event is
  // unrecorded or an older collective's, and outstanding() counts the collective as not finished.
  void note_enqueued(int rank, uint64_t number) {
    std::lock_guard lock(events_mu_);
    events_[rank].enqueued = number;
  }
  int world_;  // NCCL ranks in the clique: size() in one process, every process's GPUs in a job
  // The test build's one-rank clique (failpoint::nccl_always): one GPU's collectives go through NCCL.
  const bool one_rank_clique_;
  // A collective of `count` elements that moves nothing: empty, or one rank (but in a one-rank clique).
  bool nothing_to_do(int64_t count) const { return count == 0 || (world_ == 1 && !one_rank_clique_); }
  std::vector<ncclComm_t> comms_;
  // NCCL's API is not thread-safe on one communicator (its guide's "Thread Safety"; a nonblocking one
  // completes its queued work inside ncclCommGetAsyncError, unlocked), and two threads use each rank's:
  // the communication thread enqueues the buckets while the compute thread's host waits ask the
  // watch, failed(). So every call on comms_[r] holds api_[r] (failed() only tries it), as PyTorch's
  // NCCLComm locks around getAsyncError; but the end's, made when no rank thread uses it.
  std::unique_ptr<std::mutex[]> api_;
  // Written by rank 0 between the two meetings of start_clique, read by every rank after the second
  // (or before its first, when none is there yet); reset by recover() with every rank idle.
  Clique clique_ = Clique::none;
  std::mutex events_mu_;  // events_[r] is the compute thread's; outstanding() may run on another
  std::vector<RankEvents> events_;
};

}  // namespace dp
