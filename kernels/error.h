// The errors the lowest layers throw: kernels (a CUDA/cuDNN call that failed on a device) and models
// (an unknown model name). A leaf both may include; engine/error.h adds the engine's own.
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

}  // namespace dp
