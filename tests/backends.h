// The device backends a test body runs over. CUDA cases are skipped, visibly, when no CUDA device is
// usable: TEST_CASE("cuda: ..." * doctest::skip(!dp::test::cuda_available())), or a loop over
// backends() below; single ops run over the op matrix instead (tests/ops_matrix.h).
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"

namespace dp::test {

// Cheap and never throws: the probe caches its answer.
inline bool cuda_available() {
  static const bool yes = [] {
    try {
      return probe_cuda().count > 0;
    } catch (...) {
      return false;
    }
  }();
  return yes;
}

inline std::string cuda_skip_reason() {
  return cuda_available() ? "" : "skipped: no CUDA device (" + probe_cuda().reason + ")";
}

// Devices of one kind for a test: ranks 0..n-1. `kind` is "cpu" or "cuda"; CUDA devices wrap
// around the GPUs present (several replicas per GPU when there are fewer GPUs than n).
inline std::vector<std::unique_ptr<Device>> make_test_devices(const std::string& kind, int n, int64_t cap = 0) {
  std::vector<std::unique_ptr<Device>> out;
  for (int r = 0; r < n; ++r) {
    if (kind == "cuda")
      out.push_back(make_cuda_device(r, r % probe_cuda().count, cap));
    else
      out.push_back(make_simulated_device(r, r, cap));
  }
  return out;
}

inline std::vector<Device*> raw(const std::vector<std::unique_ptr<Device>>& v) {
  std::vector<Device*> out;
  for (auto& d : v) out.push_back(d.get());
  return out;
}

// The backends to run a body over here: always "cpu"; "cuda" when a device exists. When it does
// not, a message says the CUDA case was skipped, so a reader of the log sees it.
inline std::vector<std::string> backends() {
  if (cuda_available()) return {"cpu", "cuda"};
  MESSAGE("CUDA case " << cuda_skip_reason());
  return {"cpu"};
}

}  // namespace dp::test
