#include "engine/byte_model.h"

#include <algorithm>

namespace dp {

// The per-rank models communicator.h declares, which every communicator counts its collectives by.
namespace {
// Bytes of chunk c of count elements of type t split evenly over n, c taken modulo n.
int64_t chunk_bytes(const std::vector<int64_t>& chunk, int n, int c, DType t) {
  return chunk[size_t((c % n + n) % n)] * dtype_size(t);
}
}  // namespace

Traffic ring_reduce_scatter_traffic(int rank, int n, int64_t count, DType type) {
  Traffic t;
  if (n == 1 || count == 0) return t;
  const std::vector<int64_t> chunk = even_chunks(count, n);
  for (int s = 0; s < n - 1; ++s) {  // step s: chunk (rank - s) out, chunk (rank - 1 - s) in
    t.sent += chunk_bytes(chunk, n, rank - s, type);
    t.received += chunk_bytes(chunk, n, rank - 1 - s, type);
  }
  return t;
}

Traffic ring_all_gather_traffic(int rank, int n, int64_t count, DType type) {
  Traffic t;
  if (n == 1 || count == 0) return t;
  const std::vector<int64_t> chunk = even_chunks(count, n);
  for (int s = 0; s < n - 1; ++s) {  // step s: chunk (rank + 1 - s) out, chunk (rank - s) in
    t.sent += chunk_bytes(chunk, n, rank + 1 - s, type);
    t.received += chunk_bytes(chunk, n, rank - s, type);
  }
  return t;
}

Traffic ring_all_reduce_traffic(int rank, int n, int64_t count, DType type) {
  const Traffic a = ring_reduce_scatter_traffic(rank, n, count, type),
                b = ring_all_gather_traffic(rank, n, count, type);
  return {a.sent + b.sent, a.received + b.received};
}

Traffic naive_all_reduce_traffic(int rank, int n, int64_t count, DType type) {
  if (n == 1 || count == 0) return {};
  const int64_t bytes = count * dtype_size(type);
  if (rank == 0) return {(n - 1) * bytes, (n - 1) * bytes};  // the sum to each peer; each peer's buffer
  return {bytes, bytes};                                     // its buffer to rank 0; the sum back
}

Traffic all_reduce_traffic(AllReduceAlgorithm a, int rank, int n, int64_t count, DType type) {
  return a == AllReduceAlgorithm::ring ? ring_all_reduce_traffic(rank, n, count, type)
                                       : naive_all_reduce_traffic(rank, n, count, type);
}

int64_t CollectiveTraffic::busiest() const {
  int64_t b = 0;
  for (const Traffic& t : per_rank) b = std::max({b, t.sent, t.received});
  return b;
}

std::vector<Traffic> ring_all_reduce_traffic(int64_t count, int n, DType type) {
  std::vector<Traffic> t;
  for (int r = 0; r < n; ++r) t.push_back(ring_all_reduce_traffic(r, n, count, type));
  return t;
}

void ByteModel::micro_batch(int k, int count) {
  note_ = count > 1 && k >= 0 ? " (micro-batch " + std::to_string(k + 1) + " of " + std::to_string(count) + ")" : "";
}

void ByteModel::batchnorm_per_micro_batch(const StepShape& s) {
  for (int k = 0; k < s.micro_batches; ++k) {
    micro_batch(k, s.micro_batches);
    batchnorm(s.spec, s.sync_bn, false);
    batchnorm(s.spec, s.sync_bn, true);
  }
  micro_batch(-1, s.micro_batches);
}

void ByteModel::push(CollectiveTraffic ct) {
  ct.what += note_;
  out_.push_back(std::move(ct));
}

void ByteModel::rooted(Collective c, const std::string& what, bool root_sends, const std::vector<int64_t>& share,
                       DType t) {
  CollectiveTraffic ct{c, what, std::vector<Traffic>(size_t(n_))};
  for (int i = 1; i < n_; ++i) {
    const int64_t b = share[size_t(i)] * dtype_size(t);
    Traffic &root = ct.per_rank[0], &peer = ct.per_rank[size_t(i)];
    (root_sends ? root.sent : root.received) += b;
    (root_sends ? peer.received : peer.sent) += b;
  }
  push(std::move(ct));
}

void ByteModel::rooted(Collective c, const std::string& what, bool root_sends, int64_t each, DType t) {
  rooted(c, what, root_sends, std::vector<int64_t>(size_t(n_), each), t);
}

void ByteModel::all_reduce(const std::string& what, int64_t count, DType t) {
  if (algorithm_ == AllReduceAlgorithm::ring)
    return push({Collective::all_reduce, what, ring_all_reduce_traffic(count, n_, t)});
  rooted(Collective::all_reduce, what + ": reduce to device 0", false, count, t);
  rooted(Collective::all_reduce, what + ": broadcast from device 0", true, count, t);
}

void ByteModel::sharded(Collective c, const std::string& what, int64_t chunk, DType t) {
  const int64_t b = (n_ - 1) * chunk * dtype_size(t);
  push({c, what, std::vector<Traffic>(size_t(n_), Traffic{b, b})});
}

void ByteModel::batchnorm(const ModelSpec& spec, bool sync_bn, bool backward) {
  if (!spec.has_batchnorm()) return;
  if (!sync_bn) {
    if (!backward) rooted(Collective::broadcast, "running statistics", true, spec.buffer_count);
    return;
  }
  std::vector<const Layer*> bns;
  for (auto& l : spec.layers)
    if (l.kind == LayerKind::batchnorm) bns.push_back(&l);
  if (backward) std::reverse(bns.begin(), bns.end());
  for (const Layer* l : bns)
    if (backward) {
      all_reduce(l->name + " gradient sums", 2 * int64_t(l->out_c));
    } else {
      all_reduce(l->name + " mean", l->out_c);
      all_reduce(l->name + " variance", l->out_c);
    }
}

std::vector<Traffic> total_traffic(const std::vector<CollectiveTraffic>& collectives, int n) {
  std::vector<Traffic> total(static_cast<size_t>(n));
  for (const auto& c : collectives)
    for (size_t r = 0; r < total.size(); ++r) {
      total[r].sent += c.per_rank[r].sent;
      total[r].received += c.per_rank[r].received;
    }
  return total;
}

}  // namespace dp
