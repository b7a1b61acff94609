// Block-wide radix select on order-preserving 32-bit keys of floats: the top-k / top-p / min-p
// cutoffs of a row and div_top_k's k-th key, and the kept sum under a cutoff.
#pragma once

#include "fsd/cuda/block_stats.cuh"

namespace fsd {
namespace cuda {

// -0.0 and +0.0 get one key: they are equal values, and ties break by id (as on the CPU), not by sign.
__device__ __forceinline__ uint32_t float_key(float x) {
  const uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// hist[bin] += value from the calling lanes of a warp: the lanes with the same bin first sum their
// values (cooperative-groups partition by label), then one lane adds the sum. A row's keys fall in
// a few bins of the first digits, so plain per-lane shared-memory atomics (a compare-and-swap loop
// for double) serialise almost every id there (top_p on the H200: docs/cuda.md, "Measured on a GPU").
template <typename U>
__device__ __forceinline__ void add_to_bin(U* hist, uint32_t bin, U value) {
  namespace cg = cooperative_groups;
  const cg::coalesced_group active = cg::coalesced_threads();
  const cg::coalesced_group same_bin = cg::labeled_partition(active, bin);
  const U sum = cg::reduce(same_bin, value, cg::plus<U>());
  if (same_bin.thread_rank() == 0) atomicAdd(hist + bin, sum);
}

struct SelectShared {
  union {
    uint32_t count[256];
    double mass[256];
  } hist;
  uint32_t prefix, remaining_count, greater;
  double remaining_mass;
  int32_t found;
};

// One digit of a radix select: bins[d] = the sum of value_of(z, id, key&) over the ids whose value
// is positive and whose key agrees with the chosen prefix above the digit at `shift` (d: that digit).
// The prefix is read from shared memory after the first barrier (thread 0 may have just written it).
// Ends with a barrier: the histogram is complete in every thread.
template <typename T, typename U, typename ValueKeyFn>
__device__ __forceinline__ void block_digit_histogram(const T* __restrict__ row, int64_t n, int shift,
                                                      const uint32_t& shared_prefix, U (&bins)[256],
                                                      ValueKeyFn value_of) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = U(0);
  __syncthreads();
  const uint32_t prefix = shared_prefix;
  const uint32_t high_mask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
  block_for_each(row, 0, n, [&](int64_t j, const float* v, auto width) {
    constexpr int N = decltype(width)::value;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      uint32_t key;
      const U value = value_of(clamp_logit(v[i]), j + i, key);
      if (value > U(0) && (key & high_mask) == (prefix & high_mask)) add_to_bin(bins, (key >> shift) & 0xFFu, value);
    }
  });
  __syncthreads();
}

// The largest key v such that #{ids with key >= v} >= k (the k-th largest key, ties counted), over
// ids [0, n) of `row` where key_of(z, id) gives each id's key. Also returns #{key > v} in `greater`.
// All threads call it; results valid in all threads.
template <typename T, typename KeyFn>
__device__ __forceinline__ uint32_t block_select_kth(const T* __restrict__ row, int64_t n, uint32_t k, KeyFn key_of,
                                     SelectShared& sh, uint32_t& greater) {
  if (threadIdx.x == 0) sh.prefix = 0, sh.remaining_count = k, sh.greater = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    block_digit_histogram(row, n, shift, sh.prefix, sh.hist.count, [&](float z, int64_t id, uint32_t& key) {
      key = key_of(z, id);
      return 1u;
    });
    if (threadIdx.x == 0) {
      uint32_t above = 0;
      int digit = 0;
      for (int d = 255; d >= 0; --d) {
        if (above + sh.hist.count[d] >= sh.remaining_count) { digit = d; break; }
        above += sh.hist.count[d];
      }
      sh.remaining_count -= above;
      sh.greater += above;
      sh.prefix |= (uint32_t)digit << shift;
    }
    __syncthreads();
  }
  const uint32_t out = sh.prefix;
  greater = sh.greater;
  __syncthreads();
  return out;
}

// The largest key v such that sum over {key >= v} of weight >= target_mass, among ids where
// weight_of > 0 (weight_of(z, id, key&)). Returns false (no cutoff) when the total never reaches it.
// Only digits holding mass are chosen, so a target of 0 selects the largest key (as the CPU walk,
// which stops at the first value). Past the first digit the chosen bucket's mass covers the rest
// of the target in exact arithmetic; if the re-summed (atomic, any order) mass falls a rounding
// short, the lowest non-empty digit is taken: the cut then lies at the bucket's end, as on the CPU.
template <typename T, typename WeightKeyFn>
__device__ __forceinline__ bool block_select_mass(const T* __restrict__ row, int64_t n, double target_mass, WeightKeyFn weight_of,
                                  SelectShared& sh, uint32_t& out_key) {
  if (threadIdx.x == 0) sh.prefix = 0, sh.remaining_mass = target_mass, sh.found = 1;
  for (int shift = 24; shift >= 0; shift -= 8) {
    block_digit_histogram(row, n, shift, sh.prefix, sh.hist.mass, weight_of);  // (float weights, summed in double)
    if (threadIdx.x == 0 && sh.found) {
      double above = 0.0;
      int digit = -1, lowest = -1;
      for (int d = 255; d >= 0; --d) {
        if (!(sh.hist.mass[d] > 0.0)) continue;
        lowest = d;
        if (above + sh.hist.mass[d] >= sh.remaining_mass) { digit = d; break; }
        above += sh.hist.mass[d];
      }
      if (digit < 0 && shift < 24 && lowest >= 0) {  // a rounding short: the bucket's end
        digit = lowest;
        above -= sh.hist.mass[lowest];
      }
      if (digit < 0) {
        sh.found = 0;
      } else {
        sh.remaining_mass -= above;
        sh.prefix |= (uint32_t)digit << shift;
      }
    }
    __syncthreads();
  }
  const bool found = sh.found != 0;
  out_key = sh.prefix;
  __syncthreads();
  return found;
}

// Filter cutoff in s-space for a row with statistics (max, inv): top-k, then top-p on the top-k
// set, then min-p (see SamplingFilter). -inf when no filter is on.
template <typename T>
__device__ __forceinline__ float block_filter_cutoff(const T* __restrict__ row, int64_t n, float max, float inv,
                                     const SamplingFilter& filter, SelectShared& sh,
                                     typename cub::BlockReduce<double, kThreads>::TempStorage& reduce_temp,
                                     double& shared_double) {
  float cut = -kInf;
  if (filter.top_k > 0 && filter.top_k < n) {
    uint32_t greater;
    const uint32_t key = block_select_kth(row, n, (uint32_t)filter.top_k,
                                          [&](float z, int64_t) { return float_key((z - max) * inv); }, sh, greater);
    cut = key_float(key);
  }
  if (filter.top_p < 1.0f) {
    double part = 0.0;
    block_for_each(row, 0, n, [&](int64_t, const float* v, auto width) {
      constexpr int N = decltype(width)::value;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float s = (clamp_logit(v[i]) - max) * inv;
        part += (s >= cut && s > -kInf) ? (double)expf(s) : 0.0;
      }
    });
    const double kept_total = cub::BlockReduce<double, kThreads>(reduce_temp).Sum(part);
    if (threadIdx.x == 0) shared_double = kept_total;
    __syncthreads();
    const double target = (double)filter.top_p * shared_double;
    __syncthreads();
    uint32_t key;
    const float topk_cut = cut;
    const bool found = block_select_mass(row, n, target, [&](float z, int64_t, uint32_t& k) {
      const float s = (z - max) * inv;
      k = float_key(s);
      return (s >= topk_cut && s > -kInf) ? expf(s) : 0.0f;
    }, sh, key);
    if (found) cut = fmaxf(cut, key_float(key));
  }
  cut = fmaxf(cut, filter.min_p_cut());
  return cut;
}

// Sum over ids of exp(s) for s >= cut (double), valid in all threads.
template <typename T>
__device__ __forceinline__ double block_kept_sum(const T* __restrict__ row, int64_t n, float max, float inv, float cut,
                                 typename cub::BlockReduce<double, kThreads>::TempStorage& reduce_temp,
                                 double& shared_double) {
  float part = 0.0f;
  double total = 0.0;
  int count = 0;
  block_for_each(row, 0, n, [&](int64_t, const float* v, auto width) {
    constexpr int N = decltype(width)::value;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float s = (clamp_logit(v[i]) - max) * inv;
      part += s >= cut ? expf(s) : 0.0f;
    }
    if (++count == 64) total += part, part = 0.0f, count = 0;
  });
  total += part;
  const double sum = cub::BlockReduce<double, kThreads>(reduce_temp).Sum(total);
  if (threadIdx.x == 0) shared_double = sum;
  __syncthreads();
  const double out = shared_double;
  __syncthreads();
  return out;
}

}  // namespace cuda
}  // namespace fsd
