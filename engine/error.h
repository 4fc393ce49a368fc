// Errors carry what failed and where. Library code throws; only the front ends choose exit codes.
// UsageError and DeviceError live in kernels/error.h, the leaf the kernels and models throw from.
#pragma once

#include <stdexcept>
#include <string>

#include "kernels/error.h"

namespace dp {

// An allocation past --device-memory.
struct OutOfMemory : DeviceError {
  using DeviceError::DeviceError;
};

// Thrown on the devices that did not fail, when another one did and the step was aborted.
struct Aborted : std::runtime_error {
  Aborted() : std::runtime_error("step aborted because another device failed") {}
};

// Non-finite loss or gradients: front ends exit 3.
struct NumericalError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The system refused a read or write of a file (disk full, permission, I/O error): front ends exit 1
// with the OS's reason, not 2, since the command line was fine.
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// SIGINT / SIGTERM / SIGHUP during a run, stopped at the next safe point (after the step finished,
// between two outputs) with the finished step's checkpoint saved; what() says what was and was not
// written. Front ends exit 128 + signal (130, 143, 129).
struct Interrupted : std::runtime_error {
  Interrupted(int signal, const std::string& what) : std::runtime_error(what), signal(signal) {}
  int signal;
};

}  // namespace dp
