// What is particular to the fast CPU kernels (kernels/cpu/fast.h) beyond their values, which the op
// matrix checks against the reference for every instruction set this CPU runs (tests/ops_matrix.h,
// test_ops_*.cpp): which convolution shapes run the direct way, how make_cpu_ops picks the instruction
// set, the network's chunked walk over the fast path's preferred chunk, and the FLOP count the
// benchmarks use.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/network.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/kernels.h"
#include "models/model.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using cpu::Isa;
using Vec = std::vector<float>;

TEST_CASE("fast kernels: the direct way runs the shapes with few taps per output") {
  // The direct way's shapes in the op matrix (one input channel or few taps, rows that fill their
  // vectors) must take it, so that the matrix covers both ways; a layer with many taps does not.
  const ConvShape direct[] = {{.n = 19, .c = 2, .h = 20, .w = 30, .k = 7, .kh = 3, .kw = 2, .pad = 1},
                              {.n = 5, .c = 1, .h = 16, .w = 13, .k = 13, .kh = 4, .kw = 4, .pad = 3},
                              {.n = 33, .c = 1, .h = 9, .w = 16, .k = 11, .kh = 1, .kw = 1},
                              {.n = 2, .c = 3, .h = 12, .w = 26, .k = 5, .kh = 3, .kw = 3},
                              {.n = 1, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3},            // LeNet's conv1
                              {.n = 1, .c = 1, .h = 28, .w = 28, .k = 6, .kh = 5, .kw = 5, .pad = 2}};  // LeNet-5's
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    CAPTURE(std::string(cpu::isa_name(isa)));
    if (!cpu::isa_supported(isa)) {
      MESSAGE("fast kernels: " << std::string(cpu::isa_name(isa)) << " case skipped: this CPU does not support it");
      continue;
    }
    for (const ConvShape& s : direct) {
      INFO(describe(s));
      CHECK(cpu::conv2d_direct(isa, s));
    }
    CHECK_FALSE(cpu::conv2d_direct(isa, {.n = 1, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5}));
  }
}

TEST_CASE("fast kernels: make_cpu_ops picks the best instruction set unless told otherwise") {
  const auto best = make_cpu_ops();
  CHECK(std::string(best->variant()) == cpu::isa_name(cpu::detect_isa()));
  for (Isa isa : {Isa::reference, Isa::avx2, Isa::avx512}) {
    CAPTURE(std::string(cpu::isa_name(isa)));
    if (!cpu::isa_supported(isa)) {
      CHECK_THROWS_AS(make_cpu_ops(isa), std::invalid_argument);
      continue;
    }
    const auto ops = make_cpu_ops(isa);
    CHECK(std::string(ops->backend()) == "cpu");
    CHECK(std::string(ops->variant()) == cpu::isa_name(isa));
    CHECK(ops->preferred_chunk() == 16);
  }
  const auto ref = make_cpu_ops(Isa::reference);
  const ConvShape s{.n = 4, .c = 2, .h = 6, .w = 6, .k = 3, .kh = 3, .kw = 3, .pad = 1};
  CHECK(ref->conv2d_workspace_floats(s) == size_t(cpu::conv2d_workspace_size(s)));
  CHECK_FALSE(cpu::conv2d_direct(Isa::reference, {.n = 1, .c = 1, .h = 28, .w = 28, .k = 20, .kh = 3, .kw = 3}));
}

TEST_CASE("network: the chunked convolutional prefix equals the whole-batch walk") {
  // 37 samples: chunks of 16, 16 and 5. The forward is per sample, so the logits are the same bits;
  // the linear layers run on the whole batch either way, so their gradients are the same bits too.
  // The prefix's weight gradients are the same products summed in another order (per chunk, then
  // the chunks): within the golden comparison's bound, 2 K u max|g| * 4 (tests/test_golden.cpp),
  // K = 37 * OH * OW products per weight.
  auto dev = make_simulated_device(0, 0, 0);
  for (std::string name : {"lenet", "lenet5"}) {
    CAPTURE(name);
    const ModelSpec spec = make_model(name);
    const int n = 37;
    Vec params(static_cast<size_t>(spec.param_count)), x = random_floats(size_t(n * spec.input_size()), 3, -1, 1);
    init_params(spec, 11, params.data());
    const Vec dlogits = random_floats(size_t(n * spec.classes), 4, -1, 1);
    Network chunked(spec, *dev, n), whole(spec, *dev, n, 0);
    Vec g1(params.size()), g2(params.size());
    std::vector<int> ready1, ready2;
    const float* l1 = chunked.forward(params.data(), x.data(), n);
    const float* l2 = whole.forward(params.data(), x.data(), n);
    CHECK(std::memcmp(l1, l2, sizeof(float) * size_t(n * spec.classes)) == 0);
    chunked.backward(params.data(), g1.data(), dlogits.data(), n, [&](int l) { ready1.push_back(l); });
    whole.backward(params.data(), g2.data(), dlogits.data(), n, [&](int l) { ready2.push_back(l); });
    CHECK(ready1 == ready2);  // every parameterised layer once, from the last to the first
    for (const Param& p : spec.params) {
      CAPTURE(p.name);
      const Layer& l = spec.layers[size_t(p.layer)];
      if (l.kind == LayerKind::linear) {
        CHECK(std::memcmp(g1.data() + p.offset, g2.data() + p.offset, sizeof(float) * size_t(p.size)) == 0);
        continue;
      }
      double scale = 0, worst = 0;
      for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
        scale = std::max(scale, double(std::fabs(g2[size_t(i)])));
        worst = std::max(worst, std::fabs(double(g1[size_t(i)]) - double(g2[size_t(i)])));
      }
      CHECK(worst <= 2 * double(n) * l.out_h * l.out_w * kU * scale * 4);
    }
  }
}

TEST_CASE("train_flops_per_sample: 2 per multiply-add, forward, weight and data gradients but conv1's") {
  // LeNet:   conv1 20*26*26 * 1*3*3 = 121,680   conv2 50*9*9 * 20*5*5 = 2,025,000
  //          fc1 800*128 = 102,400               fc2 128*10 = 1,280             total 2,250,360
  //          2 * (3 * 2,250,360 - 121,680) = 13,258,800
  // LeNet-5: conv1 6*28*28 * 1*5*5 = 117,600    conv2 16*10*10 * 6*5*5 = 240,000
  //          fc1 400*120 = 48,000  fc2 120*84 = 10,080  fc3 84*10 = 840         total 416,520
  //          2 * (3 * 416,520 - 117,600) = 2,263,920
  CHECK(train_flops_per_sample(make_model("lenet")) == 13258800.0);
  CHECK(train_flops_per_sample(make_model("lenet5")) == 2263920.0);
}

}  // namespace
}  // namespace dp::test
