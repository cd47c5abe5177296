// LoRA for every module band of a projection, shrink and expand in one call: for each band i, out[t, band i's
// columns] += (x[t] @ A[slot, band i's rows].T) @ B[slot, band i's columns, band i's rows].T for the tokens t of each
// segment with an adapter slot. The slots for this path store A row-major [cap, in_dim] and B rank-major (B^T [cap,
// out_dim], see backend/lora/slots.py), so both loops run along contiguous rows. A and B may be narrower than x (fp16
// adapters beside an fp32 model): they are widened on load, sums run in fp32. Short segments (decode steps) run as
// loops that read each adapter row once per pair of tokens; long ones (prompt chunks) as two GEMMs.
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kGemmMinTokens = 16;
constexpr int64_t kMaxWidth = 2048;           // output columns per expand item at most: its sums stay in L1
constexpr int64_t kItemsPerThread = 4;        // expand items per thread at least, where the columns allow
constexpr int kRowBlock = 4;                  // adapter rows per pass over them

// Tokens are taken N = 2 at a time where a segment has two left (decode steps share an adapter among a few
// sequences), so every adapter row is loaded and widened once per pair, not once per token.
constexpr int kPair = 2;

struct Piece {                                // one band of one segment: its tokens, the adapter's rows and columns
  int64_t begin, end, rank;                   // tokens [begin, end), rank rows
  int64_t a_offset, b_offset;                 // A's first row, B^T's first row at the band's first column
  int64_t h_column, column, width;            // the band's first rank column of h, its output columns
};

struct Chunk {                                // an expand item: the columns [begin, begin + width) of a piece's band
  int64_t piece, begin, width;
};

template <typename T>
void accumulate(T* out, float sum) {                            // rounded to T as in the reference: out + T(sum)
  *out = static_cast<T>(static_cast<float>(*out) + static_cast<float>(static_cast<T>(sum)));
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

// fn<N>(t, last) for the tokens t of a piece, in pairs while two are left; last: the piece's last tile.
template <typename Fn>
void for_token_tiles(const Piece& piece, Fn&& fn) {
  int64_t t = piece.begin;
  for (; t + kPair <= piece.end; t += kPair) fn(std::integral_constant<int, kPair>(), t, t + kPair == piece.end);
  for (; t < piece.end; ++t) fn(std::integral_constant<int, 1>(), t, t + 1 == piece.end);
}

// The items [begin, end) of `thread`'s share: contiguous, each item going to the thread its cost's midpoint falls
// in, so that threads get about equal costs (adapter ranks differ up to 8x between pieces).
std::pair<int64_t, int64_t> share(const std::vector<int64_t>& costs, int thread, int num_threads) {
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  int64_t begin = 0, end = 0, before = 0;                        // 2 x midpoint x num_threads vs 2 x bound x total
  for (int64_t i = 0; i < static_cast<int64_t>(costs.size()); before += costs[i++]) {
    const int64_t mid = (2 * before + costs[i]) * num_threads;
    if (mid < 2 * thread * total) begin = i + 1;
    if (mid < 2 * (thread + 1) * total) end = i + 1;
  }
  return {begin, end};
}

// Shrink per piece, then expand per chunk of a piece's output columns, in one parallel region: each thread takes a
// share of equal cost of each, and while it reads one item's adapter rows it pulls in its next item's, so its reads
// from memory run as one stream across items (each item's first rows came in cold otherwise).
template <typename T, typename W>
void lora_pieces(const T* x, const W* a, const W* b, T* out, const std::vector<Piece>& pieces, int64_t num_tokens,
                 int64_t in_dim, int64_t x_stride, int64_t out_stride, int64_t h_stride, int64_t a_row_stride,
                 int64_t b_row_stride) {
  std::vector<float> h(num_tokens * h_stride, 0.f);             // [token, cap], rounded to T as in the reference
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  const int64_t min_chunks = (kItemsPerThread * omp_get_max_threads() + num_pieces - 1) / num_pieces;
  std::vector<Chunk> chunks;
  std::vector<int64_t> shrink_costs, expand_costs;
  for (int64_t p = 0; p < num_pieces; ++p) {
    const Piece& piece = pieces[p];
    const int64_t cost = piece.rank * ((piece.end - piece.begin + 1) / kPair);
    const int64_t num_chunks = std::max((piece.width + kMaxWidth - 1) / kMaxWidth,
                                        std::min(min_chunks, (piece.width + 63) / 64));
    const int64_t width = ((piece.width + num_chunks - 1) / num_chunks + 7) / 8 * 8;
    shrink_costs.push_back(cost);
    for (int64_t o = 0; o < piece.width; o += width) {
      chunks.push_back({p, o, std::min(width, piece.width - o)});
      expand_costs.push_back(cost * chunks.back().width);
    }
  }
  auto b_rows = [&](int64_t c) { return b + pieces[chunks[c].piece].b_offset + chunks[c].begin; };
#pragma omp parallel
  {
    const int thread = omp_get_thread_num(), num_threads = omp_get_num_threads();
    const auto [first_piece, end_piece] = share(shrink_costs, thread, num_threads);
    const auto [first_chunk, end_chunk] = share(expand_costs, thread, num_threads);
    for (int64_t p = first_piece; p < end_piece; ++p) {
      const Piece& piece = pieces[p];
      const W* rows = a + piece.a_offset;
      const W* next = p + 1 < end_piece ? a + pieces[p + 1].a_offset : nullptr;
      for_token_tiles(piece, [&](auto n, int64_t t, bool last) {  // h[t, j] = x[t] . A[j]
        shrink_tokens<decltype(n)::value>(x + t * x_stride, x_stride, rows, a_row_stride, in_dim, piece.rank,
                                          h.data() + t * h_stride + piece.h_column, h_stride, last ? next : rows);
      });
      for (int64_t t = piece.begin; t < piece.end; ++t)
        for (int64_t j = piece.h_column; j < piece.h_column + piece.rank; ++j)
          h[t * h_stride + j] = static_cast<float>(static_cast<T>(h[t * h_stride + j]));
    }
#pragma omp barrier
    for (int64_t c = first_chunk; c < end_chunk; ++c) {
      const Piece& piece = pieces[chunks[c].piece];
      const W* next = c + 1 < end_chunk ? b_rows(c + 1) : nullptr;
      for_token_tiles(piece, [&](auto n, int64_t t, bool last) {  // out[t, chunk] += h[t] @ B^T[:rank, chunk]
        expand_tokens<decltype(n)::value>(h.data() + t * h_stride + piece.h_column, h_stride, b_rows(c),
                                          b_row_stride, piece.rank, chunks[c].width,
                                          out + t * out_stride + piece.column + chunks[c].begin, out_stride,
                                          last ? next : b_rows(c));
      });
    }
  }
}

}  // namespace

// x [num_tokens, in_dim]; lora_a [num_slots, cap, in_dim] and lora_b [num_slots, out_dim, cap], views of rank-major
// slots; ranks [num_bands, num_slots] int32: band i has rows [i * max_rank, i * max_rank + rank) of a slot and writes
// the columns [bounds[i], bounds[i + 1]) of out [num_tokens, out_dim], updated in place; starts [num_segments + 1],
// slots [num_segments] int32 (-1: no adapter).
void lora_apply(torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor ranks, torch::Tensor bounds,
                int64_t max_rank, torch::Tensor starts, torch::Tensor slots, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3, "bad ranks of tensors");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out rows must be contiguous");
  TORCH_CHECK(lora_a.stride(2) == 1 && lora_b.stride(1) == 1, "A must be row-major, B rank-major");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && lora_a.scalar_type() == lora_b.scalar_type(),
              "x and out share a dtype, and so do A and B");
  for (const auto& t : {ranks, bounds, starts, slots})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu(), "int32 tables on the CPU");
  const int64_t num_bands = ranks.size(0), num_slots = lora_a.size(0), num_segments = slots.numel();
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(1) == num_slots && bounds.numel() == num_bands + 1 &&
              starts.numel() == num_segments + 1, "ranks [num_bands, num_slots], bounds, starts");
  TORCH_CHECK(num_bands * max_rank <= std::min(lora_a.size(1), lora_b.size(2)), "bands past the slots' rank rows");
  const int* rank_of = ranks.data_ptr<int>();
  const int* column = bounds.data_ptr<int>();
  const int* start = starts.data_ptr<int>();
  const int* slot_of = slots.data_ptr<int>();
  TORCH_CHECK(x.size(1) == lora_a.size(2) && lora_b.size(1) == out.size(1), "x, A, B and out disagree on dims");
  for (int64_t band = 0; band < num_bands; ++band)
    TORCH_CHECK(0 <= column[band] && column[band] <= column[band + 1], "bounds must rise from 0");
  TORCH_CHECK(column[num_bands] <= out.size(1), "bounds past out's columns");
  std::vector<Piece> pieces;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t slot = slot_of[s], begin = start[s], end = start[s + 1];
    if (slot < 0 || end == begin) continue;
    TORCH_CHECK(slot < num_slots && 0 <= begin && begin < end && end <= x.size(0), "segment ", s, " out of range");
    for (int64_t band = 0; band < num_bands; ++band) {
      const int64_t rank = rank_of[band * num_slots + slot], row = band * max_rank;
      const int64_t first = column[band], width = column[band + 1] - column[band];
      TORCH_CHECK(0 <= rank && rank <= max_rank, "rank ", rank, " past max_rank ", max_rank);
      if (rank == 0 || width == 0) continue;
      if (end - begin >= kGemmMinTokens) {
        auto h = x.slice(0, begin, end).mm(lora_a[slot].slice(0, row, row + rank).to(x.scalar_type()).t());
        auto band_b = lora_b[slot].slice(0, first, first + width).slice(1, row, row + rank);
        out.slice(0, begin, end).slice(1, first, first + width).add_(h.mm(band_b.to(x.scalar_type()).t()));
      } else {
        pieces.push_back({begin, end, rank, slot * lora_a.stride(0) + row * lora_a.stride(1),
                          slot * lora_b.stride(0) + row * lora_b.stride(2) + first, row, first, width});
      }
    }
  }
  if (pieces.empty()) return;
  DISPATCH_KERNEL_TYPES(x.scalar_type(), "lora_apply", [&] {
    using T = scalar_t;
    DISPATCH_KERNEL_TYPES(lora_a.scalar_type(), "lora_apply", [&] {
      lora_pieces<T, scalar_t>(x.data_ptr<T>(), lora_a.data_ptr<scalar_t>(), lora_b.data_ptr<scalar_t>(),
                               out.data_ptr<T>(), pieces, x.size(0), lora_a.size(2), x.stride(0), out.stride(0),
                               num_bands * max_rank, lora_a.stride(1), lora_b.stride(2));
    });
  });
}
