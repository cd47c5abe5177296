// What the CPU attention kernels share: a step's shapes and the walk over a KV head's pages.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, cache_head_stride, block_size, max_blocks;
  int64_t q_row_stride;                      // q may be a view of the step's qkv; out is contiguous
  float softcap;                             // scores -> softcap * tanh(scores / softcap) where > 0 (Gemma 2)
};

// Soft-capping of n scores in place (cap <= 0: none).
inline void cap_scores(float* scores, int64_t n, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

// The first position a query at position pos attends to (window <= 0: none, all of them).
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
}

// fn(rows, p, stop) for each page of a KV head holding positions in [first, len): rows is position p's row, the
// page holds positions up to stop (exclusive).
template <typename T, typename Fn>
inline void for_each_page(const T* head, const int32_t* table, int64_t first, int64_t len, const Shape& s, Fn&& fn) {
  for (int64_t start = first / s.block_size * s.block_size; start < len; start += s.block_size) {
    const int64_t p = std::max(first, start);
    fn(head + static_cast<int64_t>(table[start / s.block_size]) * s.block_size * s.head_dim + (p - start) * s.head_dim,
       p, std::min(len, start + s.block_size));
  }
}
