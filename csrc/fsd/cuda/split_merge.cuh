// Split paths (a row's vocabulary cut into chunks, one block each): combining the chunks' records
// into full-row statistics, sums over chunks and the chunk an inverse CDF lands in (warp-wide).
#pragma once

#include "fsd/cuda/loads.cuh"

namespace fsd {
namespace cuda {

template <typename U>
__device__ __forceinline__ U load_coherent(const U* p) {  // data other blocks of this launch wrote
  static_assert(sizeof(U) % 4 == 0, "word copy");
  U out;
  const unsigned int* src = reinterpret_cast<const unsigned int*>(p);
  unsigned int* dst = reinterpret_cast<unsigned int*>(&out);
#pragma unroll
  for (int k = 0; k < (int)(sizeof(U) / 4); ++k) dst[k] = __ldcg(src + k);
  return out;
}

// Full-row statistics of (row, position, model) from its chunk records: max, argmax, flags and the
// sums in double.
struct FullStat {
  float max;
  int32_t argmax, flags;
  double sum_s, sum_d;
};

// The full-row statistics of a position's target (chunks[0, splits)) and, with `with_draft`, its
// draft (chunks[splits, 2 splits)). Called by all 32 lanes of one warp (lane l takes chunks l,
// l + 32, ...); the results are valid in every lane. Each lane issues the loads of its first
// kCached rounds of both models at once and keeps those records in registers for the second sweep,
// so with up to 64 chunks the warp waits for L2 once, not four times (this is on the critical path
// of every decision block and of a small batch's latency).
__device__ __forceinline__ void warp_combine_position(const RowStat* chunks, int64_t splits, bool with_draft,
                                                      float inv_s, float inv_d, FullStat& target, FullStat& draft) {
  constexpr int kCached = 2;
  const int lane = threadIdx.x & 31;
  RowStat cached[2][kCached];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t c = lane + 32 * k;
      cached[m][k] = c < splits && (m == 0 || with_draft) ? load_coherent(chunks + m * splits + c) : empty_stat();
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    FullStat out{-kInf, INT32_MAX, 0, 0.0, 0.0};
    if (m == 1 && !with_draft) {
      draft = out;
      break;
    }
    // The lane's records in ascending chunk order: the cached rounds, then the rest from L2.
    auto for_each_record = [&](auto&& f) {
#pragma unroll
      for (int k = 0; k < kCached; ++k) f(cached[m][k]);  // empty beyond splits
      for (int64_t c = lane + 32 * kCached; c < splits; c += 32) f(load_coherent(chunks + m * splits + c));
    };
    for_each_record([&](const RowStat& s) {  // a lane's first max has its lowest id
      out.flags |= s.flags;
      if (s.max > out.max) out.max = s.max, out.argmax = s.argmax;
    });
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_max = __shfl_xor_sync(0xFFFFFFFFu, out.max, offset);
      const int32_t other_arg = __shfl_xor_sync(0xFFFFFFFFu, out.argmax, offset);
      out.flags |= __shfl_xor_sync(0xFFFFFFFFu, out.flags, offset);
      if (other_max > out.max || (other_max == out.max && other_arg < out.argmax)) {
        out.max = other_max;
        out.argmax = other_arg;
      }
    }
    if (out.max != -kInf) {
      for_each_record([&](const RowStat& s) {
        if (s.max == -kInf) return;
        out.sum_s += (double)s.sum_s * (s.max == out.max ? 1.0 : (double)expf((s.max - out.max) * inv_s));
        out.sum_d += (double)s.sum_d * (s.max == out.max ? 1.0 : (double)expf((s.max - out.max) * inv_d));
      });
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        out.sum_s += __shfl_xor_sync(0xFFFFFFFFu, out.sum_s, offset);
        out.sum_d += __shfl_xor_sync(0xFFFFFFFFu, out.sum_d, offset);
      }
    }
    (m == 0 ? target : draft) = out;
  }
}

// Sum over chunks of a per-chunk double (warp-wide, valid in every lane).
template <typename F>
__device__ __forceinline__ double warp_sum_chunks(int64_t splits, F value_of) {
  double sum = 0.0;
  for (int64_t c = threadIdx.x & 31; c < splits; c += 32) sum += value_of(c);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  return sum;
}

// Where an inverse CDF over a row cut into chunks lands: the first chunk whose cumulative total
// (chunk totals total_of(c) added in chunk order) exceeds `target`. Called by all 32 lanes of one
// warp (an inclusive scan over the chunks in rounds of 32); the result is valid in every lane.
struct ChunkChoice {
  int64_t chunk;       // -1 when the totals never exceed target (rounding ran past the end)
  int64_t last_chunk;  // the last chunk with a positive total (0 when none)
  double base;         // the cumulative total before `chunk`
  double mass;         // `chunk`'s total
};
template <typename F>
__device__ __forceinline__ ChunkChoice warp_choose_chunk(int64_t splits, double target, F total_of) {
  const int lane = threadIdx.x & 31;
  ChunkChoice choice{-1, 0, 0.0, 0.0};
  for (int64_t round = 0; round < splits; round += 32) {
    const int64_t c = round + lane;
    const double w = c < splits ? total_of(c) : 0.0;
    double inclusive = w;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const double other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const unsigned positive = __ballot_sync(0xFFFFFFFFu, w > 0.0);
    if (positive) choice.last_chunk = round + 31 - __clz(positive);
    if (choice.chunk < 0) {
      const unsigned crossing = __ballot_sync(0xFFFFFFFFu, c < splits && choice.base + inclusive > target);
      if (crossing) {
        const int first = __ffs(crossing) - 1;
        choice.chunk = round + first;
        choice.mass = __shfl_sync(0xFFFFFFFFu, w, first);
        choice.base += __shfl_sync(0xFFFFFFFFu, inclusive - w, first);
      } else {
        choice.base += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
      }
    }
  }
  return choice;
}

}  // namespace cuda
}  // namespace fsd
