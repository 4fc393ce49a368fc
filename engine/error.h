// Errors carry what failed and where. Library code throws; only the front ends choose exit codes.
#pragma once

#include <stdexcept>
#include <string>

namespace dp {

// Bad input from the user (arguments, files): front ends exit 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Anything that goes wrong on a device: the message names the device.
struct DeviceError : std::runtime_error {
  DeviceError(int device, const std::string& what)
      : std::runtime_error("device " + std::to_string(device) + ": " + what), device(device) {}
  int device;
};

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

// SIGINT / SIGTERM during training, after the step finished and any checkpoint was saved; front
// ends exit 128 + signal (130, 143).
struct Interrupted : std::runtime_error {
  Interrupted(int signal, const std::string& what) : std::runtime_error(what), signal(signal) {}
  int signal;
};

}  // namespace dp
