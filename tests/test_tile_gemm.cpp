// The implicit-GEMM convolution's tiles (kernels/cuda/tile_gemm.h), run on the host: each block's
// phases one thread after another (setup; the first stage's fetches; per stage the puts of all 256
// threads, the next stage's fetches, their accumulates; the stores), as conv_implicit.cu's kernel runs
// them between __syncthreads, against convolutions worked out in double. Shared memory starts each
// block as NaN, so a read of anything a phase did not write shows. The header is plain C++ outside
// nvcc and Divider's host arithmetic is the device's (tests/test_divider.cpp), so this checks the index
// arithmetic a GPU would run; the kernels themselves are the `cuda: ops:` cases' under
// DP_CUDA_CONV=implicit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/device.h"
#include "kernels/cuda/tile_gemm.h"
#include "tests/backends.h"
#include "tests/conv_exact.h"
#include "tests/ops_matrix.h"
#include "tests/tolerance.h"
#include "tests/util.h"
#if DP_TESTS_CUDA
#include "kernels/cuda/cuda_ops.h"  // the implicit GEMMs' kernels: CudaOps' own, not the Ops interface's
#endif

namespace dp::test {
namespace {

namespace tile = cuda::tile;
using Vec = std::vector<float>;
using DVec = std::vector<double>;

// Every block of a (gx, gy, gz) grid, as the kernel runs it.
template <class Tile>
void run_grid(const Tile& tile, int64_t gx, int64_t gy, int64_t gz) {
  auto s = std::make_unique<tile::Smem>();
  std::vector<tile::Acc> acc(tile::kThreads);
  std::vector<tile::Staged> next(tile::kThreads);
  for (int bz = 0; bz < int(gz); ++bz)
    for (int by = 0; by < int(gy); ++by)
      for (int bx = 0; bx < int(gx); ++bx) {
        for (auto& row : s->a) std::fill(std::begin(row), std::end(row), std::numeric_limits<float>::quiet_NaN());
        for (auto& row : s->b) std::fill(std::begin(row), std::end(row), std::numeric_limits<float>::quiet_NaN());
        std::fill(std::begin(s->one), std::end(s->one), std::numeric_limits<float>::quiet_NaN());
        std::fill(std::begin(s->base), std::end(s->base), 1 << 30);  // far past any x: a read shows
        std::fill(std::begin(s->top), std::end(s->top), 0);
        std::fill(std::begin(s->left), std::end(s->left), 0);
        Tile t = tile;
        t.place(bx, by, bz);
        for (int tid = 0; tid < tile::kThreads; ++tid) t.setup(tid, *s);
        for (tile::Acc& a : acc) a = tile::Acc{};
        for (int tid = 0; tid < tile::kThreads && t.stages() > 0; ++tid) t.fetch(0, tid, *s, next[size_t(tid)]);
        for (int stage = 0; stage < t.stages(); ++stage) {
          for (int tid = 0; tid < tile::kThreads; ++tid) tile::put(tid, next[size_t(tid)], *s);
          for (int tid = 0; tid < tile::kThreads && stage + 1 < t.stages(); ++tid)
            t.fetch(stage + 1, tid, *s, next[size_t(tid)]);
          for (int tid = 0; tid < tile::kThreads; ++tid) tile::accumulate(*s, tid, acc[size_t(tid)]);
        }
        for (int tid = 0; tid < tile::kThreads; ++tid) t.store(tid, acc[size_t(tid)], bz);
      }
}

using tile::tiles;

// What the kernels compute, emulated: y without the bias, then dw and db through `slices` partials.
Vec emulate_forward(const ConvShape& s, const Vec& x, const Vec& w) {
  Vec y(size_t(s.n) * s.k * s.out_h() * s.out_w(), std::numeric_limits<float>::quiet_NaN());
  run_grid(tile::Forward{tile::Gather::of(s, x.data()), w.data(), y.data()}, tiles(s.n * s.col_cols()), tiles(s.k), 1);
  return y;
}
void emulate_filter_grad(const ConvShape& s, const Vec& x, const Vec& dy, bool dy_rows, int slices, Vec& dw, Vec& db) {
  const int cols = int(s.col_rows()) + 1;
  Vec partial(size_t(slices) * s.k * cols, std::numeric_limits<float>::quiet_NaN());
  run_grid(tile::FilterGrad{tile::Gather::of(s, x.data()), dy.data(), dy_rows, slices, partial.data()}, tiles(cols),
           tiles(s.k), slices);
  dw.assign(size_t(s.k) * (cols - 1), std::numeric_limits<float>::quiet_NaN());
  db.assign(size_t(s.k), std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 0; i < int64_t(s.k) * cols; ++i)
    tile::filter_total(i, s.k, cols, slices, partial.data(), dw.data(), db.data());
}

// dx, as the forward pass over dy of data_grad_shape with the flipped weights (square kernels only).
bool has_dx(const ConvShape& s) { return s.kh == s.kw && s.pad < s.kh; }
Vec emulate_data_grad(const ConvShape& s, const Vec& w, const Vec& dy, bool dy_rows) {
  const ConvShape t = tile::data_grad_shape(s);
  Vec wt(w.size()), dx(size_t(s.n) * s.c * s.h * s.w, std::numeric_limits<float>::quiet_NaN());
  for (int64_t e = 0; e < int64_t(wt.size()); ++e) tile::flip_weight(e, s, w.data(), wt.data());
  run_grid(tile::DataGrad{{tile::Gather::of(t, dy.data(), dy_rows), wt.data(), dx.data()}},
           tiles(int64_t(s.n) * s.h * s.w), tiles(s.c), 1);
  return dx;
}

struct Inputs {
  Vec x, w, dy;
};
Inputs random_inputs(const ConvShape& s, uint32_t seed) {
  const size_t rows = size_t(s.n) * s.out_h() * s.out_w();
  return {random_floats(size_t(s.n) * s.c * s.h * s.w, seed, -1, 1),
          random_floats(size_t(s.k) * size_t(s.col_rows()), seed + 1, -1, 1),
          random_floats(size_t(s.k) * rows, seed + 2, -1, 1)};
}

void check_tiles(const ConvShape& s, int slices, uint32_t seed) {
  INFO(describe(s) << ", " << slices << " slices");
  const int rows = s.n * s.out_h() * s.out_w();
  const Inputs in = random_inputs(s, seed);
  const Exact e = exact(s, in.x, in.w, in.dy);
  check_close("y", emulate_forward(s, in.x, in.w), e.y, gamma_bound(double(s.col_rows()), e.y_abs));  // a chain
  for (bool dy_rows : {false, true}) {
    INFO((dy_rows ? "dy as rows" : "dy as (N, K, OH, OW)"));
    Vec dw, db;
    emulate_filter_grad(s, in.x, dy_rows ? as_rows(s, in.dy) : in.dy, dy_rows, slices, dw, db);
    const double chain = double(rows) / slices + 1 + slices;  // a slice's FMA chain, then the slices
    check_close("dw", dw, e.dw, gamma_bound(chain, e.dw_abs));
    check_close("db", db, e.db, gamma_bound(chain, e.db_abs));
    if (has_dx(s))  // one FMA chain over (k, u, v)
      check_close("dx", emulate_data_grad(s, in.w, dy_rows ? as_rows(s, in.dy) : in.dy, dy_rows), e.dx,
                  gamma_bound(double(s.k) * s.kh * s.kw, e.dx_abs));
  }
}

TEST_CASE("tile_gemm: the implicit-GEMM convolution's tiles on the host, against convolutions in double") {
  // LeNet's conv2 and LeNet-5's (the shapes the implicit path is for), 1053 rows in 5 slices.
  check_tiles({.n = 5, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5}, 1, 1);
  check_tiles({.n = 13, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5}, 5, 11);
  check_tiles({.n = 7, .c = 6, .h = 14, .w = 14, .k = 16, .kh = 5, .kw = 5}, 3, 21);
  // Tile edges: more channels than a row tile (two of them), C KH KW + 1 = 65 (db alone in a second
  // column tile), 64 taps and 64 rows exactly, padding, non-square kernels, a 1x1 output.
  check_tiles({.n = 2, .c = 3, .h = 6, .w = 6, .k = 70, .kh = 3, .kw = 3, .pad = 1}, 2, 31);
  check_tiles({.n = 3, .c = 4, .h = 7, .w = 7, .k = 9, .kh = 4, .kw = 4}, 4, 41);
  check_tiles({.n = 4, .c = 1, .h = 4, .w = 4, .k = 64, .kh = 1, .kw = 1}, 1, 51);
  check_tiles({.n = 3, .c = 2, .h = 9, .w = 7, .k = 5, .kh = 3, .kw = 2, .pad = 1}, 7, 61);
  check_tiles({.n = 1, .c = 3, .h = 5, .w = 5, .k = 1, .kh = 5, .kw = 5}, 1, 71);
  check_tiles({.n = 3, .c = 5, .h = 3, .w = 3, .k = 9, .kh = 3, .kw = 3, .pad = 3}, 2, 81);
  // dx's own edges: more input channels than a tile (its second tile of outputs), padding of KH - 1
  // (dy unpadded for it), and of none
  check_tiles({.n = 2, .c = 70, .h = 5, .w = 5, .k = 3, .kh = 3, .kw = 3, .pad = 1}, 1, 91);
  check_tiles({.n = 3, .c = 4, .h = 6, .w = 6, .k = 5, .kh = 3, .kw = 3, .pad = 2}, 2, 95);
  std::mt19937_64 gen(5);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (uint32_t trial = 0; trial < 12; ++trial) {
    const int kh = pick(1, 5), kw = pick(1, 5), pad = pick(0, 2);
    const int h = std::max(kh - 2 * pad, 1) + pick(0, 9), w = std::max(kw - 2 * pad, 1) + pick(0, 9);
    const ConvShape s{
        .n = pick(1, 9), .c = pick(1, 9), .h = h, .w = w, .k = pick(1, 80), .kh = kh, .kw = kw, .pad = pad};
    check_tiles(s, pick(1, std::min(9, s.n * s.out_h() * s.out_w())), 100 + 10 * trial);
  }
}

// On a GPU, conv_implicit.cu's kernels give the bits of the emulation of their blocks, whatever
// DP_CUDA_CONV says: each output is the same FMA chain in the same order (fmaf on the host and the
// GPU's FMA both round once), the slices are added in the same order. What the emulation cannot show
// (a missing __syncthreads) shows here, or under gpu_check's compute-sanitizer.
TEST_CASE("cuda: implicit GEMM: the GPU's y, dw, db and dx are the bits of the host's emulation of its blocks" *
          doctest::skip(!cuda_available())) {
#if DP_TESTS_CUDA
  Backend be(make_cuda_device(0, 0, 0));
  // LeNet's conv2 in 2 and 10 slices; two tiles of channels with padding, square (dx) and not (no dx);
  // two tiles of dx's channels
  for (const ConvShape& s : {ConvShape{.n = 13, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5},
                             ConvShape{.n = 64, .c = 20, .h = 13, .w = 13, .k = 50, .kh = 5, .kw = 5},
                             ConvShape{.n = 3, .c = 2, .h = 9, .w = 7, .k = 70, .kh = 3, .kw = 3, .pad = 1},
                             ConvShape{.n = 3, .c = 2, .h = 9, .w = 7, .k = 70, .kh = 3, .kw = 2, .pad = 1},
                             ConvShape{.n = 2, .c = 70, .h = 5, .w = 5, .k = 3, .kh = 3, .kw = 3, .pad = 2}}) {
    INFO(describe(s));
    const Inputs in = random_inputs(s, 7);
    Mem gx = be.put(in.x), gw = be.put(in.w), gy = be.out(in.dy.size());
    be.run([&](Ops& ops) { dynamic_cast<CudaOps&>(ops).implicit_forward(s, gx.f(), gw.f(), gy.f()); });
    check_same_bits("y", be.get(gy), emulate_forward(s, in.x, in.w));
    for (bool dy_rows : {false, true}) {
      INFO((dy_rows ? "dy as rows" : "dy as (N, K, OH, OW)"));
      const Vec dy = dy_rows ? as_rows(s, in.dy) : in.dy;
      Mem gdy = be.put(dy), gdw = be.out(in.w.size()), gdb = be.out(size_t(s.k));
      const int wanted = CudaOps::implicit_slices(s);
      Mem ws = be.out(CudaOps::implicit_partial_floats(s, wanted));
      // the slices wanted, and one, as a plan made again for a smaller workspace may have (conv_plan.cpp)
      for (int slices : wanted > 1 ? std::vector<int>{wanted, 1} : std::vector<int>{1}) {
        INFO(slices << " slices");
        be.run([&](Ops& ops) {
          dynamic_cast<CudaOps&>(ops).implicit_filter_grad(s, slices, gx.f(), gdy.f(), dy_rows, gdw.f(), gdb.f(),
                                                           ws.f());
        });
        Vec dw, db;
        emulate_filter_grad(s, in.x, dy, dy_rows, slices, dw, db);
        check_same_bits("dw", be.get(gdw), dw);
        check_same_bits("db", be.get(gdb), db);
      }
      if (has_dx(s)) {
        Mem gdx = be.out(in.x.size());
        be.run([&](Ops& ops) {
          dynamic_cast<CudaOps&>(ops).implicit_data_grad(s, gw.f(), gdy.f(), dy_rows, gdx.f(), ws.f());
        });
        check_same_bits("dx", be.get(gdx), emulate_data_grad(s, in.w, dy, dy_rows));
      }
      be.get(ws);
    }
  }
#else
  FAIL("a CUDA device is usable, but this build has no CUDA backend");
#endif
}

}  // namespace
}  // namespace dp::test
