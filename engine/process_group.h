// The processes of one job, as torch.distributed's process group or Horovod's: `mpirun -np P dp_train
// --sync allreduce --devices K` starts P processes, each driving its own K devices with its own Engine;
// the job trains on all P·K devices. OpenMPI launches the processes and moves their host memory
// (engine/mpi/); there is no launcher or socket protocol of dp's own.
//
// Collectives here are SPMD over processes: every process calls the same ones in the same order. Each
// runs on a channel: channel 0.. K-1 belong to the process's local devices (device k's thread uses
// channel k, so the K devices' cross-process all-reduces run concurrently, each on its own MPI
// communicator), and kHostChannel to the thread that drives the engine (the trainer's start-up checks,
// the step's statistics). Every wait is bounded by a Deadline and watches an abort flag (wait.h): a
// process that stops answering trips --timeout instead of hanging the job.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/flight_recorder.h"
#include "engine/wait.h"
#include "kernels/dtype.h"

namespace dp {

// True when this process was started by an MPI launcher: its environment has OpenMPI's
// OMPI_COMM_WORLD_SIZE, PMIx's PMIX_RANK or MPICH/Hydra's PMI_SIZE. A plain dp_train never starts
// MPI, so it does not pay MPI's start-up (0.3-0.5 s).
bool launched_by_mpi();
// Whether this build has the MPI backend (CMake DP_MPI).
bool mpi_built();

inline constexpr int kHostChannel = -1;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& host() const { return host_; }
  // "rank 1 (node7)": how messages name a process.
  std::string who(int rank) const;
  std::string who() const { return who(rank_); }
  // The host name of every rank, gathered when the group was joined.
  const std::vector<std::string>& hosts() const { return hosts_; }

  // The last collectives across processes (flight_recorder.h), written as JSON to flight_path() when
  // the job fails: a wait past its deadline, or abort(). The directory defaults to $TMPDIR (or /tmp)
  // /dp-flight-<host of rank 0>-<its pid>, one file per rank; dp_train's --flight-dir sets it.
  FlightRecorder& flight() { return flight_; }
  void set_flight_dir(const std::string& dir) { flight_dir_ = dir; }
  std::string flight_path() const;
  // Writes this rank's records, with `why` the job failed; returns the path, or why it could not.
  std::string write_flight_record(const std::string& why);

  // Opens channels 0..n-1 (n local devices; the same n on every process, which the trainer's start-up
  // check makes sure of before calling this, since a mismatch would leave the others waiting).
  virtual void open_channels(int n) = 0;

  // Sum of every process's buf (count elements of `type`, kernels/dtype.h) into every process's buf;
  // `what` names it in a timeout's message. An `aborted` that turns true (a local device failed) ends
  // the wait with Aborted. In a 16-bit type each partial sum is rounded to the type (math::add16), as
  // the communicators' rings do.
  virtual void all_reduce(int channel, void* buf, int64_t count, DType type, const Deadline& deadline,
                          const std::string& what, const std::function<bool()>& aborted) = 0;
  // The sharded collectives across processes: buf holds size() blocks of `count` elements (of `type`;
  // all_gather's floats). reduce_scatter:
  // afterwards this process's block rank() holds the sum over every process of that block (the other
  // blocks are left as they were); all_gather: every process's block rank() goes to the same place in
  // every process's buf.
  virtual void reduce_scatter(int channel, void* buf, int64_t count, DType type, const Deadline& deadline,
                              const std::string& what, const std::function<bool()>& aborted) = 0;
  virtual void all_gather(int channel, float* buf, int64_t count, const Deadline& deadline, const std::string& what,
                          const std::function<bool()>& aborted) = 0;
  // Host channel: element-wise sum and max of small vectors of doubles (the step's statistics and
  // its stop flag).
  virtual void all_reduce_sum(double* buf, int count, const Deadline& deadline, const std::string& what) = 0;
  virtual void all_reduce_max(double* buf, int count, const Deadline& deadline, const std::string& what) = 0;
  // Root's bytes into every process's buf (the same size everywhere).
  virtual void broadcast(int channel, void* buf, int64_t bytes, int root, const Deadline& deadline,
                         const std::string& what, const std::function<bool()>& aborted) = 0;
  // Host channel: every process's string, in rank order.
  virtual std::vector<std::string> all_gather(const std::string& mine, const Deadline& deadline,
                                              const std::string& what) = 0;
  // Host channel: returns once every process has called it.
  virtual void barrier(const Deadline& deadline, const std::string& what) = 0;
  // Host channel: MPI_Allreduce (sum) as MPI gives it, blocking, with no deadline and no abort: the
  // reference dp_bench comm measures the all-reduce across processes against. Not for training.
  virtual void all_reduce_blocking(float* buf, int64_t count) = 0;
  // Ends every process of the job with exit status `code` (MPI_Abort): the one way out when this
  // process failed and the others may be waiting for it in a collective.
  [[noreturn]] virtual void abort(int code) = 0;

 protected:
  int rank_ = 0, size_ = 1;
  std::string host_;
  std::vector<std::string> hosts_;
  FlightRecorder flight_;
  std::string flight_dir_;  // set when the group is joined, from rank 0's host and pid
};

// Initialises MPI (MPI_THREAD_MULTIPLE: every device thread calls it) and joins the job's processes.
// Throws UsageError where this build has no MPI. The group finalises MPI when destroyed.
std::unique_ptr<ProcessGroup> join_process_group();

// For a program's main (dp_train, dp_bench): null when no MPI launcher started this process;
// otherwise the joined group, with stdout silenced on every rank but 0 (rank 0 alone speaks; every
// rank's errors still reach stderr). Where joining fails it prints "<program>: ..." and exits: 2 when
// this build has no MPI, 1 when MPI failed.
std::unique_ptr<ProcessGroup> join_if_launched(const char* program);

}  // namespace dp
