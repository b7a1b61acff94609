// Intrinsics shared by the CPU linear kernels' x86 paths (skinny_gemm.cpp, quant_gemm.cpp): the
// lane sums of four accumulators at once, for AVX-512 and for AVX2. GCC on x86-64 only (the target
// pragmas are GCC's; other compilers take the kernels' portable loops): FSD_X86_INTRINSICS says
// whether they exist. Callers compile these inside their own target region, which must include
// the one here.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSD_X86_INTRINSICS 1
#include <immintrin.h>

#include "common/simd.h"

// Fully unrolled early, so that GCC keeps the kernels' accumulator arrays in registers (else it
// stores them to the stack every iteration).
#define FSD_UNROLL _Pragma("GCC unroll 16")

namespace fsd_cpu_linear {
namespace x86 {

#pragma GCC push_options
#pragma GCC target("avx512f")
// Shuffles in their full-mask forms: the plain ones pass GCC 12 an undefined source, which
// -Wuninitialized reports; with every lane selected the instruction is the same.
template <int kImm>
FSD_ALWAYS_INLINE __m512 shuffle_blocks(__m512 a, __m512 b) { return _mm512_mask_shuffle_f32x4(a, 0xFFFF, a, b, kImm); }
template <int kImm>
FSD_ALWAYS_INLINE __m512 permute_in_blocks(__m512 a) { return _mm512_mask_permute_ps(a, 0xFFFF, a, kImm); }

// sums[k] = the lane sum of a_k, by shuffles and adds on all four at once: ~15 instructions where
// 4 x 16 scalar additions took ~10% of a 4-row block's time in skinny_gemm's AVX512-BF16 path
// (measured: docs/cpu.md, "The few-row kernel's design choices").
FSD_ALWAYS_INLINE void sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float* sums) {
  // Fold halves, then quarters: 128-bit block k of `quad` holds 4 lanes that sum to sum(a_k).
  const __m512 half01 = _mm512_add_ps(shuffle_blocks<_MM_SHUFFLE(1, 0, 1, 0)>(a0, a1),
                                      shuffle_blocks<_MM_SHUFFLE(3, 2, 3, 2)>(a0, a1));
  const __m512 half23 = _mm512_add_ps(shuffle_blocks<_MM_SHUFFLE(1, 0, 1, 0)>(a2, a3),
                                      shuffle_blocks<_MM_SHUFFLE(3, 2, 3, 2)>(a2, a3));
  const __m512 quad = _mm512_add_ps(shuffle_blocks<_MM_SHUFFLE(2, 0, 2, 0)>(half01, half23),
                                    shuffle_blocks<_MM_SHUFFLE(3, 1, 3, 1)>(half01, half23));
  // Then within each block: neighbours, then the two pair sums.
  const __m512 pairs = _mm512_add_ps(quad, permute_in_blocks<_MM_SHUFFLE(2, 3, 0, 1)>(quad));
  const __m512 total = _mm512_add_ps(pairs, permute_in_blocks<_MM_SHUFFLE(1, 0, 3, 2)>(pairs));
  alignas(64) float lane[16];
  _mm512_store_ps(lane, total);
  for (int k = 0; k < 4; ++k) sums[k] = lane[4 * k];
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// The lane sums of a0..a3, in that order.
FSD_ALWAYS_INLINE __m128 sum4_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}
#pragma GCC pop_options

}  // namespace x86
}  // namespace fsd_cpu_linear
#endif
