// A mixture's LoRA for the rows of any step, added in place: each row i with an adapter (slot s = row_slots[i] >= 0)
// through its own group's matrices, g = s * num_experts + row_experts[i] (a (slot, expert) pair of the expert slots;
// with one "expert", a slot): h = x[i / rows_per_x] @ A[g].T, A's rank rows cut into parts, part j expanded by B_j[g]
// ([out_j, rank] rows) and added into its own columns of out[i]. Only the slot's own rank rows and columns are read
// (its rank rounded up to 8: the slots are zero past it), in place; sums in fp32, rounded once into out. The adapted
// rows are taken group by group (a counting sort), so the rows of a (slot, expert) pair follow one another on one
// thread while its matrices are in the cache: a prompt chunk's many rows of a pair read them from memory about once.
// The sorted rows are shared among the threads in runs.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

using namespace vec;

struct Rows {
  const int32_t* slots;
  const int64_t* experts;
  int64_t num_experts, rows_per_x, num_rows;
  const int64_t* slot_ranks;
};

// The adapted rows (slot >= 0) in group order, g = slot * num_experts + expert.
std::vector<int64_t> rows_by_group(const Rows& rows, int64_t num_groups) {
  std::vector<int64_t> starts(num_groups + 1, 0);
  for (int64_t i = 0; i < rows.num_rows; ++i) {
    if (rows.slots[i] < 0) continue;
    const int64_t g = rows.slots[i] * rows.num_experts + rows.experts[i];
    TORCH_CHECK(rows.experts[i] >= 0 && rows.experts[i] < rows.num_experts && g < num_groups, "row ", i,
                ": slot ", rows.slots[i], ", expert ", rows.experts[i], " past the groups");
    ++starts[g + 1];
  }
  for (int64_t g = 0; g < num_groups; ++g) starts[g + 1] += starts[g];
  std::vector<int64_t> order(starts[num_groups]);
  for (int64_t i = 0; i < rows.num_rows; ++i)
    if (rows.slots[i] >= 0) order[starts[rows.slots[i] * rows.num_experts + rows.experts[i]]++] = i;
  return order;
}

template <typename X, typename W>
void add_rows_lora(const X* x, int64_t x_stride, const W* a, int64_t a_stride, int64_t rank_rows, int64_t in_dim,
                   const std::vector<const W*>& bs, const std::vector<int64_t>& b_strides,
                   const std::vector<int64_t>& widths, const Rows& rows, const std::vector<int64_t>& order,
                   X* out, int64_t out_stride) {
  const int64_t num_parts = static_cast<int64_t>(bs.size());
  const int64_t part_rank = rank_rows / num_parts;
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(rank_rows);
    alignas(32) float sums[8];
    for (int64_t position = begin; position < end; ++position) {
      const int64_t i = order[position];
      const int64_t slot = rows.slots[i];
      const int64_t g = slot * rows.num_experts + rows.experts[i];
      const int64_t rank = std::min((rows.slot_ranks[slot] + 7) / 8 * 8, part_rank);
      if (rank == 0) continue;
      const X* x_i = x + (i / rows.rows_per_x) * x_stride;
      const W* a_g = a + g * a_stride;
      X* o = out + i * out_stride;
      for (int64_t j = 0; j < num_parts; ++j) {
        float* h_j = h.data() + j * part_rank;
        for (int64_t r = 0; r < rank; r += 8) {                    // shrink, eight rank rows at a time
          const vec8 s = dot8(x_i, a_g + (j * part_rank + r) * in_dim, in_dim, in_dim);
          __builtin_memcpy(h_j + r, &s, sizeof(s));
        }
        const W* b_g = bs[j] + g * b_strides[j];
        for (int64_t c = 0; c < widths[j]; c += 8) {               // expand into the part's columns
          const vec8 s = dot8(h_j, b_g + c * part_rank, part_rank, rank);
          __builtin_memcpy(sums, &s, sizeof(s));
          for (int l = 0; l < 8; ++l) o[c + l] = static_cast<X>(static_cast<float>(o[c + l]) + sums[l]);
        }
        o += widths[j];
      }
    }
  });
}

}  // namespace

// out [n, sum out_j] += each adapted row's LoRA. x [n / rows_per_x, in]; row_slots [n] int32 (-1: none);
// row_experts [n] int64; a [groups, rank_rows, in] (contiguous); bs: [groups, out_j, rank_rows / len(bs)] with
// contiguous rows; slot_ranks [slots] int64. Every width (in, rank, out_j) a multiple of 8.
void expert_lora_add(torch::Tensor x, int64_t rows_per_x, torch::Tensor row_slots, torch::Tensor row_experts,
                     int64_t num_experts, torch::Tensor a, std::vector<torch::Tensor> bs, torch::Tensor slot_ranks,
                     torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && a.dim() == 3 && a.is_contiguous(), "x [n, in], a [g, r, in]");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous(), "row_slots: int32");
  TORCH_CHECK(row_experts.scalar_type() == at::kLong && row_experts.is_contiguous(), "row_experts: int64");
  TORCH_CHECK(slot_ranks.scalar_type() == at::kLong && slot_ranks.is_contiguous(), "slot_ranks: int64");
  const int64_t n = row_slots.numel(), in_dim = x.size(1), rank_rows = a.size(1);
  TORCH_CHECK(a.size(2) == in_dim && in_dim % 8 == 0 && rank_rows % (8 * bs.size()) == 0, "widths of 8s");
  TORCH_CHECK(row_experts.numel() == n && x.size(0) * rows_per_x == n && a.size(0) == slot_ranks.numel() *
              num_experts, "rows, groups");
  std::vector<int64_t> widths, b_strides;
  int64_t total = 0;
  for (const auto& b : bs) {
    TORCH_CHECK(b.dim() == 3 && b.stride(2) == 1 && b.stride(1) == b.size(2) && b.size(2) * static_cast<int64_t>(
        bs.size()) == rank_rows && b.size(1) % 8 == 0 && b.scalar_type() == a.scalar_type(), "b [g, out, r]");
    widths.push_back(b.size(1));
    b_strides.push_back(b.stride(0));
    total += b.size(1);
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == total && out.stride(1) == 1 &&
              out.scalar_type() == x.scalar_type(), "out [n, sum out_j] in x's dtype");
  const Rows rows{row_slots.data_ptr<int32_t>(), row_experts.data_ptr<int64_t>(), num_experts, rows_per_x, n,
                  slot_ranks.data_ptr<int64_t>()};
  const std::vector<int64_t> order = rows_by_group(rows, a.size(0));
  DISPATCH_KERNEL_TYPES(x.scalar_type(), "expert_lora_add", [&] {
    using X = scalar_t;
    DISPATCH_KERNEL_TYPES(a.scalar_type(), "expert_lora_add", [&] {
      std::vector<const scalar_t*> b_ptrs;
      for (const auto& b : bs) b_ptrs.push_back(b.data_ptr<scalar_t>());
      add_rows_lora<X, scalar_t>(x.data_ptr<X>(), x.stride(0), a.data_ptr<scalar_t>(), a.stride(0), rank_rows, in_dim,
                                 b_ptrs, b_strides, widths, rows, order, out.data_ptr<X>(),
                                 out.stride(0));
    });
  });
}
