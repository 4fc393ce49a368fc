#include "engine/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>

#include "engine/error.h"
#include "engine/failpoint.h"

namespace dp {
namespace {

// A collective as messages name it: "the all-reduce", "the broadcast".
const char* collective_text(Collective c) {
  static const char* names[kCollectives] = {"the scatter",    "the gather",         "the broadcast", "the reduce",
                                            "the all-reduce", "the reduce-scatter", "the all-gather"};
  return names[int(c)];
}

}  // namespace

const char* collective_name(Collective c) {
  static const char* names[kCollectives] = {"scatter",    "gather",         "broadcast", "reduce",
                                            "all_reduce", "reduce_scatter", "all_gather"};
  return names[int(c)];
}

const char* all_reduce_name(AllReduceAlgorithm a) { return a == AllReduceAlgorithm::ring ? "ring" : "naive"; }

AllReduceAlgorithm parse_all_reduce(const std::string& s) {
  if (s == "ring") return AllReduceAlgorithm::ring;
  if (s == "naive") return AllReduceAlgorithm::naive;
  throw UsageError("--allreduce: '" + s +
                   "' is not an all-reduce algorithm; use ring (reduce-scatter + all-gather, as DDP) or naive "
                   "(reduce to device 0 + broadcast, as d2l's hand-written allreduce)");
}

void Barrier::arrive_and_wait(int rank, const Deadline& deadline) {
  std::unique_lock lock(mu_);
  if (aborted_) throw Aborted();
  int64_t gen = generation_;
  if (++waiting_ == n_) {
    waiting_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), false);
    ++generation_;
    cv_.notify_all();
    return;
  }
  arrived_[size_t(rank)] = true;
  if (!cv_.wait_until(lock, deadline.at, [&] { return generation_ != gen || aborted_; })) {
    std::vector<int> missing;
    for (int r = 0; r < n_; ++r)
      if (!arrived_[size_t(r)]) missing.push_back(r);
    aborted_ = true;  // the ranks that did arrive stop waiting now, with Aborted
    cv_.notify_all();
    throw Expired(std::move(missing));
  }
  if (generation_ == gen) throw Aborted();
}

void Barrier::abort() {
  std::lock_guard lock(mu_);
  aborted_ = true;
  cv_.notify_all();
}

void Barrier::reset() {
  std::lock_guard lock(mu_);
  aborted_ = false;
  waiting_ = 0;
  std::fill(arrived_.begin(), arrived_.end(), false);
  ++generation_;
}

std::vector<int64_t> even_chunks(int64_t count, int n) {
  std::vector<int64_t> c(n, count / n);
  for (int64_t i = 0; i < count % n; ++i) ++c[i];
  return c;
}

std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> at(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), at.begin(), int64_t(0));
  return at;
}

Communicator::Communicator(std::vector<Device*> devices)
    : devices_(std::move(devices)),
      barrier_(int(devices_.size())),
      inside_(devices_.size(), 0),
      at_barrier_(devices_.size(), 0),
      slots_(devices_.size()),
      scratch_(devices_.size()),
      traffic_(devices_.size()),
      inter_(devices_.size()),
      pending_(devices_.size()) {
  failpoint::communicator_built(*this);
}

void Communicator::meet(int rank, Collective c) {
  failpoint::collective(
      *this, rank, c, [this] { return barrier_.aborted(); }, timeout_);
  meet(rank, collective_text(c), Deadline::after(timeout_));
}

Communicator::Inside::Inside(Communicator& c, int rank) : c_(c), rank_(rank) {
  std::lock_guard lock(c_.readers_mu_);
  ++c_.inside_[size_t(rank_)];
}

Communicator::Inside::~Inside() {
  std::lock_guard lock(c_.readers_mu_);
  --c_.inside_[size_t(rank_)];
  c_.readers_cv_.notify_all();
}

// A rank leaving by an exception (an abort, or its deadline) may free what it published as soon as it
// returns (a zero2 bucket, a step's scratch), while a peer that passed the last meet with it still
// copies from it. A peer inside a collective finishes its copies and comes to the barrier, where it
// finds the abort and leaves too. Bounded, so that a peer stuck in a copy cannot hang this rank: by
// the timeout, and never less than kReadersGrace (a copy slower than a short --timeout still lands).
void Communicator::await_readers(int rank) {
  constexpr double kReadersGrace = 10.0;  // seconds
  std::unique_lock lock(readers_mu_);
  readers_cv_.wait_until(lock, Deadline::after(std::max(timeout_, kReadersGrace)).at, [&] {
    for (size_t q = 0; q < inside_.size(); ++q)
      if (int(q) != rank && inside_[q] > 0 && !at_barrier_[q]) return false;
    return true;
  });
}

void Communicator::meet(int rank, const std::string& what, const Deadline& deadline) {
  struct AtBarrier {
    Communicator& c;
    int rank;
    explicit AtBarrier(Communicator& comm, int r) : c(comm), rank(r) { set(1); }
    ~AtBarrier() { set(0); }
    void set(char v) {
      std::lock_guard lock(c.readers_mu_);
      c.at_barrier_[size_t(rank)] = v;
      c.readers_cv_.notify_all();
    }
  } at_barrier(*this, rank);
  try {
    barrier_.arrive_and_wait(rank, deadline);
  } catch (const Barrier::Expired& e) {
    await_readers(rank);
    // Device names, with the rank where replicas share a device (--gpus 0,0 names both cuda:0).
    auto who = [&](int r) {
      const std::string name = devices_[r]->name();
      for (int q = 0; q < size(); ++q)
        if (q != r && devices_[q]->name() == name) return name + " (rank " + std::to_string(r) + ")";
      return name;
    };
    std::string missing;
    for (size_t i = 0; i < e.missing.size(); ++i)
      missing += (i == 0 ? "" : i + 1 == e.missing.size() ? " and " : ", ") + who(e.missing[i]);
    throw TimedOut(devices_[rank]->id(),
                   timeout_message(what + " on " + who(rank), deadline.seconds,
                                   missing + (e.missing.size() == 1 ? " stopped answering (it never joined)"
                                                                    : " stopped answering (they never joined)")));
  } catch (...) {  // Aborted
    await_readers(rank);
    throw;
  }
}

void* Communicator::scratch(int rank, int64_t bytes) {
  if (scratch_[rank].bytes() < size_t(bytes)) {
    scratch_[rank].reset();
    scratch_[rank] = devices_[rank]->alloc(size_t(bytes), Category::comm);
  }
  return scratch_[rank].data();
}

void Communicator::sync_and_wait(int rank, Collective c) {
  devices_[rank]->synchronize();
  meet(rank, c);
}

Traffic Communicator::inter_process(int rank) const { return inter_[size_t(rank)]; }

Traffic Communicator::total(int rank) const {
  Traffic t;
  for (auto& c : traffic_[rank]) t.sent += c.sent, t.received += c.received;
  return t;
}

void Communicator::reset_traffic() {
  for (auto& r : traffic_) r = {};
  for (auto& r : inter_) r = {};
}

void Communicator::abort() { barrier_.abort(); }

void Communicator::recover() {
  for (auto& p : pending_) {
    for (auto& f : p)
      if (f.valid()) f.wait();
    p.clear();
  }
  barrier_.reset();
}

void Communicator::broadcast(int rank, float* buf, int64_t count, int root) {
  broadcast_as(Collective::broadcast, rank, buf, count, root, DType::fp32);
}

void Communicator::broadcast_as(Collective as, int rank, void* buf, int64_t count, int root, DType type) {
  const int n = size();
  if (n == 1 || count == 0) return;
  Inside inside(*this, rank);
  const int64_t bytes = count * dtype_size(type);
  slots_[rank] = buf;
  meet(rank, as);
  if (rank == root) {
    tally(rank, as, (n - 1) * bytes, 0);
  } else {
    devices_[rank]->copy_from_peer(buf, *devices_[root], slots_[root], size_t(bytes));
    tally(rank, as, 0, bytes);
  }
  sync_and_wait(rank, as);  // the root may not touch buf until every copy has landed
}

void Communicator::scatter(int rank, const float* send, float* recv, const std::vector<int64_t>& counts, int root) {
  const int n = size();
  if (n == 1) return;
  Inside inside(*this, rank);
  slots_[rank] = send;
  meet(rank, Collective::scatter);
  const int64_t offset = chunk_offsets(counts)[size_t(rank)];
  if (rank == root) {
    int64_t sent = 0;
    for (int r = 0; r < n; ++r)
      if (r != root) sent += counts[r];
    tally(rank, Collective::scatter, sent * int64_t(sizeof(float)), 0);
  } else if (counts[rank] > 0) {
    devices_[rank]->copy_from_peer(recv, *devices_[root], at(slots_[root], offset, DType::fp32),
                                   size_t(counts[rank]) * sizeof(float));
    tally(rank, Collective::scatter, 0, counts[rank] * int64_t(sizeof(float)));
  }
  sync_and_wait(rank, Collective::scatter);
}

void Communicator::gather(int rank, const float* send, float* recv, const std::vector<int64_t>& counts, int root) {
  const int n = size();
  const int64_t offset = chunk_offsets(counts)[size_t(rank)];
  if (rank == root && counts[rank] > 0 && send != recv + offset)
    devices_[rank]->copy(recv + offset, send, size_t(counts[rank]) * sizeof(float));
  if (n == 1) return;
  Inside inside(*this, rank);
  slots_[rank] = send;
  meet(rank, Collective::gather);
  if (rank == root) {
    int64_t received = 0, pos = 0;
    for (int r = 0; r < n; ++r) {
      if (r != root && counts[r] > 0) {
        devices_[rank]->copy_from_peer(recv + pos, *devices_[r], slots_[r], size_t(counts[r]) * sizeof(float));
        received += counts[r];
      }
      pos += counts[r];
    }
    tally(rank, Collective::gather, 0, received * int64_t(sizeof(float)));
  } else {
    tally(rank, Collective::gather, counts[rank] * int64_t(sizeof(float)), 0);
  }
  sync_and_wait(rank, Collective::gather);
}

void Communicator::reduce(int rank, void* buf, int64_t count, int root, DType type) {
  reduce_as(Collective::reduce, rank, buf, count, root, type);
}

void Communicator::reduce_as(Collective as, int rank, void* buf, int64_t count, int root, DType type) {
  const int n = size();
  if (n == 1 || count == 0) return;
  Inside inside(*this, rank);
  const int64_t bytes = count * dtype_size(type);
  void* recv = rank == root ? scratch(rank, (n - 1) * bytes) : nullptr;  // (n-1, count)
  slots_[rank] = buf;
  meet(rank, as);
  if (rank == root) {
    int slot = 0;
    for (int r = 0; r < n; ++r) {
      if (r == root) continue;
      devices_[rank]->copy_from_peer(at(recv, slot * count, type), *devices_[r], slots_[r], size_t(bytes));
      ++slot;
    }
    tally(rank, as, 0, (n - 1) * bytes);
  } else {
    tally(rank, as, bytes, 0);
  }
  sync_and_wait(rank, as);  // peers may reuse their buffers once the root holds the copies
  if (rank == root)
    for (int s = 0; s < n - 1; ++s) devices_[rank]->ops().add_typed(type, count, at(recv, s * count, type), buf);
}

void Communicator::all_reduce(int rank, void* buf, int64_t count, DType type) {
  if (all_reduce_algorithm_ == AllReduceAlgorithm::ring) return ring_all_reduce(rank, buf, count, type);
  // d2l's allreduce: every buffer added into rank 0's, in rank order, then rank 0's sum copied to
  // every rank, which so holds the same bits. The broadcast's copies come after rank 0's adds (done
  // in place on simulated devices; on CUDA copy_from_peer waits on rank 0's stream).
  reduce_as(Collective::all_reduce, rank, buf, count, 0, type);
  broadcast_as(Collective::all_reduce, rank, buf, count, 0, type);
}

void Communicator::ring_all_reduce(int rank, void* buf, int64_t count, DType type) {
  if (size() == 1 || count == 0) return;
  const std::vector<int64_t> chunks = even_chunks(count, size());
  ring_reduce_scatter(rank, buf, chunks, 1, Collective::all_reduce, type);
  ring_all_gather(rank, buf, chunks, 1, Collective::all_reduce, /*publish=*/false, type);
}

void Communicator::reduce_scatter(int rank, void* buf, int64_t chunk, DType type) {
  if (size() == 1 || chunk == 0) return;
  ring_reduce_scatter(rank, buf, std::vector<int64_t>(size_t(size()), chunk), 0, Collective::reduce_scatter, type);
}

void Communicator::all_gather(int rank, float* buf, int64_t chunk) {
  if (size() == 1 || chunk == 0) return;
  ring_all_gather(rank, buf, std::vector<int64_t>(size_t(size()), chunk), 0, Collective::all_gather, true, DType::fp32);
}

// The ring's two halves. After reduce_scatter rank r holds the sum of chunk (r + lead) % n and every
// rank has met; all_gather passes the finished chunks around. Within an all-reduce it reads the
// buffers reduce_scatter published: whatever a caller does to its chunk between the two
// (ProcessCommunicator: the all-reduce across processes) it must finish and meet before all_gather.
void Communicator::ring_reduce_scatter(int rank, void* buf, const std::vector<int64_t>& chunk, int lead, Collective as,
                                       DType type) {
  Inside inside(*this, rank);
  const int n = size();
  const int64_t each = dtype_size(type);  // bytes an element
  const std::vector<int64_t> offset = chunk_offsets(chunk);
  void* recv = scratch(rank, *std::max_element(chunk.begin(), chunk.end()) * each);  // (largest chunk)
  const int prev = (rank + n - 1) % n;
  slots_[rank] = buf;
  meet(rank, as);
  Device& dev = *devices_[rank];
  // At step s rank r sends chunk (r + lead - 1 - s) to r + 1 and receives chunk (r + lead - 2 - s) from
  // r - 1, adding it into its own. Nobody writes a chunk while its neighbour reads it.
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = (rank + lead - 1 - s + 2 * n) % n, recv_c = (rank + lead - 2 - s + 2 * n) % n;
    tally(rank, as, chunk[size_t(send_c)] * each, chunk[size_t(recv_c)] * each);
    if (chunk[recv_c] > 0)
      dev.copy_from_peer(recv, *devices_[prev], at(slots_[prev], offset[recv_c], type), size_t(chunk[recv_c] * each));
    sync_and_wait(rank, as);
    dev.ops().add_typed(type, chunk[recv_c], recv, at(buf, offset[recv_c], type));
    sync_and_wait(rank, as);
  }
}

void Communicator::ring_all_gather(int rank, void* buf, const std::vector<int64_t>& chunk, int lead, Collective as,
                                   bool publish, DType type) {
  Inside inside(*this, rank);
  const int n = size();
  const int64_t each = dtype_size(type);  // bytes an element
  const std::vector<int64_t> offset = chunk_offsets(chunk);
  const int prev = (rank + n - 1) % n;
  Device& dev = *devices_[rank];
  if (publish) {
    slots_[rank] = buf;
    sync_and_wait(rank, as);  // the owned chunk is written before a neighbour reads it
  }
  // Rank r owns chunk (r + lead); at step s it sends chunk (r + lead - s) to r + 1 and receives chunk
  // (r + lead - 1 - s) from r - 1.
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = (rank + lead - s + 2 * n) % n, recv_c = (rank + lead - 1 - s + 2 * n) % n;
    tally(rank, as, chunk[size_t(send_c)] * each, chunk[size_t(recv_c)] * each);
    if (chunk[recv_c] > 0)
      dev.copy_from_peer(at(buf, offset[recv_c], type), *devices_[prev], at(slots_[prev], offset[recv_c], type),
                         size_t(chunk[recv_c] * each));
    sync_and_wait(rank, as);
  }
}

void Communicator::all_reduce_async(int rank, void* buf, int64_t count, Interval* timing, DType type) {
  submit_comm(rank, timing, [this, rank, buf, count, type] { all_reduce(rank, buf, count, type); });
}

void Communicator::reduce_scatter_async(int rank, void* buf, int64_t chunk, void* out, Interval* timing, DType type) {
  submit_comm(rank, timing, [this, rank, buf, chunk, out, type] {
    reduce_scatter(rank, buf, chunk, type);
    copy_owned_chunk(rank, buf, chunk, out, type);
  });
}

void Communicator::copy_owned_chunk(int rank, const void* buf, int64_t chunk, void* out, DType type) {
  if (out == at(buf, int64_t(shard(rank)) * chunk, type)) return;  // already there (in place)
  devices_[rank]->copy(out, at(buf, int64_t(shard(rank)) * chunk, type), size_t(chunk * dtype_size(type)));
}

void Communicator::all_gather_async(int rank, float* buf, int64_t chunk, Interval* timing) {
  submit_comm(rank, timing, [this, rank, buf, chunk] { all_gather(rank, buf, chunk); });
}

void Communicator::wait(int rank) {
  std::exception_ptr first;
  for (auto& f : pending_[rank]) {
    try {
      f.get();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  pending_[rank].clear();
  if (first) std::rethrow_exception(first);
}

}  // namespace dp
