// The convolution's forward pass, its dw and db, and its dx as implicit GEMMs (kernels/cuda/tile_gemm.h says
// how): the kernels here run a tile's phases with __syncthreads between them, as the host's emulation
// in tests/test_tile_gemm.cpp runs them one thread after another. Taken by conv2d.cu's plans under
// DP_CUDA_CONV=implicit (CudaOps::implicit): on an H200 slower than the library path (docs/gpu.md).
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/tile_gemm.h"

namespace dp {
namespace {

template <class Tile>
__global__ void __launch_bounds__(cuda::tile::kThreads) tile_kernel(Tile tile) {
  cuda::await_previous();
  __shared__ cuda::tile::Smem s;
  const int tid = int(threadIdx.x);
  tile.place(int(blockIdx.x), int(blockIdx.y), int(blockIdx.z));
  tile.setup(tid, s);
  cuda::tile::Acc acc{};
  cuda::tile::Staged next;
  const int stages = tile.stages();
  __syncthreads();  // the setup's coordinates, which every fetch reads
  if (stages > 0) tile.fetch(0, tid, s, next);
  for (int stage = 0; stage < stages; ++stage) {
    cuda::tile::put(tid, next, s);
    __syncthreads();
    if (stage + 1 < stages) tile.fetch(stage + 1, tid, s, next);  // in flight during the accumulate
    cuda::tile::accumulate(s, tid, acc);
    __syncthreads();  // every thread done reading the stage before the next put
  }
  tile.store(tid, acc, int(blockIdx.z));
}

__global__ void filter_total_kernel(int64_t total, int k, int cols, int slices, const float* partial, float* dw,
                                    float* db) {
  cuda::await_previous();
  DP_GRID_STRIDE(e, total) { cuda::tile::filter_total(e, k, cols, slices, partial, dw, db); }
}

__global__ void flip_weights_kernel(int64_t total, ConvShape s, const float* w, float* wt) {
  cuda::await_previous();
  DP_GRID_STRIDE(e, total) { cuda::tile::flip_weight(e, s, w, wt); }
}

using cuda::tile::tiles;

// A forward tile's 32-bit indices, with room for what a last tile computes past the rows (a tile, a
// stage) and for an output pixel's window corner past the image (padding wider than the kernel);
// grid.y at most 65,535.
bool tiles_fit(const ConvShape& s) {
  const int64_t rows = s.n * s.col_cols(), margin = cuda::tile::kM + cuda::tile::kK;
  return s.pad >= 0 && int64_t(s.k) * rows + margin < INT32_MAX &&
         int64_t(s.n) * s.c * s.h * s.w + int64_t(s.pad + 1) * (s.w + 1) < INT32_MAX &&
         int64_t(s.k) * (s.col_rows() + 1) < INT32_MAX && tiles(s.k) <= 65535;
}

}  // namespace

// Read once per process.
bool CudaOps::implicit_wanted() {
  static const bool wanted = cuda::env_choice("DP_CUDA_CONV", {"library", "implicit"},
                                              "is not a convolution path; use library (cuDNN's forward, im2col and "
                                              "cuBLAS for dw) or implicit (dp's implicit GEMMs), or unset it") == 1;
  return wanted;
}

bool CudaOps::implicit(const ConvShape& s) { return implicit_wanted() && tiles_fit(s); }

bool CudaOps::implicit_dx(const ConvShape& s) {
  return s.kh == s.kw && s.pad < s.kh && tiles_fit(cuda::tile::data_grad_shape(s));
}

int CudaOps::implicit_slices(const ConvShape& s) {
  const int64_t rows = s.n * s.col_cols();  // about 512 rows (32 stages) a slice
  return int(std::clamp<int64_t>(rows / 512, 1, kImplicitSlices));
}

size_t CudaOps::implicit_partial_floats(const ConvShape& s, int slices) {
  return size_t(slices) * size_t(s.k) * size_t(s.col_rows() + 1);
}

void CudaOps::implicit_forward(const ConvShape& s, const float* x, const float* w, float* y) {
  const cuda::tile::Forward tile{cuda::tile::Gather::of(s, x), w, y};
  const dim3 grid(unsigned(tiles(s.n * s.col_cols())), unsigned(tiles(s.k)));
  cuda::launch("tile_kernel", tile_kernel<cuda::tile::Forward>, grid, cuda::tile::kThreads, 0, stream_, tile);
}

void CudaOps::implicit_filter_grad(const ConvShape& s, int slices, const float* x, const float* dy, bool rows,
                                   float* dw, float* db, float* workspace) {
  const int cols = int(s.col_rows()) + 1;
  const cuda::tile::FilterGrad tile{cuda::tile::Gather::of(s, x), dy, rows, slices, workspace};
  const dim3 grid(unsigned(tiles(cols)), unsigned(tiles(s.k)), unsigned(slices));
  cuda::launch("tile_kernel", tile_kernel<cuda::tile::FilterGrad>, grid, cuda::tile::kThreads, 0, stream_, tile);
  const int64_t total = int64_t(s.k) * cols;
  cuda::launch("filter_total_kernel", filter_total_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_, total,
               s.k, cols, slices, workspace, dw, db);
}

void CudaOps::implicit_data_grad(const ConvShape& s, const float* w, const float* dy, bool rows, float* dx,
                                 float* workspace) {
  const ConvShape t = cuda::tile::data_grad_shape(s);
  const int64_t weights = int64_t(s.k) * s.col_rows();
  cuda::launch("flip_weights_kernel", flip_weights_kernel, cuda::blocks_for(weights), cuda::kThreads, 0, stream_,
               weights, s, w, workspace);
  const cuda::tile::DataGrad tile{{cuda::tile::Gather::of(t, dy, rows), workspace, dx}};
  const dim3 grid(unsigned(tiles(t.n * t.col_cols())), unsigned(tiles(t.k)));
  cuda::launch("tile_kernel", tile_kernel<cuda::tile::DataGrad>, grid, cuda::tile::kThreads, 0, stream_, tile);
}

}  // namespace dp
