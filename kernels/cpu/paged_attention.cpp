// Decode attention over the paged KV cache, read in place: one query per sequence, the GQA group of a KV head
// together, so each page of K and V is read once per group. Parallel over (sequence, KV head) on ATen's pool.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables, const int64_t* seq_lens,
            T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t cache_head_stride, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores, kf(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = seq_lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const T* q_group = q + (s * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(q_group[i]) * scale;
      scores.assign(group * n, 0.f);
      const T* k_head = k_cache + h * cache_head_stride;
      const T* v_head = v_cache + h * cache_head_stride;
      const int32_t* table = block_tables + s * max_blocks;
      for (int64_t p = first; p < len; ++p) {
        const T* k = k_head + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
          scores[g * n + (p - first)] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * n;
        const float top = *std::max_element(row, row + n);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) sum += (row[i] = std::exp(row[i] - top));
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) row[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p < len; ++p) {
        const T* v = v_head + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * n + (p - first)];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * kf[d];
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
