// Decode attention over the paged KV cache, read in place: one query per sequence, the GQA group of a KV head
// together, so each page of K and V is read once per group. Parallel over (sequence, KV head) on ATen's pool;
// nothing at or past a sequence's length is read.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// A K or V row as fp32: the cache row itself for fp32 caches, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

// Three passes: the scores of every (sequence, KV head) item into one [items, group, max_len] buffer (-inf past
// each context), one vectorized softmax over it, then the weighted sums of V.
template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables, const int64_t* seq_lens,
            T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t cache_head_stride, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads, num_items = num_seqs * num_kv_heads;
  auto first_of = [&](int64_t s) { return window > 0 ? std::max<int64_t>(0, seq_lens[s] - window) : 0; };
  int64_t max_len = 1;
  for (int64_t s = 0; s < num_seqs; ++s) max_len = std::max(max_len, seq_lens[s] - first_of(s));
  auto scores = torch::full({num_items, group, max_len}, -std::numeric_limits<float>::infinity());
  float* score_data = scores.data_ptr<float>();
  auto row_of = [&](const T* head, const int32_t* table, int64_t p) {
    return head + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * head_dim;
  };
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), buffer(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads, first = first_of(s);
      const T* q_group = q + (s * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(q_group[i]) * scale;
      const T* k_head = k_cache + h * cache_head_stride;
      const int32_t* table = block_tables + s * max_blocks;
      float* item_scores = score_data + item * group * max_len;
      for (int64_t p = first; p < seq_lens[s]; ++p) {
        const float* k = as_float(row_of(k_head, table, p), buffer.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
          item_scores[g * max_len + (p - first)] = dot;
        }
      }
    }
  });
  scores = scores.softmax(-1);
  score_data = scores.data_ptr<float>();
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), buffer(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads, first = first_of(s);
      const T* v_head = v_cache + h * cache_head_stride;
      const int32_t* table = block_tables + s * max_blocks;
      const float* item_scores = score_data + item * group * max_len;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p < seq_lens[s]; ++p) {
        const float* v = as_float(row_of(v_head, table, p), buffer.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float w = item_scores[g * max_len + (p - first)];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * v[d];
        }
      }
      T* o = out + (s * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim];
// block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int64; window <= 0: none.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables int32, seq_lens int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  TORCH_CHECK(head_dim == k_cache.size(3) && num_heads % num_kv_heads == 0, "head shapes do not match the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                     num_seqs, num_heads, num_kv_heads, head_dim, k_cache.stride(0), block_size,
                     block_tables.size(1), static_cast<float>(scale), window);
  });
  return out;
}

torch::Tensor add_rms_norm_op(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                              double eps);
torch::Tensor silu_and_mul_op(torch::Tensor gate_up);
void rotary_and_cache_op(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                         torch::Tensor cos_sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
void lora_apply(torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, std::vector<int64_t> starts,
                std::vector<int64_t> slots, std::vector<int64_t> ranks, torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Paged decode attention read in place");
  m.def("add_rms_norm", &add_rms_norm_op, "Residual add (in place) + RMSNorm");
  m.def("silu_and_mul", &silu_and_mul_op, "SiLU(gate) * up");
  m.def("rotary_and_cache", &rotary_and_cache_op, "RoPE of q and k in place, k and v into the cache");
  m.def("lora_apply", &lora_apply, "LoRA shrink and expand of one module band, in place");
}
