// Projections over weights kept in column panels: W [N, K] stored as [N / 16, K, 16], so each k of a panel is
// one 64-byte line in fp32, half a line in bf16 (widened as it loads), a quarter in INT8 (converted as it loads,
// its columns scaled once at the end: weight-only INT8, one scale per output channel), an eighth in INT4 (each
// group's sums shifted by its zero points and scaled), a quarter in FP8 (converted through fp16 and scaled as it
// loads). A 6 x 16 output tile lives in registers (AVX2: 12; AVX-512: 6 x 4, see tile), fed per k by that line
// and 6 broadcasts of x; on AVX2 one or two rows take 4 or 2 panels at once. Where the CPU has AMX-BF16, bf16
// weights beside bf16 x are read by its tiles instead (amx_gemm), and quantized ones from a few rows
// (amx_dequantized_linear).
// Threads claim groups of panels (claims.h); a group stays in L2 while each 6-row tile of x meets it in turn. A step
// reads every weight from memory once (the layers are far larger than the caches), and those reads must hide behind
// the FMAs: every tile call of a group prefetches its share of the thread's next group's lines, spread over its k
// loop, so memory and compute overlap for any number of rows (prefetching only in the first row tile's pass left it
// memory-bound and the later passes compute-only: 32-row steps took 17% longer). A thread's first group has no
// group before it, and a small quantized weight is a group or two a thread: each tile also pulls its own stream
// in kAheadBytes ahead (SmolLM2's 121 GEMMs of a decode row, INT4 with an INT8 head: 7.0 -> 5.0 ms; INT8 7.9 ->
// 7.0, FP8 9.9 -> 8.7; 2-core Xeon). Where x is one row tile (decode) no group is met twice, and groups of
// kGroupBytes left a small weight's threads uneven (INT4 o_proj's 36 panels: 28 and 8): there a thread's share
// is kDecodeGroups groups (SmolLM2's INT4 projections at 1 / 2 / 4 rows 5-15% faster, AVX2 and AVX-512). On AVX2
// a group of narrow panels is widened into fp32 once where x has many row tiles (Widened), which then read it from
// the cache instead of each converting it again.
#include <cpuid.h>
#include <omp.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>

#include "claims.h"
#include "vec.h"

namespace {

constexpr int64_t kPanel = 16;       // output columns per panel: one 16-float vector, or two of 8
constexpr int64_t kTileRows = 6;     // AVX2: 12 accumulators + 2 panel vectors + 1 broadcast of its 16 registers
constexpr int64_t kGroupBytes = 128 << 10;   // the panels one x tile meets in turn; with the next one, in L2
constexpr int64_t kSideEvery = 8;            // k values between the points where a tile issues side prefetches
constexpr int64_t kAheadBytes = 4096;        // how far ahead of its k a tile pulls its own panel's stream in
constexpr int64_t kDecodeGroups = 2;         // groups of a thread's share where x is one row tile (see above)
constexpr int64_t kWidenRows = 24;           // AVX2: from more rows, narrow panels are widened a group at a time

// One k of a panel: 16 floats, in one register where the CPU has AVX-512, in two of AVX2's otherwise; the few
// operations the tile and the panel types need.
#ifdef __AVX512F__
struct Line {
  __m512 v;
};
inline Line line_zero() { return {_mm512_setzero_ps()}; }
inline Line line_set(float a) { return {_mm512_set1_ps(a)}; }
inline Line line_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void line_store(float* p, Line a) { _mm512_storeu_ps(p, a.v); }
inline Line line_add(Line a, Line b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Line line_mul(Line a, Line b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Line line_fmadd(Line a, Line b, Line c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Line line_fnmadd(Line a, Line b, Line c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline Line line_u16_high(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline Line line_i8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))}; }
inline Line line_u8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))}; }
inline Line line_fp16(__m256i h) { return {_mm512_cvtph_ps(h)}; }
constexpr int kSums = 4;    // sums over k a row (k mod 4), added at the end: 24 of the 32 registers (see tile)
constexpr int kWide[7] = {0, 1, 1, 1, 1, 1, 1};   // panels a tile of R rows takes at once (see tile)
constexpr bool kWiden = false;   // narrow panels read as they are at any M (Widened: a 6-row tile's 64-byte fp32
                                 // line a k outran L2, bf16 at 128 rows 17.3-18.5 -> 20.2-21.3 ms)
#else
struct Line {
  __m256 lo, hi;
};
inline Line line_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Line line_set(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline Line line_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void line_store(float* p, Line a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline Line line_add(Line a, Line b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Line line_mul(Line a, Line b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Line line_fmadd(Line a, Line b, Line c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Line line_fnmadd(Line a, Line b, Line c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Line line_u16_high(__m256i h) {
  const auto widen = [](__m128i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)); };
  return {widen(_mm256_castsi256_si128(h)), widen(_mm256_extracti128_si256(h, 1))};
}
inline Line line_i8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
inline Line line_u8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
}
inline Line line_fp16(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
constexpr int kSums = 1;    // 6 rows x 2 registers fill AVX2's 16
constexpr int kWide[7] = {0, 4, 2, 1, 1, 1, 1};   // 8 sums for 1 or 2 rows, 6 or more for more
constexpr bool kWiden = true;    // narrow panels widened a group at a time from kWidenRows rows (Widened: 576 x
                                 // 1536 x 576 shapes at 128 rows, bf16 26.0-27.6 -> 22.8-23.8 ms, INT4 37.7-38.4 ->
                                 // 31.3-31.7; at 13-16 rows 10-20% slower, even at 32)
#endif

// The weight's panels by their type: each reads a panel's 16 values at one k as a Line (`Lines`, one panel's k
// lines from k = 0 up), and says how many bytes one k of a panel takes.
struct Fp32Panels {
  static constexpr bool kGroupSums = false;
  static constexpr int64_t kRowBytes = kPanel * sizeof(float);
  const float* data;
  struct Lines {
    const float* p;
    Line load(int64_t k) { return line_load(p + k * kPanel); }
  };
  Lines lines(int64_t panel, int64_t K) const { return {data + panel * K * kPanel}; }
};

// bf16 (a bf16 checkpoint's weights beside fp32 activations, on CPUs without bf16 arithmetic): half fp32's bytes,
// each value widened exactly by a 16-bit shift as it loads.
struct Bf16Panels {
  static constexpr bool kGroupSums = false;
  static constexpr int64_t kRowBytes = kPanel * sizeof(uint16_t);
  const uint16_t* data;
  struct Lines {
    const uint16_t* p;
    Line load(int64_t k) {
      return line_u16_high(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * kPanel)));
    }
  };
  Lines lines(int64_t panel, int64_t K) const { return {data + panel * K * kPanel}; }
};

// INT8: the values converted as they load; the output channels' scales applied once, at the store.
struct Int8Panels {
  static constexpr bool kGroupSums = false;
  static constexpr int64_t kRowBytes = kPanel;
  const int8_t* data;
  struct Lines {
    const int8_t* p;
    Line load(int64_t k) { return line_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * kPanel))); }
  };
  Lines lines(int64_t panel, int64_t K) const { return {data + panel * K * kPanel}; }
};

// INT4: 8 bytes a k, read as one 64-bit word whose nibble n holds column 2n (n < 8) or 2(n - 8) + 1: each of
// its 64-bit lanes moved by its index gives columns 2e and 2e + 1 in its two 32-bit halves, in order. Scales and
// zero points [groups, N] (a panel's 16 contiguous).
// Each lane is moved so that both its nibbles land in the top of a float's mantissa, then masked and or-ed with
// 1.0's bits: the line is 1 + q / 16, exact. The tile sums x * (1 + q / 16) over a group and applies the group's
// factors once (kGroupSums): (sum - (1 + zero / 16) * sum of x) * 16 * scale, (q - zero) * scale summed.
// AVX-512: a rotate and one ternary-logic op, 3 vector ops a k with the FMA where converting and scaling each value
// took 5. AVX2 (no rotate, no ternary logic): the upper columns' lanes from the word shifted by 16; 7 vector ops
// a k besides the FMAs (shifts, and, or) where converting and scaling took 8.
struct Int4Panels {
  static constexpr int64_t kRowBytes = kPanel / 2;
  static constexpr bool kGroupSums = true;
  const uint8_t* data;
  const float* scale;
  const uint8_t* zero;
  int64_t N, group;
  struct Lines {
    const uint8_t* p;
    const float* scale;
    const uint8_t* zero;
    int64_t N, group;
    Lines(const uint8_t* p, const float* scale, const uint8_t* zero, int64_t N, int64_t group)
        : p(p), scale(scale), zero(zero), N(N), group(group) {}
    int64_t word(int64_t k) const {
      int64_t w;
      std::memcpy(&w, p + k * kRowBytes, sizeof(w));
      return w;
    }
#ifdef __AVX512F__
    Line load(int64_t k) const {                                     // 1 + q / 16
      const __m512i placed = _mm512_rolv_epi64(_mm512_set1_epi64(word(k)),
                                               _mm512_set_epi64(55, 59, 63, 3, 7, 11, 15, 19));   // 19 - 4e, mod 64
      return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(placed, _mm512_set1_epi32(0x00780000),
                                                            _mm512_set1_epi32(0x3F800000), 0xEA))};  // (a & b) | c
    }
#else
    Line load(int64_t k) const {                                     // 1 + q / 16
      const __m256i all = _mm256_set1_epi64x(word(k)), shifts = _mm256_set_epi64x(7, 11, 15, 19);
      const __m256i mask = _mm256_set1_epi32(0x00780000), one = _mm256_set1_epi32(0x3F800000);
      const __m256i lo = _mm256_sllv_epi64(all, shifts), hi = _mm256_sllv_epi64(_mm256_srli_epi64(all, 16), shifts);
      return {_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(lo, mask), one)),
              _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(hi, mask), one))};
    }
#endif
    // Group g's factors: 16 * scale and 1 + zero / 16.
    std::pair<Line, Line> factors(int64_t g) const {
      const Line z = line_u8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zero + g * N)));
      return {line_mul(line_load(scale + g * N), line_set(16.0f)), line_fmadd(z, line_set(1.0f / 16), line_set(1.0f))};
    }
    Line value(int64_t k) const {                                    // (q - zero) * scale, rounded once
      const auto [s16, z] = factors(k / group);
      return line_mul(line_add(load(k), line_mul(z, line_set(-1.0f))), s16);
    }
  };
  Lines lines(int64_t panel, int64_t K) const {
    return Lines(data + panel * K * kRowBytes, scale + panel * kPanel, zero + panel * kPanel, N, group);
  }
};

// FP8 (e4m3): 16 bytes a k, each value's bits moved into an fp16's (sign to bit 15, exponent and mantissa below,
// the exponent's bias 7 short of fp16's 15, made up by the scale's 2^8) and converted by F16C, which reads fp16's
// subnormals (e4m3's own) exactly; scaled by its group's scales ([groups, N]), read again at every group start.
struct Fp8Panels {
  static constexpr bool kGroupSums = false;
  static constexpr int64_t kRowBytes = kPanel;
  const uint8_t* data;
  const float* scale;
  int64_t N, group;
  struct Lines {
    const uint8_t* p;
    const float* scale;
    int64_t N, group, next_group = 0;
    Line s;
    Lines(const uint8_t* p, const float* scale, int64_t N, int64_t group) : p(p), scale(scale), N(N), group(group) {}
    Line load(int64_t k) {
      if (k == next_group) {
        s = line_mul(line_load(scale), line_set(256.0f));                   // 2^(15 - 7)
        scale += N, next_group += group;
      }
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * kRowBytes));
      // sign-extended and shifted by 7: bit 15 the sign, bits 13..7 exponent and mantissa; bit 14 (the sign
      // again, or 0) cleared
      const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
      return line_mul(line_fp16(half), s);
    }
  };
  Lines lines(int64_t panel, int64_t K) const {
    return Lines(data + panel * K * kRowBytes, scale + panel * kPanel, N, group);
  }
};

// A group of a weight's panels widened once into fp32 lines in the thread's buffer (each k's 16 values as the
// source's load gives them, from `first` on), for the row tiles of many rows to read from the cache: the source's
// conversions are made once a group instead of once a row tile. The same values meet the same FMAs in the same
// order, so a row's result is the one it gets alone (and a group's factors, kGroupSums, are still the source's).
template <typename Panels>
struct Widened {
  static constexpr bool kGroupSums = Panels::kGroupSums;
  static constexpr int64_t kRowBytes = kPanel * sizeof(float);
  const Panels& source;
  const float* data;
  int64_t first, group;                                 // group: the source's (kGroupSums)
  struct Lines {
    const float* p;
    typename Panels::Lines source;
    Line load(int64_t k) const { return line_load(p + k * kPanel); }
    auto factors(int64_t g) const { return source.factors(g); }
  };
  Lines lines(int64_t panel, int64_t K) const { return {data + (panel - first) * K * kPanel, source.lines(panel, K)}; }
};

// Panels first..last of w as Widened's buffer holds them, made in `buffer`.
template <typename Panels>
Widened<Panels> widen_group(const Panels& w, int64_t first, int64_t last, int64_t K, std::vector<float>& buffer) {
  buffer.resize(std::max<size_t>(buffer.size(), (last - first) * K * kPanel));
  for (int64_t p = first; p < last; ++p) {
    auto lines = w.lines(p, K);
    float* out = buffer.data() + (p - first) * K * kPanel;
    for (int64_t k = 0; k < K; ++k) line_store(out + k * kPanel, lines.load(k));
  }
  int64_t group = 0;
  if constexpr (Panels::kGroupSums) group = w.group;
  return {w, buffer.data(), first, group};
}

// The P panels from `first` on, as their Lines.
template <typename Panels, size_t... I>
std::array<typename Panels::Lines, sizeof...(I)> panel_lines(const Panels& w, int64_t first, int64_t K,
                                                             std::index_sequence<I...>) {
  return {w.lines(first + static_cast<int64_t>(I), K)...};
}

// y[0:R, 0:16P] = (x[0:R] @ panels first..first + P) * scale (where given) + bias, x rows K apart, y rows N apart;
// scale and bias from the first panel's columns on. Meanwhile pulls num_lines lines from prefetch on into the cache,
// and num_side lines of `side`, each spread evenly over the k loop. Each row keeps kSums sums a panel, of the k
// values in turn (the rest of K / kSums in the first): a decode row's FMAs then wait on no FMA's latency but each
// kSums-th's (AVX2, one sum: on the P panels' sums beside each other), and a column's result is the same for any
// R and P (M 1 or 32, alone or beside others). Panels with kGroupSums: the sums start again at each group, whose
// factors then fold them into a total, with the rows' sums of x over the group (xsum, rows xsum_stride apart).
template <int R, int P, typename Panels>
void tile(const float* x, int64_t K, const Panels& weight, int64_t first, const float* scale, const float* bias,
          float* y, int64_t N, const char* prefetch, int64_t num_lines, vec::LineCursor& side, int64_t num_side,
          const float* xsum, int64_t xsum_stride) {
  auto panel = panel_lines(weight, first, K, std::make_index_sequence<P>());
  Line acc[kSums][R][P];
  auto clear = [&] {
#pragma GCC unroll 32
    for (int i = 0; i < kSums * R * P; ++i) acc[i / (R * P)][i / P % R][i % P] = line_zero();
  };
  auto sum_of = [&](int r, int p) {
    if constexpr (kSums == 4)
      return line_add(line_add(acc[0][r][p], acc[1][r][p]), line_add(acc[2][r][p], acc[3][r][p]));
    return acc[0][r][p];
  };
  auto step = [&](int64_t k, Line (&sums)[R][P]) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const Line w = panel[p].load(k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sums[r][p] = line_fmadd(line_set(x[r * K + k]), w, sums[r][p]);
    }
  };
  constexpr int64_t kChunk = std::max<int64_t>(kSums, vec::kLineBytes / Panels::kRowBytes);   // k's a line holds
  const int64_t every = num_lines > 0 ? std::max<int64_t>(1, K / (kChunk * num_lines)) : K + 1;   // in chunks
  int64_t countdown = every, num_issued = 0;
  auto own_prefetch = [&] {
    if (--countdown == 0) {
      countdown = every;
      if (num_issued < num_lines) _mm_prefetch(prefetch + vec::kLineBytes * num_issued++, _MM_HINT_T0);
    }
  };
  auto steps = [&](int64_t k, int64_t k_end) {                    // a prefetch a line of each panel, not a k
    for (; k + kChunk <= k_end; k += kChunk) {
#pragma GCC unroll 16
      for (int i = 0; i < kChunk; ++i) step(k + i, acc[i % kSums]);
      own_prefetch();
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panel[p].p) + k * Panels::kRowBytes + kAheadBytes, _MM_HINT_T0);
    }
    for (; k + kSums <= k_end; k += kSums) {
#pragma GCC unroll 4
      for (int i = 0; i < kSums; ++i) step(k + i, acc[i]);
    }
    for (; k < k_end; ++k) step(k, acc[0]);
  };
  int64_t side_owed = 0;                           // x K, so that the loop needs no division
  auto run = [&](int64_t k_begin, int64_t k_end) {
    if (num_side == 0) return steps(k_begin, k_end);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += kSideEvery) {   // every kSideEvery k values, the side lines due
      const int64_t k1 = std::min(k_end, k0 + kSideEvery);
      for (side_owed += num_side * (k1 - k0); side_owed >= K; side_owed -= K) side.prefetch_next();
      steps(k0, k1);
    }
  };
  clear();
  Line total[R][P];
  if constexpr (Panels::kGroupSums) {
#pragma GCC unroll 32
    for (int i = 0; i < R * P; ++i) total[i / P][i % P] = line_zero();
    for (int64_t g = 0; g * weight.group < K; ++g) {
      run(g * weight.group, (g + 1) * weight.group);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const auto [s16, z] = panel[p].factors(g);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          total[r][p] = line_fmadd(line_fnmadd(line_set(xsum[r * xsum_stride + g]), z, sum_of(r, p)), s16,
                                   total[r][p]);
      }
      clear();
    }
  } else {
    run(0, K);
#pragma GCC unroll 32
    for (int i = 0; i < R * P; ++i) total[i / P][i % P] = sum_of(i / P, i % P);
  }
  for (; num_issued < num_lines; ++num_issued) _mm_prefetch(prefetch + vec::kLineBytes * num_issued, _MM_HINT_T0);
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const Line b = bias ? line_load(bias + p * kPanel) : line_zero();
    const Line s = scale ? line_load(scale + p * kPanel) : line_set(1.0f);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) line_store(y + r * N + p * kPanel, line_fmadd(total[r][p], s, b));
  }
}

template <typename Panels>
using Tile = void (*)(const float*, int64_t, const Panels&, int64_t, const float*, const float*, float*, int64_t,
                      const char*, int64_t, vec::LineCursor&, int64_t, const float*, int64_t);
// Rows a tile: 6 (AVX-512: 24 sums of the 32 registers; AVX2: 12 of 16), 5 with kGroupSums (a total a row more).
template <typename Panels>
constexpr int64_t kRows = Panels::kGroupSums ? 5 : kTileRows;
template <typename Panels>
constexpr Tile<Panels> kTiles[kTileRows + 1] = {nullptr, tile<1, 1, Panels>, tile<2, 1, Panels>, tile<3, 1, Panels>,
                                                tile<4, 1, Panels>, tile<5, 1, Panels>, tile<6, 1, Panels>};
template <typename Panels>
constexpr Tile<Panels> kWideTiles[kTileRows + 1] = {nullptr, tile<1, kWide[1], Panels>, tile<2, kWide[2], Panels>,
                                                    tile<3, kWide[3], Panels>, tile<4, kWide[4], Panels>,
                                                    tile<5, kWide[5], Panels>, tile<6, kWide[6], Panels>};

// The items of each group of `group` in num_items (the last group the rest): what threads claim.
std::vector<int64_t> group_costs(int64_t num_items, int64_t group) {
  std::vector<int64_t> costs((num_items + group - 1) / group);
  for (size_t g = 0; g < costs.size(); ++g) costs[g] = std::min<int64_t>(group, num_items - g * group);
  return costs;
}

// y [M, N] = (x @ W^T) * scale (where given) + bias over the panels; side: see panel_linear. On AVX2, narrow
// panels meet x of more than kWidenRows rows widened a group at a time (Widened).
template <typename Panels>
void panel_gemm(const float* xp, int64_t M, int64_t K, const Panels& w, int64_t num_panels, const float* sp,
                const float* bp, float* yp, const std::vector<vec::Span>& side) {
  constexpr int64_t kTileRows = kRows<Panels>;
  std::vector<float> xsum;                               // kGroupSums: each row's sums of x over each group
  int64_t num_k_groups = 0;
  if constexpr (Panels::kGroupSums) {
    num_k_groups = K / w.group;
    xsum.resize(M * num_k_groups);
    for (int64_t i = 0; i < M * num_k_groups; ++i) {
      float sum = 0.0f;
      for (int64_t k = 0; k < w.group; ++k) sum += xp[(i / num_k_groups) * K + (i % num_k_groups) * w.group + k];
      xsum[i] = sum;
    }
  }
  const int64_t N = num_panels * kPanel;
  constexpr int64_t kPanelRowBytes = Panels::kRowBytes;          // one k of a panel
  const int64_t num_decode_groups = kDecodeGroups * omp_get_max_threads();
  const int64_t group = std::max<int64_t>(1, std::min(kGroupBytes / (K * kPanelRowBytes), M > kTileRows ? num_panels :
                                                      (num_panels + num_decode_groups - 1) / num_decode_groups));
  const std::vector<int64_t> costs = group_costs(num_panels, group);
  const int64_t num_groups = static_cast<int64_t>(costs.size());
  const int64_t num_side_lines = vec::num_lines(side);
  const int num_threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), num_groups));
  Claims claims(costs, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num();
    for (int64_t g = claims.claim(thread); g >= 0; g = claims.claim(thread)) {
      const int64_t first = g * group, last = std::min(num_panels, first + group);
      const char* next = reinterpret_cast<const char*>(w.data) + last * K * kPanelRowBytes;  // the next group
      const int64_t num_next_lines = claims.is_next(thread, g + 1) ?
          (costs[g + 1] * K * kPanelRowBytes + vec::kLineBytes - 1) / vec::kLineBytes : 0;
      const int64_t side_line = num_side_lines * g / num_groups;
      const int64_t side_share = num_side_lines * (g + 1) / num_groups - side_line;
      auto num_calls_of = [&](int64_t rows) {             // a row tile's calls: its wide tiles, then single panels
        const int64_t n = last - first;
        return n / kWide[rows] + n % kWide[rows];
      };
      const int64_t num_calls =
          M / kTileRows * num_calls_of(kTileRows) + (M % kTileRows ? num_calls_of(M % kTileRows) : 0);
      const int64_t lines_per_call = (num_next_lines + num_calls - 1) / num_calls;
      const int64_t side_per_call = (side_share + num_calls - 1) / num_calls;
      vec::LineCursor cursor(side, side_line);
      int64_t call = 0, side_left = side_share;
      auto row_tiles = [&](const auto& panels) {
        using Source = std::decay_t<decltype(panels)>;
        for (int64_t m = 0; m < M; m += kTileRows) {
          const int64_t rows = std::min(kTileRows, M - m);
          for (int64_t p = first, width; p < last; p += width, ++call) {
            width = p + kWide[rows] <= last ? kWide[rows] : 1;
            const int64_t line = std::min(num_next_lines, call * lines_per_call);
            const int64_t num_lines = std::min(num_next_lines - line, lines_per_call);
            const int64_t num_side = std::min(side_left, side_per_call);
            side_left -= num_side;
            (width == 1 ? kTiles<Source> : kWideTiles<Source>)[rows](
                xp + m * K, K, panels, p, sp ? sp + p * kPanel : nullptr, bp ? bp + p * kPanel : nullptr,
                yp + m * N + p * kPanel, N, next + vec::kLineBytes * line, num_lines, cursor, num_side,
                xsum.data() + m * num_k_groups, num_k_groups);
          }
        }
      };
      if constexpr (kWiden && !std::is_same_v<Panels, Fp32Panels>) {
        if (M > kWidenRows) {
          static thread_local std::vector<float> buffer;
          row_tiles(widen_group(w, first, last, K, buffer));
          continue;
        }
      }
      row_tiles(w);
    }
  }
}

// A narrow x's values in fp32, and y's fp32 sums rounded to nearest even into its dtype (torch's conversions).
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void narrow(const float* src, at::BFloat16* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint32_t*>(src);
  auto* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {                     // branch-free, so that it vectorizes
    const uint32_t u = bits[i];
    const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    out[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded;
  }
}

void narrow(const float* src, at::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), half);
  }
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

// A weight's panels as a binding checks them: [N / 16, K, width] of the type `type` names (one of `types`),
// contiguous; and unpacked whole (dequantize_panels).
struct PanelShape {
  int64_t K, num_panels, N;
  PanelShape(const torch::Tensor& panels, int64_t width, std::initializer_list<at::ScalarType> types,
             const char* type) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == width && panels.is_contiguous(), "panels [N / 16, K, ", width,
                "], contiguous");
    TORCH_CHECK(std::find(types.begin(), types.end(), panels.scalar_type()) != types.end(), "panels ", type);
    K = panels.size(1), num_panels = panels.size(0), N = num_panels * kPanel;
  }
  // A per-output-channel tensor (INT8's scales, a bias): [N] fp32, contiguous; `what` says so when it is not.
  void check_per_column(const torch::Tensor& t, const char* what) const {
    TORCH_CHECK(t.numel() == N && t.is_contiguous() && t.scalar_type() == at::kFloat, what);
  }
  // A grouped weight's per-group tensor: [K / group_size, N], contiguous, of `dtype` (group_size dividing K);
  // `what` says so when it is not.
  void check_grouped(const torch::Tensor& t, int64_t group_size, at::ScalarType dtype, const char* what) const {
    TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size must divide K");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == K / group_size && t.size(1) == N && t.is_contiguous() &&
                t.scalar_type() == dtype, what);
  }
  // W [N, K] in bf16 or fp16: each panel's lines as the GEMM reads them (times `scale` per column where given),
  // through a [K, 16] fp32 tile, then its columns rounded into W's rows; the threads take panels in turn.
  template <typename Panels>
  torch::Tensor unpack(const Panels& panels, const float* scale, at::ScalarType dtype) const {
    torch::Tensor w = torch::empty({N, K}, torch::dtype(dtype));
#pragma omp parallel
    {
      std::vector<float> tile(K * kPanel), row(K);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < num_panels; ++p) {
        auto lines = panels.lines(p, K);
        for (int64_t k = 0; k < K; ++k) {
          if constexpr (Panels::kGroupSums)
            line_store(tile.data() + k * kPanel, lines.value(k));
          else
            line_store(tile.data() + k * kPanel, lines.load(k));
        }
        for (int64_t c = 0; c < kPanel; ++c) {
          const float s = scale ? scale[p * kPanel + c] : 1.0f;
          for (int64_t k = 0; k < K; ++k) row[k] = tile[k * kPanel + c] * s;
          const int64_t n = p * kPanel + c;
          if (dtype == at::kBFloat16)
            narrow(row.data(), w.data_ptr<at::BFloat16>() + n * K, K);
          else
            narrow(row.data(), w.data_ptr<at::Half>() + n * K, K);
        }
      }
    }
    return w;
  }
};

// What every panel GEMM's binding checks and makes beside the panels' shape: x [M, K] fp32, bf16 or fp16 (computed
// in fp32: a narrow x widened here, y's fp32 sums rounded into its dtype at the end, in buffers the calling thread
// keeps for decode steps' few rows; no Python op on either side), bias fp32 [N] where given, and y [M, N] in x's
// dtype.
struct PanelCall : PanelShape {
  static constexpr int64_t kScratchRows = 32;            // rows converted through the thread's buffers
  torch::Tensor x, y, x32, y32;                          // x32, y32: fp32 copies beyond kScratchRows rows
  at::ScalarType dtype;
  int64_t M;
  const float* bias;
  const float* xp;
  float* yp;
  PanelCall(torch::Tensor x_in, const torch::Tensor& panels, int64_t width, std::initializer_list<at::ScalarType> types,
            const char* type, const std::optional<torch::Tensor>& b)
      : PanelShape(panels, width, types, type) {
    TORCH_CHECK(x_in.dim() == 2, "x [M, K]");
    dtype = x_in.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "x float32, bfloat16 or float16");
    TORCH_CHECK(x_in.size(1) == K, "x and the panels disagree on K");
    M = x_in.size(0);
    if (b) check_per_column(*b, "bias [N] fp32");
    bias = b ? b->data_ptr<float>() : nullptr;
    x = x_in.contiguous();
    y = torch::empty({M, N}, x.options());
    if (dtype == at::kFloat) {
      xp = x.data_ptr<float>(), yp = y.data_ptr<float>();
      return;
    }
    static thread_local std::vector<float> x_rows, y_rows;
    if (M <= kScratchRows) {
      x_rows.resize(std::max<size_t>(x_rows.size(), M * K)), y_rows.resize(std::max<size_t>(y_rows.size(), M * N));
      xp = x_rows.data(), yp = y_rows.data();
    } else {
      x32 = torch::empty({M, K}, x.options().dtype(at::kFloat)), y32 = torch::empty({M, N}, x32.options());
      xp = x32.data_ptr<float>(), yp = y32.data_ptr<float>();
    }
    float* wide = const_cast<float*>(xp);
    if (dtype == at::kBFloat16)
      widen(x.data_ptr<at::BFloat16>(), wide, M * K);
    else
      widen(x.data_ptr<at::Half>(), wide, M * K);
  }
  bool empty() const { return M == 0 || num_panels == 0; }
  template <typename Panels>
  torch::Tensor run(const Panels& panels, const float* scale, const std::vector<vec::Span>& side = {}) {
    if (empty()) return y;
    panel_gemm(xp, M, K, panels, num_panels, scale, bias, yp, side);
    if (dtype == at::kBFloat16)
      narrow(yp, y.data_ptr<at::BFloat16>(), M * N);
    else if (dtype == at::kHalf)
      narrow(yp, y.data_ptr<at::Half>(), M * N);
    return y;
  }
};

// bf16 on AMX tiles (CPUs with AMX-BF16): W [N, K] in pair panels [N / 16, K / 2, 16, 2], each row of a panel one k
// pair of its 16 columns, (w[n][2j], w[n][2j + 1]): the layout the tile product reads as its second operand, 64
// bytes a row; x's rows are the first operand as they lie. A block of up to 32 rows x 32 columns is four fp32 tiles
// (tile 2b + c: rows block b, panel c; 4, 5: x's two rows blocks; 6, 7: the two panels), summed over K in steps of
// 32. A row's sums take the same k order for any M, so its result is the same alone or beside others. Threads claim
// groups of panel pairs (kGroupBytes, as panel_gemm) and every rows block meets a group in turn; one row is bound
// by memory as the panel GEMM is, and many rows by the tiles, not the FMAs.
#ifdef __AMX_BF16__
constexpr int64_t kAmxK = 32;                 // k values a tile product sums: 16 pairs
constexpr int64_t kAmxRows = 16;              // rows a tile holds

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles for a block of rows0 + rows1 rows (rows1 0: one rows block) and num_panels (1 or 2) panels; tiles a
// block leaves out are configured empty, as the architecture asks.
void configure_tiles(int rows0, int rows1, int num_panels) {
  TileConfig cfg;
  auto set = [&](int tile, int rows) { cfg.rows[tile] = rows, cfg.colsb[tile] = rows ? 64 : 0; };
  set(0, rows0), set(4, rows0), set(6, kAmxRows);
  set(2, rows1), set(5, rows1);
  set(1, num_panels == 2 ? rows0 : 0), set(3, num_panels == 2 ? rows1 : 0), set(7, num_panels == 2 ? kAmxRows : 0);
  // (GCC's _tile_loadconfig tells the compiler it reads 8 bytes, which let it drop the stores of the rest)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// c [32, 32] fp32 (rows 128 bytes apart) = x[0:32] @ (panels w0, w1)^T, the tiles configure_tiles set up for
// kRowsBlocks rows blocks and kPanels panels.
template <int kRowsBlocks, int kPanels>
void amx_block(const uint16_t* x, int64_t K, const uint16_t* w0, const uint16_t* w1, float* c) {
  constexpr int64_t kCStride = 2 * kPanel * sizeof(float);
  _tile_zero(0);
  if constexpr (kPanels == 2) _tile_zero(1);
  if constexpr (kRowsBlocks == 2) _tile_zero(2);
  if constexpr (kRowsBlocks == 2 && kPanels == 2) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kAmxK) {
    _tile_loadd(4, x + k, K * 2);
    _tile_loadd(6, w0 + k * kPanel, 64);                    // pair rows k / 2 .. k / 2 + 15
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kPanels == 2) {
      _tile_loadd(7, w1 + k * kPanel, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kRowsBlocks == 2) {
      _tile_loadd(5, x + kAmxRows * K + k, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kPanels == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, kCStride);
  if constexpr (kPanels == 2) _tile_stored(1, c + kPanel, kCStride);
  if constexpr (kRowsBlocks == 2) _tile_stored(2, c + kAmxRows * 2 * kPanel, kCStride);
  if constexpr (kRowsBlocks == 2 && kPanels == 2) _tile_stored(3, c + kAmxRows * 2 * kPanel + kPanel, kCStride);
}

// Where amx_gemm finds a panel's pair rows: bf16 pair panels as stored, or a quantized weight's panel dequantized
// into the thread's buffer as its group begins (each k's line as the panel GEMM reads it, times the columns'
// scales where given; two k's lines rounded to nearest even and interleaved), so that a quantized weight's rows
// meet the tiles without its whole bf16 copy.
struct StoredPairs {
  static constexpr bool kBuffered = false;
  const uint16_t* w;
  const uint16_t* panel(int64_t p, int64_t K, uint16_t*) const { return w + p * K * kPanel; }
};

template <typename Panels>
struct DequantizedPairs {
  static constexpr bool kBuffered = true;
  Panels w;
  const float* column_scale;
  const uint16_t* panel(int64_t p, int64_t K, uint16_t* out) const {
    auto lines = w.lines(p, K);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    auto put = [&](int64_t k, Line a, Line b) {                       // a: k's line, b: k + 1's
      const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b.v, a.v));
      _mm512_storeu_si512(out + k * kPanel, _mm512_permutexvar_epi16(interleave, halves));
    };
    if constexpr (Panels::kGroupSums) {
      for (int64_t g = 0; g * w.group < K; ++g) {
        const auto [s16, z] = lines.factors(g);
        const Line minus_z = line_mul(z, line_set(-1.0f));
        for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 2)
          put(k, line_mul(line_add(lines.load(k), minus_z), s16), line_mul(line_add(lines.load(k + 1), minus_z), s16));
      }
    } else {
      const Line s = column_scale ? line_load(column_scale + p * kPanel) : line_set(1.0f);
      for (int64_t k = 0; k < K; k += 2) {
        const Line a = line_mul(lines.load(k), s);
        put(k, a, line_mul(lines.load(k + 1), s));
      }
    }
    return out;
  }
};

// y [M, N] bf16 = x [M, K] bf16 @ W^T + bias (fp32 [N] where given), the sums rounded once into bf16; W's panels
// from `source`.
template <typename Source>
void amx_gemm(const uint16_t* x, int64_t M, int64_t K, const Source& source, int64_t num_panels, const float* bias,
              at::BFloat16* y) {
  const int64_t N = num_panels * kPanel, panel_elems = K * kPanel;
  const int64_t num_pairs = (num_panels + 1) / 2;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (2 * panel_elems * 2));    // pairs a group
  const std::vector<int64_t> costs = group_costs(num_pairs, group);
  const int64_t num_groups = static_cast<int64_t>(costs.size());
  const int num_threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), num_groups));
  Claims claims(costs, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num();
    alignas(64) float c[2 * kAmxRows * 2 * kPanel];
    static thread_local std::vector<uint16_t> buffer;         // kept: not zeroed again at every call
    if (Source::kBuffered && buffer.size() < static_cast<size_t>(2 * group * panel_elems))
      buffer.resize(2 * group * panel_elems);
    std::vector<const uint16_t*> panels_at(2 * group);
    for (int64_t g = claims.claim(thread); g >= 0; g = claims.claim(thread)) {
      const int64_t first = g * group * 2, last = std::min(num_panels, first + group * 2);
      for (int64_t p = first; p < last; ++p)
        panels_at[p - first] = source.panel(p, K, buffer.data() + (p - first) * panel_elems);
      for (int64_t m = 0; m < M; m += 2 * kAmxRows) {
        const int rows = static_cast<int>(std::min(2 * kAmxRows, M - m));
        const int rows0 = std::min<int>(rows, kAmxRows), rows1 = rows - rows0;
        int configured = 0;
        for (int64_t p = first; p < last; p += 2) {
          const int panels = static_cast<int>(std::min<int64_t>(2, last - p));
          if (panels != configured) configure_tiles(rows0, rows1, panels), configured = panels;
          const uint16_t* xm = x + m * K;
          const uint16_t *w0 = panels_at[p - first], *w1 = panels == 2 ? panels_at[p + 1 - first] : nullptr;
          if (rows1 && panels == 2) amx_block<2, 2>(xm, K, w0, w1, c);
          else if (rows1) amx_block<2, 1>(xm, K, w0, w1, c);
          else if (panels == 2) amx_block<1, 2>(xm, K, w0, w1, c);
          else amx_block<1, 1>(xm, K, w0, w1, c);
          for (int r = 0; r < rows; ++r) {
            float* row = c + r * 2 * kPanel;
            if (bias)
              for (int64_t j = 0; j < panels * kPanel; ++j) row[j] += bias[p * kPanel + j];
            narrow(row, y + (m + r) * N + p * kPanel, panels * kPanel);
          }
        }
      }
    }
    _tile_release();
  }
}
#endif

// Whether the CPU has AMX-BF16, this build reads it and the kernel lets this process use its tiles (Linux asks a
// process to request the tile data state: arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_ready() {
#ifdef __AMX_BF16__
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

}  // namespace

torch::Tensor pack_linear(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be a 2-D float32 tensor");
  TORCH_CHECK(weight.size(0) % kPanel == 0, "out_features must be a multiple of ", kPanel);
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.view({N / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

// side: what the caller reads next (the adapters of a LoRA after this GEMM), pulled into the cache in even shares
// of every thread's tile calls: a GEMM of a few rows is bound by its FMAs, with memory bandwidth to spare.
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                           const std::vector<vec::Span>& side) {
  PanelCall call(x, panels, kPanel, {at::kFloat, at::kBFloat16}, "float32 or bfloat16", bias);
  if (panels.scalar_type() == at::kBFloat16)
    return call.run(Bf16Panels{reinterpret_cast<const uint16_t*>(panels.data_ptr())}, nullptr, side);
  return call.run(Fp32Panels{panels.data_ptr<float>()}, nullptr, side);
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias) {
  return panel_linear(x, panels, bias, {});
}

// Weight-only INT8: y = (x @ panels^T) * scale + bias, x fp32 [M, K], panels int8 [N / 16, K, 16], scale [N] fp32.
torch::Tensor int8_panel_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale,
                                std::optional<torch::Tensor> bias) {
  PanelCall call(x, panels, kPanel, {at::kChar}, "int8", bias);
  call.check_per_column(scale, "scale [N] fp32");
  return call.run(Int8Panels{panels.data_ptr<int8_t>()}, scale.data_ptr<float>());
}

// Weight-only INT4: y = x @ ((q - zero) * scale)^T + bias, x fp32 [M, K], panels uint8 [N / 16, K, 8] (two values
// a byte), scale [K / group_size, N] fp32, zero [K / group_size, N] uint8.
torch::Tensor int4_panel_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale, torch::Tensor zero,
                                int64_t group_size, std::optional<torch::Tensor> bias) {
  PanelCall call(x, panels, kPanel / 2, {at::kByte}, "uint8", bias);
  call.check_grouped(scale, group_size, at::kFloat, "scale [K / group_size, N] fp32");
  call.check_grouped(zero, group_size, at::kByte, "zero [K / group_size, N] uint8");
  return call.run(Int4Panels{panels.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<uint8_t>(), call.N,
                             group_size}, nullptr);
}

// Weight-only FP8: y = x @ (e4m3(panels) * scale)^T + bias, x fp32 [M, K], panels uint8 [N / 16, K, 16] (e4m3
// bits), scale [K / group_size, N] fp32.
torch::Tensor fp8_panel_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale, int64_t group_size,
                               std::optional<torch::Tensor> bias) {
  PanelCall call(x, panels, kPanel, {at::kByte}, "uint8", bias);
  call.check_grouped(scale, group_size, at::kFloat, "scale [K / group_size, N] fp32");
  return call.run(Fp8Panels{panels.data_ptr<uint8_t>(), scale.data_ptr<float>(), call.N, group_size}, nullptr);
}

// The weight [N, K] that quantized panels encode, in dtype (bf16 or fp16), each value as their GEMM reads it,
// rounded to nearest even: for the GEMMs of many rows on CPUs without AMX tiles, which oneDNN runs faster than the
// panel GEMM's FMAs.
// INT8: panels int8 [N / 16, K, 16], scale [N]; INT4: panels uint8 [N / 16, K, 8], scale and zero [K / group_size,
// N]; FP8: panels uint8 [N / 16, K, 16], scale [K / group_size, N].
torch::Tensor dequantize_panels(torch::Tensor panels, torch::Tensor scale, std::optional<torch::Tensor> zero,
                                int64_t group_size, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "dtype bfloat16 or float16");
  if (panels.scalar_type() == at::kChar) {
    PanelShape w(panels, kPanel, {at::kChar}, "int8");
    w.check_per_column(scale, "scale [N] fp32");
    return w.unpack(Int8Panels{panels.data_ptr<int8_t>()}, scale.data_ptr<float>(), dtype);
  }
  if (zero) {
    PanelShape w(panels, kPanel / 2, {at::kByte}, "uint8");
    w.check_grouped(scale, group_size, at::kFloat, "scale [K / group_size, N] fp32");
    w.check_grouped(*zero, group_size, at::kByte, "zero [K / group_size, N] uint8");
    return w.unpack(Int4Panels{panels.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero->data_ptr<uint8_t>(), w.N,
                               group_size}, nullptr, dtype);
  }
  PanelShape w(panels, kPanel, {at::kByte}, "uint8");
  w.check_grouped(scale, group_size, at::kFloat, "scale [K / group_size, N] fp32");
  return w.unpack(Fp8Panels{panels.data_ptr<uint8_t>(), scale.data_ptr<float>(), w.N, group_size}, nullptr, dtype);
}

bool amx_available() { return amx_ready(); }

// bf16 over AMX tiles: y = x @ W^T + bias, x bf16 [M, K] (K a multiple of 32), pairs bf16 [N / 16, K / 2, 16, 2]
// (pack_pairs), bias fp32 [N] where given; y bf16 [M, N].
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor pairs, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_ready(), "amx_linear: this CPU, build or kernel gives no AMX-BF16 tiles");
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(2) == kPanel && pairs.size(3) == 2 && pairs.is_contiguous() &&
              pairs.scalar_type() == at::kBFloat16, "pairs bf16 [N / 16, K / 2, 16, 2], contiguous");
  const int64_t num_panels = pairs.size(0), K = pairs.size(1) * 2, N = num_panels * kPanel;
  TORCH_CHECK(K % 32 == 0, "K a multiple of 32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16, "x bf16 [M, K]");
  if (bias) TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat, "bias [N]");
  x = x.contiguous();
  torch::Tensor y = torch::empty({x.size(0), N}, x.options());
#ifdef __AMX_BF16__
  if (x.size(0) > 0 && N > 0)
    amx_gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), K,
             StoredPairs{reinterpret_cast<const uint16_t*>(pairs.data_ptr())}, num_panels,
             bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>());
#endif
  return y;
}

// A quantized weight in panels (as dequantize_panels takes it) beside bf16 x on AMX tiles: y = x @ W^T + bias, each
// group of panels dequantized into bf16 pair rows in the thread's buffer as its turn comes, bias fp32 [N] where
// given; y bf16 [M, N]. The same values as amx_linear over dequantize_panels' weight in pair panels.
torch::Tensor amx_dequantized_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scale,
                                     std::optional<torch::Tensor> zero, int64_t group_size,
                                     std::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_ready(), "amx_dequantized_linear: this CPU, build or kernel gives no AMX-BF16 tiles");
  const bool int8 = panels.scalar_type() == at::kChar;
  PanelShape w(panels, zero ? kPanel / 2 : kPanel, {int8 ? at::kChar : at::kByte}, int8 ? "int8" : "uint8");
  TORCH_CHECK(w.K % 32 == 0, "K a multiple of 32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.scalar_type() == at::kBFloat16, "x bf16 [M, K]");
  if (bias) w.check_per_column(*bias, "bias [N] fp32");
  if (int8)
    w.check_per_column(scale, "scale [N] fp32");
  else
    w.check_grouped(scale, group_size, at::kFloat, "scale [K / group_size, N] fp32");
  if (zero) w.check_grouped(*zero, group_size, at::kByte, "zero [K / group_size, N] uint8");
  x = x.contiguous();
  torch::Tensor y = torch::empty({x.size(0), w.N}, x.options());
#ifdef __AMX_BF16__
  if (x.size(0) == 0 || w.N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  if (int8)
    amx_gemm(xp, x.size(0), w.K, DequantizedPairs<Int8Panels>{{panels.data_ptr<int8_t>()}, scale.data_ptr<float>()},
             w.num_panels, bp, yp);
  else if (zero)
    amx_gemm(xp, x.size(0), w.K,
             DequantizedPairs<Int4Panels>{{panels.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                           zero->data_ptr<uint8_t>(), w.N, group_size}, nullptr},
             w.num_panels, bp, yp);
  else
    amx_gemm(xp, x.size(0), w.K,
             DequantizedPairs<Fp8Panels>{{panels.data_ptr<uint8_t>(), scale.data_ptr<float>(), w.N, group_size},
                                         nullptr},
             w.num_panels, bp, yp);
#endif
  return y;
}
