// Prefetch (Engine::stage, Device::upload_ahead): each batch uploaded during the step before it, on the
// devices' copy streams, trains bit-identical to uploads at the step, under every strategy; a failed
// step drops what was staged; a loader that fails while an upload is in flight frees nothing under it.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/host_pages.h"
#include "tests/backends.h"
#include "tests/failpoint/failpoints.h"
#include "tests/pinned_batches.h"
#include "tests/util.h"
#include "train/trainer.h"

using namespace dp;
using dp::test::all_strategies;
using dp::test::Batches;
using dp::test::for_each_strategy;
using dp::test::make_batches;
using dp::test::max_diff;
using dp::test::raw;
using dp::test::takes_buckets;
namespace {

// Prefetch (EngineConfig::prefetch): each batch staged, its upload started on the copy streams,
// before the step ahead of it trains, as dp_train does. Against an engine that uploads at the step:
// the same losses, correct counts, evaluation and weights, bit for bit, in every strategy, over
// batches of several sizes (one smaller than the device count: a device uploads nothing). The host
// buffers are reused as the loader reuses them (held + 1 of them) and a batch's buffer is filled with
// NaN as soon as the loader would get it back: an upload that ran late, or a step that read the
// wrong buffer, shows as a NaN loss or a difference. The devices copy slowly (10 ms an upload, on
// simulated and CUDA devices alike): a step that did not wait for its batch's upload would read the
// buffer before it, and the first step trains on a batch staged just before it.
void check_prefetch(const std::string& kind, int n) {
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 5, init.data());
  const std::vector<int> sizes{12, 12, 7, 2, 12};
  const int K = int(sizes.size()), B = 12;
  Batches data = make_batches(K, B, 21), test = make_batches(1, 20, 77);
  for_each_strategy([&](const std::string& sync, int64_t bucket_kb) {
    EngineConfig c;
    c.batch = B, c.sync = sync, c.bucket_kb = bucket_kb;
    auto ref_devs = dp::test::make_test_devices(kind, n);
    Engine ref(raw(ref_devs), spec, c);
    ref.set_params(init);
    std::vector<StepResult> want, want_eval;
    for (int s = 0; s < K; ++s) {
      want.push_back(ref.step(data.x[s].data(), data.y[s].data(), sizes[s]));
      want_eval.push_back(ref.evaluate(test.x[0].data(), test.y[0].data(), 20));
    }

    c.prefetch = true;
    auto devs = dp::test::make_test_devices(kind, n);
    const dp::failpoint::SlowUploads slow(raw(devs), std::chrono::milliseconds(10));
    Engine e(raw(devs), spec, c);
    e.set_params(init);
    // Every device that uploads holds two batch buffers, the others none more.
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const int64_t with = devs[r]->ledger().snapshot().current[int(Category::inputs)];
      const int64_t without = ref_devs[r]->ledger().snapshot().current[int(Category::inputs)];
      CHECK(with == (sync != "scatter" || r == 0 ? 2 * without : without));
    }
    dp::test::PinnedBatches host(e, 3, B);
    auto stage = [&](int s) { host.stage(e, data, s, sizes[size_t(s)]); };
    stage(0);
    for (int s = 0; s < K; ++s) {
      CAPTURE(s);
      if (s + 1 < K) stage(s + 1);
      CHECK(e.staged() == (s + 1 < K ? 2 : 1));
      const StepResult got = e.step();
      CHECK(got.loss == want[size_t(s)].loss);  // bitwise: the same kernels on the same bytes
      CHECK(got.correct == want[size_t(s)].correct);
      CHECK(got.n == sizes[size_t(s)]);
      host.spoil(s);
      // With the next batch staged (in either buffer): evaluation must borrow the other one.
      const StepResult ev = e.evaluate(test.x[0].data(), test.y[0].data(), 20);
      CHECK(ev.loss == want_eval[size_t(s)].loss);
      CHECK(ev.correct == want_eval[size_t(s)].correct);
    }
    CHECK(e.staged() == 0);
    CHECK(e.params() == ref.params());
  });
}

// A device's copy stream: two uploads ahead, into both slots, each held back 200 ms (a slow copy
// engine); after await_upload(0) the compute stream's copy of slot 0's buffer reads the bytes uploaded
// (32 MiB: a copy still running would be caught reading a part, one not started reading none); after
// synchronize() the host memory of both may change. Page-locked: from pageable memory CUDA copies
// the bytes out before upload_ahead returns, and nothing could be caught.
void check_upload_ahead(Device& d) {
  const dp::failpoint::SlowUploads slow({&d}, std::chrono::milliseconds(200));
  const int64_t n = int64_t(8) << 20;
  const size_t bytes = size_t(n) * sizeof(float);
  PageVector<float> a(static_cast<size_t>(n)), b(a.size());
  std::vector<float> got(a.size());
  const std::shared_ptr<void> lock_a = d.pin_host(a.data(), bytes), lock_b = d.pin_host(b.data(), bytes);
  for (int64_t i = 0; i < n; ++i) a[size_t(i)] = float(i), b[size_t(i)] = -float(i);
  const std::vector<float> a_sent(a.begin(), a.end()), b_sent(b.begin(), b.end());
  d.run([&] {
     Buffer da = d.alloc_floats(n, Category::inputs), db = d.alloc_floats(n, Category::inputs);
     Buffer out = d.alloc_floats(n, Category::workspace);
     d.upload_ahead(0, da.data(), a.data(), bytes);
     d.upload_ahead(1, db.data(), b.data(), bytes);
     d.await_upload(0);
     d.copy(out.data(), da.data(), bytes);
     d.download(got.data(), out.data(), bytes);
     CHECK(got == a_sent);
     d.synchronize();
     std::fill(b.begin(), b.end(), std::numeric_limits<float>::quiet_NaN());
     d.download(got.data(), db.data(), bytes);
     CHECK(got == b_sent);
     CHECK_THROWS_AS(d.upload_ahead(Device::kUploadSlots, da.data(), a.data(), bytes), DeviceError);
   }).get();
}

}  // namespace

TEST_CASE("prefetch: batches uploaded a step ahead train bit-identical to uploads at the step, every strategy") {
  check_prefetch("cpu", 3);
}

TEST_CASE("prefetch: a simulated device's upload ahead is complete for the compute stream after await_upload") {
  auto devs = dp::test::make_test_devices("cpu", 1);
  check_upload_ahead(*devs[0]);
}

TEST_CASE("cuda: prefetch on the copy stream trains bit-identical to uploads at the step" *
          doctest::skip(!dp::test::cuda_available())) {
  auto devs = dp::test::make_test_devices("cuda", 1);
  check_upload_ahead(*devs[0]);
  check_prefetch("cuda", 2);
}

TEST_CASE(
    "prefetch: a loader that fails for the batch after a staged one waits for that upload before its buffers go") {
  // Step 1's batch is staged (its upload held back 300 ms on the copy thread) when the loader fails
  // for step 2's: the run unwinds, and the loader's buffers must outlive the upload reading one of
  // them (under AddressSanitizer, the sanitizer job, a use after free otherwise).
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 256, 32);
  const dp::test::CommandResult r = dp::test::run_command(
      "timeout -s KILL 60 env DP_TEST_AT=batch-2:fail DP_TEST_SLOW_UPLOADS=300 " + std::string(DP_TRAIN_BIN) +
      " --backend cpu --devices 2 --data " + dir.path.string() + " --batch 32 --steps 6 --quiet");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("DP_TEST_AT: batch-2: the write failed on purpose") != std::string::npos);
  CHECK(r.output.find("AddressSanitizer") == std::string::npos);
}

TEST_CASE("prefetch: staging past the buffers, a step with nothing staged, and a failed step are handled") {
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 9, init.data());
  Batches data = make_batches(4, 12, 9);
  for (bool prefetch : {false, true}) {
    CAPTURE(prefetch);
    auto devs = dp::test::make_test_devices("cpu", 2);
    EngineConfig c;
    c.batch = 12, c.sync = "allreduce", c.prefetch = prefetch;
    Engine e(raw(devs), spec, c);
    e.set_params(init);
    CHECK_THROWS_AS(e.step(), std::logic_error);
    const int most = prefetch ? 2 : 1;
    for (int i = 0; i < most; ++i) e.stage(data.x[size_t(i)].data(), data.y[size_t(i)].data(), 12);
    CHECK_THROWS_WITH_AS(e.stage(data.x[2].data(), data.y[2].data(), 12),
                         doctest::Contains(prefetch ? "the most prefetch allows" : "without prefetch takes"),
                         std::logic_error);
    CHECK_THROWS_AS(e.step(data.x[2].data(), data.y[2].data(), 12), std::logic_error);  // one is staged
    CHECK_THROWS_AS(e.stage(data.x[2].data(), data.y[2].data(), 13), UsageError);       // past the batch
    CHECK(e.staged() == most);
    // A failed step drops what was staged; the next staged batch trains.
    dp::failpoint::inject_fault(*devs[1], "simulated kernel failure");
    CHECK_THROWS_AS(e.step(), DeviceError);
    CHECK(e.staged() == 0);
    e.stage(data.x[3].data(), data.y[3].data(), 12);
    const StepResult r = e.step();
    CHECK(r.n == 12);
    CHECK(std::isfinite(r.loss));
  }
}
