// make_communicator for CUDA builds: NCCL's all-reduce when every device is a distinct GPU, the peer
// ring of engine/communicator.cpp otherwise (one device, a GPU shared by several replicas, or
// simulated devices). Broadcast, scatter, gather and reduce stay the base class's peer copies on
// both; only all_reduce, the collective that matters for DDP, goes through NCCL.
//
// Calls follow NCCL's one-thread-per-device model: every rank calls ncclAllReduce on its own
// communicator from its own thread, no group calls. With --allreduce naive it is d2l's all-reduce:
// ncclReduce to rank 0, then ncclBroadcast from it, every rank enqueuing both in turn on one stream.
//   all_reduce        — compute thread, compute stream; the engine synchronises after it.
//   all_reduce_async  — an event recorded on the compute stream right after the bucket's gradients
//                       were enqueued; the communication thread makes the comm stream wait on it and
//                       enqueues ncclAllReduce there, so backward keeps going on the compute stream.
//                       reduce_scatter_async and all_gather_async alike (submit_ordered).
//   wait              — the compute stream waits on an event recorded on the comm stream after the
//                       last bucket. No host synchronisation with the GPU.
// Before each ncclAllReduce the ranks meet at the communicator's host barrier. It costs microseconds
// and keeps the engine's failure rule: a rank that failed earlier aborts the barrier and the others
// throw instead of enqueuing an all-reduce whose peer never comes (which would hang the GPU).
//
// The clique's life (its start at the first collective, the watches on its waits, its end after a
// failure or at the end of the run) is nccl_clique.cpp's. The class is declared in nccl_communicator.h:
// the job's form (several processes, one clique over all their GPUs; nccl_process_communicator.cpp)
// derives from it and replaces the start, the byte count and the broadcast; the waits, events, watches
// and ends are the ones here and in nccl_clique.cpp.
//
// Bytes are counted as the base class counts them (ring_all_reduce_traffic, naive_all_reduce_traffic),
// so reports compare across communicators. NCCL may choose another algorithm (tree, NVLS on NVSwitch)
// and move other bytes over other links; the count is the ring's, nccl-tests' bus-bandwidth convention.
#include "engine/cuda/nccl_communicator.h"

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

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
  const std::deque<Queued>& queued = events_[rank].queued;
  for (size_t i = 0; i < queued.size(); ++i) {
    if (event_done(queued[i].finished)) continue;
    return "NCCL's " + std::string(collective_name(queued[i].kind)) + " number " + std::to_string(queued[i].number) +
           " on " + devices_[rank]->name() + " (the oldest not finished; " + std::to_string(queued.size() - i - 1) +
           " more queued behind it)";
  }
  return "the work queued on " + devices_[rank]->name() + " (its kernels and NCCL's collectives)";
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
    q.kind = kind, q.number = ++ev.count;
    ready = q.ready.get();
    finished = q.finished.get();
    ev.queued.push_back(std::move(q));
  }
  DP_CUDA_CHECK(cudaEventRecord(ready, dev.stream()));  // after the kernels that wrote the buffer
  // Whether NCCL or the peer ring runs it is decided on the communication thread, where the clique
  // starts: the compute thread may not read the outcome while rank 0 writes it.
  submit_comm(rank, timing, [this, rank, ready, finished, &dev, peer = std::move(peer), nccl = std::move(nccl)] {
    // The peer ring's copies go on the compute stream, after the kernels that wrote the buffer.
    if (!use_nccl(rank)) return peer();
    DP_CUDA_CHECK(cudaStreamWaitEvent(dev.comm_stream(), ready, 0));
    nccl(dev.comm_stream());  // meets the other ranks first, as the synchronous forms do
    DP_CUDA_CHECK(cudaEventRecord(finished, dev.comm_stream()));  // for a timeout's message
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
