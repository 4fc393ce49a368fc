// The communicator: the only way bytes cross between devices. Collectives are SPMD, as in NCCL and
// torch.distributed: every rank calls the same collectives in the same order from its own device
// thread. Each rank counts the bytes it sends and receives, per collective.
//
// The base class implements them over Device::copy_from_peer and the device's add kernel, with a
// barrier between phases: on simulated devices that is memcpy between host buffers; on CUDA it is
// cudaMemcpyPeerAsync (the path for several replicas on one GPU). NCCL overrides all_reduce.
//
// Every wait for peers is bounded by the collective timeout (set_timeout, dp_train --timeout; wait.h):
// a rank that waits longer at a barrier aborts the collective on every rank and throws TimedOut,
// naming the collective and the ranks that never came. A rank leaving a collective so (or by Aborted)
// first waits for any peer still copying from the buffer it published, which it may free once it
// returns (await_readers).
//
// The gradient collectives (reduce, all_reduce, reduce_scatter and their asynchronous forms) take the
// buffer's element type (kernels/dtype.h; --grad-dtype): float32, or bf16 or fp16 as 16-bit bits. In a
// 16-bit type every partial sum is rounded to the type as it is formed (Ops::add_typed), hop by hop in
// the ring, as NCCL's ring reduces a bf16 or half buffer; bytes are counted at the type's size.
//
// all_reduce runs one of two algorithms (set_all_reduce_algorithm, dp_train --allreduce):
//   ring  — reduce-scatter then all-gather (DDP's, NCCL's): every rank moves about 2(n-1)/n of the buffer.
//   naive — "Dive into Deep Learning"'s hand-written allreduce: every rank's buffer is reduced into
//           rank 0 (reduce), then rank 0 sends the sum back to every rank (broadcast). Rank 0 moves
//           (n-1) buffers each way, the others one.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/wait.h"

namespace dp {

enum class Collective { scatter, gather, broadcast, reduce, all_reduce, reduce_scatter, all_gather };
inline constexpr int kCollectives = 7;
const char* collective_name(Collective c);

enum class AllReduceAlgorithm { ring, naive };
// "ring" / "naive"; parse throws UsageError naming --allreduce and the accepted values.
const char* all_reduce_name(AllReduceAlgorithm a);
AllReduceAlgorithm parse_all_reduce(const std::string& s);

struct Traffic {
  int64_t sent = 0, received = 0;  // bytes
};

// A barrier that can be aborted: waiting ranks then throw Aborted instead of hanging. A rank whose
// deadline passes before every rank arrived aborts it (the others throw Aborted rather than each
// wait out its own deadline) and throws Expired, which says who never came.
class Barrier {
 public:
  struct Expired : std::runtime_error {
    explicit Expired(std::vector<int> missing)
        : std::runtime_error("the barrier's deadline passed"), missing(std::move(missing)) {}
    std::vector<int> missing;  // the ranks that had not arrived, in rank order
  };

  explicit Barrier(int n) : n_(n), arrived_(size_t(n), false) {}
  void arrive_and_wait(int rank, const Deadline& deadline);
  void abort();
  void reset();  // only when no rank is inside
  // Lock-free: the wait loops (wait.h) ask it between polls.
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int n_, waiting_ = 0;
  std::vector<bool> arrived_;  // this generation's arrivals, by rank
  int64_t generation_ = 0;
  std::atomic<bool> aborted_{false};  // written under mu_
};

// When a collective ran on a rank's communication thread: from the moment that thread began it
// (waiting for its peers included) until it returned. Written by the communication thread, read by
// the rank's compute thread after wait(), whose future orders the two.
struct Interval {
  std::chrono::steady_clock::time_point start, end;
};

// Chunk sizes that differ by at most one, larger first: 10 over 3 -> 4, 3, 3.
std::vector<int64_t> even_chunks(int64_t count, int n);
// Where each of back-to-back chunks starts: the running sum of the counts before it (4, 3, 3 -> 0, 4, 7).
std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& counts);

// The bytes rank `rank` of n sends and receives in a ring all-reduce of count elements of type t
// (floats unless given; kernels/dtype.h): reduce-scatter,
// then all-gather, over even_chunks(count, n), so 2 (n-1) chunks each way. Every communicator counts
// its ring all-reduces by this one model (NCCL may pick another algorithm; the count stays the ring's,
// as nccl-tests' bus bandwidth does), and dp_bench's byte model predicts with it. These models are
// defined beside the step's byte model, in byte_model.cpp.
Traffic ring_all_reduce_traffic(int rank, int n, int64_t count, DType t = DType::fp32);
// Its two halves: reduce-scatter's (n-1) chunks each way, then all-gather's (they sum to the above).
Traffic ring_reduce_scatter_traffic(int rank, int n, int64_t count, DType t = DType::fp32);
Traffic ring_all_gather_traffic(int rank, int n, int64_t count, DType t = DType::fp32);
// The ring chunk rank `rank` of n holds the sum of after ring_reduce_scatter.
inline int ring_owned_chunk(int rank, int n) { return (rank + 1) % n; }
// The bytes rank `rank` of n sends and receives in a naive all-reduce of count floats (P): reduce to
// rank 0, then broadcast from it. Rank 0 receives every peer's whole buffer, (n-1)·P·4 bytes, and
// sends the sum to each of them, (n-1)·P·4 bytes; every other rank sends P·4 and receives P·4. Every
// communicator counts its naive all-reduces by this model (NCCL's ncclReduce + ncclBroadcast move
// the same buffers), and dp_bench's byte model predicts with it.
Traffic naive_all_reduce_traffic(int rank, int n, int64_t count, DType t = DType::fp32);
// The model of the given algorithm.
Traffic all_reduce_traffic(AllReduceAlgorithm a, int rank, int n, int64_t count, DType t = DType::fp32);

class Communicator {
 public:
  explicit Communicator(std::vector<Device*> devices);
  virtual ~Communicator() = default;
  int size() const { return int(devices_.size()); }
  Device& device(int rank) const { return *devices_[rank]; }

  // root's buf -> every other rank's buf.
  virtual void broadcast(int rank, float* buf, int64_t count, int root);
  // root's send holds the chunks back to back (counts[r] floats each); rank r != root receives its
  // chunk into recv. The root's own chunk stays in place (the caller reads it at its offset).
  virtual void scatter(int rank, const float* send, float* recv, const std::vector<int64_t>& counts, int root);
  // Inverse of scatter: rank r's send (counts[r] floats) lands at its offset in root's recv; the
  // root's own chunk is copied locally (not counted: it does not leave the device).
  virtual void gather(int rank, const float* send, float* recv, const std::vector<int64_t>& counts, int root);
  // Sum of every rank's buf into root's buf. The root receives each peer's whole buffer into its
  // comm scratch ((n-1) * count floats, as nn.DataParallel's reduce_add gathers before it sums),
  // then adds them in rank order.
  virtual void reduce(int rank, void* buf, int64_t count, int root, DType type = DType::fp32);
  // Sum of every rank's buf into every rank's buf, by all_reduce_algorithm(); every rank ends with
  // the same bits. ring: reduce-scatter then all-gather over n even chunks, each rank sends and
  // receives 2 (n-1) chunks. naive: reduce to rank 0 as reduce() does (its comm scratch holds the
  // (n-1) peer buffers), then broadcast from rank 0. Bytes are counted under Collective::all_reduce.
  virtual void all_reduce(int rank, void* buf, int64_t count, DType type = DType::fp32);
  // Starts all_reduce on the rank's communication thread (buckets overlapping backward); wait()
  // returns when every started one is done and rethrows the first failure. With `timing` (a trace is
  // on) the communication thread stamps it, which must outlive the wait().
  virtual void all_reduce_async(int rank, void* buf, int64_t count, Interval* timing = nullptr,
                                DType type = DType::fp32);
  virtual void wait(int rank);

  // The sharded collectives (ZeRO, FSDP), in place, as NCCL's in-place forms: buf holds world()
  // chunks of `chunk` floats back to back, one per device of the job, and device `rank` owns chunk
  // shard(rank). reduce_scatter: afterwards the owned chunk holds the sum over every device of that
  // chunk; the device's other chunks are left holding partial sums. all_gather: every device's owned
  // chunk goes to the same place in every device's buf. Each rank sends and receives (world - 1)
  // chunks in either (the ring; counted so on every communicator, as nccl-tests counts them).
  virtual void reduce_scatter(int rank, void* buf, int64_t chunk, DType type = DType::fp32);
  virtual void all_gather(int rank, float* buf, int64_t chunk);
  // Their asynchronous forms, started on the rank's communication thread after the collectives
  // started before them (zero2's and zero3's buckets overlapping backward), waited for by wait() as
  // all_reduce_async is. reduce_scatter_async also leaves the owned chunk of the sum in `out` (chunk
  // floats outside buf; NCCL writes it there directly). While any is pending, every collective of
  // the rank goes through this queue, as the bucketed all-reduce's do. `out` is of the buffer's type.
  virtual void reduce_scatter_async(int rank, void* buf, int64_t chunk, void* out, Interval* timing = nullptr,
                                    DType type = DType::fp32);
  virtual void all_gather_async(int rank, float* buf, int64_t chunk, Interval* timing = nullptr);
  // The devices of the job (this communicator's in one process) and the chunk a device owns: its rank
  // in the job, unless the communicator lays the chunks out otherwise (ProcessCommunicator).
  virtual int world() const { return size(); }
  virtual int shard(int rank) const { return rank; }
  // What carries the collectives, for the report: "peer copies" here; NCCL's and the job's say theirs
  // (NCCL's after its start: "nccl", or why it fell back). Between steps.
  virtual std::string transport() const { return "peer copies"; }

  // Grows the rank's ring scratch to `floats` (the largest chunk of the collectives to come), on the
  // rank's thread while no collective of it runs: allocated there, not on the communication thread.
  void reserve_scratch(int rank, int64_t floats) { scratch(rank, floats * int64_t(sizeof(float))); }
  // Called when a rank fails: every rank waiting in, or later entering, a collective throws Aborted.
  void abort();
  // After a failed step, once every rank has returned (no rank thread uses the communicator): drop
  // pending work and re-arm. NCCL's also ends every NCCL operation still queued on the GPUs, so that
  // none of them writes a buffer the next step uses.
  virtual void recover();

  // Set before the first collective (the engine does so as it is built), never while one runs.
  void set_all_reduce_algorithm(AllReduceAlgorithm a) { all_reduce_algorithm_ = a; }
  AllReduceAlgorithm all_reduce_algorithm() const { return all_reduce_algorithm_; }
  // Seconds a rank waits for its peers in a collective before it fails the collective on every rank
  // (TimedOut); kDefaultTimeout unless set. Set as the algorithm is.
  void set_timeout(double seconds) { timeout_ = seconds; }
  double timeout() const { return timeout_; }

  Traffic traffic(int rank, Collective c) const { return traffic_[rank][int(c)]; }
  // Bytes between this rank's device and the others of its process, every collective together.
  Traffic total(int rank) const;
  // Bytes this rank's device moved to and from other processes (ProcessCommunicator); none in one
  // process.
  Traffic inter_process(int rank) const;
  void reset_traffic();

 protected:
  void tally(int rank, Collective c, int64_t sent_bytes, int64_t received_bytes) {
    traffic_[rank][int(c)].sent += sent_bytes;
    traffic_[rank][int(c)].received += received_bytes;
  }
  void tally_inter(int rank, Traffic t) {
    inter_[size_t(rank)].sent += t.sent;
    inter_[size_t(rank)].received += t.received;
  }
  // Runs fn on the rank's communication thread, stamping `timing` around it when given; a failure
  // aborts every rank's collectives, and wait() rethrows it.
  template <class F>
  void submit_comm(int rank, Interval* timing, F fn) {
    pending_[rank].push_back(devices_[rank]->run_comm([this, timing, fn = std::move(fn)] {
      try {
        if (timing) timing->start = std::chrono::steady_clock::now();
        fn();
        if (timing) timing->end = std::chrono::steady_clock::now();
      } catch (...) {
        abort();
        throw;
      }
    }));
  }
  void* scratch(int rank, int64_t bytes);  // comm buffer on the rank's device, grown on demand
  // Element i of a buffer of type t: where a chunk starts.
  static std::byte* at(void* p, int64_t i, DType t) { return static_cast<std::byte*>(p) + i * dtype_size(t); }
  static const std::byte* at(const void* p, int64_t i, DType t) {
    return static_cast<const std::byte*>(p) + i * dtype_size(t);
  }
  // Every rank's meeting point within collective c: the barrier, with the timeout (and a test
  // build's stall, engine/failpoint.h). Past the deadline it throws TimedOut, naming the collective, this rank's device
  // and the ranks that never came. The second form names what it waits in (`what`, e.g. "the start of NCCL") and takes
  // its own deadline.
  // A rank that leaves by an exception first waits (await_readers) until no peer may still be
  // reading the buffers it published, so that it can free them.
  void meet(int rank, Collective c);
  void meet(int rank, const std::string& what, const Deadline& deadline);
  void sync_and_wait(int rank, Collective c);  // finish the rank's queued copies, then meet
  // After an in-place reduce_scatter of buf: the rank's owned chunk of the sum into out (the
  // asynchronous form's result where it runs the in-place one).
  void copy_owned_chunk(int rank, const void* buf, int64_t chunk, void* out, DType type);
  // broadcast and reduce, counting their bytes under `as` (the naive all-reduce is both, counted
  // as an all_reduce); ring_all_reduce is the ring.
  void broadcast_as(Collective as, int rank, void* buf, int64_t count, int root, DType type);
  void reduce_as(Collective as, int rank, void* buf, int64_t count, int root, DType type);
  void ring_all_reduce(int rank, void* buf, int64_t count, DType type);
  // The ring's halves (communicator.cpp) over chunks of the given sizes back to back: afterwards (in
  // reduce-scatter) or before (in all-gather) rank r holds chunk (r + lead) % n; the bytes are counted
  // under `as`. The all-reduce's ring leads with 1 (ring_owned_chunk), the sharded collectives with 0.
  // reduce-scatter publishes buf and meets first; all-gather does when `publish` (else it reads what
  // the reduce-scatter before it published).
  void ring_reduce_scatter(int rank, void* buf, const std::vector<int64_t>& chunks, int lead, Collective as,
                           DType type);
  void ring_all_gather(int rank, void* buf, const std::vector<int64_t>& chunks, int lead, Collective as, bool publish,
                       DType type);

  // A collective that reads its peers' published buffers (the ring's halves, broadcast, reduce,
  // scatter, gather), from its start to its return: while a rank is inside one and not at the
  // barrier it may be copying from a peer (its copies have landed once it meets: sync_and_wait
  // synchronizes first).
  class Inside {
   public:
    Inside(Communicator& c, int rank);
    ~Inside();
    Inside(const Inside&) = delete;
    Inside& operator=(const Inside&) = delete;

   private:
    Communicator& c_;
    int rank_;
  };
  // Until every peer is at the barrier or outside those collectives (bounded by the timeout).
  void await_readers(int rank);

  std::vector<Device*> devices_;
  Barrier barrier_;
  std::mutex readers_mu_;
  std::condition_variable readers_cv_;
  std::vector<int> inside_;         // per rank: the collectives above it is in (nested: all-reduce's halves)
  std::vector<char> at_barrier_;    // per rank: in meet
  std::vector<const void*> slots_;  // each rank publishes a pointer for the others to read
  std::vector<Buffer> scratch_;
  std::vector<std::array<Traffic, kCollectives>> traffic_;
  std::vector<Traffic> inter_;  // per rank: to and from other processes
  std::vector<std::vector<std::future<void>>> pending_;
  AllReduceAlgorithm all_reduce_algorithm_ = AllReduceAlgorithm::ring;
  double timeout_ = kDefaultTimeout;
};

// NCCL when every device is a distinct GPU, the peer ring otherwise (kernels/cuda/ or the stub).
std::unique_ptr<Communicator> make_communicator(std::vector<Device*> devices);

}  // namespace dp
