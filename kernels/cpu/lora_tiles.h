// The register-level loops of the CPU LoRA (lora.cpp): the shrink h = x @ A^T and the expand out += h @ B^T for a
// few tokens at a time, A and B widened to fp32 on load (fp16 adapters beside an fp32 model), sums in fp32 and the
// results rounded to the activations' dtype as in the reference.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace lora_tiles {

constexpr int64_t kMaxWidth = 2048;           // output columns per expand item at most: its sums stay in L1
constexpr int kRowBlock = 4;                  // adapter rows per pass over them
constexpr int kTileTokens = 6;                // expand_tiled's tiles: 6 tokens x 16 columns, the sums in registers

template <typename T>
void accumulate(T* out, float sum) {                            // rounded to T as in the reference: out + T(sum)
  *out = static_cast<T>(static_cast<float>(*out) + static_cast<float>(static_cast<T>(sum)));
}

template <typename T>
void accumulate8(T* out, vec::vec8 sums) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<vec::vec8*>(out) += sums;
  } else {
    alignas(32) float values[8];
    *reinterpret_cast<vec::vec8*>(values) = sums;
    for (int i = 0; i < 8; ++i) accumulate(out + i, values[i]);
  }
}

// h_i[j] = x_i . A[j] for N tokens i (x_stride, h_stride apart) and j < rank: 8 / N rows at a time, so eight sums
// run side by side, each block prefetching the next one (after the last, `next`: the rows read after these); the
// columns past the last multiple of 8 in scalar code.
template <int N, typename T, typename W>
void shrink_tokens(const T* x, int64_t x_stride, const W* a, int64_t a_row_stride, int64_t in_dim, int64_t rank,
                   float* h, int64_t h_stride, const W* next) {
  constexpr int kRows = 8 / N;
  const int64_t vec_dim = in_dim / 8 * 8;
  auto tail = [&](const T* xi, const W* row) {
    float sum = 0.f;
    for (int64_t k = vec_dim; k < in_dim; ++k) sum += static_cast<float>(xi[k]) * static_cast<float>(row[k]);
    return sum;
  };
  int64_t j = 0;
  for (; j + kRows <= rank; j += kRows) {
    const W* ahead = j + kRows < rank ? a + (j + kRows) * a_row_stride : next;
    const vec::vec8 sums = vec::dot_tile<N>(x, x_stride, a + j * a_row_stride, a_row_stride, vec_dim, ahead);
    for (int i = 0; i < N; ++i)
      for (int r = 0; r < kRows; ++r)
        h[i * h_stride + j + r] = sums[i * kRows + r] + tail(x + i * x_stride, a + (j + r) * a_row_stride);
  }
  for (; j < rank; ++j)
    for (int i = 0; i < N; ++i)
      h[i * h_stride + j] = vec::dot1(x + i * x_stride, a + j * a_row_stride, vec_dim) +
                            tail(x + i * x_stride, a + j * a_row_stride);
}

// sums_i[o] += sum_r h_i[r] * rows[r][o] for N tokens i, R rows r and the columns o < width: the rows read along
// their contiguous columns, the R products of a column summed in registers before one read-modify-write of sums;
// meanwhile the R rows at `next` (row_stride apart, read after these) are pulled into the cache.
template <int N, int R, typename W>
void expand_rows(const float* h, int64_t h_stride, const W* rows, int64_t row_stride, int64_t width, const W* next,
                 float (*sums)[kMaxWidth]) {
  float hr[N][R];
  for (int i = 0; i < N; ++i)
    for (int r = 0; r < R; ++r) hr[i][r] = h[i * h_stride + r];
  const int64_t vec_width = width / 8 * 8;
  constexpr int64_t kLineValues = vec::kLineBytes / sizeof(W);
  for (int64_t c = 0; c < vec_width; c += 8) {
    if (next && c % kLineValues == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(next + r * row_stride + c);
    vec::vec8 w[R];
    for (int r = 0; r < R; ++r) w[r] = vec::load8(rows + r * row_stride + c);
    for (int i = 0; i < N; ++i) {
      vec::vec8 sum = *reinterpret_cast<const vec::vec8*>(sums[i] + c);
      for (int r = 0; r < R; ++r) sum += hr[i][r] * w[r];
      *reinterpret_cast<vec::vec8*>(sums[i] + c) = sum;
    }
  }
  for (int64_t o = vec_width; o < width; ++o)
    for (int i = 0; i < N; ++i)
      for (int r = 0; r < R; ++r) sums[i][o] += hr[i][r] * static_cast<float>(rows[r * row_stride + o]);
}

// out_i[o] += h_i @ B^T[:rank, o] for N tokens i and the columns o < width (<= kMaxWidth) of one chunk: the rank
// rows kRowBlock at a time (`next`: the rows read after them), the sums in an fp32 row per token (in L1), added to
// out at the end.
template <int N, typename T, typename W>
void expand_tokens(const float* h, int64_t h_stride, const W* b, int64_t b_row_stride, int64_t rank, int64_t width,
                   T* out, int64_t out_stride, const W* next) {
  alignas(32) float sums[N][kMaxWidth];
  for (int i = 0; i < N; ++i) std::fill(sums[i], sums[i] + width, 0.f);
  int64_t j = 0;
  for (; j + kRowBlock <= rank; j += kRowBlock)
    expand_rows<N, kRowBlock>(h + j, h_stride, b + j * b_row_stride, b_row_stride, width,
                              j + kRowBlock < rank ? b + (j + kRowBlock) * b_row_stride : next, sums);
  for (; j < rank; ++j)
    expand_rows<N, 1>(h + j, h_stride, b + j * b_row_stride, b_row_stride, width,
                      j + 1 < rank ? b + (j + 1) * b_row_stride : next, sums);
  for (int i = 0; i < N; ++i)
    for (int64_t o = 0; o < width; ++o) accumulate(out + i * out_stride + o, sums[i][o]);
}

// out[t, o] += h[t] @ B^T[:rank, o] for R tokens t and V x 8 columns o: the sums in registers across the rank rows
// (row_stride apart), each row's values widened once for all R tokens. For prompt chunks, where a piece has many.
template <int R, int V, typename T, typename W>
void expand_block(const float* h, int64_t h_stride, const W* b, int64_t b_row_stride, int64_t rank, T* out,
                  int64_t out_stride) {
  vec::vec8 acc[R][V] = {};
  for (int64_t j = 0; j < rank; ++j) {
    vec::vec8 w[V];
    for (int v = 0; v < V; ++v) w[v] = vec::load8(b + j * b_row_stride + 8 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const float hr = h[r * h_stride + j];
      for (int v = 0; v < V; ++v) acc[r][v] += hr * w[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) accumulate8(out + r * out_stride + 8 * v, acc[r][v]);
}

// expand_block over the tokens [begin, end) in tiles of up to kTileTokens, and the columns o < width in blocks of 16,
// then 8, then one at a time.
template <typename T, typename W>
void expand_tiled(int64_t begin, int64_t end, const float* h, int64_t h_stride, const W* b, int64_t b_row_stride,
                  int64_t rank, int64_t width, T* out, int64_t out_stride) {
  using Block = void (*)(const float*, int64_t, const W*, int64_t, int64_t, T*, int64_t);
  constexpr Block kBlocks16[kTileTokens + 1] = {nullptr, expand_block<1, 2, T, W>, expand_block<2, 2, T, W>,
      expand_block<3, 2, T, W>, expand_block<4, 2, T, W>, expand_block<5, 2, T, W>, expand_block<6, 2, T, W>};
  constexpr Block kBlocks8[kTileTokens + 1] = {nullptr, expand_block<1, 1, T, W>, expand_block<2, 1, T, W>,
      expand_block<3, 1, T, W>, expand_block<4, 1, T, W>, expand_block<5, 1, T, W>, expand_block<6, 1, T, W>};
  for (int64_t t = begin; t < end; t += kTileTokens) {
    const int64_t n = std::min<int64_t>(kTileTokens, end - t);
    const float* ht = h + t * h_stride;
    T* ot = out + t * out_stride;
    int64_t o = 0;
    for (; o + 16 <= width; o += 16) kBlocks16[n](ht, h_stride, b + o, b_row_stride, rank, ot + o, out_stride);
    for (; o + 8 <= width; o += 8) kBlocks8[n](ht, h_stride, b + o, b_row_stride, rank, ot + o, out_stride);
    for (; o < width; ++o)
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0.f;
        for (int64_t j = 0; j < rank; ++j)
          sum += ht[i * h_stride + j] * static_cast<float>(b[j * b_row_stride + o]);
        accumulate(ot + i * out_stride + o, sum);
      }
  }
}

}  // namespace lora_tiles
