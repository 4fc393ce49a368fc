// dp_train: the command-line front end. Exit codes: 0 done, 1 --verify failed or a device failed,
// 2 bad input, 3 non-finite loss or gradients, 130/143 interrupted by SIGINT/SIGTERM; 1 also when the
// system refuses a write (disk full, permission): the command line was fine, the OS's reason is printed.
#include <cstdio>
#include <exception>

#include "engine/error.h"
#include "engine/options.h"
#include "engine/trainer.h"

int main(int argc, char** argv) {
  try {
    dp::TrainOptions opt;
    if (!dp::parse_train_args(argc, argv, opt)) return 0;
    dp::TrainResult r = dp::train(opt);
    return r.verify_ok ? 0 : 1;
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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_train: error: %s\n", e.what());
    return 1;
  }
}
