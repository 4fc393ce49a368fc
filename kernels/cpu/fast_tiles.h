// The register-tile machinery of the fast convolution (kernels/cpu/fast.h): a tile kernel K computes
// R rows x C columns of vector accumulators (R output or input channels; C output positions, taps or
// vectors along a row) with R and C compile-time constants, so the accumulators live in registers.
// This header picks R among the vector type's four row options (S::kRows etc.) and returns the
// instantiation for the columns at hand. The kernels themselves are in fast_blocked.h and
// fast_direct.h. Everything is a template on the vector type S or on a kernel that depends on it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "kernels/ops.h"

// Fully unrolls the loop that follows. Every loop over a tile's rows and columns has a constant trip
// count (tails break out) and is unrolled, so the accumulators stay in registers: a loop the compiler
// leaves rolled indexes the array at run time and puts it on the stack, 2-3x slower (measured on the
// 10-row direct tile).
#define DP_UNROLL _Pragma("GCC unroll 32")

namespace dp::cpu::fast {

// A convolution's dimensions as the tile kernels index them (stride 1). In the blocked layout HP, WP
// are the padded input's; the direct way's rows are described by its DirectImages instead.
struct Dims {
  int c, hp, wp;  // input channels, padded height and width
  int kh, kw, k;  // kernel, output channels
  int ow, p;      // output width, output positions OH * OW
  int taps;       // C * KH * KW
};

template <class S>  // S unused: see fill_zero
Dims dims_of(const ConvShape& s) {
  return {.c = s.c,
          .hp = s.h + 2 * s.pad,
          .wp = s.w + 2 * s.pad,
          .kh = s.kh,
          .kw = s.kw,
          .k = s.k,
          .ow = s.out_w(),
          .p = int(s.col_cols()),
          .taps = int(s.col_rows())};
}

// std::fill_n and std::copy_n for floats, as templates on S: a std:: instantiation would be shared (one
// copy kept by the linker) with the code compiled without this unit's instruction set.
template <class S>
inline void fill_zero(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
}
template <class S>
inline void copy_floats(const float* from, int64_t n, float* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = from[i];
}

// dw[k0 + r][t0 + t] += the lanes' sum of acc[r][t], for r < rv; dw is (K, taps). Four taps at a
// time where S has add_hsums4 (the same bits as hsum); AVX-512 has not: with it the compiler put one
// of the 5x5 weight-gradient tile's accumulators on the stack, 3-6% slower. (Reducing L accumulators
// at a time with a shuffle tree takes a third of the operations, but copying the tile into it made
// the compiler put the accumulators on the stack: 2x slower, measured.)
template <class S, int R, int C>
__attribute__((always_inline)) inline void add_sums(const Dims& d, typename S::V (&acc)[R][C], int k0, int t0, int rv,
                                                    float* dw) {
  DP_UNROLL for (int r = 0; r < R; ++r) {
    if (r >= rv) break;
    float* row = dw + int64_t(k0 + r) * d.taps + t0;
    constexpr bool has4 = requires(float* p, typename S::V v) { S::add_hsums4(p, v, v, v, v); };
    constexpr int grouped = has4 ? C / 4 * 4 : 0;
    if constexpr (has4) {
      DP_UNROLL for (int t = 0; t < grouped; t += 4) {
        S::add_hsums4(row + t, acc[r][t], acc[r][t + 1], acc[r][t + 2], acc[r][t + 3]);
      }
    }
    DP_UNROLL for (int t = grouped; t < C; ++t) row[t] += S::hsum(acc[r][t]);
  }
}

// A tile kernel K has `using Args`, the row and column options kRows, kCols, and
// `template <int R, int C> static void run(const Args&, int row0, int col0)`.
template <class K>
using TileFn = void (*)(const typename K::Args&, int, int);

template <class K, int R, int... C>
constexpr std::array<TileFn<K>, sizeof...(C)> tile_table(std::integer_sequence<int, C...>) {
  return {&K::template run<R, C + 1>...};
}

template <class K, int I>
TileFn<K> tile_i(int cols) {
  static constexpr auto table = tile_table<K, K::kRows[I]>(std::make_integer_sequence<int, K::kCols[I]>());
  return table[size_t(cols - 1)];
}

// Kernel K's tile for row option `option` (an index into K::kRows) and 1..K::kCols[option] columns.
template <class K>
TileFn<K> tile(int option, int cols) {
  switch (option) {
    case 0:
      return tile_i<K, 0>(cols);
    case 1:
      return tile_i<K, 1>(cols);
    case 2:
      return tile_i<K, 2>(cols);
    default:
      return tile_i<K, 3>(cols);
  }
}

// The row option of kernel K for `count` rows (output or input channels) among those with at least
// `cols` columns: the least padding, then the larger tile; padding of at most 1/K::kPaddingShare of
// the rows (0: none) counts as none, where more accumulators pay more than the padded rows cost. -1 if
// none has the columns.
template <class K>
int pick_rows(int count, int cols = 1) {
  int best = -1, best_waste = 1 << 30, best_area = 0;
  for (int i = 0; i < 4; ++i) {
    if (K::kCols[i] < cols) continue;
    const int r = K::kRows[i], padding = (count + r - 1) / r * r - count, area = r * K::kCols[i];
    const int waste = K::kPaddingShare > 0 && padding * K::kPaddingShare <= count ? 0 : padding;
    if (waste < best_waste || (waste == best_waste && area > best_area)) best = i, best_waste = waste, best_area = area;
  }
  return best;
}

// wk (K / R, taps, R) from w (K, taps), R = rows; rows past K zero. The forward tiles' weights.
template <class S>
void pack_forward_weights(const float* w, int k, int taps, int rows, float* wk) {
  for (int k0 = 0; k0 < k; k0 += rows)
    for (int t = 0; t < taps; ++t)
      for (int r = 0; r < rows; ++r)
        wk[int64_t(k0) * taps + int64_t(t) * rows + r] = k0 + r < k ? w[int64_t(k0 + r) * taps + t] : 0.0f;
}

// Runs kernel K over rows [0, rows) x columns [0, cols) in tiles of K::kRows[option] x K::kCols[option],
// row blocks outer unless K says `kColsOuter = true` (then a column block's inputs stay in L1 while
// every row block runs over them).
template <class K>
void tiles(const typename K::Args& a, int option, int rows, int cols) {
  const int R = K::kRows[option], C = K::kCols[option];
  bool cols_outer = false;
  if constexpr (requires { K::kColsOuter; }) cols_outer = K::kColsOuter;
  if (cols_outer) {
    for (int c0 = 0; c0 < cols; c0 += C) {
      const TileFn<K> fn = tile<K>(option, std::min(C, cols - c0));
      for (int r0 = 0; r0 < rows; r0 += R) fn(a, r0, c0);
    }
    return;
  }
  for (int r0 = 0; r0 < rows; r0 += R)
    for (int c0 = 0; c0 < cols; c0 += C) tile<K>(option, std::min(C, cols - c0))(a, r0, c0);
}

}  // namespace dp::cpu::fast
