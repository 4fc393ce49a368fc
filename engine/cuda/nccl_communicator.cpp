// make_communicator for CUDA builds: NCCL's all-reduce when every device is a distinct GPU, the peer ring of
// engine/communicator.cpp otherwise (one device, a GPU shared by several replicas, or simulated devices).
// Broadcast, scatter, gather and reduce stay the base class's peer copies on both; only all_reduce, the
// collective that matters for DDP, goes through NCCL.
//
// Calls follow NCCL's one-thread-per-device model: every rank calls ncclAllReduce on its own communicator from
// its own thread, no group calls. With --allreduce naive it is d2l's all-reduce: ncclReduce to rank 0, then
// ncclBroadcast from it, every rank enqueuing both in turn on one stream.
//   all_reduce        — compute thread, compute stream; the engine synchronises after it.
//   all_reduce_async  — an event recorded on the compute stream right after the bucket's gradients were
//                       enqueued; the communication thread makes the comm stream wait on it and enqueues
//                       ncclAllReduce there, so backward keeps going on the compute stream.
//                       reduce_scatter_async and all_gather_async alike (submit_ordered).
//   wait              — the compute stream waits on an event recorded on the comm stream after the
//                       last bucket. No host synchronisation with the GPU.
// Before each ncclAllReduce the ranks meet at the communicator's host barrier. It costs microseconds and keeps
// the engine's failure rule: a rank that failed earlier aborts the barrier and the others throw instead of
// enqueuing an all-reduce whose peer never comes (which would hang the GPU).
//
// The clique (one NCCL communicator per GPU) is created at the first all-reduce, not with the communicator:
// --sync scatter never all-reduces (but for --sync-bn's BatchNorm statistics), and a run that does not need
// NCCL must not fail because NCCL cannot start. Every rank meets at its first all-reduce; rank 0 creates the
// clique with one ncclCommInitAll; a second meeting gives every rank the outcome. If NCCL cannot start (a small
// /dev/shm in a container, no P2P, ...), one line on stderr says so and all_reduce is the base class's peer
// copies from then on, counted the same way. InitAll is NCCL's one-thread-per-device recipe run from one thread
// (ncclGetUniqueId, then every rank's init in one group): it succeeds or fails as a whole, so every rank learns
// one outcome and falls back together. It blocks with no deadline (a bootstrap that never connects holds the
// process for good). The job's nonblocking start has one, but a nonblocking communicator of two or more ranks
// answers every collective ncclInProgress and starts a thread for it (group.cc of NCCL 2.28 and 2.30): a cost
// on every bucket of DDP's path, which this form does not pay for a start that rarely hangs.
//
// Failures. Host waits on GPU work that may include NCCL poll (CudaDevice's watch, set while the clique
// exists): between polls they look at the barrier's abort flag (another rank failed) and at
// ncclCommGetAsyncError of the rank's own communicator (an NCCL error, which then aborts the other ranks too),
// and give up after the collective timeout (--timeout) with TimedOut. So a rank whose peer failed after the
// barrier, its kernel left waiting for the peer's half of an all-reduce, throws instead of hanging. Once every
// rank has returned, recover() (engine.cpp, after a failed step) ends every NCCL operation still queued:
// ncclCommAbort on every communicator (the kernels waiting for a half that will never come quit), then both
// streams of every GPU drain, so no all-reduce queued on the comm stream writes the gradient buffer while the
// next step's backward writes it; the clique is created again at the next all-reduce, since after a failure its
// state is unknown. This is what PyTorch's ProcessGroupNCCL does after an NCCL error or a timeout. The abort
// waits for recover() rather than happening in the wait that saw the failure because ncclCommAbort frees the
// communicator, and another rank's thread may at that moment still be polling its own.
//
// The class is declared in nccl_communicator.h: the job's form (several processes, one clique over all their
// GPUs; nccl_process_communicator.cpp) derives from it and replaces the start, the byte count and the
// broadcast; the waits, events, watches and the ends are these.
//
// Bytes are counted as the base class counts them (ring_all_reduce_traffic, naive_all_reduce_traffic), so
// reports compare across communicators. NCCL may choose another algorithm (tree, NVLS on NVSwitch) and move
// other bytes over other links; the count is the ring's, nccl-tests' bus-bandwidth convention.
#include "engine/cuda/nccl_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <future>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "kernels/cuda/check.h"

namespace dp {

NcclCommunicator::NcclCommunicator(std::vector<Device*> devices)
    : Communicator(std::move(devices)),
      world_(size()),
      one_rank_clique_(failpoint::nccl_always()),
      comms_(devices_.size(), nullptr),
      api_(std::make_unique<std::mutex[]>(devices_.size())),
      events_(devices_.size()) {
  try {
    for (int r = 0; r < size(); ++r) devices_[r]->run([this, r] { events_[r].done = cuda::make_event(); }).get();
  } catch (...) {
    release_events();
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  abort();                  // a comm-thread task still at the barrier throws instead of waiting forever
  Communicator::recover();  // and every task has finished before its state goes
  end_clique(/*failure=*/false);
  release_events();
}

void NcclCommunicator::release_events() noexcept {
  for (int r = 0; r < size(); ++r)
    devices_[r]->run([this, r] { events_[r] = RankEvents(); }).wait();  // destroyed on their GPU's thread
}

bool NcclCommunicator::use_nccl(int rank) {
  if (clique_ == Clique::none) start_clique(rank);
  return clique_ == Clique::ready;
}

void NcclCommunicator::start_clique(int rank) {
  meet(rank, Collective::all_reduce);  // every rank, at its first all-reduce
  if (rank == 0) {
    std::vector<int> ids;
    for (Device* d : devices_) ids.push_back(d->id());
    try {
      try {
        // On rank 0's thread, whose current device is ids[0]: NCCL's save-and-restore of the current
        // device never touches another GPU.
        DP_NCCL_CHECK(ncclCommInitAll(comms_.data(), int(ids.size()), ids.data()));
        DP_CUDA_CHECK(cudaSetDevice(ids[0]));
      } catch (...) {
        // A failed init may leave communicators half made; ncclCommAbort frees them.
        for (ncclComm_t& c : comms_)
          if (c) DP_NCCL_CHECK_PRINT(ncclCommAbort(std::exchange(c, nullptr)));
        DP_CUDA_CHECK_PRINT(cudaSetDevice(ids[0]));
        throw;
      }
      watch_clique();
      clique_ = Clique::ready;
    } catch (const std::exception& e) {
      clique_ = Clique::unavailable;
      // NCCL's refusal of a GPU named twice comes without a message of its own (ncclInvalidUsage).
      const bool shared = std::set<int>(ids.begin(), ids.end()).size() < ids.size();
      std::fprintf(stderr, "note: NCCL could not start (%s%s); all-reduce uses peer copies\n", e.what(),
                   shared ? "; a GPU is named twice, which NCCL ranks once but with NCCL_MULTI_RANK_GPU_ENABLE=1 "
                            "(NCCL 2.30 or later)"
                          : "");
    }
  }
  // Every rank learns the outcome. NCCL's start can take seconds on many GPUs: the wait for it is at least the default
  // timeout, so that a short --timeout (for a quick verdict on a stuck step) does not fail a start that is merely slow.
  meet(rank, "the start of NCCL", Deadline::after(std::max(timeout_, kDefaultTimeout)));
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
  ncclResult_t state = nccl();
  lock.unlock();
  if (state != ncclInProgress) return state;
  const CudaDevice& d = gpu(rank);
  poll_until(
      [&] {
        std::lock_guard poll(api_[rank]);
        DP_NCCL_CHECK(ncclCommGetAsyncError(comms_[rank], &state));
        return state != ncclInProgress;
      },
      [this] { return barrier_.aborted(); }, Deadline::after(timeout_), d.id(),
      [&d] { return "NCCL's enqueueing of a collective on " + d.name(); });
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

// Whether the work before `event` has run. Unlike cuda_device.cpp's event_done, the stream's failure
// counts as done rather than thrown: the wait reports it.
static bool event_done(const cuda::Event& event) {
  const cudaError_t err = cudaEventQuery(event.get());
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err != cudaErrorNotReady;
}

// The oldest collective not finished, so that a timeout while the host waits for step k names step
// k's, not the step k+1 that --run-ahead queued behind it.
std::string NcclCommunicator::outstanding(int rank) {
  std::lock_guard lock(events_mu_);
  const RankEvents& ev = events_[rank];
  const std::deque<Queued>& queued = ev.queued;
  for (size_t i = 0; i < queued.size(); ++i) {
    if (queued[i].number <= ev.enqueued && event_done(queued[i].finished)) continue;
    return "NCCL's " + std::string(collective_name(queued[i].kind)) + " number " + std::to_string(queued[i].number) +
           " on " + devices_[rank]->name() + " (the oldest not finished; " + std::to_string(queued.size() - i - 1) +
           " more queued behind it)";
  }
  return "the work queued on " + devices_[rank]->name() + " (its kernels and NCCL's collectives)";
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

void NcclCommunicator::tally_all_reduce(int rank, int64_t count, DType type) {
  const Traffic t = all_reduce_traffic(all_reduce_algorithm(), rank, world_, count, type);
  tally(rank, Collective::all_reduce, t.sent, t.received);
}

void NcclCommunicator::enqueue_all_reduce(int rank, void* buf, int64_t count, DType type, cudaStream_t stream) {
  const ncclDataType_t t = nccl_type(type);
  if (all_reduce_algorithm() == AllReduceAlgorithm::ring) {
    DP_NCCL_CHECK(call(rank, [&] { return ncclAllReduce(buf, buf, size_t(count), t, ncclSum, comms_[rank], stream); }));
    return;
  }
  // In place on every rank: rank 0's buf receives the sum (the others' are only read), then every
  // rank's buf receives rank 0's. Stream order puts the broadcast after the reduce.
  DP_NCCL_CHECK(call(rank, [&] { return ncclReduce(buf, buf, size_t(count), t, ncclSum, 0, comms_[rank], stream); }));
  DP_NCCL_CHECK(call(rank, [&] { return ncclBroadcast(buf, buf, size_t(count), t, 0, comms_[rank], stream); }));
}

void NcclCommunicator::reduce_scatter(int rank, void* buf, int64_t chunk, DType type) {
  if (nothing_to_do(chunk)) return;
  if (!use_nccl(rank)) return Communicator::reduce_scatter(rank, buf, chunk, type);
  // NCCL's in-place form: recvbuff = sendbuff + rank·recvcount.
  enqueue_reduce_scatter(rank, buf, chunk, at(buf, int64_t(shard(rank)) * chunk, type), type, gpu(rank).stream());
}

void NcclCommunicator::all_gather(int rank, float* buf, int64_t chunk) {
  if (nothing_to_do(chunk)) return;
  if (!use_nccl(rank)) return Communicator::all_gather(rank, buf, chunk);
  enqueue_all_gather(rank, buf, chunk, gpu(rank).stream());
}

void NcclCommunicator::all_reduce(int rank, void* buf, int64_t count, DType type) {
  if (nothing_to_do(count)) return;
  if (!use_nccl(rank)) return Communicator::all_reduce(rank, buf, count, type);
  tally_all_reduce(rank, count, type);
  meet(rank, Collective::all_reduce);
  enqueue_all_reduce(rank, buf, count, type, gpu(rank).stream());
}

void NcclCommunicator::enqueue_reduce_scatter(int rank, const void* buf, int64_t chunk, void* out, DType type,
                                              cudaStream_t stream) {
  const int64_t bytes = (world_ - 1) * chunk * dtype_size(type);
  tally_ring(rank, Collective::reduce_scatter, {bytes, bytes});
  meet(rank, Collective::reduce_scatter);
  DP_NCCL_CHECK(call(rank, [&] {
    return ncclReduceScatter(buf, out, size_t(chunk), nccl_type(type), ncclSum, comms_[rank], stream);
  }));
}

void NcclCommunicator::enqueue_all_gather(int rank, float* buf, int64_t chunk, cudaStream_t stream) {
  const int64_t bytes = (world_ - 1) * chunk * int64_t(sizeof(float));
  tally_ring(rank, Collective::all_gather, {bytes, bytes});
  meet(rank, Collective::all_gather);
  const float* mine = buf + int64_t(shard(rank)) * chunk;  // in place: sendbuff = recvbuff + rank·sendcount
  DP_NCCL_CHECK(call(rank, [&] { return ncclAllGather(mine, buf, size_t(chunk), ncclFloat, comms_[rank], stream); }));
}

// The timing is the host's view: from the communication thread reaching the barrier to the NCCL call
// returning, i.e. when the collective was enqueued, not when the GPU ran it (which follows on the comm
// stream and ends, at the latest, within the engine's wait for it, which synchronises).
void NcclCommunicator::submit_ordered(int rank, Collective kind, Interval* timing, std::function<void()> peer,
                                      std::function<void(cudaStream_t)> nccl) {
  CudaDevice& dev = gpu(rank);
  cudaEvent_t ready = nullptr, finished = nullptr;
  uint64_t number = 0;
  {
    std::lock_guard lock(events_mu_);
    RankEvents& ev = events_[rank];
    // The finished ones go back to spare: past a wait() (their task has used their events) and run.
    while (!ev.queued.empty() && ev.queued.front().number <= ev.waited && event_done(ev.queued.front().finished)) {
      ev.spare.push_back(std::move(ev.queued.front()));
      ev.queued.pop_front();
    }
    if (ev.spare.empty()) ev.spare.push_back({cuda::make_event(), cuda::make_event()});  // the compute thread's GPU
    Queued q = std::move(ev.spare.back());
    ev.spare.pop_back();
    q.kind = kind, q.number = number = ++ev.count;
    ready = q.ready.get();
    finished = q.finished.get();
    ev.queued.push_back(std::move(q));
  }
  DP_CUDA_CHECK(cudaEventRecord(ready, dev.stream()));  // after the kernels that wrote the buffer
  // Whether NCCL or the peer ring runs it is decided on the communication thread, where the clique
  // starts: the compute thread may not read the outcome while rank 0 writes it.
  submit_comm(rank, timing, [=, this, &dev, peer = std::move(peer), nccl = std::move(nccl)] {
    // The peer ring's copies go on the compute stream, after the kernels that wrote the buffer.
    if (!use_nccl(rank)) return peer();
    DP_CUDA_CHECK(cudaStreamWaitEvent(dev.comm_stream(), ready, 0));
    nccl(dev.comm_stream());  // meets the other ranks first, as the synchronous forms do
    DP_CUDA_CHECK(cudaEventRecord(finished, dev.comm_stream()));  // for a timeout's message
    note_enqueued(rank, number);
  });
}

void NcclCommunicator::all_reduce_async(int rank, void* buf, int64_t count, Interval* timing, DType type) {
  if (nothing_to_do(count)) return;
  submit_ordered(
      rank, Collective::all_reduce, timing,
      [this, rank, buf, count, type] { Communicator::all_reduce(rank, buf, count, type); },
      [this, rank, buf, count, type](cudaStream_t stream) {
        tally_all_reduce(rank, count, type);
        meet(rank, Collective::all_reduce);
        enqueue_all_reduce(rank, buf, count, type, stream);
      });
}

void NcclCommunicator::reduce_scatter_async(int rank, void* buf, int64_t chunk, void* out, Interval* timing,
                                            DType type) {
  if (nothing_to_do(chunk)) return Communicator::reduce_scatter_async(rank, buf, chunk, out, timing, type);
  submit_ordered(
      rank, Collective::reduce_scatter, timing,
      [this, rank, buf, chunk, out, type] {
        Communicator::reduce_scatter(rank, buf, chunk, type);
        copy_owned_chunk(rank, buf, chunk, out, type);
      },
      [this, rank, buf, chunk, out, type](cudaStream_t stream) {
        enqueue_reduce_scatter(rank, buf, chunk, out, type, stream);
      });
}

void NcclCommunicator::all_gather_async(int rank, float* buf, int64_t chunk, Interval* timing) {
  if (nothing_to_do(chunk)) return;
  submit_ordered(
      rank, Collective::all_gather, timing, [this, rank, buf, chunk] { Communicator::all_gather(rank, buf, chunk); },
      [this, rank, buf, chunk](cudaStream_t stream) { enqueue_all_gather(rank, buf, chunk, stream); });
}

void NcclCommunicator::wait(int rank) {
  const bool any = !pending_[rank].empty();
  // The compute stream after whatever reached the comm stream (the optimizer waits on the GPU, not
  // here), a failure's too: the buckets a failed step's owner frees on the compute stream as it
  // unwinds must not go to a new allocation while a collective queued before the failure still reads
  // them (cudaFreeAsync's rule, what PyTorch's record_stream keeps).
  auto order = [&] {
    if (!any) return;
    CudaDevice& dev = gpu(rank);
    cudaEvent_t done = events_[rank].done.get();
    DP_CUDA_CHECK(cudaEventRecord(done, dev.comm_stream()));
    DP_CUDA_CHECK(cudaStreamWaitEvent(dev.stream(), done, 0));
  };
  try {
    Communicator::wait(rank);  // every bucket enqueued on the comm stream (or the first failure rethrown)
  } catch (...) {
    try {
      order();
    } catch (...) {  // the collective's failure is the one reported
    }
    throw;
  }
  {
    std::lock_guard lock(events_mu_);
    events_[rank].waited = events_[rank].count;
  }
  order();
}

std::unique_ptr<Communicator> make_communicator(std::vector<Device*> devices) {
  // One rank has nothing to reduce: no NCCL, but where the test build asks (failpoint::nccl_always).
  const bool always = failpoint::nccl_always();
  bool nccl = devices.size() >= 2 || always;
  std::set<int> ids;
  for (Device* d : devices) {
    if (d->kind() != DeviceKind::cuda || !dynamic_cast<CudaDevice*>(d)) nccl = false;
    ids.insert(d->id());
  }
  // A GPU shared by replicas: NCCL cannot rank it twice (asked anyway, it refuses: the fallback runs).
  if (ids.size() != devices.size() && !always) nccl = false;
  if (nccl) return std::make_unique<NcclCommunicator>(std::move(devices));
  return std::make_unique<Communicator>(std::move(devices));
}

}  // namespace dp
