// Counter-based Philox4x32-10 (Salmon et al., SC'11), shared by the CPU and CUDA kernels and
// mirrored in fsd_ext/reference.py (philox_uniforms), so the reference can replay the same draws.
//
// Keying (docs/design.md section 3), for one call with seed s and offset o:
//   key     = (lo32(row seed), hi32(row seed))
//   counter = (position | purpose << 24, row stream, lo32(o), hi32(o))
// where row seed / row stream are (seed[b], 0) with per-row seeds and (s, b) with a scalar seed.
// Every (row, position, purpose) draws one 53-bit uniform double in [0, 1).
#pragma once

#include <cstdint>

#include "common.h"

namespace fsd {

struct Philox4x32 {
  uint32_t v[4];
};

FSD_INLINE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = (uint64_t)a * (uint64_t)b;
  hi = (uint32_t)(product >> 32);
  lo = (uint32_t)product;
}

FSD_INLINE Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t* c = counter.v;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, c[0], hi0, lo0);
    philox_mulhilo(kMul1, c[2], hi1, lo1);
    const uint32_t next[4] = {hi1 ^ c[1] ^ key0, lo1, hi0 ^ c[3] ^ key1, lo0};
    c[0] = next[0]; c[1] = next[1]; c[2] = next[2]; c[3] = next[3];
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// The uniform in [0, 1) for one (row, position, purpose) under `key`. 53 random bits, so every
// double in the grid k * 2^-53 is equally likely and inverse-CDF sampling can reach tokens of
// probability far below float32 resolution.
FSD_INLINE double philox_uniform(uint64_t row_seed, uint32_t row_stream, uint64_t offset,
                                 uint32_t position, Purpose purpose) {
  Philox4x32 counter = {{(position & 0xFFFFFFu) | ((uint32_t)purpose << 24), row_stream,
                         (uint32_t)offset, (uint32_t)(offset >> 32)}};
  const Philox4x32 out = philox4x32_10(counter, (uint32_t)row_seed, (uint32_t)(row_seed >> 32));
  const uint64_t bits53 = ((uint64_t)(out.v[0] >> 5) << 26) | (uint64_t)(out.v[1] >> 6);
  return (double)bits53 * (1.0 / 9007199254740992.0);  // 2^-53
}

FSD_INLINE double draw_uniform(const RandomKey& key, int64_t row, int64_t position, Purpose purpose) {
  return philox_uniform(key.row_seed(row), key.row_stream(row), key.call_offset(), (uint32_t)position,
                        purpose);
}

}  // namespace fsd
