// Running dp across processes from a test (test_mpi.cpp, test_mpi_outputs.cpp): mpirun on loopback
// under timeout(1), a synthetic data set, and the hierarchical all-reduce's bytes derived from the
// ring's model.
#pragma once

#include <doctest/doctest.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "models/model.h"
#include "tests/util.h"

namespace dp::test::mpi {

// As root, more ranks than the 2 cores, loopback only, and ranks that yield while they wait (busy
// polling ranks starve each other on 2 cores).
inline const std::string kMpirun =
    "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
    "OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_mpi_yield_when_idle=1 "
    "timeout -s KILL 120 " +
    std::string(DP_MPIEXEC[0] ? DP_MPIEXEC : "mpirun");

inline bool have_mpi() {
  if (!DP_TESTS_MPI || !std::filesystem::exists(DP_MPIEXEC)) {
    MESSAGE("skipped: this build has no MPI backend or no mpirun (apt-get install libopenmpi-dev openmpi-bin)");
    return false;
  }
  return true;
}

// 192 training images, batches of 24: 8 steps an epoch.
struct Job {
  TempDir dir;
  std::string args;
  std::string train = kTrainCpu;  // dp_train and its backend
  Job() {
    std::filesystem::create_directory(dir / "data");
    write_synthetic_dataset(dir / "data", 192, 40);
    args = " --data " + dir / "data" + " --quiet";
  }
  // P processes running dp_train with `more`, each with the variables `env` ("NAME=value ...", given
  // to mpirun's -x).
  CommandResult mpirun(int processes, const std::string& more, const std::string& env = "") const {
    std::string exports;
    std::istringstream vars(env);
    for (std::string var; vars >> var;) exports += " -x " + var;
    return run_command(kMpirun + " -np " + std::to_string(processes) + exports + " " + train + with(more));
  }
  CommandResult one(const std::string& more) const { return run_command("timeout -s KILL 120 " + train + with(more)); }
  // --sync allreduce and --batch 24 unless `more` gives them.
  std::string with(const std::string& more) const {
    return args + (more.find("--sync") == std::string::npos ? " --sync allreduce" : "") +
           (more.find("--batch") == std::string::npos ? " --batch 24 " : " ") + more;
  }
};

// The hierarchical all-reduce's bytes for device k of `process` (K devices a process, P processes), as
// derived here from the ring's model: the ring over the process's K devices, then device k's chunk
// over the P processes.
struct Hierarchical {
  Traffic local, inter;
  Hierarchical(int64_t count, int K, int P, int k, int process)
      : local(ring_all_reduce_traffic(k, K, count)),
        inter(ring_all_reduce_traffic(process, P, even_chunks(count, K)[size_t(K > 1 ? ring_owned_chunk(k, K) : 0)])) {}
};

inline std::vector<float> weights(const std::string& path) { return load_checkpoint(path, make_model("lenet")).params; }

}  // namespace dp::test::mpi
