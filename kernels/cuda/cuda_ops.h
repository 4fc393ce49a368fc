// The CUDA kernels: every op of kernels/ops.h on one device, enqueued on that device's stream.
// GEMM goes through cuBLAS (a row-major wrapper), convolution through cuDNN, the rest are the
// kernels in this directory, one file per op family, each the twin of kernels/cpu/<same name>.cpp.
//
// Threading: a CudaOps belongs to one CudaDevice and is called from that device's threads (compute,
// and the communication thread for add()). The cuBLAS and cuDNN handles are only used from the
// compute thread; the convolution plan cache is guarded anyway.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/raii.h"
#include "kernels/ops.h"

namespace dp {

// The algorithm make_plan chose for one pass of one convolution shape, in plain words, so that logs
// and tests can see whether the choice was the strict one (kernels/cuda/conv2d.cu) or a fallback.
struct ConvChoice {
  ConvShape shape;
  std::string pass;  // "forward", "backward-data" or "backward-filter"
  std::string algo;  // cuDNN's enum name less its prefix: "IMPLICIT_PRECOMP_GEMM", "BWD_DATA_ALGO_1"
  std::string math;  // the math type cuDNN reported for it: "FMA", "DEFAULT", ...
  size_t workspace_bytes = 0;
  bool deterministic = false;  // cuDNN says: the same bits every run
  bool strict = false;         // deterministic and GEMM-like: the first round of the choice, no fallback
};

// Everything one convolution shape needs: cuDNN's descriptors and its forward algorithm, chosen once,
// and the chunk of dp's own backward pass (kernels/cuda/conv2d.cu explains).
struct ConvPlan {
  cuda::TensorDesc x, y;  // (N, C, H, W), (N, K, OH, OW)
  cuda::FilterDesc w;     // (K, C, KH, KW)
  cuda::ConvDesc conv;
  cudnnConvolutionFwdAlgo_t fwd{};
  int backward_images = 0;  // images per chunk of dp's own backward pass (conv2d.cu), within the workspace
  size_t fwd_bytes = 0, bwd_data_bytes = 0, bwd_filter_bytes = 0;
  size_t bias_floats = 0;             // the bias gradient's (and a direct plan's dw's) partial sums, first
  bool direct = false;                // forward and dw, db by conv_direct.cu (CudaOps::direct)
  bool implicit = false;              // forward and dw, db by conv_implicit.cu (CudaOps::implicit)
  int slices = 0;                     // an implicit dw's partials: implicit_slices, or fewer to fit the workspace
  bool implicit_dx = false;           // and dx (CudaOps::implicit_dx)
  bool side_dw = false;               // dw and db on the side lane, dx's columns apart (conv2d.cu)
  size_t side_bytes = 0;              // of the backward pass's bytes, dx's columns apart (side_dw)
  std::array<ConvChoice, 3> choices;  // forward, backward-data, backward-filter
  size_t workspace_floats() const;
  size_t lane_floats() const;             // what one lane would need: the same, less side_bytes
  size_t floats_less(size_t side) const;  // the workspace, less `side` of the backward pass's bytes
};

namespace cuda {
// The environment variable `name` as the index of its value among `choices`, 0 where it is unset or
// empty (the default); any other value is a UsageError, "NAME: 'value' " and then `refusal` (what to
// use instead). DP_CUDA_CONV, DP_CUDA_STREAMS and DP_CUDA_PDL, each read once per process.
int env_choice(const char* name, std::initializer_list<const char*> choices, const char* refusal);
}  // namespace cuda

class CudaOps final : public Ops {
 public:
  // Device memory the ops keep between calls: all_finite's answer, and softmax_xent's and
  // sum_squares' per-block partial sums with the count of blocks done (the last block adds them up in
  // block order), and that count for the fused conv's db. A count serves one grid at a time: each of
  // these kernels runs on the compute stream alone, never on the side lane.
  static constexpr int kBiasSlices = 32;     // a convolution's db: partial sums per channel (conv2d.cu)
  static constexpr int kReduceBlocks = 128;  // softmax_xent's and sum_squares' grids at most; their blocks loop
  struct Scratch {
    int32_t flag;
    uint32_t xent_done;
    float xent_partials[2 * kReduceBlocks];  // (block, loss | correct)
    uint32_t squares_done;                   // sum_squares likewise
    float squares_partials[kReduceBlocks];
    uint32_t bias_done;  // the fused conv's backward, its db's blocks (conv_act_pool.cu)
  };
  // Where kernels and GEMMs are enqueued: a stream and a cuBLAS handle bound to it; Lane{} is none.
  struct Lane {
    cudaStream_t stream;
    cublasHandle_t cublas;
  };
  // The handles belong to the device and are already bound to `stream`. scratch: device memory the
  // caller allocated (and booked), zeroed here on the stream. side: a second lane, or none (a null
  // stream): see streams_wanted.
  CudaOps(cudaStream_t stream, cublasHandle_t cublas, cudnnHandle_t cudnn, Scratch* scratch, Lane side = {});
  ~CudaOps() override;
  const char* backend() const override { return "cuda"; }
  cudaStream_t stream() const { return stream_; }
  // DP_CUDA_STREAMS (read once): 1, the default, or 2; any other value is a UsageError, from the
  // device's start (CudaDevice::open). With 2 the device gives its ops a side lane, and the backward
  // pass of a linear layer (but one of few outputs: one kernel, linear.cu, fuse_wanted) and of a
  // convolution on the im2col path computes dw and db there while dx is computed on the stream: the two
  // need nothing of each other but dy. Each op joins the lanes before it returns, so the ops stay in
  // stream order. The same kernels on the same data: the same bits. Not the default: compiled, not yet
  // run on a GPU (docs/gpu.md).
  static int streams_wanted();
  bool two_lanes() const { return side_.stream != stream_; }
  // DP_CUDA_FUSE (read once): 1, the default, runs as one kernel each the passes dp fuses so: the
  // forward pass of a first convolution of few taps with its activation and pooling (direct_act_pool)
  // and its dw and db (direct_act_pool_filter_grad), dy's rows with db (a convolution on the im2col
  // path, conv_act_pool.cu), and a linear layer of few outputs each way (linear.cu); 0 runs them on the
  // kernels each did before (the same bits, but the few-outputs forward: within the GEMM's bound), so
  // that what fusing gains is measured in one run (scripts/gpu_speed_steps.sh's fuse step) and a wrong
  // fused kernel can be told apart. Any other value is a UsageError, from the constructor.
  static bool fuse_wanted();

  void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override;
  size_t conv2d_workspace_floats(const ConvShape& s) override;
  void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                      float* workspace) override;
  void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db, float* workspace) override;
  void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool, float* workspace) override;
  void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                float* db, float* workspace) override;
  void avgpool_forward(const PoolShape& s, const float* x, float* y) override;
  void avgpool_backward(const PoolShape& s, const float* dy, float* dx) override;
  void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) override;
  void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) override;
  void activation_forward(Activation a, int64_t n, const float* x, float* y) override;
  void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) override;
  void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) override;
  void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx, float* dw,
                       float* db) override;
  void bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) override;
  void bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var, const float* gamma,
                    const float* beta, float eps, float* y) override;
  void bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                        const float* dy, float* sums) override;
  void bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                      const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) override;
  void bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum, float* running_mean,
                         float* running_var) override;
  void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                    float* stats) override;
  void sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) override;
  void adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                 float* nonfinite) override;
  void add(int64_t n, const float* x, float* y) override;
  void fill(int64_t n, float value, float* x) override;
  void narrow(DType t, int64_t n, const float* x, void* y) override;
  void widen(DType t, int64_t n, const void* x, float* y) override;
  void add_typed(DType t, int64_t n, const void* x, void* y) override;
  bool all_finite(int64_t n, const float* x) override;
  void sum_squares(int64_t n, const float* x, float* sum) override;
  void clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) override;

  // The algorithms of every convolution plan made so far, three per shape (forward, backward-data,
  // backward-filter), in shape order. A shape whose choice fell back also got one warning on stderr.
  std::vector<ConvChoice> conv_choices() const;

 private:
  using ShapeKey = std::array<int, 8>;     // n, c, h, w, k, kh, kw, pad
  using GeometryKey = std::array<int, 7>;  // the same without n
  // The plan for s, made on first use, or again when its workspace exceeds the smallest one
  // conv2d_workspace_floats has handed out for s's geometry (see conv2d.cu).
  ConvPlan& plan(const ConvShape& s);
  // Every choice within limit_bytes (at most 64 MiB), the workspace within capacity_bytes (conv_plan.cpp).
  ConvPlan& make_plan(const ConvShape& s, size_t limit_bytes, size_t capacity_bytes);
  static void plan_own(ConvPlan& p, const ConvShape& s, size_t limit);  // direct or implicit, where they fit
  // Shapes with at most kDirectTaps taps per output (C KH KW) and kDirectWeights weights (the forward
  // pass keeps them in shared memory; their partials, below, stay within 35 MB) run their forward pass
  // and their dw and db on conv_direct.cu's kernels, dw and db through kDirectSlices partials per channel
  // (256 took lenet's conv1 from 42.5 to 47.7 us on an H200: more blocks, no faster).
 public:
  static constexpr int kDirectTaps = 32, kDirectWeights = 4096, kDirectSlices = 64;

 private:
  static bool direct(const ConvShape& s);
  static size_t direct_partial_floats(const ConvShape& s);
  void direct_forward(const ConvShape& s, const float* x, const float* w, float* y);
  void direct_filter_grad(const ConvShape& s, const float* x, const float* dy, bool rows, float* dw, float* db,
                          float* workspace);
  // The fused op's forward pass in one kernel (conv_direct.cu, direct_taps.h's forward_window) for a
  // shape of at most 16 taps whose output 2 x 2 windows tile (direct_act_pool; lenet's conv1), where its
  // plan is direct: the convolution's output is neither written nor read back.
  static bool direct_act_pool(const ConvShape& s, int window);
  void direct_act_pool_forward(const ConvShape& s, Activation a, const float* x, const float* w, const float* b,
                               float* y_act, float* y_pool);
  // The fused op's dw and db (conv_act_pool.cu) where it wants no dx: dy worked out from dy_pool and
  // y_act inside the weight gradient's kernel (direct_taps.h's DyActPool), not written as rows first.
  void direct_act_pool_filter_grad(const ConvShape& s, Activation a, int window, const float* x, const float* y_act,
                                   const float* dy_pool, float* dw, float* db, float* workspace);
  // Other shapes, under DP_CUDA_CONV=implicit (read once; a value other than that or "library" is a
  // UsageError, from the constructor), run their forward pass, their dw and db (through
  // implicit_slices partials) and, where implicit_dx, their dx as implicit GEMMs (conv_implicit.cu,
  // kernels/cuda/tile_gemm.h): not the default, slower on an H200 (650 us of kernels a step against 413, 2026-11-28).
 public:
  static bool implicit_wanted();
  // The kernels themselves, whatever DP_CUDA_CONV says, for the test that holds them to the bits of
  // the host's emulation of their blocks (tests/test_tile_gemm.cpp). dw is summed in `slices` partials
  // (implicit_slices(s) where the workspace holds them; any number from 1 gives the same bits on the GPU
  // as the emulation with as many); workspace: implicit_partial_floats(s, slices).
  static int implicit_slices(const ConvShape& s);
  static size_t implicit_partial_floats(const ConvShape& s, int slices);
  void implicit_forward(const ConvShape& s, const float* x, const float* w, float* y);
  void implicit_filter_grad(const ConvShape& s, int slices, const float* x, const float* dy, bool rows, float* dw,
                            float* db, float* workspace);
  // dx, for square kernels padded by less than their size (implicit_dx); workspace: K C KH KW floats.
  void implicit_data_grad(const ConvShape& s, const float* w, const float* dy, bool rows, float* dx, float* workspace);

 private:
  static constexpr int kImplicitSlices = 64;
  static bool implicit(const ConvShape& s);
  static bool implicit_dx(const ConvShape& s);
  // y = x * w without the bias, on cuDNN, directly or as an implicit GEMM (conv2d.cu).
  void convolve(const ConvShape& s, const float* x, const float* w, float* y, float* workspace);
  // conv2d_backward from dy (N, K, OH, OW), or with `rows` from dy's rows dyt (K, N OH OW), as the
  // fused op writes them (conv2d.cu).
  void conv_backward(const ConvShape& s, const float* x, const float* w, const float* dy, bool rows, float* dx,
                     float* dw, float* db, float* workspace);
  // gemm on a lane; gemm_ld with A's and B's stored row lengths given (a block of a wider matrix), C (m, n) dense.
  void gemm(const Lane& on, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b,
            float beta, float* c);
  void gemm_ld(const Lane& on, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c);
  Lane main() const { return {stream_, cublas_}; }
  // The side lane waits for the stream's work so far (fork), the stream for the side lane's (join);
  // neither does anything without a side lane, whose work is then the stream's, in order.
  void fork();
  void join();
  // fork() where `on`, and join() on every way out of the scope: an error's too, so that what the
  // stream frees after it is ordered after the side lane's work, and a capture ends joined. join()
  // on the way out without an error, so that its own errors are thrown.
  class Forked {
   public:
    Forked(CudaOps& ops, bool on) : ops_(on ? &ops : nullptr) {
      if (ops_) ops_->fork();
    }
    Forked(const Forked&) = delete;
    Forked& operator=(const Forked&) = delete;
    ~Forked();
    void join();

   private:
    CudaOps* ops_;
  };

  cudaStream_t stream_;
  cublasHandle_t cublas_;
  cudnnHandle_t cudnn_;
  Lane side_;                    // {stream_, cublas_} without a second lane
  cuda::Event forked_, joined_;  // fork's and join's, with a second lane
  mutable std::mutex conv_mu_;
  std::map<ShapeKey, std::unique_ptr<ConvPlan>> plans_;
  struct Budget {
    size_t floats, lane_floats;  // the smallest workspace handed out, and the smallest one lane would need
  };
  std::map<GeometryKey, Budget> budgets_;
  Scratch* scratch_;
  int32_t* flag_;  // &scratch_->flag: all_finite's answer
};

}  // namespace dp
