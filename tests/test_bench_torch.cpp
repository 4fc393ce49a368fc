// bench/torch_workers.py, PyTorch's side of bench/cpu_speed.sh, run with every PyTorch the bench
// compares: today's 2.x from scripts/deps.sh --bench's environment (.venv-bench) and Debian's 1.13
// (/usr/bin/python3). An interpreter without torch is skipped, and the case says so.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "tests/util.h"

using namespace dp::test;

namespace {

// One measurement of bench/torch_workers.py with `python` and `args`, on the data in `dir`: its JSON
// line, after checking that it ran and measured something.
nlohmann::json measure(const std::string& python, const std::string& args, const TempDir& dir) {
  CommandResult r = run_command(python + " " + DP_SOURCE_DIR + "/bench/torch_workers.py " + args +
                                " --model lenet5 --batch 32 --seconds 0.2 --warmup 2 --data " + dir.path.string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.output.substr(r.output.rfind('{')));
  CHECK(j["images_per_second"].get<double>() > 0);
  CHECK(j["steps"].get<int>() >= 10);
  return j;
}

}  // namespace

TEST_CASE("bench: torch_workers.py measures eager PyTorch with each interpreter there is, and says which") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 96, 16);
  int measured = 0;
  for (const std::string& python :
       {std::string(DP_SOURCE_DIR) + "/.venv-bench/bin/python", std::string("/usr/bin/python3")}) {
    CAPTURE(python);
    CommandResult has =
        run_command(python + " -c \"import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)\"");
    if (has.exit_code != 0) {
      MESSAGE("skipped: " << python
                          << " has no torch (scripts/deps.sh --bench makes .venv-bench; Debian: python3-torch)");
      continue;
    }
    const std::string version = run_command(python + " -c \"import torch; print(torch.__version__, end='')\"").output;
    const nlohmann::json j = measure(python, "--mode eager --threads 1", dir);
    CHECK(j["torch"] == version);
    CHECK(j["mode"] == "eager");
    CHECK(j["compile_s"].get<double>() > 0);
    ++measured;
  }
  MESSAGE(measured << " PyTorch(es) measured");
}

TEST_CASE("bench: torch_workers.py --mode torchrun runs DDP under torchrun with today's PyTorch, where it is") {
  const std::string python = std::string(DP_SOURCE_DIR) + "/.venv-bench/bin/python";
  if (run_command(python + " -c \"import torch.distributed.run\"").exit_code != 0) {
    MESSAGE("skipped: no " << python << " with torch (scripts/deps.sh --bench makes it)");
    return;
  }
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 96, 16);
  CHECK(measure(python, "--mode torchrun", dir)["mode"] == "ddp-rank");  // rank 0's, of both ranks' images
}
