// The collective sweep behind dp_bench comm and the alpha-beta fit dp_bench compare uses: every
// collective over message sizes doubling from --min-bytes to --max-bytes, timed with nccl-tests'
// definitions (algbw = S/t, busbw = algbw times the collective's factor).
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include "bench/bench.h"
#include "engine/error.h"

namespace dp::bench {

double busbw_factor(Collective c, int n) {
  switch (c) {
    case Collective::all_reduce:
      return 2.0 * (n - 1) / n;
    case Collective::scatter:
    case Collective::gather:
    case Collective::reduce_scatter:
    case Collective::all_gather:
      return double(n - 1) / n;
    case Collective::broadcast:
    case Collective::reduce:
      return 1.0;
  }
  return 1.0;
}

namespace {
// The most bytes one rank sends or receives in the collective over S = 4·count bytes.
int64_t busiest_bytes(Collective c, int64_t count, int n) {
  const int64_t F = sizeof(float);
  switch (c) {
    case Collective::all_reduce: {
      int64_t b = 0;
      for (const Traffic& t : ring_all_reduce_traffic(count, n)) b = std::max({b, t.sent, t.received});
      return b;
    }
    case Collective::broadcast:
    case Collective::reduce:
      return (n - 1) * count * F;  // the root sends / receives n − 1 copies
    case Collective::scatter:
    case Collective::gather:
      return (count - even_chunks(count, n)[0]) * F;  // everything but its own chunk
    case Collective::reduce_scatter:
    case Collective::all_gather:
      return (n - 1) * (count / n) * F;  // the ring: every chunk but its own, each way
  }
  return 0;
}
}  // namespace

std::vector<int64_t> sweep_sizes(int64_t min_bytes, int64_t max_bytes) {
  std::vector<int64_t> s;
  if (min_bytes < 1 || min_bytes > max_bytes) return s;
  // Stops before doubling past max: no overflow for a max near 2^63.
  for (int64_t b = min_bytes;; b *= 2) {
    s.push_back(b / 4 * 4);
    if (b > max_bytes / 2) {
      if (b != max_bytes) s.push_back(max_bytes / 4 * 4);
      break;
    }
  }
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

int64_t sweep_bytes(const CommSweep& sw, int n) {
  const std::vector<int64_t> sizes = sweep_sizes(sw.min_bytes, sw.max_bytes);
  if (sizes.empty()) return 0;
  const int64_t count = sizes.back() / 4, chunk = even_chunks(count, n)[0];
  bool reduce = false, all_reduce = false;
  for (Collective c : sw.collectives) reduce |= c == Collective::reduce, all_reduce |= c == Collective::all_reduce;
  // run_comm_sweep's buf and part on every rank, then Communicator::scratch: reduce's root receives
  // (n - 1) buffers, all_reduce's ranks a chunk each; the scratch only grows, so each rank peaks at
  // the larger of the two.
  // In double, held under 2^62: a --max-bytes near 2^63 would overflow int64 (exact below 2^53).
  double floats = double(n) * double(count + chunk);
  floats += reduce ? double(n - 1) * double(count) : all_reduce ? double(chunk) : 0;
  floats += all_reduce ? double(n - 1) * double(chunk) : 0;
  return int64_t(std::min(floats * sizeof(float), 0x1p62));
}

void spmd(Communicator& comm, const std::vector<Device*>& devices, const std::function<void(int)>& fn) {
  std::vector<std::future<void>> futures;
  for (int r = 0; r < int(devices.size()); ++r)
    futures.push_back(devices[r]->run([&comm, &fn, r] {
      try {
        fn(r);
      } catch (...) {
        comm.abort();
        throw;
      }
    }));
  std::exception_ptr first;
  for (auto& f : futures) {
    try {
      f.get();
    } catch (const Aborted&) {
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) {
    comm.recover();
    std::rethrow_exception(first);
  }
}

namespace {

// One collective c of `count` floats on rank r, over the sweep's buffers.
void run_collective(Communicator& comm, Collective c, int r, int64_t count, float* buf, float* part) {
  const std::vector<int64_t> counts = even_chunks(count, comm.size());
  switch (c) {
    case Collective::all_reduce:
      return comm.all_reduce(r, buf, count);
    case Collective::broadcast:
      return comm.broadcast(r, buf, count, 0);
    case Collective::reduce:
      return comm.reduce(r, buf, count, 0);
    case Collective::scatter:
      return comm.scatter(r, r == 0 ? buf : nullptr, part, counts, 0);
    case Collective::gather:
      return comm.gather(r, part, r == 0 ? buf : nullptr, counts, 0);
    case Collective::reduce_scatter:  // n chunks of count / n floats: the sweep's size, rounded down
      return comm.reduce_scatter(r, buf, count / comm.size());
    case Collective::all_gather:
      return comm.all_gather(r, buf, count / comm.size());
  }
}

// Seconds per op and the op count: one warm-up op (first touch of the communicator's scratch),
// which also sizes the run to the budget, then every rank starts its clock after a common barrier
// and stops it when its last op is done; the op takes as long as the slowest rank.
std::pair<double, int> time_op(Communicator& comm, const std::vector<Device*>& devices, const CommSweep& sw,
                               const std::function<void(int)>& op) {
  using clock = std::chrono::steady_clock;
  const int n = int(devices.size());
  auto w0 = clock::now();
  spmd(comm, devices, [&](int r) {
    op(r);
    devices[r]->synchronize();
  });
  double warm = std::chrono::duration<double>(clock::now() - w0).count();
  int iters = std::clamp(int(sw.budget_seconds / std::max(warm, 1e-9)), 1, std::max(1, sw.max_iters));
  Barrier start(n);
  std::vector<double> elapsed(static_cast<size_t>(n));
  spmd(comm, devices, [&](int r) {
    start.arrive_and_wait(r, Deadline::after(comm.timeout()));  // bounded as the collectives are
    auto t0 = clock::now();
    for (int i = 0; i < iters; ++i) op(r);
    devices[r]->synchronize();
    elapsed[r] = std::chrono::duration<double>(clock::now() - t0).count();
  });
  return {*std::max_element(elapsed.begin(), elapsed.end()) / iters, iters};
}

}  // namespace

std::vector<CommPoint> run_comm_sweep(const std::vector<Device*>& devices, const CommSweep& sw) {
  const int n = int(devices.size());
  std::unique_ptr<Communicator> comm = make_communicator(devices);
  const std::vector<int64_t> sizes = sweep_sizes(sw.min_bytes, sw.max_bytes);
  const int64_t max_count = sizes.back() / 4;
  // Per rank: the collective's buffer (S bytes) and one chunk of it (scatter's receive, gather's
  // send). Filled with zeros: repeated in-place sums then stay finite.
  std::vector<Buffer> buf(static_cast<size_t>(n)), part(static_cast<size_t>(n));
  spmd(*comm, devices, [&](int r) {
    Device& d = *devices[r];
    buf[r] = d.alloc_floats(max_count, Category::workspace);                      // (S / 4)
    part[r] = d.alloc_floats(even_chunks(max_count, n)[0], Category::workspace);  // (S / 4n)
    d.ops().fill(max_count, 0.0f, buf[r].f());
    d.ops().fill(even_chunks(max_count, n)[0], 0.0f, part[r].f());
    d.synchronize();
  });

  // Largest size first: the communicator's scratch then grows once, instead of being reallocated
  // (and its pages first touched again) at every doubling.
  std::vector<CommPoint> points;
  for (Collective c : sw.collectives) {
    for (auto it = sizes.rbegin(); it != sizes.rend(); ++it) {
      const int64_t bytes = *it, count = bytes / 4;
      auto [seconds, iters] =
          time_op(*comm, devices, sw, [&](int r) { run_collective(*comm, c, r, count, buf[r].f(), part[r].f()); });
      CommPoint p;
      p.collective = c, p.bytes = bytes, p.rank_bytes = busiest_bytes(c, count, n), p.iters = iters;
      p.seconds = seconds;
      p.algbw = double(bytes) / p.seconds;
      p.busbw = p.algbw * busbw_factor(c, n);
      points.push_back(p);
    }
  }
  // Back in the sweep's order: collectives as listed, sizes ascending.
  auto rank_of = [&](Collective c) {
    return std::find(sw.collectives.begin(), sw.collectives.end(), c) - sw.collectives.begin();
  };
  std::stable_sort(points.begin(), points.end(), [&](const CommPoint& a, const CommPoint& b) {
    return a.collective != b.collective ? rank_of(a.collective) < rank_of(b.collective) : a.bytes < b.bytes;
  });
  // Device memory is freed on the device's own thread (the CUDA allocator wants it).
  for (int r = 0; r < n; ++r)
    devices[r]
        ->run([&, r] {
          buf[r].reset();
          part[r].reset();
        })
        .get();
  return points;
}

AlphaBeta fit_from_sweep(const std::vector<CommPoint>& points) {
  std::vector<double> x, t;
  int64_t lo = 0, hi = 0;
  for (const auto& p : points)
    if (p.collective == Collective::all_reduce) {
      x.push_back(double(p.rank_bytes)), t.push_back(p.seconds);
      lo = lo == 0 ? p.bytes : std::min(lo, p.bytes), hi = std::max(hi, p.bytes);
    }
  AlphaBeta ab = fit_alpha_beta(x, t);
  ab.source = "fitted to all_reduce over " + format_bytes(lo) + " .. " + format_bytes(hi);
  return ab;
}

AlphaBeta fit_repeated(const std::vector<Device*>& devices, CommSweep sweep, int repeats,
                       const std::vector<CommPoint>& first) {
  sweep.collectives = {Collective::all_reduce};
  std::vector<AlphaBeta> fits;
  for (int i = 0; i < repeats; ++i)
    fits.push_back(fit_from_sweep(i == 0 && !first.empty() ? first : run_comm_sweep(devices, sweep)));
  return median_fit(fits);
}

}  // namespace dp::bench
