// The NCCL clique's life, for both forms of NcclCommunicator (nccl_communicator.cpp): its start at the
// first collective, the watches on the host's waits while it exists, and its end.
//
// The clique (one NCCL communicator per GPU) is created at the first all-reduce, not with the
// communicator: --sync scatter never all-reduces (but for --sync-bn's BatchNorm statistics), and a
// run that does not need NCCL must not fail because NCCL cannot start. Every rank meets at its first
// all-reduce; rank 0 creates the clique (init_clique); a second meeting gives every rank the outcome.
// If NCCL cannot start (a small /dev/shm in a container, no P2P, ...), one line on stderr says so and
// all_reduce is the base class's peer copies from then on, counted the same way. Rank 0 starts every
// GPU's communicator from its own thread, as ncclCommInitAll does (ncclGetUniqueId, then every rank's
// init in one group), so the start succeeds or fails as a whole, in one place, and every rank learns
// the same outcome and falls back together. Unlike InitAll, the inits are nonblocking
// (ncclCommInitRankConfig, blocking = 0) and polled: a start that does not finish within max(--timeout,
// 600 s) (a bootstrap that never connects) is aborted and reported, where InitAll would hold rank 0's
// thread, and then the whole process, forever. The communicators stay nonblocking (call() settles).
//
// Failures. Host waits on GPU work that may include NCCL poll (CudaDevice's watch, set while the
// clique exists): between polls they look at the barrier's abort flag (another rank failed) and at
// ncclCommGetAsyncError of the rank's own communicator (an NCCL error, which then aborts the other
// ranks too), and give up after the collective timeout (--timeout) with TimedOut. So a rank whose peer
// failed after the barrier, its kernel left waiting for the peer's half of an all-reduce, throws
// instead of hanging. Once every rank has returned, recover() (engine.cpp, after a failed step) ends
// every NCCL operation still queued: ncclCommAbort on every communicator (the kernels waiting for a
// half that will never come quit), then both streams of every GPU drain, so no all-reduce queued on
// the comm stream writes the gradient buffer while the next step's backward writes it; the clique is
// created again at the next all-reduce, since after a failure its state is unknown. This is what
// PyTorch's ProcessGroupNCCL does after an NCCL error or a timeout. The abort waits for recover()
// rather than happening in the wait that saw the failure because ncclCommAbort frees the
// communicator, and another rank's thread may at that moment still be polling its own.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/cuda/nccl_communicator.h"
#include "engine/error.h"
#include "kernels/cuda/check.h"

namespace dp {

bool NcclCommunicator::use_nccl(int rank) {
  if (clique_ == Clique::none) start_clique(rank);
  return clique_ == Clique::ready;
}

void NcclCommunicator::start_clique(int rank) {
  const double start = std::max(timeout_, kDefaultTimeout);  // a slow start is not a stuck one
  meet(rank, Collective::all_reduce);                        // every rank, at its first all-reduce
  if (rank == 0) {
    std::vector<int> ids;
    for (Device* d : devices_) ids.push_back(d->id());
    try {
      try {
        init_clique(ids, Deadline::after(start));
      } catch (...) {
        // A failed or late init leaves communicators half made; ncclCommAbort ends their init and frees them.
        for (ncclComm_t& c : comms_) end_comm(std::exchange(c, nullptr), /*abort=*/true);
        DP_CUDA_CHECK_PRINT(cudaSetDevice(ids[0]));
        throw;
      }
      watch_clique();
      clique_ = Clique::ready;
    } catch (const Aborted&) {
      throw;  // another rank failed meanwhile: the step fails, and NCCL is tried again after recover()
    } catch (const std::exception& e) {
      clique_ = Clique::unavailable;
      // NCCL's refusal of a GPU named twice (ncclInvalidUsage) does not say how to allow it.
      const bool shared = std::set<int>(ids.begin(), ids.end()).size() < ids.size();
      std::fprintf(stderr, "note: NCCL could not start (%s%s); all-reduce uses peer copies\n", e.what(),
                   shared ? "; a GPU is named twice, which NCCL ranks once but with NCCL_MULTI_RANK_GPU_ENABLE=1 "
                            "(NCCL 2.30 or later)"
                          : "");
    }
  }
  // Every rank learns the outcome. NCCL's start can take seconds on many GPUs: its deadline is at
  // least the default timeout, so that a short --timeout (for a quick verdict on a stuck step) does
  // not fail a start that is merely slow, and the others wait twice that, so that rank 0's verdict on
  // a start past its deadline reaches them before they give up.
  meet(rank, "the start of NCCL", Deadline::after(2 * start));
}

void NcclCommunicator::init_clique(const std::vector<int>& ids, const Deadline& deadline) {
  ncclUniqueId id;
  DP_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  // Between ncclGroupStart and ncclGroupEnd nothing throws: an init's own failure shows in ncclGroupEnd's
  // result or its communicator's state, as in ncclCommInitAll.
  cudaError_t set = cudaSuccess;
  DP_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < size() && set == cudaSuccess; ++r)
    if ((set = cudaSetDevice(ids[size_t(r)])) == cudaSuccess)
      (void)ncclCommInitRankConfig(&comms_[size_t(r)], size(), id, r, &config);  // the GPU current now
  const ncclResult_t launched = ncclGroupEnd();
  DP_CUDA_CHECK_NAMED(set, "cudaSetDevice");
  DP_CUDA_CHECK(cudaSetDevice(ids[0]));  // rank 0's thread's own GPU again
  DP_NCCL_CHECK_NAMED(launched == ncclInProgress ? ncclSuccess : launched, "ncclGroupEnd");
  for (int r = 0; r < size(); ++r) {
    auto what = [&] { return "NCCL's start on " + devices_[r]->name(); };
    DP_NCCL_CHECK_NAMED(settle(r, ncclInProgress, deadline, what), "ncclCommInitRankConfig");
  }
}

void NcclCommunicator::watch_clique() {
  for (int r = 0; r < size(); ++r) {
    auto watch = std::make_shared<CudaDevice::Watch>();
    watch->aborted = [this, r] { return failed(r); };
    watch->what = [this, r] { return outstanding(r); };
    watch->timeout = timeout_;
    gpu(r).set_watch(std::move(watch));
  }
}

ncclResult_t NcclCommunicator::call(int rank, const std::function<ncclResult_t()>& nccl) {
  std::unique_lock lock(api_[rank]);
  const ncclResult_t state = nccl();
  lock.unlock();
  return settle(rank, state, Deadline::after(timeout_),
                [this, rank] { return "NCCL's enqueueing of a collective on " + devices_[rank]->name(); });
}

ncclResult_t NcclCommunicator::settle(int rank, ncclResult_t state, const Deadline& deadline,
                                      const std::function<std::string()>& what) {
  if (state != ncclInProgress) return state;
  poll_until(
      [&] {
        std::lock_guard poll(api_[rank]);
        DP_NCCL_CHECK(ncclCommGetAsyncError(comms_[rank], &state));
        return state != ncclInProgress;
      },
      [this] { return barrier_.aborted(); }, deadline, devices_[rank]->id(), what);
  return state;
}

bool NcclCommunicator::failed(int rank) {
  if (barrier_.aborted()) return true;  // another rank failed: Aborted
  // The communication thread inside NCCL on this communicator: asked again at the next poll, while
  // the wait's timeout runs on.
  std::unique_lock lock(api_[rank], std::try_to_lock);
  if (!lock.owns_lock()) return false;
  ncclResult_t state = ncclSuccess;
  DP_NCCL_CHECK(ncclCommGetAsyncError(comms_[rank], &state));
  if (state == ncclSuccess || state == ncclInProgress) return false;
  abort();  // the other ranks stop waiting too
  const char* detail = ncclGetLastError(comms_[rank]);
  throw DeviceError(devices_[rank]->id(), "NCCL reported an error on " + devices_[rank]->name() + ": " +
                                              ncclGetErrorString(state) +
                                              (detail && *detail ? std::string(": ") + detail : std::string()));
}

void NcclCommunicator::recover() {
  Communicator::recover();  // every comm-thread task has finished, and the barrier is re-armed
  for (RankEvents& ev : events_) {
    for (Queued& q : ev.queued) ev.spare.push_back(std::move(q));
    ev.queued.clear();
  }
  end_clique(/*failure=*/true);
}

void NcclCommunicator::end_clique(bool failure) noexcept {
  if (clique_ != Clique::ready) return;  // none, or NCCL could not start: then it stays the peer ring
  for (int r = 0; r < size(); ++r) gpu(r).set_watch(nullptr);  // before the communicators they ask go
  const bool drained = !failure && drain();
  end_comms(/*abort=*/!drained);
  if (!drained) drain();  // the aborted kernels have quit; what was queued behind them runs out
  clique_ = Clique::none;
}

void NcclCommunicator::end_comms(bool abort) noexcept {
  std::vector<std::future<void>> ends;
  for (int r = 0; r < size(); ++r)
    ends.push_back(devices_[r]->run([this, r, abort] {
      end_comm(std::exchange(comms_[r], nullptr), abort);
      DP_CUDA_CHECK_PRINT(cudaSetDevice(devices_[r]->id()));  // NCCL's end may leave another device current
    }));
  for (std::future<void>& f : ends) f.wait();
}

void NcclCommunicator::end_comm(ncclComm_t comm, bool abort) const noexcept {
  if (!comm) return;
  // An orderly end finalizes first, as NCCL asks (ncclCommFinalize flushes the operations still
  // queued and frees the network's resources; on a nonblocking communicator it answers ncclInProgress
  // and ncclCommGetAsyncError says when it is through), then destroys. A finalize that fails or does
  // not finish within --timeout ends in ncclCommAbort instead.
  if (!abort) {
    ncclResult_t st = ncclCommFinalize(comm);
    const Deadline deadline = Deadline::after(timeout_);
    while (st == ncclInProgress && std::chrono::steady_clock::now() < deadline.at) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) st = ncclInternalError;
    }
    if (st != ncclSuccess) {
      if (st != ncclInProgress)
        cuda::print_failure("NCCL", "ncclCommFinalize", ncclGetErrorString(st), __FILE__, __LINE__);
      abort = true;
    }
  }
  // A nonblocking communicator may answer ncclInProgress: the end goes on inside NCCL, and the handle
  // is not ours to ask any more.
  const ncclResult_t st = abort ? ncclCommAbort(comm) : ncclCommDestroy(comm);
  if (st != ncclSuccess && st != ncclInProgress)
    cuda::print_failure("NCCL", abort ? "ncclCommAbort" : "ncclCommDestroy", ncclGetErrorString(st), __FILE__,
                        __LINE__);
}

// Every GPU at once, under one deadline: K GPUs stuck behind NCCL's kernels cost one --timeout, not K.
bool NcclCommunicator::drain() noexcept {
  const Deadline deadline = Deadline::after(timeout_);
  std::vector<std::future<void>> waits;
  for (int r = 0; r < size(); ++r)
    waits.push_back(devices_[r]->run([this, r, deadline] {
      CudaDevice& d = gpu(r);
      poll_until([&d] { return stream_idle(d.comm_stream()) && stream_idle(d.stream()); }, [] { return false; },
                 deadline, d.id(), [&d] { return "the work left on " + d.name() + "'s streams after the step"; });
    }));
  bool ok = true;
  for (std::future<void>& w : waits) {
    try {
      w.get();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dp: %s\n", e.what());
      ok = false;
    }
  }
  return ok;
}

}  // namespace dp
