// make_communicator for CUDA builds: NCCL's all-reduce when every device is a distinct GPU, the peer
// ring of engine/communicator.cpp otherwise (one device, a GPU shared by several replicas, or
// simulated devices). Broadcast, scatter, gather and reduce stay the base class's peer copies on
// both; only all_reduce, the collective that matters for DDP, goes through NCCL.
//
// Calls follow NCCL's one-thread-per-device model: every rank calls ncclAllReduce on its own
// communicator from its own thread, no group calls needed. With --allreduce naive the all-reduce is
// d2l's instead: ncclReduce to rank 0, then ncclBroadcast from it, one after the other on the same
// stream (every rank enqueues both, in that order).
//   all_reduce        — compute thread, compute stream; the engine synchronises after it.
//   all_reduce_async  — an event recorded on the compute stream right after the bucket's gradients
//                       were enqueued; the communication thread makes the comm stream wait on it and
//                       enqueues ncclAllReduce there, so backward keeps going on the compute stream.
//   wait              — the compute stream waits on an event recorded on the comm stream after the
//                       last bucket. No host synchronisation with the GPU.
// Before each ncclAllReduce the ranks meet at the communicator's host barrier. It costs microseconds
// and keeps the engine's failure rule: a rank that failed earlier aborts the barrier and the others
// throw instead of enqueuing an all-reduce whose peer never comes (which would hang the GPU).
//
// Bytes are counted by ring_all_reduce_traffic, as the base ring counts them, so reports compare across
// communicators. NCCL may choose another algorithm (tree, NVLS on NVSwitch systems) and move a
// different number of bytes over different links; the count is the ring model's, the bus-bandwidth
// convention of nccl-tests. The naive all-reduce is counted by naive_all_reduce_traffic, as the base
// class counts it.
#include <nccl.h>

#include <exception>
#include <set>
#include <utility>

#include "engine/communicator.h"
#include "engine/cuda/cuda_device.h"
#include "engine/error.h"
#include "kernels/cuda/check.h"

namespace dp {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::vector<Device*> devices);
  ~NcclCommunicator() override;

  void all_reduce(int rank, float* buf, int64_t count) override;
  void all_reduce_async(int rank, float* buf, int64_t count, Interval* timing = nullptr) override;
  void wait(int rank) override;

 private:
  CudaDevice& gpu(int rank) const { return static_cast<CudaDevice&>(*devices_[rank]); }
  void tally_all_reduce(int rank, int64_t count);
  // The all-reduce of all_reduce_algorithm(), enqueued on `stream`.
  void enqueue_all_reduce(int rank, float* buf, int64_t count, cudaStream_t stream);
  void release() noexcept;

  struct RankEvents {
    std::vector<cuda::Event> ready;  // one per bucket in flight: recorded on the compute stream
    size_t used = 0;
    cuda::Event done;  // recorded on the comm stream after the last bucket
  };
  std::vector<ncclComm_t> comms_;
  std::vector<RankEvents> events_;
};

NcclCommunicator::NcclCommunicator(std::vector<Device*> devices)
    : Communicator(std::move(devices)), comms_(devices_.size(), nullptr), events_(devices_.size()) {
  std::vector<int> ids;
  for (Device* d : devices_) ids.push_back(d->id());
  try {
    for (int r = 0; r < size(); ++r) devices_[r]->run([this, r] { events_[r].done = cuda::make_event(); }).get();
    // One call creates the whole clique. It runs on rank 0's compute thread, whose current device
    // is ids[0], so NCCL's save-and-restore of the current device never touches another GPU.
    devices_[0]
        ->run([this, &ids] {
          DP_NCCL_CHECK(ncclCommInitAll(comms_.data(), int(ids.size()), ids.data()));
          DP_CUDA_CHECK(cudaSetDevice(ids[0]));
        })
        .get();
  } catch (...) {
    release();
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  abort();    // a comm-thread task still at the barrier throws instead of waiting forever
  recover();  // and every task has finished before its state goes
  release();
}

void NcclCommunicator::release() noexcept {
  // Every rank's NCCL work must be complete before the communicators are destroyed.
  for (int r = 0; r < size(); ++r)
    devices_[r]
        ->run([this, r] {
          CudaDevice& d = gpu(r);
          DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(d.comm_stream()));
          DP_CUDA_CHECK_PRINT(cudaStreamSynchronize(d.stream()));
          events_[r] = RankEvents();
        })
        .wait();
  // With several communicators in one process the last ncclCommDestroy frees them all, so one thread
  // may destroy them one after another.
  devices_[0]
      ->run([this] {
        for (ncclComm_t& c : comms_)
          if (c) DP_NCCL_CHECK_PRINT(ncclCommDestroy(std::exchange(c, nullptr)));
        DP_CUDA_CHECK_PRINT(cudaSetDevice(devices_[0]->id()));
      })
      .wait();
}

void NcclCommunicator::tally_all_reduce(int rank, int64_t count) {
  const Traffic t = all_reduce_traffic(all_reduce_algorithm(), rank, size(), count);
  tally(rank, Collective::all_reduce, t.sent, t.received);
}

void NcclCommunicator::enqueue_all_reduce(int rank, float* buf, int64_t count, cudaStream_t stream) {
  if (all_reduce_algorithm() == AllReduceAlgorithm::ring) {
    DP_NCCL_CHECK(ncclAllReduce(buf, buf, size_t(count), ncclFloat, ncclSum, comms_[rank], stream));
    return;
  }
  // In place on every rank: rank 0's buf receives the sum (the others' are only read), then every
  // rank's buf receives rank 0's. Stream order puts the broadcast after the reduce.
  DP_NCCL_CHECK(ncclReduce(buf, buf, size_t(count), ncclFloat, ncclSum, 0, comms_[rank], stream));
  DP_NCCL_CHECK(ncclBroadcast(buf, buf, size_t(count), ncclFloat, 0, comms_[rank], stream));
}

void NcclCommunicator::all_reduce(int rank, float* buf, int64_t count) {
  if (size() == 1 || count == 0) return;
  tally_all_reduce(rank, count);
  barrier_.arrive_and_wait();
  enqueue_all_reduce(rank, buf, count, gpu(rank).stream());
}

// The timing is the host's view: from the communication thread reaching the barrier to ncclAllReduce
// returning, i.e. when the collective was enqueued, not when the GPU ran it (which follows on the comm
// stream and ends, at the latest, within the engine's all-reduce phase, which synchronises).
void NcclCommunicator::all_reduce_async(int rank, float* buf, int64_t count, Interval* timing) {
  if (size() == 1 || count == 0) return;
  tally_all_reduce(rank, count);
  RankEvents& ev = events_[rank];
  if (ev.used == ev.ready.size()) ev.ready.push_back(cuda::make_event());  // on the compute thread: its GPU
  cudaEvent_t ready = ev.ready[ev.used++].get();
  CudaDevice& dev = gpu(rank);
  DP_CUDA_CHECK(cudaEventRecord(ready, dev.stream()));  // after the bucket's gradient kernels
  submit_comm(rank, timing, [this, rank, buf, count, ready, &dev] {
    barrier_.arrive_and_wait();
    DP_CUDA_CHECK(cudaStreamWaitEvent(dev.comm_stream(), ready, 0));
    enqueue_all_reduce(rank, buf, count, dev.comm_stream());
  });
}

void NcclCommunicator::wait(int rank) {
  const bool any = !pending_[rank].empty();
  events_[rank].used = 0;
  Communicator::wait(rank);  // every bucket enqueued on the comm stream (or the first failure rethrown)
  if (!any) return;
  CudaDevice& dev = gpu(rank);
  cudaEvent_t done = events_[rank].done.get();
  DP_CUDA_CHECK(cudaEventRecord(done, dev.comm_stream()));
  DP_CUDA_CHECK(cudaStreamWaitEvent(dev.stream(), done, 0));  // the optimizer waits on the GPU, not here
}

}  // namespace

std::unique_ptr<Communicator> make_communicator(std::vector<Device*> devices) {
  bool nccl = devices.size() >= 2;  // one rank has nothing to reduce: skip NCCL's setup
  std::set<int> ids;
  for (Device* d : devices) {
    if (d->kind() != DeviceKind::cuda || !dynamic_cast<CudaDevice*>(d)) nccl = false;
    ids.insert(d->id());
  }
  if (ids.size() != devices.size()) nccl = false;  // a GPU shared by replicas: NCCL cannot rank it twice
  if (nccl) return std::make_unique<NcclCommunicator>(std::move(devices));
  return std::make_unique<Communicator>(std::move(devices));
}

}  // namespace dp
