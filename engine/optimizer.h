// The optimizers, as PyTorch's: torch.optim.SGD (with momentum and weight decay), Adam and AdamW.
// What state each keeps per parameter, under the names of PyTorch's optimizer state_dict, and one step
// over a flat buffer, or over a shard of one (a sharded strategy steps only the parameters it owns).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "kernels/ops.h"

namespace dp {

// "sgd", "adam", "adamw"; parse throws UsageError naming --optimizer and the accepted values.
const char* optimizer_name(Optimizer o);
Optimizer parse_optimizer(const std::string& s);

// The per-parameter state: SGD's "momentum_buffer" (none at momentum 0), Adam's and AdamW's "exp_avg"
// and "exp_avg_sq" (the moments). Each is a flat buffer as long as the parameters it belongs to.
std::vector<std::string> optimizer_state_names(const EngineConfig& c);

// The state in words, for the memory model: "momentum buffer, P floats", "two Adam moments, 2 x P
// floats" (after "the" or "its own").
std::string optimizer_state_text(const EngineConfig& c);

// One optimizer step's scalars, which the kernels read from device memory (Replica::scalars, written
// before each step; Ops::sgd_step says why): SGD's learning rate, momentum and weight decay, and Adam's
// coefficients for step `step`, the optimizer's step count, 1 on the first (its bias correction).
struct OptimizerScalars {
  math::SgdStep sgd;
  math::AdamStep adam;
};
OptimizerScalars optimizer_scalars(const EngineConfig& c, int64_t step);

// One step over n parameters: state holds the buffers optimizer_state_names lists (zeros before the
// first step, as PyTorch's are), scalars the step's (device memory). nonfinite (device memory, or null)
// is set to 1 when a gradient read is not finite: the step's finiteness check, in the optimizer's kernel.
void optimizer_step(Ops& ops, const EngineConfig& c, int64_t n, float* params, const float* grads,
                    const std::vector<float*>& state, const OptimizerScalars* scalars, float* nonfinite);

}  // namespace dp
