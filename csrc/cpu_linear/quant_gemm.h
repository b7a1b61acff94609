// y = x W^T (+ bias) for a few float32 rows of x (decoding's linear layers on the CPU), with W held
// as small integer codes and a float scale (and offset) per group of consecutive input features.
// That is how a GGUF checkpoint stores its linear layers (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, ...);
// fsd_ext/gguf_weights.py repacks them once into the layout below, in which every weight is
// exactly the float32 value the checkpoint's own dequantisation gives, and decoding, which is bound
// by reading the weights, reads 0.75 (Q4), 1.125 (Q8G32) or 1.25 (Q8) bytes per weight instead of
// bfloat16's 2.
//
// Layout. W's rows go in blocks of kQuantBlockRows = 4 (out is padded with zero rows to a multiple
// of 4), each block's columns in groups (in must be a multiple of the group size). For each
// (block, group), in block-major order:
//   codes: quant_code_bytes: 64 bytes, 16 per row of the block (row b at byte 16 b; Q8G32: 128,
//       32 per row at byte 32 b), and
//   params: quant_params_per_group floats.
//   Q4, groups of 32: byte k of a row holds the codes of columns k (low nibble) and k + 16 (high
//       nibble), unsigned 0..15; params (scale, offset) of rows 0..3 in turn;
//       weight = fma(code, scale, offset).
//   Q8, groups of 16: byte k of a row is the signed code of column k; params: the four rows'
//       scales; weight = code * scale.
//   Q8G32: Q8 in groups of 32 (GGUF's Q8_0 and Q5_0 keep one scale per 32 weights).
// A block's codes for one group fill one cache line, so the kernel streams W in the order it is
// stored. The sums are float32 (the result differs from F.linear of the dequantised W by float
// rounding only).
#pragma once

#include <cstdint>

#include "cpu_linear/common.h"

namespace fsd_cpu_linear {

enum class QuantFormat : int32_t { Q4 = 0, Q8 = 1, Q8G32 = 2 };

constexpr int64_t kQuantBlockRows = 4;
constexpr int64_t kQuantCodeBytes = 64;  // per (block, group) of Q4 and Q8: 16 bytes per row
constexpr int64_t kQuantMaxRows = 16;    // rows of x per call, as skinny_gemm

constexpr int64_t quant_group_size(QuantFormat format) { return format == QuantFormat::Q8 ? 16 : 32; }
constexpr int64_t quant_params_per_group(QuantFormat format) { return format == QuantFormat::Q4 ? 8 : 4; }
// Code bytes per (block, group), and per row of it.
constexpr int64_t quant_code_bytes(QuantFormat format) { return format == QuantFormat::Q8G32 ? 128 : kQuantCodeBytes; }
constexpr int64_t quant_row_code_bytes(QuantFormat format) { return quant_code_bytes(format) / kQuantBlockRows; }

// A repacked weight matrix [out, in]: codes [blocks][groups][quant_code_bytes] bytes, params
// [blocks][groups][quant_params_per_group] floats, blocks = ceil(out / 4), groups = in / group size.
struct QuantWeights {
  const uint8_t* codes = nullptr;
  const float* params = nullptr;
  QuantFormat format = QuantFormat::Q4;
  int64_t in = 0, out = 0;
};

// Block `block`'s codes and params of group 0 (group k: + k * quant_code_bytes, + k *
// quant_params_per_group).
inline int64_t quant_group_count(const QuantWeights& w) { return w.in / quant_group_size(w.format); }
inline const uint8_t* quant_block_codes(const QuantWeights& w, int64_t block) {
  return w.codes + block * quant_group_count(w) * quant_code_bytes(w.format);
}
inline const float* quant_block_params(const QuantWeights& w, int64_t block) {
  return w.params + block * quant_group_count(w) * quant_params_per_group(w.format);
}

// Which loops compute the product. Best: the AVX-512 loops, else AVX2 + FMA, else portable C++.
// The others (tests, benchmarks) ask for one path, and get the next one down where this CPU lacks
// it.
enum class QuantPath { Best, Avx512, Avx2, Portable };

struct QuantGemm {
  QuantWeights w;
  const float* x = nullptr;  // [rows, in]: row r at x + r * x_stride
  int64_t x_stride = 0;
  const float* bias = nullptr;  // [out], or nullptr
  float* y = nullptr;  // [rows, out]: row r at y + r * y_stride
  int64_t y_stride = 0;
  int64_t rows = 0;  // in [1, kQuantMaxRows]
  QuantPath path = QuantPath::Best;
};

// Whether this CPU runs the AVX-512 (AVX512F) path (x86-64 builds with GCC); the AVX2 + FMA path
// runs where skinny_gemm.h's avx2_available().
bool quant_avx512_available();

// Blocks per parallel task of quant_gemm (every path): 64 output features.
constexpr int64_t kQuantTaskBlocks = 16;

// Parallel over tasks of kQuantTaskBlocks blocks.
void quant_gemm(const QuantGemm& problem, const ParallelFor& parallel_for = serial_for);

// The weights of rows [row_begin, row_end) of W into out [row_end - row_begin, in] (the prompt
// path: cache-sized pieces of W for a BLAS GEMM), as float32 (`out`) or rounded to nearest-even
// bfloat16 bit patterns (`out_bf16`; exactly one of the two is set). Parallel over rows.
void quant_dequantize(const QuantWeights& w, int64_t row_begin, int64_t row_end, float* out, uint16_t* out_bf16,
                      const ParallelFor& parallel_for = serial_for);

}  // namespace fsd_cpu_linear
