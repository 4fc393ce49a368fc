// dp_train: the command-line front end. Exit codes: 0 done, 1 --verify failed or a device failed,
// 2 bad input, 3 non-finite loss or gradients, 128 + signal when stopped by SIGHUP, SIGINT or SIGTERM
// (129, 130, 143; also when the grace deadline after one ends the process); 1 also when the system
// refuses a write (disk full, permission): the command line was fine, the OS's reason is printed.
#include <csignal>
#include <cstdio>
#include <exception>
#include <new>

#include "engine/error.h"
#include "engine/options.h"
#include "engine/progress.h"
#include "engine/trainer.h"

int main(int argc, char** argv) {
  // SIGPIPE ignored: stdout is a log for a person, the checkpoint and the report are the results, so a
  // reader that goes away (dp_train | head -2) must not kill the run. A write to the closed pipe then
  // fails with EPIPE instead; the trainer stops printing and trains, saves and reports as asked, with
  // the exit code it would have had. (stderr likewise: its lines are lost, the run goes on.)
  std::signal(SIGPIPE, SIG_IGN);
  try {
    dp::TrainOptions opt;
    if (!dp::parse_train_args(argc, argv, opt)) return 0;
    bool ok = true;
    if (opt.eval)  // --eval --load FILE: the checkpoint on the test set, nothing trained
      dp::evaluate_checkpoint(opt);
    else
      ok = dp::train(opt).verify_ok;
    // A signal after the run's last safe point, as it was returning: everything had been written.
    if (int sig = dp::signal_received()) {
      std::fprintf(stderr, "dp_train: %s as the run ended; every output was written\n",
                   dp::describe_signal(sig).c_str());
      return 128 + sig;
    }
    return ok ? 0 : 1;
  } catch (const dp::UsageError& e) {
    std::fprintf(stderr, "dp_train: %s\n", e.what());
    return 2;
  } catch (const dp::NumericalError& e) {
    std::fprintf(stderr, "dp_train: %s\n", e.what());
    return 3;
  } catch (const dp::IoError& e) {
    std::fprintf(stderr, "dp_train: error: %s\n", e.what());
    return 1;
  } catch (const dp::Interrupted& e) {
    std::fprintf(stderr, "dp_train: %s\n", e.what());
    return 128 + e.signal;
  } catch (const std::bad_alloc&) {  // outside the ledgers: host memory for buffers, threads, data
    std::fprintf(stderr, "dp_train: error: out of host memory (std::bad_alloc); check ulimit -v and what else runs\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_train: error: %s\n", e.what());
    return 1;
  }
}
