// safetensors checkpoints: round trip, PyTorch names and layouts, validation of what is loaded.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>

#include "engine/error.h"
#include "tests/util.h"
#include "train/checkpoint.h"

using namespace dp;
using namespace dp::test;

namespace {

void expect_load_error(const std::string& path, const ModelSpec& spec, const std::string& words) {
  try {
    load_checkpoint(path, spec);
    FAIL("no error");
  } catch (const UsageError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(words) != std::string::npos);
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("checkpoint round trip keeps Adam's moments and step count under PyTorch's names") {
  TempDir dir;
  ModelSpec spec = make_model("lenet5");
  Checkpoint c;
  c.params = random_floats(size_t(spec.param_count), 11, -1, 1);
  c.optimizer_state["exp_avg"] = random_floats(size_t(spec.param_count), 12, -1, 1);
  c.optimizer_state["exp_avg_sq"] = random_floats(size_t(spec.param_count), 13, 0, 1);
  c.optimizer_steps = (int64_t(1) << 40) + 3;  // past 32 bits: the I64 scalar is read whole
  save_checkpoint(dir / "a.st", spec, c);
  Checkpoint back = load_checkpoint(dir / "a.st", spec);
  CHECK(back.optimizer_state == c.optimizer_state);
  CHECK(back.optimizer_steps == c.optimizer_steps);
  SafeTensors st = read_safetensors(dir / "a.st");
  CHECK(st.tensors.at("optimizer.fc3.weight.exp_avg_sq").shape == std::vector<int64_t>{10, 84});
  CHECK(st.tensors.at("optimizer.step").dtype == "I64");
  CHECK(st.tensors.count("optimizer.fc3.weight.momentum_buffer") == 0);
  // One moment without the other is no Adam state; a negative step count no count.
  st.tensors.erase("optimizer.conv1.bias.exp_avg_sq");
  st.order.erase(std::find(st.order.begin(), st.order.end(), "optimizer.conv1.bias.exp_avg_sq"));
  CHECK_THROWS_WITH_AS(checkpoint_from_safetensors(st, spec, "x"), doctest::Contains("exp_avg_sq"), UsageError);
}

TEST_CASE("checkpoint round trip keeps every bit, with PyTorch names and shapes") {
  TempDir dir;
  ModelSpec spec = make_model("lenet");
  Checkpoint c;
  c.params = random_floats(size_t(spec.param_count), 1, -1, 1);
  c.optimizer_state["momentum_buffer"] = random_floats(size_t(spec.param_count), 2, -1, 1);
  c.metadata["epoch"] = "3";
  save_checkpoint(dir / "a.safetensors", spec, c);
  Checkpoint back = load_checkpoint(dir / "a.safetensors", spec);
  CHECK(back.params == c.params);
  CHECK(back.optimizer_state == c.optimizer_state);
  CHECK(back.metadata.at("epoch") == "3");
  CHECK(back.metadata.at("model") == "lenet");
  SafeTensors st = read_safetensors(dir / "a.safetensors");
  CHECK(st.tensors.at("conv1.weight").shape == std::vector<int64_t>{20, 1, 3, 3});
  CHECK(st.tensors.at("fc1.weight").shape == std::vector<int64_t>{128, 800});
  CHECK(st.tensors.at("fc2.bias").shape == std::vector<int64_t>{10});
  CHECK(st.tensors.count("optimizer.fc1.weight.momentum_buffer") == 1);
  // the file layout: 8-byte little-endian header length, JSON, data 8-byte aligned
  std::string bytes = slurp(dir / "a.safetensors");
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  CHECK(hlen % 8 == 0);
  CHECK(bytes[8] == '{');
  CHECK(bytes.size() == 8 + hlen + 2 * size_t(spec.param_count) * 4);
  CHECK(!std::filesystem::exists(dir / "a.safetensors.tmp"));
}

TEST_CASE("loading validates model, names, shapes, dtypes and offsets") {
  TempDir dir;
  ModelSpec lenet = make_model("lenet"), lenet5 = make_model("lenet5");
  Checkpoint c;
  c.params = random_floats(size_t(lenet5.param_count), 3);
  save_checkpoint(dir / "l5", lenet5, c);
  expect_load_error(dir / "l5", lenet, "this checkpoint is lenet5, you asked for lenet");

  SafeTensors st = read_safetensors(dir / "l5");
  st.metadata.erase("model");
  st.tensors.at("fc1.weight").shape = {400, 120};
  write_safetensors(dir / "shape", st);
  expect_load_error(dir / "shape", lenet5, "shape");

  st = read_safetensors(dir / "l5");
  st.tensors.at("conv1.bias").dtype = "I32";
  write_safetensors(dir / "dtype", st);
  expect_load_error(dir / "dtype", lenet5, "I32");

  st = read_safetensors(dir / "l5");
  st.tensors.erase("fc3.bias");
  st.order.erase(std::find(st.order.begin(), st.order.end(), "fc3.bias"));
  write_safetensors(dir / "missing", st);
  expect_load_error(dir / "missing", lenet5, "fc3.bias");

  std::string good = slurp(dir / "l5");
  write_file(dir / "tiny", good.substr(0, 5), false);
  expect_load_error(dir / "tiny", lenet5, "header length");
  std::string huge = good;
  huge[0] = '\xff', huge[1] = '\xff', huge[2] = '\xff';
  write_file(dir / "hlen", huge, false);
  expect_load_error(dir / "hlen", lenet5, "header length");
  write_file(dir / "trunc", good.substr(0, good.size() - 4), false);
  expect_load_error(dir / "trunc", lenet5, "outside");
  std::string notjson = good;
  notjson[8] = 'x';
  write_file(dir / "json", notjson, false);
  expect_load_error(dir / "json", lenet5, "JSON");
  expect_load_error(dir / "absent", lenet5, "no such");

  // The data section is the tensors' bytes back to back: bytes after them, or a hole, are refused.
  write_file(dir / "trailing", good + "junk", false);
  expect_load_error(dir / "trailing", lenet5, "4 bytes after the last tensor's data");
  auto raw = [](const std::string& header, size_t data) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
    return s + header + std::string(data, '\0');
  };
  write_file(dir / "hole", raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), false);
  expect_load_error(dir / "hole", lenet5, "bytes 0 to 4 of the data section belong to no tensor");
  // A name given twice: JSON keeps the last, the format forbids it (a tensor, and a metadata key).
  write_file(dir / "twice",
             raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],)"
                 R"("data_offsets":[0,4]}})",
                 4),
             false);
  expect_load_error(dir / "twice", lenet5, "the header names 'a' twice");
  write_file(dir / "meta_twice",
             raw(R"({"__metadata__":{"model":"lenet","model":"lenet5"},"a":{"dtype":"F32","shape":[1],)"
                 R"("data_offsets":[0,4]}})",
                 4),
             false);
  expect_load_error(dir / "meta_twice", lenet5, "the header names 'model' twice");
  // The header is checked against the file's size before the data is read: a 64 GiB sparse file
  // (more than this machine's memory: reading it whole would fail otherwise) is refused by its header.
  write_file(dir / "sparse", raw(R"({"a":{}})", 0), false);
  std::filesystem::resize_file(dir / "sparse", uint64_t(64) << 30);
  expect_load_error(dir / "sparse", lenet5, "tensor 'a' lacks dtype");
}

TEST_CASE("a failed save leaves the previous checkpoint intact") {
  TempDir dir;
  ModelSpec spec = make_model("lenet5");
  Checkpoint c;
  c.params = random_floats(size_t(spec.param_count), 4);
  save_checkpoint(dir / "ck", spec, c);
  std::string before = slurp(dir / "ck");
  // In a child limited to 4 KiB files (SIGXFSZ ignored), the write fails with EFBIG before the rename,
  // as on a full disk: an IoError, and no temporary file left.
  c.params[0] += 1;
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    try {
      save_checkpoint(dir / "ck", spec, c);
    } catch (const IoError&) {
      _exit(0);
    } catch (...) {
    }
    _exit(1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(slurp(dir / "ck") == before);
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"ck"});
}

TEST_CASE("the model-level checks run on a parsed file: foreign tensors, partial momentum") {
  TempDir dir;
  ModelSpec spec = make_model("lenet");
  Checkpoint c;
  c.params = random_floats(size_t(spec.param_count), 5);
  c.optimizer_state["momentum_buffer"] = random_floats(size_t(spec.param_count), 6);
  save_checkpoint(dir / "ck", spec, c);
  const SafeTensors good = read_safetensors(dir / "ck");
  Checkpoint back = checkpoint_from_safetensors(good, spec, "in-memory");
  CHECK(back.params == c.params);
  CHECK(back.optimizer_state == c.optimizer_state);

  auto expect = [&](const SafeTensors& st, const std::string& words) {
    try {
      checkpoint_from_safetensors(st, spec, "in-memory");
      FAIL("no error for " << words);
    } catch (const UsageError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find("in-memory") != std::string::npos);
      CHECK(std::string(e.what()).find(words) != std::string::npos);
    }
  };
  auto erase = [](SafeTensors& st, const std::string& name) {
    st.tensors.erase(name);
    st.order.erase(std::find(st.order.begin(), st.order.end(), name));
  };
  auto without = [&](const std::string& name) {
    SafeTensors st = good;
    erase(st, name);
    return st;
  };
  auto with = [&](const std::string& name) {
    SafeTensors st = good;
    st.tensors[name] = Tensor{"F32", {1}, std::vector<unsigned char>(4)};
    st.order.push_back(name);
    return st;
  };
  // one momentum buffer gone (even the first one): all or none
  expect(without("optimizer.conv1.weight.momentum_buffer"), "optimizer.conv1.weight.momentum_buffer");
  expect(without("optimizer.fc2.bias.momentum_buffer"), "optimizer.fc2.bias.momentum_buffer");
  expect(with("optimizer.fc9.weight.momentum_buffer"), "unexpected tensor 'optimizer.fc9.weight.momentum_buffer'");
  expect(with("optimizer.conv1.weight"), "unexpected tensor");
  expect(with("state.step"), "unexpected tensor 'state.step'");
  expect(with("conv1.weight.extra"), "unexpected tensor");
  // metadata that names no model: said so, not "this checkpoint is , (use --model )"
  SafeTensors unnamed = good;
  unnamed.metadata["model"] = "";
  expect(unnamed, "its metadata names no model");
  // weights only (a --momentum 0 run, or a PyTorch state_dict): fine, no momentum
  SafeTensors plain = good;
  for (auto& p : spec.params) erase(plain, "optimizer." + p.name + ".momentum_buffer");
  CHECK(checkpoint_from_safetensors(plain, spec, "in-memory").optimizer_state.empty());
}

TEST_CASE("a save leaves no temporary file behind") {
  TempDir dir;
  ModelSpec spec = make_model("lenet");
  Checkpoint c;
  c.params = random_floats(size_t(spec.param_count), 7);
  save_checkpoint(dir / "ck", spec, c);
  save_checkpoint(dir / "ck", spec, c);
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"ck"});
}

// Every seed and every crash input the fuzzer found (tests/fuzz/corpus/safetensors/crash-*) parses
// or is refused with a UsageError: nothing else escapes, and the sanitizer builds check the rest.
TEST_CASE("the safetensors fuzz corpus: each file loads or is refused cleanly") {
  ModelSpec models[] = {make_model("lenet"), make_model("lenet5")};
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(std::string(DP_SOURCE_DIR) + "/tests/fuzz/corpus/safetensors")) {
    CAPTURE(e.path().string());
    std::string bytes = slurp(e.path().string());
    ++files;
    try {
      SafeTensors st =
          parse_safetensors(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), e.path().string());
      for (auto& spec : models) {
        try {
          Checkpoint c = checkpoint_from_safetensors(st, spec, e.path().string());
          CHECK(c.params.size() == size_t(spec.param_count));
        } catch (const UsageError&) {
        }
      }
    } catch (const UsageError& err) {
      CHECK(std::string(err.what()).find(e.path().string()) != std::string::npos);
    }
  }
  CHECK(files >= 10);
}

namespace {

// `name`'s element `index` set to `value`, the rest of the file as it was.
void poke(const std::string& from, const std::string& to, const std::string& name, size_t index, float value) {
  SafeTensors st = read_safetensors(from);
  Tensor& t = st.tensors.at(name);
  REQUIRE((index + 1) * sizeof(float) <= t.data.size());
  std::memcpy(t.data.data() + index * sizeof(float), &value, sizeof value);
  write_safetensors(to, st);
}

}  // namespace

TEST_CASE("inputs: a checkpoint holding NaN or Inf is refused at load, naming the file, the tensor and the element") {
  TempDir dir;
  ModelSpec spec = make_model("lenet");
  Checkpoint c;
  c.params = random_floats(size_t(spec.param_count), 8, -1, 1);
  c.optimizer_state["momentum_buffer"] = random_floats(size_t(spec.param_count), 9, -1, 1);
  save_checkpoint(dir / "c.st", spec, c);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  struct Case {
    std::string tensor;
    size_t index;
    float value;
    std::string what;
  };
  const Case cases[] = {{"fc1.weight", 123, nan, "(NaN) at index 123"},
                        {"conv1.bias", 0, inf, "(+Inf) at index 0"},
                        {"fc2.bias", 9, -inf, "(-Inf) at index 9"},
                        {"optimizer.fc1.weight.momentum_buffer", 7, nan, "(NaN) at index 7"},
                        {"optimizer.conv2.bias.momentum_buffer", 1, inf, "(+Inf) at index 1"}};
  for (const Case& k : cases) {
    CAPTURE(k.tensor);
    poke(dir / "c.st", dir / "bad.st", k.tensor, k.index, k.value);
    expect_load_error(dir / "bad.st", spec,
                      "bad.st: tensor " + k.tensor + " holds a non-finite value " + k.what +
                          "; the checkpoint is damaged or came from a diverged run");
  }
  // the first bad element is named, with a count of the others
  poke(dir / "c.st", dir / "bad.st", "fc1.weight", 500, inf);
  poke(dir / "bad.st", dir / "bad.st", "fc1.weight", 40, nan);
  expect_load_error(dir / "bad.st", spec, "tensor fc1.weight holds a non-finite value (NaN) at index 40 and 1 more;");
  // the largest finite floats load: only NaN and the infinities are refused
  poke(dir / "c.st", dir / "big.st", "fc1.weight", 3, std::numeric_limits<float>::max());
  CHECK(load_checkpoint(dir / "big.st", spec).params[size_t(spec.find("fc1.weight")->offset) + 3] ==
        std::numeric_limits<float>::max());
}

TEST_CASE("inputs: dp_train --load and --resume refuse a checkpoint holding NaN with exit 2, before training") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 8);
  const std::string base =
      std::string(DP_TRAIN_BIN) + " --backend cpu --data " + dir.path.string() + " --batch 16 --quiet";
  CommandResult r = run_command(base + " --steps 1 --save " + dir / "ck.st");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  poke(dir / "ck.st", dir / "nan.st", "fc2.bias", 2, std::numeric_limits<float>::quiet_NaN());
  poke(dir / "ck.st", dir / "inf.st", "optimizer.fc1.weight.momentum_buffer", 77,
       std::numeric_limits<float>::infinity());
  struct Case {
    std::string args, words;
  };
  const Case cases[] = {
      {"--load " + dir / "nan.st", "nan.st: tensor fc2.bias holds a non-finite value (NaN) at index 2"},
      {"--resume " + dir / "nan.st", "nan.st: tensor fc2.bias holds a non-finite value (NaN) at index 2"},
      {"--resume " + dir / "inf.st",
       "inf.st: tensor optimizer.fc1.weight.momentum_buffer holds a non-finite value (+Inf) at index 77"}};
  for (const Case& c : cases) {
    CAPTURE(c.args);
    CommandResult bad = run_command(base + " --steps 2 " + c.args);
    INFO(bad.output);
    CHECK(bad.exit_code == 2);
    CHECK(bad.output.find(c.words) != std::string::npos);
    CHECK(bad.output.find("diverged run") != std::string::npos);
    CHECK(bad.output.find("--lr") == std::string::npos);  // not blamed on the learning rate
  }
}
