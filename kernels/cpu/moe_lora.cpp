// A mixture's LoRA for a decode step's rows, each row through its own group's matrices (a (slot, expert) pair of
// the expert slots, or a slot): h = x[i] @ A[g].T, A's rank rows cut into parts, part j expanded by B_j[g] ([out_j,
// rank] rows) into its own columns of the result. Only the group's own rank rows and columns are read (its rank
// rounded up to 8: the slots are zero past it). Read in place, each row's A and B streamed once (the torch reference
// gathers them into a copy first); sums in fp32. Rows are shared among the threads.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

using namespace vec;

template <typename X, typename W>
void rows_lora(const X* x, int64_t x_stride, const W* a, int64_t a_stride, int64_t rank_rows, int64_t in_dim,
               const std::vector<const W*>& bs, const std::vector<int64_t>& b_strides,
               const std::vector<int64_t>& widths, const int64_t* groups, const int64_t* ranks, int64_t num_rows,
               float* out, int64_t out_stride) {
  const int64_t num_parts = static_cast<int64_t>(bs.size());
  const int64_t part_rank = rank_rows / num_parts;
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(rank_rows);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = groups[i];
      const int64_t rank = std::min((ranks[g] + 7) / 8 * 8, part_rank);
      const W* a_g = a + g * a_stride;
      float* o = out + i * out_stride;
      for (int64_t j = 0; j < num_parts; ++j) {
        float* h_j = h.data() + j * part_rank;
        for (int64_t r = 0; r < rank; r += 8) {                    // shrink, eight rank rows at a time
          const vec8 sums = dot8(x + i * x_stride, a_g + (j * part_rank + r) * in_dim, in_dim, in_dim);
          __builtin_memcpy(h_j + r, &sums, sizeof(sums));
        }
        const W* b_g = bs[j] + g * b_strides[j];
        for (int64_t c = 0; c < widths[j]; c += 8) {               // expand into the part's columns
          const vec8 sums = rank ? dot8(h_j, b_g + c * part_rank, part_rank, rank) : vec8{};
          __builtin_memcpy(o + c, &sums, sizeof(sums));
        }
        o += widths[j];
      }
    }
  });
}

}  // namespace

// x [n, in]; a [groups, rank_rows, in] (contiguous); bs: [groups, out_j, rank_rows / len(bs)] with contiguous rows;
// groups [n] int64; ranks [groups] int64 (each group's rank, at most rank_rows / len(bs)) -> [n, sum out_j] fp32.
// Every width (in, rank, out_j) a multiple of 8.
torch::Tensor expert_lora_rows(torch::Tensor x, torch::Tensor a, std::vector<torch::Tensor> bs, torch::Tensor groups,
                               torch::Tensor ranks) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && a.dim() == 3 && a.is_contiguous(), "x [n, in], a [g, r, in]");
  TORCH_CHECK(groups.scalar_type() == at::kLong && groups.is_contiguous(), "groups: int64");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.numel() == a.size(0), "ranks");
  const int64_t n = x.size(0), in_dim = x.size(1), rank_rows = a.size(1);
  TORCH_CHECK(a.size(2) == in_dim && in_dim % 8 == 0 && rank_rows % (8 * bs.size()) == 0, "widths of 8s");
  std::vector<int64_t> widths, b_strides;
  int64_t total = 0;
  for (const auto& b : bs) {
    TORCH_CHECK(b.dim() == 3 && b.stride(2) == 1 && b.stride(1) == b.size(2) && b.size(2) * static_cast<int64_t>(
        bs.size()) == rank_rows && b.size(1) % 8 == 0 && b.scalar_type() == a.scalar_type(), "b [g, out, r]");
    widths.push_back(b.size(1));
    b_strides.push_back(b.stride(0));
    total += b.size(1);
  }
  auto out = torch::empty({n, total}, x.options().dtype(at::kFloat));
  DISPATCH_KERNEL_TYPES(x.scalar_type(), "expert_lora_rows", [&] {
    using X = scalar_t;
    DISPATCH_KERNEL_TYPES(a.scalar_type(), "expert_lora_rows", [&] {
      std::vector<const scalar_t*> b_ptrs;
      for (const auto& b : bs) b_ptrs.push_back(b.data_ptr<scalar_t>());
      rows_lora<X, scalar_t>(x.data_ptr<X>(), x.stride(0), a.data_ptr<scalar_t>(), a.stride(0), rank_rows, in_dim,
                             b_ptrs, b_strides, widths, groups.data_ptr<int64_t>(), ranks.data_ptr<int64_t>(), n,
                             out.data_ptr<float>(), total);
    });
  });
  return out;
}
