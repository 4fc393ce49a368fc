// dp_bench bn end to end, on a small synthetic IDX set: a local and a sync row for each per-device batch
// and the reference; SyncBatchNorm's running statistics equal the reference's up to float rounding while
// local BatchNorm's, at 2 images per device, do not; the bytes sync adds over local equal the ring
// all-reduce model for the BatchNorm layers' sizes; bad input exits 2 before anything runs. A few
// seconds in all. The test names avoid ';' and ',' (ctest's and doctest's separators).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "engine/communicator.h"
#include "models/model.h"
#include "tests/util.h"

#ifdef DP_BENCH_BIN

namespace {

using nlohmann::json;

// A data set of 128 training and 64 test images, and the start of a bn command line on it: `base` on the
// simulated devices, `any_backend` naming none (for a test that gives its own --backend).
struct BnFixture {
  dp::test::TempDir dir;
  std::string any_backend, base;
  BnFixture() {
    dp::test::write_synthetic_dataset(dir.path.string(), 128, 64);
    any_backend = "'" + std::string(DP_BENCH_BIN) + "' bn --data '" + dir.path.string() + "' ";
    base = any_backend + "--backend cpu ";
  }
};

// What BatchNorm's collectives move on rank r of n in one step: SyncBatchNorm's three ring all-reduces
// per layer (C, C and 2C floats), or local BatchNorm's broadcast of the R running statistics from device 0.
dp::Traffic batchnorm_bytes(const dp::ModelSpec& spec, int r, int n, bool sync) {
  dp::Traffic t;
  if (!sync) {
    if (r == 0) t.sent = (n - 1) * spec.buffer_count * 4;
    if (r != 0) t.received = spec.buffer_count * 4;
    return t;
  }
  for (const dp::Layer& l : spec.layers)
    if (l.kind == dp::LayerKind::batchnorm)
      for (int64_t count : {int64_t(l.out_c), int64_t(l.out_c), 2 * int64_t(l.out_c)}) {
        const dp::Traffic a = dp::ring_all_reduce_traffic(r, n, count);
        t.sent += a.sent, t.received += a.received;
      }
  return t;
}

}  // namespace

TEST_CASE("dp_bench bn - a local and a sync row per per-device batch and the reference and sync equals the reference") {
  BnFixture f;
  const std::string out_json = f.dir / "bn.json";
  dp::test::CommandResult r = dp::test::run_command(f.base + "--batch 16 --per-device 2,8 --steps 4 --limit-test 48 " +
                                                    "--json '" + out_json + "'");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  // The table: the reference, then local and sync for 2 (8 devices) and 8 (2 devices).
  CHECK(r.output.find("per-device") != std::string::npos);
  CHECK(r.output.find("reference") != std::string::npos);
  CHECK(r.output.find("bytes: measured == model, to the byte, on every device of every run") != std::string::npos);
  CHECK(r.output.find("conclusion: SyncBatchNorm's test accuracy is ") != std::string::npos);
  CHECK(r.output.find("one epoch = 8 steps of 16") != std::string::npos);

  const json j = dp::test::read_json(out_json);
  CHECK(j["match"] == true);
  CHECK(j["config"]["model"] == "lenet-bn");
  CHECK(j["config"]["backend"] == "cpu");
  CHECK(j["config"]["strategy"] == "allreduce");
  CHECK(j["config"]["test_images"] == 48);
  CHECK(j["config"]["device_names"].size() == 8);  // the widest run's
  CHECK(j["command"].get<std::string>().find(" bn ") != std::string::npos);
  const json& ref = j["reference"];
  CHECK(ref["mode"] == "reference");
  CHECK(ref["devices"] == 1);
  CHECK(ref["per_device"] == 16);
  CHECK(ref["running_distance"] == 0.0);
  CHECK(ref["bytes_per_step"]["device0"]["sent"] == 0);
  CHECK(ref["bytes_per_step"]["peer"].is_null());

  std::map<std::pair<int, std::string>, json> rows;
  for (const json& row : j["runs"]) rows[{row["per_device"].get<int>(), row["mode"].get<std::string>()}] = row;
  REQUIRE(rows.size() == 4);
  for (const auto& entry : rows) {  // no structured bindings under CAPTURE: clang 14 refuses the capture
    const auto& key = entry.first;
    const json& row = entry.second;
    CAPTURE(key.first);
    CAPTURE(key.second);
    CHECK(row["devices"] == 16 / key.first);
    const double acc = row["test_accuracy"];
    CHECK(acc >= 0.0);
    CHECK(acc <= 1.0);
    CHECK(std::isfinite(row["test_loss"].get<double>()));
    CHECK(row["step_ms"]["all"].size() == 4);
    CHECK(row["step_ms"]["median"].get<double>() > 0);
    CHECK(row["bytes_match_model"] == true);
    CHECK(row["running_distance_by_buffer"].size() == 6);  // bn1..bn3, running_mean and running_var
    for (const json& d : row["device_bytes"]) {
      CHECK(d["bytes_sent"] == d["predicted_sent"]);
      CHECK(d["bytes_received"] == d["predicted_received"]);
    }
  }
  // SyncBatchNorm is one device's BatchNorm over the global batch: the same running statistics up to
  // float summation order (a few ulps over 4 steps: far below 1e-4 relative).
  for (int p : {2, 8}) {
    CAPTURE(p);
    CHECK(rows[{p, "sync"}]["running_distance"].get<double>() < 1e-4);
    for (auto& item : rows[{p, "sync"}]["running_distance_by_buffer"].items()) {
      const std::string name = item.key();
      CAPTURE(name);
      CHECK(item.value().get<double>() < 1e-4);
    }
  }
  // Local BatchNorm at 2 images per device keeps device 0's statistics of its 2 images: far off.
  const double local2 = rows[{2, "local"}]["running_distance"];
  CHECK(local2 > 1e-3);
  CHECK(local2 > 100 * rows[{2, "sync"}]["running_distance"].get<double>());
  CHECK(!j["conclusion"].get<std::string>().empty());
  // The verdict: sync's accuracy is the mean of the sync runs and the reference, the threshold at
  // least 1 point, and a gap per per-device batch.
  const json& v = j["verdict"];
  double sum = ref["test_accuracy"], lo = sum, hi = sum;
  for (int p : {2, 8}) {
    const double a = rows[{p, "sync"}]["test_accuracy"];
    sum += a, lo = std::min(lo, a), hi = std::max(hi, a);
  }
  CHECK(v["sync_accuracy"].get<double>() == doctest::Approx(sum / 3));
  CHECK(v["sync_spread_points"].get<double>() == doctest::Approx(100 * (hi - lo)));
  CHECK(v["threshold_points"].get<double>() >= 1.0);
  REQUIRE(v["local"].size() == 2);
  CHECK(v["local"][0]["points_below_sync"].get<double>() ==
        doctest::Approx(100 * (sum / 3 - rows[{2, "local"}]["test_accuracy"].get<double>())));
}

TEST_CASE("dp_bench bn - the bytes sync adds over local equal the ring all-reduce model for the BatchNorm layers") {
  BnFixture f;
  const dp::ModelSpec spec = dp::make_model("lenet-bn");
  for (const char* sync : {"allreduce", "scatter"}) {
    CAPTURE(sync);
    const std::string out_json = f.dir / (std::string(sync) + ".json");
    dp::test::CommandResult r =
        dp::test::run_command(f.base + "--batch 24 --per-device 2,4,12 --steps 2 --limit-test 16 --sync " + sync +
                              " --json '" + out_json + "'");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const json j = dp::test::read_json(out_json);
    CHECK(j["match"] == true);
    REQUIRE(j["sync_vs_local"].size() == 3);
    std::set<int> seen;
    for (const json& e : j["sync_vs_local"]) {
      const int p = e["per_device"], n = e["devices"];
      CAPTURE(p);
      seen.insert(p);
      CHECK(n == 24 / p);
      for (int rank : {0, 1}) {
        CAPTURE(rank);
        const dp::Traffic s = batchnorm_bytes(spec, rank, n, true), l = batchnorm_bytes(spec, rank, n, false);
        const json& got = e[rank == 0 ? "device0" : "peer"];
        CHECK(got["sent"].get<int64_t>() == s.sent - l.sent);
        CHECK(got["received"].get<int64_t>() == s.received - l.received);
      }
    }
    CHECK(seen == std::set<int>{2, 4, 12});
    // Device 0's extra, written out for 12 devices: 3 layers x 3 ring all-reduces, less the broadcast
    // of R = 2 x (20 + 50 + 128) = 396 floats to 11 peers.
    for (const json& e : j["sync_vs_local"])
      if (e["devices"] == 12) {
        int64_t ring = 0;
        for (int64_t c : {20, 50, 128})
          for (int64_t count : {c, c, 2 * c}) ring += dp::ring_all_reduce_traffic(0, 12, count).sent;
        CHECK(e["device0"]["sent"].get<int64_t>() == ring - 11 * 396 * 4);
      }
  }
}

TEST_CASE("dp_bench bn - bad input exits 2 naming why before anything runs") {
  BnFixture f;
  const std::string ok = "--batch 16 --steps 2 --per-device 2,4 ";  // a run that would go ahead
  dp::test::check_refusals(
      f.base,
      {
          {"--batch 16 --per-device 3", "--per-device 3: does not divide --batch 16"},
          {"--batch 16 --per-device 1", "BatchNorm needs more than 1 value per channel"},
          {"--batch 16 --per-device 1", "local BatchNorm cannot normalise a shard of 1 sample"},
          {"--batch 16 --per-device 0", "--per-device 0: BatchNorm needs more than 1 value per channel"},
          {"--batch 16 --per-device 2,2", "--per-device 2: given twice"},
          {"--per-device 2,x", "'x' in '2,x' is not a batch size"},
          {"--per-device ''", "--per-device: the list is empty"},
          {"--batch 16 --per-device 2,4 --steps 0", "--steps: 0 steps; give at least 1"},
          {"--batch 0", "--batch: 0 is not a batch size"},
          {ok + "--sync weird", "--sync: 'weird' is not a strategy"},
          {ok + "--lr 0", "--lr: must be a finite learning rate > 0"},
          {ok + "--seed -1", "--seed"},
          {"--batch 1024 --per-device 2", "512 devices, more than the 256 this demo makes"},
          {"--batch 256 --per-device 2", "--batch 256: more than the 128 training images"},
          {ok + "--json '" + f.dir / "missing/x.json" + "'", "does not exist"},
      },
      "run 1/");
  dp::test::check_refusals(f.any_backend, {{ok + "--backend tpu", "--backend: 'tpu' is not a backend"}}, "run 1/");
  // A missing data directory: load_idx's refusal, before any device is made.
  dp::test::check_refusals("'" + std::string(DP_BENCH_BIN) + "' bn --backend cpu " + ok,
                           {{"--data '" + f.dir / "nowhere" + "'", f.dir / "nowhere"}}, "run 1/");
  // A learning rate that diverges: exit 3 naming the run and the step, no NaN table or conclusion.
  const dp::test::CommandResult r = dp::test::run_command(f.base + ok + "--lr 1e38");
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(r.output.find("diverged: loss ") != std::string::npos);
  CHECK(r.output.find("try a smaller --lr") != std::string::npos);
  CHECK(r.output.find("bytes: measured") == std::string::npos);
}

TEST_CASE("dp_bench bn - the plot says in its title that the devices were simulated") {
  if (std::system("/usr/bin/python3 -c 'import matplotlib' > /dev/null 2>&1") != 0) {
    MESSAGE("SKIPPED: /usr/bin/python3 cannot import matplotlib, so no plot to check");
    return;
  }
  BnFixture f;
  const std::string plots = f.dir / "plots";
  std::filesystem::create_directories(plots);
  dp::test::CommandResult r =
      dp::test::run_command(f.base + "--batch 8 --per-device 2,4 --steps 2 --limit-test 16 --plot '" + plots + "'");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("plot: " + plots + "/bn.png") != std::string::npos);
  const std::string png = dp::test::slurp(plots + "/bn.png");
  CHECK(png.find("Title") != std::string::npos);
  CHECK(png.find("simulated CPU devices (1 to 4 of them") != std::string::npos);
  CHECK(dp::test::read_json(plots + "/bn.json")["runs"].size() == 4);
}

#endif  // DP_BENCH_BIN
