// dp across processes, what a job writes and reads (mpirun -np P dp_train / dp_bench; see test_mpi.cpp
// for the training itself): dp_bench comm beside MPI_Allreduce, one --trace file with a process per
// rank, --verify against one device on rank 0, --resume and --load read by rank 0 alone, and NCCL
// across processes where GPUs are. Every mpirun runs on loopback under timeout(1).
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <thread>
#include <tuple>
#include <utility>

#include "engine/communicator.h"
#include "engine/device.h"
#include "models/model.h"
#include "tests/backends.h"
#include "tests/bench_runner.h"
#include "tests/mpi_job.h"
#include "tests/util.h"
#include "train/verify.h"

using namespace dp;
using namespace dp::test;

using namespace dp::test::mpi;

namespace {

// comm's alpha-beta fit across processes: the median of its --repeats 2 sweeps, and the first sweep's
// fit the table's: t = alpha + x / beta in relative error (weights 1 / t^2) over the table's dp times, x
// a ring's bytes per rank over the job's n devices, so at the fit the weighted residuals sum to 0 and are
// orthogonal to x (the first only where alpha was not clamped to 0). No fit only on a badly loaded machine.
void check_fit(const nlohmann::json& j, int n) {
  CHECK(j["repeats"] == 2);
  if (j["alpha_beta"].is_null()) return;
  dp::test::bench_runner::check_median_fit(j["alpha_beta"], 2);
  const nlohmann::json& first = j["alpha_beta"]["per_repeat"][0];
  if (first.is_null()) return;
  const double alpha = first["alpha_us"].get<double>() * 1e-6, beta = first["beta_gbps"].get<double>() * 1e9;
  double sum = 0, sum_x = 0, scale = 0, scale_x = 0;
  for (const nlohmann::json& p : j["points"]) {
    const double t = p["dp"]["time_us"].get<double>() * 1e-6, x = p["bytes"].get<double>() * 2 * (n - 1) / n;
    const double r = (t - alpha - x / beta) / (t * t);
    sum += r, sum_x += r * x, scale += std::abs(r), scale_x += std::abs(r * x);
  }
  CHECK(sum_x == doctest::Approx(0).scale(scale_x).epsilon(1e-6));
  if (alpha > 0) CHECK(sum == doctest::Approx(0).scale(scale).epsilon(1e-6));
}

}  // namespace

TEST_CASE("mpi: dp_bench comm measures the all-reduce across processes beside MPI_Allreduce, bytes on the model") {
  if (!have_mpi()) return;
  TempDir dir;
  const std::string bench = std::string(DP_BENCH_BIN) + " comm --backend cpu";
  const int64_t lenet = make_model("lenet").param_count;
  for (int K : {1, 2}) {
    CAPTURE(K);
    const std::string json = dir / "c.json";
    CommandResult r = run_command(kMpirun + " -np 2 " + bench + " --devices " + std::to_string(K) +
                                  " --min-bytes 4K --max-bytes 64K --iters 2 --repeats 2 --json " + json);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("bytes: every device equals the model") != std::string::npos);
    CHECK(r.output.find("every device's sums right, its bytes on the hierarchical model") != std::string::npos);
    const nlohmann::json j = read_json(json);
    for (const nlohmann::json& d : j["bytes_check"]) {  // reduce-scatter and all-gather, device by device
      CHECK(d["sharded"]["values_right"] == true);
      CHECK(d["sharded"]["matches_model"] == true);
    }
    CHECK(j["processes"] == 2);
    CHECK(j["devices_per_process"] == K);
    // 4K..64K doubling, and LeNet's gradient, ascending.
    REQUIRE(j["points"].size() == 6);
    CHECK(j["points"][5]["bytes"] == lenet * 4);
    CHECK(j["points"][5]["lenet_gradient"] == true);
    for (const nlohmann::json& p : j["points"]) {
      const int n = 2 * K;
      CHECK(p["dp"]["ranks"] == n);
      CHECK(p["mpi"]["ranks"] == 2);
      // nccl-tests' definitions: algbw = S / t, busbw = algbw x 2(n-1)/n.
      const double t = p["dp"]["time_us"].get<double>() * 1e-6;
      CHECK(p["dp"]["algbw_gbps"].get<double>() == doctest::Approx(p["bytes"].get<double>() / t / 1e9));
      CHECK(p["dp"]["busbw_gbps"].get<double>() ==
            doctest::Approx(p["dp"]["algbw_gbps"].get<double>() * 2 * (n - 1) / n));
      CHECK(p["mpi"]["busbw_gbps"].get<double>() == doctest::Approx(p["mpi"]["algbw_gbps"].get<double>()));
    }
    // Every device of both processes, its bytes as the trainer's test derives them.
    REQUIRE(j["bytes_check"].size() == size_t(2 * K));
    for (const nlohmann::json& d : j["bytes_check"]) {
      const int process = d["process"], k = d["job_rank"].get<int>() % K;
      const Hierarchical m(lenet, K, 2, k, process);
      CHECK(d["local_sent"] == m.local.sent);
      CHECK(d["local_received"] == m.local.received);
      CHECK(d["inter_sent"] == m.inter.sent);
      CHECK(d["inter_received"] == m.inter.received);
      CHECK(d["matches_model"] == true);
    }
    check_fit(j, 2 * K);
  }
  // Processes with different device counts are refused before any channel opens; the other
  // subcommands measure one process.
  CommandResult m = run_command(kMpirun + " -np 1 " + bench + " --devices 1 : -np 1 " + bench + " --devices 2");
  CHECK(m.exit_code == 2);
  CHECK(m.output.find("disagree: devices per process") != std::string::npos);
  CommandResult c = run_command(kMpirun + " -np 2 " + DP_BENCH_BIN + " compare --backend cpu --devices 2");
  CHECK(c.exit_code == 2);
  CHECK(c.output.find("only comm measures across processes") != std::string::npos);
  CHECK(c.output.find("MPI_ABORT") == std::string::npos);  // said once, by rank 0
  // Sizes that cannot fit the host's memory (two processes' buffers) are refused before any buffer is
  // allocated; they ran until the OOM killer ended the job.
  CommandResult big = run_command(kMpirun + " -np 2 " + bench + " --devices 1 --min-bytes 4K --max-bytes 4096G");
  INFO(big.output);
  CHECK(big.exit_code == 2);
  CHECK(big.output.find("--max-bytes 4096.00 GiB: this run needs about") != std::string::npos);
  CHECK(big.output.find("give --max-bytes ") != std::string::npos);
  CHECK(big.output.find("MPI_ABORT") == std::string::npos);
}

TEST_CASE("mpi: --trace is one file, a process per rank, a lane per device named by its job rank, clocks aligned") {
  if (!have_mpi()) return;
  Job job;
  const int steps = 3;
  CommandResult r = job.mpirun(2, "--devices 2 --steps " + std::to_string(steps) + " --trace " + job.dir / "t.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json t = read_json(job.dir / "t.json");  // throws unless it is JSON
  std::map<int, std::string> processes;                    // pid -> process_name
  std::map<std::pair<int, int>, std::string> lanes;        // (pid, tid) -> thread_name
  // (pid, tid, step) -> the phases of that step on that lane, by name
  std::map<std::tuple<int, int, int64_t>, std::map<std::string, nlohmann::json>> phases;
  double last_ts = 0;
  for (const nlohmann::json& e : t["traceEvents"]) {
    const int pid = e["pid"];
    if (e["ph"] == "M") {
      if (e["name"] == "process_name") processes[pid] = e["args"]["name"];
      if (e["name"] == "thread_name") lanes[{pid, e["tid"].get<int>()}] = e["args"]["name"];
      continue;
    }
    REQUIRE(e["ph"] == "X");
    CHECK(e["ts"].get<double>() >= last_ts);  // one time line: every rank's spans merged in time order
    last_ts = e["ts"].get<double>();
    if (e["cat"] == "phase") phases[{pid, e["tid"].get<int>(), e["args"]["step"].get<int64_t>()}][e["name"]] = e;
  }
  REQUIRE(processes.size() == 2);
  CHECK(processes[0].rfind("rank 0 (", 0) == 0);
  CHECK(processes[1].rfind("rank 1 (", 0) == 0);
  // Rank 1's devices are the job's devices 2 and 3.
  auto lane = [&](int pid, int tid) { return lanes[std::pair(pid, tid)]; };
  for (int g = 0; g < 4; ++g) CHECK(lane(g / 2, g % 2) == "sim:" + std::to_string(g));
  CHECK(lane(0, 4) == "host");
  CHECK(lane(1, 4) == "host");
  double worst = -1e300;  // the largest gap seen (negative: the spans overlap by that much)
  for (int64_t s = 0; s < steps; ++s)
    for (int k = 0; k < 2; ++k) {
      CAPTURE(s);
      CAPTURE(k);
      for (int p = 0; p < 2; ++p)
        for (const char* phase : {"load", "forward", "loss", "backward", "all-reduce", "optimizer"}) {
          const bool has = phases[std::tuple(p, k, s)].count(phase) == 1;
          CHECK_MESSAGE(has, "rank " << p << " device " << k << " lacks " << phase);
        }
      // Device k's all-reduce on either rank waits for the other's: on one clock the two spans overlap,
      // up to the alignment's error (a bound for a loaded machine, not a precision: the error seen is
      // printed below, some tens of microseconds unloaded).
      const nlohmann::json &a = phases[{0, k, s}]["all-reduce"], &b = phases[{1, k, s}]["all-reduce"];
      auto end = [](const nlohmann::json& e) { return e["ts"].get<double>() + e["dur"].get<double>(); };
      const double gap = std::max(a["ts"].get<double>(), b["ts"].get<double>()) - std::min(end(a), end(b));
      worst = std::max(worst, gap);
      CHECK(gap <= 20000);
    }
  MESSAGE("largest gap between the ranks' all-reduce spans of one step: " << worst << " us (< 0: overlapping)");
}

TEST_CASE("mpi: --verify compares rank 0's replica with one device on the whole batch, every process exits alike") {
  if (!have_mpi()) return;
  Job job;
  CommandResult r = job.mpirun(2, "--devices 2 --steps 8 --verify --report " + job.dir / "r.json");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("verify: largest weight difference from 1 device after 8 steps") != std::string::npos);
  CHECK(r.output.find(") ok") != std::string::npos);
  nlohmann::json rep = read_json(job.dir / "r.json");
  CHECK(rep["verify"]["ok"] == true);
  // The summation bound and each step's rounding of the update, an ulp of the largest weight (a few %).
  CHECK(rep["verify"]["tolerance"].get<double>() > summation_tolerance(8, 24, 0.1f, 0.9f));
  CHECK(rep["verify"]["tolerance"].get<double>() ==
        doctest::Approx(summation_tolerance(8, 24, 0.1f, 0.9f)).epsilon(0.1));
  CHECK(rep["verify"]["max_abs_diff"].get<double>() <= rep["verify"]["tolerance"].get<double>());
  CHECK(rep["verify"]["max_abs_diff"].get<double>() > 0);  // 4 devices sum in another order than 1

  // The reference moved by the test hook: verify fails on rank 0, and every process exits 1.
  const std::string args = job.with("--devices 2 --steps 8 --verify --report " + job.dir / "r.json");
  r = run_command(kMpirun + " -x DP_TEST_VERIFY_OFFSET=0.5 -np 2 " + kTrainCpu + args);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("after 8 steps: 0.5 (tolerance 1.") != std::string::npos);
  CHECK(r.output.find("e-05) over it") != std::string::npos);  // lenet's ReLUs: then held to the movement
  CHECK(r.output.find("with ReLUs or max-pools FAILED: 0.5 is more than 10%") != std::string::npos);
  CHECK(read_json(job.dir / "r.json")["verify"]["ok"] == false);
}

TEST_CASE("mpi: --resume and --load are read by rank 0 alone and broadcast, a refusal ends every process with exit 2") {
  if (!have_mpi()) return;
  Job job;
  const std::string ck = job.dir / "ck.st", full = job.dir / "full.st", resumed = job.dir / "resumed.st";
  REQUIRE(job.mpirun(2, "--devices 2 --steps 5 --save " + ck).exit_code == 0);
  REQUIRE(job.mpirun(2, "--devices 2 --steps 12 --save " + full).exit_code == 0);
  // Rank 1's --resume names a file that does not exist (as on a host without it): it resumes all the same.
  const std::string args = job.with("--devices 2 --steps 12 --save " + resumed);
  CommandResult r = run_command(kMpirun + " -np 1 " + kTrainCpu + args + " --resume " + ck + " : -np 1 " + kTrainCpu +
                                args + " --resume " + job.dir / "absent.st");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  check_same_tensors(resumed, full);

  // Rank 0's file missing, or corrupt: exit 2 on every process, rank 0's message once, no hang.
  const std::string corrupt = job.dir / "corrupt.st";
  std::string bytes = slurp(ck);
  bytes.resize(bytes.size() / 2);
  write_file(corrupt, bytes, false);
  for (const auto& refused : {std::pair{job.dir / "absent.st", std::string(": no such checkpoint file")},
                              std::pair{corrupt, std::string(": not a valid safetensors file: ")}}) {
    const std::string& file = refused.first;
    const std::string& says = refused.second;
    CAPTURE(file);
    const auto start = std::chrono::steady_clock::now();
    r = run_command(kMpirun + " -np 1 " + kTrainCpu + args + " --resume " + file + " : -np 1 " + kTrainCpu + args +
                    " --resume " + ck);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("rank 0 (") != std::string::npos);
    CHECK(r.output.find(file + says) != std::string::npos);
    CHECK(r.output.find("rank 1 (") == std::string::npos);   // said once, by rank 0
    CHECK(r.output.find("MPI_ABORT") == std::string::npos);  // every process ended on its own
    CHECK(seconds < 60);                                     // a bound on a hang, not a speed
  }

  // Rank 0 resumes, rank 1 was not told to: refused as a disagreement.
  r = run_command(kMpirun + " -np 1 " + kTrainCpu + args + " --resume " + ck + " : -np 1 " + kTrainCpu + args);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("disagree: resume: rank 0 (") != std::string::npos);

  // --load likewise: rank 0 alone reads it (rank 1's names no file) and every replica starts from its
  // weights, as when both read it; a refusal on rank 0 ends every process with exit 2.
  const std::string loaded = job.dir / "loaded.st", both = job.dir / "both.st";
  const std::string load = job.with("--devices 2 --steps 3 --load " + ck + " --save ");
  r = run_command(kMpirun + " -np 1 " + kTrainCpu + load + loaded + " : -np 1 " + kTrainCpu +
                  job.with("--devices 2 --steps 3 --load " + job.dir / "absent.st" + " --save " + loaded));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  REQUIRE(job.mpirun(2, "--devices 2 --steps 3 --load " + ck + " --save " + both).exit_code == 0);
  check_same_tensors(loaded, both);
  const std::string fresh = job.dir / "fresh.st";  // and the load mattered: from --seed's weights it ends elsewhere
  REQUIRE(job.mpirun(2, "--devices 2 --steps 3 --save " + fresh).exit_code == 0);
  CHECK(max_diff(weights(loaded), weights(fresh)) > 0.01);
  r = run_command(kMpirun + " -np 1 " + kTrainCpu + job.with("--devices 2 --steps 3 --load " + corrupt + " --save ") +
                  loaded + " : -np 1 " + kTrainCpu + load + loaded);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find(corrupt + ": not a valid safetensors file: ") != std::string::npos);
  CHECK(r.output.find("rank 1 (") == std::string::npos);
}

// GPUs across processes: one NCCL communicator over every GPU of every process (engine/cuda/
// nccl_process_communicator.cpp). With one GPU: two processes that would share it are refused on every
// process before NCCL starts, quickly and with the reason. With two: one GPU per process
// (CUDA_VISIBLE_DEVICES by local rank) trains as one process on both GPUs, every byte of the ring of two
// counted as across processes.
TEST_CASE("cuda: mpi: NCCL across processes, one GPU each, two processes on one GPU refused, no hang" *
          doctest::skip(!cuda_available())) {
  if (!have_mpi()) return;
  Job job;
  job.train = std::string(DP_TRAIN_BIN) + " --backend cuda";
  CommandResult shared = job.mpirun(2, "--gpus 0 --steps 2 --save " + job.dir / "p.st");
  INFO(shared.output);
  CHECK(shared.exit_code != 0);
  CHECK(shared.exit_code != 137);  // refused, not killed by timeout(1)
  CHECK(shared.output.find("both use the GPU at PCI") != std::string::npos);
  CHECK(!std::filesystem::exists(job.dir / "p.st"));
  if (probe_cuda().count < 2) {
    MESSAGE("skipped: training across processes on GPUs needs two GPUs, one per process");
    return;
  }
  const int steps = 6;
  const std::string run = " --gpus 0 --steps " + std::to_string(steps);
  CommandResult m =
      run_command(kMpirun + " -np 2 sh -c 'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec " + job.train +
                  job.with(run + " --save " + job.dir / "p.st" + " --report " + job.dir / "p.json") + "'");
  INFO(m.output);
  REQUIRE(m.exit_code == 0);
  CommandResult o = job.one("--gpus 0,1 --steps " + std::to_string(steps) + " --save " + job.dir / "o.st");
  REQUIRE(o.exit_code == 0);
  CHECK(max_diff(weights(job.dir / "p.st"), weights(job.dir / "o.st")) <= summation_tolerance(steps, 24, 0.1f, 0.9f));
  const int64_t P = make_model("lenet").param_count;
  const nlohmann::json r = read_json(job.dir / "p.json");
  REQUIRE(r["devices"].size() == 2);
  for (const nlohmann::json& dev : r["devices"]) {
    const Traffic t = ring_all_reduce_traffic(dev["job_rank"], 2, P);  // NCCL's ring over the 2 GPUs
    CHECK(dev["bytes_sent_per_step"] == 0);                            // one GPU per process: every link crosses
    CHECK(dev["bytes_received_per_step"] == 0);
    CHECK(dev["inter_process_bytes_sent_per_step"] == t.sent);
    CHECK(dev["inter_process_bytes_received_per_step"] == t.received);
    CHECK(dev["parameters_fnv1a"] == r["devices"][0]["parameters_fnv1a"]);
  }
}
