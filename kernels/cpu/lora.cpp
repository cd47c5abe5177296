// LoRA for every module band of a projection, shrink and expand in one call: for each band i, out[t, band i's
// columns] += (x[t] @ A[slot, band i's rows].T) @ B[slot, band i's columns, band i's rows].T for the tokens t of each
// segment with an adapter slot. The slots for this path store A row-major [cap, in_dim] and B rank-major (B^T [cap,
// out_dim], see backend/lora/slots.py), so both loops run along contiguous rows. A and B may be narrower than x (fp16
// adapters beside an fp32 model): they are widened on load, sums run in fp32. Short segments (decode steps) run as
// loops that stream each adapter row once per pair of tokens; long ones (prompt chunks) in pieces of up to 64 tokens
// that the threads share, the shrink 4 tokens at a time and the expand in tiles of 6 tokens x 16 columns whose sums
// stay in registers. A band of a slot with a DoRA module has its expanded columns scaled by the module's magnitude
// (base + LoRA, per output feature) right after each expand item, while they are in the cache.
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "lora_tiles.h"
#include "claims.h"
#include "vec.h"

namespace {

using namespace lora_tiles;

constexpr int64_t kItemsPerThread = 4;        // expand items per thread at least, where the columns allow

// Tokens are taken a few at a time while a segment has that many left (decode steps share an adapter among a few
// sequences, prompt chunks among many), so every adapter row is loaded and widened once per tile of tokens.
constexpr int kPair = 2;                      // a decode step's tile: 2 tokens
constexpr int kShrinkTile = 4;                // a prompt chunk's shrink: 4 tokens x 2 rows of A
constexpr int64_t kTiledMinTokens = 4;        // pieces with this many tokens expand in tiles (expand_tiled)
constexpr int64_t kPieceTokens = 64;          // tokens per piece at most: a long segment is shared among threads

struct Piece {                                // one band of one segment: its tokens, the adapter's rows and columns
  int64_t begin, end, rank;                   // tokens [begin, end), rank rows
  int64_t a_offset, b_offset;                 // A's first row, B^T's first row at the band's first column
  int64_t h_column, column, width;            // the band's first rank column of h, its output columns
  int64_t m_offset;                           // the DoRA magnitude of the band's first column, or -1: none
};

struct Chunk {                                // an expand item: the columns [begin, begin + width) of a piece's band
  int64_t piece, begin, width;
};

// fn<N>(t, last) for the tokens t of a piece in tiles of N = kMax, then halves of it; last: the piece's last tile.
template <int kMax, typename Fn>
void for_token_tiles(const Piece& piece, int64_t& t, Fn&& fn) {
  for (; t + kMax <= piece.end; t += kMax) fn(std::integral_constant<int, kMax>(), t, t + kMax == piece.end);
  if constexpr (kMax > 1) for_token_tiles<kMax / 2>(piece, t, fn);
}

template <int kMax, typename Fn>
void for_token_tiles(const Piece& piece, Fn&& fn) {
  int64_t t = piece.begin;
  for_token_tiles<kMax>(piece, t, fn);
}

// Shrink per piece, then expand per chunk of a piece's output columns, in one parallel region: each thread claims
// items of each by cost (claims.h), and while it reads one item's adapter rows it pulls in its next item's, so its
// reads from memory run as one stream across items (each item's first rows came in cold otherwise).
// out[t, columns] *= m[columns] for the tokens of a piece: a DoRA module's whole output, scaled per feature.
template <typename T, typename W>
void dora_scale(const Piece& piece, const W* m, T* out, int64_t out_stride, int64_t begin, int64_t width) {
  for (int64_t t = piece.begin; t < piece.end; ++t) {
    T* row = out + t * out_stride + piece.column + begin;
    for (int64_t j = 0; j < width; ++j)
      row[j] = static_cast<T>(static_cast<float>(row[j]) * static_cast<float>(m[piece.m_offset + begin + j]));
  }
}

template <typename T, typename W>
void lora_pieces(const T* x, const W* a, const W* b, const W* m, T* out, const std::vector<Piece>& pieces,
                 int64_t num_tokens, int64_t in_dim, int64_t x_stride, int64_t out_stride, int64_t h_stride,
                 int64_t a_row_stride, int64_t b_row_stride) {
  // h [token, cap], rounded to T as in the reference. The expand reads only what the shrink wrote, so the buffer
  // is reused between calls as it is: a fresh one (1.5 MB for a 2048-token step) would fault in its pages each call.
  thread_local std::vector<float> h_buffer;
  h_buffer.resize(std::max<size_t>(h_buffer.size(), num_tokens * h_stride));
  float* h = h_buffer.data();
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
  const int num_threads = omp_get_max_threads();
  Claims shrinks(shrink_costs, num_threads), expands(expand_costs, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num();
    for (int64_t p = shrinks.claim(thread); p >= 0; p = shrinks.claim(thread)) {
      const Piece& piece = pieces[p];
      const W* rows = a + piece.a_offset;
      const W* next = shrinks.is_next(thread, p + 1) ? a + pieces[p + 1].a_offset : nullptr;
      for_token_tiles<kShrinkTile>(piece, [&](auto n, int64_t t, bool last) {  // h[t, j] = x[t] . A[j]
        shrink_tokens<decltype(n)::value>(x + t * x_stride, x_stride, rows, a_row_stride, in_dim, piece.rank,
                                          h + t * h_stride + piece.h_column, h_stride, last ? next : rows);
      });
      for (int64_t t = piece.begin; t < piece.end; ++t)
        for (int64_t j = piece.h_column; j < piece.h_column + piece.rank; ++j)
          h[t * h_stride + j] = static_cast<float>(static_cast<T>(h[t * h_stride + j]));
    }
#pragma omp barrier
    for (int64_t c = expands.claim(thread); c >= 0; c = expands.claim(thread)) {
      const Piece& piece = pieces[chunks[c].piece];
      const W* next = expands.is_next(thread, c + 1) ? b_rows(c + 1) : nullptr;
      if (piece.end - piece.begin >= kTiledMinTokens) {
        expand_tiled(piece.begin, piece.end, h + piece.h_column, h_stride, b_rows(c), b_row_stride, piece.rank,
                     chunks[c].width, out + piece.column + chunks[c].begin, out_stride);
      } else {
        for_token_tiles<kPair>(piece, [&](auto n, int64_t t, bool last) {  // out[t, chunk] += h[t] @ B^T[:r, chunk]
          expand_tokens<decltype(n)::value>(h + t * h_stride + piece.h_column, h_stride, b_rows(c),
                                            b_row_stride, piece.rank, chunks[c].width,
                                            out + t * out_stride + piece.column + chunks[c].begin, out_stride,
                                            last ? next : b_rows(c));
        });
      }
      if (piece.m_offset >= 0) dora_scale(piece, m, out, out_stride, chunks[c].begin, chunks[c].width);
    }
  }
}

// x [num_tokens, in_dim]; lora_a [num_slots, cap, in_dim] and lora_b [num_slots, out_dim, cap], views of rank-major
// slots; ranks [num_bands, num_slots] int32: band i has rows [i * max_rank, i * max_rank + rank) of a slot and writes
// the columns [bounds[i], bounds[i + 1]) of an output [num_tokens, out_dim]; dora [num_bands, num_slots] int32: the
// band has a DoRA module in the slot, whose magnitudes are m [num_slots, out_dim]; starts [num_segments + 1], slots
// [num_segments] int32 (-1: no adapter).
std::vector<Piece> plan_lora(const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
                             const torch::Tensor& ranks, const torch::Tensor& bounds, const torch::Tensor& m,
                             const torch::Tensor& dora, int64_t max_rank, const torch::Tensor& starts,
                             const torch::Tensor& slots, int64_t out_dim) {
  TORCH_CHECK(x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3, "bad ranks of tensors");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(lora_a.stride(2) == 1 && lora_b.stride(1) == 1, "A must be row-major, B rank-major");
  TORCH_CHECK(lora_a.scalar_type() == lora_b.scalar_type(), "A and B share a dtype");
  for (const auto& t : {ranks, bounds, starts, slots, dora})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu(), "int32 tables on the CPU");
  TORCH_CHECK(dora.sizes() == ranks.sizes() && m.dim() == 2 && m.size(0) == lora_a.size(0) && m.size(1) == out_dim &&
              m.stride(1) == 1 && m.scalar_type() == lora_a.scalar_type(), "dora like ranks; m [num_slots, out_dim]");
  const int64_t num_bands = ranks.size(0), num_slots = lora_a.size(0), num_segments = slots.numel();
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(1) == num_slots && bounds.numel() == num_bands + 1 &&
              starts.numel() == num_segments + 1, "ranks [num_bands, num_slots], bounds, starts");
  TORCH_CHECK(num_bands * max_rank <= std::min(lora_a.size(1), lora_b.size(2)), "bands past the slots' rank rows");
  const int* rank_of = ranks.data_ptr<int>();
  const int* dora_of = dora.data_ptr<int>();
  const int* column = bounds.data_ptr<int>();
  const int* start = starts.data_ptr<int>();
  const int* slot_of = slots.data_ptr<int>();
  TORCH_CHECK(x.size(1) == lora_a.size(2) && lora_b.size(1) == out_dim, "x, A, B and out disagree on dims");
  for (int64_t band = 0; band < num_bands; ++band)
    TORCH_CHECK(0 <= column[band] && column[band] <= column[band + 1], "bounds must rise from 0");
  TORCH_CHECK(column[num_bands] <= out_dim, "bounds past out's columns");
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
      const int64_t m_offset = dora_of[band * num_slots + slot] ? slot * m.stride(0) + first : -1;
      for (int64_t t = begin; t < end; t += kPieceTokens)
        pieces.push_back({t, std::min(end, t + kPieceTokens), rank, slot * lora_a.stride(0) + row * lora_a.stride(1),
                          slot * lora_b.stride(0) + row * lora_b.stride(2) + first, row, first, width, m_offset});
    }
  }
  return pieces;
}

void run_lora(const std::vector<Piece>& pieces, const torch::Tensor& x, const torch::Tensor& lora_a,
              const torch::Tensor& lora_b, const torch::Tensor& m, int64_t h_stride, torch::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && x.scalar_type() == out.scalar_type() &&
              out.size(0) == x.size(0), "out [num_tokens, out_dim], rows contiguous, x's dtype");
  if (pieces.empty()) return;
  DISPATCH_KERNEL_TYPES(x.scalar_type(), "lora_apply", [&] {
    using T = scalar_t;
    DISPATCH_KERNEL_TYPES(lora_a.scalar_type(), "lora_apply", [&] {
      lora_pieces<T, scalar_t>(x.data_ptr<T>(), lora_a.data_ptr<scalar_t>(), lora_b.data_ptr<scalar_t>(),
                               m.data_ptr<scalar_t>(), out.data_ptr<T>(), pieces, x.size(0), lora_a.size(2),
                               x.stride(0), out.stride(0),
                               h_stride, lora_a.stride(1), lora_b.stride(2));
    });
  });
}

// The adapter bytes a decode step's pieces stream: each one's A rows (contiguous) and its band's columns of B^T's
// rank rows. (Prompt chunks compute far longer on what they read.)
std::vector<vec::Span> piece_spans(const std::vector<Piece>& pieces, const torch::Tensor& lora_a,
                                   const torch::Tensor& lora_b) {
  const char* a = static_cast<const char*>(lora_a.data_ptr());
  const char* b = static_cast<const char*>(lora_b.data_ptr());
  const int64_t size = lora_a.element_size(), in_dim = lora_a.size(2), b_row_stride = lora_b.stride(2);
  std::vector<vec::Span> spans;
  for (const Piece& piece : pieces) {
    if (piece.end - piece.begin >= kTiledMinTokens) continue;
    spans.push_back(vec::span(a + piece.a_offset * size, piece.rank * in_dim * size));
    for (int64_t j = 0; j < piece.rank; ++j)
      spans.push_back(vec::span(b + (piece.b_offset + j * b_row_stride) * size, piece.width * size));
  }
  return spans;
}

}  // namespace

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                           const std::vector<vec::Span>& side);

// out += LoRA(x) in place (see plan_lora for the tables).
void lora_apply(torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor ranks, torch::Tensor bounds,
                torch::Tensor m, torch::Tensor dora, int64_t max_rank, torch::Tensor starts, torch::Tensor slots,
                torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2, "out [num_tokens, out_dim]");
  const auto pieces = plan_lora(x, lora_a, lora_b, ranks, bounds, m, dora, max_rank, starts, slots, out.size(1));
  run_lora(pieces, x, lora_a, lora_b, m, ranks.size(0) * max_rank, out);
}

// panel_linear(x, panels, bias) + LoRA(x): the GEMM pulls the adapter rows a decode step's LoRA streams into the cache
// as it runs (it is bound by its FMAs, with memory bandwidth to spare), so the LoRA reads them from there.
torch::Tensor linear_lora(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                          torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor ranks, torch::Tensor bounds,
                          torch::Tensor m, torch::Tensor dora, int64_t max_rank, torch::Tensor starts,
                          torch::Tensor slots) {
  x = x.contiguous();
  const int64_t out_dim = panels.size(0) * panels.size(2);
  const auto pieces = plan_lora(x, lora_a, lora_b, ranks, bounds, m, dora, max_rank, starts, slots, out_dim);
  auto y = panel_linear(x, panels, bias, piece_spans(pieces, lora_a, lora_b));
  run_lora(pieces, x, lora_a, lora_b, m, ranks.size(0) * max_rank, y);
  return y;
}
