// See quant_gemm.h. Each path computes one block of four weight rows against up to kPassRows rows
// of x over a range of columns, with a register accumulator per (weight row, x row); the weights
// are decoded in registers (shared by all those x rows) and never written to memory.
//
// Loop order: each task (16 blocks) goes over the columns in chunks, and over all its blocks
// within a chunk, so that the chunk of x (at most kXChunkBytes) stays in L1 for the 16 blocks while
// the codes stream past it. The first ordering tried, whole rows block by block, read x from L2
// once it outgrew L1 beside the codes (in = 8960, or 6 rows of in = 1536) and ran slower there.
//
// Against skinny_gemm's AVX512-BF16 path on bfloat16 weights Q4 wins at 1-2 rows, where both are
// bound by memory, and about evens at 6, where both are bound by multiply-adds (docs/cpu.md, "The
// quantised-weight kernel's design choices"; benchmarks/bench_cpu_linear.py measures it as built).
#include "cpu_linear/quant_gemm.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu_linear/skinny_gemm.h"  // avx2_available, bf16_dot_available: the CPU checks of both kernels
#include "cpu_linear/x86_sums.h"

namespace fsd_cpu_linear {
namespace {

constexpr int64_t kXChunkBytes = 24 << 10;  // x columns per chunk: half of a 48 KB L1

// One call of a path's block kernel: x rows [row0, row0 + R) times block `block` of W over columns
// [c0, c1) (whole groups). The first column chunk stores bias + sums into y, later ones add theirs.
struct BlockSpan {
  int64_t block, row0, c0, c1;
  bool first_chunk;
  bool prefetch_next;  // prefetch the next block's codes and params over the same columns
};

// y[row][o0 + b] for the block's rows b < 4 that exist (the padding rows past `out` are dropped).
FSD_ALWAYS_INLINE void store_sums(const QuantGemm& g, const BlockSpan& s, int64_t row, const float* sums) {
  const int64_t o0 = s.block * kQuantBlockRows;
  const int64_t n = std::min<int64_t>(kQuantBlockRows, g.w.out - o0);
  float* y = g.y + row * g.y_stride + o0;
  for (int64_t b = 0; b < n; ++b) {
    const float before = s.first_chunk ? (g.bias ? g.bias[o0 + b] : 0.0f) : y[b];
    y[b] = before + sums[b];
  }
}

// The weights of row b of a block over one group: `row_codes` is that row's quant_row_code_bytes
// bytes of the group.
template <QuantFormat F>
FSD_ALWAYS_INLINE void decode_group(const uint8_t* row_codes, const float* group_params, int b, float* weights) {
  if constexpr (F == QuantFormat::Q4) {
    const float scale = group_params[2 * b], offset = group_params[2 * b + 1];
    FSD_SIMD for (int j = 0; j < 16; ++j) {
      weights[j] = std::fma((float)(row_codes[j] & 15), scale, offset);
      weights[j + 16] = std::fma((float)(row_codes[j] >> 4), scale, offset);
    }
  } else {
    const float scale = group_params[b];
    FSD_SIMD for (int j = 0; j < quant_group_size(F); ++j) weights[j] = (float)(int8_t)row_codes[j] * scale;
  }
}

// Portable C++: each group's weights decoded into a small array, then per-lane partial sums (which
// vectorise without reassociating a sum).
struct Portable {
  static constexpr int kPassRows = 4;

  template <QuantFormat F, int R>
  static void block(const QuantGemm& g, const BlockSpan& s) {
    constexpr int64_t kGroup = quant_group_size(F), kParams = quant_params_per_group(F);
    const uint8_t* codes = quant_block_codes(g.w, s.block);
    const float* params = quant_block_params(g.w, s.block);
    float acc[kQuantBlockRows][R][kGroup] = {};
    float weights[kGroup];
    for (int64_t k = s.c0 / kGroup; k < s.c1 / kGroup; ++k) {
      for (int b = 0; b < kQuantBlockRows; ++b) {
        decode_group<F>(codes + k * quant_code_bytes(F) + quant_row_code_bytes(F) * b, params + k * kParams, b, weights);
        for (int r = 0; r < R; ++r) {
          const float* x = g.x + (s.row0 + r) * g.x_stride + k * kGroup;
          FSD_SIMD for (int64_t j = 0; j < kGroup; ++j) acc[b][r][j] += weights[j] * x[j];
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float sums[kQuantBlockRows];
      for (int b = 0; b < kQuantBlockRows; ++b) {
        sums[b] = 0.0f;
        for (int64_t j = 0; j < kGroup; ++j) sums[b] += acc[b][r][j];
      }
      store_sums(g, s, s.row0 + r, sums);
    }
  }
};

#if FSD_X86_INTRINSICS
#pragma GCC push_options
#pragma GCC target("avx512f")
// AVX-512: 16 weights per register. Q4 decodes a row's group with one fma into a table of its 16
// possible weights (fma(c, scale, offset) for c = 0..15, the exact values) and two lookups (vpermps
// reads the low four bits of each index), instead of converting every code; Q8 converts and scales.
// 4 x 6 accumulators and the decoded weights fit the 32 registers.
// (The full-mask forms of these instructions: the plain ones pass GCC 12 an undefined source,
// which -Wmaybe-uninitialized reports; with every lane selected the instruction is the same.)
constexpr __mmask16 kAll = 0xFFFF;
FSD_ALWAYS_INLINE __m512i widen_unsigned(__m128i bytes) { return _mm512_maskz_cvtepu8_epi32(kAll, bytes); }
FSD_ALWAYS_INLINE __m512i widen_signed(__m128i bytes) { return _mm512_maskz_cvtepi8_epi32(kAll, bytes); }
FSD_ALWAYS_INLINE __m512 to_float(__m512i v) { return _mm512_maskz_cvtepi32_ps(kAll, v); }
FSD_ALWAYS_INLINE __m512 lookup(__m512i index, __m512 table) { return _mm512_maskz_permutexvar_ps(kAll, index, table); }
FSD_ALWAYS_INLINE __m512i high_nibbles(__m512i v) { return _mm512_maskz_srli_epi32(kAll, v, 4); }

struct Avx512 {
  static constexpr int kPassRows = 6;

  template <QuantFormat F, int R>
  static void block(const QuantGemm& g, const BlockSpan& s) {
    constexpr int64_t kGroup = quant_group_size(F), kParams = quant_params_per_group(F);
    const int64_t groups = quant_group_count(g.w);
    const uint8_t* codes = quant_block_codes(g.w, s.block);
    const float* params = quant_block_params(g.w, s.block);
    const float* x_row[R];
    FSD_UNROLL
    for (int r = 0; r < R; ++r) x_row[r] = g.x + (s.row0 + r) * g.x_stride;
    __m512 acc[kQuantBlockRows][R];
    FSD_UNROLL
    for (int b = 0; b < kQuantBlockRows; ++b)
      FSD_UNROLL
      for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
    const __m512 code_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    constexpr int64_t kCodeBytes = quant_code_bytes(F), kRowBytes = quant_row_code_bytes(F);
    for (int64_t k = s.c0 / kGroup; k < s.c1 / kGroup; ++k) {
      const uint8_t* c = codes + k * kCodeBytes;
      const float* p = params + k * kParams;
      const int64_t col = k * kGroup;
      if (s.prefetch_next) {  // the next block's same group: its line(s) of codes, part of a line of params
        FSD_UNROLL
        for (int64_t line = 0; line < kCodeBytes; line += 64)
          _mm_prefetch((const char*)(c + groups * kCodeBytes + line), _MM_HINT_T0);
        _mm_prefetch((const char*)(p + groups * kParams), _MM_HINT_T0);
      }
      FSD_UNROLL
      for (int b = 0; b < kQuantBlockRows; ++b) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kRowBytes * b));
        if constexpr (F == QuantFormat::Q4) {
          const __m512i v = widen_unsigned(bytes);
          const __m512 table = _mm512_fmadd_ps(code_values, _mm512_set1_ps(p[2 * b]), _mm512_set1_ps(p[2 * b + 1]));
          const __m512 low = lookup(v, table);  // columns 0..15
          FSD_UNROLL
          for (int r = 0; r < R; ++r) acc[b][r] = _mm512_fmadd_ps(low, _mm512_loadu_ps(x_row[r] + col), acc[b][r]);
          const __m512 high = lookup(high_nibbles(v), table);  // columns 16..31
          FSD_UNROLL
          for (int r = 0; r < R; ++r) acc[b][r] = _mm512_fmadd_ps(high, _mm512_loadu_ps(x_row[r] + col + 16), acc[b][r]);
        } else {  // Q8, Q8G32: 16 codes at a time
          const __m512 scale = _mm512_set1_ps(p[b]);
          FSD_UNROLL
          for (int64_t j = 0; j < kGroup; j += 16) {
            const __m128i sixteen = j == 0 ? bytes : _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kRowBytes * b + j));
            const __m512 w = _mm512_mul_ps(to_float(widen_signed(sixteen)), scale);
            FSD_UNROLL
            for (int r = 0; r < R; ++r) acc[b][r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x_row[r] + col + j), acc[b][r]);
          }
        }
      }
    }
    static_assert(kQuantBlockRows == 4, "sum4 reduces four weight rows");
    FSD_UNROLL
    for (int r = 0; r < R; ++r) {
      float sums[kQuantBlockRows];
      x86::sum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r], sums);
      store_sums(g, s, s.row0 + r, sums);
    }
  }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")
// Rows [row_begin, row_end) of W decoded as in Avx512::block, into float32 rows (`out`), or rounded
// to bfloat16 by vcvtneps2bf16 (`out_bf16`: nearest even, as torch rounds; it reads float32
// subnormals as zero, which no weight of a GGUF file is). Compiled for AVX512-BF16, but the
// float32 instantiation holds no AVX512-BF16 instruction, so it runs on any AVX-512 CPU.
template <QuantFormat F, bool kBfloat16>
void dequantize_rows_avx512(const QuantWeights& w, int64_t row_begin, int64_t row_end, float* out, uint16_t* out_bf16) {
  constexpr int64_t kGroup = quant_group_size(F), kParams = quant_params_per_group(F);
  const __m512 code_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t o = row_begin; o < row_end; ++o) {
    const int b = (int)(o % kQuantBlockRows);
    const uint8_t* codes = quant_block_codes(w, o / kQuantBlockRows) + quant_row_code_bytes(F) * b;
    const float* params = quant_block_params(w, o / kQuantBlockRows);
    const int64_t row = (o - row_begin) * w.in;
    auto store = [&](int64_t col, __m512 values) FSD_INLINE_LAMBDA {
      if constexpr (kBfloat16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_bf16 + row + col), (__m256i)_mm512_cvtneps_pbh(values));
      } else {
        _mm512_storeu_ps(out + row + col, values);
      }
    };
    for (int64_t k = 0; k < w.in / kGroup; ++k) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * quant_code_bytes(F)));
      const float* p = params + k * kParams;
      if constexpr (F == QuantFormat::Q4) {
        const __m512i v = widen_unsigned(bytes);
        const __m512 table = _mm512_fmadd_ps(code_values, _mm512_set1_ps(p[2 * b]), _mm512_set1_ps(p[2 * b + 1]));
        store(k * kGroup, lookup(v, table));
        store(k * kGroup + 16, lookup(high_nibbles(v), table));
      } else {
        store(k * kGroup, _mm512_mul_ps(to_float(widen_signed(bytes)), _mm512_set1_ps(p[b])));
        if constexpr (kGroup == 32) {
          const __m128i upper = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * quant_code_bytes(F) + 16));
          store(k * kGroup + 16, _mm512_mul_ps(to_float(widen_signed(upper)), _mm512_set1_ps(p[b])));
        }
      }
    }
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// AVX2 + FMA: 8 weights per register, each eighth of a row's group converted and scaled (with the
// same fma as the other paths); 4 x 3 accumulators, the scale and offset and one weight register
// in 16. The codes are loaded once per eighth (a zero- or sign-extending load), so no wider
// register of codes stays live.
struct Avx2 {
  static constexpr int kPassRows = 3;

  template <QuantFormat F, int R>
  static void block(const QuantGemm& g, const BlockSpan& s) {
    constexpr int64_t kGroup = quant_group_size(F), kParams = quant_params_per_group(F);
    const int64_t groups = quant_group_count(g.w);
    const uint8_t* codes = quant_block_codes(g.w, s.block);
    const float* params = quant_block_params(g.w, s.block);
    const float* x_row[R];
    FSD_UNROLL
    for (int r = 0; r < R; ++r) x_row[r] = g.x + (s.row0 + r) * g.x_stride;
    __m256 acc[kQuantBlockRows][R];
    FSD_UNROLL
    for (int b = 0; b < kQuantBlockRows; ++b)
      FSD_UNROLL
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
    auto eight_codes = [](const uint8_t* p) FSD_INLINE_LAMBDA {
      return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    };
    auto add_products = [&](int b, __m256 w, int64_t col) FSD_INLINE_LAMBDA {
      FSD_UNROLL
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x_row[r] + col), acc[b][r]);
    };
    constexpr int64_t kCodeBytes = quant_code_bytes(F);
    for (int64_t k = s.c0 / kGroup; k < s.c1 / kGroup; ++k) {
      const uint8_t* c = codes + k * kCodeBytes;
      const float* p = params + k * kParams;
      const int64_t col = k * kGroup;
      if (s.prefetch_next) {
        FSD_UNROLL
        for (int64_t line = 0; line < kCodeBytes; line += 64)
          _mm_prefetch((const char*)(c + groups * kCodeBytes + line), _MM_HINT_T0);
        _mm_prefetch((const char*)(p + groups * kParams), _MM_HINT_T0);
      }
      FSD_UNROLL
      for (int b = 0; b < kQuantBlockRows; ++b) {
        const uint8_t* row_codes = c + quant_row_code_bytes(F) * b;
        if constexpr (F == QuantFormat::Q4) {
          const __m256 scale = _mm256_set1_ps(p[2 * b]), offset = _mm256_set1_ps(p[2 * b + 1]);
          const __m256i nibble = _mm256_set1_epi32(15);
          FSD_UNROLL
          for (int half = 0; half < 2; ++half) {  // bytes 0..7, then 8..15
            const __m256i low = _mm256_and_si256(_mm256_cvtepu8_epi32(eight_codes(row_codes + 8 * half)), nibble);
            add_products(b, _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), scale, offset), col + 8 * half);
            const __m256i high = _mm256_srli_epi32(_mm256_cvtepu8_epi32(eight_codes(row_codes + 8 * half)), 4);
            add_products(b, _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), scale, offset), col + 16 + 8 * half);
          }
        } else {
          const __m256 scale = _mm256_set1_ps(p[b]);
          FSD_UNROLL
          for (int eighth = 0; eighth < kGroup / 8; ++eighth) {
            const __m256i v = _mm256_cvtepi8_epi32(eight_codes(row_codes + 8 * eighth));
            add_products(b, _mm256_mul_ps(_mm256_cvtepi32_ps(v), scale), col + 8 * eighth);
          }
        }
      }
    }
    FSD_UNROLL
    for (int r = 0; r < R; ++r) {
      alignas(16) float sums[kQuantBlockRows];
      _mm_store_ps(sums, x86::sum4_avx2(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
      store_sums(g, s, s.row0 + r, sums);
    }
  }
};
#pragma GCC pop_options
#endif

// Path::block<F, R> for the R = `rows` (1..kPassRows) known at compile time.
template <class Path, QuantFormat F, int R = 1>
FSD_ALWAYS_INLINE void block_rows(const QuantGemm& g, const BlockSpan& s, int64_t rows) {
  if constexpr (R < Path::kPassRows) {
    if (rows > R) return block_rows<Path, F, R + 1>(g, s, rows);
  }
  Path::template block<F, R>(g, s);
}

// x columns per chunk: as many whole groups as keep `rows` rows of x within kXChunkBytes.
int64_t column_chunk(const QuantGemm& g) {
  const int64_t group = quant_group_size(g.w.format);
  const int64_t fitting = kXChunkBytes / (int64_t(sizeof(float)) * g.rows) / group * group;
  return std::min(g.w.in, std::max(group, fitting));
}

// Blocks [block_begin, block_end): column chunk by column chunk, every block within a chunk.
template <class Path, QuantFormat F>
void run_task(const QuantGemm& g, int64_t block_begin, int64_t block_end) {
  const int64_t chunk = column_chunk(g);
  for (int64_t c0 = 0; c0 < g.w.in; c0 += chunk) {
    const int64_t c1 = std::min(g.w.in, c0 + chunk);
    for (int64_t block = block_begin; block < block_end; ++block) {
      for (int64_t row0 = 0; row0 < g.rows; row0 += Path::kPassRows) {
        const BlockSpan span{block, row0, c0, c1, c0 == 0, row0 == 0 && block + 1 < block_end};
        block_rows<Path, F>(g, span, std::min<int64_t>(Path::kPassRows, g.rows - row0));
      }
    }
  }
}

using TaskFn = void (*)(const QuantGemm&, int64_t, int64_t);

// f(std::integral_constant<QuantFormat, F>{}) for the F of `format`.
template <class Fn>
auto with_format(QuantFormat format, Fn&& f) {
  switch (format) {
    case QuantFormat::Q4: return f(std::integral_constant<QuantFormat, QuantFormat::Q4>{});
    case QuantFormat::Q8G32: return f(std::integral_constant<QuantFormat, QuantFormat::Q8G32>{});
    case QuantFormat::Q8: break;
  }
  return f(std::integral_constant<QuantFormat, QuantFormat::Q8>{});
}

template <class Path>
TaskFn task_for(QuantFormat format) {
  return with_format(format, [](auto f) -> TaskFn { return run_task<Path, decltype(f)::value>; });
}

TaskFn select_task(const QuantGemm& g) {
#if FSD_X86_INTRINSICS
  if ((g.path == QuantPath::Best || g.path == QuantPath::Avx512) &&
      quant_avx512_available())
    return task_for<Avx512>(g.w.format);
  if (g.path != QuantPath::Portable && avx2_available()) return task_for<Avx2>(g.w.format);
#endif
  return task_for<Portable>(g.w.format);
}

// Nearest-even bfloat16 of a float (NaN stays a quiet NaN), as torch rounds.
FSD_ALWAYS_INLINE uint16_t round_to_bfloat16(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

// Portable dequantisation (and the bfloat16 rounding where the CPU lacks AVX512-BF16).
template <QuantFormat F>
void dequantize_rows_portable(const QuantWeights& w, int64_t row_begin, int64_t row_end, float* out, uint16_t* out_bf16) {
  constexpr int64_t kGroup = quant_group_size(F), kParams = quant_params_per_group(F);
  float weights[kGroup];
  for (int64_t o = row_begin; o < row_end; ++o) {
    const int b = (int)(o % kQuantBlockRows);
    const uint8_t* codes = quant_block_codes(w, o / kQuantBlockRows) + quant_row_code_bytes(F) * b;
    const float* params = quant_block_params(w, o / kQuantBlockRows);
    const int64_t row = (o - row_begin) * w.in;
    for (int64_t k = 0; k < w.in / kGroup; ++k) {
      float* dst = out ? out + row + k * kGroup : weights;
      decode_group<F>(codes + k * quant_code_bytes(F), params + k * kParams, b, dst);
      if (!out) {
        for (int64_t j = 0; j < kGroup; ++j) out_bf16[row + k * kGroup + j] = round_to_bfloat16(weights[j]);
      }
    }
  }
}

template <QuantFormat F>
void dequantize_rows(const QuantWeights& w, int64_t row_begin, int64_t row_end, float* out, uint16_t* out_bf16) {
#if FSD_X86_INTRINSICS
  if (quant_avx512_available()) {
    if (out) return dequantize_rows_avx512<F, false>(w, row_begin, row_end, out, nullptr);
    if (bf16_dot_available()) return dequantize_rows_avx512<F, true>(w, row_begin, row_end, nullptr, out_bf16);
  }
#endif
  dequantize_rows_portable<F>(w, row_begin, row_end, out, out_bf16);
}

}  // namespace

bool quant_avx512_available() {
#if FSD_X86_INTRINSICS
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
#else
  return false;
#endif
}

void quant_gemm(const QuantGemm& g, const ParallelFor& parallel_for) {
  const int64_t blocks = (g.w.out + kQuantBlockRows - 1) / kQuantBlockRows;
  const int64_t tasks = (blocks + kQuantTaskBlocks - 1) / kQuantTaskBlocks;
  const TaskFn task = select_task(g);
  parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    task(g, begin * kQuantTaskBlocks, std::min(blocks, end * kQuantTaskBlocks));
  });
}

void quant_dequantize(const QuantWeights& w, int64_t row_begin, int64_t row_end, float* out, uint16_t* out_bf16,
                      const ParallelFor& parallel_for) {
  parallel_for(row_end - row_begin, 16, [&](int64_t begin, int64_t end) {
    float* rows_out = out ? out + begin * w.in : nullptr;
    uint16_t* rows_out_bf16 = out_bf16 ? out_bf16 + begin * w.in : nullptr;
    with_format(w.format, [&](auto format) {
      dequantize_rows<decltype(format)::value>(w, row_begin + begin, row_begin + end, rows_out, rows_out_bf16);
    });
  });
}

}  // namespace fsd_cpu_linear
