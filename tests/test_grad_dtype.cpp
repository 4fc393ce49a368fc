// --grad-dtype (EngineConfig::grad_dtype): the gradients' collectives in bf16 or fp16, as DDP's
// compression hooks. The conversions round to nearest even (against _Float16 where the compiler has
// it, and against the midpoints of every pair of neighbours); the 16-bit add is correctly rounded; the
// ops agree on every backend; the rings round every partial sum; every strategy that takes it halves
// its gradients' bytes exactly, on the byte model, and trains within the rounding of the fp32
// trajectory without equalling it.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "engine/communicator.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "kernels/math.h"
#include "tests/backends.h"
#include "tests/ops_matrix.h"
#include "tests/util.h"
#include "train/verify.h"

using namespace dp;
using dp::test::Batches;
using dp::test::make_batches;
using dp::test::max_diff;
using dp::test::raw;
using dp::test::spmd;

namespace {

constexpr DType kTypes[] = {DType::bf16, DType::fp16};
// The largest finite value's bits and infinity's, per type.
uint16_t max_finite(DType t) { return t == DType::bf16 ? 0x7f7f : 0x7bff; }
bool is_nan16(DType t, uint16_t h) { return std::isnan(math::widen(t, h)); }

// The value of type t nearest the exact sum s > 0 (ties to the even bits), found among the neighbours
// of a first guess by exact comparison in double: what a correctly rounded add gives.
uint16_t nearest(DType t, double s) {
  const uint16_t guess = math::narrow(t, float(s));
  uint16_t best = guess;
  double best_err = INFINITY;
  for (int d = -1; d <= 1; ++d) {
    const uint16_t c = uint16_t(guess + d);
    if (is_nan16(t, c)) continue;
    const double err = std::fabs(double(math::widen(t, c)) - s);
    if (err < best_err || (err == best_err && (c & 1) == 0)) best = c, best_err = err;
  }
  return best;
}

}  // namespace

TEST_CASE("grad-dtype: every 16-bit value widens exactly and narrows back to itself, NaN stays NaN") {
  for (DType t : kTypes) {
    CAPTURE(dtype_name(t));
    int64_t wrong = 0;
    for (uint32_t h = 0; h <= 0xffff; ++h) {
      const float f = math::widen(t, uint16_t(h));
      if (std::isnan(f))
        wrong += !is_nan16(t, math::narrow(t, f));
      else
        wrong += math::narrow(t, f) != h;
    }
    CHECK(wrong == 0);
    CHECK(std::isinf(math::widen(t, uint16_t(max_finite(t) + 1))));
    CHECK(is_nan16(t, math::narrow(t, std::nanf(""))));
    CHECK(math::narrow(t, -0.0f) == 0x8000);
  }
}

TEST_CASE("grad-dtype: narrowing rounds to nearest, ties to even, between every pair of neighbours") {
  for (DType t : kTypes) {
    CAPTURE(dtype_name(t));
    int64_t wrong = 0;
    for (uint32_t h = 0; h < max_finite(t); ++h) {  // positive finite neighbours h, h + 1, subnormals too
      const double lo = math::widen(t, uint16_t(h)), hi = math::widen(t, uint16_t(h + 1));
      const float mid = float((lo + hi) / 2);  // exact in float: a 16-bit type has at most 11 bits
      REQUIRE(double(mid) == (lo + hi) / 2);
      const uint16_t even = (h & 1) == 0 ? uint16_t(h) : uint16_t(h + 1);
      wrong += math::narrow(t, mid) != even;
      wrong += math::narrow(t, std::nextafter(mid, 0.0f)) != h;
      wrong += math::narrow(t, std::nextafter(mid, INFINITY)) != h + 1;
      wrong += math::narrow(t, -mid) != (even | 0x8000);
    }
    CHECK(wrong == 0);
  }
  // fp16's overflow: 65520 (the midpoint to the next power of two) and up become infinity.
  CHECK(math::to_fp16(65519.996f) == 0x7bff);
  CHECK(math::to_fp16(65520.0f) == 0x7c00);
  CHECK(math::to_fp16(-1e9f) == 0xfc00);
  CHECK(math::to_fp16(std::ldexp(1.0f, -25)) == 0);  // half the smallest subnormal: a tie, to even (0)
  CHECK(math::to_fp16(std::ldexp(1.5f, -25)) == 1);
  CHECK(math::to_bf16(3.0e38f) == 0x7f62);
}

#if defined(__FLT16_MAX__)
TEST_CASE("grad-dtype: fp16 narrowing and widening equal the compiler's _Float16 conversions") {
  int64_t wrong = 0, checked = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) {  // every sign, exponent and many mantissas
    const float f = std::bit_cast<float>(uint32_t(u));
    if (std::isnan(f)) continue;
    ++checked;
    wrong += math::to_fp16(f) != std::bit_cast<uint16_t>(static_cast<_Float16>(f));
  }
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float want = float(std::bit_cast<_Float16>(uint16_t(h))), got = math::from_fp16(uint16_t(h));
    wrong += !(std::isnan(want) ? std::isnan(got) : std::bit_cast<uint32_t>(want) == std::bit_cast<uint32_t>(got));
  }
  CHECK(checked > 60000);
  CHECK(wrong == 0);
}
#endif

TEST_CASE("grad-dtype: the 16-bit add is the correctly rounded sum (NCCL's sum of two values of the type)") {
  std::mt19937 rng(11);
  for (DType t : kTypes) {
    CAPTURE(dtype_name(t));
    int64_t wrong = 0;
    std::uniform_int_distribution<uint32_t> bits(0, max_finite(t) - 1);
    for (int i = 0; i < 200000; ++i) {
      const uint16_t x = uint16_t(bits(rng)), y = uint16_t(i % 7 == 0 ? x : bits(rng));  // some equal: exact doubling
      const double s = double(math::widen(t, x)) + double(math::widen(t, y));            // exact in double
      if (s == 0 || s > math::widen(t, max_finite(t))) continue;
      wrong += math::add16(t, x, y) != nearest(t, s);
    }
    CHECK(wrong == 0);
  }
}

namespace {

std::vector<float> as_floats(const std::vector<uint16_t>& h) {
  std::vector<float> f((h.size() + 1) / 2, 0.0f);
  std::memcpy(f.data(), h.data(), h.size() * sizeof(uint16_t));
  return f;
}
std::vector<uint16_t> as_halves(const std::vector<float>& f, size_t n) {
  std::vector<uint16_t> h(n);
  std::memcpy(h.data(), f.data(), n * sizeof(uint16_t));
  return h;
}

}  // namespace

DP_OPS_TEST("narrow, widen and add_typed equal math.h's per element, and fp32 copies and adds") {
  const int64_t n = 100'003;
  std::vector<float> x = dp::test::random_floats(size_t(n), 81, -3, 3);
  x[0] = 1e-6f, x[1] = 70000.0f, x[2] = -0.0f, x[3] = std::ldexp(1.0f, -30), x[4] = INFINITY;
  for (DType t : kTypes) {
    CAPTURE(dtype_name(t));
    const size_t count = static_cast<size_t>(n);
    std::vector<uint16_t> want(count), other(count), sum(count);
    for (int64_t i = 0; i < n; ++i) {
      want[size_t(i)] = math::narrow(t, x[size_t(i)]);
      other[size_t(i)] = math::narrow(t, x[size_t((i * 7) % n)]);
      sum[size_t(i)] = math::add16(t, other[size_t(i)], want[size_t(i)]);
    }
    dp::test::Mem gx = be.put(x), g16 = be.out(size_t(n + 1) / 2), go = be.put(as_floats(other)),
                  gw = be.out(size_t(n));
    be.run([&](Ops& ops) {
      ops.narrow(t, n, gx.f(), g16.f());
      ops.widen(t, n, g16.f(), gw.f());
      ops.add_typed(t, n, go.f(), g16.f());
    });
    std::vector<float> widened(count);
    for (int64_t i = 0; i < n; ++i) widened[size_t(i)] = math::widen(t, want[size_t(i)]);
    dp::test::check_same_bits("widen", be.get(gw), widened);
    CHECK(as_halves(be.get(g16), size_t(n)) == sum);
  }
  dp::test::Mem gx = be.put(x), gy = be.out(size_t(n)), gz = be.out(size_t(n));
  be.run([&](Ops& ops) {
    ops.narrow(DType::fp32, n, gx.f(), gy.f());
    ops.widen(DType::fp32, n, gy.f(), gz.f());
    ops.add_typed(DType::fp32, n, gx.f(), gz.f());
  });
  dp::test::check_same_bits("fp32 copy", be.get(gy), x);
  std::vector<float> twice = x;
  for (float& v : twice) v += v;
  dp::test::check_same_bits("fp32 add", be.get(gz), twice);
}

TEST_CASE("grad-dtype: the rings reduce in the type, every partial sum rounded, at half the bytes") {
  for (const std::string& kind : dp::test::backends())
    for (DType t : kTypes)
      for (int n : {2, 3})
        for (AllReduceAlgorithm a : {AllReduceAlgorithm::ring, AllReduceAlgorithm::naive}) {
          CAPTURE(kind);
          CAPTURE(dtype_name(t));
          CAPTURE(n);
          CAPTURE(all_reduce_name(a));
          const int64_t count = 1001;
          const size_t devices = static_cast<size_t>(n);
          std::vector<std::vector<uint16_t>> in(devices),
              out(devices, std::vector<uint16_t>(static_cast<size_t>(count)));
          for (int r = 0; r < n; ++r)
            for (const float v : dp::test::random_floats(size_t(count), 90 + r, -1, 1))
              in[size_t(r)].push_back(math::narrow(t, v));
          auto devs = dp::test::make_test_devices(kind, n);
          auto comm = make_communicator(raw(devs));
          comm->set_all_reduce_algorithm(a);
          std::vector<Buffer> bufs(devices);
          spmd(
              raw(devs),
              [&](int r) {
                Device& d = *devs[size_t(r)];
                bufs[size_t(r)] = d.alloc(size_t(count) * 2, Category::gradients);
                d.upload(bufs[size_t(r)].data(), in[size_t(r)].data(), size_t(count) * 2);
                d.synchronize();
                comm->all_reduce(r, bufs[size_t(r)].data(), count, t);
                d.download(out[size_t(r)].data(), bufs[size_t(r)].data(), size_t(count) * 2);
              },
              comm.get());
          int64_t wrong = 0, different = 0;
          for (int64_t i = 0; i < count; ++i) {
            double exact = 0, magnitude = 0;
            for (int r = 0; r < n; ++r) {
              const double v = math::widen(t, in[size_t(r)][size_t(i)]);
              exact += v, magnitude += std::fabs(v);
            }
            const double got = math::widen(t, out[0][size_t(i)]);
            // n - 1 roundings of partial sums, each within u_t of the magnitudes' sum
            wrong += std::fabs(got - exact) > (n - 1) * std::ldexp(1.0, t == DType::bf16 ? -8 : -11) * magnitude;
            for (int r = 1; r < n; ++r) different += out[size_t(r)][size_t(i)] != out[0][size_t(i)];
            // Two devices: one add, the correctly rounded sum, whichever the order
            if (n == 2) wrong += out[0][size_t(i)] != math::add16(t, in[0][size_t(i)], in[1][size_t(i)]);
          }
          CHECK(wrong == 0);
          CHECK(different == 0);  // every rank the same bits
          for (int r = 0; r < n; ++r) {
            const Traffic want = all_reduce_traffic(a, r, n, count, t), fp32 = all_reduce_traffic(a, r, n, count);
            CHECK(comm->traffic(r, Collective::all_reduce).sent == want.sent);
            CHECK(comm->traffic(r, Collective::all_reduce).received == want.received);
            CHECK(2 * want.sent == fp32.sent);
          }
        }
}

namespace {

// K steps of `rows` images on n devices from init under c; the parameters after them, every
// replica checked bitwise equal after each step, and each step's bytes against the byte model.
std::vector<float> train(const ModelSpec& spec, const EngineConfig& c, int n, const Batches& data, int rows,
                         const std::vector<float>& init, std::vector<int64_t>* sent = nullptr) {
  auto devs = dp::test::make_test_devices("cpu", n);
  Engine e(raw(devs), spec, c);
  e.set_params(init);
  for (size_t s = 0; s < data.x.size(); ++s) {
    e.step(data.x[s].data(), data.y[s].data(), rows);
    for (int q = 1; q < n; ++q) REQUIRE(e.params(q) == e.params(0));
    StepShape shape{spec, split_batch(rows, n, c.split), e.buckets(), c.sync_bn, c.all_reduce};
    shape.grad_dtype = c.grad_dtype;
    const std::vector<Traffic> model = total_traffic(e.strategy().step_collectives(shape), n);
    for (int r = 0; r < n; ++r) {
      CHECK(e.recorder().step_traffic(r).sent == model[size_t(r)].sent);
      CHECK(e.recorder().step_traffic(r).received == model[size_t(r)].received);
    }
    if (sent && s == 0) sent->push_back(e.recorder().step_traffic(0).sent);
  }
  return e.params();
}

}  // namespace

TEST_CASE("grad-dtype: every strategy that takes it halves its gradients' bytes and trains within their rounding") {
  const int K = 3, rows = 24;
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 5, init.data());
  const Batches data = make_batches(K, rows, 400);
  EngineConfig base;
  base.lr = 0.1f, base.momentum = 0.9f, base.batch = rows;
  for (int n : {2, 3})
    for (const std::string sync : {"allreduce", "zero1", "zero2", "zero3"})
      for (int64_t bucket_kb : {int64_t(0), int64_t(8)}) {
        if (bucket_kb > 0 && !dp::test::takes_buckets(sync)) continue;
        CAPTURE(n);
        CAPTURE(sync);
        CAPTURE(bucket_kb);
        EngineConfig c = base;
        c.sync = sync, c.bucket_kb = bucket_kb, c.split = n == 3 ? Split::chunk : Split::even;
        std::vector<int64_t> sent;
        const std::vector<float> fp32 = train(spec, c, n, data, rows, init, &sent);
        std::vector<double> diffs;
        for (DType t : kTypes) {
          CAPTURE(dtype_name(t));
          c.grad_dtype = t;
          const double d = max_diff(train(spec, c, n, data, rows, init, &sent), fp32);
          const double bound = summation_tolerance(K, rows, c.lr, c.momentum) +
                               gradient_tolerance(K, compression_rounding(t, n), c.lr, c.momentum);
          INFO("difference from fp32 " << d << ", bound " << bound);
          CHECK(d > 0);  // the compression really happens
          CHECK(d <= bound);
          diffs.push_back(d);
        }
        CHECK(diffs[0] > diffs[1]);  // bf16's 8 bits round more than fp16's 11
        CHECK(sent[1] == sent[2]);   // both 16 bits
        // allreduce sends its gradients alone: half. The sharded ones also all-gather the parameters,
        // as many bytes as the gradients' reduce-scatter (zero3 twice: for forward and for backward),
        // which stay float32: a quarter saved (zero3 a sixth).
        const int64_t saved = sent[0] - sent[1];
        CHECK(saved * (sync == "allreduce" ? 2 : sync == "zero3" ? 6 : 4) == sent[0]);
      }
}

TEST_CASE("grad-dtype: one device sends nothing and trains as fp32, and scatter refuses it") {
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 5, init.data());
  const Batches data = make_batches(2, 16, 401);
  EngineConfig c;
  c.batch = 16, c.sync = "allreduce";
  const std::vector<float> fp32 = train(spec, c, 1, data, 16, init);
  c.grad_dtype = DType::bf16;
  CHECK(train(spec, c, 1, data, 16, init) == fp32);
  c.sync = "scatter";
  auto devs = dp::test::make_test_devices("cpu", 2);
  CHECK_THROWS_WITH_AS(Engine(raw(devs), spec, c),
                       doctest::Contains("--grad-dtype bf16: --sync scatter (nn.DataParallel) reduces its gradients to "
                                         "device 0 and has no communication hook"),
                       UsageError);
}

TEST_CASE(
    "grad-dtype: dp_train --grad-dtype halves the bytes, goes in the report and the resume identity, and refusals") {
  using dp::test::read_json;
  using dp::test::run_command;
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 128, 32);
  const std::string train =
      std::string(DP_TRAIN_BIN) + " --backend cpu --devices 2 --data " + dir.path.string() + " --batch 32 --quiet ";
  std::vector<int64_t> sent;
  for (const std::string dtype : {"fp32", "bf16", "fp16"}) {
    CAPTURE(dtype);
    const std::string report = dir / (dtype + ".json");
    dp::test::CommandResult r =
        run_command(train + "--steps 2 --sync allreduce --bucket-kb 64 --grad-dtype " + dtype + " --report " + report);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const nlohmann::json j = read_json(report);
    CHECK(j["config"]["grad_dtype"] == dtype);
    sent.push_back(j["devices"][0]["bytes_sent_per_step"].get<int64_t>());
  }
  CHECK(sent[0] == 2 * sent[1]);
  CHECK(sent[1] == sent[2]);
  // A bf16 run resumed as fp32 goes on, warned that it is no longer bit-exact (as another --sync is).
  const std::string ckpt = dir / "c.st";
  REQUIRE(run_command(train + "--steps 2 --sync zero1 --grad-dtype bf16 --save " + ckpt).exit_code == 0);
  dp::test::CommandResult again = run_command(train + "--steps 3 --sync zero1 --resume " + ckpt);
  CHECK(again.exit_code == 0);
  CHECK(again.output.find("grad_dtype bf16 -> fp32; the continuation is not guaranteed bit-exact") !=
        std::string::npos);
  dp::test::check_refusals(
      train + "--steps 2 ",
      {
          {"--grad-dtype fp8", "--grad-dtype: 'fp8' is not a gradient type; use fp32 (as computed), bf16"},
          {"--grad-dtype bf16",
           "--grad-dtype bf16: --sync scatter (nn.DataParallel) reduces its gradients to device 0 "
           "and has no communication hook"},
      },
      "epoch 1/");
}
