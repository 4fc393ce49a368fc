// dp_train: the command-line front end. Exit codes: 0 done, 1 --verify failed or a device failed,
// 2 bad input, 3 non-finite loss or gradients, 128 + signal when stopped by SIGHUP, SIGINT or SIGTERM
// (129, 130, 143; also when the grace deadline after one ends the process); 1 also when the system
// refuses a write (disk full, permission): the command line was fine, the OS's reason is printed. A
// refused --log record stops the log, not the run: it trains and writes the rest, then exits 1.
// Under mpirun (README "Across processes and hosts") every process exits with these codes; a failure on
// one process ends the job with its code (MPI_Abort).
#include <csignal>
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <string>

#include "engine/error.h"
#include "train/job.h"
#include "train/options.h"
#include "train/progress.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace {

// The options read (across processes, a refusal anywhere every process's), then the training or the
// evaluation; the exit code of a run that ended without an error.
int train_or_evaluate(int argc, char** argv, dp::ProcessGroup* group, const std::string& who) {
  const bool job = group && group->size() > 1;
  dp::TrainOptions opt;
  bool parsed = false;
  auto read_options = [&] {
    parsed = dp::parse_train_args(argc, argv, opt);
    if (parsed && opt.eval && job) dp::check_job_options(opt, group->size());  // refuses --eval across processes
  };
  // Across processes a mistyped option is every process's refusal, said once by rank 0 (exit 2 on
  // every process, no MPI_Abort); the options' own --timeout is not read yet.
  if (job)
    dp::refuse_together(*group, dp::kDefaultTimeout, read_options);
  else
    read_options();
  if (!parsed) return 0;
  bool ok = true;
  std::string log_failure;
  if (opt.eval) {  // --eval --load FILE: the checkpoint on the test set, nothing trained
    dp::evaluate_checkpoint(opt);
  } else {
    const dp::TrainResult r = dp::train(opt, group);
    ok = r.verify_ok, log_failure = r.log_failure;
  }
  // A signal after the run's last safe point, as it was returning: everything had been written.
  if (int sig = dp::signal_received()) {
    std::fprintf(stderr, "%sdp_train: %s as the run ended; every output was written\n", who.c_str(),
                 dp::describe_signal(sig).c_str());
    return 128 + sig;
  }
  if (!log_failure.empty()) {  // the run went on without its log: the outputs are whole, the log is not
    std::fprintf(stderr, "%sdp_train: error: %s; every other output was written\n", who.c_str(), log_failure.c_str());
    return 1;
  }
  return ok ? 0 : 1;
}

// The run, and its exit code. In a job of several processes (mpirun), an error is said with the
// process's rank and host; the errors every process meets alike at the same point (settings that
// disagree, a signal, which the processes agree on at a step, collectives that differ) end each process
// normally, rank 0 alone saying why; any other ends the whole job at once (MPI_Abort with this exit
// code), since the other processes may be waiting for this one in a collective.
int run(int argc, char** argv, dp::ProcessGroup* group) {
  const bool job = group && group->size() > 1;
  const std::string who = job ? group->who() + ": " : "";
  const bool lead = !job || group->rank() == 0;
  auto fail = [&](int code, const char* prefix, const char* what, bool everyone_agrees = false) {
    if (!everyone_agrees || lead) std::fprintf(stderr, "%sdp_train: %s%s\n", who.c_str(), prefix, what);
    if (job && !everyone_agrees) {
      std::fflush(stderr);
      group->abort(code);
    }
    return code;
  };
  try {
    return train_or_evaluate(argc, argv, group, who);
  } catch (const dp::JobMismatch& e) {
    return fail(2, "", e.what(), true);
  } catch (const dp::JobDesync& e) {
    return fail(1, "error: ", e.what(), true);
  } catch (const dp::UsageError& e) {
    return fail(2, "", e.what());
  } catch (const dp::NumericalError& e) {
    return fail(3, "", e.what());
  } catch (const dp::IoError& e) {
    return fail(1, "error: ", e.what());
  } catch (const dp::Interrupted& e) {
    return fail(128 + e.signal, "", e.what(), true);
  } catch (const std::bad_alloc&) {  // outside the ledgers: host memory for buffers, threads, data
    return fail(1, "error: ", "out of host memory (std::bad_alloc); check ulimit -v and what else runs");
  } catch (const std::exception& e) {
    return fail(1, "error: ", e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // SIGPIPE ignored: stdout is a log for a person, the checkpoint and the report are the results, so a
  // reader that goes away (dp_train | head -2) must not kill the run. A write to the closed pipe then
  // fails with EPIPE instead; the trainer stops printing and trains, saves and reports as asked, with
  // the exit code it would have had. (stderr likewise: its lines are lost, the run goes on.)
  std::signal(SIGPIPE, SIG_IGN);
  // SIGXFSZ likewise: past the file size limit (ulimit -f) a write fails with EFBIG, handled as a full
  // disk is (exit 1 naming the reason, the temporary file removed, the previous file kept), where the
  // signal's default would kill the process mid-write and leave the temporary file.
  std::signal(SIGXFSZ, SIG_IGN);
  // Started by mpirun (or another MPI launcher): join the job's other processes. Only rank 0 speaks on
  // stdout; every rank's errors go to stderr, prefixed with its rank and host.
  std::unique_ptr<dp::ProcessGroup> group = dp::join_if_launched("dp_train");
  return run(argc, argv, group.get());  // the group, destroyed after it, finalises MPI
}
