#include "train/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/error.h"
#include "train/output_files.h"

namespace dp {
namespace {

int64_t dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

// A NaN or an infinity loaded into the weights or the momentum would surface steps later as a
// "non-finite loss" that blames the learning rate: refuse it here, at the element.
void check_finite(const float* v, int64_t count, const std::string& path, const std::string& name) {
  int64_t first = -1, bad = 0;
  for (int64_t i = 0; i < count; ++i)
    if (!std::isfinite(v[i])) {
      if (first < 0) first = i;
      ++bad;
    }
  if (bad == 0) return;
  const float x = v[first];
  const std::string what = std::isnan(x) ? "NaN" : x > 0 ? "+Inf" : "-Inf";
  throw UsageError(path + ": tensor " + name + " holds a non-finite value (" + what + ") at index " +
                   std::to_string(first) + (bad > 1 ? " and " + std::to_string(bad - 1) + " more" : "") +
                   "; the checkpoint is damaged or came from a diverged run");
}

using Refusal = std::function<UsageError(const std::string& why)>;

// One tensor's header entry: its dtype, shape and bytes, which must lie inside the data section and
// fill exactly what the shape needs.
Tensor parse_tensor(const std::string& name, const nlohmann::json& v, const unsigned char* data, uint64_t data_size,
                    std::pair<uint64_t, uint64_t>& range, const Refusal& fail) {
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
    throw fail("tensor '" + name + "' lacks dtype, shape or data_offsets");
  Tensor t;
  if (!v["dtype"].is_string() || dtype_size(t.dtype = v["dtype"].get<std::string>()) == 0)
    throw fail("tensor '" + name + "' has an unknown dtype");
  if (!v["shape"].is_array()) throw fail("tensor '" + name + "' shape is not a list");
  uint64_t numel = 1;
  for (auto& d : v["shape"]) {
    if (!d.is_number_unsigned()) throw fail("tensor '" + name + "' has a negative or non-integer dimension");
    uint64_t dim = d.get<uint64_t>();
    if (dim > (uint64_t(1) << 40) || (dim && numel > (uint64_t(1) << 40) / dim))
      throw fail("tensor '" + name + "' is impossibly large");
    numel *= dim;
    t.shape.push_back(int64_t(dim));
  }
  auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    throw fail("tensor '" + name + "' data_offsets is not [begin, end]");
  uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
  if (b > e || e > data_size)
    throw fail("tensor '" + name + "' data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
               "] lie outside the " + std::to_string(data_size) + "-byte data section");
  if (e - b != numel * uint64_t(dtype_size(t.dtype)))
    throw fail("tensor '" + name + "' holds " + std::to_string(e - b) + " bytes, its shape " + shape_str(t.shape) +
               " of " + t.dtype + " needs " + std::to_string(numel * dtype_size(t.dtype)));
  if (data) t.data.assign(data + b, data + e);  // null: the header alone is being checked
  range = {b, e};
  return t;
}

// The 8-byte little-endian length of the JSON header that opens a safetensors file, and the largest
// the reader takes (100 MB: a header of LeNet's tensors is under 4 KB).
uint64_t header_length(const unsigned char* bytes) {
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = hlen << 8 | bytes[i];
  return hlen;
}
constexpr uint64_t kMaxHeader = uint64_t(100) << 20;

// The header's JSON object. A name given twice in one object (a tensor, a metadata key) is refused:
// JSON parsers keep the last, the format forbids it, and which one a reader took would be a guess.
nlohmann::json parse_header(const unsigned char* text, uint64_t length, const Refusal& fail) {
  std::vector<std::set<std::string>> keys;  // of each object open at this point of the parse
  std::string twice;
  const nlohmann::json::parser_callback_t note_keys = [&](int, nlohmann::json::parse_event_t e, nlohmann::json& j) {
    using E = nlohmann::json::parse_event_t;
    if (e == E::object_start) keys.emplace_back();
    if (e == E::object_end) keys.pop_back();
    if (e == E::key && !keys.back().insert(j.get<std::string>()).second && twice.empty()) twice = j.get<std::string>();
    return true;
  };
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(text, text + length, note_keys);
  } catch (const std::exception& e) {
    throw fail(std::string("header is not JSON: ") + e.what());
  }
  if (!twice.empty()) throw fail("the header names '" + twice + "' twice; each name must be unique");
  if (!h.is_object()) throw fail("header is not a JSON object");
  return h;
}

// A file of `size` bytes of which the first `available` are at `bytes`: all of them (the tensors' data
// copied), or the length and the header alone (everything checked, nothing copied).
SafeTensors parse(const unsigned char* bytes, size_t available, size_t size, const std::string& path) {
  const Refusal fail = [&](const std::string& why) {
    return UsageError(path + ": not a valid safetensors file: " + why);
  };
  if (size < 8) throw fail("only " + std::to_string(size) + " bytes; the 8-byte header length is missing");
  const uint64_t hlen = header_length(bytes);
  if (hlen > size - 8)
    throw fail("header length " + std::to_string(hlen) + " runs past the end of the file (" + std::to_string(size) +
               " bytes)");
  if (hlen > kMaxHeader) throw fail("header length " + std::to_string(hlen) + " exceeds 100 MB");
  const nlohmann::json h = parse_header(bytes + 8, hlen, fail);
  const uint64_t data_size = size - 8 - hlen;
  const unsigned char* data = available == size ? bytes + 8 + hlen : nullptr;
  SafeTensors st;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw fail("__metadata__ is not an object");
      for (auto& [k, mv] : v.items()) {
        if (!mv.is_string()) throw fail("metadata value of '" + k + "' is not a string");
        st.metadata[k] = mv.get<std::string>();
      }
      continue;
    }
    ranges.emplace_back();
    Tensor t = parse_tensor(name, v, data, data_size, ranges.back(), fail);
    st.order.push_back(name);
    st.tensors[name] = std::move(t);
  }
  // The format's data section is the tensors' bytes back to back: no overlap, no hole, nothing after.
  std::sort(ranges.begin(), ranges.end());
  uint64_t end = 0;
  for (const auto& [b, e] : ranges) {
    if (b < end) throw fail("two tensors' data overlap");
    if (b > end)
      throw fail("bytes " + std::to_string(end) + " to " + std::to_string(b) +
                 " of the data section belong to no tensor");
    end = e;
  }
  if (end != data_size)
    throw fail(std::to_string(data_size - end) + " bytes after the last tensor's data, which belong to no tensor");
  return st;
}

}  // namespace

SafeTensors parse_safetensors(const unsigned char* bytes, size_t size, const std::string& path) {
  return parse(bytes, size, size, path);
}

void require_checkpoint_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw UsageError(path + ": no such checkpoint file");
  if (!std::filesystem::is_regular_file(path, ec))
    throw UsageError(path + ": not a checkpoint file (a directory or a device)");
}

SafeTensors read_safetensors(const std::string& path) {
  require_checkpoint_file(path);
  std::error_code ec;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UsageError(path + ": cannot open: " + std::strerror(errno));
  // The header first, checked against the file's size, before the data is read: a damaged or huge
  // file is refused without reading it whole.
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw UsageError(path + ": cannot read its size: " + ec.message());
  std::vector<unsigned char> head(size_t(std::min<uint64_t>(size, 8)));
  f.read(reinterpret_cast<char*>(head.data()), std::streamsize(head.size()));
  if (head.size() == 8) {
    const uint64_t hlen = header_length(head.data());
    if (hlen <= size - 8 && hlen <= kMaxHeader) {  // else parse below refuses it by the length alone
      head.resize(size_t(8 + hlen));
      f.read(reinterpret_cast<char*>(head.data() + 8), std::streamsize(hlen));
    }
  }
  if (!f) throw UsageError(path + ": reading failed: " + std::strerror(errno));
  parse(head.data(), head.size(), size_t(size), path);  // throws what is wrong, having read no data
  f.seekg(0);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() != size)
    throw UsageError(path + ": changed while it was read (" + std::to_string(size) + " bytes, then " +
                     std::to_string(bytes.size()) + ")");
  return parse_safetensors(bytes.data(), bytes.size(), path);
}

void write_safetensors(const std::string& path, const SafeTensors& st) {
  nlohmann::json h = nlohmann::json::object();
  if (!st.metadata.empty()) h["__metadata__"] = st.metadata;
  uint64_t at = 0;
  for (auto& name : st.order) {
    const Tensor& t = st.tensors.at(name);
    h[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.data.size()}}};
    at += t.data.size();
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = (uint64_t(header.size()) >> (8 * i)) & 0xff;
  std::vector<std::string_view> parts{{reinterpret_cast<const char*>(len), 8}, header};
  for (auto& name : st.order) {
    const auto& data = st.tensors.at(name).data;
    parts.emplace_back(reinterpret_cast<const char*>(data.data()), data.size());
  }
  write_file_atomically(path, parts);
}

namespace {
// Every per-parameter optimizer state a checkpoint may hold, in the order it is written, and Adam's
// step count (PyTorch's names: torch.optim's state_dict()["state"][i] keys).
const std::vector<std::string> kOptimizerStates = {"momentum_buffer", "exp_avg", "exp_avg_sq"};
const std::string kOptimizerStep = "optimizer.step";
}  // namespace

void save_checkpoint(const std::string& path, const ModelSpec& spec, const Checkpoint& ckpt) {
  SafeTensors st;
  st.metadata = ckpt.metadata;
  st.metadata["model"] = spec.name;
  st.metadata["width"] = std::to_string(spec.width);
  st.metadata["format"] = "dp checkpoint: PyTorch state_dict names and layouts";
  auto add = [&](const std::string& name, const Param& p, const std::vector<float>& flat) {
    Tensor t{"F32", p.shape, {}};
    auto* b = reinterpret_cast<const unsigned char*>(flat.data() + p.offset);
    t.data.assign(b, b + p.size * sizeof(float));
    st.order.push_back(name);
    st.tensors[name] = std::move(t);
  };
  for (auto& p : spec.params) add(p.name, p, ckpt.params);
  for (auto& b : spec.buffers) {
    Tensor t{"F32", {b.channels}, {}};
    auto* bytes = reinterpret_cast<const unsigned char*>(ckpt.buffers.data() + b.offset);
    t.data.assign(bytes, bytes + b.channels * sizeof(float));
    st.order.push_back(b.name);
    st.tensors[b.name] = std::move(t);
  }
  for (auto& name : spec.batches_tracked_names()) {  // PyTorch's: a 0-dim int64 tensor
    Tensor t{"I64", {}, std::vector<unsigned char>(8)};
    for (int i = 0; i < 8; ++i) t.data[i] = (uint64_t(ckpt.batches_tracked) >> (8 * i)) & 0xff;
    st.order.push_back(name);
    st.tensors[name] = std::move(t);
  }
  for (const std::string& state : kOptimizerStates) {
    auto it = ckpt.optimizer_state.find(state);
    if (it != ckpt.optimizer_state.end())
      for (auto& p : spec.params) add("optimizer." + p.name + "." + state, p, it->second);
  }
  if (ckpt.optimizer_state.count("exp_avg")) {  // Adam's step count, as PyTorch keeps it (SGD has none)
    Tensor t{"I64", {}, std::vector<unsigned char>(8)};
    for (int i = 0; i < 8; ++i) t.data[i] = (uint64_t(ckpt.optimizer_steps) >> (8 * i)) & 0xff;
    st.order.push_back(kOptimizerStep);
    st.tensors[kOptimizerStep] = std::move(t);
  }
  write_safetensors(path, st);
}

namespace {

// The model's tensor names, for a refusal: "conv1.weight, conv1.bias, ..." (BatchNorm's buffers too).
std::string expected_names(const ModelSpec& spec) {
  std::string out;
  auto add = [&](const std::string& n) { out += (out.empty() ? "" : ", ") + n; };
  for (auto& p : spec.params) add(p.name);
  for (auto& b : spec.buffers) add(b.name);
  for (auto& n : spec.batches_tracked_names()) add(n);
  return out;
}

// nn.DataParallel and DDP hold the model as .module, so a wrapped model's state_dict() names every
// tensor "module.conv1.weight": when every name of the file but dp's own optimizer state has the
// prefix, the copy returned has it stripped and `note` says so.
SafeTensors strip_module_prefix(const SafeTensors& st, const std::string& path, std::string& note) {
  const std::string prefix = "module.";
  bool any = false;
  for (auto& name : st.order) {
    if (name.rfind("optimizer.", 0) == 0) continue;
    if (name.rfind(prefix, 0) != 0) return st;
    any = true;
  }
  if (!any) return st;
  SafeTensors out;
  out.metadata = st.metadata;
  for (auto& name : st.order) {
    std::string n = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
    if (out.tensors.count(n)) throw UsageError(path + ": tensor '" + n + "' is there with and without 'module.'");
    out.order.push_back(n);
    out.tensors[n] = st.tensors.at(name);
  }
  note = path + ": keys prefixed 'module.' (a model saved wrapped in nn.DataParallel or DDP); read without it";
  return out;
}

}  // namespace

namespace {

const std::string kOptimizerPrefix = "optimizer.";

// The state of the optimizer's per-parameter tensor "optimizer.<param>.<state>" ("" if the name is
// not one).
std::string optimizer_state_of(const ModelSpec& spec, const std::string& name) {
  if (name.rfind(kOptimizerPrefix, 0) != 0) return "";
  for (const std::string& state : kOptimizerStates) {
    const std::string suffix = "." + state;
    if (name.size() > kOptimizerPrefix.size() + suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        spec.find(name.substr(kOptimizerPrefix.size(), name.size() - kOptimizerPrefix.size() - suffix.size())))
      return state;
  }
  return "";
}

// Refuses a tensor the model does not have; the optimizer states the file holds.
std::set<std::string> check_names(const SafeTensors& st, const ModelSpec& spec, const std::string& path) {
  const auto tracked = spec.batches_tracked_names();
  std::set<std::string> states;
  for (auto& name : st.order) {
    if (spec.find(name) || spec.find_buffer(name) || std::count(tracked.begin(), tracked.end(), name)) continue;
    if (name == kOptimizerStep) continue;
    if (const std::string state = optimizer_state_of(spec, name); !state.empty()) {
      states.insert(state);
      continue;
    }
    throw UsageError(path + ": unexpected tensor '" + name + "' for model " + spec.name + ", which has " +
                     expected_names(spec) + (spec.has_batchnorm() ? "" : " (no BatchNorm: --model lenet-bn has it)"));
  }
  return states;
}

// The model's tensors out of a file, each held to the dtype and shape the model needs.
struct TensorReader {
  const SafeTensors& st;
  const ModelSpec& spec;
  const std::string& path;

  const Tensor& tensor(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) const {
    auto it = st.tensors.find(name);
    if (it == st.tensors.end())
      throw UsageError(path + ": tensor '" + name + "' is missing; a " + spec.name + " checkpoint has it");
    const Tensor& t = it->second;
    if (t.dtype != dtype) throw UsageError(path + ": tensor '" + name + "' is " + t.dtype + ", expected " + dtype);
    if (t.shape != shape)
      throw UsageError(path + ": tensor '" + name + "' has shape " + shape_str(t.shape) + ", " + spec.name + " needs " +
                       shape_str(shape));
    return t;  // parse_safetensors checked that its bytes match its shape
  }
  // A float tensor into flat[offset, offset + size), refused unless every value is finite.
  void take(const std::string& name, const std::vector<int64_t>& shape, int64_t offset, int64_t size,
            std::vector<float>& flat) const {
    const Tensor& t = tensor(name, "F32", shape);
    std::memcpy(flat.data() + offset, t.data.data(), size_t(size) * sizeof(float));
    check_finite(flat.data() + offset, size, path, name);
  }
  // BatchNorm's running statistics: no variance may be negative.
  std::vector<float> running_stats() const {
    std::vector<float> out(size_t(spec.buffer_count), 0.0f);
    for (auto& b : spec.buffers) {
      take(b.name, {b.channels}, b.offset, b.channels, out);
      if (b.name.ends_with(".running_var"))
        for (int64_t i = 0; i < b.channels; ++i)
          if (out[size_t(b.offset + i)] < 0)
            throw UsageError(path + ": tensor " + b.name + " holds a negative variance at index " + std::to_string(i) +
                             "; the checkpoint is damaged");
    }
    return out;
  }
  // Every layer's count is the same for a model trained as a whole: the first one's is kept.
  int64_t batches_tracked() const {
    const auto tracked = spec.batches_tracked_names();
    return tracked.empty() ? 0 : count(tracked[0]);
  }
  // An I64 scalar that counts something: never negative.
  int64_t count(const std::string& name) const {
    const Tensor& t = tensor(name, "I64", {});
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = v << 8 | t.data[size_t(i)];
    if (int64_t(v) < 0) throw UsageError(path + ": tensor " + name + " is negative");
    return int64_t(v);
  }
};

}  // namespace

Checkpoint checkpoint_from_safetensors(const SafeTensors& file, const ModelSpec& spec, const std::string& path) {
  std::string note;
  const SafeTensors st = strip_module_prefix(file, path, note);
  auto m = st.metadata.find("model");
  if (m != st.metadata.end() && m->second.empty()) {
    std::string names;
    for (const std::string& n : model_names()) names += (names.empty() ? "" : ", ") + n;
    throw UsageError(path + ": its metadata names no model (\"model\" is empty); dp's checkpoints name one of " +
                     names);
  }
  if (m != st.metadata.end() && m->second != spec.name)
    throw UsageError(path + ": this checkpoint is " + m->second + ", you asked for " + spec.name + " (use --model " +
                     m->second + ")");
  // A checkpoint from before --width, or from PyTorch, says none: its shapes then speak.
  if (auto w = st.metadata.find("width"); w != st.metadata.end() && w->second != std::to_string(spec.width))
    throw UsageError(path + ": this checkpoint is " + spec.name + " at --width " + w->second +
                     ", you asked for --width " + std::to_string(spec.width) + " (use --width " + w->second + ")");
  const std::set<std::string> states = check_names(st, spec, path);
  const TensorReader read{st, spec, path};
  Checkpoint c;
  c.note = note;
  c.metadata = st.metadata;
  c.params.assign(size_t(spec.param_count), 0.0f);
  for (auto& p : spec.params) read.take(p.name, p.shape, p.offset, p.size, c.params);
  // Each state is there for every parameter or for none (a run with --momentum 0 has none).
  for (const std::string& state : kOptimizerStates) {
    if (!states.count(state)) continue;
    std::vector<float>& flat = c.optimizer_state[state];
    flat.assign(size_t(spec.param_count), 0.0f);
    for (auto& p : spec.params) read.take(kOptimizerPrefix + p.name + "." + state, p.shape, p.offset, p.size, flat);
  }
  if (states.count("exp_avg") != states.count("exp_avg_sq"))
    throw UsageError(path + ": Adam's state is exp_avg and exp_avg_sq together; this checkpoint has only one");
  if (states.count("exp_avg")) c.optimizer_steps = read.count(kOptimizerStep);
  c.buffers = read.running_stats();
  c.batches_tracked = read.batches_tracked();
  return c;
}

Checkpoint load_checkpoint(const std::string& path, const ModelSpec& spec) {
  return checkpoint_from_safetensors(read_safetensors(path), spec, path);
}

}  // namespace dp
