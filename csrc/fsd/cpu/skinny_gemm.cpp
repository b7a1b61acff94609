// See skinny_gemm.h. Register blocking: kOutBlock weight rows x kRowGroup rows of x, each with a
// kChunk-lane partial sum (2 x 4 x 8 floats: eight AVX registers), so every weight load feeds
// kRowGroup multiply-adds and every x load kOutBlock. More than kRowGroup rows of x are done in
// groups over the same weight block, which is then still in L1/L2, so W leaves memory once.
// bfloat16 weights: each block is first widened into a float32 scratch (a vectorised pass that
// stays in cache), so the inner loops are the float32 ones and memory sees half the bytes.
#include "fsd/cpu/skinny_gemm.h"

#include <algorithm>
#include <vector>

#include "fsd/cpu/vec.h"

namespace fsd {
namespace cpu {
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

// Output features [begin, end): all rows of x, in groups of at most kRowGroup, over blocks of
// weight rows small enough (~kBlockBytes as float32) to stay in L2 while the groups after the
// first reread them.
void out_range(const SkinnyGemm& g, int64_t begin, int64_t end) {
  const bool bf16 = g.w_dtype == DType::BFloat16;
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

void skinny_gemm(const SkinnyGemm& g, const ParallelFor& parallel_for) {
  const int64_t tasks = (g.out + kOutGrain - 1) / kOutGrain;
  parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    out_range(g, begin * kOutGrain, std::min(g.out, end * kOutGrain));
  });
}

}  // namespace cpu
}  // namespace fsd
