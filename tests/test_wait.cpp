// The bounded waits of engine/wait.h and the communicator's barrier: a wait returns when its work is
// done, throws Aborted when another rank failed, and throws TimedOut naming what it waited for once
// the timeout passes; the barrier, past its deadline, aborts itself and says who never came. The
// CUDA waits (CudaDevice::synchronize with NCCL's watch) are this same poll_until on a stream query.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "engine/communicator.h"
#include "engine/error.h"
#include "engine/wait.h"
#include "tests/util.h"

using namespace dp;
using dp::test::seconds_since;

namespace {

using Clock = std::chrono::steady_clock;

// Sets `flag` after `ms` milliseconds, on a thread of its own.
std::future<void> set_later(std::atomic<bool>& flag, int ms) {
  return std::async(std::launch::async, [&flag, ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    flag = true;
  });
}

}  // namespace

TEST_CASE("wait: poll_until returns once the work is done, and asks what it waits for only on a timeout") {
  std::atomic<bool> done{false};
  int described = 0;
  auto what = [&] {
    ++described;
    return std::string("the test's work");
  };
  auto later = set_later(done, 30);
  const auto start = Clock::now();
  poll_until([&] { return done.load(); }, [] { return false; }, Deadline::after(30), 3, what);
  later.get();
  CHECK(seconds_since(start) >= 0.02);
  CHECK(seconds_since(start) < 10);
  CHECK(described == 0);
  // Finished work is never a failure, even when the abort flag and the deadline say otherwise.
  poll_until([] { return true; }, [] { return true; }, Deadline::after(0), 3, what);
  CHECK(described == 0);
}

TEST_CASE("wait: poll_until throws Aborted when another rank fails, long before the deadline") {
  std::atomic<bool> aborted{false};
  auto later = set_later(aborted, 30);
  const auto start = Clock::now();
  CHECK_THROWS_AS(poll_until([] { return false; }, [&] { return aborted.load(); }, Deadline::after(600), 1,
                             [] { return std::string("never asked"); }),
                  Aborted);
  later.get();
  CHECK(seconds_since(start) < 10);
}

TEST_CASE("wait: poll_until throws TimedOut past the deadline, naming the device, the work and --timeout") {
  const auto start = Clock::now();
  try {
    poll_until([] { return false; }, [] { return false; }, Deadline::after(0.05), 1,
               [] { return std::string("the all-reduce of bucket 3 on cuda:1"); });
    FAIL("no timeout");
  } catch (const TimedOut& e) {
    CHECK(e.device == 1);
    CHECK(std::string(e.what()) ==
          "device 1: the all-reduce of bucket 3 on cuda:1 did not finish within 0.05 s (--timeout): a peer stopped "
          "answering");
  }
  CHECK(seconds_since(start) >= 0.05);
  CHECK(seconds_since(start) < 10);
}

TEST_CASE("wait: an error of a predicate's own (NCCL's, say) goes through unchanged") {
  auto nccl_failed = []() -> bool { throw DeviceError(2, "NCCL reported an error on cuda:2: remote process exited"); };
  CHECK_THROWS_WITH_AS(
      poll_until([] { return false; }, nccl_failed, Deadline::after(600), 2, [] { return std::string("x"); }),
      "device 2: NCCL reported an error on cuda:2: remote process exited", DeviceError);
}

TEST_CASE("wait: deadlines saturate, and the message writes the timeout as given") {
  const Deadline far = Deadline::after(1e300);  // would overflow the clock's count of nanoseconds
  CHECK(far.seconds == 1e300);
  CHECK(far.at > Clock::now() + std::chrono::hours(24 * 365));
  const Clock::time_point before = Clock::now();
  const Deadline ten_minutes = Deadline::after(600);
  const Clock::time_point after = Clock::now();
  CHECK(ten_minutes.at >= before + std::chrono::seconds(600));
  CHECK(ten_minutes.at <= after + std::chrono::seconds(600));
  CHECK(timeout_message("the broadcast on sim:0", 600, "why") ==
        "the broadcast on sim:0 did not finish within 600 s (--timeout): why");
  CHECK(timeout_message("x", 0.5, "y") == "x did not finish within 0.5 s (--timeout): y");
}

TEST_CASE("wait: a barrier past its deadline aborts itself, says who never came, and works again after reset") {
  Barrier barrier(3);
  const auto start = Clock::now();
  // Ranks 0 and 1 arrive, rank 2 never does. The first deadline to pass aborts the barrier: that rank
  // throws Expired naming rank 2, the other Aborted (or Expired, when both deadlines passed at once).
  std::vector<std::future<void>> fs;
  for (int r = 0; r < 2; ++r)
    fs.push_back(std::async(std::launch::async, [&barrier, r] { barrier.arrive_and_wait(r, Deadline::after(0.1)); }));
  int expired = 0;
  for (auto& f : fs) {
    try {
      f.get();
      FAIL("the barrier let a rank through without rank 2");
    } catch (const Barrier::Expired& e) {
      ++expired;
      CHECK(e.missing == std::vector<int>{2});
    } catch (const Aborted&) {
    }
  }
  CHECK(expired >= 1);
  CHECK(barrier.aborted());
  CHECK_THROWS_AS(barrier.arrive_and_wait(2, Deadline::after(600)), Aborted);  // until reset
  CHECK(seconds_since(start) < 10);

  barrier.reset();
  CHECK_FALSE(barrier.aborted());
  fs.clear();
  for (int r = 0; r < 3; ++r)
    fs.push_back(std::async(std::launch::async, [&barrier, r] { barrier.arrive_and_wait(r, Deadline::after(600)); }));
  for (auto& f : fs) CHECK_NOTHROW(f.get());
}
