// LoRA for one module band, shrink and expand in one call: out[t] += (x[t] @ A[slot, :r].T) @ B[slot, :, :r].T for
// the tokens of each segment with an adapter slot. The slots for this path store A row-major [cap, in_dim] and B
// rank-major (B^T [cap, out_dim], see backend/lora/slots.py), so both loops run along contiguous rows. Short
// segments (decode steps) run as loops that read each adapter row once per segment; long ones (prompt chunks) as
// two GEMMs.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kGemmMinTokens = 16;
constexpr int64_t kColumnChunk = 64;

struct Segment {
  int64_t begin, end, slot, rank;
};

// h[j] = x . A[j] for j < rank: eight rows at a time, so the eight sums run side by side; the columns past the
// last multiple of 8 in scalar code.
template <typename T>
void shrink_row(const T* x, const T* a, int64_t a_row_stride, int64_t in_dim, int64_t rank, float* h) {
  const int64_t vec_dim = in_dim / 8 * 8;
  auto tail = [&](const T* row) {
    float sum = 0.f;
    for (int64_t k = vec_dim; k < in_dim; ++k) sum += static_cast<float>(x[k]) * static_cast<float>(row[k]);
    return sum;
  };
  int64_t j = 0;
  for (; j + 8 <= rank; j += 8) {
    const vec::vec8 sums = vec::dot8(x, a + j * a_row_stride, a_row_stride, vec_dim);
    for (int r = 0; r < 8; ++r) h[j + r] = sums[r] + tail(a + (j + r) * a_row_stride);
  }
  for (; j < rank; ++j) h[j] = vec::dot1(x, a + j * a_row_stride, vec_dim) + tail(a + j * a_row_stride);
}

// out[o] += h @ B^T[:rank, o] for the columns o < width (<= kColumnChunk) of one chunk: the sums held in
// registers while the rank rows stream by; columns past the last multiple of 8 in scalar code.
template <typename T>
void expand_chunk(const float* h, const T* b, int64_t b_row_stride, int64_t rank, int64_t width, T* out) {
  constexpr int64_t kVecs = kColumnChunk / 8;
  const int64_t num_vecs = width / 8;
  vec::vec8 acc[kVecs] = {};
  float tail[8] = {};
  for (int64_t j = 0; j < rank; ++j) {
    const T* row = b + j * b_row_stride;
    for (int64_t c = 0; c < num_vecs; ++c) acc[c] += h[j] * vec::load8(row + 8 * c);
    for (int64_t o = 8 * num_vecs; o < width; ++o) tail[o - 8 * num_vecs] += h[j] * static_cast<float>(row[o]);
  }
  auto add = [&](int64_t o, float sum) {
    out[o] = static_cast<T>(static_cast<float>(out[o]) + static_cast<float>(static_cast<T>(sum)));
  };
  for (int64_t c = 0; c < num_vecs; ++c)
    for (int i = 0; i < 8; ++i) add(8 * c + i, acc[c][i]);
  for (int64_t o = 8 * num_vecs; o < width; ++o) add(o, tail[o - 8 * num_vecs]);
}

// Shrink per segment, then expand per (segment, chunk of output columns), both in parallel.
template <typename T>
void lora_segments(const T* x, const T* a, const T* b, T* out, const std::vector<Segment>& segments,
                   int64_t num_tokens, int64_t in_dim, int64_t out_dim, int64_t band_rank, int64_t x_stride,
                   int64_t out_stride, int64_t a_slot_stride, int64_t a_row_stride, int64_t b_slot_stride,
                   int64_t b_row_stride) {
  std::vector<float> h(num_tokens * band_rank, 0.f);            // [token, rank], rounded to T as in the reference
  at::parallel_for(0, static_cast<int64_t>(segments.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const Segment& seg = segments[s];
      const T* a_slot = a + seg.slot * a_slot_stride;
      for (int64_t t = seg.begin; t < seg.end; ++t)             // h[t, j] = x[t] . A[j]
        shrink_row(x + t * x_stride, a_slot, a_row_stride, in_dim, seg.rank, h.data() + t * band_rank);
      for (int64_t t = seg.begin; t < seg.end; ++t)
        for (int64_t j = 0; j < seg.rank; ++j)
          h[t * band_rank + j] = static_cast<float>(static_cast<T>(h[t * band_rank + j]));
    }
  });
  const int64_t num_chunks = (out_dim + kColumnChunk - 1) / kColumnChunk;
  const int64_t num_items = static_cast<int64_t>(segments.size()) * num_chunks;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Segment& seg = segments[item / num_chunks];
      const int64_t o0 = item % num_chunks * kColumnChunk, width = std::min(kColumnChunk, out_dim - o0);
      for (int64_t t = seg.begin; t < seg.end; ++t)             // out[t, chunk] += h[t] @ B^T[:rank, chunk]
        expand_chunk(h.data() + t * band_rank, b + seg.slot * b_slot_stride + o0, b_row_stride, seg.rank, width,
                     out + t * out_stride + o0);
    }
  });
}

}  // namespace

// x [num_tokens, in_dim]; lora_a [num_slots, band_rank, in_dim] and lora_b [num_slots, out_dim, band_rank], views
// of rank-major slots; out [num_tokens, out_dim], updated in place; starts [num_segments + 1], slots
// [num_segments] (-1: no adapter), ranks [num_slots].
void lora_apply(torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, std::vector<int64_t> starts,
                std::vector<int64_t> slots, std::vector<int64_t> ranks, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3, "bad ranks of tensors");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out rows must be contiguous");
  TORCH_CHECK(lora_a.stride(2) == 1 && lora_b.stride(1) == 1, "A must be row-major, B rank-major");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && lora_a.scalar_type() == x.scalar_type() &&
              lora_b.scalar_type() == x.scalar_type(), "one dtype");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == static_cast<int64_t>(slots.size()) + 1, "starts, slots");
  std::vector<Segment> short_segments;
  for (size_t s = 0; s < slots.size(); ++s) {
    const int64_t slot = slots[s], begin = starts[s], end = starts[s + 1];
    if (slot < 0 || ranks[slot] == 0 || end == begin) continue;
    const int64_t rank = ranks[slot];
    if (end - begin >= kGemmMinTokens) {
      auto h = x.slice(0, begin, end).mm(lora_a[slot].slice(0, 0, rank).t());
      out.slice(0, begin, end).add_(h.mm(lora_b[slot].slice(1, 0, rank).t()));
    } else {
      short_segments.push_back({begin, end, slot, rank});
    }
  }
  if (short_segments.empty()) return;
  DISPATCH_KERNEL_TYPES(x.scalar_type(), "lora_apply", [&] {
    lora_segments<scalar_t>(x.data_ptr<scalar_t>(), lora_a.data_ptr<scalar_t>(), lora_b.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), short_segments, x.size(0), lora_a.size(2), lora_b.size(1),
                            lora_a.size(1), x.stride(0), out.stride(0), lora_a.stride(0), lora_a.stride(1),
                            lora_b.stride(0), lora_b.stride(2));
  });
}
