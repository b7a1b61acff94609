// See int8_gemm.h. Two paths compute the same float operations in the same order: the portable
// loops (the reference the tests compare with bit for bit, and the fallback) and AVX512-VNNI.
//
// Per tile (16 output rows, one per lane) the kernel walks the tile's super-blocks and groups in
// storage order, so W streams from memory once per pass of up to kPassRows rows of x. Per group the
// codes become eight vpdpbusd operands (features 4k..4k+3 of all 16 rows each), shared by the pass's
// rows; each row adds its group sum with two FMAs per sub-group. A pass holds R float accumulators,
// eight operands and the group's scales in registers.
#include "cpu_linear/int8_gemm.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSD_INT8_X86 1
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define INT8_INLINE inline __attribute__((always_inline))
#else
#define INT8_INLINE inline
#endif
#define INT8_UNROLL _Pragma("GCC unroll 16")

namespace fsd_cpu_linear {

namespace {

constexpr int kPassRows = 8;  // rows of x per pass over a tile
// How far ahead of its group the AVX-512 path prefetches W: the hardware prefetcher alone left a pass
// of 6 rows ~1.5x slower (docs/cpu.md). (A prefetch never faults, so the last tile's may run past W.)
constexpr int64_t kPrefetchBytes = 2048;
constexpr int kOperands = 8;  // vpdpbusd operands per group: 4 features x 16 rows each

template <Int8Format F>
constexpr int kSubGroups = F == Int8Format::Q6_K ? 2 : 1;  // scales per group and row
template <Int8Format F>
constexpr int kPlanes = F == Int8Format::Q5_0 ? 1 : 0;  // bit planes after the nibbles
template <Int8Format F>
constexpr bool kCrumbs = F == Int8Format::Q6_K;  // bits 4-5 in two 64-byte chunks after the nibbles
// The code subtracted from u, as a multiple of the scale (folded into the offset).
template <Int8Format F>
constexpr int32_t kZeroInt = F == Int8Format::Q6_K ? 32 : F == Int8Format::Q5_0 ? 16 : F == Int8Format::Q8_0 ? 128 : 0;
template <Int8Format F>
constexpr float kZero = (float)kZeroInt<F>;
// Byte offset of a group's params (after its codes).
template <Int8Format F>
constexpr int64_t kParamsAt = F == Int8Format::Q8_0 ? 512 : 256 + 64 * kPlanes<F> + (kCrumbs<F> ? 128 : 0);

INT8_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  float value;
  if (exponent == 0) {
    value = std::ldexp((float)mantissa, -24);  // zero or subnormal: exact
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    const uint32_t bits = ((exponent + 112u) << 23) | (mantissa << 13);
    std::memcpy(&value, &bits, 4);
  }
  return sign ? -value : value;
}

INT8_INLINE uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// --------------------------------------------------------------------------------------------
// Quantising x.

// Scale of a group with amax = max |x| (NaN when the group holds a NaN or an infinity), and the
// multiplier giving its codes (0 where the scale is zero or its reciprocal overflows).
INT8_INLINE void group_scale(float amax, bool finite, float& dx, float& inv) {
  if (!finite || !(amax <= FLT_MAX)) {
    dx = NAN;
    inv = 0.0f;
    return;
  }
  dx = amax / 127.0f;
  inv = dx > 0.0f ? 1.0f / dx : 0.0f;
  if (!(inv <= FLT_MAX)) dx = inv = 0.0f;
}

INT8_INLINE void store_group_params(float* params, float dx, int32_t low_sum, int32_t high_sum) {
  params[0] = dx;
  params[1] = dx * (float)(low_sum + high_sum);
  std::memcpy(params + 2, &low_sum, 4);
  std::memcpy(params + 3, &high_sum, 4);
}

// The sums of a group's codes of x (features 0-15, 16-31), stored as int32 after dx and dx * sum.
INT8_INLINE int32_t code_sum(const float* params, int half) {
  int32_t v;
  std::memcpy(&v, params + 2 + half, 4);
  return v;
}

void quantize_row_portable(const float* x, int64_t in, uint8_t* out) {
  int8_t* codes = reinterpret_cast<int8_t*>(out);
  float* params = reinterpret_cast<float*>(out + in);
  for (int64_t g = 0; g < in / kGroupCols; ++g) {
    const float* v = x + g * kGroupCols;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < kGroupCols; ++j) {
      finite = finite && std::fabs(v[j]) <= FLT_MAX;
      amax = std::max(amax, std::fabs(v[j]));
    }
    float dx, inv;
    group_scale(amax, finite, dx, inv);
    int32_t sums[2] = {0, 0};
    for (int j = 0; j < kGroupCols; ++j) {
      const int32_t q = finite ? std::clamp((int32_t)std::nearbyint(v[j] * inv), -127, 127) : 0;
      codes[g * kGroupCols + j] = (int8_t)q;
      sums[j / 16] += q;
    }
    store_group_params(params + 4 * g, dx, sums[0], sums[1]);
  }
}

// --------------------------------------------------------------------------------------------
// The portable kernel: 16-lane arrays for the registers, each step as the vector path does it.

struct Lanes {
  float v[kTileRows];
};

template <Int8Format F>
struct PortableGroup {
  uint8_t u[kTileRows][kGroupCols];          // codes by (row, feature)
  float scale[kSubGroups<F>][kTileRows];
  float offset[kSubGroups<F>][kTileRows];    // Q4_K's -dmin m; the others' -zero x scale (dequantisation)
};

template <Int8Format F>
void decode_group_portable(const uint8_t* g, const float* d, const float* neg_dmin, PortableGroup<F>& out) {
  for (int i = 0; i < kTileRows; ++i) {
    for (int k = 0; k < kOperands; ++k) {
      for (int t = 0; t < 4; ++t) {
        const int bit = 4 * i + t;
        uint32_t u;
        if constexpr (F == Int8Format::Q8_0) {
          u = g[64 * k + bit];
        } else {
          const uint8_t byte = g[64 * (k % 4) + bit];
          u = k < 4 ? byte & 15u : byte >> 4;
          for (int plane = 0; plane < kPlanes<F>; ++plane) {
            const uint8_t* mask = g + 256 + 64 * plane + 8 * k;
            u += ((mask[bit / 8] >> (bit % 8)) & 1u) << (4 + plane);
          }
          if constexpr (kCrumbs<F>) u += ((g[256 + 64 * (k / 4) + bit] >> (2 * (k % 4))) & 3u) << 4;
        }
        out.u[i][4 * k + t] = (uint8_t)u;
      }
    }
    const uint8_t* p = g + kParamsAt<F>;
    if constexpr (F == Int8Format::Q4_K) {
      out.scale[0][i] = (float)p[i] * d[i];
      out.offset[0][i] = (float)p[16 + i] * neg_dmin[i];
    } else if constexpr (F == Int8Format::Q6_K) {
      for (int s = 0; s < 2; ++s) {
        out.scale[s][i] = (float)(int8_t)p[16 * s + i] * d[i];
        out.offset[s][i] = out.scale[s][i] * -kZero<F>;
      }
    } else {
      out.scale[0][i] = half_to_float(load_u16(p + 2 * i));
      out.offset[0][i] = out.scale[0][i] * -kZero<F>;
    }
  }
}

template <Int8Format F>
void tile_portable(const Int8Gemm& g, int64_t tile, int64_t row0, int rows) {
  const int64_t in = g.w.in, act_bytes = int8_act_row_bytes(in);
  const uint8_t* p = g.w.data + tile * int8_tile_bytes(F, in);
  Lanes acc[kPassRows] = {};
  float d[kTileRows] = {}, neg_dmin[kTileRows] = {};
  PortableGroup<F> group;
  int64_t gi = 0;
  for (int64_t block = 0; block < in / int8_block_cols(F); ++block) {
    for (int i = 0; i < kTileRows; ++i) {
      if constexpr (F == Int8Format::Q4_K || F == Int8Format::Q6_K) d[i] = half_to_float(load_u16(p + 2 * i));
      if constexpr (F == Int8Format::Q4_K) neg_dmin[i] = -half_to_float(load_u16(p + 32 + 2 * i));
    }
    p += int8_header_bytes(F);
    for (int64_t k = 0; k < int8_group_count(F); ++k, ++gi, p += int8_group_bytes(F)) {
      decode_group_portable<F>(p, d, neg_dmin, group);
      for (int r = 0; r < rows; ++r) {
        const uint8_t* row = g.x + (row0 + r) * act_bytes;
        const int8_t* xq = reinterpret_cast<const int8_t*>(row) + gi * kGroupCols;
        const float* xs = reinterpret_cast<const float*>(row + in) + 4 * gi;
        for (int i = 0; i < kTileRows; ++i) {
          int32_t sums[2] = {0, 0};
          for (int j = 0; j < kGroupCols; ++j) sums[j / 16] += (int32_t)group.u[i][j] * xq[j];
          float a = acc[r].v[i];
          if constexpr (F == Int8Format::Q4_K) {
            a = std::fma((float)(sums[0] + sums[1]), group.scale[0][i] * xs[0], a);
            a = std::fma(group.offset[0][i], xs[1], a);
          } else if constexpr (kSubGroups<F> == 1) {
            const int32_t centred = sums[0] + sums[1] - kZeroInt<F> * (code_sum(xs, 0) + code_sum(xs, 1));
            a = std::fma((float)centred, group.scale[0][i] * xs[0], a);
          } else {
            for (int h = 0; h < 2; ++h)
              a = std::fma((float)(sums[h] - kZeroInt<F> * code_sum(xs, h)), group.scale[h][i] * xs[0], a);
          }
          acc[r].v[i] = a;
        }
      }
    }
  }
  const int64_t o0 = tile * kTileRows, n = std::min<int64_t>(kTileRows, g.w.out - o0);
  for (int r = 0; r < rows; ++r) {
    float* y = g.y + (row0 + r) * g.y_stride + o0;
    for (int64_t i = 0; i < n; ++i) y[i] = acc[r].v[i] + (g.bias ? g.bias[o0 + i] : 0.0f);
  }
}

// Rows [row_begin, row_end) of W as float32: the one rounding of gguf's own dequantisation (every
// product is exact, so w = fma(u, scale, offset) is that value).
template <Int8Format F>
void dequantize_portable(const Int8Weights& w, int64_t row_begin, int64_t row_end, float* out) {
  PortableGroup<F> group;
  float d[kTileRows] = {}, neg_dmin[kTileRows] = {};
  for (int64_t tile = row_begin / kTileRows; tile * kTileRows < row_end; ++tile) {
    const uint8_t* p = w.data + tile * int8_tile_bytes(F, w.in);
    for (int64_t col = 0; col < w.in; col += int8_block_cols(F)) {
      for (int i = 0; i < kTileRows; ++i) {
        if constexpr (F == Int8Format::Q4_K || F == Int8Format::Q6_K) d[i] = half_to_float(load_u16(p + 2 * i));
        if constexpr (F == Int8Format::Q4_K) neg_dmin[i] = -half_to_float(load_u16(p + 32 + 2 * i));
      }
      p += int8_header_bytes(F);
      for (int64_t k = 0; k < int8_group_count(F); ++k, p += int8_group_bytes(F)) {
        decode_group_portable<F>(p, d, neg_dmin, group);
        for (int i = 0; i < kTileRows; ++i) {
          const int64_t o = tile * kTileRows + i;
          if (o < row_begin || o >= row_end) continue;
          float* row = out + (o - row_begin) * w.in + col + k * kGroupCols;
          for (int j = 0; j < kGroupCols; ++j) {
            const int s = j / (kGroupCols / kSubGroups<F>);
            row[j] = std::fma((float)group.u[i][j], group.scale[s][i], group.offset[s][i]);
          }
        }
      }
    }
  }
}

// --------------------------------------------------------------------------------------------
// AVX512-VNNI.

#if FSD_INT8_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12's unmasked AVX-512 intrinsics pass their builtins an undefined source operand, which
// -Wmaybe-uninitialized reports at every use; the instructions are the plain ones.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

constexpr __mmask16 kAll16 = 0xFFFF;

void quantize_row_avx512(const float* x, int64_t in, uint8_t* out) {
  float* params = reinterpret_cast<float*>(out + in);
  for (int64_t g = 0; g < in / kGroupCols; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * kGroupCols), b = _mm512_loadu_ps(x + g * kGroupCols + 16);
    const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
    // not finite: |v| > FLT_MAX, or unordered (NaN)
    const __m512 big = _mm512_set1_ps(FLT_MAX);
    const __mmask16 bad = _mm512_cmp_ps_mask(abs_a, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(abs_b, big, _CMP_NLE_UQ);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
    float dx, inv;
    group_scale(amax, bad == 0, dx, inv);
    const __m512 scale = _mm512_set1_ps(bad ? 0.0f : inv);  // (0 x inf is NaN: masked below)
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __mmask16 keep = bad ? 0 : kAll16;
    const __m512i ca = _mm512_maskz_min_epi32(keep, _mm512_max_epi32(qa, lo), hi);
    const __m512i cb = _mm512_maskz_min_epi32(keep, _mm512_max_epi32(qb, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + g * kGroupCols), _mm512_cvtepi32_epi8(ca));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + g * kGroupCols + 16), _mm512_cvtepi32_epi8(cb));
    store_group_params(params + 4 * g, dx, _mm512_reduce_add_epi32(ca), _mm512_reduce_add_epi32(cb));
  }
}

INT8_INLINE __m512 halves_to_float(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// acc + the byte products of w (unsigned) and four bytes of x (signed) at p, broadcast to every lane
// by the instruction's own memory operand ({1to16}), which GCC does not fold from a set1 (it issues a
// vpbroadcastd per operand: as many instructions as the products).
INT8_INLINE __m512i dot_broadcast(__m512i acc, __m512i w, const uint8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

template <Int8Format F, int R>
void tile_avx512(const Int8Gemm& g, int64_t tile, int64_t row0) {
  const int64_t in = g.w.in, act_bytes = int8_act_row_bytes(in);
  const uint8_t* p = g.w.data + tile * int8_tile_bytes(F, in);
  const uint8_t* xq[R];
  const float* xs[R];
  __m512 acc[R];
  INT8_UNROLL
  for (int r = 0; r < R; ++r) {
    xq[r] = g.x + (row0 + r) * act_bytes;
    xs[r] = reinterpret_cast<const float*>(xq[r] + in);
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 d = _mm512_setzero_ps(), neg_dmin = _mm512_setzero_ps();
  int64_t gi = 0;
  for (int64_t block = 0; block < in / int8_block_cols(F); ++block) {
    if constexpr (F == Int8Format::Q4_K || F == Int8Format::Q6_K) d = halves_to_float(p);
    if constexpr (F == Int8Format::Q4_K) neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), halves_to_float(p + 32));
    p += int8_header_bytes(F);
    for (int64_t k = 0; k < int8_group_count(F); ++k, ++gi, p += int8_group_bytes(F)) {
      for (int64_t line = 0; line < int8_group_bytes(F); line += 64)
        _mm_prefetch((const char*)p + kPrefetchBytes + line, _MM_HINT_T0);
      __m512i w[kOperands];
      if constexpr (F == Int8Format::Q8_0) {
        INT8_UNROLL
        for (int j = 0; j < kOperands; ++j) w[j] = _mm512_loadu_si512(p + 64 * j);
      } else {
        INT8_UNROLL
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(p + 64 * j);
          w[j] = _mm512_and_si512(v, nibble);
          w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        if constexpr (kCrumbs<F>) {  // operand 4h + k: bits 2k, 2k + 1 of chunk h's bytes, to bits 4, 5
          const __m512i two_bits = _mm512_set1_epi8(0x30);
          INT8_UNROLL
          for (int h = 0; h < 2; ++h) {
            const __m512i c = _mm512_loadu_si512(p + 256 + 64 * h);
            // (16-bit shifts: what crosses into the neighbouring byte lands outside bits 4-5)
            const __m512i at[4] = {_mm512_slli_epi16(c, 4), _mm512_slli_epi16(c, 2), c, _mm512_srli_epi16(c, 2)};
            INT8_UNROLL
            for (int k = 0; k < 4; ++k) w[4 * h + k] = _mm512_or_si512(w[4 * h + k], _mm512_and_si512(at[k], two_bits));
          }
        }
        INT8_UNROLL
        for (int plane = 0; plane < kPlanes<F>; ++plane) {
          const __m512i bit = _mm512_set1_epi8((char)(16 << plane));
          INT8_UNROLL
          for (int j = 0; j < kOperands; ++j) {
            uint64_t bits;
            std::memcpy(&bits, p + 256 + 64 * plane + 8 * j, 8);
            const __mmask64 m = _cvtu64_mask64(bits);
            w[j] = _mm512_mask_add_epi8(w[j], m, w[j], bit);
          }
        }
      }
      const uint8_t* pp = p + kParamsAt<F>;
      __m512 scale[kSubGroups<F>], offset[kSubGroups<F>];  // (offset: Q4_K's only)
      if constexpr (F == Int8Format::Q4_K) {
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pp));
        const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pp + 16));
        scale[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), d);
        offset[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)), neg_dmin);
      } else if constexpr (F == Int8Format::Q6_K) {
        INT8_UNROLL
        for (int s = 0; s < 2; ++s) {
          const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pp + 16 * s));
          scale[s] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), d);
        }
      } else {
        scale[0] = halves_to_float(pp);
      }
      INT8_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* x = xq[r] + gi * kGroupCols;
        const float* s = xs[r] + 4 * gi;
        const __m512 dx = _mm512_set1_ps(s[0]);
        if constexpr (kSubGroups<F> == 1) {
          // two chains of four: half the latency of one, which few rows cannot hide
          __m512i half[2];
          INT8_UNROLL
          for (int h = 0; h < 2; ++h) {
            half[h] = dot_broadcast(_mm512_setzero_si512(), w[h], x + 4 * h);
            INT8_UNROLL
            for (int j = 2 + h; j < kOperands; j += 2) half[h] = dot_broadcast(half[h], w[j], x + 4 * j);
          }
          const __m512i sum = _mm512_add_epi32(half[0], half[1]);
          if constexpr (F == Int8Format::Q4_K) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale[0], dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(offset[0], _mm512_set1_ps(s[1]), acc[r]);
          } else {  // the zero point in integers: vpsubd runs beside vpdpbusd, an FMA would not
            const int32_t zero_sum = kZeroInt<F> * (code_sum(s, 0) + code_sum(s, 1));
            const __m512i centred = _mm512_sub_epi32(sum, _mm512_set1_epi32(zero_sum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(scale[0], dx), acc[r]);
          }
        } else {
          __m512i sum[2];
          INT8_UNROLL
          for (int h = 0; h < 2; ++h) {
            sum[h] = dot_broadcast(_mm512_setzero_si512(), w[4 * h], x + 16 * h);
            INT8_UNROLL
            for (int j = 1; j < 4; ++j) sum[h] = dot_broadcast(sum[h], w[4 * h + j], x + 16 * h + 4 * j);
          }
          INT8_UNROLL
          for (int h = 0; h < 2; ++h) {
            const __m512i centred = _mm512_sub_epi32(sum[h], _mm512_set1_epi32(kZeroInt<F> * code_sum(s, h)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(scale[h], dx), acc[r]);
          }
        }
      }
    }
  }
  const int64_t o0 = tile * kTileRows, n = std::min<int64_t>(kTileRows, g.w.out - o0);
  const __mmask16 valid = (__mmask16)((1u << n) - 1u);
  const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(valid, g.bias + o0) : _mm512_setzero_ps();
  INT8_UNROLL
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(g.y + (row0 + r) * g.y_stride + o0, valid, _mm512_add_ps(acc[r], bias));
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// --------------------------------------------------------------------------------------------
// Dispatch.

using TileFn = void (*)(const Int8Gemm&, int64_t tile, int64_t row0, int rows);

#if FSD_INT8_X86
template <Int8Format F, int R = 1>
void tile_rows_avx512(const Int8Gemm& g, int64_t tile, int64_t row0, int rows) {
  if constexpr (R < kPassRows) {
    if (rows > R) return tile_rows_avx512<F, R + 1>(g, tile, row0, rows);
  }
  tile_avx512<F, R>(g, tile, row0);
}
#endif

template <class Fn>
auto with_format(Int8Format format, Fn&& f) {
  switch (format) {
    case Int8Format::Q6_K: return f(std::integral_constant<Int8Format, Int8Format::Q6_K>{});
    case Int8Format::Q5_0: return f(std::integral_constant<Int8Format, Int8Format::Q5_0>{});
    case Int8Format::Q8_0: return f(std::integral_constant<Int8Format, Int8Format::Q8_0>{});
    case Int8Format::Q4_K: break;
  }
  return f(std::integral_constant<Int8Format, Int8Format::Q4_K>{});
}

TileFn select_tile(const Int8Gemm& g) {
#if FSD_INT8_X86
  if (g.path == Int8Path::Best && int8_vnni_available())
    return with_format(g.w.format, [](auto f) -> TileFn { return tile_rows_avx512<decltype(f)::value>; });
#endif
  return with_format(g.w.format, [](auto f) -> TileFn { return tile_portable<decltype(f)::value>; });
}

}  // namespace

bool int8_vnni_available() {
#if FSD_INT8_X86
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return available;
#else
  return false;
#endif
}

void int8_quantize(const float* x, int64_t x_stride, int64_t rows, int64_t in, uint8_t* out, Int8Path path,
                   const ParallelFor& parallel_for) {
  const int64_t row_bytes = int8_act_row_bytes(in);
  parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if FSD_INT8_X86
      if (path == Int8Path::Best && int8_vnni_available()) {
        quantize_row_avx512(x + r * x_stride, in, out + r * row_bytes);
        continue;
      }
#endif
      quantize_row_portable(x + r * x_stride, in, out + r * row_bytes);
    }
  });
}

void int8_dequantize(const Int8Weights& w, int64_t row_begin, int64_t row_end, float* out,
                     const ParallelFor& parallel_for) {
  const int64_t first_tile = row_begin / kTileRows, tiles = (row_end + kTileRows - 1) / kTileRows - first_tile;
  parallel_for(tiles, 4, [&](int64_t begin, int64_t end) {
    const int64_t rows_begin = std::max(row_begin, (first_tile + begin) * kTileRows);
    const int64_t rows_end = std::min(row_end, (first_tile + end) * kTileRows);
    with_format(w.format, [&](auto f) {
      dequantize_portable<decltype(f)::value>(w, rows_begin, rows_end, out + (rows_begin - row_begin) * w.in);
    });
  });
}

void int8_gemm_many(const Int8Gemm* problems, int64_t count, const ParallelFor& parallel_for) {
  std::vector<int64_t> first_tile(count + 1, 0);  // problem p's tiles: [first_tile[p], first_tile[p + 1])
  std::vector<TileFn> tile_fns(count);
  for (int64_t p = 0; p < count; ++p) {
    first_tile[p + 1] = first_tile[p] + (problems[p].w.out + kTileRows - 1) / kTileRows;
    tile_fns[p] = select_tile(problems[p]);
  }
  parallel_for(first_tile[count], 1, [&](int64_t begin, int64_t end) {
    int64_t p = std::upper_bound(first_tile.begin(), first_tile.end(), begin) - first_tile.begin() - 1;
    for (int64_t tile = begin; tile < end; ++tile) {
      while (tile >= first_tile[p + 1]) ++p;
      const Int8Gemm& g = problems[p];
      for (int64_t row0 = 0; row0 < g.rows; row0 += kPassRows)
        tile_fns[p](g, tile - first_tile[p], row0, (int)std::min<int64_t>(kPassRows, g.rows - row0));
    }
  });
}

void int8_gemm(const Int8Gemm& g, const ParallelFor& parallel_for) { int8_gemm_many(&g, 1, parallel_for); }

}  // namespace fsd_cpu_linear
