// Helpers shared by the test suites: temporary directories, synthetic IDX files, running the
// front ends, SPMD calls over devices.
#pragma once

#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/strategy.h"
#include "train/checkpoint.h"

extern char** environ;

namespace dp::test {

// Built with ASan or TSan (GCC defines __SANITIZE_*, clang answers __has_feature): they reserve
// terabytes of address space, so ulimit -v cannot apply to these binaries.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DP_TEST_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || defined(DP_TEST_SANITIZED)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

// The equal-results matrices (every strategy x split x bucket size x device count) run whole in the
// plain builds, where what they check is the arithmetic. Under the sanitizers, which look for memory
// and thread errors rather than bits, they run 3 devices alone: the same code paths (uneven shards,
// flat buffers padded to a multiple of 3, a ring of more than two), at a third of the cost.
inline bool sanitizers_skip(int devices) { return kSanitized && devices != 3; }

#ifdef DP_TRAIN_BIN
// The dp_train the tests start (the test build's, which arms failpoints from DP_TEST_AT), and the same on
// the simulated devices.
inline const std::string kTrain = DP_TRAIN_BIN;
inline const std::string kTrainCpu = kTrain + " --backend cpu";
#endif

// Seconds from t0 to now.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A fresh directory under the system temp dir, removed with its contents at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("dp_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline void put_be32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(char((v >> (8 * i)) & 0xff));
}

// The whole file, byte for byte ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void write_file(const std::string& path, const std::string& bytes, bool gz) {
  if (gz) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), unsigned(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

inline std::string idx_images(const std::vector<uint8_t>& pixels, uint32_t n, uint32_t rows, uint32_t cols) {
  std::string s;
  put_be32(s, 0x803);
  put_be32(s, n);
  put_be32(s, rows);
  put_be32(s, cols);
  s.append(pixels.begin(), pixels.end());
  return s;
}

inline std::string idx_labels(const std::vector<uint8_t>& labels) {
  std::string s;
  put_be32(s, 0x801);
  put_be32(s, uint32_t(labels.size()));
  s.append(labels.begin(), labels.end());
  return s;
}

// A learnable synthetic data set: class k is a bright horizontal bar at rows 2k+3..2k+5 plus noise.
// Writes <dir>/{train,t10k}-{images,labels}-idx*-ubyte(.gz).
inline void write_synthetic_dataset(const std::string& dir, int train, int test, bool gz = true, uint32_t seed = 7) {
  std::mt19937 gen(seed);
  auto make = [&](const std::string& prefix, int n) {
    std::vector<uint8_t> px(size_t(n) * 784), lab(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      int k = int(gen() % 10);
      lab[i] = uint8_t(k);
      for (int p = 0; p < 784; ++p) {
        int row = p / 28;
        int v = int(gen() % 60);
        if (row >= 2 * k + 3 && row < 2 * k + 6) v += 180;
        px[size_t(i) * 784 + p] = uint8_t(std::min(v, 255));
      }
    }
    std::string ext = gz ? ".gz" : "";
    write_file(dir + "/" + prefix + "-images-idx3-ubyte" + ext, idx_images(px, uint32_t(n), 28, 28), gz);
    write_file(dir + "/" + prefix + "-labels-idx1-ubyte" + ext, idx_labels(lab), gz);
  };
  make("train", train);
  make("t10k", test);
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// A JSON file (a report, a trace) parsed; throws where it is not JSON.
inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

// Runs a shell command line, capturing both streams.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, got);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// The tensors of two checkpoints, bit for bit (the metadata holds the command line, which differs); with
// `within` > 0 the F32 ones need only lie that close, value by value (the rest still bit for bit).
inline void check_same_tensors(const std::string& got_path, const std::string& want_path, double within = 0) {
  INFO("got " << got_path << ", want " << want_path);
  SafeTensors got = read_safetensors(got_path), want = read_safetensors(want_path);
  REQUIRE(got.order == want.order);
  for (auto& name : want.order) {
    const Tensor &a = got.tensors.at(name), &b = want.tensors.at(name);
    CAPTURE(name);
    if (within > 0) REQUIRE((a.dtype == b.dtype && a.shape == b.shape && a.data.size() == b.data.size()));
    if (within == 0 || b.dtype != "F32") {
      CHECK(a.data == b.data);
      continue;
    }
    std::vector<float> x(a.data.size() / sizeof(float)), y(x.size());
    std::memcpy(x.data(), a.data.data(), a.data.size());
    std::memcpy(y.data(), b.data.data(), b.data.size());
    double worst = 0;
    size_t outside = 0;  // values farther apart than `within`, or not a number on either side
    for (size_t i = 0; i < x.size(); ++i) {
      const double d = std::fabs(double(x[i]) - double(y[i]));
      if (!(d <= within)) ++outside;
      if (d > worst) worst = d;
    }
    CAPTURE(worst);
    CHECK(outside == 0);
  }
}

// The step a checkpoint was written after (its metadata's global_step).
inline int64_t global_step(const std::string& path) {
  return std::stoll(read_safetensors(path).metadata.at("global_step"));
}

// A command line's arguments and words its output must contain: the refusals tests table.
struct Refusal {
  std::string args, words;
};

// Each refusal's arguments after `base` exit 2 with its words in the output and without `absent`
// (a sign that the run went ahead: "epoch 1/", "test acc").
inline void check_refusals(const std::string& base, const std::vector<Refusal>& refusals, const std::string& absent) {
  for (const Refusal& c : refusals) {
    CAPTURE(c.args);
    CommandResult r = run_command(base + c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
    CHECK(r.output.find(absent) == std::string::npos);
  }
}

// `sh -c "exec CMD"` in the background with SIGPIPE at its default (whatever this process does with
// it), stdout onto `stdout_fd` when given; killed if still running at destruction.
struct Spawned {
  pid_t pid = -1;
  Spawned(const std::string& cmd, int stdout_fd = -1) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (stdout_fd >= 0) posix_spawn_file_actions_adddup2(&fa, stdout_fd, 1);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t def, none;
    sigemptyset(&def);
    sigaddset(&def, SIGPIPE);
    sigemptyset(&none);
    posix_spawnattr_setsigdefault(&attr, &def);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
    std::string line = "exec " + cmd;
    const char* argv[] = {"/bin/sh", "-c", line.c_str(), nullptr};
    int err = posix_spawn(&pid, "/bin/sh", &fa, &attr, const_cast<char**>(argv), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    REQUIRE(err == 0);
  }
  // The exit code (128 + signal when killed by one), or -1 if it still runs after `timeout`.
  int wait(std::chrono::seconds timeout = std::chrono::seconds(120)) {
    auto end = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > end) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  bool running() {
    int status = 0;
    return pid > 0 && waitpid(pid, &status, WNOHANG) == 0;
  }
  ~Spawned() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

// Calls fn(rank) on every device's compute thread at once (SPMD), rethrowing the first failure (a
// rank's own before its peers' Aborted). A rank that throws aborts `comm` (when given), as the engine
// does, so that its peers waiting in a collective throw too instead of hanging the test.
inline void spmd(const std::vector<Device*>& devs, const std::function<void(int)>& fn, Communicator* comm = nullptr) {
  std::vector<std::future<void>> fs;
  for (auto* d : devs)
    fs.push_back(d->run([&fn, d, comm] {
      try {
        fn(d->rank());
      } catch (...) {
        if (comm) comm->abort();
        throw;
      }
    }));
  std::exception_ptr first, aborted;
  for (auto& f : fs) try {
      f.get();
    } catch (const Aborted&) {
      if (!aborted) aborted = std::current_exception();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  if (first || aborted) std::rethrow_exception(first ? first : aborted);
}

// A convolution shape for test diagnostics: "n 2 c 3 h 7 w 5 k 4 kh 3 kw 2 pad 1".
inline std::string describe(const ConvShape& s) {
  return "n " + std::to_string(s.n) + " c " + std::to_string(s.c) + " h " + std::to_string(s.h) + " w " +
         std::to_string(s.w) + " k " + std::to_string(s.k) + " kh " + std::to_string(s.kh) + " kw " +
         std::to_string(s.kw) + " pad " + std::to_string(s.pad);
}

// n deterministic pseudo-random floats in [lo, hi).
inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = 0.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(gen);
  return v;
}

// Training batches for engine tests: `steps` batches of b MNIST-sized images uniform in [0, 1) and
// labels (i * 7 + step) % 10.
struct Batches {
  std::vector<std::vector<float>> x;    // (steps, b * 784)
  std::vector<std::vector<int32_t>> y;  // (steps, b)
};

inline Batches make_batches(int steps, int b, uint32_t seed) {
  Batches out;
  for (int s = 0; s < steps; ++s) {
    out.x.push_back(random_floats(size_t(b) * 784, seed + uint32_t(s)));
    std::vector<int32_t> labels(static_cast<size_t>(b));
    for (int i = 0; i < b; ++i) labels[size_t(i)] = (i * 7 + s) % 10;
    out.y.push_back(labels);
  }
  return out;
}

// The largest elementwise difference of two equally long vectors.
// Every registered strategy's --sync name (engine/strategy.h), in the registry's order: the loops of
// the "every strategy ..." tests, which a new strategy joins by being registered.
inline std::vector<std::string> all_strategies() {
  std::vector<std::string> names;
  for (const Strategy* s : strategies()) names.push_back(s->name());
  return names;
}
// Whether the strategy takes gradient buckets (--bucket-kb).
inline bool takes_buckets(const std::string& sync) { return find_strategy(sync).takes_buckets(); }

// Every strategy, with and without buckets where they apply: scatter, allreduce, allreduce with
// 8 KiB buckets.
template <class F>
void for_each_strategy(F&& f) {
  for (const std::string& sync : all_strategies()) {
    for (int64_t bucket_kb : {int64_t(0), int64_t(8)}) {
      if (!takes_buckets(sync) && bucket_kb) continue;
      CAPTURE(sync);
      CAPTURE(bucket_kb);
      f(sync, bucket_kb);
    }
  }
}

inline double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

}  // namespace dp::test
