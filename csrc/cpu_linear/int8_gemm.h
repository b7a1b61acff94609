// y = x W^T (+ bias) with W in a GGUF checkpoint's own block formats and x quantised to int8 on the
// fly, multiplied by the CPU's int8 dot-product instruction (AVX512-VNNI's vpdpbusd: 64 multiply-adds
// per instruction, 4x a float32 FMA's 16). For any number of rows of x: decoding's 1-16 and prompts.
//
// Arithmetic. Each row of x is quantised per group of 32 features as GGUF's Q8_0 is: dx = amax / 127,
// q = round(x / dx) in [-127, 127]; a group with a NaN or an infinity gets dx = NaN (its row's outputs
// become NaN, never a silently finite value). Weights are unsigned codes u with a scale per (output
// row, sub-group of 16 or 32 features), and either an offset (Q4_K: w = scale * u + offset) or an
// integer zero point (the others: w = scale * (u - zero)). Per sub-group the integer sum S = sum u q
// is exact, and
//     Q4_K:   y += float(S) * (scale * dx) + offset * (dx * sum q)
//     others: y += float(S - zero * sum q) * (scale * dx)
// (the zero point in integers: one FMA fewer, on the port the dot products need), in a fixed order,
// so a row's result is the same bits whatever other rows are in the call (batch invariance, which
// exact greedy speculative decoding relies on) and on every path (the portable loops compute exactly
// what the vector ones do).
//
// Layout. Output rows go in tiles of kTileRows = 16 (out padded with zero rows), one per 32-bit lane
// of a 512-bit register; a tile's features in groups of 32, and groups in super-blocks of
// int8_group_count(format) (the GGUF block: 256 features for the K formats, 32 for Q5_0 and Q8_0).
// Each tile is contiguous: its super-blocks in order, each a header followed by its groups.
//   Nibbles (every format but Q8_0): 256 bytes, four chunks of 64. Byte 4 i + t of chunk k holds, for
//     tile row i, the low four bits of the code of feature 4 k + t (low nibble) and of feature
//     16 + 4 k + t (high nibble): chunk k gives the operands of features 4k.. (low) and 16 + 4k..
//     (high) for vpdpbusd, which sums four adjacent byte products into each 32-bit lane.
//   Bit plane (Q5_0: bit 4): 64 bytes, eight 64-bit masks in operand order (chunk 0 low, ..., chunk 3
//     low, chunk 0 high, ..., chunk 3 high), bit 4 i + t as above.
//   Crumbs (Q6_K: bits 4 and 5): 128 bytes, two chunks of 64; byte 4 i + t of chunk h holds those bits
//     of operand 4 h + k's code in bits 2 k and 2 k + 1 (shifts and masks, no mask registers, unpack
//     them: ops that run beside vpdpbusd).
//   Bytes (Q8_0): 512 bytes, eight chunks of 64 in operand order, byte 4 i + t = code of feature
//     4 k + t (k < 4) or 16 + 4 (k - 4) + t, i.e. operand k covers features 4k..4k+3 in every format.
//   Params, after the codes: see Int8Format.
#pragma once

#include <cstdint>

#include "cpu_linear/common.h"

namespace fsd_cpu_linear {

constexpr int64_t kTileRows = 16;
constexpr int64_t kGroupCols = 32;

// The GGUF types, with u the stored (unsigned) code, as [super-block header] + per group:
//   Q4_K: header d, dmin float16 [16]; group: nibbles, sc uint8 [16], m uint8 [16];
//         w = (d sc) u - (dmin m), u in 0..15.
//   Q6_K: header d float16 [16]; group: nibbles, crumbs, sc int8 [2][16] (features 0-15,
//         16-31); w = (d sc) (u - 32), u in 0..63.
//   Q5_0: group: nibbles, plane 4, d float16 [16]; w = d (u - 16), u in 0..31.
//   Q8_0: group: bytes, d float16 [16]; w = d (u - 128), u in 0..255 (the file's int8 code + 128).
// Every product and offset above is exact in float32, as in gguf's own dequantisation.
enum class Int8Format : int32_t { Q4_K = 0, Q6_K = 1, Q5_0 = 2, Q8_0 = 3 };
constexpr int kInt8FormatCount = 4;

// Groups per super-block, and bytes of a super-block's header and of each of its groups.
constexpr int64_t int8_group_count(Int8Format f) { return f == Int8Format::Q4_K || f == Int8Format::Q6_K ? 8 : 1; }
constexpr int64_t int8_header_bytes(Int8Format f) {
  return f == Int8Format::Q4_K ? 64 : f == Int8Format::Q6_K ? 32 : 0;
}
constexpr int64_t int8_group_bytes(Int8Format f) {
  return f == Int8Format::Q4_K ? 256 + 32 : f == Int8Format::Q6_K ? 256 + 128 + 32 : f == Int8Format::Q5_0 ? 256 + 64 + 32 : 512 + 32;
}
constexpr int64_t int8_block_cols(Int8Format f) { return int8_group_count(f) * kGroupCols; }
constexpr int64_t int8_block_bytes(Int8Format f) { return int8_header_bytes(f) + int8_group_count(f) * int8_group_bytes(f); }
// Bytes of one tile of a matrix with `in` features (a multiple of int8_block_cols).
constexpr int64_t int8_tile_bytes(Int8Format f, int64_t in) { return in / int8_block_cols(f) * int8_block_bytes(f); }

struct Int8Weights {
  const uint8_t* data = nullptr;  // [ceil(out / 16)] tiles of int8_tile_bytes(format, in)
  Int8Format format = Int8Format::Q4_K;
  int64_t in = 0, out = 0;
};

// x quantised: per row, `in` int8 codes, then per group 16 bytes: dx and dx * sum q (float32), the
// sums of q over features 0-15 and 16-31 (int32). Row r at base + r * int8_act_row_bytes(in).
constexpr int64_t int8_act_row_bytes(int64_t in) { return in + in / kGroupCols * 16; }

// Which loops: Best (AVX512-VNNI where the CPU has it, else portable) or Portable (tests).
enum class Int8Path { Best, Portable };

struct Int8Gemm {
  Int8Weights w;
  const uint8_t* x = nullptr;  // quantised rows (int8_quantize), int8_act_row_bytes(w.in) apart
  const float* bias = nullptr;  // [out], or nullptr
  float* y = nullptr;  // [rows, out]: row r at y + r * y_stride
  int64_t y_stride = 0;
  int64_t rows = 0;
  Int8Path path = Int8Path::Best;
};

// Whether this CPU has the AVX512-VNNI path (AVX512F, BW and VNNI; x86-64 builds with GCC).
bool int8_vnni_available();

// x [rows, in] float32 (row r at x + r * x_stride) -> `out` (rows x int8_act_row_bytes(in) bytes).
// Parallel over rows.
void int8_quantize(const float* x, int64_t x_stride, int64_t rows, int64_t in, uint8_t* out, Int8Path path,
                   const ParallelFor& parallel_for = serial_for);

// Rows [row_begin, row_end) of W as float32 into out [row_end - row_begin, in]: exactly the values
// of gguf's dequantisation of the file. Parallel over tiles.
void int8_dequantize(const Int8Weights& w, int64_t row_begin, int64_t row_end, float* out,
                     const ParallelFor& parallel_for = serial_for);

// Parallel over tiles of output rows.
void int8_gemm(const Int8Gemm& problem, const ParallelFor& parallel_for = serial_for);
// Several products (of one x, as a layer's q, k and v projections) in one parallel region over
// all their tiles.
void int8_gemm_many(const Int8Gemm* problems, int64_t count, const ParallelFor& parallel_for = serial_for);

}  // namespace fsd_cpu_linear
