// y = x W^T (+ bias) for a few rows of x: the linear layers of a decoding step on the CPU, where x
// holds the K+1 tokens the target verifies (or the draft's 1-2 tokens). BLAS GEMM paths pack W for
// every call and cost 2-3x a single-row product for 2..16 rows; here each weight row is streamed
// from memory once and multiplied with every row of x while it is in registers, so the product
// costs about what reading W costs, whatever the number of rows (up to kSkinnyMaxRows).
// W may be float32 or bfloat16 (widened to float32 in cache or, with AVX2, in registers: half the
// bytes to stream); x, the bias and y are float32 and the sums are float32 either way. With
// bfloat16 W and x given as bfloat16 too (`x_bf16`), a CPU with AVX512-BF16 multiplies the pairs
// with its bfloat16 dot-product instruction (exact products, float32 sums) instead of widening W: a
// fraction of the work, so the product runs at memory speed.
#pragma once

#include <cstdint>

#include "cpu_linear/common.h"

namespace fsd_cpu_linear {

constexpr int64_t kSkinnyMaxRows = 16;

struct SkinnyGemm {
  // [rows, in]: row r at x + r * x_stride, elements contiguous. May be null with bfloat16 W when
  // x_bf16 is set and bf16_dot_available(): that path reads x_bf16 alone.
  const float* x = nullptr;
  int64_t x_stride = 0;
  // Optional: the same values as bfloat16 bit patterns (they must be exact), row r at
  // x_bf16 + r * x_stride. Used with bfloat16 W where the CPU has AVX512-BF16 (see bf16_dot_available).
  const uint16_t* x_bf16 = nullptr;
  const void* w = nullptr;  // [out, in] of w_dtype: row o at w + o * w_stride, elements contiguous
  int64_t w_stride = 0;
  WeightDType w_dtype = WeightDType::Float32;  // Float32 or BFloat16
  const float* bias = nullptr;  // [out], or nullptr
  float* y = nullptr;  // [rows, out]: row r at y + r * y_stride
  int64_t y_stride = 0;
  int64_t rows = 0, in = 0, out = 0;  // rows in [1, kSkinnyMaxRows]
  bool portable = false;  // for tests: the portable loops even where an intrinsics path exists
};

// Whether this CPU runs the AVX512-BF16 path (x86-64 builds with GCC; checked once).
bool bf16_dot_available();
// Whether this CPU takes the AVX2 + FMA path for float32 x (x86-64 builds with GCC; checked once).
bool avx2_available();

// Parallel over blocks of output features (each thread streams its own part of W).
void skinny_gemm(const SkinnyGemm& problem, const ParallelFor& parallel_for = serial_for);

}  // namespace fsd_cpu_linear
