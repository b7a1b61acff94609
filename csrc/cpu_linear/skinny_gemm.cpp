// See skinny_gemm.h. Register blocking: kOutBlock weight rows x kRowGroup rows of x, each with a
// kChunk-lane partial sum (2 x 4 x 8 floats: eight AVX registers), so every weight load feeds
// kRowGroup multiply-adds and every x load kOutBlock. More than kRowGroup rows of x are done in
// groups over the same weight block, which is then still in L1/L2, so W leaves memory once.
// bfloat16 weights, portable path: each block is first widened into a float32 scratch (a vectorised
// pass that stays in cache), so the inner loops are the float32 ones and memory sees half the bytes.
// Two paths are written with intrinsics, where the portable loops measured far slower: with bfloat16
// x too and AVX512-BF16, `vdpbf16ps` multiplies 32 bfloat16 pairs per instruction straight from the
// stored weights (no compiler emits it from a loop); otherwise, with AVX2, float32 weights and
// bfloat16 ones widened in a register as they are loaded (the portable loop written that way
// compiled to accumulators kept on the stack). Both prefetch the next block of weights by hand.
// The measurements behind these choices: docs/cpu.md ("The few-row kernel's design choices").
#include "cpu_linear/skinny_gemm.h"

#include <algorithm>
#include <vector>

#include "cpu_linear/x86_sums.h"  // FSD_X86_INTRINSICS: GCC on x86-64, else the portable loops alone

namespace fsd_cpu_linear {
namespace {

constexpr int kOutBlock = 2;   // weight rows sharing each x load
constexpr int kRowGroup = 4;   // rows of x sharing each weight load
constexpr int kChunk = 8;      // lanes of each partial sum
constexpr int64_t kOutGrain = 64;  // output features per parallel task (a multiple of kOutBlock)
constexpr int64_t kBlockBytes = 96 * 1024;  // float32 weight bytes reused across row groups (fits L2)
constexpr int64_t kWidenedBytes = 24 * 1024;  // widened bfloat16 block: consumed from L1

// Weight rows [o, o + n) of one block, as float32: row j at rows + j * stride.
struct WeightBlock {
  const float* rows;
  int64_t stride;
  int64_t o, n;
};

// Rows [row0, row0 + R) of x times weight rows j and j + 1 of the block (only j when single).
template <int R>
FSD_ALWAYS_INLINE void dot_block(const SkinnyGemm& g, const WeightBlock& w, int64_t row0, int64_t j, bool single) {
  const float* w0 = w.rows + j * w.stride;
  const float* w1 = single ? w0 : w0 + w.stride;  // a lone last row is computed twice, stored once
  float acc[kOutBlock][R][kChunk] = {};
  int64_t i = 0;
  for (; i + kChunk <= g.in; i += kChunk) {
    for (int r = 0; r < R; ++r) {
      const float* xr = g.x + (row0 + r) * g.x_stride + i;
      FSD_SIMD for (int l = 0; l < kChunk; ++l) {
        acc[0][r][l] += w0[i + l] * xr[l];
        acc[1][r][l] += w1[i + l] * xr[l];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xr = g.x + (row0 + r) * g.x_stride;
    for (int b = 0; b < kOutBlock; ++b) {
      const float* wr = b == 0 ? w0 : w1;
      float sum = 0.0f;
      for (int l = 0; l < kChunk; ++l) sum += acc[b][r][l];
      for (int64_t t = i; t < g.in; ++t) sum += wr[t] * xr[t];  // the in % kChunk tail
      if (b == 1 && single) break;
      const int64_t col = w.o + j + b;
      g.y[(row0 + r) * g.y_stride + col] = sum + (g.bias ? g.bias[col] : 0.0f);
    }
  }
}

template <int R>
FSD_CPU_CLONES void dot_rows(const SkinnyGemm& g, const WeightBlock& w, int64_t row0) {
  for (int64_t j = 0; j < w.n; j += kOutBlock) dot_block<R>(g, w, row0, j, j + 1 >= w.n);
}

// dst[i] = float(src[i]) for bfloat16 bit patterns.
FSD_CPU_CLONES void widen_bfloat16(const uint16_t* src, float* dst, int64_t n) {
  FSD_SIMD for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float((uint32_t)src[i] << 16);
}

#if FSD_X86_INTRINSICS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
using x86::sum4;
using x86::sum4_avx2;
constexpr int kDotRows = 4;  // weight rows per pass over x: 4 x kRowGroup accumulators (16 zmm)
// Blocks up to this size are prefetched into L1, larger ones into L2: a next block that large,
// brought into L1 (48 KB here) beside the current one and x, evicts the lines still in use. The
// lm_head's 12 KB blocks measured the same either way.
constexpr int64_t kL1PrefetchBytes = 16 << 10;
// With several passes over such a block, x's rows (6 x 17.5 KB for in = 8960) no longer fit in L1
// either, and each pass reread the block and x from L2; then the passes go over kDotColumnChunk
// columns at a time, keeping their sums in memory between chunks (splitting in = 1536 was slower,
// so smaller blocks keep whole rows).
constexpr int64_t kDotColumnChunk = 1024;  // a multiple of 32: only the last chunk has a tail

// A block of kDotRows weight rows too large for L1 prefetches (and, with several passes, column
// chunks): the down projections' 39-70 KB blocks, not the lm_head's 12 KB ones.
FSD_ALWAYS_INLINE bool is_large_block(const SkinnyGemm& g) {
  return kDotRows * g.in * int64_t(sizeof(uint16_t)) > kL1PrefetchBytes;
}

// 32 bfloat16 values at p: all of them (`full`), or those in `mask` and 0 elsewhere (they add 0 * 0;
// a masked load, which costs an ALU operation more, only for the in % 32 tail).
FSD_ALWAYS_INLINE __m512bh load_bf16(const uint16_t* p, __mmask32 mask, bool full) {
  return (__m512bh)(full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p));
}

// Rows [row0, row0 + R) of x times weight rows [o, o + n) (n <= kDotRows), 32 pairs per
// instruction; the in % 32 tail by masked loads. The products of bfloat16 values are exact in
// float32, so this differs from the widening path by the order of its float32 additions alone
// (and flushes float32 subnormals, as the instruction does).
// prefetch_rows: bit b set = prefetch the next block's row b during this pass. Columns
// [i_begin, i_end) only: before the last chunk the sums go to `saved` (kDotRows x R), and a chunk
// after the first starts from them.
template <int R>
void dot_bf16_block(const SkinnyGemm& g, int64_t o, int n, int64_t row0, unsigned prefetch_rows,
                    int64_t i_begin, int64_t i_end, __m512* saved) {
  // Row pointers set up once (recomputing them from g each iteration cost more than the products).
  const uint16_t* w_row[kDotRows];
  const uint16_t* x_row[R];
  FSD_UNROLL
  for (int b = 0; b < kDotRows; ++b) w_row[b] = static_cast<const uint16_t*>(g.w) + (o + std::min(b, n - 1)) * g.w_stride;
  FSD_UNROLL
  for (int r = 0; r < R; ++r) x_row[r] = g.x_bf16 + (row0 + r) * g.x_stride;
  const int64_t next_block = kDotRows * g.w_stride;  // the next block's row b: w_row[b] + next_block
  const bool prefetch_to_l2 = is_large_block(g);
  __m512 acc[kDotRows][R];
  FSD_UNROLL
  for (int b = 0; b < kDotRows; ++b)
    FSD_UNROLL
    for (int r = 0; r < R; ++r) acc[b][r] = i_begin > 0 ? saved[b * R + r] : _mm512_setzero_ps();
  // One step of 32 pairs per (weight row, x row) at column i; `mask` holds the columns < in.
  auto step = [&](int64_t i, __mmask32 mask, bool full) FSD_INLINE_LAMBDA {
    __m512bh wv[kDotRows];
    FSD_UNROLL
    for (int b = 0; b < kDotRows; ++b) wv[b] = load_bf16(w_row[b] + i, mask, full);
    // The next block's rows, a block ahead: at this much work per byte the hardware prefetcher
    // alone left the loop waiting on memory.
    FSD_UNROLL
    for (int b = 0; b < kDotRows; ++b) {
      if (!(prefetch_rows & (1u << b))) continue;
      const char* ahead = (const char*)(w_row[b] + next_block + i);
      if (prefetch_to_l2) _mm_prefetch(ahead, _MM_HINT_T1);
      else _mm_prefetch(ahead, _MM_HINT_T0);
    }
    FSD_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bf16(x_row[r] + i, mask, full);
      FSD_UNROLL
      for (int b = 0; b < kDotRows; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  };
  int64_t i = i_begin;
  for (; i + 32 <= i_end; i += 32) step(i, ~__mmask32(0), true);
  if (i < i_end) step(i, (__mmask32(1) << (i_end - i)) - 1, false);
  if (i_end < g.in) {  // more columns to come: keep the sums
    FSD_UNROLL
    for (int b = 0; b < kDotRows; ++b)
      FSD_UNROLL
      for (int r = 0; r < R; ++r) saved[b * R + r] = acc[b][r];
    return;
  }
  // Reduced with constant indices only (a runtime one would keep acc in memory through the loop).
  static_assert(kDotRows == 4, "sum4 reduces four weight rows");
  FSD_UNROLL
  for (int r = 0; r < R; ++r) {
    float sum[kDotRows];
    sum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r], sum);
    float* y = g.y + (row0 + r) * g.y_stride + o;
    for (int b = 0; b < n; ++b)  // rows past n (a short last block) repeat row n - 1: not stored
      y[b] = sum[b] + (g.bias ? g.bias[o + b] : 0.0f);
  }
}

// Output features [begin, end) by the AVX512-BF16 path: each block of kDotRows weight rows is read
// from memory once and meets every group of x rows while it is in L1. (Widening the weights in
// registers for plain float32 multiply-adds, twice vdpbf16ps's rate on the Xeon measured, was no
// faster.)
//
// The prefetches of the next block are shared out over the passes (pass p takes rows b with
// b % passes == p), so that memory is busy during every pass: all of them in the first pass left
// memory idle during the others. A longer distance (2 blocks) measured the same, and so did an L2
// hint for these 12 KB blocks (larger ones take it: kL1PrefetchBytes).
void out_range_bf16_dot(const SkinnyGemm& g, int64_t begin, int64_t end) {
  const int passes = (int)((g.rows + kRowGroup - 1) / kRowGroup);
  const int64_t chunk = passes > 1 && is_large_block(g) ? kDotColumnChunk : g.in;
  alignas(64) __m512 saved[kSkinnyMaxRows / kRowGroup][kDotRows * kRowGroup];  // per pass
  for (int64_t o = begin; o < end; o += kDotRows) {
    const int n = (int)std::min<int64_t>(kDotRows, end - o);
    const bool next_is_whole = o + 2 * kDotRows <= end;
    for (int64_t c = 0; c < g.in; c += chunk) {
      const int64_t c_end = std::min(g.in, c + chunk);
      for (int pass = 0; pass < passes; ++pass) {
        unsigned prefetch_rows = 0;
        for (int b = pass; next_is_whole && b < kDotRows; b += passes) prefetch_rows |= 1u << b;
        const int64_t row0 = int64_t(pass) * kRowGroup;
        __m512* sums = saved[pass];
        switch (std::min<int64_t>(kRowGroup, g.rows - row0)) {
          case 1: dot_bf16_block<1>(g, o, n, row0, prefetch_rows, c, c_end, sums); break;
          case 2: dot_bf16_block<2>(g, o, n, row0, prefetch_rows, c, c_end, sums); break;
          case 3: dot_bf16_block<3>(g, o, n, row0, prefetch_rows, c, c_end, sums); break;
          default: dot_bf16_block<4>(g, o, n, row0, prefetch_rows, c, c_end, sums); break;
        }
      }
    }
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// float32 x on AVX2 + FMA (any x86-64 CPU of the last decade), float32 or bfloat16 weights (those
// without AVX512-BF16, or with float32 x): bfloat16 weights are widened in a register right after
// their load (a zero-extension and a shift), so the memory stream and the multiply-adds overlap,
// where the portable path's widening pass into an L1 scratch left memory idle while it multiplied;
// with the prefetches and a 4 x 3 register block, float32 weights gain too.
constexpr int kAvx2Rows = 4;      // weight rows per pass over x
constexpr int kAvx2RowGroup = 3;  // x rows per pass: 4 x 3 accumulators + one weight register of 16 ymm

// 8 weights at p as float32: widened from bfloat16 bit patterns, or loaded.
FSD_ALWAYS_INLINE __m256 load8(const uint16_t* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
FSD_ALWAYS_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
FSD_ALWAYS_INLINE float weight_value(uint16_t bits) { return bits_to_float((uint32_t)bits << 16); }
FSD_ALWAYS_INLINE float weight_value(float value) { return value; }

// Rows [row0, row0 + R) of x times weight rows [o, o + n) (n <= kAvx2Rows); prefetch_rows as in
// dot_bf16_block. The products and float32 sums are the widening path's, in another order.
template <typename Weight, int R>
void dot_avx2_block(const SkinnyGemm& g, int64_t o, int n, int64_t row0, unsigned prefetch_rows) {
  const Weight* w_row[kAvx2Rows];
  const float* x_row[R];
  FSD_UNROLL
  for (int b = 0; b < kAvx2Rows; ++b) w_row[b] = static_cast<const Weight*>(g.w) + (o + std::min(b, n - 1)) * g.w_stride;
  FSD_UNROLL
  for (int r = 0; r < R; ++r) x_row[r] = g.x + (row0 + r) * g.x_stride;
  const int64_t next_block = kAvx2Rows * g.w_stride;
  const bool prefetch_to_l2 = kAvx2Rows * g.in * int64_t(sizeof(Weight)) > kL1PrefetchBytes;
  __m256 acc[kAvx2Rows][R];
  FSD_UNROLL
  for (int b = 0; b < kAvx2Rows; ++b)
    FSD_UNROLL
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  // Weight row by weight row, rereading x from L1: one widened register live, not kAvx2Rows.
  auto step = [&](int64_t i) FSD_INLINE_LAMBDA {
    FSD_UNROLL
    for (int b = 0; b < kAvx2Rows; ++b) {
      const __m256 w = load8(w_row[b] + i);
      FSD_UNROLL
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x_row[r] + i), acc[b][r]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= g.in; i += 32) {  // 32 weights: one (bfloat16) or two (float32) cache lines per row
    FSD_UNROLL
    for (int b = 0; b < kAvx2Rows; ++b) {
      if (!(prefetch_rows & (1u << b))) continue;
      FSD_UNROLL
      for (int line = 0; line < int(32 * sizeof(Weight) / 64); ++line) {
        const char* ahead = (const char*)(w_row[b] + next_block + i) + 64 * line;
        if (prefetch_to_l2) _mm_prefetch(ahead, _MM_HINT_T1);
        else _mm_prefetch(ahead, _MM_HINT_T0);
      }
    }
    FSD_UNROLL
    for (int k = 0; k < 32; k += 8) step(i + k);
  }
  for (; i + 8 <= g.in; i += 8) step(i);
  FSD_UNROLL
  for (int r = 0; r < R; ++r) {
    alignas(16) float sum[kAvx2Rows];
    _mm_store_ps(sum, sum4_avx2(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
    float* y = g.y + (row0 + r) * g.y_stride + o;
    for (int b = 0; b < n; ++b) {  // rows past n (a short last block) repeat row n - 1: not stored
      float tail = 0.0f;  // the in % 8 columns
      for (int64_t t = i; t < g.in; ++t) tail += weight_value(w_row[b][t]) * x_row[r][t];
      y[b] = sum[b] + tail + (g.bias ? g.bias[o + b] : 0.0f);
    }
  }
}

// Output features [begin, end) by the AVX2 path, kAvx2Rows weight rows at a time, each
// block meeting every group of x rows while in cache; next-block prefetches shared over the passes.
template <typename Weight>
void out_range_avx2(const SkinnyGemm& g, int64_t begin, int64_t end) {
  const int passes = (int)((g.rows + kAvx2RowGroup - 1) / kAvx2RowGroup);
  for (int64_t o = begin; o < end; o += kAvx2Rows) {
    const int n = (int)std::min<int64_t>(kAvx2Rows, end - o);
    const bool next_is_whole = o + 2 * kAvx2Rows <= end;
    for (int pass = 0; pass < passes; ++pass) {
      unsigned prefetch_rows = 0;
      for (int b = pass; next_is_whole && b < kAvx2Rows; b += passes) prefetch_rows |= 1u << b;
      const int64_t row0 = int64_t(pass) * kAvx2RowGroup;
      switch (std::min<int64_t>(kAvx2RowGroup, g.rows - row0)) {
        case 1: dot_avx2_block<Weight, 1>(g, o, n, row0, prefetch_rows); break;
        case 2: dot_avx2_block<Weight, 2>(g, o, n, row0, prefetch_rows); break;
        default: dot_avx2_block<Weight, 3>(g, o, n, row0, prefetch_rows); break;
      }
    }
  }
}
#pragma GCC pop_options
#endif

// Output features [begin, end): all rows of x, in groups of at most kRowGroup, over blocks of
// weight rows small enough (~kBlockBytes as float32) to stay in L2 while the groups after the
// first reread them.
void out_range(const SkinnyGemm& g, int64_t begin, int64_t end) {
  const bool bf16 = g.w_dtype == WeightDType::BFloat16;
#if FSD_X86_INTRINSICS
  if (bf16 && !g.portable && g.x_bf16 != nullptr && bf16_dot_available()) return out_range_bf16_dot(g, begin, end);
  if (!g.portable && g.x != nullptr && avx2_available()) {
    return bf16 ? out_range_avx2<uint16_t>(g, begin, end) : out_range_avx2<float>(g, begin, end);
  }
#endif
  const int64_t block_bytes = bf16 ? kWidenedBytes : kBlockBytes;
  const int64_t block = std::clamp<int64_t>(block_bytes / (int64_t(sizeof(float)) * g.in) / kOutBlock * kOutBlock,
                                            kOutBlock, kOutGrain);
  std::vector<float> widened(bf16 ? (size_t)(block * g.in) : 0);
  for (int64_t o = begin; o < end; o += block) {
    WeightBlock w{nullptr, g.w_stride, o, std::min(end, o + block) - o};
    if (bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(g.w) + o * g.w_stride;
      for (int64_t j = 0; j < w.n; ++j) widen_bfloat16(src + j * g.w_stride, widened.data() + j * g.in, g.in);
      w.rows = widened.data();
      w.stride = g.in;
    } else {
      w.rows = static_cast<const float*>(g.w) + o * g.w_stride;
    }
    for (int64_t row0 = 0; row0 < g.rows; row0 += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, g.rows - row0)) {
        case 1: dot_rows<1>(g, w, row0); break;
        case 2: dot_rows<2>(g, w, row0); break;
        case 3: dot_rows<3>(g, w, row0); break;
        default: dot_rows<4>(g, w, row0); break;
      }
    }
  }
}

}  // namespace

bool bf16_dot_available() {
#if FSD_X86_INTRINSICS
  static const bool available = __builtin_cpu_supports("avx512bf16");
  return available;
#else
  return false;
#endif
}

bool avx2_available() {
#if FSD_X86_INTRINSICS
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
#else
  return false;
#endif
}

void skinny_gemm(const SkinnyGemm& g, const ParallelFor& parallel_for) {
  const int64_t tasks = (g.out + kOutGrain - 1) / kOutGrain;
  parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    out_range(g, begin * kOutGrain, std::min(g.out, end * kOutGrain));
  });
}

}  // namespace fsd_cpu_linear
