// The input pipeline (train/loader.h): the loader thread hands out exactly the batches the
// synchronous path assembles, in the same order, across epoch boundaries, the last partial batch,
// a start mid-epoch and an end mid-epoch, with one batch held, two (prefetch) or three (prefetch and
// --run-ahead); so dp_train's
// weights and losses are bit-identical between --workers 0 --no-prefetch and the defaults (--workers 1,
// prefetch) for both strategies and with --resume. Bad --workers values exit 2; a signal or an
// exception while the loader runs ends the run with its usual code, the thread joined.
#include <doctest/doctest.h>

#include <algorithm>
#include <stdexcept>

#include "tests/util.h"
#include "train/checkpoint.h"
#include "train/loader.h"

using namespace dp;
using namespace dp::test;

namespace {

// A data set whose every pixel names its sample: image i is all (i + 1) / 1000, its label i % 10.
Dataset numbered(int64_t count) {
  Dataset d;
  d.count = count, d.rows = 2, d.cols = 3;
  for (int64_t i = 0; i < count; ++i) {
    d.images.insert(d.images.end(), size_t(d.image_size()), float(i + 1) / 1000.0f);
    d.labels.push_back(int32_t(i % 10));
  }
  return d;
}

// The batch of `step` as the plan defines it, gathered here by hand.
void check_batch(const HostBatch& b, const Dataset& d, const LoaderPlan& p, int64_t step) {
  CAPTURE(step);
  const std::vector<int64_t> order = epoch_order(d.count, p.seed, step / p.per_epoch, p.shuffle);
  const int64_t first = (step % p.per_epoch) * p.batch;
  REQUIRE(b.step == step);
  REQUIRE(b.n == int(std::min<int64_t>(p.batch, d.count - first)));
  for (int i = 0; i < b.n; ++i) {
    const int64_t s = order[size_t(first + i)];
    CHECK(b.y[size_t(i)] == d.labels[size_t(s)]);
    const int64_t D = d.image_size();
    CHECK(std::equal(b.x.begin() + i * D, b.x.begin() + (i + 1) * D, d.images.begin() + s * D));
  }
}

}  // namespace

TEST_CASE("loader: both worker counts hand out the plan's batches, mid-epoch start and end, partial last batch") {
  // 10 samples in batches of 4: 3 steps an epoch, the last of 2; steps 2..7 start and end mid-epoch.
  // With two batches held (prefetch: this step's and the next, staged), the older is still intact
  // after the next next(), while the loader thread fills the one after; with three (--run-ahead: the
  // step in flight's too) the oldest of them as well.
  const Dataset d = numbered(10);
  for (bool shuffle : {true, false}) {
    for (int held : {1, 2, 3}) {
      LoaderPlan plan{4, 3, 2, 8, 5, shuffle, {}, {}};
      plan.held = held;
      for (int workers : {0, 1}) {
        CAPTURE(shuffle);
        CAPTURE(held);
        CAPTURE(workers);
        BatchLoader loader(d, plan, workers);
        std::vector<const HostBatch*> holding;
        std::vector<const float*> buffers;
        for (int64_t step = plan.first_step; step < plan.end_step; ++step) {
          holding.push_back(&loader.next());
          buffers.push_back(holding.back()->x.data());
          if (holding.size() > size_t(held)) holding.erase(holding.begin());
          for (size_t i = 0; i < holding.size(); ++i)
            check_batch(*holding[i], d, plan, step + 1 - int64_t(holding.size() - i));
          // held + 1 buffers, reused in turn
          const size_t k = buffers.size() - 1;
          if (k > size_t(held)) CHECK(buffers[k] == buffers[k - size_t(held) - 1]);
          if (k > 0) CHECK(buffers[k] != buffers[k - 1]);
        }
        CHECK_THROWS_AS(loader.next(), std::logic_error);
      }
    }
  }
  LoaderPlan four{4, 3, 0, 3, 5, true, {}, {}};
  four.held = 4;
  CHECK_THROWS_AS(BatchLoader(d, four, 1), std::invalid_argument);
}

TEST_CASE("loader: each staging buffer is page-locked whole (LoaderPlan::pin), and unlocked with the loader") {
  const Dataset d = numbered(10);
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  struct Lock {
    uintptr_t p;
    size_t bytes;
  };
  std::vector<Lock> locked;
  int unlocked = 0;
  LoaderPlan plan{4, 3, 0, 3, 5, true, {}, {}};
  plan.pin = [&](void* p, size_t bytes) {
    locked.push_back({uintptr_t(p), bytes});
    return std::shared_ptr<void>(p, [&](void*) { ++unlocked; });
  };
  for (auto [workers_, held_] : {std::pair{0, 1}, {1, 1}, {1, 2}, {1, 3}}) {
    const auto workers = workers_;  // a copy: clang 14 cannot capture a structured binding (CAPTURE)
    const auto held = held_;
    CAPTURE(workers);
    CAPTURE(held);
    plan.held = held;
    const size_t locks = 2 * size_t(held + 1);
    locked.clear(), unlocked = 0;
    {
      BatchLoader loader(d, plan, workers);
      // x and y of every staging buffer (held + 1): 4 rows of 6 floats, 4 labels; each on pages of its own
      REQUIRE(locked.size() == locks);
      for (size_t i = 0; i < locked.size(); ++i) {
        CAPTURE(i);
        CHECK(locked[i].p % page == 0);
        CHECK(locked[i].bytes == (i % 2 == 0 ? 4 * 6 * sizeof(float) : 4 * sizeof(int32_t)));
        for (size_t j = 0; j < i; ++j) CHECK((locked[i].p / page != locked[j].p / page));
      }
      const HostBatch& b = loader.next();
      CHECK(uintptr_t(b.x.data()) == locked[0].p);
      check_batch(b, d, plan, 0);
      CHECK(unlocked == 0);
    }
    CHECK(unlocked == int(locks));
  }
  // A device that does not lock (a null handle, the simulated devices) is asked once.
  int asked = 0;
  plan.pin = [&](void*, size_t) {
    ++asked;
    return std::shared_ptr<void>();
  };
  BatchLoader loader(d, plan, 0);
  CHECK(asked == 1);
  check_batch(loader.next(), d, plan, 0);
}

TEST_CASE("loader: destroyed while its thread fills or waits, it joins at once") {
  const Dataset d = numbered(64);
  const LoaderPlan plan{8, 8, 0, 1000, 1, true, {}, {}};
  for (int taken : {0, 1, 5}) {
    CAPTURE(taken);
    auto t0 = std::chrono::steady_clock::now();
    {
      BatchLoader loader(d, plan, 1);
      for (int i = 0; i < taken; ++i) check_batch(loader.next(), d, plan, i);
    }
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  }
  BatchLoader empty(d, LoaderPlan{8, 8, 3, 3, 1, true, {}, {}}, 1);  // nothing to load: no thread
  CHECK_THROWS_AS(empty.next(), std::logic_error);
}

TEST_CASE(
    "loader: dp_train --workers 0 --no-prefetch and the defaults train bit-identical weights and losses, with "
    "--resume") {
  TempDir dir;
  // 120 samples in batches of 32: 4 steps an epoch, the last of 24. 9 steps cross two epoch
  // boundaries and end mid-epoch; the resumed run starts at step 3, mid-epoch.
  write_synthetic_dataset(dir.path.string(), 120, 32);
  for (const std::string devices : {"--devices 1", "--devices 2 --sync scatter", "--devices 2 --sync allreduce"}) {
    CAPTURE(devices);
    const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --quiet " + devices;
    auto run = [&](const std::string& args) {
      CommandResult r = run_command(base + " " + args);
      INFO(args << "\n" << r.output);
      REQUIRE(r.exit_code == 0);
    };
    // 0: the batch assembled between steps and uploaded at its step; 1 (the defaults): assembled by
    // the loader thread and uploaded during the step before, on the copy stream.
    for (int w : {0, 1}) {
      const std::string tag = std::to_string(w), flags = w == 0 ? " --workers 0 --no-prefetch" : "";
      run("--steps 9" + flags + " --save " + dir / ("full" + tag) + " --report " + dir / ("r" + tag));
      run("--steps 3" + flags + " --save " + dir / ("part" + tag));
      run("--resume " + dir / ("part" + tag) + " --steps 9" + flags + " --save " + dir / ("resumed" + tag));
    }
    check_same_tensors(dir / "full1", dir / "full0");
    check_same_tensors(dir / "resumed1", dir / "full0");
    check_same_tensors(dir / "resumed0", dir / "full0");
    const nlohmann::json r0 = read_json(dir / "r0"), r1 = read_json(dir / "r1");
    CHECK(r0["config"]["workers"] == 0);
    CHECK(r0["config"]["prefetch"] == false);
    CHECK(r1["config"]["workers"] == 1);
    CHECK(r1["config"]["prefetch"] == true);
    REQUIRE(r1["epochs"].size() == 3);
    for (size_t e = 0; e < 3; ++e) {
      CAPTURE(e);
      CHECK(r1["epochs"][e]["train_loss"] == r0["epochs"][e]["train_loss"]);
      CHECK(r1["epochs"][e]["test_loss"] == r0["epochs"][e]["test_loss"]);
    }
    CHECK(r1["load_wait_seconds"].get<double>() >= 0);
  }
}

TEST_CASE("loader: --workers other than 0 or 1 is refused with exit 2, saying why") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --steps 1 --workers ";
  struct Case {
    std::string value, says;
  };
  for (const Case& c : {Case{"2", "would be no faster than 1"}, Case{"-1", "is not a number of loader threads"},
                        Case{"one", "not a whole number"}, Case{"", "--workers"}}) {
    CAPTURE(c.value);
    CommandResult r = run_command(base + "'" + c.value + "'");
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.says) != std::string::npos);
  }
  CommandResult eval = run_command(kTrain + " --backend cpu --eval --load x --workers 1");
  CHECK(eval.exit_code == 2);
  CHECK(eval.output.find("--workers only makes sense for training") != std::string::npos);
}

TEST_CASE("loader: a signal or a diverging step while the loader thread runs exits 143 or 3, no hang") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);
  const std::string base = "timeout -s KILL 60 env DP_TEST_AT=step-3:SIGTERM " + kTrain + " --backend cpu --data " +
                           dir.path.string() + " --batch 32 --epochs 2 --workers 1 --quiet";
  const std::string ck = dir / "ck";
  CommandResult sig = run_command(base + " --save " + ck);
  INFO(sig.output);
  CHECK(sig.exit_code == 143);
  CHECK(sig.output.find("terminated (SIGTERM) after step 3; checkpoint saved to " + ck) != std::string::npos);
  CHECK(read_safetensors(ck).metadata.at("global_step") == "3");

  CommandResult diverged = run_command("timeout -s KILL 60 " + kTrain + " --backend cpu --data " + dir.path.string() +
                                       " --batch 32 --epochs 2 --workers 1 --quiet --lr 1e30");
  INFO(diverged.output);
  CHECK(diverged.exit_code == 3);
}
