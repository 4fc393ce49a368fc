// Collectives against closed forms: rank r contributes r, the sum is n(n-1)/2; sizes not divisible
// by the device count, zero-length chunks, one device; and the bytes each rank counts. The naive
// all-reduce (d2l's) against the ring and against the rank-order sum.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "engine/communicator.h"
#include "engine/error.h"
#include "tests/backends.h"
#include "tests/failpoint/failpoints.h"
#include "tests/util.h"

using namespace dp;
using dp::test::raw;
using dp::test::spmd;

namespace {

// Ring all-reduce bytes rank r sends (== receives) under the even-chunk ring: at reduce-scatter step
// s it sends chunk (r - s) and at all-gather step s chunk (r + 1 - s), both mod n.
int64_t ring_bytes_sent(int64_t count, int n, int r) {
  auto chunk = even_chunks(count, n);
  int64_t b = 0;
  for (int s = 0; s < n - 1; ++s) b += chunk[((r - s) % n + n) % n] + chunk[((r + 1 - s) % n + n) % n];
  return b * 4;
}

// ... and receives chunk (r - 1 - s) then chunk (r - s).
int64_t ring_bytes_received(int64_t count, int n, int r) {
  auto chunk = even_chunks(count, n);
  int64_t b = 0;
  for (int s = 0; s < n - 1; ++s) b += chunk[((r - 1 - s) % n + n) % n] + chunk[((r - s) % n + n) % n];
  return b * 4;
}

}  // namespace

TEST_CASE("even_chunks differ by at most one, larger first") {
  CHECK(even_chunks(10, 3) == std::vector<int64_t>{4, 3, 3});
  CHECK(even_chunks(2, 4) == std::vector<int64_t>{1, 1, 0, 0});
  CHECK(even_chunks(0, 2) == std::vector<int64_t>{0, 0});
}

TEST_CASE("all_reduce sums rank contributions on every rank, for awkward sizes") {
  for (const std::string& kind : dp::test::backends()) {
    for (int n : {1, 2, 3, 4}) {
      for (int64_t count : {int64_t(0), int64_t(1), int64_t(3), int64_t(7), int64_t(1001)}) {
        CAPTURE(kind);
        CAPTURE(n);
        CAPTURE(count);
        auto devs = dp::test::make_test_devices(kind, n);
        auto comm = make_communicator(raw(devs));
        std::vector<Buffer> bufs(n);
        std::vector<std::vector<float>> out(n, std::vector<float>(size_t(count)));
        spmd(
            raw(devs),
            [&](int r) {
              Device& d = *devs[r];
              bufs[r] = d.alloc_floats(std::max<int64_t>(count, 1), Category::gradients);
              std::vector<float> host(static_cast<size_t>(count));
              for (int64_t i = 0; i < count; ++i) host[i] = float(r) + float(i % 5);  // r plus an index pattern
              d.upload(bufs[r].f(), host.data(), host.size() * 4);
              d.synchronize();
              comm->all_reduce(r, bufs[r].f(), count);
              d.download(out[r].data(), bufs[r].f(), out[r].size() * 4);
            },
            comm.get());
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < count; ++i) REQUIRE(out[r][i] == float(n * (n - 1) / 2 + n * (i % 5)));
        int64_t sent = 0, received = 0;
        for (int r = 0; r < n; ++r) {
          Traffic t = comm->traffic(r, Collective::all_reduce);
          CHECK(t.sent == (n == 1 ? 0 : ring_bytes_sent(count, n, r)));
          CHECK(t.received == (n == 1 ? 0 : ring_bytes_received(count, n, r)));
          sent += t.sent, received += t.received;
        }
        CHECK(sent == received);  // every byte sent is received by someone
      }
    }
  }
}

// The sharded collectives (ZeRO's): rank r's chunk j starts as 1000 (r + 1) + j, so after the
// reduce-scatter the owned chunk j = shard(r) holds 1000 n(n+1)/2 + n j, exactly (integers in float);
// the all-gather, from buffers whose other chunks hold NaN, leaves every rank every owned chunk.
TEST_CASE("reduce_scatter and all_gather: each rank's own chunk summed, then every chunk everywhere") {
  for (const std::string& kind : dp::test::backends()) {
    for (int n : {1, 2, 3, 4}) {
      for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(5), int64_t(257)}) {
        CAPTURE(kind);
        CAPTURE(n);
        CAPTURE(chunk);
        auto devs = dp::test::make_test_devices(kind, n);
        auto comm = make_communicator(raw(devs));
        REQUIRE(comm->world() == n);
        const int64_t count = n * chunk;
        std::vector<Buffer> bufs(n);
        std::vector<std::vector<float>> scattered(n, std::vector<float>(size_t(count))), gathered = scattered;
        spmd(
            raw(devs),
            [&](int r) {
              Device& d = *devs[r];
              bufs[r] = d.alloc_floats(std::max<int64_t>(count, 1), Category::gradients);
              std::vector<float> host(static_cast<size_t>(count));
              for (int64_t i = 0; i < count; ++i)
                host[size_t(i)] = float(1000 * (r + 1) + i / std::max<int64_t>(chunk, 1));
              d.upload(bufs[r].f(), host.data(), host.size() * 4);
              comm->reduce_scatter(r, bufs[r].f(), chunk);
              d.download(scattered[r].data(), bufs[r].f(), scattered[r].size() * 4);
              // Only the owned chunk is kept: the all-gather must fill in every other one.
              for (int64_t i = 0; i < count; ++i)
                if (i / chunk != comm->shard(r))
                  host[size_t(i)] = std::nanf("");
                else
                  host[size_t(i)] = scattered[r][size_t(i)];
              d.upload(bufs[r].f(), host.data(), host.size() * 4);
              comm->all_gather(r, bufs[r].f(), chunk);
              d.download(gathered[r].data(), bufs[r].f(), gathered[r].size() * 4);
            },
            comm.get());
        const float sum = float(1000 * n * (n + 1) / 2);
        std::vector<float> want(static_cast<size_t>(count));
        for (int64_t i = 0; i < count; ++i) want[size_t(i)] = sum + float(n * (i / chunk));
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          const int j = comm->shard(r);
          for (int64_t i = 0; i < chunk; ++i)
            REQUIRE(scattered[r][size_t(j * chunk + i)] == want[size_t(j * chunk + i)]);
          CHECK(gathered[r] == want);
          const int64_t bytes = n == 1 ? 0 : (n - 1) * chunk * 4;
          for (Collective c : {Collective::reduce_scatter, Collective::all_gather}) {
            CHECK(comm->traffic(r, c).sent == bytes);
            CHECK(comm->traffic(r, c).received == bytes);
          }
        }
        std::vector<int> shards;
        for (int r = 0; r < n; ++r) shards.push_back(comm->shard(r));
        std::sort(shards.begin(), shards.end());
        for (int r = 0; r < n; ++r) CHECK(shards[size_t(r)] == r);  // every chunk owned once
      }
    }
  }
}

TEST_CASE("ring all_reduce moves 2(n-1)/n of the buffer per device when it divides evenly") {
  auto devs = dp::test::make_test_devices("cpu", 4);
  auto comm = make_communicator(raw(devs));
  const int64_t P = 1000;  // divisible by 4
  std::vector<Buffer> bufs(4);
  spmd(
      raw(devs),
      [&](int r) {
        bufs[r] = devs[r]->alloc_floats(P, Category::gradients);
        devs[r]->ops().fill(P, 1.0f, bufs[r].f());
        comm->all_reduce(r, bufs[r].f(), P);
      },
      comm.get());
  for (int r = 0; r < 4; ++r) CHECK(comm->traffic(r, Collective::all_reduce).sent == 2 * 3 * P * 4 / 4);
}

TEST_CASE("broadcast, reduce, scatter and gather against closed forms") {
  for (const std::string& kind : dp::test::backends()) {
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(kind);
      CAPTURE(n);
      auto devs = dp::test::make_test_devices(kind, n);
      auto comm = make_communicator(raw(devs));
      const int64_t count = 13;
      // chunk sizes for scatter/gather including a zero-length chunk on the last rank
      std::vector<int64_t> counts(n);
      for (int r = 0; r < n; ++r) counts[r] = (r == n - 1 && n > 1) ? 0 : r + 2;
      const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
      std::vector<std::vector<float>> bcast(n), reduced(n), scattered(n), gathered(n);
      std::vector<Buffer> keep;
      std::mutex mu;
      spmd(
          raw(devs),
          [&](int r) {
            Device& d = *devs[r];
            Buffer b = d.alloc_floats(count, Category::comm), s = d.alloc_floats(total + 1, Category::comm),
                   c = d.alloc_floats(total + 1, Category::comm), g = d.alloc_floats(total + 1, Category::comm);
            std::vector<float> host(count);
            for (int64_t i = 0; i < count; ++i) host[i] = r == 0 ? float(i) : -1.0f;
            d.upload(b.f(), host.data(), count * 4);
            d.synchronize();
            comm->broadcast(r, b.f(), count, 0);
            bcast[r].resize(count);
            d.download(bcast[r].data(), b.f(), count * 4);

            for (int64_t i = 0; i < count; ++i) host[i] = float(r);
            d.upload(b.f(), host.data(), count * 4);
            d.synchronize();
            comm->reduce(r, b.f(), count, 0);
            reduced[r].resize(count);
            d.download(reduced[r].data(), b.f(), count * 4);

            // scatter: root holds 0..total-1; rank r receives its slice
            std::vector<float> all(total);
            std::iota(all.begin(), all.end(), 0.0f);
            if (r == 0 && total > 0) d.upload(s.f(), all.data(), total * 4);
            d.synchronize();
            comm->scatter(r, s.f(), c.f(), counts, 0);
            scattered[r].resize(counts[r]);
            if (counts[r] > 0) {
              int64_t off = 0;
              for (int q = 0; q < r; ++q) off += counts[q];
              d.download(scattered[r].data(), r == 0 ? s.f() + off : c.f(), counts[r] * 4);
            }
            // gather: rank r contributes counts[r] copies of 100 + r
            std::vector<float> mine(counts[r], 100.0f + r);
            if (counts[r] > 0) d.upload(c.f(), mine.data(), counts[r] * 4);
            d.synchronize();
            comm->gather(r, c.f(), g.f(), counts, 0);
            if (r == 0) {
              gathered[0].resize(total);
              if (total > 0) d.download(gathered[0].data(), g.f(), total * 4);
            }
            std::lock_guard lock(mu);
            keep.push_back(std::move(b));
            keep.push_back(std::move(s));
            keep.push_back(std::move(c));
            keep.push_back(std::move(g));
          },
          comm.get());
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i) CHECK(bcast[r][i] == float(i));
      for (int64_t i = 0; i < count; ++i) CHECK(reduced[0][i] == float(n * (n - 1) / 2));
      int64_t off = 0;
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < counts[r]; ++i) CHECK(scattered[r][i] == float(off + i));
        for (int64_t i = 0; i < counts[r]; ++i) CHECK(gathered[0][off + i] == 100.0f + r);
        off += counts[r];
      }
      // bytes: the root sends (n-1) copies in broadcast and receives (n-1) buffers in reduce
      CHECK(comm->traffic(0, Collective::broadcast).sent == (n - 1) * count * 4);
      CHECK(comm->traffic(0, Collective::reduce).received == (n - 1) * count * 4);
      CHECK(comm->traffic(0, Collective::scatter).sent == (total - counts[0]) * 4);
      CHECK(comm->traffic(0, Collective::gather).received == (total - counts[0]) * 4);
      for (int r = 1; r < n; ++r) {
        CHECK(comm->traffic(r, Collective::broadcast).received == count * 4);
        CHECK(comm->traffic(r, Collective::reduce).sent == count * 4);
        CHECK(comm->traffic(r, Collective::scatter).received == counts[r] * 4);
      }
    }
  }
}

TEST_CASE("an aborted collective releases every waiting rank") {
  auto devs = dp::test::make_test_devices("cpu", 3);
  auto comm = make_communicator(raw(devs));
  std::vector<std::future<void>> fs;
  std::vector<Buffer> bufs(3);
  for (int r = 0; r < 3; ++r) bufs[r] = devs[r]->alloc_floats(8, Category::gradients);
  // ranks 0 and 1 enter the collective; rank 2 fails before it and aborts
  for (int r = 0; r < 2; ++r) fs.push_back(devs[r]->run([&, r] { comm->all_reduce(r, bufs[r].f(), 8); }));
  fs.push_back(devs[2]->run([&] {
    comm->abort();
    throw DeviceError(2, "boom");
  }));
  for (int r = 0; r < 2; ++r) CHECK_THROWS_AS(fs[r].get(), Aborted);
  CHECK_THROWS_AS(fs[2].get(), DeviceError);
  comm->recover();
  spmd(
      raw(devs), [&](int r) { comm->all_reduce(r, bufs[r].f(), 8); }, comm.get());  // usable again

  // The tests' spmd does the same for a body that throws: the peers in the collective are released
  // (the test fails with the rank's error instead of hanging ctest) and the communicator recovers.
  auto failing = [&](int r) {
    if (r == 1) throw DeviceError(1, "rank 1 failed before the collective");
    comm->all_reduce(r, bufs[r].f(), 8);
  };
  CHECK_THROWS_WITH_AS(spmd(raw(devs), failing, comm.get()), doctest::Contains("rank 1 failed"), DeviceError);
  comm->recover();
  spmd(
      raw(devs), [&](int r) { comm->all_reduce(r, bufs[r].f(), 8); }, comm.get());
}

// A peer may still copy from a rank's buffer when that rank's deadline passes: the rank leaves the
// collective (and may free or reuse the buffer) only once the peer's copy has landed.
TEST_CASE("a rank whose deadline passes leaves only after a peer's copy from its buffer has landed") {
  auto devs = dp::test::make_test_devices("cpu", 2);
  auto comm = make_communicator(raw(devs));
  comm->set_timeout(0.05);
  const int64_t count = 4096;
  std::vector<Buffer> bufs(2);
  for (int r = 0; r < 2; ++r) bufs[r] = devs[r]->alloc_floats(count, Category::gradients);
  devs[0]->ops().fill(count, 1.0f, bufs[0].f());
  devs[1]->ops().fill(count, 0.0f, bufs[1].f());
  // The root (rank 0) copies nothing and waits at the broadcast's last meeting; rank 1 reads the root's
  // buffer 300 ms on, past the 50 ms deadline. The root then overwrites it, as a freed buffer's reuse.
  dp::failpoint::SlowPeerCopies slow({devs[1].get()}, std::chrono::milliseconds(300));
  auto root = devs[0]->run([&] {
    try {
      comm->broadcast(0, bufs[0].f(), count, 0);
    } catch (const TimedOut&) {
      devs[0]->ops().fill(count, -7.0f, bufs[0].f());
      throw;
    }
  });
  auto peer = devs[1]->run([&] { comm->broadcast(1, bufs[1].f(), count, 0); });
  CHECK_THROWS_AS(root.get(), TimedOut);
  CHECK_THROWS_AS(peer.get(), Aborted);
  std::vector<float> got(static_cast<size_t>(count));
  devs[1]->download(got.data(), bufs[1].f(), got.size() * sizeof(float));
  CHECK(std::count(got.begin(), got.end(), 1.0f) == count);  // the root's values, none of -7
}

TEST_CASE(
    "a rank that stops answering: the all-reduce is aborted on every rank within the timeout, named, then it "
    "recovers") {
  auto devs = dp::test::make_test_devices("cpu", 3);
  auto comm = make_communicator(raw(devs));
  comm->set_timeout(0.2);
  std::vector<Buffer> bufs(3);
  for (int r = 0; r < 3; ++r) bufs[r] = devs[r]->alloc_floats(8, Category::gradients);
  for (bool buckets : {false, true}) {  // on the compute thread, and on the communication thread
    CAPTURE(buckets);
    comm->set_timeout(0.2);
    dp::failpoint::stall_once(*comm, 2, Collective::all_reduce);
    const auto start = std::chrono::steady_clock::now();
    auto body = [&](int r) {
      if (!buckets) return comm->all_reduce(r, bufs[r].f(), 8);
      comm->all_reduce_async(r, bufs[r].f(), 4);
      comm->all_reduce_async(r, bufs[r].f() + 4, 4);
      comm->wait(r);
    };
    // Rank 0 or 1 (whichever deadline passed first) names the collective, itself and rank 2; the
    // others throw Aborted, rank 2 too, which stopped answering until then.
    CHECK_THROWS_WITH_AS(spmd(raw(devs), body, comm.get()),
                         doctest::Contains("did not finish within 0.2 s (--timeout): sim:2 stopped answering"),
                         TimedOut);
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 10);
    comm->recover();
    // The recovered all-reduce with the default timeout: under a sanitizer on a loaded machine a rank's
    // thread can start later than 0.2 s (seen in CI under TSan), which is no stall.
    comm->set_timeout(kDefaultTimeout);
    spmd(
        raw(devs),
        [&](int r) {
          devs[r]->ops().fill(8, float(r), bufs[r].f());
          body(r);
        },
        comm.get());
    std::vector<float> out(8);
    devs[2]->download(out.data(), bufs[2].f(), 32);
    for (float v : out) CHECK(v == 3.0f);  // 0 + 1 + 2
  }
}

namespace {

struct AllReduced {
  std::vector<std::vector<float>> out;  // (n, count) every rank's buffer afterwards
  std::vector<Traffic> traffic;         // per rank, under Collective::all_reduce
};

// An all-reduce of in[r] on every rank with `algo`: one all_reduce call, or with buckets > 1 the
// buffer cut into that many ranges (even_chunks, some empty when count is small), each started with
// all_reduce_async as backward's buckets are, then wait().
AllReduced run_all_reduce(const std::string& kind, AllReduceAlgorithm algo, const std::vector<std::vector<float>>& in,
                          int buckets) {
  const int n = int(in.size());
  const int64_t count = int64_t(in[0].size());
  auto devs = dp::test::make_test_devices(kind, n);
  auto comm = make_communicator(raw(devs));
  comm->set_all_reduce_algorithm(algo);
  std::vector<Buffer> bufs(n);
  AllReduced res{std::vector<std::vector<float>>(n, std::vector<float>(size_t(count))), {}};
  spmd(
      raw(devs),
      [&](int r) {
        Device& d = *devs[r];
        bufs[r] = d.alloc_floats(std::max<int64_t>(count, 1), Category::gradients);
        d.upload(bufs[r].f(), in[r].data(), size_t(count) * 4);
        d.synchronize();
        if (buckets <= 1) {
          comm->all_reduce(r, bufs[r].f(), count);
        } else {
          int64_t offset = 0;
          for (int64_t c : even_chunks(count, buckets)) {
            comm->all_reduce_async(r, bufs[r].f() + offset, c);
            offset += c;
          }
          comm->wait(r);
        }
        d.download(res.out[r].data(), bufs[r].f(), size_t(count) * 4);
        d.synchronize();
      },
      comm.get());
  for (int r = 0; r < n; ++r) res.traffic.push_back(comm->traffic(r, Collective::all_reduce));
  return res;
}

}  // namespace

TEST_CASE(
    "naive all_reduce (d2l) sums like the ring, leaves the same bits on every rank, and moves its model's bytes") {
  for (const std::string& kind : dp::test::backends()) {
    for (int n : {1, 2, 3, 4}) {
      for (int64_t count : {int64_t(0), int64_t(1), int64_t(3), int64_t(7), int64_t(1001)}) {
        for (int buckets : {1, 3}) {
          CAPTURE(kind);
          CAPTURE(n);
          CAPTURE(count);
          CAPTURE(buckets);
          std::vector<std::vector<float>> in;
          for (int r = 0; r < n; ++r)
            in.push_back(dp::test::random_floats(size_t(count), 7 + uint32_t(r), -1.0f, 1.0f));
          const AllReduced naive = run_all_reduce(kind, AllReduceAlgorithm::naive, in, buckets);
          const AllReduced ring = run_all_reduce(kind, AllReduceAlgorithm::ring, in, buckets);
          for (int r = 1; r < n; ++r) REQUIRE(naive.out[r] == naive.out[0]);  // bitwise: rank 0's sum, broadcast
          for (int64_t i = 0; i < count; ++i) {
            // Two orders of the same n-term float sum each err by at most (n-1) u sum|x| (u = 2^-24,
            // recursive summation), so they differ by at most 2 (n-1) u sum|x|.
            double mag = 0;
            float in_rank_order = in[0][i];
            for (int r = 0; r < n; ++r) mag += std::fabs(in[r][i]);
            for (int r = 1; r < n; ++r) in_rank_order += in[r][i];
            CAPTURE(i);
            REQUIRE(std::fabs(double(naive.out[0][i]) - double(ring.out[0][i])) <= 2.0 * (n - 1) * 0x1p-24 * mag);
            // The peer communicator adds the peers into rank 0's buffer in rank order (reduce()'s rule):
            // exactly the sum a loop over the ranks gives. NCCL picks its own order.
            if (kind == "cpu") REQUIRE(naive.out[0][i] == in_rank_order);
          }
          // Rank 0 receives every peer's buffer and sends each the sum: (n-1)·P·4 bytes each way;
          // every other rank sends P·4 and receives P·4 (the buckets add up to the buffer).
          for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            const int64_t want = n == 1 ? 0 : (r == 0 ? (n - 1) * count * 4 : count * 4);
            CHECK(naive.traffic[r].sent == want);
            CHECK(naive.traffic[r].received == want);
            CHECK(naive.traffic[r].sent == naive_all_reduce_traffic(r, n, count).sent);
            CHECK(naive.traffic[r].received == naive_all_reduce_traffic(r, n, count).received);
          }
        }
      }
    }
  }
}

TEST_CASE("--allreduce names: ring and naive, anything else refused naming the flag") {
  CHECK(parse_all_reduce("ring") == AllReduceAlgorithm::ring);
  CHECK(parse_all_reduce("naive") == AllReduceAlgorithm::naive);
  CHECK(std::string(all_reduce_name(AllReduceAlgorithm::naive)) == "naive");
  CHECK_THROWS_WITH_AS(parse_all_reduce("tree"), doctest::Contains("--allreduce: 'tree'"), UsageError);
}
