// libFuzzer target for checkpoints: the safetensors parser, then the model-level checks of
// load_checkpoint for both models. A parsed file or a UsageError is the only acceptable outcome;
// anything else (another exception, a sanitizer report, a result that breaks the parser's own
// guarantees) is a bug.
#include <cstdint>
#include <string>

#include "engine/error.h"
#include "train/checkpoint.h"

namespace {

int64_t dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  return 1;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dp::ModelSpec models[] = {dp::make_model("lenet"), dp::make_model("lenet5")};
  dp::SafeTensors st;
  try {
    st = dp::parse_safetensors(data, size, "fuzz");
  } catch (const dp::UsageError&) {
    return 0;
  }
  // What the parser promises: every listed tensor exists and holds exactly shape x dtype bytes.
  if (st.order.size() != st.tensors.size()) __builtin_trap();
  for (auto& name : st.order) {
    const dp::Tensor& t = st.tensors.at(name);
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= uint64_t(d);
    if (t.data.size() != numel * uint64_t(dtype_size(t.dtype))) __builtin_trap();
  }
  for (const dp::ModelSpec& spec : models) {
    try {
      dp::Checkpoint c = dp::checkpoint_from_safetensors(st, spec, "fuzz");
      if (c.params.size() != size_t(spec.param_count)) __builtin_trap();
      for (const auto& [name, state] : c.optimizer_state)
        if (state.size() != size_t(spec.param_count)) __builtin_trap();
    } catch (const dp::UsageError&) {
    }
  }
  return 0;
}
