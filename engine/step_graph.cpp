// --graphs: the step captured as a graph and replayed (CUDA graphs, as PyTorch's torch.cuda.graph and
// make_graphed_callables; the simulated device's twin records its calls: engine/cpu/recording_ops.h).
// A LeNet step is some forty kernels of microseconds each: launched one by one from the host they
// cost about as much as they compute; a graph is one launch. What a replay cannot do decides where it
// runs: it repeats the capture's pointers and arguments, so the batch must already be in the upload
// slot's buffer (prefetch), the step must have the capture's shape (a full batch, no micro-batches),
// and every scalar that changes between steps must be read from device memory, not passed to a
// kernel (the optimizer's: Replica::scalars, uploaded before each launch, so a learning-rate schedule
// and Adam's bias correction need no recapture), and no buffer may be allocated in the step (zero2's
// and zero3's buckets are, so they are refused). Collectives between devices are not captured: one
// device in one process.
#include <cstdio>
#include <string>

#include "engine/engine.h"
#include "engine/error.h"

namespace dp {

void Engine::check_graphs() const {
  if (!cfg_.graphs) return;
  std::string why;
  if (world_ > 1)
    why = "one device in one process only (the job has " + std::to_string(world_) +
          "): the collectives between devices are not captured; give --gpus one id";
  else if (cfg_.accumulate > 1)
    why = "--accumulate " + std::to_string(cfg_.accumulate) +
          ": the micro-batches after the first upload during the step, which a replay would repeat; use --accumulate 1";
  else if (!cfg_.prefetch)
    why =
        "it needs prefetch: without it the step uploads its batch, which a replay would repeat; leave out "
        "--no-prefetch";
  else if (strategy_.zero_stage() >= 2)
    why = "--sync " + std::string(strategy_.name()) +
          " allocates each gradient bucket in the step and frees it after its reduce-scatter (what ZeRO saves), "
          "and a replay would write a freed buffer; use allreduce, zero1 or scatter";
  if (!why.empty()) throw UsageError("--graphs: " + why);
}

// The first full step runs eagerly (it makes cuDNN's plans and sizes the workspaces, which no capture
// may allocate), as does a short last batch, whose shapes differ from the capture's.
bool Engine::runs_as_graph(const StagedBatch& b) const { return cfg_.graphs && warm_ && b.ahead && b.n == cfg_.batch; }

// A capture that fails (a call the device cannot capture) ran nothing: false, and the caller runs the
// step eagerly instead, as every step after, with a warning, as the run is still correct without graphs.
bool Engine::graph_step(const StagedBatch& b, const std::vector<int>& sizes, int set) {
  Device& dev = *devices_[0];
  StepGraph& g = graphs_[size_t(b.slot)];
  if (g.captured) {
    recorder_.reopen(0, g.phases);
  } else {
    try {
      dev.begin_capture();  // inside: a capture that cannot begin falls back as one that fails
      StepContext context(*this, 0, b, sizes, {0, 1, b.n});
      strategy_.step(context);
      dev.end_capture(b.slot);
    } catch (const DeviceError& e) {
      dev.abandon_capture();
      std::fprintf(stderr, "dp: warning: --graphs: the step could not be captured (%s); every step runs eagerly\n",
                   e.what());
      cfg_.graphs = false;
      recorder_.begin_step(dev, 0, set);  // the capture's marks and phases dropped
      return false;
    } catch (...) {
      dev.abandon_capture();
      throw;
    }
    g = {true, recorder_.open_phases(0)};
    ++graph_captures_;
  }
  dev.launch(b.slot);
  ++graph_launches_;
  return true;
}

}  // namespace dp
