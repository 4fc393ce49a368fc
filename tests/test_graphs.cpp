// Step graphs (--graphs; EngineConfig::graphs, Device::begin_capture): a step captured once per upload
// slot and replayed trains bit-identical to the eager step, under SGD and AdamW with a learning rate
// changed every step (the optimizer's scalars are read from device memory, not captured); what a
// replay would get wrong (the capture's host memory, a buffer allocated in the step) is refused;
// where a replay cannot run, --graphs is refused. On simulated devices a graph is the
// recorded list of calls (engine/cpu/recording_ops.h), the twin of CUDA's stream capture: the same
// engine code decides what is captured, when, and what is launched.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "tests/backends.h"
#include "tests/failpoint/failpoints.h"
#include "tests/util.h"
#include "train/checkpoint.h"

using namespace dp;
using dp::test::Batches;
using dp::test::make_batches;
using dp::test::raw;
namespace {

struct GraphRun {
  std::vector<StepResult> steps, evals;
  std::vector<float> params, running;
  int64_t captures = 0, launches = 0;
  double forward_seconds = 0;
};

// Eleven steps of batch 12 on one device, prefetched as dp_train does: a short batch (7) in the middle,
// the learning rate changed before every step from the sixth on (a schedule's), an evaluation after
// every step. The host buffers are overwritten with NaN once their step has run: a replay that read
// the captured step's host memory would show it; one that kept the captured step's learning rate or
// Adam's bias correction would train otherwise.
GraphRun train(const std::string& kind, const std::string& model, const std::string& sync, Optimizer optimizer,
               bool graphs, float clip, bool sync_bn = false) {
  const ModelSpec spec = make_model(model);
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 3, init.data());
  const std::vector<int> sizes{12, 12, 12, 12, 7, 12, 12, 12, 12, 12, 12};
  const int K = int(sizes.size()), B = 12;
  Batches data = make_batches(K, B, 5), test = make_batches(1, 16, 6);
  EngineConfig c;
  c.batch = B, c.sync = sync, c.prefetch = true, c.graphs = graphs, c.clip_grad_norm = clip, c.trace = true;
  c.optimizer = optimizer, c.sync_bn = sync_bn;
  if (optimizer != Optimizer::sgd) c.lr = 1e-3f, c.weight_decay = 0.01f;
  auto devs = dp::test::make_test_devices(kind, 1);
  Engine e(raw(devs), spec, c);
  e.set_params(init);
  std::vector<std::vector<float>> host_x(3);
  std::vector<std::vector<int32_t>> host_y(3);
  auto stage = [&](int s) {
    host_x[size_t(s % 3)] = data.x[size_t(s)];
    host_y[size_t(s % 3)] = data.y[size_t(s)];
    e.stage(host_x[size_t(s % 3)].data(), host_y[size_t(s % 3)].data(), sizes[size_t(s)]);
  };
  GraphRun run;
  stage(0);
  for (int s = 0; s < K; ++s) {
    if (s + 1 < K) stage(s + 1);
    if (s >= 5) e.set_lr(e.config().lr * 0.9f);
    run.steps.push_back(e.step());
    std::fill(host_x[size_t(s % 3)].begin(), host_x[size_t(s % 3)].end(), std::numeric_limits<float>::quiet_NaN());
    std::fill(host_y[size_t(s % 3)].begin(), host_y[size_t(s % 3)].end(), -1);
    run.evals.push_back(e.evaluate(test.x[0].data(), test.y[0].data(), 16));
  }
  run.params = e.params();
  run.running = e.running_stats();
  run.captures = e.graph_captures(), run.launches = e.graph_launches();
  run.forward_seconds = e.recorder().phase_seconds()[0][int(Phase::forward)];
  return run;
}

// Steps 0 and the short step 4 eager; a capture per slot (steps 1 and 2), launched from then on
// whatever the learning rate: nine launches, two captures; bit for bit the eager steps.
void check_same(const GraphRun& want, const GraphRun& got) {
  for (size_t s = 0; s < want.steps.size(); ++s) {
    CAPTURE(s);
    CHECK(std::isfinite(got.steps[s].loss));
    CHECK(got.steps[s].loss == want.steps[s].loss);  // bitwise: the same kernels on the same bytes
    CHECK(got.steps[s].correct == want.steps[s].correct);
    CHECK(got.steps[s].finite_gradients);
    CHECK(got.evals[s].loss == want.evals[s].loss);
  }
  CHECK(got.params == want.params);
  CHECK(got.running == want.running);
  CHECK(got.launches == 9);
  CHECK(got.captures == 2);
  CHECK(want.launches == 0);
  // The phases of a launched step are timed by its own marks.
  CHECK(got.forward_seconds > 0);
}

void check_graphs_train_as_eager(const std::string& kind) {
  for (const std::string model : {"lenet5", "lenet-bn"})
    for (const std::string sync : {"scatter", "allreduce", "zero1"})
      for (Optimizer optimizer : {Optimizer::sgd, Optimizer::adamw})
        for (float clip : {0.0f, 0.5f}) {
          CAPTURE(model);
          CAPTURE(sync);
          CAPTURE(optimizer_name(optimizer));
          CAPTURE(clip);
          check_same(train(kind, model, sync, optimizer, false, clip), train(kind, model, sync, optimizer, true, clip));
        }
  // --sync-bn on one device: the statistics are the replica's own, and no host wait (which a capture
  // refuses, as CUDA's does) falls the step back to eager.
  for (const std::string sync : {"scatter", "allreduce"}) {
    CAPTURE(sync);
    check_same(train(kind, "lenet-bn", sync, Optimizer::sgd, false, 0, true),
               train(kind, "lenet-bn", sync, Optimizer::sgd, true, 0, true));
  }
}

}  // namespace

TEST_CASE("graphs: steps replayed from a graph per upload slot train bit-identical to eager steps") {
  check_graphs_train_as_eager("cpu");
}

TEST_CASE("cuda: graphs: steps replayed from a CUDA graph per upload slot train bit-identical to eager steps" *
          doctest::skip(!dp::test::cuda_available())) {
  check_graphs_train_as_eager("cuda");
}

// The device's side, on each backend there is: a captured op runs at launch, not at capture, and each
// launch runs it again with the capture's arguments; what a replay would repeat wrongly throws while
// capturing (a free, which cannot throw, when the capture ends), and the device works on after.
void check_capture(Device& d) {
  d.run([&] {
     Buffer x = d.alloc_floats(4, Category::workspace);
     std::vector<float> got(4);
     d.ops().fill(4, 0.0f, x.f());
     d.begin_capture();
     d.ops().fill(4, 1.0f, x.f());
     d.ops().add(4, x.f(), x.f());  // doubles it
     d.end_capture(1);
     d.download(got.data(), x.f(), sizeof(float) * 4);
     CHECK(got == std::vector<float>(4, 0.0f));  // recorded, not run
     d.launch(1);
     d.download(got.data(), x.f(), sizeof(float) * 4);
     CHECK(got == std::vector<float>(4, 2.0f));
     d.ops().fill(4, 5.0f, x.f());
     d.launch(1);
     d.download(got.data(), x.f(), sizeof(float) * 4);
     CHECK(got == std::vector<float>(4, 2.0f));  // the fill's 1, not the 5 since
     CHECK_THROWS_WITH_AS(d.launch(0), doctest::Contains("no graph captured for upload slot 0"), DeviceError);
     const float host[4] = {7, 7, 7, 7};
     for (int what = 0; what < 4; ++what) {
       CAPTURE(what);
       d.begin_capture();
       if (what == 0)
         CHECK_THROWS_WITH_AS(d.upload(x.f(), host, sizeof host),
                              doctest::Contains("an upload from host memory while capturing"), DeviceError);
       else if (what == 1)
         CHECK_THROWS_WITH_AS(d.download(got.data(), x.f(), sizeof host),
                              doctest::Contains("a download to host memory while capturing"), DeviceError);
       else if (what == 2)
         CHECK_THROWS_WITH_AS(d.alloc_floats(4, Category::workspace),
                              doctest::Contains("an allocation while capturing"), DeviceError);
       else
         CHECK_THROWS_WITH_AS(d.synchronize(), doctest::Contains("a host wait for the device while capturing"),
                              DeviceError);
       d.abandon_capture();
     }
     // A free while capturing: held until the capture ends (the graph's fill still writes y), then
     // freed, and the graph refused; the slot keeps no graph.
     const int64_t before = d.ledger().snapshot().total;
     Buffer y = d.alloc_floats(4, Category::workspace);
     d.begin_capture();
     d.ops().fill(4, 1.0f, y.f());
     y = Buffer();
     CHECK_THROWS_WITH_AS(d.end_capture(0), doctest::Contains("a free while capturing"), DeviceError);
     d.abandon_capture();
     CHECK(d.ledger().snapshot().total == before);
     CHECK_THROWS_WITH_AS(d.launch(0), doctest::Contains("no graph captured for upload slot 0"), DeviceError);
     d.ops().fill(4, 3.0f, x.f());  // eager again
     d.download(got.data(), x.f(), sizeof(float) * 4);
     CHECK(got == std::vector<float>(4, 3.0f));
   }).get();
}

TEST_CASE("graphs: a simulated device's captured ops run at each launch with the capture's arguments") {
  auto devs = dp::test::make_test_devices("cpu", 1);
  check_capture(*devs[0]);
}

TEST_CASE("cuda: graphs: a CUDA device's captured ops run at each launch with the capture's arguments" *
          doctest::skip(!dp::test::cuda_available())) {
  auto devs = dp::test::make_test_devices("cuda", 1);
  check_capture(*devs[0]);
}

TEST_CASE("graphs: a step that cannot be captured runs eagerly, and so does every step after") {
  // A fault in the first capture (step 1) stands for a call the device cannot capture: the step and
  // the rest run eagerly, the same bits as a run without --graphs, and nothing is launched.
  const ModelSpec spec = make_model("lenet5");
  std::vector<float> init(size_t(spec.param_count));
  init_params(spec, 8, init.data());
  Batches data = make_batches(5, 8, 4);
  std::vector<StepResult> want;
  std::vector<float> want_params;
  for (bool graphs : {false, true}) {
    EngineConfig c;
    c.batch = 8, c.sync = "allreduce", c.prefetch = true, c.graphs = graphs;
    auto devs = dp::test::make_test_devices("cpu", 1);
    Engine e(raw(devs), spec, c);
    e.set_params(init);
    for (int s = 0; s < 5; ++s) {
      CAPTURE(s);
      e.stage(data.x[size_t(s)].data(), data.y[size_t(s)].data(), 8);
      if (graphs && s == 1) dp::failpoint::inject_fault(*devs[0], "not capturable");
      const StepResult r = e.step();
      if (!graphs) want.push_back(r);
      if (graphs) CHECK(r.loss == want[size_t(s)].loss);
    }
    if (!graphs) want_params = e.params();
    if (graphs) {
      CHECK(e.params() == want_params);
      CHECK(e.graph_launches() == 0);
      CHECK_FALSE(e.config().graphs);
    }
  }
}

TEST_CASE("graphs: refused where a replay cannot run, naming why and what would") {
  const ModelSpec spec = make_model("lenet5");
  struct Case {
    int devices;
    EngineConfig config;
    const char* says;
  };
  EngineConfig base;
  base.batch = 8, base.sync = "allreduce", base.prefetch = true, base.graphs = true;
  EngineConfig accumulate = base, eager_upload = base, zero2 = base, zero3 = base;
  accumulate.accumulate = 2, eager_upload.prefetch = false;
  zero2.sync = "zero2", zero3.sync = "zero3";
  for (const Case& c :
       {Case{2, base, "one device in one process only (the job has 2)"}, Case{1, accumulate, "--accumulate 2"},
        Case{1, eager_upload, "leave out --no-prefetch"}, Case{1, zero2, "--sync zero2 allocates each gradient bucket"},
        Case{1, zero3, "--sync zero3 allocates"}}) {
    CAPTURE(c.says);
    auto devs = dp::test::make_test_devices("cpu", c.devices);
    CHECK_THROWS_WITH_AS(Engine(raw(devs), spec, c.config), doctest::Contains(c.says), UsageError);
  }
}

TEST_CASE("graphs: dp_train --graphs trains as without it, bit for bit, and reports its launches") {
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 200, 40);
  const std::string base = std::string(DP_TRAIN_BIN) + " --backend cpu --gpus 0 --sync allreduce --data " +
                           dir.path.string() + " --batch 32 --epochs 2 --quiet --seed 4";
  for (bool graphs : {false, true}) {
    const std::string tag = graphs ? "graphs" : "eager";
    const dp::test::CommandResult r = dp::test::run_command(base + (graphs ? " --graphs" : "") + " --save " +
                                                            (dir.path / (tag + ".safetensors")).string() +
                                                            " --report " + (dir.path / (tag + ".json")).string());
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
  }
  dp::test::check_same_tensors((dir.path / "graphs.safetensors").string(), (dir.path / "eager.safetensors").string());
  const nlohmann::json report = dp::test::read_json((dir.path / "graphs.json").string());
  CHECK(report["config"]["graphs"] == true);
  // Two epochs of 200 images at 32: 6 full steps and a short one each; the first step eager.
  CHECK(report["graphs"]["launches"] == 11);
  CHECK(report["graphs"]["captures"] == 2);
  CHECK(dp::test::read_json((dir.path / "eager.json").string()).count("graphs") == 0);

  // --verify's reference steps eagerly: the graphs checked against it.
  const dp::test::CommandResult verified =
      dp::test::run_command(std::string(DP_TRAIN_BIN) + " --backend cpu --gpus 0 --sync allreduce --data " +
                            dir.path.string() + " --batch 32 --graphs --verify --steps 8");
  INFO(verified.output);
  CHECK(verified.exit_code == 0);
  CHECK(verified.output.find("graphs: each step captured once per batch buffer") != std::string::npos);

  const dp::test::CommandResult two = dp::test::run_command(
      std::string(DP_TRAIN_BIN) + " --backend cpu --devices 2 --graphs --data " + dir.path.string());
  CHECK(two.exit_code == 2);
  CHECK(two.output.find("--graphs: one device in one process only") != std::string::npos);
}

// An environment variable's two values train the same bits, eager and captured in a graph; a third is
// refused, naming the accepted ones (`accepted`, a piece of the message). `shape`: the model's options.
// `within` > 0: the two values' weights need only lie that close (each value's graphs its eager bits),
// and must differ somewhere: a variable that changed no kernel would train the same bits. `also`: other
// variables every run is given ("NAME=value ..."). `more_workspace`: bytes of workspace the value `on`
// books beyond `off` at least (a second stream's cuBLAS workspace): what shows the value took effect
// where the bits are the same by design.
struct EitherWay {
  const char* variable;
  const char* off;
  const char* on;
  const char* wrong;
  const char* accepted;
  std::string shape = "--batch 64";
  double within = 0;
  std::string also = "";
  int64_t more_workspace = 0;
};

// The second stream's cuBLAS workspace (CudaDevice::kCublasWorkspaceBytes), booked as workspace.
constexpr int64_t kSideWorkspace = int64_t(32) << 20;

// That the value `on` took effect: other bits (within > 0), or more workspace booked.
void check_took_effect(const EitherWay& w, const std::filesystem::path& dir) {
  const auto file = [&](const char* value, const char* ext) {
    return (dir / (std::string(value) + "-eager" + ext)).string();
  };
  if (w.within > 0) {
    const SafeTensors on = read_safetensors(file(w.on, ".safetensors")),
                      off = read_safetensors(file(w.off, ".safetensors"));
    bool differ = false;
    for (const std::string& name : off.order) differ = differ || on.tensors.at(name).data != off.tensors.at(name).data;
    CHECK_MESSAGE(differ, std::string(w.variable) << "=" << std::string(w.on) << " trained the same bits as "
                                                  << std::string(w.off) << ": it changed no kernel");
  }
  if (w.more_workspace > 0) {
    auto workspace = [&](const char* value) {
      return dp::test::read_json(file(value, ".json"))["devices"][0]["category_peaks"]["workspace"].get<int64_t>();
    };
    CHECK(workspace(w.on) - workspace(w.off) >= w.more_workspace);
  }
}

void check_same_bits_either_way(const EitherWay& w) {
  dp::test::TempDir dir;
  dp::test::write_synthetic_dataset(dir.path.string(), 300, 40);
  const std::string base = std::string(DP_TRAIN_BIN) + " --backend cuda --gpus 0 --data " + dir.path.string() + " " +
                           w.shape + " --quiet --seed 4";
  const auto with = [&](const char* value) { return w.also + " " + w.variable + "=" + value + " " + base; };
  for (const char* value : {w.off, w.on})
    for (bool graphs : {false, true}) {
      const std::string tag = std::string(value) + (graphs ? "-graphs" : "-eager");
      const dp::test::CommandResult r = dp::test::run_command(
          with(value) + (graphs ? " --graphs" : "") + " --epochs 2 --save " +
          (dir.path / (tag + ".safetensors")).string() + " --report " + (dir.path / (tag + ".json")).string());
      INFO(w.also << " " << std::string(w.variable) << "=" << tag << ": " << r.output);
      REQUIRE(r.exit_code == 0);
      // a capture that failed would train eagerly, the same bits, with this warning (engine/step_graph.cpp)
      CHECK(r.output.find("dp: warning:") == std::string::npos);
    }
  const auto path = [&](const std::string& value, const char* how) {
    return (dir.path / (value + how + ".safetensors")).string();
  };
  for (const char* value : {w.off, w.on}) dp::test::check_same_tensors(path(value, "-graphs"), path(value, "-eager"));
  dp::test::check_same_tensors(path(w.on, "-eager"), path(w.off, "-eager"), w.within);
  check_took_effect(w, dir.path);

  const dp::test::CommandResult refused = dp::test::run_command(with(w.wrong) + " --steps 1");
  CHECK(refused.exit_code == 2);
  CHECK(refused.output.find(std::string(w.variable) + ": '" + w.wrong + "'") != std::string::npos);
  CHECK(refused.output.find(w.accepted) != std::string::npos);
}

// DP_CUDA_STREAMS' two values at width 4 and batch 256 (below), with `also`.
EitherWay two_streams(const std::string& also) {
  return {.variable = "DP_CUDA_STREAMS",
          .off = "1",
          .on = "2",
          .wrong = "3",
          .accepted = "use 1",
          .shape = "--width 4 --batch 256",
          .also = also,
          .more_workspace = kSideWorkspace};
}

// DP_CUDA_STREAMS=2 (kernels/cuda/cuda_ops.h): lenet's conv2 and fc1 compute dw and db on a second
// stream while dx runs on the first, joined before each op returns: eager and captured in a graph,
// the weights must be the bits of one stream's. At width 4 and batch 256 conv2's backward pass takes
// 94 images a chunk (kernels/cuda/conv_plan.cpp), so the chunks, in which dw is summed, must be one
// lane's too. A value other than 1 or 2 is refused, naming both.
TEST_CASE(
    "cuda: graphs: the weight gradients on a second stream train the bits of one stream, eager and "
    "in graphs" *
    doctest::skip(!dp::test::cuda_available())) {
  check_same_bits_either_way(two_streams(""));
}

// DP_CUDA_PDL=1 (kernels/cuda/launch.h): every kernel launched programmatically dependent on the one
// before it, waiting for it before anything else, then letting the next launch; in a graph the edges
// between them are programmatic.
// The same kernels on the same data: the bits of ordinary launches. A value other than 0 or 1 is refused.
TEST_CASE("cuda: graphs: programmatic dependent launches train the bits of ordinary ones, eager and in graphs" *
          doctest::skip(!dp::test::cuda_available())) {
  check_same_bits_either_way({"DP_CUDA_PDL", "0", "1", "2", "use 0"});
}

// DP_CUDA_FUSE=0 (kernels/cuda/cuda_ops.h): lenet's conv1 and fc2 passes and conv2's bias gradient on the
// kernels each took before it was fused: the same bits but for fc2's forward pass (cuBLAS's GEMM sums
// in another order), so after 10 steps each weight within 1e-4 of the fused kernels' (a lost or wrong
// gradient of any layer moves some by more). A value other than 1 or 0 is refused.
TEST_CASE("cuda: graphs: the fused kernels train as the kernels they replace, eager and in graphs" *
          doctest::skip(!dp::test::cuda_available())) {
  check_same_bits_either_way({"DP_CUDA_FUSE", "1", "0", "2", "use 1", "--batch 64", 1e-4});
}

// Under DP_CUDA_FUSE=0 the second stream takes other work: fc2's dw and db (the column sums) and
// conv2's bias gradient after dy's rows. Where each runs changes no sum's order: one stream's bits.
TEST_CASE("cuda: graphs: under DP_CUDA_FUSE=0 the weight gradients on a second stream train the bits of one" *
          doctest::skip(!dp::test::cuda_available())) {
  check_same_bits_either_way(two_streams("DP_CUDA_FUSE=0"));
}
