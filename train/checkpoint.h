// Checkpoints as safetensors files: the weights under PyTorch's names and layouts (so
// safetensors.torch.load_file + load_state_dict reads them), BatchNorm's buffers as PyTorch's
// state_dict holds them (running_mean, running_var: F32; num_batches_tracked: an I64 scalar), the
// optimizer's state per parameter as "optimizer.<name>.<state>" under the names of PyTorch's
// optimizer state_dict (SGD's momentum_buffer, Adam's and AdamW's exp_avg and exp_avg_sq, with their
// step count as "optimizer.step", an I64 scalar), and the training position in the metadata.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "models/model.h"

namespace dp {

struct Tensor {
  std::string dtype;  // "F32", "I64", ...
  std::vector<int64_t> shape;
  std::vector<unsigned char> data;
};

struct SafeTensors {
  std::vector<std::string> order;  // tensors in file order
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Validates the header length, the JSON, dtypes, shapes and that every tensor's byte range lies
// inside the file, matches its shape and overlaps no other; throws UsageError naming the file.
SafeTensors read_safetensors(const std::string& path);
// UsageError unless path is a regular file: the first check of read_safetensors, for a front end to
// make before the devices start.
void require_checkpoint_file(const std::string& path);
SafeTensors parse_safetensors(const unsigned char* bytes, size_t size, const std::string& name);
// Writes beside the target, fsyncs, renames over it (write_file_atomically): a crash leaves the old
// file or the new one. Throws IoError where the system refuses the write.
void write_safetensors(const std::string& path, const SafeTensors& st);

struct Checkpoint {
  std::vector<float> params;  // (P) the flat buffer
  // The optimizer's state by its PyTorch name ("momentum_buffer", "exp_avg", "exp_avg_sq"), each (P);
  // empty without one (SGD at momentum 0, or a file of weights alone). optimizer_steps: Adam's step count.
  std::map<std::string, std::vector<float>> optimizer_state;
  int64_t optimizer_steps = 0;
  std::vector<float> buffers;   // (R) BatchNorm's running statistics; empty without BatchNorm
  int64_t batches_tracked = 0;  // BatchNorm's num_batches_tracked
  std::map<std::string, std::string> metadata;
  // What loading changed in the file's names, for the caller to say once: a PyTorch model saved
  // wrapped in nn.DataParallel or DDP prefixes every key with "module.", which loading strips.
  std::string note;
};

void save_checkpoint(const std::string& path, const ModelSpec& spec, const Checkpoint& ckpt);
// Checks the model ("this checkpoint is lenet5, you asked for lenet"), every parameter's and
// buffer's name, dtype and shape, that no tensor is foreign to the model (naming the first that is,
// and the names the model has) and that every value of the weights, running statistics and momentum
// buffers is finite (and every running variance >= 0); throws UsageError naming the file (and the
// tensor and element). Keys all prefixed "module." (a wrapped model's state_dict) are read without it.
Checkpoint load_checkpoint(const std::string& path, const ModelSpec& spec);
// The same checks on a file already parsed (the fuzzer's entry point); `name` is what errors call it.
Checkpoint checkpoint_from_safetensors(const SafeTensors& st, const ModelSpec& spec, const std::string& name);

}  // namespace dp
