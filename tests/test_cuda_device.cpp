// The CUDA device and what runs on it beyond single ops (those are in the op matrix, test_ops_*.cpp):
// a device books its memory and refuses past its cap, the collectives on CUDA devices (NCCL and the
// peer ring), cuDNN's choice of convolution algorithms, three LeNet steps on CUDA against the CPU
// reference, a failure on one replica aborting the step, and the fallback to simulated devices where
// CUDA is built but no GPU is usable. The GPU cases are skipped, visibly, on machines without one; the
// fallback case runs everywhere.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "models/model.h"
#include "tests/backends.h"
#include "tests/failpoint/failpoints.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"
#if DP_TESTS_CUDA
#include "kernels/cuda/cuda_ops.h"  // conv_choices: CudaOps' own, not the Ops interface's
#endif

namespace dp::test {
namespace {

TEST_CASE("cuda: a CUDA device books its memory, copies, and refuses past its cap" * doctest::skip(!cuda_available())) {
  auto be = make_cuda_backend();
  Device& dev = *be->device();
  CHECK(dev.name() == "cuda:0");
  CHECK(std::string(be->ops().backend()) == "cuda");
  const std::vector<float> h = random_floats(1001, 8, -1, 1);
  Mem a = be->put(h);  // booked as workspace
  Buffer b;
  std::vector<float> back(h.size());
  dev.run([&] {
       b = dev.alloc_floats(1001, Category::activations);
       dev.copy(b.f(), a.f(), 1001 * sizeof(float));
       dev.download(back.data(), b.f(), back.size() * sizeof(float));
     })
      .get();
  check_equal("round trip", back, h);
  CHECK(dev.ledger().snapshot().current[int(Category::activations)] == int64_t(1001 * sizeof(float)));

  auto capped = make_cuda_device(0, 0, 4096);
  capped
      ->run([&] {
        Buffer ok = capped->alloc(1024, Category::parameters);
        CHECK_THROWS_AS(capped->alloc(8192, Category::activations), OutOfMemory);
      })
      .get();
}

// ------------------------------------------------------------------------------------------------
// Collectives

// Runs fn(rank) on every device's compute thread at once (SPMD); a failure aborts the others.
void on_all_ranks(std::vector<std::unique_ptr<Device>>& devs, Communicator& comm, const std::function<void(int)>& fn) {
  std::vector<std::future<void>> fs;
  for (int r = 0; r < int(devs.size()); ++r)
    fs.push_back(devs[size_t(r)]->run([&, r] {
      try {
        fn(r);
      } catch (...) {
        comm.abort();
        throw;
      }
    }));
  for (auto& f : fs) f.get();
}

TEST_CASE("cuda: collectives over CUDA devices: rank r contributes r, the sum is n(n-1)/2" *
          doctest::skip(!cuda_available())) {
  const int gpus = probe_cuda().count;
  std::vector<std::vector<int>> layouts;
  if (gpus >= 2) layouts.push_back({0, 1});  // distinct GPUs: NCCL
  layouts.push_back({0, 0});                 // one GPU shared: the peer ring
  layouts.push_back(gpus >= 2 ? std::vector<int>{0, 1, 0} : std::vector<int>{0, 0, 0});  // mixed: the ring
  if (gpus >= 3) layouts.push_back({0, 1, 2});
  for (const auto& ids : layouts) {
    const int n = int(ids.size());
    CAPTURE(n);
    CAPTURE(ids[1]);
    std::vector<std::unique_ptr<Device>> devs;
    for (int r = 0; r < n; ++r) devs.push_back(make_cuda_device(r, ids[size_t(r)], 0));
    std::unique_ptr<Communicator> comm = make_communicator(raw(devs));
    const int64_t count = 1001;  // not a multiple of n: uneven chunks
    std::vector<Buffer> bufs(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      devs[size_t(r)]
          ->run([&, r] { bufs[size_t(r)] = devs[size_t(r)]->alloc_floats(count, Category::gradients); })
          .get();
    auto fill_rank = [&](int r) { devs[size_t(r)]->ops().fill(count, float(r), bufs[size_t(r)].f()); };
    auto expect_all = [&](float want, const char* what) {
      for (int r = 0; r < n; ++r) {
        std::vector<float> h(static_cast<size_t>(count));
        devs[size_t(r)]
            ->run([&] { devs[size_t(r)]->download(h.data(), bufs[size_t(r)].f(), h.size() * sizeof(float)); })
            .get();
        CHECK_MESSAGE(std::all_of(h.begin(), h.end(), [&](float x) { return x == want; }),
                      what << ": rank " << r << " holds " << h[0] << " ... " << h.back() << ", want " << want);
      }
    };
    const float sum = float(n * (n - 1) / 2);

    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      comm->all_reduce(r, bufs[size_t(r)].f(), count);
      devs[size_t(r)]->synchronize();
    });
    expect_all(sum, "all_reduce");

    // Bytes as the ring counts them, whichever communicator: the same as on simulated devices.
    {
      auto sims = make_test_devices("cpu", n);
      Communicator ring(raw(sims));
      std::vector<std::vector<float>> hs(size_t(n), std::vector<float>(size_t(count), 1.0f));
      on_all_ranks(sims, ring, [&](int r) { ring.all_reduce(r, hs[size_t(r)].data(), count); });
      for (int r = 0; r < n; ++r) {
        CHECK(comm->traffic(r, Collective::all_reduce).sent == ring.traffic(r, Collective::all_reduce).sent);
        CHECK(comm->traffic(r, Collective::all_reduce).received == ring.traffic(r, Collective::all_reduce).received);
      }
    }

    // Buckets overlapping "backward": three ranges started on the compute thread, then wait().
    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      float* b = bufs[size_t(r)].f();
      comm->all_reduce_async(r, b + 600, count - 600);
      comm->all_reduce_async(r, b + 100, 500);
      comm->all_reduce_async(r, b, 100);
      comm->wait(r);
      devs[size_t(r)]->synchronize();
    });
    expect_all(sum, "all_reduce_async");

    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      comm->broadcast(r, bufs[size_t(r)].f(), count, n - 1);
    });
    expect_all(float(n - 1), "broadcast");

    on_all_ranks(devs, *comm, [&](int r) {
      fill_rank(r);
      comm->reduce(r, bufs[size_t(r)].f(), count, 0);
      devs[size_t(r)]->synchronize();
    });
    std::vector<float> root(static_cast<size_t>(count));
    devs[0]->run([&] { devs[0]->download(root.data(), bufs[0].f(), root.size() * sizeof(float)); }).get();
    CHECK(root.front() == sum);
    CHECK(root.back() == sum);

    for (int r = 0; r < n; ++r) devs[size_t(r)]->run([&, r] { bufs[size_t(r)].reset(); }).get();
    comm.reset();
  }
}

// ------------------------------------------------------------------------------------------------
// cuDNN's algorithms

TEST_CASE("cuda: cuDNN runs every model's convolutions with deterministic GEMM-like algorithms, no fallback" *
          doctest::skip(!cuda_available())) {
#if DP_TESTS_CUDA
  // The conv layers of every model (models/model.cpp), at batches from one sample to a large
  // per-device batch, planned as the engine plans them (conv2d_workspace_floats). Every pass must be
  // the strict choice of kernels/cuda/conv2d.cu: the op matrix's element-wise bounds, the same bits
  // from run to run and the bit-exact resume all rest on it; a fallback (FFT, Winograd, a
  // non-deterministic algorithm) would only be warned about at run time.
  auto be = make_cuda_backend();
  auto* cuda = dynamic_cast<CudaOps*>(&be->ops());
  REQUIRE(cuda != nullptr);
  std::vector<ConvShape> shapes;
  for (const std::string& name : model_names())
    for (const Layer& l : make_model(name).layers)
      if (l.kind == LayerKind::conv)
        for (int n : {1, 8, 16, 32, 37, 64, 96, 128, 256})
          shapes.push_back({.n = n,
                            .c = l.in_c,
                            .h = l.in_h,
                            .w = l.in_w,
                            .k = l.out_c,
                            .kh = l.kernel,
                            .kw = l.kernel,
                            .pad = l.pad});
  std::vector<ConvChoice> choices;
  be->run([&](Ops& ops) {
    for (const ConvShape& s : shapes) CHECK(ops.conv2d_workspace_floats(s) > 0);
    choices = cuda->conv_choices();
  });
  int implicit = 0;  // passes on the implicit GEMMs (DP_CUDA_CONV=implicit: every non-direct forward and dw)
  for (const ConvShape& s : shapes) {
    INFO(describe(s));
    int passes = 0;
    for (const ConvChoice& c : choices) {
      const ConvShape& t = c.shape;
      if (std::tie(t.n, t.c, t.h, t.w, t.k, t.kh, t.kw, t.pad) != std::tie(s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad))
        continue;
      ++passes;
      INFO(c.pass << ": " << c.algo << ", " << c.math << " math, " << c.workspace_bytes << " bytes of workspace");
      CHECK(c.deterministic);
      CHECK(c.strict);
      CHECK(c.math.find("TENSOR_OP") == std::string::npos);  // FP32 FMA, never TF32 tensor cores
      if (CudaOps::implicit_wanted() && c.pass != "backward-data")
        CHECK((c.algo == "DP_DIRECT" || c.algo == "DP_IMPLICIT_GEMM"));
      implicit += c.algo == "DP_IMPLICIT_GEMM";
    }
    CHECK(passes == 3);  // forward, backward-data, backward-filter
  }
  CHECK((implicit > 0) == CudaOps::implicit_wanted());
#else
  FAIL("a CUDA device is usable, but this build has no CUDA backend");
#endif
}

// ------------------------------------------------------------------------------------------------
// Training: CUDA against the CPU reference

struct Trained {
  std::vector<float> params;
  std::vector<double> losses;
};

Trained train_three_steps(std::vector<Device*> devs, const ModelSpec& spec, const std::string& sync, int64_t bucket_kb,
                          const std::vector<float>& init, const std::vector<float>& x, const std::vector<int32_t>& y,
                          int batch) {
  EngineConfig ec;
  ec.sync = sync, ec.batch = batch, ec.lr = 0.05f, ec.momentum = 0.9f, ec.weight_decay = 1e-4f,
  ec.bucket_kb = bucket_kb;
  Engine engine(std::move(devs), spec, ec);
  engine.set_params(init);
  Trained t;
  for (int s = 0; s < 3; ++s) t.losses.push_back(engine.step(x.data(), y.data(), batch).loss);
  t.params = engine.params();
  return t;
}

TEST_CASE("cuda: three LeNet steps on CUDA match the CPU from the same weights and batch" *
          doctest::skip(!cuda_available())) {
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 7, init.data());
  const int batch = 64;
  std::mt19937 rng(9);
  auto x = random_floats(size_t(batch) * size_t(spec.input_size()), uint32_t(rng()), 0.0f, 1.0f);
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (auto& l : y) l = int32_t(rng() % 10);

  // The oracle is the CPU's reference kernels (kernels/cpu/kernels.h), not the fast ones this CPU
  // would pick: those are themselves tested against the reference, and their error would add to
  // CUDA's in the comparison.
  std::vector<std::unique_ptr<Device>> cpu_devs;
  cpu_devs.push_back(make_simulated_device(0, 0, 0, make_cpu_ops(cpu::Isa::reference)));
  REQUIRE(std::string(cpu_devs[0]->ops().variant()) == "reference");
  const Trained ref = train_three_steps(raw(cpu_devs), spec, "allreduce", 0, init, x, y, batch);

  struct Variant {
    const char* name;
    int devices;
    std::string sync;
    int64_t bucket_kb;
  };
  for (const Variant& v :
       {Variant{"one GPU", 1, "allreduce", 0}, Variant{"two replicas, allreduce in buckets", 2, "allreduce", 16},
        Variant{"two replicas, allreduce", 2, "allreduce", 0}, Variant{"two replicas, scatter", 2, "scatter", 0}}) {
    CAPTURE(v.name);
    auto devs = make_test_devices("cuda", v.devices);
    const Trained got = train_three_steps(raw(devs), spec, v.sync, v.bucket_kb, init, x, y, batch);
    // Per step CUDA's gradients differ from the reference's by at most the two summation-order
    // bounds, about gamma(800) (fc1's fan-in) ~ 5e-5 relative to sums of |terms| of the gradients'
    // own size (the loss's exp and log, within 2 ulp on either side, add far less); three SGD steps
    // at lr 0.05 with momentum move the weights by ~ 3 lr (1 + 0.9 + 0.81) |g| per weight, so their
    // differences stay near 1e-6 (the fast CPU kernels, summing in orders of their own, end within
    // 1.5e-8 of the reference here). A wrong kernel moves them by ~ lr |g| ~ 1e-3 (the weights move
    // by up to 0.026 in these steps). The tolerance sits between: 1e-4 + 1e-3 |w|.
    std::vector<double> tol(ref.params.size());
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = 1e-4 + 1e-3 * std::fabs(double(ref.params[i]));
    check_close(std::string("weights, ") + v.name, got.params, ref.params, tol);
    for (int s = 0; s < 3; ++s)
      CHECK(std::fabs(got.losses[size_t(s)] - ref.losses[size_t(s)]) <= 1e-4 * std::fabs(ref.losses[size_t(s)]));
  }
}

TEST_CASE("cuda: a failure on one replica aborts the step on all, and the next step runs" *
          doctest::skip(!cuda_available())) {
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 3, init.data());
  const int batch = 32;
  std::mt19937 rng(10);
  auto x = random_floats(size_t(batch) * size_t(spec.input_size()), uint32_t(rng()), 0.0f, 1.0f);
  std::vector<int32_t> y(size_t(batch), 1);
  for (int64_t bucket_kb : {int64_t(0), int64_t(16)}) {
    CAPTURE(bucket_kb);
    auto devs = make_test_devices("cuda", 2);
    EngineConfig ec;
    ec.sync = "allreduce", ec.batch = batch, ec.bucket_kb = bucket_kb;
    Engine engine(raw(devs), spec, ec);
    engine.set_params(init);
    dp::failpoint::inject_fault(*devs[1], "test");
    CHECK_THROWS_AS(engine.step(x.data(), y.data(), batch), DeviceError);
    StepResult r = engine.step(x.data(), y.data(), batch);
    CHECK(std::isfinite(r.loss));
  }
}

// ------------------------------------------------------------------------------------------------
// Every machine

TEST_CASE("without a usable CUDA device, auto falls back to simulated devices and --backend cuda is refused") {
  const CudaProbe probe = probe_cuda();
  if (probe.count > 0) {
    MESSAGE("this machine has " << probe.count << " CUDA device(s): the fallback is not exercised here");
    DeviceConfig cfg;
    cfg.backend = "cpu";
    CHECK(make_devices(cfg).devices.at(0)->kind() == DeviceKind::simulated);
    return;
  }
  CHECK_FALSE(probe.reason.empty());
  if (cuda_built()) {
    MESSAGE("CUDA is built in; the probe says: " << probe.reason);
    CHECK(probe.reason.find("no CUDA") != std::string::npos);
  }
  DeviceConfig cfg;
  cfg.backend = "auto";
  cfg.ids = {0, 1};
  DeviceSet set = make_devices(cfg);
  REQUIRE(set.devices.size() == 2);
  for (auto& d : set.devices) CHECK(d->kind() == DeviceKind::simulated);
  CHECK(set.notice.find("simulated") != std::string::npos);
  CHECK(set.notice.find(probe.reason) != std::string::npos);

  DeviceConfig want_cuda = cfg;
  want_cuda.backend = "cuda";
  CHECK_THROWS_AS(make_devices(want_cuda), UsageError);
  CHECK_THROWS_AS(make_cuda_device(0, 0, 0), UsageError);

  // And the fallback devices train: the same batch five times, the loss goes down.
  const ModelSpec spec = make_model("lenet");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 11, init.data());
  const int batch = 16;
  std::mt19937 rng(12);
  auto x = random_floats(size_t(batch) * size_t(spec.input_size()), uint32_t(rng()), 0.0f, 1.0f);
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (auto& l : y) l = int32_t(rng() % 10);
  std::vector<Device*> ptrs;
  for (auto& d : set.devices) ptrs.push_back(d.get());
  EngineConfig ec;
  ec.sync = "allreduce", ec.batch = batch, ec.lr = 0.05f;
  Engine engine(ptrs, spec, ec);
  engine.set_params(init);
  const double first = engine.step(x.data(), y.data(), batch).loss;
  double last = first;
  for (int s = 0; s < 4; ++s) last = engine.step(x.data(), y.data(), batch).loss;
  CHECK(std::isfinite(first));
  CHECK(last < first);
}

}  // namespace
}  // namespace dp::test
