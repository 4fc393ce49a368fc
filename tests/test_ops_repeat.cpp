// The same inputs give the same bits on every run, over the op matrix (tests/ops_matrix.h): the
// bit-exact resume, the run-to-run identical losses and --verify's bounds rest on it. Each op runs
// twice (or twenty times) on the same buffers and its outputs are compared bit for bit, instead of
// trusting a library's word for it (cuDNN's determinism flag, say). On the CPU the kernels are
// deterministic by construction; on CUDA an atomicAdd per block, or a convolution algorithm that
// splits its sums over blocks, would not be.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "models/model.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"

namespace dp::test {
namespace {

using Vec = std::vector<float>;

DP_OPS_TEST("softmax_xent: the statistics have the same bits on every run, and a second call adds the same") {
  // 4,096 rows: 512 warps' worth, more than one pass of CUDA's grid (CudaOps::kReduceBlocks blocks of
  // 8 rows), so the rows, the warps and the blocks are all summed.
  const int n = 4096, classes = 10;
  const Vec z = random_floats(size_t(n) * classes, 7, -4.0f, 4.0f);
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) labels[size_t(i)] = (i * 7) % classes;
  Mem gz = be.put(z), gl = be.put(labels), gdz = be.out(z.size());
  Vec first, first_dz;
  for (int run = 0; run < 20; ++run) {
    CAPTURE(run);
    Mem gs = be.put(Vec{0.0f, 0.0f});
    be.run([&](Ops& ops) { ops.softmax_xent(n, classes, gz.f(), gl.i32(), 1.0f / n, gdz.f(), gs.f()); });
    const Vec stats = be.get(gs);
    if (run == 0) {
      first = stats, first_dz = be.get(gdz);
      CHECK(stats[0] > 0.0f);
      CHECK(stats[1] >= 0.0f);
      continue;
    }
    check_same_bits("loss and correct count", stats, first);
    if (run == 1) check_same_bits("dlogits", be.get(gdz), first_dz);
  }
  // Added onto what is there: a second call on the same stats adds the same bits again (on CUDA the
  // count of finished blocks must be back at zero for its last block to add anything).
  Mem gs = be.put(Vec{0.0f, 0.0f});
  be.run([&](Ops& ops) {
    ops.softmax_xent(n, classes, gz.f(), gl.i32(), 1.0f / n, gdz.f(), gs.f());
    ops.softmax_xent(n, classes, gz.f(), gl.i32(), 1.0f / n, gdz.f(), gs.f());
  });
  check_same_bits("two calls", be.get(gs), {first[0] + first[0], first[1] + first[1]});
}

DP_OPS_TEST("conv2d: every model's convolutions give the same bits when run twice, forward and backward") {
  // The batch sizes the engine runs: one image, the last chunks of training (96 of 60,000 at batch
  // 256) and of the test set (16 of 10,000 at 256 per device in chunks), an odd split, and a full
  // batch. cuDNN plans per shape, so each size may get algorithms of its own.
  std::vector<int> sizes = {1, 16, 37, 96, 256};
  if (!be.is_cuda()) sizes = {1, 16};  // deterministic by construction: a smoke test, kept quick
  for (const std::string& name : model_names()) {
    for (const Layer& l : make_model(name).layers) {
      if (l.kind != LayerKind::conv) continue;
      for (int n : sizes) {
        const ConvShape s{
            .n = n, .c = l.in_c, .h = l.in_h, .w = l.in_w, .k = l.out_c, .kh = l.kernel, .kw = l.kernel, .pad = l.pad};
        INFO(name << ": " << describe(s));
        const size_t xs = size_t(n) * s.c * s.h * s.w, ws = size_t(s.k) * s.c * s.kh * s.kw,
                     ys = size_t(n) * s.k * s.out_h() * s.out_w();
        Mem x = be.put(random_floats(xs, 1, -1.0f, 1.0f)), w = be.put(random_floats(ws, 2, -0.5f, 0.5f)),
            b = be.put(random_floats(size_t(s.k), 3)), dy = be.put(random_floats(ys, 4, -1.0f, 1.0f));
        Mem work = be.workspace(s);
        std::vector<Vec> outs[2];
        for (auto& out : outs) {
          Mem y = be.out(ys), dx = be.out(xs), dw = be.out(ws), db = be.out(size_t(s.k));
          be.run([&](Ops& ops) {
            ops.conv2d_forward(s, x.f(), w.f(), b.f(), y.f(), work.f());
            ops.conv2d_backward(s, x.f(), w.f(), dy.f(), dx.f(), dw.f(), db.f(), work.f());
          });
          out = {be.get(y), be.get(dx), be.get(dw), be.get(db)};
        }
        const char* what[] = {"y", "dx", "dw", "db"};
        for (size_t i = 0; i < 4; ++i) check_same_bits(what[i], outs[1][i], outs[0][i]);
      }
    }
  }
}

}  // namespace
}  // namespace dp::test
