// The plans of the convolutions (kernels/cuda/conv2d.cu runs them): which algorithm each pass takes
// for a shape, and the workspace it needs. Shapes of few taps take conv_direct.cu's kernels, and under
// DP_CUDA_CONV=implicit the others conv_implicit.cu's implicit GEMMs; else the forward pass is cuDNN's
// and the backward pass dp's own im2col and cuBLAS GEMMs.
//
// cuDNN 9 still ships the legacy convolution API (cudnn_cnn.h: cudnnConvolutionForward, the *_v7
// heuristics), marked deprecated but only warned about under CUDNN_WARN_DEPRECATED; it is the short
// path for a few fixed convolutions.
//
// cuDNN's forward algorithm is chosen once per shape from cuDNN's heuristics (the *_v7 queries, which run nothing
// and allocate nothing, unlike cudnnFind*, which times candidates in memory of its own and may pick
// differently from run to run). Among the candidates, in cuDNN's order of preference, the first is
// taken that
//   - is deterministic (the same bits every run: the golden trajectories depend on it),
//   - is a GEMM-like summation (not FFT or Winograd), so every output is a plain sum of products
//     whose error the tests bound element by element (tests/test_ops_conv.cpp),
//   - runs in FP32 FMA math, never TF32 tensor cores (CUDNN_FMA_MATH on the descriptor), which
//     would round the inputs to 10 mantissa bits,
//   - needs no more workspace than allowed.
// Only when none qualifies is the first supported candidate of any kind taken: FFT, Winograd or a
// non-deterministic algorithm, whose results may leave the tests' bounds and differ from run to run
// (a resume is then no longer bit-exact). That fallback is never silent: every choice is kept
// (CudaOps::conv_choices) and a shape that needed one gets a warning on stderr, once per process.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"

namespace dp {
namespace {

// Largest workspace one algorithm may ask for when the caller is about to allocate it. Two lanes'
// backward pass keeps a second column matrix on top (plan_backward), not a larger limit: every choice,
// and the images a chunk takes, are then one lane's, so the same sums in the same order. A plan made
// again within a smaller workspace (CudaOps::plan) likewise takes one lane's limit, kept beside it.
constexpr size_t kMaxWorkspaceBytes = size_t(64) << 20;

std::string describe(const ConvShape& s) {
  return "conv (N " + std::to_string(s.n) + ", C " + std::to_string(s.c) + ", H " + std::to_string(s.h) + ", W " +
         std::to_string(s.w) + ") * (K " + std::to_string(s.k) + ", " + std::to_string(s.kh) + "x" +
         std::to_string(s.kw) + ", pad " + std::to_string(s.pad) + ")";
}

bool is_tensor_op(cudnnMathType_t m) { return m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION; }

bool gemm_like(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT;
}
// cuDNN's enum names less "CUDNN_CONVOLUTION_" (and less "FWD_ALGO_" for the forward ones, whose
// names say what they are), as ConvChoice reports them.
const char* algo_name(cudnnConvolutionFwdAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM:
      return "IMPLICIT_GEMM";
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM:
      return "IMPLICIT_PRECOMP_GEMM";
    case CUDNN_CONVOLUTION_FWD_ALGO_GEMM:
      return "GEMM";
    case CUDNN_CONVOLUTION_FWD_ALGO_DIRECT:
      return "DIRECT";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
      return "FFT";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      return "FFT_TILING";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
      return "WINOGRAD";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
      return "WINOGRAD_NONFUSED";
    default:
      return "FWD_ALGO_?";
  }
}
const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH:
      return "DEFAULT";
    case CUDNN_TENSOR_OP_MATH:
      return "TENSOR_OP";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "TENSOR_OP_ALLOW_CONVERSION";
    case CUDNN_FMA_MATH:
      return "FMA";
    default:
      return "?";
  }
}

// The first acceptable candidate (see the top of the file), described for conv_choices; false when
// none is. `bytes_of` asks cuDNN for an algorithm's workspace and returns false when cuDNN does not
// support it for this shape.
template <class Perf, class Algo, class BytesOf>
bool choose(const std::vector<Perf>& perf, int returned, size_t limit, BytesOf bytes_of, Algo& algo, size_t& bytes,
            ConvChoice& chosen) {
  for (int strict = 1; strict >= 0; --strict) {
    for (int i = 0; i < returned; ++i) {
      const Perf& p = perf[size_t(i)];
      if (p.status != CUDNN_STATUS_SUCCESS || is_tensor_op(p.mathType)) continue;
      if (strict && (p.determinism != CUDNN_DETERMINISTIC || !gemm_like(p.algo))) continue;
      size_t need = 0;
      if (!bytes_of(p.algo, need) || need > limit) continue;
      algo = p.algo;
      bytes = need;
      chosen.algo = algo_name(p.algo);
      chosen.math = math_name(p.mathType);
      chosen.workspace_bytes = need;
      chosen.deterministic = p.determinism == CUDNN_DETERMINISTIC;
      chosen.strict = strict == 1;
      return true;
    }
  }
  return false;
}

// One line on stderr for a plan that fell back in any pass, once per shape in this process (devices
// share shapes; a shape planned again for a smaller workspace is not reported twice).
void warn_fallback(const ConvPlan& p, const std::string& shape) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::string passes;
  for (const ConvChoice& c : p.choices)
    if (!c.strict)
      passes += (passes.empty() ? "" : ", ") + c.pass + " uses " + c.algo + " (" +
                (c.deterministic ? "deterministic" : "non-deterministic") + ", " + c.math + ")";
  if (passes.empty()) return;
  std::lock_guard lock(mu);
  if (!warned.insert(shape).second) return;
  std::fprintf(stderr,
               "dp: warning: %s: no deterministic GEMM-like cuDNN algorithm within the workspace, so %s; its "
               "results may not be bit-repeatable from run to run\n",
               shape.c_str(), passes.c_str());
}

DeviceError no_fit(const char* pass, const ConvShape& s, size_t limit) {
  return DeviceError(cuda::current_device(), std::string("no ") + pass + " for " + describe(s) +
                                                 " fits a workspace of " + std::to_string(limit) +
                                                 " bytes (conv2d_workspace_floats sizes the workspace)");
}

// A pass on dp's own kernels: FP32 FMA math (cuBLAS's default too, never TF32: cuda_device.cpp),
// the same bits every run.
void choose_own(ConvChoice& c, const char* algo, size_t workspace_bytes) {
  c.algo = algo;
  c.math = "FMA";
  c.workspace_bytes = workspace_bytes;
  c.deterministic = c.strict = true;
}

// The im2col path's chunk of one image: dy's rows and the im2col.
size_t image_floats(const ConvShape& s) {
  return size_t(s.out_h()) * size_t(s.out_w()) * (size_t(s.col_rows()) + size_t(s.k));
}
size_t weight_bytes(const ConvShape& s) { return sizeof(float) * size_t(s.k) * size_t(s.col_rows()); }

// The backward pass's choices once the forward's are made. dx is an implicit GEMM where the plan's
// dw is one, the shape allows it (`implicit_dx`, CudaOps::implicit_dx) and the flipped weights fit:
// then the workspace holds those and dw's partials, nothing more. Otherwise dx, and dw where the plan
// has no kernel of its own for it, are dp's im2col path (see conv_backward), over as many images at
// a time as the limit holds past the partials and 32-bit indices reach: per image, dy's rows and the
// im2col. With two lanes (CudaOps::streams_wanted) dx's transpose of it lies beside, as both lanes use
// them at once: as many images as one lane's limit gives (the same chunks, so dw's sums in the same
// order), their second matrix within `capacity`, all the workspace may hold. (A batch larger than the
// workspace was sized for, whose forward pass needs the most, may find room for fewer: other chunks.)
void plan_backward(ConvPlan& p, const ConvShape& s, size_t limit, size_t capacity, bool implicit_dx, bool two_lanes) {
  p.implicit_dx = p.implicit && implicit_dx && weight_bytes(s) <= limit;
  if (p.implicit_dx) return choose_own(p.choices[1], "DP_IMPLICIT_GEMM", weight_bytes(s));
  p.side_dw = two_lanes && !p.direct && !p.implicit;  // the im2col path's dw: conv_backward
  const size_t pixels = size_t(s.out_h()) * s.out_w(), crs = size_t(s.col_rows());
  const size_t image = image_floats(s), lanes_floats = image + (p.side_dw ? pixels * crs : 0);
  const size_t index_cap = size_t(INT32_MAX) / std::max(image, size_t(s.c) * s.h * s.w);
  const size_t partial_bytes = p.bias_floats * sizeof(float), image_bytes = image * sizeof(float);
  const size_t lanes_bytes = lanes_floats * sizeof(float);
  if (partial_bytes + lanes_bytes > capacity || partial_bytes + image_bytes > limit || index_cap == 0)
    throw no_fit("chunk of the backward pass (the partials, an image's rows and im2col)", s,
                 partial_bytes + lanes_bytes > capacity ? capacity : limit);
  p.backward_images = int(std::min(
      {size_t(s.n), (limit - partial_bytes) / image_bytes, (capacity - partial_bytes) / lanes_bytes, index_cap}));
  p.bwd_data_bytes = p.bwd_filter_bytes = partial_bytes + lanes_bytes * size_t(p.backward_images);
  p.side_bytes = (lanes_bytes - image_bytes) * size_t(p.backward_images);
  choose_own(p.choices[1], "DP_IM2COL_GEMM", p.bwd_filter_bytes);
  if (!p.direct && !p.implicit) choose_own(p.choices[2], "DP_IM2COL_GEMM", p.bwd_filter_bytes);
}

}  // namespace

// The forward algorithm and the backward pass use the workspace one after the other on the stream. The
// backward pass's bytes count its partials, but for an implicit dx's (its flipped weights' bytes alone).
size_t ConvPlan::workspace_floats() const { return floats_less(0); }
size_t ConvPlan::lane_floats() const { return floats_less(side_bytes); }
size_t ConvPlan::floats_less(size_t side) const {
  size_t most = std::max({fwd_bytes, bwd_data_bytes - side, bwd_filter_bytes - side});
  return std::max((most + sizeof(float) - 1) / sizeof(float), bias_floats);
}

// dp's own kernels where their partials fit, and beside them the chunk of an image dx's im2col path
// needs (plan_backward; an implicit dx needs none: its flipped weights take the partials' place): the
// im2col path's partials are fewer, so it may fit where they do not. Implicit GEMMs take as many of
// the slices wanted as fit (a larger batch than the workspace was sized for may have fewer). Both
// (conv_direct.cu, conv_implicit.cu) run the forward pass and dw without cuDNN.
void CudaOps::plan_own(ConvPlan& p, const ConvShape& s, size_t limit) {
  const size_t image_bytes = image_floats(s) * sizeof(float);
  p.direct = direct(s) && direct_partial_floats(s) * sizeof(float) + image_bytes <= limit;
  if (!p.direct && implicit(s)) {
    const size_t beside = implicit_dx(s) && weight_bytes(s) <= limit ? 0 : image_bytes;
    const size_t fit = limit > beside ? (limit - beside) / (implicit_partial_floats(s, 1) * sizeof(float)) : 0;
    p.slices = int(std::min(size_t(implicit_slices(s)), fit));
    p.implicit = p.slices > 0;
  }
  if (!p.direct && !p.implicit) return;
  p.bias_floats = p.direct ? direct_partial_floats(s) : implicit_partial_floats(s, p.slices);
  const char* algo = p.direct ? "DP_DIRECT" : "DP_IMPLICIT_GEMM";
  choose_own(p.choices[0], algo, 0);
  choose_own(p.choices[2], algo, p.bias_floats * sizeof(float));
}

// `capacity`: the bytes the plan's workspace may take in all (SIZE_MAX when it is being sized);
// `limit`, one lane's: every algorithm and chunk within it, and within kMaxWorkspaceBytes.
ConvPlan& CudaOps::make_plan(const ConvShape& s, size_t limit_bytes, size_t capacity) {
  const size_t limit = std::min({kMaxWorkspaceBytes, limit_bytes, capacity});
  auto p = std::make_unique<ConvPlan>();
  const int oh = s.out_h(), ow = s.out_w();
  p->x = cuda::make_tensor_desc(s.n, s.c, s.h, s.w);
  p->y = cuda::make_tensor_desc(s.n, s.k, oh, ow);
  p->w = cuda::make_filter_desc(s.k, s.c, s.kh, s.kw);
  cudnnConvolutionDescriptor_t cd = nullptr;
  DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&cd));
  p->conv = cuda::ConvDesc(cd);
  DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(cd, s.pad, s.pad, /*stride*/ 1, 1, /*dilation*/ 1, 1,
                                                 CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH));

  int dims[4] = {0, 0, 0, 0};
  DP_CUDNN_CHECK(
      cudnnGetConvolution2dForwardOutputDim(cd, p->x.get(), p->w.get(), &dims[0], &dims[1], &dims[2], &dims[3]));
  if (dims[0] != s.n || dims[1] != s.k || dims[2] != oh || dims[3] != ow)
    throw DeviceError(cuda::current_device(), "cuDNN disagrees about the output shape of " + describe(s));

  int max_count = 0, got = 0;
  p->bias_floats = size_t(s.k) * kBiasSlices;
  const char* passes[3] = {"forward", "backward-data", "backward-filter"};
  for (size_t i = 0; i < 3; ++i) {
    p->choices[i].shape = s;
    p->choices[i].pass = passes[i];
  }

  plan_own(*p, s, limit);
  if (!p->direct && !p->implicit) {
    DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(cudnn_, &max_count));
    std::vector<cudnnConvolutionFwdAlgoPerf_t> fwd(size_t(std::max(max_count, 1)));
    DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(cudnn_, p->x.get(), p->w.get(), cd, p->y.get(), max_count,
                                                          &got, fwd.data()));
    auto fwd_bytes = [&](cudnnConvolutionFwdAlgo_t a, size_t& b) {
      return cudnnGetConvolutionForwardWorkspaceSize(cudnn_, p->x.get(), p->w.get(), cd, p->y.get(), a, &b) ==
             CUDNN_STATUS_SUCCESS;
    };
    if (!choose(fwd, got, limit, fwd_bytes, p->fwd, p->fwd_bytes, p->choices[0]))
      throw no_fit("cuDNN forward algorithm", s, limit);
  }

  plan_backward(*p, s, limit, capacity, implicit_dx(s), two_lanes());
  warn_fallback(*p, describe(s));

  auto& slot = plans_[ShapeKey{s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad}];
  slot = std::move(p);
  return *slot;
}

// Every caller has allocated at least the smallest workspace handed out for this geometry (the
// engine asks with its largest batch and runs smaller ones; another network on the same device may
// have asked with a different batch). A plan whose algorithms need more than that is made again
// within it, so no execution can overrun any caller's workspace; its choices within what one lane's
// workspace would have been (the same choices with two lanes as with one).
ConvPlan& CudaOps::plan(const ConvShape& s) {
  std::lock_guard lock(conv_mu_);
  auto b = budgets_.find(GeometryKey{s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad});
  if (b == budgets_.end())  // a workspace of unknown size: it may not even hold db's partials
    throw DeviceError(cuda::current_device(), describe(s) + " runs, but conv2d_workspace_floats was never asked " +
                                                  "about its geometry, at any batch size");
  const Budget budget = b->second;
  auto it = plans_.find(ShapeKey{s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad});
  if (it != plans_.end() && it->second->workspace_floats() <= budget.floats &&
      it->second->lane_floats() <= budget.lane_floats)
    return *it->second;
  return make_plan(s, budget.lane_floats * sizeof(float), budget.floats * sizeof(float));
}

size_t CudaOps::conv2d_workspace_floats(const ConvShape& s) {
  if (s.n == 0) return 0;
  std::lock_guard lock(conv_mu_);
  auto it = plans_.find(ShapeKey{s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad});
  const ConvPlan& p =
      it != plans_.end() ? *it->second : make_plan(s, kMaxWorkspaceBytes, std::numeric_limits<size_t>::max());
  const Budget asked{p.workspace_floats(), p.lane_floats()};
  auto [b, fresh] = budgets_.try_emplace(GeometryKey{s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad}, asked);
  if (!fresh)
    b->second = {std::min(b->second.floats, asked.floats), std::min(b->second.lane_floats, asked.lane_floats)};
  return asked.floats;
}

std::vector<ConvChoice> CudaOps::conv_choices() const {
  std::lock_guard lock(conv_mu_);
  std::vector<ConvChoice> out;
  for (const auto& [key, plan] : plans_) out.insert(out.end(), plan->choices.begin(), plan->choices.end());
  return out;
}

}  // namespace dp
