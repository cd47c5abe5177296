// Eight floats at a time for the compiled CPU kernels (x86-64-v3: AVX2, FMA, F16C): loads that convert bf16, fp16
// and int8 on the way in, a horizontal sum of eight vectors at once, and exp.
#pragma once
#include <array>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the compiled CPU kernels need AVX2, FMA and F16C (x86-64-v3)"
#endif

// The dtypes the kernels take: fp32, bf16, fp16 (scalar_t inside, as with AT_DISPATCH_*).
#define DISPATCH_KERNEL_TYPES(TYPE, NAME, ...)                                                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                                    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// f(q's data, K cache's, V cache's), each pointer of its type, for the KV caches the kernels read: in q's dtype, bf16
// beside fp32 q (dtype auto where the CPU has no bf16 arithmetic), int8 (an INT8 cache) or uint8 (an FP8 cache's
// e4m3 bits) beside any of the kernels' dtypes.
template <typename F>
void dispatch_kv_cache(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, F&& f) {
  const auto type = k_cache.scalar_type();
  const bool bf16_beside_fp32 = type == torch::kBFloat16 && q.scalar_type() == torch::kFloat32;
  TORCH_CHECK(v_cache.scalar_type() == type &&
                  (type == q.scalar_type() || type == torch::kInt8 || type == torch::kByte || bf16_beside_fp32),
              "the caches in q's dtype, bf16 beside fp32 q, int8 or uint8 (e4m3 bits)");
  if (bf16_beside_fp32)
    return f(q.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  DISPATCH_KERNEL_TYPES(q.scalar_type(), "q beside a KV cache", [&] {
    if (type == torch::kInt8)
      f(q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else if (type == torch::kByte)
      f(q.data_ptr<scalar_t>(), k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>());
    else
      f(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
}

namespace vec {

using vec8 = float __attribute__((vector_size(32), aligned(4)));   // unaligned loads and stores
constexpr int64_t kLineBytes = 64;                                 // the unit a prefetch pulls in

// Bytes a kernel reads later, as whole cache lines; a kernel reading something else meanwhile can pull them into
// the cache a line at a time (LineCursor), so that they come from there instead of from memory.
struct Span {
  const char* first_line;
  int64_t num_lines;
};

inline Span span(const void* p, int64_t num_bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(p) / kLineBytes;
  const auto end = (reinterpret_cast<uintptr_t>(p) + num_bytes + kLineBytes - 1) / kLineBytes;
  return {reinterpret_cast<const char*>(begin * kLineBytes), static_cast<int64_t>(end - begin)};
}

inline int64_t num_lines(const std::vector<Span>& spans) {
  int64_t total = 0;
  for (const Span& s : spans) total += s.num_lines;
  return total;
}

// The lines of `spans` in order from the line-th on.
class LineCursor {
 public:
  LineCursor(const std::vector<Span>& spans, int64_t line) : span_(spans.data()), end_(spans.data() + spans.size()) {
    while (span_ != end_ && line >= span_->num_lines) line -= (span_++)->num_lines;
    line_ = line;
  }
  void prefetch_next() {
    if (span_ == end_) return;
    _mm_prefetch(span_->first_line + kLineBytes * line_, _MM_HINT_T1);
    if (++line_ == span_->num_lines) ++span_, line_ = 0;
  }

 private:
  const Span* span_;
  const Span* end_;
  int64_t line_ = 0;
};

inline __m256 m(vec8 x) { return reinterpret_cast<__m256>(x); }
inline vec8 v(__m256 x) { return reinterpret_cast<vec8>(x); }

// An FP8 KV cache's 256 e4m3 values by their bits (c10's conversion, once).
inline const float* e4m3_values() {
  static const auto table = [] {
    std::array<float, 256> values{};
    for (int b = 0; b < 256; ++b)
      values[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return values;
  }();
  return table.data();
}

// One value as fp32: an FP8 cache's byte through e4m3_values, any other converted.
template <typename T>
inline float load1(const T* p) {
  if constexpr (std::is_same_v<T, uint8_t>)
    return e4m3_values()[*p];
  else
    return static_cast<float>(*p);
}

template <typename T>
inline vec8 load8(const T* p) {
  if constexpr (std::is_same_v<T, int8_t>) {                      // an INT8 KV cache's values, as they are
    return v(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  } else if constexpr (std::is_same_v<T, uint8_t>) {              // an FP8 KV cache's e4m3 bits: moved into fp16s
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));   // (the sign to bit 15, exponent
    const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),   // and mantissa to 13..7),
                                       _mm_set1_epi16(static_cast<int16_t>(0xBF80)));  // 2^-8 times the value
    return v(_mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f)));
  } else if constexpr (std::is_same_v<T, float>) {
    return *reinterpret_cast<const vec8*>(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return v(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "float, bf16, fp16, int8 or uint8 (e4m3)");
    return v(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

// [sum(a[0]), ..., sum(a[7])]
inline vec8 sum8(const vec8* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(m(a[0]), m(a[1])), _mm256_hadd_ps(m(a[2]), m(a[3])));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(m(a[4]), m(a[5])), _mm256_hadd_ps(m(a[6]), m(a[7])));
  return v(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

inline float sum1(vec8 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(m(a)), _mm256_extractf128_ps(m(a), 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// [x_i . rows[r] for i < N, r < kRows] (i major; lanes past N * kRows 0) over n values (a multiple of 8): N vectors
// x_i, x_stride apart, against kRows rows (8 / N by default), row_stride apart. Up to eight sums side by side, so none
// waits on another, and each row is loaded (and converted) once for all N. prefetch (or nullptr): the kRows rows
// (row_stride apart) read next, pulled into the cache on the way a line at a time, so a run of rows streams from
// memory as in a GEMV. Each sum's lanes add up in sum8's order, whichever lane it takes.
template <int N, int kRows = 8 / N, typename X, typename R>
inline vec8 dot_tile(const X* x, int64_t x_stride, const R* rows, int64_t row_stride, int64_t n,
                     const R* prefetch = nullptr) {
  static_assert(N >= 1 && kRows >= 1 && N * kRows <= 8, "at most 8 sums");
  constexpr int64_t kLineValues = kLineBytes / sizeof(R);
  vec8 acc[8] = {};
  for (int64_t k = 0; k < n; k += 8) {
    if (prefetch && k % kLineValues == 0)
      for (int r = 0; r < kRows; ++r) __builtin_prefetch(prefetch + r * row_stride + k);
    vec8 xv[N];
    for (int i = 0; i < N; ++i) xv[i] = load8(x + i * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      const vec8 w = load8(rows + r * row_stride + k);
      for (int i = 0; i < N; ++i) acc[i * kRows + r] += xv[i] * w;
    }
  }
  return sum8(acc);
}

// [x . rows[0], ..., x . rows[7]]
template <typename X, typename R>
inline vec8 dot8(const X* x, const R* rows, int64_t row_stride, int64_t n) {
  return dot_tile<1>(x, 0, rows, row_stride, n);
}

// x . row over n values (a multiple of 8).
template <typename X, typename R>
inline float dot1(const X* x, const R* row, int64_t n) {
  vec8 acc = {};
  for (int64_t k = 0; k < n; k += 8) acc += load8(x + k) * load8(row + k);
  return sum1(acc);
}

// exp(x), within 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 Taylor polynomial for exp(r), 2^n in the
// exponent bits. Below -87.3 it gives exp(-87.3) (no denormals), past ln(FLT_MAX) inf; NaN stays NaN.
inline vec8 exp8(vec8 x) {
  const __m256 nan = _mm256_cmp_ps(m(x), m(x), _CMP_UNORD_Q);
  __m256 t = _mm256_min_ps(_mm256_max_ps(m(x), _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  t = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);          // ln2, split in two for an exact r
  t = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), t);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_or_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), nan);
  const __m256 over = _mm256_cmp_ps(m(x), _mm256_set1_ps(88.7228f), _CMP_GT_OQ);      // past FLT_MAX: inf
  return v(_mm256_blendv_ps(result, _mm256_set1_ps(__builtin_huge_valf()), over));
}

}  // namespace vec
