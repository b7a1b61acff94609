// See skinny_gemm.h. Register blocking: kOutBlock weight rows x kRowGroup rows of x, each with a
// kChunk-lane partial sum (2 x 4 x 8 floats: eight AVX registers), so every weight load feeds
// kRowGroup multiply-adds and every x load kOutBlock. More than kRowGroup rows of x are done in
// groups over the same weight block, which is then still in L1/L2, so W leaves memory once.
#include "fsd/cpu/skinny_gemm.h"

#include <algorithm>

#include "fsd/cpu/vec.h"

namespace fsd {
namespace cpu {
namespace {

constexpr int kOutBlock = 2;   // weight rows sharing each x load
constexpr int kRowGroup = 4;   // rows of x sharing each weight load
constexpr int kChunk = 8;      // lanes of each partial sum
constexpr int64_t kOutGrain = 64;  // output features per parallel task (a multiple of kOutBlock)
constexpr int64_t kBlockBytes = 96 * 1024;  // weight bytes reused across row groups (fits L2)

// Rows [row0, row0 + R) of x times weight rows o and o + 1 (o + 1 < out unless last_single).
template <int R>
FSD_ALWAYS_INLINE void dot_block(const SkinnyGemm& g, int64_t row0, int64_t o, bool single) {
  const float* w0 = g.w + o * g.w_stride;
  const float* w1 = single ? w0 : w0 + g.w_stride;  // a lone last row is computed twice, stored once
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
      const int64_t col = o + b;
      g.y[(row0 + r) * g.y_stride + col] = sum + (g.bias ? g.bias[col] : 0.0f);
    }
  }
}

template <int R>
FSD_CPU_CLONES void dot_range(const SkinnyGemm& g, int64_t row0, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; o += kOutBlock) dot_block<R>(g, row0, o, o + 1 >= end);
}

// Output features [begin, end): all rows of x, in groups of at most kRowGroup, over blocks of
// weight rows small enough (~kBlockBytes) to stay in L2 while the groups after the first reread them.
void out_range(const SkinnyGemm& g, int64_t begin, int64_t end) {
  const int64_t block = std::clamp<int64_t>(kBlockBytes / (int64_t(sizeof(float)) * g.in) / kOutBlock *
                                                kOutBlock, kOutBlock, kOutGrain);
  for (int64_t o = begin; o < end; o += block) {
    const int64_t block_end = std::min(end, o + block);
    for (int64_t row0 = 0; row0 < g.rows; row0 += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, g.rows - row0)) {
        case 1: dot_range<1>(g, row0, o, block_end); break;
        case 2: dot_range<2>(g, row0, o, block_end); break;
        case 3: dot_range<3>(g, row0, o, block_end); break;
        default: dot_range<4>(g, row0, o, block_end); break;
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
