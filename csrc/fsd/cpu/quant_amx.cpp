// See quant_amx.h. Why tiles: at R rows of x the AVX-512 path does R float32 multiply-adds per
// weight it reads, so from a few rows on its time is those multiply-adds, not memory; one tile
// product (TDPBF16PS) does 16 x 16 x 32 of them at a fixed cost, whatever R.
//
// Where the time goes: decoding the codes into A (four instructions per row of A, two on the
// shuffle port), the three tile products with their loads, and scaling the sums into the
// accumulators take comparable shares, and the tile instructions and the vector ones around them
// hardly overlap. With two threads the tiles gained less than the vector loops do (the two virtual
// CPUs seem to share one tile unit), hence kQuantAmxMinRows. Timings: docs/cpu.md, "The
// quantised-weight kernel's design choices".
//
// Exactness. The tile unit multiplies bfloat16 pairs into float32 sums; neither the weights nor x
// are bfloat16, so neither goes in as such:
//   - A (16 weight rows x one group's columns) holds the integer codes, which bfloat16 holds
//     exactly (0..15, -128..127); the group's scale (and offset) are applied to the tile's float32
//     sums afterwards: sum_j (c_j s + o) x_j = s sum_j c_j x_j + o sum_j x_j.
//   - B (one group's columns x the rows of x) holds x split exactly into three bfloat16 parts,
//     x = hi + mid + lo (8 + 8 + 8 significant bits), one tile product each, all into one sum.
// So every product is exact and the result differs from quant_gemm's other paths (and F.linear
// of the dequantised W) by the order and rounding of float32 sums only (the tests bound it). The
// unit reads subnormal bfloat16 as zero: a part below 2^-126, i.e. only x within 2^-110 of zero
// loses its lowest bits. An infinite x gives NaN sums (hi + mid splits inf - inf), as 0 * inf would.
//
// Pairs. The unit multiplies pairs of consecutive bfloat16 of an A row with a pair of B.
// For Q4 a pair is columns (k, k + 16) of the group, the two nibbles of code byte k, so a row of
// A is decoded from its 16 bytes with no shuffle across bytes; for Q8 it is columns (2k, 2k + 1).
// B is laid out once per call (the x panel), pair k of x row n at [k][n], beside each group's sum
// of x (for Q4's offsets).
#include "fsd/cpu/quant_amx.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "fsd/cpu/x86_sums.h"  // FSD_X86_INTRINSICS, FSD_UNROLL, sum4

#if FSD_X86_INTRINSICS && defined(__linux__)
#define FSD_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fsd {
namespace cpu {

#if FSD_AMX
namespace {

constexpr int kTileRows = 16;  // weight rows per A tile: four blocks
constexpr int kParts = 3;      // x = hi + mid + lo

constexpr int pairs_per_group(QuantFormat format) { return (int)quant_group_size(format) / 2; }

// The tile configuration (palette 1): tile 0 the float32 sums C [16 weight rows][n rows of x],
// tile 1 the codes A [16 weight rows][pairs], tiles 2..4 the parts of x, B [pairs][n].
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The x panel: pair words [groups][kParts][pairs][n] (B tiles, row stride 4 n bytes) and the
// sums of x per group [groups][16] (lanes n >= rows zero). Built by the calling thread, read by
// the workers of the same call.
struct Panel {
  const uint32_t* pairs;
  const float* sums;
  int64_t part_words;  // pairs * n: one B tile
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

constexpr __mmask16 kAll = 0xFFFF;

// x = hi + mid + lo, each part a float32 whose low 16 bits are zero (a bfloat16): hi and mid
// truncate, and what is left after them has at most 8 significant bits.
FSD_ALWAYS_INLINE void split3(__m512 x, __m512i parts[kParts]) {
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  const __m512i hi = _mm512_and_si512(_mm512_castps_si512(x), top);
  const __m512 rest = _mm512_sub_ps(x, _mm512_castsi512_ps(hi));
  const __m512i mid = _mm512_and_si512(_mm512_castps_si512(rest), top);
  const __m512 lo = _mm512_sub_ps(rest, _mm512_castsi512_ps(mid));
  parts[0] = hi, parts[1] = mid, parts[2] = _mm512_and_si512(_mm512_castps_si512(lo), top);
}

// Row n of x into the panel, group by group.
template <QuantFormat F>
void panel_row(const float* x, int64_t groups, int n, int rows, uint32_t* pairs, float* sums) {
  constexpr int kPairs = pairs_per_group(F);
  const int64_t part_words = (int64_t)kPairs * rows;
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(rows));  // pair k's word at k * rows
  const __m256i column8 = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(rows));
  __m512 group_x[4];
  for (int64_t k = 0; k < groups; ++k) {
    uint32_t* group_pairs = pairs + k * kParts * part_words + n;
    __m512i first[kParts], second[kParts];
    if constexpr (F == QuantFormat::Q4) {  // pair k: columns k and k + 16
      const __m512 x0 = _mm512_loadu_ps(x + 32 * k), x1 = _mm512_loadu_ps(x + 32 * k + 16);
      split3(x0, first), split3(x1, second);
      const int slot = (int)(k % 4);  // the group sums go four at a time through sum4
      group_x[slot] = _mm512_add_ps(x0, x1);
      if (slot == 3 || k + 1 == groups) {
        for (int j = slot + 1; j < 4; ++j) group_x[j] = _mm512_setzero_ps();
        float four[4];
        x86::sum4(group_x[0], group_x[1], group_x[2], group_x[3], four);
        for (int j = 0; j <= slot; ++j) sums[16 * (k - slot + j) + n] = four[j];
      }
      FSD_UNROLL
      for (int p = 0; p < kParts; ++p) {  // word: first's bfloat16 low, second's high
        const __m512i words = _mm512_or_si512(_mm512_maskz_srli_epi32(kAll, first[p], 16), second[p]);
        _mm512_i32scatter_epi32(group_pairs + p * part_words, column, words, 4);
      }
    } else {  // pair k: columns 2k and 2k + 1, i.e. the 16 bfloat16 in column order
      split3(_mm512_loadu_ps(x + 16 * k), first);
      FSD_UNROLL
      for (int p = 0; p < kParts; ++p) {
        const __m256i words = _mm512_maskz_cvtepi32_epi16(kAll, _mm512_maskz_srli_epi32(kAll, first[p], 16));
        _mm256_i32scatter_epi32(group_pairs + p * part_words, column8, words, 4);
      }
    }
  }
}

// The bfloat16 bit patterns of 0..15 (an index table for vpermw; words 16..31 unused).
alignas(64) constexpr uint16_t kSmallIntegersBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// One weight row's codes of a group (16 bytes) as a row of A.
template <QuantFormat F>
FSD_ALWAYS_INLINE void decode_row(const uint8_t* codes, __m512i table, uint8_t* a_row) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  if constexpr (F == QuantFormat::Q4) {
    // dword k = byte k; word 2k = low nibble, word 2k + 1 = high nibble: (d | d << 12) & 0x000F000F.
    const __m512i d = _mm512_maskz_cvtepu8_epi32(kAll, bytes);
    const __m512i nibbles =
        _mm512_ternarylogic_epi32(d, _mm512_maskz_slli_epi32(kAll, d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    _mm512_storeu_si512(a_row, _mm512_permutexvar_epi16(nibbles, table));
  } else {
    const __m512 values = _mm512_maskz_cvtepi32_ps(kAll, _mm512_maskz_cvtepi8_epi32(kAll, bytes));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a_row), (__m256i)_mm512_cvtneps_pbh(values));
  }
}

// Tiles: 0 the sums C, 1 the codes A, 2..4 the parts of x (B).
FSD_ALWAYS_INLINE void multiply_group(const uint8_t* a_tile, int a_row_bytes, const uint32_t* b_parts,
                                      int64_t part_words, int64_t b_stride, float* c_tile) {
  _tile_zero(0);
  _tile_loadd(1, a_tile, a_row_bytes);
  _tile_loadd(2, b_parts, b_stride);
  _tile_loadd(3, b_parts + part_words, b_stride);
  _tile_loadd(4, b_parts + 2 * part_words, b_stride);
  _tile_dpbf16ps(0, 1, 2);
  _tile_dpbf16ps(0, 1, 3);
  _tile_dpbf16ps(0, 1, 4);
  _tile_stored(0, c_tile, 64);
}

TileConfig tile_config(int pairs, int n) {
  TileConfig config;
  config.rows[0] = kTileRows, config.colsb[0] = (uint16_t)(4 * n);
  config.rows[1] = kTileRows, config.colsb[1] = (uint16_t)(4 * pairs);
  for (int t = 2; t < 2 + kParts; ++t) config.rows[t] = (uint8_t)pairs, config.colsb[t] = (uint16_t)(4 * n);
  return config;
}

// A tile load of data that vector stores wrote just before, or a vector load of a tile store's,
// waits for the stores to reach the cache, which tripled a group's product time on the Intel Xeon.
// So the codes are decoded kAhead groups before their product, and the sums are read kAhead groups
// after it, through rings of kRing buffers (measured: docs/cpu.md, "The quantised-weight kernel's
// design choices").
constexpr int kAhead = 2, kRing = 4;
constexpr int kATileBytes = kTileRows * 64, kCTileFloats = kTileRows * 16;

// Weight rows of blocks [b0, b0 + NB) (NB <= 4) against every row of x: per group, a tile
// product of its codes with x's three parts into C, whose rows are then scaled into one float32
// accumulator per weight row (lanes: rows of x). Rows of the kRing `a_tiles` past 4 NB must be zero.
template <QuantFormat F, int NB>
void tile_rows(const QuantGemm& g, const Panel& panel, int64_t b0, uint8_t* a_tiles, float* c_tiles) {
  constexpr int64_t kGroup = quant_group_size(F), kParams = quant_params_per_group(F);
  constexpr int kARowBytes = 2 * (int)kGroup;
  const int64_t groups = g.w.in / kGroup, b_stride = 4 * g.rows;
  const __m512i table = _mm512_load_si512(kSmallIntegersBf16);
  __m512 acc[4 * NB];
  FSD_UNROLL
  for (int o = 0; o < 4 * NB; ++o) acc[o] = _mm512_setzero_ps();
  auto decode = [&](int64_t k, uint8_t* a_tile) FSD_INLINE_LAMBDA {
    FSD_UNROLL
    for (int b = 0; b < NB; ++b) {
      const uint8_t* codes = quant_block_codes(g.w, b0 + b) + k * kQuantCodeBytes;
      FSD_UNROLL
      for (int r = 0; r < 4; ++r) decode_row<F>(codes + 16 * r, table, a_tile + (4 * b + r) * kARowBytes);
    }
  };
  auto multiply = [&](int64_t k, const uint8_t* a_tile, float* c_tile) FSD_INLINE_LAMBDA {
    multiply_group(a_tile, kARowBytes, panel.pairs + k * kParts * panel.part_words, panel.part_words, b_stride, c_tile);
  };
  auto scale_into_acc = [&](int64_t k, const float* c_tile) FSD_INLINE_LAMBDA {
    __m512 x_sums = _mm512_setzero_ps();  // Q4's offsets multiply the group's sum of x
    if constexpr (F == QuantFormat::Q4) x_sums = _mm512_loadu_ps(panel.sums + 16 * k);
    FSD_UNROLL
    for (int b = 0; b < NB; ++b) {
      const float* p = quant_block_params(g.w, b0 + b) + k * kParams;
      FSD_UNROLL
      for (int r = 0; r < 4; ++r) {
        __m512& sum = acc[4 * b + r];
        const __m512 c_row = _mm512_load_ps(c_tile + 16 * (4 * b + r));
        if constexpr (F == QuantFormat::Q4) {
          sum = _mm512_fmadd_ps(c_row, _mm512_set1_ps(p[2 * r]), sum);
          sum = _mm512_fmadd_ps(x_sums, _mm512_set1_ps(p[2 * r + 1]), sum);
        } else {
          sum = _mm512_fmadd_ps(c_row, _mm512_set1_ps(p[r]), sum);
        }
      }
    }
  };
  auto a_slot = [&](int64_t k) FSD_INLINE_LAMBDA { return a_tiles + (k % kRing) * kATileBytes; };
  auto c_slot = [&](int64_t k) FSD_INLINE_LAMBDA { return c_tiles + (k % kRing) * kCTileFloats; };
  for (int64_t k = 0; k < std::min<int64_t>(kAhead, groups); ++k) decode(k, a_slot(k));
  for (int64_t k = 0; k < groups + kAhead; ++k) {
    if (k + kAhead < groups) decode(k + kAhead, a_slot(k + kAhead));
    if (k < groups) multiply(k, a_slot(k), c_slot(k));
    if (k >= kAhead) scale_into_acc(k - kAhead, c_slot(k - kAhead));
  }
  alignas(64) float lanes[16];
  FSD_UNROLL
  for (int o = 0; o < 4 * NB; ++o) {
    const int64_t out_row = 4 * b0 + o;
    if (out_row >= g.w.out) break;  // padding rows
    _mm512_store_ps(lanes, acc[o]);
    const float bias = g.bias ? g.bias[out_row] : 0.0f;
    for (int64_t n = 0; n < g.rows; ++n) g.y[n * g.y_stride + out_row] = bias + lanes[n];
  }
}

template <QuantFormat F>
void tile_task(const QuantGemm& g, const Panel& panel, int64_t block_begin, int64_t block_end) {
  const TileConfig config = tile_config(pairs_per_group(F), (int)g.rows);
  _tile_loadconfig(&config);
  alignas(64) uint8_t a_tiles[kRing * kATileBytes] = {};
  alignas(64) float c_tiles[kRing * kCTileFloats] = {};  // lanes past g.rows stay zero
  int64_t b0 = block_begin;
  for (; b0 + 4 <= block_end; b0 += 4) tile_rows<F, 4>(g, panel, b0, a_tiles, c_tiles);
  const int64_t left = block_end - b0;
  if (left > 0) {
    std::memset(a_tiles, 0, sizeof(a_tiles));
    if (left == 1) tile_rows<F, 1>(g, panel, b0, a_tiles, c_tiles);
    if (left == 2) tile_rows<F, 2>(g, panel, b0, a_tiles, c_tiles);
    if (left == 3) tile_rows<F, 3>(g, panel, b0, a_tiles, c_tiles);
  }
  _tile_release();
}

template <QuantFormat F>
void run(const QuantGemm& g, const ParallelFor& parallel_for) {
  const int64_t groups = g.w.in / quant_group_size(F), rows = g.rows;
  const int64_t part_words = pairs_per_group(F) * rows;
  thread_local std::vector<uint32_t> pair_words;
  thread_local std::vector<float> sums;
  pair_words.resize(groups * kParts * part_words);
  sums.assign(F == QuantFormat::Q4 ? groups * 16 : 0, 0.0f);  // Q4's offsets only
  for (int n = 0; n < (int)rows; ++n)
    panel_row<F>(g.x + n * g.x_stride, groups, n, (int)rows, pair_words.data(), sums.data());
  const Panel panel{pair_words.data(), sums.data(), part_words};
  const int64_t blocks = (g.w.out + kQuantBlockRows - 1) / kQuantBlockRows;
  const int64_t tasks = (blocks + kQuantTaskBlocks - 1) / kQuantTaskBlocks;
  parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    tile_task<F>(g, panel, begin * kQuantTaskBlocks, std::min(blocks, end * kQuantTaskBlocks));
  });
}

// ---------------------------------------------------------------------------------------------
// The prompt product (quant_prompt_gemm): many rows of x, W and x rounded to bfloat16, so the
// tiles sum across groups and each weight row is decoded once per chunk of x rows. Tiles: 0..3
// the sums C[a][b] (A tile a x B tile b: 32 weight rows x 32 rows of x), 4..5 A (16 weight rows
// x 32 columns), 6..7 B (the pairs of 32 columns x 16 rows of x). In both formats a 32-column
// tile pairs columns (j, j + 16), as the Q4 tiles above do.
// Faster than quant_dequantize + torch's bfloat16 mm on the Qwen2.5-Coder shapes (Intel Xeon;
// benchmarks/bench_prompt_linear.py, docs/cpu.md "A GGUF checkpoint's own linear weights").
// Not yet tried: decoding the next A while the tiles multiply (now each strip's A is decoded, then
// multiplied).

constexpr int kPromptStripRows = 32;     // weight rows per strip: two A tiles
constexpr int kPromptKTiles = 8;         // 32-column tiles per pass over a strip: A in L1 (16 KB)
constexpr int kPromptTaskStrips = 8;     // strips per task: its sums [256][<= 256] fit in L2
constexpr int64_t kPromptChunkRows = 256;  // rows of x per panel
constexpr int kTileWords = 256;          // one A, B or C tile: 16 rows of 64 bytes

// out[c] = the words of column c of the 16 x 16 word matrix in[0..15] (rows): the standard
// 4-stage transpose (32-bit and 64-bit interleaves inside 128-bit lanes, then the lanes).
FSD_ALWAYS_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  FSD_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_epi32(kAll, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_epi32(kAll, r[2 * i], r[2 * i + 1]);
  }
  FSD_UNROLL
  for (int i = 0; i < 4; ++i) {  // u[4i + m], lane L: rows 4i..4i+3 of column 4L + m
    u[4 * i] = _mm512_maskz_unpacklo_epi64(0xFF, t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_maskz_unpackhi_epi64(0xFF, t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_maskz_unpacklo_epi64(0xFF, t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_maskz_unpackhi_epi64(0xFF, t[4 * i + 1], t[4 * i + 3]);
  }
  FSD_UNROLL
  for (int m = 0; m < 4; ++m) {
    const __m512i v0 = _mm512_maskz_shuffle_i32x4(kAll, u[m], u[4 + m], 0x44);
    const __m512i v1 = _mm512_maskz_shuffle_i32x4(kAll, u[m], u[4 + m], 0xEE);
    const __m512i w0 = _mm512_maskz_shuffle_i32x4(kAll, u[8 + m], u[12 + m], 0x44);
    const __m512i w1 = _mm512_maskz_shuffle_i32x4(kAll, u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_maskz_shuffle_i32x4(kAll, v0, w0, 0x88);
    r[4 + m] = _mm512_maskz_shuffle_i32x4(kAll, v0, w0, 0xDD);
    r[8 + m] = _mm512_maskz_shuffle_i32x4(kAll, v1, w1, 0x88);
    r[12 + m] = _mm512_maskz_shuffle_i32x4(kAll, v1, w1, 0xDD);
  }
}

// 32 floats (columns 0..15 in `low`, 16..31 in `high`) as the 16 words of a tile row: word j the
// nearest-even bfloat16 of columns j (low half) and j + 16 (high half).
FSD_ALWAYS_INLINE __m512i pair_words(__m512 low, __m512 high) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(high, low);  // words 0..15 low, 16..31 high
  return _mm512_maskz_permutexvar_epi16(0xFFFFFFFFu, _mm512_load_si512(kInterleave), halves);
}

// The B tiles of x rows [row0, row0 + 16 * slabs): tile (slab s, column tile t) at
// panel + (s * ktiles + t) * kTileWords, row j of a tile the pair j of its 16 rows of x (zero
// past g.rows or past the last column).
void prompt_panel(const QuantGemm& g, int64_t row0, int64_t slab_begin, int64_t slab_end, int64_t ktiles,
                  uint32_t* panel) {
  for (int64_t s = slab_begin; s < slab_end; ++s) {
    for (int64_t t = 0; t < ktiles; ++t) {
      const int64_t col = 32 * t;
      const __mmask16 low_mask = col < g.w.in ? kAll : 0, high_mask = col + 16 < g.w.in ? kAll : 0;
      __m512i r[16];
      FSD_UNROLL
      for (int n = 0; n < 16; ++n) {
        const int64_t row = row0 + 16 * s + n;
        if (row < g.rows) {
          const float* x = g.x + row * g.x_stride + col;
          r[n] = pair_words(_mm512_maskz_loadu_ps(low_mask, x), _mm512_maskz_loadu_ps(high_mask, x + 16));
        } else {
          r[n] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      uint32_t* tile = panel + (s * ktiles + t) * kTileWords;
      FSD_UNROLL
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + 16 * j, r[j]);
    }
  }
}

// Weight row o's columns [32 t, 32 t + 32) as a row of A (bfloat16 pairs, nearest even of the
// float32 weights: quant_dequantize's out_bf16). Rows past the blocks are zero.
template <QuantFormat F>
FSD_ALWAYS_INLINE __m512i prompt_a_row(const QuantWeights& w, int64_t o, int64_t t) {
  if (o >= 4 * ((w.out + kQuantBlockRows - 1) / kQuantBlockRows)) return _mm512_setzero_si512();
  const int r = (int)(o % kQuantBlockRows);
  const uint8_t* codes = quant_block_codes(w, o / kQuantBlockRows) + 16 * r;
  const float* params = quant_block_params(w, o / kQuantBlockRows);
  if constexpr (F == QuantFormat::Q4) {
    const __m512 code_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_maskz_cvtepu8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + t * kQuantCodeBytes)));
    const float* p = params + t * 8;
    const __m512 table = _mm512_fmadd_ps(code_values, _mm512_set1_ps(p[2 * r]), _mm512_set1_ps(p[2 * r + 1]));
    return pair_words(_mm512_maskz_permutexvar_ps(kAll, v, table),
                      _mm512_maskz_permutexvar_ps(kAll, _mm512_maskz_srli_epi32(kAll, v, 4), table));
  } else {  // groups 2t and 2t + 1 (16 columns each; the second may be past the last column)
    auto group = [&](int64_t k) FSD_INLINE_LAMBDA {
      if (k >= quant_group_count(w)) return _mm512_setzero_ps();
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kQuantCodeBytes));
      return _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll, _mm512_maskz_cvtepi8_epi32(kAll, bytes)),
                           _mm512_set1_ps(params[k * 4 + r]));
    };
    return pair_words(group(2 * t), group(2 * t + 1));
  }
}

TileConfig prompt_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  return config;
}

// Weight strips [strip_begin, strip_end) against the panel's rows of x (slab pairs: the panel
// holds an even number of slabs), into y rows [row0, ...). sums: [strips * 32][16 * slabs] floats.
template <QuantFormat F>
void prompt_task(const QuantGemm& g, const uint32_t* panel, int64_t row0, int64_t slabs, int64_t ktiles,
                 int64_t strip_begin, int64_t strip_end, float* sums) {
  const TileConfig config = prompt_tile_config();
  _tile_loadconfig(&config);
  alignas(64) uint32_t a_tiles[kPromptKTiles * 2 * kTileWords];
  const int64_t sum_stride = 16 * slabs;  // floats per row of sums
  for (int64_t t0 = 0; t0 < ktiles; t0 += kPromptKTiles) {
    const int64_t tiles = std::min<int64_t>(kPromptKTiles, ktiles - t0);
    for (int64_t strip = strip_begin; strip < strip_end; ++strip) {
      for (int64_t t = 0; t < tiles; ++t)
        for (int i = 0; i < kPromptStripRows; ++i)
          _mm512_store_si512(a_tiles + (2 * t + i / 16) * kTileWords + 16 * (i % 16),
                             prompt_a_row<F>(g.w, kPromptStripRows * strip + i, t0 + t));
      float* strip_sums = sums + (strip - strip_begin) * kPromptStripRows * sum_stride;
      for (int64_t s = 0; s < slabs; s += 2) {
        float* c = strip_sums + 16 * s;  // C[a][b] at c + 16 a * sum_stride + 16 b
        const int64_t c_bytes = 4 * sum_stride;
        if (t0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c, c_bytes);
          _tile_loadd(1, c + 16, c_bytes);
          _tile_loadd(2, c + 16 * sum_stride, c_bytes);
          _tile_loadd(3, c + 16 * sum_stride + 16, c_bytes);
        }
        const uint32_t* b0 = panel + (s * ktiles + t0) * kTileWords;
        const uint32_t* b1 = b0 + ktiles * kTileWords;
        for (int64_t t = 0; t < tiles; ++t) {
          _tile_loadd(4, a_tiles + 2 * t * kTileWords, 64);
          _tile_loadd(5, a_tiles + (2 * t + 1) * kTileWords, 64);
          _tile_loadd(6, b0 + t * kTileWords, 64);
          _tile_loadd(7, b1 + t * kTileWords, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, c_bytes);
        _tile_stored(1, c + 16, c_bytes);
        _tile_stored(2, c + 16 * sum_stride, c_bytes);
        _tile_stored(3, c + 16 * sum_stride + 16, c_bytes);
      }
    }
  }
  _tile_release();
  // The sums are [weight row][row of x]; y is [row of x][weight row]: 16 x 16 transposes.
  for (int64_t o0 = kPromptStripRows * strip_begin; o0 < std::min(g.w.out, kPromptStripRows * strip_end); o0 += 16) {
    const __mmask16 outs = (__mmask16)(g.w.out - o0 >= 16 ? 0xFFFF : (1u << (g.w.out - o0)) - 1);
    const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(outs, g.bias + o0) : _mm512_setzero_ps();
    const float* block = sums + (o0 - kPromptStripRows * strip_begin) * sum_stride;
    for (int64_t s = 0; s < slabs; ++s) {
      __m512i r[16];
      FSD_UNROLL
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(block + i * sum_stride + 16 * s);
      transpose16(r);
      for (int n = 0; n < 16 && row0 + 16 * s + n < g.rows; ++n) {
        float* y = g.y + (row0 + 16 * s + n) * g.y_stride + o0;
        _mm512_mask_storeu_ps(y, outs, _mm512_add_ps(_mm512_castsi512_ps(r[n]), bias));
      }
    }
  }
}

template <QuantFormat F>
void run_prompt(const QuantGemm& g, const ParallelFor& parallel_for) {
  const int64_t ktiles = (g.w.in + 31) / 32;
  const int64_t strips = (g.w.out + kPromptStripRows - 1) / kPromptStripRows;
  const int64_t tasks = (strips + kPromptTaskStrips - 1) / kPromptTaskStrips;
  std::vector<uint32_t> panel;
  for (int64_t row0 = 0; row0 < g.rows; row0 += kPromptChunkRows) {
    const int64_t rows = std::min(kPromptChunkRows, g.rows - row0);
    const int64_t slabs = 2 * ((rows + 31) / 32);  // pairs of 16-row slabs
    panel.resize(slabs * ktiles * kTileWords);
    parallel_for(slabs, 1, [&](int64_t begin, int64_t end) { prompt_panel(g, row0, begin, end, ktiles, panel.data()); });
    parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> sums;
      sums.resize(kPromptTaskStrips * kPromptStripRows * 16 * slabs);
      for (int64_t task = begin; task < end; ++task)
        prompt_task<F>(g, panel.data(), row0, slabs, ktiles, task * kPromptTaskStrips,
                       std::min(strips, (task + 1) * kPromptTaskStrips), sums.data());
    });
  }
}
#pragma GCC pop_options

bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  return amx_bf16 && amx_tile && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// Linux hands a process the (8 KB) tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a tile instruction without it is a fatal signal.
bool tile_state_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
}

}  // namespace

bool quant_amx_hardware() {
  static const bool available = cpu_has_amx_bf16() && tile_state_permitted();
  return available;
}

void quant_gemm_amx(const QuantGemm& g, const ParallelFor& parallel_for) {
  if (g.w.format == QuantFormat::Q4) return run<QuantFormat::Q4>(g, parallel_for);
  run<QuantFormat::Q8>(g, parallel_for);
}

void quant_prompt_gemm_amx(const QuantGemm& g, const ParallelFor& parallel_for) {
  if (g.w.format == QuantFormat::Q4) return run_prompt<QuantFormat::Q4>(g, parallel_for);
  run_prompt<QuantFormat::Q8>(g, parallel_for);
}

#else

bool quant_amx_hardware() { return false; }

void quant_gemm_amx(const QuantGemm&, const ParallelFor&) {}

void quant_prompt_gemm_amx(const QuantGemm&, const ParallelFor&) {}

#endif

}  // namespace cpu
}  // namespace fsd
