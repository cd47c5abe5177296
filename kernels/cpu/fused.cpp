// Elementwise work of a layer fused into single passes: residual add + RMSNorm, SiLU-and-mul, and RoPE with the
// KV-cache write. Rounding follows the torch reference op by op (each torch op rounds to the tensor's dtype); only
// the order of the fp32 sums differs.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>

#include "vec.h"

namespace {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t num_tokens, int64_t hidden, float eps) {
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * hidden;
      T* ot = out + t * hidden;
      if (residual) {                                             // residual += x; the sum is what is normed
        T* rt = residual + t * hidden;
        for (int64_t i = 0; i < hidden; ++i)
          rt[i] = static_cast<T>(static_cast<float>(xt[i]) + static_cast<float>(rt[i]));
        xt = rt;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += static_cast<float>(xt[i]) * static_cast<float>(xt[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i)
        ot[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(static_cast<float>(xt[i]) * inv));
    }
  });
}

// silu(g) * u, eight columns at a time with a vectorized exp; the tail (width % 8) in scalar code.
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t num_tokens, int64_t width) {
  auto silu = [](float g) { return round_to<T>(g / (1.f + std::exp(-g))); };
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gate_up + t * 2 * width;
      const T* u = g + width;
      T* o = out + t * width;
      int64_t i = 0;
      for (; i + 8 <= width; i += 8) {
        const vec::vec8 gv = vec::load8(g + i);
        vec::vec8 sv = gv / (1.f + vec::exp8(-gv));
        if constexpr (std::is_same_v<T, float>) {
          *reinterpret_cast<vec::vec8*>(o + i) = sv * vec::load8(u + i);
        } else {
          const vec::vec8 uv = vec::load8(u + i);
          for (int j = 0; j < 8; ++j) o[i + j] = static_cast<T>(round_to<T>(sv[j]) * uv[j]);
        }
      }
      for (; i < width; ++i) o[i] = static_cast<T>(silu(static_cast<float>(g[i])) * static_cast<float>(u[i]));
    }
  });
}

// Neox RoPE of one head in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, cos/sin rounded to T first.
template <typename T>
inline void rotate(T* x, const float* cs, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_to<T>(cs[i]), s = round_to<T>(cs[half + i]);
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    x[i] = static_cast<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    x[half + i] = static_cast<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

// x as an INT8 KV cache holds it: floor(x * inv + 0.5) clamped to [-127, 127] in fp32, the product rounded before
// the sum (kernels/quant.quantize_kv; volatile: no fused multiply-add).
inline int8_t quantize(float x, float inv) {
  volatile float scaled = x * inv;
  return static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::floor(scaled + 0.5f))));
}

// x as an FP8 KV cache holds it: the e4m3 bits of x * inv clamped to [-448, 448] (c10's rounding, torch's own:
// nearest, ties to even; kernels/quant.quantize_kv).
inline uint8_t quantize_fp8(float x, float inv) {
  volatile float scaled = x * inv;
  return c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, static_cast<float>(scaled)))).x;
}

template <typename T, typename C>
inline void store_row(C* cache, const T* x, int64_t n, float inv) {
  for (int64_t d = 0; d < n; ++d) {
    if constexpr (std::is_same_v<C, int8_t>)
      cache[d] = quantize(static_cast<float>(x[d]), inv);
    else if constexpr (std::is_same_v<C, uint8_t>)
      cache[d] = quantize_fp8(static_cast<float>(x[d]), inv);
    else
      cache[d] = static_cast<C>(x[d]);
  }
}

// C: the caches' type, T, bf16 beside float T (rounded to nearest even, as torch's .to(bfloat16)), int8 or uint8
// (e4m3 bits) (quantized against the inverses of K's and V's scales).
template <typename T, typename C>
void rotary_and_cache(T* q, T* k, const T* v, const int32_t* positions, const float* cos_sin, C* k_cache,
                      C* v_cache, const int32_t* slots, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t q_stride, int64_t kv_stride, int64_t cache_head_stride, float inv_k,
                      float inv_v) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, num_tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) rotate(q + t * q_stride + h * head_dim, cs, half);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        T* kh = k + t * kv_stride + h * head_dim;
        rotate(kh, cs, half);
        const T* vh = v + t * kv_stride + h * head_dim;
        const int64_t row = h * cache_head_stride + static_cast<int64_t>(slots[t]) * head_dim;
        store_row(k_cache + row, kh, head_dim, inv_k);
        store_row(v_cache + row, vh, head_dim, inv_v);
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1), name, " must be contiguous [rows, dim]");
}

}  // namespace

// x [num_tokens, hidden]; residual (optional) is updated in place to residual + x; returns rms_norm of that sum.
torch::Tensor add_rms_norm_op(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                              double eps) {
  check_rows(x, "x");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual like x");
  }
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight [hidden] in x's dtype");
  auto out = torch::empty_like(x);
  DISPATCH_KERNEL_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                           weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                           static_cast<float>(eps));
  });
  return out;
}

// gate_up [num_tokens, 2 * width] -> silu(gate) * up [num_tokens, width]
torch::Tensor silu_and_mul_op(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t width = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
  DISPATCH_KERNEL_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), width);
  });
  return out;
}

// q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] rotated in place (rows may be
// views into one qkv row); k and v written to the cache slots [num_kv_heads, num_blocks, block_size, head_dim] (an
// int8 or uint8 (e4m3) cache: quantized against k_scale and v_scale; a bf16 cache beside fp32 q, k, v: rounded).
void rotary_and_cache_op(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                         torch::Tensor cos_sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                         double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
              v.strides() == k.strides(), "q, k, v heads must be contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos_sin.is_contiguous() &&
              cos_sin.scalar_type() == torch::kFloat32, "contiguous caches, fp32 cos_sin");
  TORCH_CHECK(positions.scalar_type() == torch::kInt32 && slots.scalar_type() == torch::kInt32, "int32 indices");
  positions = positions.contiguous();
  slots = slots.contiguous();
  const float inv_k = static_cast<float>(1.0 / k_scale), inv_v = static_cast<float>(1.0 / v_scale);
  dispatch_kv_cache(q, k_cache, v_cache, [&](auto* q_data, auto* k_data, auto* v_data) {
    using T = std::remove_pointer_t<decltype(q_data)>;
    rotary_and_cache<T>(q_data, k.data_ptr<T>(), v.data_ptr<T>(), positions.data_ptr<int32_t>(),
                        cos_sin.data_ptr<float>(), k_data, v_data, slots.data_ptr<int32_t>(), q.size(0), q.size(1),
                        k.size(1), q.size(2), q.stride(0), k.stride(0), k_cache.stride(0), inv_k, inv_v);
  });
}
