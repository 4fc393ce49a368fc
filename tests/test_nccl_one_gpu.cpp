// NCCL on a machine with one GPU (the lent machines have one; NCCL refuses one GPU twice). The test
// build's failpoint::nccl_always gives one GPU a one-rank NCCL clique, so NCCL's start, its polled
// waits and the buckets on the communication stream run for real; and it asks NCCL for a GPU named
// twice, which NCCL refuses (ncclInvalidUsage), so the fallback to peer copies runs. NCCL 2.30
// and later can put two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, experimental): tried where the
// library is that new, by threads of one process and by two processes under mpirun (where this build
// has MPI). Every case is a "cuda:" case, skipped visibly without a GPU.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tests/backends.h"
#include "tests/failpoint/failpoints.h"
#include "tests/mpi_job.h"
#include "tests/util.h"
#if DP_TESTS_CUDA
#include <nccl.h>

#include "engine/cuda/cuda_device.h"
#include "tests/cuda/spin.h"
#endif

using namespace dp;
using dp::test::make_batches;
using dp::test::raw;
namespace {

// Four steps of `sync` on `ids` (CUDA devices), NCCL asked for or not: the weights after them.
std::vector<float> train(const std::vector<int>& ids, const std::string& sync, int64_t bucket_kb, bool nccl) {
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 2, init.data());
  dp::test::Batches data = make_batches(4, 16, 3);
  std::vector<std::unique_ptr<Device>> devs;
  for (int r = 0; r < int(ids.size()); ++r) devs.push_back(make_cuda_device(r, ids[size_t(r)], 0));
  EngineConfig c;
  c.batch = 16, c.sync = sync, c.bucket_kb = bucket_kb;
  std::unique_ptr<failpoint::NcclAlways> always;
  if (nccl) always = std::make_unique<failpoint::NcclAlways>();
  Engine e(raw(devs), spec, c);
  always.reset();  // the communicator is made
  e.set_params(init);
  for (int s = 0; s < 4; ++s) e.step(data.x[size_t(s)].data(), data.y[size_t(s)].data(), 16);
  return e.params();
}

// Whether this NCCL can rank two processes or threads on one GPU (2.30: NCCL_MULTI_RANK_GPU_ENABLE);
// says so where it cannot.
bool multi_rank_gpu() {
  int version = 0;
#if DP_TESTS_CUDA
  REQUIRE(ncclGetVersion(&version) == ncclSuccess);
#endif
  if (version >= 23000) return true;
  MESSAGE("NCCL " << version << ": two ranks on one GPU need 2.30 (NCCL_MULTI_RANK_GPU_ENABLE); not tried");
  return false;
}

}  // namespace

TEST_CASE("cuda: nccl: a one-rank clique on one GPU and NCCL refused a shared GPU train as the peer path" *
          doctest::skip(!dp::test::cuda_available())) {
  // NCCL from 2.30 ranks one GPU twice where this says so (and reads it once a process): refused here.
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0", 1);
  for (const std::string sync : {"allreduce", "zero2"})
    for (int64_t bucket_kb : {int64_t(0), int64_t(64)}) {
      CAPTURE(sync);
      CAPTURE(bucket_kb);
      // One rank: NCCL's all-reduce and reduce-scatter of one rank copy, so the bits are the peer path's.
      CHECK(train({0}, sync, bucket_kb, true) == train({0}, sync, bucket_kb, false));
      // Two ranks on one GPU: NCCL refuses, the peer ring runs (a sum of two is the same bits either way).
      CHECK(train({0, 0}, sync, bucket_kb, true) == train({0, 0}, sync, bucket_kb, false));
    }
}

TEST_CASE("cuda: nccl: dp_train on one GPU says which NCCL ran: a one-rank clique, the fallback, two ranks" *
          doctest::skip(!dp::test::cuda_available())) {
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 256, 32);
  // --timeout 60: two ranks on one GPU driven by two threads at once is what NCCL's guide calls unsafe
  // (and NCCL_MULTI_RANK_GPU_ENABLE experimental); a hang gives up in a minute, not ten. NCCL's start in
  // one process (ncclCommInitAll) has no deadline of dp's: timeout(1) ends a hang there (exit 137).
  const std::string run = "timeout -s KILL 120 " + std::string(DP_TRAIN_BIN) +
                          " --backend cuda --sync allreduce --bucket-kb 64 --verify --steps 6 --timeout 60 "
                          "--batch 32 --data " +
                          dir.path.string();
  // What carried the collectives, as the report says (Communicator::transport).
  auto collectives = [&](const std::string& env, const std::string& gpus) {
    const std::string report = (dir.path / "report.json").string();
    const dp::test::CommandResult r =
        dp::test::run_command(env + " " + run + " --gpus " + gpus + " --report " + report);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    return r.exit_code == 0 ? dp::test::read_json(report)["config"]["collectives"].get<std::string>() : "";
  };
  CHECK(collectives("DP_TEST_NCCL=always", "0") == "nccl");
  CHECK(collectives("", "0") == "peer copies");
  CHECK(collectives("DP_TEST_NCCL=always NCCL_MULTI_RANK_GPU_ENABLE=0", "0,0 --allow-shared-device") ==
        "peer copies (NCCL could not start)");
  if (multi_rank_gpu())
    CHECK(collectives("DP_TEST_NCCL=always NCCL_MULTI_RANK_GPU_ENABLE=1", "0,0 --allow-shared-device") == "nccl");
}

// Two processes of one device each (mpirun -np 2 ... --gpus 0) on the one GPU, against one process of
// two replicas of it (peer copies): every sum is of two addends, the same bits in any order.
TEST_CASE("cuda: nccl: two processes on the one GPU under mpirun: NCCL's refusal, or two NCCL ranks" *
          doctest::skip(!dp::test::cuda_available())) {
  namespace mpi = dp::test::mpi;
  if (!mpi::have_mpi()) return;
  mpi::Job job;
  job.train = std::string(DP_TRAIN_BIN) + " --backend cuda";
  auto two = [&](const std::string& env) {
    return job.mpirun(2, "--steps 6 --gpus 0 --save " + job.dir / "p.st" + " --report " + job.dir / "p.json", env);
  };
  // Without the option dp refuses before NCCL starts (tests/test_mpi_outputs.cpp). NCCL asked: it refuses
  // one GPU twice, and every process says so instead of waiting.
  dp::test::CommandResult r = two("DP_TEST_NCCL=always NCCL_MULTI_RANK_GPU_ENABLE=0");
  INFO(r.output);  // read when a check fails: the last run's
  CHECK(r.exit_code != 0);
  CHECK(r.exit_code != 137);  // refused, not killed by timeout(1)
  CHECK(r.output.find("NCCL across processes could not start") != std::string::npos);
  CHECK(r.output.find("both use the GPU") == std::string::npos);
  CHECK(!std::filesystem::exists(job.dir / "p.st"));
  if (!multi_rank_gpu()) return;
  r = two("DP_TEST_NCCL=always NCCL_MULTI_RANK_GPU_ENABLE=1");
  REQUIRE(r.exit_code == 0);
  CHECK(dp::test::read_json(job.dir / "p.json")["config"]["collectives"] == "nccl");
  const dp::test::CommandResult one = job.one("--steps 6 --gpus 0,0 --allow-shared-device --save " + job.dir / "o.st");
  INFO(one.output);
  REQUIRE(one.exit_code == 0);
  CHECK(mpi::weights(job.dir / "p.st") == mpi::weights(job.dir / "o.st"));
}

TEST_CASE("cuda: nccl: a timeout names the oldest collective not finished, not one a later step queued behind" *
          doctest::skip(!dp::test::cuda_available())) {
#if DP_TESTS_CUDA
  // Three "steps" of buckets on a one-rank clique, each ended by wait(): the first runs; the second's
  // are held behind a spin kernel on the compute stream (a peer that never comes); the third is
  // queued behind them before the host waits for the second (--run-ahead). The download's timeout
  // must name the second step's first all-reduce, the rank's second collective.
  auto dev = make_cuda_device(0, 0, 0);
  auto* cuda = dynamic_cast<CudaDevice*>(dev.get());
  REQUIRE(cuda != nullptr);
  std::unique_ptr<Communicator> comm;
  {
    failpoint::NcclAlways always;
    comm = make_communicator({dev.get()});
  }
  comm->set_timeout(0.5);
  Buffer buf = dev->alloc_floats(256, Category::comm);
  dp::test::SpinFlag flag;
  std::vector<float> host(256);
  std::string message;
  dev->run([&] {
       comm->all_reduce_async(0, buf.data(), 256);  // 1, and the clique's start
       comm->wait(0);
       dp::test::spin_on(cuda->stream(), flag, 20.0);
       for (int i = 0; i < 2; ++i) comm->all_reduce_async(0, buf.data(), 256);  // 2 and 3, held
       comm->wait(0);
       comm->all_reduce_async(0, buf.data(), 256);  // 4, run ahead
       comm->wait(0);
       try {
         dev->download(host.data(), buf.data(), host.size() * sizeof(float));
       } catch (const TimedOut& e) {
         message = e.what();
       }
     })
      .get();
  flag.release();
  dev->run([&] { dev->synchronize(); }).get();
  INFO(message);
  CHECK(comm->transport() == "nccl");
  CHECK(message.find("NCCL's all_reduce number 2 on ") != std::string::npos);
  CHECK(message.find("(the oldest not finished; 2 more queued behind it)") != std::string::npos);
#else
  FAIL("a CUDA device is usable, but this build has no CUDA backend");
#endif
}
