// Prompt rows in tiles: up to 8 consecutive rows of a sequence, with the GQA group of one KV head (24 queries for 3
// heads a group), against the context they share, as small GEMMs whose sums stay in registers, so each K and V row
// is loaded once per tile instead of once per row. Scores are kept transposed, [position, query], so the softmax
// runs along positions 8 queries at a time; a query's positions past its row (or before its window) are masked.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "vec.h"

namespace attention_tiles {

constexpr int64_t kRows = 8;                 // prompt rows per tile

// A tile's queries: rows [first_row, first_row + num_rows) of the step, at positions from first_pos on, for the
// heads of KV head `head`; its context [lo, hi). part: where a decode row's part of a long context keeps its sums
// (paged_attention.cpp), -1 for a whole one.
struct Tile {
  int64_t seq, head, first_row, num_rows, first_pos, lo, hi, part = -1;
};

// Per thread, reused from tile to tile.
struct Scratch {
  std::vector<float> queries, scores, sums, out;  // [head_dim, width], [hi - lo, width], [width], [queries, head_dim]
  std::vector<int64_t> lo, hi;                    // each query's positions
};

// s[p, 0:8V] = k[p] . qt[:, 0:8V] for P positions: qt [head_dim, width] holds the queries as columns.
template <int P, int V, typename T>
inline void score_block(const float* qt, int64_t width, const T* k, int64_t head_dim, float* s) {
  __m256 acc[P][V];
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < V; ++v) acc[p][v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m256 q[V];
    for (int v = 0; v < V; ++v) q[v] = _mm256_loadu_ps(qt + d * width + 8 * v);
    for (int p = 0; p < P; ++p) {
      const __m256 kp = _mm256_set1_ps(vec::load1(k + p * head_dim + d));
      for (int v = 0; v < V; ++v) acc[p][v] = _mm256_fmadd_ps(kp, q[v], acc[p][v]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(s + p * width + 8 * v, acc[p][v]);
}

// The scores of n positions of a page, 4 at a time, for query columns [0, 8V).
template <int V, typename T>
inline void score_rows(const float* qt, int64_t width, const T* k, int64_t n, int64_t head_dim, float* s) {
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) score_block<4, V>(qt, width, k + p * head_dim, head_dim, s + p * width);
  for (; p < n; ++p) score_block<1, V>(qt, width, k + p * head_dim, head_dim, s + p * width);
}

template <typename T>
void tile_scores(const float* qt, int64_t width, const T* k_head, const int32_t* table, const Tile& t, const Shape& s,
                 float* scores) {
  for_each_page(k_head, table, t.lo, t.hi, s, [&](const T* rows, int64_t p, int64_t stop) {
    float* out = scores + (p - t.lo) * width;
    for (int64_t c = 0; c < width; c += 24) {                   // 3 x 8 queries: 12 sums + 3 queries in registers
      const int64_t n = stop - p;
      switch (std::min<int64_t>(3, (width - c) / 8)) {
        case 3: score_rows<3>(qt + c, width, rows, n, s.head_dim, out + c); break;
        case 2: score_rows<2>(qt + c, width, rows, n, s.head_dim, out + c); break;
        default: score_rows<1>(qt + c, width, rows, n, s.head_dim, out + c);
      }
    }
  });
}

// scores [hi - lo, width] -> exp(score - the query's max), 0 outside the query's positions [q_lo, q_hi); the sums of
// each query's column into sums [width].
inline void softmax_columns(float* scores, int64_t width, const Tile& t, const int64_t* q_lo, const int64_t* q_hi,
                            float* sums) {
  const float minus_inf = -__builtin_huge_valf();
  const int64_t n = t.hi - t.lo;
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t p = t.lo; p < q_lo[c]; ++p) scores[(p - t.lo) * width + c] = minus_inf;
    for (int64_t p = q_hi[c]; p < t.hi; ++p) scores[(p - t.lo) * width + c] = minus_inf;
  }
  for (int64_t c = 0; c < width; c += 8) {
    __m256 top = _mm256_set1_ps(minus_inf), total = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; ++p) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + p * width + c));
    for (int64_t p = 0; p < n; ++p) {
      float* row = scores + p * width + c;
      const __m256 x = _mm256_loadu_ps(row);
      const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(minus_inf), _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(vec::m(vec::exp8(vec::v(_mm256_sub_ps(x, top)))), kept);
      _mm256_storeu_ps(row, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(sums + c, total);
  }
}

// out[q, col:col + 8C] = sum_p probs[p, q] * v[p, col:col + 8C] for Q queries; out rows head_dim apart.
template <int Q, int C, typename T>
void value_block(const float* probs, int64_t width, const T* v_head, const int32_t* table, const Tile& t,
                 const Shape& s, int64_t col, float* out) {
  __m256 acc[Q][C];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) acc[q][c] = _mm256_setzero_ps();
  for_each_page(v_head, table, t.lo, t.hi, s, [&](const T* rows, int64_t p, int64_t stop) {
    __m256 sum[Q][C];                              // a page's sums in registers (acc, captured, would be spilled)
    for (int q = 0; q < Q; ++q)
      for (int c = 0; c < C; ++c) sum[q][c] = acc[q][c];
    const float* pr = probs + (p - t.lo) * width;
    for (; p < stop; ++p, rows += s.head_dim, pr += width) {
      __m256 v[C];
      for (int c = 0; c < C; ++c) v[c] = vec::m(vec::load8(rows + col + 8 * c));
      for (int q = 0; q < Q; ++q) {
        const __m256 w = _mm256_broadcast_ss(pr + q);
        for (int c = 0; c < C; ++c) sum[q][c] = _mm256_fmadd_ps(w, v[c], sum[q][c]);
      }
    }
    for (int q = 0; q < Q; ++q)
      for (int c = 0; c < C; ++c) acc[q][c] = sum[q][c];
  });
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + q * s.head_dim + col + 8 * c, acc[q][c]);
}

template <int Q, typename T>
void value_columns(const float* probs, int64_t width, const T* v_head, const int32_t* table, const Tile& t,
                   const Shape& s, float* out) {
  int64_t col = 0;
  for (; col + 16 <= s.head_dim; col += 16) value_block<Q, 2>(probs, width, v_head, table, t, s, col, out);
  if (col < s.head_dim) value_block<Q, 1>(probs, width, v_head, table, t, s, col, out);
}

// 6 queries x 16 columns a pass: 12 sums, 2 rows of V and a probability in registers.
template <typename T>
void tile_values(const float* probs, int64_t width, int64_t num_queries, const T* v_head, const int32_t* table,
                 const Tile& t, const Shape& s, float* out) {
  using Fn = void (*)(const float*, int64_t, const T*, const int32_t*, const Tile&, const Shape&, float*);
  constexpr Fn kBlocks[7] = {nullptr, value_columns<1, T>, value_columns<2, T>, value_columns<3, T>,
                             value_columns<4, T>, value_columns<5, T>, value_columns<6, T>};
  for (int64_t q = 0; q < num_queries; q += 6)
    kBlocks[std::min<int64_t>(6, num_queries - q)](probs + q, width, v_head, table, t, s, out + q * s.head_dim);
}

// One tile: q [num_rows, num_heads, head_dim] with rows s.q_row_stride apart, out alike but contiguous; the caches
// [num_kv_heads, num_blocks, block_size, head_dim] of T or int8 (scale holds K's scale, v_scale is V's); window <= 0:
// none.
template <typename T, typename C>
void run_tile(const T* q, const C* k_cache, const C* v_cache, const int32_t* table, const Tile& t, const Shape& s,
              float scale, float v_scale, int64_t window, T* out, Scratch& x) {
  const int64_t num_queries = t.num_rows * s.group, width = (num_queries + 7) / 8 * 8, n = t.hi - t.lo;
  x.queries.assign(s.head_dim * width, 0.f);
  x.lo.assign(width, t.lo);
  x.hi.assign(width, t.hi);
  for (int64_t i = 0; i < t.num_rows; ++i)
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t c = i * s.group + g;
      const T* row = q + (t.first_row + i) * s.q_row_stride + (t.head * s.group + g) * s.head_dim;
      for (int64_t d = 0; d < s.head_dim; ++d) x.queries[d * width + c] = static_cast<float>(row[d]) * scale;
      x.hi[c] = t.first_pos + i + 1;
      x.lo[c] = window_start(t.first_pos + i, window);
    }
  x.scores.resize(std::max<size_t>(x.scores.size(), n * width));
  x.sums.resize(width);
  x.out.resize(num_queries * s.head_dim);
  const int64_t head_offset = t.head * s.cache_head_stride;
  tile_scores(x.queries.data(), width, k_cache + head_offset, table, t, s, x.scores.data());
  cap_scores(x.scores.data(), n * width, s.softcap);
  softmax_columns(x.scores.data(), width, t, x.lo.data(), x.hi.data(), x.sums.data());
  tile_values(x.scores.data(), width, num_queries, v_cache + head_offset, table, t, s, x.out.data());
  for (int64_t i = 0; i < t.num_rows; ++i)
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t c = i * s.group + g;
      const float inv = v_scale / x.sums[c];
      T* o = out + ((t.first_row + i) * s.num_heads + t.head * s.group + g) * s.head_dim;
      for (int64_t d = 0; d < s.head_dim; ++d) o[d] = static_cast<T>(x.out[c * s.head_dim + d] * inv);
    }
}

}  // namespace attention_tiles
