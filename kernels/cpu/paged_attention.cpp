// Attention over the paged KV cache, read in place. A decode row runs alone: the GQA group of a KV head goes
// together, its scores, softmax and sums of V on one thread, each K and V row loaded 8 values at a time (bf16, fp16,
// int8 and e4m3 caches converted on load) once for all the group's queries (GroupRow), their sums side by side so
// none waits on another; a long context in parts, merged after. Prompt rows run in tiles of consecutive rows
// (attention_tiles.h). Threads claim (row, part of a row or tile, KV head) items, shares of equal cost first
// (claims.h); nothing at or past a row's position is read.
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "attention_tiles.h"
#include "claims.h"
#include "vec.h"

namespace {

using vec::vec8;

constexpr int64_t kItemCost = 16;       // an item's fixed work (its queries, its softmax's passes) in context positions
constexpr int64_t kTileRowsPerRow = 3;  // a tile's rows cost as much as one decode row per this many (its GEMMs)
constexpr int64_t kPartPositions = 512;  // a decode row's context longer than this goes in parts of about equal length
                                         // (one sequence at 4096 positions: 8 parts for each of SmolLM2's 3 KV
                                         // heads, where 3 items left one of 2 threads idle a third of the time)

// The lines of an item's K and V rows, positions [first, len), page by page: what the item before it pulls into the
// cache while it computes (a page at a time ahead left the reads of each item's first pages exposed, and a step's
// attention read its pages at half the rate memory streams).
template <typename T>
void item_spans(const T* k_head, const T* v_head, const int32_t* table, int64_t first, int64_t len, const Shape& s,
                std::vector<vec::Span>& spans) {
  for (const T* head : {k_head, v_head})
    for_each_page(head, table, first, len, s, [&](const T* rows, int64_t p, int64_t stop) {
      spans.push_back(vec::span(rows, (stop - p) * s.head_dim * static_cast<int64_t>(sizeof(T))));
    });
}

// The next item's lines, spread evenly over this item's work: a unit is one position for one head of the group, in
// the K pass and again in the V pass.
class Ahead {
 public:
  Ahead(const std::vector<vec::Span>& spans, int64_t units_per_pass)
      : cursor_(spans, 0), num_lines_(vec::num_lines(spans)), num_units_(std::max<int64_t>(1, 2 * units_per_pass)) {}
  void advance(int64_t num_units) {
    for (owed_ += num_units * num_lines_; owed_ >= num_units_; owed_ -= num_units_) cursor_.prefetch_next();
  }

 private:
  vec::LineCursor cursor_;
  int64_t num_lines_, num_units_, owed_ = 0;
};

// G queries of a GQA group (1, 2, 3, 4 or 8) against the rows of one KV head: each K or V row is loaded and
// converted once for all G (their sums side by side: G x kRows scores, G x kCols column sums), not once a query.
template <int G>
struct GroupRow {
  static constexpr int kRows = G == 1 ? 8 : G == 2 ? 4 : G <= 4 ? 2 : 1;    // K rows a pass: G x kRows <= 8 sums
  static constexpr int kCols = G == 1 ? 8 : G <= 3 ? 4 : G == 4 ? 2 : 1;     // vec8 columns of V a pass

  // scores[g, p - first] = q[g] . k[p] for positions [first, len), rows n = len - first apart; q already scaled.
  template <typename C>
  static void scores(const float* q, const C* k_head, const int32_t* table, int64_t first, int64_t len,
                     const Shape& s, float* scores, Ahead& ahead) {
    const int64_t n = len - first;
    auto put = [&](vec8 sums, int rows, int64_t p) {
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < rows; ++r) scores[g * n + p - first + r] = sums[g * rows + r];
    };
    for_each_page(k_head, table, first, len, s, [&](const C* rows, int64_t p, int64_t stop) {
      for (; p + kRows <= stop; p += kRows, rows += kRows * s.head_dim) {
        ahead.advance(G * kRows);
        put(vec::dot_tile<G, kRows>(q, s.head_dim, rows, s.head_dim, s.head_dim), kRows, p);
      }
      for (; p < stop; ++p, rows += s.head_dim) {
        ahead.advance(G);
        put(vec::dot_tile<G, 1>(q, s.head_dim, rows, s.head_dim, s.head_dim), 1, p);
      }
    });
  }

  // out[g] = v_scale * sum_p weights[g, p - first] * v[p], kCols x 8 columns at a time held in registers (the
  // last pass moved back to end at head_dim: columns it computes again come out the same).
  template <typename C, typename T>
  static void values(const float* weights, const C* v_head, const int32_t* table, int64_t first, int64_t len,
                     const Shape& s, float v_scale, T* out, Ahead& ahead) {
    const int64_t chunks = s.head_dim / 8;
    if (chunks < kCols) {
      for (int64_t c0 = 0; c0 < chunks; ++c0)
        columns<1>(c0, weights, v_head, table, first, len, s, v_scale, out, ahead);
      return;
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += kCols)
      columns<kCols>(std::min(c0, chunks - kCols), weights, v_head, table, first, len, s, v_scale, out, ahead);
  }

  template <int W, typename C, typename T>
  static void columns(int64_t c0, const float* weights, const C* v_head, const int32_t* table, int64_t first,
                      int64_t len, const Shape& s, float v_scale, T* out, Ahead& ahead) {
    const int64_t n = len - first;
    vec8 acc[G][W] = {};
    for_each_page(v_head, table, first, len, s, [&](const C* rows, int64_t p, int64_t stop) {
      vec8 sum[G][W];                              // a page's sums in registers (acc, captured, would be spilled)
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < W; ++c) sum[g][c] = acc[g][c];
      for (; p < stop; ++p, rows += s.head_dim) {
        if (c0 == 0) ahead.advance(G);
        for (int c = 0; c < W; ++c) {
          const vec8 v = vec::load8(rows + 8 * (c0 + c));
          for (int g = 0; g < G; ++g) sum[g][c] += weights[g * n + p - first] * v;
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < W; ++c) acc[g][c] = sum[g][c];
    });
    for (int g = 0; g < G; ++g) {
      T* o = out + g * s.head_dim + 8 * c0;
      for (int c = 0; c < W; ++c)
        for (int i = 0; i < 8; ++i) o[8 * c + i] = static_cast<T>(acc[g][c][i] * v_scale);
    }
  }
};

// A group's queries in runs of 8, then 4, then the rest: f(GroupRow<G>{}, first query of the run).
template <typename F>
void for_group_rows(int64_t group, F&& f) {
  for (int64_t g0 = 0; g0 < group;) {
    const int64_t left = group - g0;
    if (left >= 8) {
      f(GroupRow<8>{}, g0), g0 += 8;
    } else if (left >= 4) {
      f(GroupRow<4>{}, g0), g0 += 4;
    } else {
      switch (left) {
        case 1: f(GroupRow<1>{}, g0); break;
        case 2: f(GroupRow<2>{}, g0); break;
        default: f(GroupRow<3>{}, g0);
      }
      g0 += left;
    }
  }
}

// softmax(scores[g, 0:n]) in place for each of group rows, n apart; or (stats: [2, group]) each row's exp(score -
// its max) in place, the maxima and the sums of those in stats, for a part of a context.
inline void softmax_rows(float* scores, int64_t group, int64_t n, float* stats = nullptr) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * n;
    const float top = *std::max_element(row, row + n);
    vec8 total = {};
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
      const vec8 e = vec::exp8(vec::load8(row + p) - top);
      *reinterpret_cast<vec8*>(row + p) = e;
      total += e;
    }
    float sum = vec::sum1(total);
    for (; p < n; ++p) sum += row[p] = std::exp(row[p] - top);
    if (stats) {
      stats[g] = top, stats[group + g] = sum;
      continue;
    }
    const float inv = 1.f / sum;
    for (p = 0; p < n; ++p) row[p] *= inv;
  }
}

using attention_tiles::Tile;

// A decode row's item: its scores, their softmax and the weighted sums of V, pulling the next item's pages into the
// cache as it computes (spans: theirs, if the thread takes a decode row next). A part of a row's context (t.part)
// keeps its unnormalized sums, maxima and totals in parts + t.part ([group, head_dim], [group], [group]) for
// merge_parts.
template <typename T, typename C>
void run_row(const T* q, const C* k_cache, const C* v_cache, const int32_t* table, const Tile& t, const Shape& s,
             float scale, float v_scale, T* out, float* parts, const std::vector<vec::Span>& next,
             std::vector<float>& qf, std::vector<float>& scores) {
  const int64_t q_offset = t.first_row * s.q_row_stride + t.head * s.group * s.head_dim;
  const int64_t out_offset = (t.first_row * s.num_heads + t.head * s.group) * s.head_dim;
  const int64_t head_offset = t.head * s.cache_head_stride;
  Ahead ahead(next, s.group * (t.hi - t.lo));
  qf.resize(s.group * s.head_dim);
  scores.resize(std::max<size_t>(scores.size(), s.group * (t.hi - t.lo)));
  for (int64_t i = 0; i < s.group * s.head_dim; ++i) qf[i] = static_cast<float>(q[q_offset + i]) * scale;
  const int64_t n = t.hi - t.lo;
  for_group_rows(s.group, [&](auto rows, int64_t g0) {
    rows.scores(qf.data() + g0 * s.head_dim, k_cache + head_offset, table, t.lo, t.hi, s, scores.data() + g0 * n,
                ahead);
  });
  cap_scores(scores.data(), s.group * n, s.softcap);
  auto sums_into = [&](auto* dst, float dst_scale) {
    for_group_rows(s.group, [&](auto rows, int64_t g0) {
      rows.values(scores.data() + g0 * n, v_cache + head_offset, table, t.lo, t.hi, s, dst_scale,
                  dst + g0 * s.head_dim, ahead);
    });
  };
  if (t.part < 0) {
    softmax_rows(scores.data(), s.group, n);
    sums_into(out + out_offset, v_scale);
    return;
  }
  softmax_rows(scores.data(), s.group, n, parts + t.part + s.group * s.head_dim);
  sums_into(parts + t.part, 1.f);
}

// A decode row whose context went in parts: items [first, first + num_parts), consecutive.
struct Split {
  int64_t first, num_parts;
};

// out[g] = v_scale * sum_i exp(m_i - m) sums_i[g] / sum_i exp(m_i - m) total_i over a split row's parts, m the
// largest of their maxima m_i.
template <typename T>
void merge_parts(const std::vector<Tile>& items, const Split& split, const float* parts, const Shape& s,
                 float v_scale, T* out) {
  const Tile& t = items[split.first];
  const int64_t stats = s.group * s.head_dim;
  std::vector<float> weights(split.num_parts), acc(s.head_dim);
  for (int64_t g = 0; g < s.group; ++g) {
    float top = -__builtin_huge_valf(), total = 0.f;
    for (int64_t i = 0; i < split.num_parts; ++i) top = std::max(top, parts[items[split.first + i].part + stats + g]);
    for (int64_t i = 0; i < split.num_parts; ++i) {
      const float* part = parts + items[split.first + i].part;
      weights[i] = std::exp(part[stats + g] - top);
      total += weights[i] * part[stats + s.group + g];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t i = 0; i < split.num_parts; ++i) {
      const float* sums = parts + items[split.first + i].part + g * s.head_dim;
      for (int64_t d = 0; d < s.head_dim; ++d) acc[d] += weights[i] * sums[d];
    }
    T* o = out + (t.first_row * s.num_heads + t.head * s.group + g) * s.head_dim;
    const float factor = v_scale / total;
    for (int64_t d = 0; d < s.head_dim; ++d) o[d] = static_cast<T>(acc[d] * factor);
  }
}

// The step's items: a sequence with one query row (decode) gives a row per KV head, in parts of its context where
// it is longer than kPartPositions (splits; each part's place in a buffer of num_part_floats), one with more (a
// prompt chunk) tiles of up to attention_tiles::kRows rows per KV head, each head's tiles in turn (they share its
// pages). How a row splits depends on its own context alone, so its result does not depend on the rows beside it.
struct Plan {
  std::vector<Tile> items;
  std::vector<Split> splits;
  int64_t num_part_floats = 0;
};

Plan plan_items(const int32_t* seq_lens, const int32_t* query_starts, int64_t num_seqs, const Shape& s,
                int64_t window) {
  Plan plan;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t num_rows = query_starts[seq + 1] - query_starts[seq], first_pos = seq_lens[seq] - num_rows;
    TORCH_CHECK(num_rows >= 0 && first_pos >= 0, "sequence ", seq, ": more query rows than context");
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t r = 0; r < num_rows; r += attention_tiles::kRows) {
        const int64_t rows = std::min(attention_tiles::kRows, num_rows - r), pos = first_pos + r;
        const int64_t lo = window_start(pos, window), hi = pos + rows;
        const int64_t num_parts = num_rows == 1 ? (hi - lo + kPartPositions - 1) / kPartPositions : 1;
        if (num_parts <= 1) {
          plan.items.push_back({seq, h, query_starts[seq] + r, rows, pos, lo, hi});
          continue;
        }
        plan.splits.push_back({static_cast<int64_t>(plan.items.size()), num_parts});
        for (int64_t i = 0; i < num_parts; ++i) {
          const int64_t part_lo = lo + (hi - lo) * i / num_parts, part_hi = lo + (hi - lo) * (i + 1) / num_parts;
          plan.items.push_back({seq, h, query_starts[seq] + r, 1, pos, part_lo, part_hi, plan.num_part_floats});
          plan.num_part_floats += s.group * (s.head_dim + 2);
        }
      }
  }
  return plan;
}

// The caches hold T, or int8 (an INT8 KV cache: scale is the scores' times K's scale, v_scale V's scale).
template <typename T, typename C>
void attention(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables, const int32_t* seq_lens,
               const int32_t* query_starts, T* out, int64_t num_seqs, const Shape& s, float scale, float v_scale,
               int64_t window) {
  const Plan plan = plan_items(seq_lens, query_starts, num_seqs, s, window);
  const std::vector<Tile>& items = plan.items;
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items == 0) return;
  std::vector<int64_t> costs(num_items);
  for (int64_t i = 0; i < num_items; ++i) {
    const Tile& t = items[i];
    costs[i] = kItemCost + (t.hi - t.lo) * t.num_rows / (t.num_rows == 1 ? 1 : kTileRowsPerRow);
  }
  auto table_of = [&](const Tile& t) { return block_tables + t.seq * s.max_blocks; };
  const int num_threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), num_items));
  Claims claims(costs, num_threads);
  std::vector<float> parts(plan.num_part_floats);
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num();
    std::vector<float> qf, scores;
    std::vector<vec::Span> next;
    attention_tiles::Scratch scratch;
    for (int64_t i = claims.claim(thread); i >= 0; i = claims.claim(thread)) {
      const Tile& t = items[i];
      if (t.num_rows > 1) {
        attention_tiles::run_tile(q, k_cache, v_cache, table_of(t), t, s, scale, v_scale, window, out, scratch);
        continue;
      }
      next.clear();
      if (claims.is_next(thread, i + 1) && items[i + 1].num_rows == 1) {
        const Tile& u = items[i + 1];
        item_spans(k_cache + u.head * s.cache_head_stride, v_cache + u.head * s.cache_head_stride, table_of(u), u.lo,
                   u.hi, s, next);
      }
      run_row(q, k_cache, v_cache, table_of(t), t, s, scale, v_scale, out, parts.data(), next, qf, scores);
    }
    if (!plan.splits.empty()) {
#pragma omp barrier
#pragma omp for schedule(static)
      for (size_t i = 0; i < plan.splits.size(); ++i)
        merge_parts(items, plan.splits[i], parts.data(), s, v_scale, out);
    }
  }
}

}  // namespace

// q [num_rows, num_heads, head_dim]; k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim];
// block_tables [num_seqs, max_blocks], seq_lens [num_seqs] (context lengths, this step's rows included) and
// query_starts [num_seqs + 1] (sequence s has rows [query_starts[s], query_starts[s + 1])), all int32; window <= 0:
// none; softcap <= 0: none. Caches in q's dtype, bf16 beside fp32 q, or int8 or uint8 (an INT8 or FP8 KV cache, the
// FP8 one's bytes e4m3 bits: values times k_scale, v_scale).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_starts, double scale, int64_t window,
                              double softcap, double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  const bool quantized = k_cache.scalar_type() == torch::kInt8 || k_cache.scalar_type() == torch::kByte;
  TORCH_CHECK(quantized || (k_scale == 1.0 && v_scale == 1.0), "scales belong to an INT8 or FP8 cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  for (const auto& t : {block_tables, seq_lens, query_starts})
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.device().is_cpu(), "int32 tables on the CPU");
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(query_starts.numel() == num_seqs + 1 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "block_tables [num_seqs, max_blocks], seq_lens [num_seqs], query_starts [num_seqs + 1]");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();     // rows may stay apart (a qkv view)
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query_starts = query_starts.contiguous();
  TORCH_CHECK(query_starts.data_ptr<int32_t>()[0] == 0 && query_starts.data_ptr<int32_t>()[num_seqs] == q.size(0),
              "query_starts must run from 0 to q's rows");
  auto out = torch::empty(q.sizes(), q.options());
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  TORCH_CHECK(head_dim == k_cache.size(3) && num_heads % num_kv_heads == 0, "head shapes do not match the cache");
  TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
  const Shape shape{num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim, k_cache.stride(0), block_size,
                    block_tables.size(1), q.stride(0), static_cast<float>(softcap)};
  const auto tables = block_tables.data_ptr<int32_t>();
  const auto lens = seq_lens.data_ptr<int32_t>();
  const auto starts = query_starts.data_ptr<int32_t>();
  const float k_scaled = static_cast<float>(scale * k_scale);        // (scales of 1 but for a quantized cache)
  dispatch_kv_cache(q, k_cache, v_cache, [&](auto* q_data, auto* k_data, auto* v_data) {
    using T = std::remove_pointer_t<decltype(q_data)>;
    attention(q_data, k_data, v_data, tables, lens, starts, out.data_ptr<T>(), num_seqs, shape, k_scaled,
              static_cast<float>(v_scale), window);
  });
  return out;
}

torch::Tensor add_rms_norm_op(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                              double eps);
torch::Tensor silu_and_mul_op(torch::Tensor gate_up);
void rotary_and_cache_op(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                         torch::Tensor cos_sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                         double k_scale, double v_scale);
void lora_apply(torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor ranks, torch::Tensor bounds,
                torch::Tensor m, torch::Tensor dora, int64_t max_rank, torch::Tensor starts, torch::Tensor slots,
                torch::Tensor out);
torch::Tensor linear_lora(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                          torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor ranks, torch::Tensor bounds,
                          torch::Tensor m, torch::Tensor dora, int64_t max_rank, torch::Tensor starts,
                          torch::Tensor slots);
torch::Tensor pack_linear(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias);
torch::Tensor int8_panel_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale,
                                std::optional<torch::Tensor> bias);
torch::Tensor int4_panel_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale, torch::Tensor zero,
                                int64_t group_size, std::optional<torch::Tensor> bias);
torch::Tensor fp8_panel_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale, int64_t group_size,
                               std::optional<torch::Tensor> bias);
bool amx_available();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor pairs, std::optional<torch::Tensor> bias);
torch::Tensor amx_dequantized_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale,
                                     std::optional<torch::Tensor> zero, int64_t group_size,
                                     std::optional<torch::Tensor> bias);
torch::Tensor dequantize_panels(torch::Tensor panels, torch::Tensor scale, std::optional<torch::Tensor> zero,
                                int64_t group_size, at::ScalarType dtype);
void expert_lora_add(torch::Tensor x, int64_t rows_per_x, torch::Tensor row_slots, torch::Tensor row_experts,
                     int64_t num_experts, torch::Tensor a, std::vector<torch::Tensor> bs, torch::Tensor slot_ranks,
                     torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every op lets go of the GIL while it computes: a server's other Python threads (its request handler parsing an
  // adapter upload, its responder) would otherwise wait out each of them, a prefill step's GEMMs included.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, "Attention over the paged KV cache, read in place", no_gil);
  m.def("add_rms_norm", &add_rms_norm_op, "Residual add (in place) + RMSNorm", no_gil);
  m.def("silu_and_mul", &silu_and_mul_op, "SiLU(gate) * up", no_gil);
  m.def("rotary_and_cache", &rotary_and_cache_op, "RoPE of q and k in place, k and v into the cache", no_gil);
  m.def("lora_apply", &lora_apply, "LoRA shrink and expand of every band of a projection, in place", no_gil);
  m.def("linear_lora", &linear_lora, "panel_linear + LoRA, the adapter rows prefetched during the GEMM", no_gil);
  m.def("pack_linear", &pack_linear, "fp32 weight [N, K] into panels [N / 16, K, 16]", no_gil);
  m.def("panel_linear", &panel_linear, "x @ W^T (+ bias) over a weight in panels", no_gil);
  m.def("int8_panel_linear", &int8_panel_linear, "(x @ W^T) * scale (+ bias) over an INT8 weight in panels", no_gil);
  m.def("int4_panel_linear", &int4_panel_linear, "x @ W^T (+ bias) over an INT4 weight in panels", no_gil);
  m.def("fp8_panel_linear", &fp8_panel_linear, "x @ W^T (+ bias) over an FP8 weight in panels", no_gil);
  m.def("dequantize_panels", &dequantize_panels, "The weight quantized panels encode, [N, K] in bf16 or fp16", no_gil);
  m.def("amx_available", &amx_available, "Whether amx_linear runs here (AMX-BF16 tiles granted)");
  m.def("amx_linear", &amx_linear, "x @ W^T (+ bias) in bf16 on AMX tiles over a weight in pair panels", no_gil);
  m.def("amx_dequantized_linear", &amx_dequantized_linear,
        "x @ W^T (+ bias) in bf16 on AMX tiles over a quantized weight in panels, dequantized group by group", no_gil);
  m.def("expert_lora_add", &expert_lora_add, "Each row's LoRA through its own group's A and B, added (a mixture's)",
        no_gil);
  m.def("claim_order", [](const std::vector<int64_t>& costs, int num_threads, const std::vector<int>& turns) {
    Claims claims(costs, num_threads);
    std::vector<int64_t> items;
    for (int thread : turns) items.push_back(claims.claim(thread));
    return items;
  }, "The items threads taking turns claim (claims.h), for tests");
}
