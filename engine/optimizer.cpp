#include "engine/optimizer.h"

#include "engine/error.h"

namespace dp {

const char* optimizer_name(Optimizer o) {
  return o == Optimizer::sgd ? "sgd" : o == Optimizer::adam ? "adam" : "adamw";
}

Optimizer parse_optimizer(const std::string& s) {
  if (s == "sgd") return Optimizer::sgd;
  if (s == "adam") return Optimizer::adam;
  if (s == "adamw") return Optimizer::adamw;
  throw UsageError("--optimizer: '" + s +
                   "' is not an optimizer; use sgd (torch.optim.SGD with --momentum), adam (torch.optim.Adam) or "
                   "adamw (torch.optim.AdamW)");
}

std::vector<std::string> optimizer_state_names(const EngineConfig& c) {
  if (c.optimizer != Optimizer::sgd) return {"exp_avg", "exp_avg_sq"};
  if (c.momentum != 0.0f) return {"momentum_buffer"};
  return {};
}

std::string optimizer_state_text(const EngineConfig& c) {
  if (c.optimizer != Optimizer::sgd)
    return std::string("two ") + (c.optimizer == Optimizer::adam ? "Adam" : "AdamW") + " moments, 2 x P floats";
  return c.momentum != 0.0f ? "momentum buffer, P floats" : "no state";
}

OptimizerScalars optimizer_scalars(const EngineConfig& c, int64_t step) {
  OptimizerScalars s;
  s.sgd = {c.lr, c.momentum, c.weight_decay};
  s.adam =
      math::adam_coefficients(c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.optimizer == Optimizer::adamw, step);
  return s;
}

void optimizer_step(Ops& ops, const EngineConfig& c, int64_t n, float* params, const float* grads,
                    const std::vector<float*>& state, const OptimizerScalars* scalars, float* nonfinite) {
  if (c.optimizer == Optimizer::sgd)
    return ops.sgd_step(n, params, grads, state.empty() ? nullptr : state[0], &scalars->sgd, nonfinite);
  ops.adam_step(n, params, grads, state[0], state[1], &scalars->adam, nonfinite);
}

}  // namespace dp
