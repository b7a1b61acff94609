// Device building blocks of the CUDA kernels (framework-free: CUDA runtime, CUB and fsd headers).
//
//   - logit loads: float / bfloat16 / float16 to float, +inf clamped to FLT_MAX, 16-byte vectors
//     with scalar head and tail so any row alignment and any vocabulary size works;
//   - block-wide online-softmax statistics of one vocabulary range (the per-thread arithmetic,
//     RowStat and its merge live in streaming.cuh);
//   - a Dist's probabilities and weights (Dist itself, the dtypes and their conversions:
//     fsd/numerics.h, shared with the CPU kernel);
//   - block-wide radix select (top-k / top-p cutoffs, div_top_k), inverse-CDF sampling over a
//     range (block scan over tiles), reductions;
//   - pass 2 (divergence terms, residual mass): the plain path of streaming.cuh for the default
//     configuration, a general per-id path for filters, one-hot rows and top-k buckets.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "fsd/common.h"
#include "fsd/cuda/streaming.cuh"
#include "fsd/rules.h"

// Thread-block clusters (accept.cuh's cluster kernels): device code for sm_90 and newer, and the
// CPU simulation of the kernels (csrc/fsd/tests/cuda_sim), which runs a cluster's blocks at once.
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || defined(FSD_CUDA_SIM)
#define FSD_CLUSTER_KERNELS 1
#else
#define FSD_CLUSTER_KERNELS 0
#endif

namespace fsd {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of every kernel
// Register budgets (__launch_bounds__ minimum blocks per SM): ptxas otherwise sometimes settles on
// 64 registers and spills. Streaming statistics: 4 blocks (<= 64 registers); the decision kernel
// (pass 2 + the row finish): 2 blocks (<= 128); the filter path: 1 block; sample_rows_kernel: 2
// (its histograms' warp reductions spilled at 64).
constexpr int kScanItems = 8;  // contiguous ids per thread in the sampling / tie scans

// The CUDA simulation (csrc/fsd/tests/cuda_sim) counts the bytes these load helpers read from the
// buffers a test watches, to measure how many times a launch path reads the logits.
#ifdef FSD_CUDA_SIM
#define FSD_SIM_READ(p, bytes) ::sim::global_read((p), (bytes))
#else
#define FSD_SIM_READ(p, bytes) ((void)0)
#endif

// One logit, unclamped (the bad-row check needs to see +inf as non-finite).
template <typename T>
__device__ __forceinline__ float load_raw(const T* p) {
  FSD_SIM_READ(p, sizeof(T));
  return to_float(*p);
}

template <typename T>
__device__ __forceinline__ float load_logit(const T* p) {
  return clamp_logit(load_raw(p));
}

template <typename T>
struct VecWidth {
  static constexpr int value = 16 / sizeof(T);
};

// The N = 16 / sizeof(T) raw values packed in one 16-byte word.
template <typename T>
__device__ __forceinline__ void decode_vec(const uint4 word, float (&out)[VecWidth<T>::value]) {
  const uint32_t w[4] = {word.x, word.y, word.z, word.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      T lo, hi;
      lo.bits = (uint16_t)(w[i] & 0xFFFFu);
      hi.bits = (uint16_t)(w[i] >> 16);
      out[2 * i] = to_float(lo);
      out[2 * i + 1] = to_float(hi);
    }
  }
}

// The 16-byte word at a 16-byte aligned address of global memory, through the read-only path.
template <typename T>
__device__ __forceinline__ uint4 load_word(const T* p) {
  FSD_SIM_READ(p, 16);
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <int N>
using Width = std::integral_constant<int, N>;

// End of the scalar head of ids [begin, end) of `row`: the first id at a 16-byte boundary (or end).
template <typename T>
__device__ __forceinline__ int64_t vector_head_end(const T* row, int64_t begin, int64_t end) {
  constexpr int64_t N = VecWidth<T>::value;
  const int64_t misalign = (int64_t)((reinterpret_cast<uintptr_t>(row + begin) % 16) / sizeof(T));
  return misalign ? min(end, begin + (N - misalign)) : begin;
}

// The block's threads visit ids [begin, end) of `row`: f(id, values, Width<n>) with n raw values at
// ids id..id+n-1 (n = the vector width in the aligned body, 1 in the head and tail).
template <typename T, typename F>
__device__ __forceinline__ void block_for_each(const T* __restrict__ row, int64_t begin, int64_t end, F&& f) {
  constexpr int N = VecWidth<T>::value;
  if (end <= begin) return;
  const int64_t head_end = vector_head_end(row, begin, end);
  for (int64_t j = begin + threadIdx.x; j < head_end; j += blockDim.x) {
    float v[N];
    v[0] = load_raw(row + j);
    f(j, v, Width<1>{});
  }
  const int64_t vectors = (end - head_end) / N;
  // kAhead 16-byte loads in flight per thread before the first is used (the compiler does not
  // hoist a load above the previous iteration's work); each thread still visits its vectors in
  // the same order.
  constexpr int kAhead = 2;
  for (int64_t first = threadIdx.x; first < vectors; first += (int64_t)kAhead * blockDim.x) {
    uint4 words[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = first + (int64_t)u * blockDim.x;
      if (t < vectors) words[u] = load_word(row + head_end + t * N);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = first + (int64_t)u * blockDim.x;
      if (t < vectors) {
        float v[N];
        decode_vec<T>(words[u], v);
        f(head_end + t * N, v, Width<N>{});
      }
    }
  }
  for (int64_t j = head_end + vectors * N + threadIdx.x; j < end; j += blockDim.x) {
    float v[N];
    v[0] = load_raw(row + j);
    f(j, v, Width<1>{});
  }
}

// The block visits ids [begin, end) of a target row and a draft row at once:
// f(id, target_values, draft_values, Width<n>). Ids >= draft_end get draft value -inf (the draft
// vocabulary is smaller). Vector loads for the target; for the draft too when both rows share the
// same 16-byte phase.
// With `reverse` the aligned body is walked from its end (pass 2 right after pass 1: the ids read
// last are the likeliest still in L2).
template <typename T, typename F>
__device__ __forceinline__ void block_for_each_pair(const T* __restrict__ target, const T* __restrict__ draft,
                                                    int64_t begin, int64_t end, int64_t draft_end, bool reverse,
                                                    F&& f) {
  constexpr int N = VecWidth<T>::value;
  const int64_t both_end = max(begin, min(end, draft_end));
  if (both_end > begin) {
    const bool same_phase =
        reinterpret_cast<uintptr_t>(target + begin) % 16 == reinterpret_cast<uintptr_t>(draft + begin) % 16;
    const int64_t head_end = vector_head_end(target, begin, both_end);
    for (int64_t j = begin + threadIdx.x; j < head_end; j += blockDim.x) {
      float a[N], b[N];
      a[0] = load_raw(target + j);
      b[0] = load_raw(draft + j);
      f(j, a, b, Width<1>{});
    }
    const int64_t vectors = (both_end - head_end) / N;
    // As in block_for_each: kAhead vectors of each row in flight per thread.
    constexpr int kAhead = 2;
    for (int64_t first = threadIdx.x; first < vectors; first += (int64_t)kAhead * blockDim.x) {
      uint4 target_words[kAhead], draft_words[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int64_t t = first + (int64_t)u * blockDim.x;
        const int64_t j = head_end + (reverse ? vectors - 1 - t : t) * N;
        if (t < vectors) {
          target_words[u] = load_word(target + j);
          if (same_phase) draft_words[u] = load_word(draft + j);
        }
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int64_t t = first + (int64_t)u * blockDim.x;
        const int64_t j = head_end + (reverse ? vectors - 1 - t : t) * N;
        if (t < vectors) {
          float a[N], b[N];
          decode_vec<T>(target_words[u], a);
          if (same_phase) {
            decode_vec<T>(draft_words[u], b);
          } else {
#pragma unroll
            for (int i = 0; i < N; ++i) b[i] = load_raw(draft + j + i);
          }
          f(j, a, b, Width<N>{});
        }
      }
    }
    for (int64_t j = head_end + vectors * N + threadIdx.x; j < both_end; j += blockDim.x) {
      float a[N], b[N];
      a[0] = load_raw(target + j);
      b[0] = load_raw(draft + j);
      f(j, a, b, Width<1>{});
    }
  }
  if (end > both_end) {
    block_for_each<T>(target, both_end, end, [&](int64_t j, const float* a, auto width) {
      float b[N];
#pragma unroll
      for (int i = 0; i < N; ++i) b[i] = -kInf;
      f(j, a, b, width);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Online-softmax statistics of a range of one vocabulary row.

template <typename T>
using StatReduce = cub::BlockReduce<RowStat, kThreads>;

// The block's total of every thread's statistics, valid in every thread (the barrier also orders
// everything the threads wrote to shared memory before it).
template <typename T>
__device__ __forceinline__ RowStat block_total_stat(const RowStat& st, float inv_s, float inv_d,
                                                    typename StatReduce<T>::TempStorage& temp, RowStat& shared_out) {
  const RowStat total = StatReduce<T>(temp).Reduce(st, StatMerge{inv_s, inv_d});
  if (threadIdx.x == 0) shared_out = total;
  __syncthreads();
  const RowStat out = shared_out;
  __syncthreads();
  return out;
}

// Calls f(std::true_type) when the two temperatures agree (one exponential per id and one sum),
// else f(std::false_type).
template <typename F>
__device__ __forceinline__ void with_same_inv(float inv_s, float inv_d, F&& f) {
  if (inv_s == inv_d) f(std::true_type{});
  else f(std::false_type{});
}

// Block-wide statistics of ids [begin, end) of `row`; the result is valid in every thread.
template <typename T>
__device__ __forceinline__ RowStat block_row_stat(const T* __restrict__ row, int64_t begin, int64_t end, float inv_s, float inv_d,
                                  typename StatReduce<T>::TempStorage& temp, RowStat& shared_out) {
  RowStat st = empty_stat();
  const StatScales scales = stat_scales(inv_s, inv_d);
  with_same_inv(inv_s, inv_d, [&](auto same) {
    constexpr bool kSame = decltype(same)::value;
    block_for_each(row, begin, end, [&](int64_t j, const float* v, auto width) {
      stat_add<decltype(width)::value, kSame>(st, j, v, scales);
    });
    if (kSame) st.sum_d = st.sum_s;
  });
  return block_total_stat<T>(st, inv_s, inv_d, temp, shared_out);
}

__device__ __forceinline__ bool stat_good(int32_t flags) { return !(flags & kHasNaN) && (flags & kHasFinite); }

// ---------------------------------------------------------------------------------------------
// A distribution's probabilities and weights as the kernels take them (Dist: fsd/numerics.h).
__device__ __forceinline__ float prob(const Dist& d, float z, int64_t id) {
  const float lp = d.log_prob(z, id);
  return lp > -kInf ? expf(lp) : 0.0f;
}
__device__ __forceinline__ float prob_fast(const Dist& d, float z, int64_t id) {  // pass 2's streaming sums
  const float lp = d.log_prob(z, id);
  return lp > -kInf ? fast_exp(lp) : 0.0f;
}
// The unnormalised sampling weight exp(s_j) of a kept id (what p-sampling scans).
__device__ __forceinline__ float sampling_weight(const Dist& d, float z) {
  const float s = d.scaled(z);
  return s >= d.cut ? expf(s) : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Block-wide radix select on order-preserving 32-bit keys of floats.

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

// ---------------------------------------------------------------------------------------------
// Block scans over ids in tiles of kThreads * kScanItems, each thread kScanItems contiguous ids.

struct MinOp {
  template <typename U>
  __device__ __forceinline__ U operator()(const U& a, const U& b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <typename U>
  __device__ __forceinline__ U operator()(const U& a, const U& b) const { return a < b ? b : a; }
};

struct ScanShared {
  typename cub::BlockScan<double, kThreads>::TempStorage scan;
  typename cub::BlockReduce<int64_t, kThreads>::TempStorage reduce;
  int64_t found;
};

// One thread's share of a scan tile: the kScanItems contiguous weights from id `first` (0 past
// `end`) into w, and their sum in double, added in id order. block_inverse_cdf and
// block_weight_total both take their per-thread sums from here, so their totals round alike.
template <typename WeightFn>
__device__ __forceinline__ double load_tile_weights(int64_t first, int64_t end, WeightFn weight_of,
                                                    float (&w)[kScanItems]) {
  double mine = 0.0;
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    w[i] = first + i < end ? weight_of(first + i) : 0.0f;
    mine += (double)w[i];
  }
  return mine;
}

// Inverse CDF over ids [begin, end) with weights weight_of(id) >= 0, cumulative starting at `base`:
// the first id whose cumulative weight exceeds `target`. Returns -1 when the range ends first;
// `last_positive` gets the last id with positive weight in the range (-1 if none). Valid in all
// threads.
template <typename WeightFn>
__device__ __forceinline__ int64_t block_inverse_cdf(int64_t begin, int64_t end, double base, double target, WeightFn weight_of,
                                     ScanShared& sh, int64_t& last_positive) {
  int64_t my_last = -1, result = -1;
  for (int64_t tile = begin; tile < end; tile += (int64_t)kThreads * kScanItems) {
    const int64_t first = tile + (int64_t)threadIdx.x * kScanItems;
    float w[kScanItems];
    const double mine = load_tile_weights(first, end, weight_of, w);
#pragma unroll
    for (int i = 0; i < kScanItems; ++i)
      if (w[i] > 0.0f) my_last = first + i;
    double before, aggregate;
    cub::BlockScan<double, kThreads>(sh.scan).ExclusiveSum(mine, before, aggregate);
    int64_t candidate = INT64_MAX;
    if (base + aggregate > target) {
      double running = base + before;
#pragma unroll
      for (int i = 0; i < kScanItems; ++i) {
        running += (double)w[i];
        if (candidate == INT64_MAX && w[i] > 0.0f && running > target) candidate = first + i;
      }
    }
    const int64_t found = cub::BlockReduce<int64_t, kThreads>(sh.reduce).Reduce(candidate, MinOp());
    if (threadIdx.x == 0) sh.found = found;
    __syncthreads();
    const int64_t f = sh.found;
    __syncthreads();
    base += aggregate;
    if (f != INT64_MAX) {
      result = f;
      break;
    }
  }
  const int64_t last = cub::BlockReduce<int64_t, kThreads>(sh.reduce).Reduce(my_last, MaxOp());
  if (threadIdx.x == 0) sh.found = last;
  __syncthreads();
  last_positive = sh.found;
  __syncthreads();
  return result;
}

// The total of weights weight_of(id) over ids [begin, end), summed exactly as block_inverse_cdf
// accumulates them (load_tile_weights per thread, then the tile aggregates in order), so
// that a target of u * this total puts the boundaries at the scan's own cumulative sums. (A total
// from another pass, e.g. the online statistics, differs by a rounding of ~1e-7 relative, and
// about V * 1e-7 of the draws would then fall between this kernel's and the CPU kernel's
// boundaries.) Valid in all threads.
template <typename WeightFn>
__device__ __forceinline__ double block_weight_total(int64_t begin, int64_t end, WeightFn weight_of, ScanShared& sh) {
  double total = 0.0;
  for (int64_t tile = begin; tile < end; tile += (int64_t)kThreads * kScanItems) {
    const int64_t first = tile + (int64_t)threadIdx.x * kScanItems;
    float w[kScanItems];
    const double mine = load_tile_weights(first, end, weight_of, w);
    double before, aggregate;
    cub::BlockScan<double, kThreads>(sh.scan).ExclusiveSum(mine, before, aggregate);
    __syncthreads();  // (the scan's storage is reused by the next tile)
    total += aggregate;
  }
  return total;
}

// The id of the `rank`-th (1-based) id in [0, n) with key == `key` in id order (div_top_k ties).
template <typename KeyAt>
__device__ __forceinline__ int64_t block_nth_tie(int64_t n, uint32_t key, uint32_t rank, KeyAt key_at, ScanShared& sh) {
  double base = 0.0;
  int64_t result = n - 1;
  for (int64_t tile = 0; tile < n; tile += (int64_t)kThreads * kScanItems) {
    const int64_t first = tile + (int64_t)threadIdx.x * kScanItems;
    uint32_t hits = 0;
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) hits += (first + i < n && key_at(first + i) == key) ? 1u : 0u;
    double before, aggregate;
    cub::BlockScan<double, kThreads>(sh.scan).ExclusiveSum((double)hits, before, aggregate);
    int64_t candidate = INT64_MAX;
    if (base + aggregate >= (double)rank) {
      double running = base + before;
      for (int i = 0; i < kScanItems; ++i) {
        if (first + i < n && key_at(first + i) == key) {
          running += 1.0;
          if (running == (double)rank) { candidate = first + i; break; }
        }
      }
    }
    const int64_t found = cub::BlockReduce<int64_t, kThreads>(sh.reduce).Reduce(candidate, MinOp());
    if (threadIdx.x == 0) sh.found = found;
    __syncthreads();
    const int64_t f = sh.found;
    __syncthreads();
    base += aggregate;
    if (f != INT64_MAX) {
      result = f;
      break;
    }
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// Pass 2: the divergence terms (optionally bucketed) and the residual mass over a range of ids.

struct TopBuckets {  // trivially constructible: it lives in shared memory
  bool on;
  uint32_t key;      // the k-th largest ranking key
  int64_t tie_last;  // ids with key == `key` and id <= tie_last are in the top k
};
__device__ __forceinline__ TopBuckets no_buckets() { return TopBuckets{false, 0u, -1}; }

struct PassTwo {
  double div = 0.0;     // sum of divergence terms (of the top ids when bucketed)
  double rest_p = 0.0;  // bucketed: mass of p and q outside the top k
  double rest_q = 0.0;
  // The weights the position's correction / bonus draw adds up: max(0, p - q) at the sampling
  // temperature where the correction samples the residual; where the token comes from p itself
  // (the bonus position, FSD-strict's corrections) and the vocabulary is split, p's weights exp(s),
  // summed as the draw's scan adds them (accept.cuh, decide_position).
  double draw_mass = 0.0;
};

struct DeviceLog {
  __device__ __forceinline__ float operator()(float x) const { return logf(x); }
  __device__ __forceinline__ double operator()(double x) const { return log(x); }
};

// Ranking key of an id under the divergence's target distribution (div_top_k).
__device__ __forceinline__ uint32_t rank_key(const Dist& d, float z, int64_t id) {
  return float_key(d.log_prob(z, id) > -kInf ? d.scaled(z) : -kInf);
}

// Whether an id is one of div_top_k's top ids (lp: its log-probability under pd).
__device__ __forceinline__ bool in_top_bucket(const TopBuckets& top, const Dist& pd, float zt, float lp, int64_t id) {
  const uint32_t key = float_key(lp > -kInf ? pd.scaled(zt) : -kInf);
  return key > top.key || (key == top.key && id <= top.tie_last);
}

// Pass 2's plain path (streaming.cuh): p and q plain softmaxes that the divergence compares
// itself, no buckets. Terms summed in float per thread, flushed to double every 32 vectors.
template <Divergence D, bool kDiv, bool kResidual, typename T>
__device__ __forceinline__ void pass_two_plain(const T* __restrict__ target, const T* __restrict__ draft, int64_t begin,
                                               int64_t end, int64_t draft_vocab, const PlainPair& pair, bool reverse,
                                               PassTwo& acc) {
  float div = 0.0f, residual = 0.0f;
  int count = 0;
  block_for_each_pair<T>(target, draft, begin, end, draft_vocab, reverse, [&](int64_t, const float* a, const float* b, auto width) {
#pragma unroll
    for (int i = 0; i < decltype(width)::value; ++i) plain_add<D, kDiv, kResidual>(pair, a[i], b[i], div, residual);
    if (++count == 32) {
      acc.div += div * plain_term_unit<D>(), acc.draw_mass += residual;
      div = residual = 0.0f;
      count = 0;
    }
  });
  acc.div += div * plain_term_unit<D>(), acc.draw_mass += residual;
}

// Accumulates pass 2 over [begin, end) of one position into a thread's PassTwo.
//   p, q: sampling distributions (residual); pd, qd: the distributions the divergence compares.
template <Divergence D, typename T>
__device__ __forceinline__ void pass_two(const T* __restrict__ target, const T* __restrict__ draft, int64_t begin,
                                         int64_t end, int64_t draft_vocab, const Dist& pd, const Dist& qd,
                                         const Dist& p, const Dist& q, bool need_div, bool need_residual,
                                         const TopBuckets& top, bool reverse, PassTwo& acc) {
  const DeviceLog log_fn;
  const bool shared_dists = pd.max == p.max && pd.inv == p.inv && pd.cut == p.cut && pd.one_hot == p.one_hot &&
                            qd.max == q.max && qd.inv == q.inv && qd.cut == q.cut && qd.one_hot == q.one_hot &&
                            pd.log_sum == p.log_sum && qd.log_sum == q.log_sum;
  if (!top.on && p.one_hot < 0 && q.one_hot < 0 && p.cut == -kInf && q.cut == -kInf && (shared_dists || !need_div)) {
    const PlainPair pair = plain_pair(p.max, p.inv, p.sum, q.max, q.inv, q.sum);
    if (need_div && need_residual)
      pass_two_plain<D, true, true>(target, draft, begin, end, draft_vocab, pair, reverse, acc);
    else if (need_div)
      pass_two_plain<D, true, false>(target, draft, begin, end, draft_vocab, pair, reverse, acc);
    else if (need_residual)
      pass_two_plain<D, false, true>(target, draft, begin, end, draft_vocab, pair, reverse, acc);
    return;
  }
  float div = 0.0f, rest_p = 0.0f, rest_q = 0.0f, residual = 0.0f;
  int count = 0;
  block_for_each_pair<T>(target, draft, begin, end, draft_vocab, reverse, [&](int64_t j, const float* a, const float* b, auto width) {
    constexpr int N = decltype(width)::value;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float zt = clamp_logit(a[i]), zd = clamp_logit(b[i]);
      float pp = 0.0f, qq = 0.0f;
      if (need_div) {
        const float lp = pd.log_prob(zt, j + i);
        const float lq = zd > -kInf ? qd.log_prob(zd, j + i) : -kInf;
        pp = lp > -kInf ? fast_exp(lp) : 0.0f;
        qq = lq > -kInf ? fast_exp(lq) : 0.0f;
        if (top.on) {
          if (in_top_bucket(top, pd, zt, lp, j + i)) {
            div += divergence_term<D, float>(pp, lp, qq, lq, log_fn);
          } else {  // (a rest that sums below kExactRestBelow is redone by exact_tiny_rests)
            rest_p += pp;
            rest_q += qq;
          }
        } else {
          div += divergence_term<D, float>(pp, lp, qq, lq, log_fn);
        }
      }
      if (need_residual) {
        if (!(need_div && shared_dists)) {
          pp = prob_fast(p, zt, j + i);
          qq = zd > -kInf ? prob_fast(q, zd, j + i) : 0.0f;
        }
        residual += pp > qq ? pp - qq : 0.0f;
      }
    }
    if (++count == 32) {
      acc.div += div, acc.rest_p += rest_p, acc.rest_q += rest_q, acc.draw_mass += residual;
      div = rest_p = rest_q = residual = 0.0f;
      count = 0;
    }
  });
  acc.div += div, acc.rest_p += rest_p, acc.rest_q += rest_q, acc.draw_mass += residual;
}

struct PassTwoSum {
  __device__ __forceinline__ PassTwo operator()(const PassTwo& a, const PassTwo& b) const {
    PassTwo out;
    out.div = a.div + b.div;
    out.rest_p = a.rest_p + b.rest_p;
    out.rest_q = a.rest_q + b.rest_q;
    out.draw_mass = a.draw_mass + b.draw_mass;
    return out;
  }
};

// div_top_k's rest buckets of [begin, end) in float64 where pass 2's float sum (`sums`, the block's
// reduction, valid on thread 0) fell below kExactRestBelow (rules.h): a log-sum-exp over the rest
// ids of that side, so a rest below float's range still has the right log. Block-uniform: every
// thread calls it after the reduction; a block whose rests are both above the bound only syncs.
struct RestLogMass {
  LogMass<float> p, q;
};
struct FastExp {
  __device__ __forceinline__ float operator()(float x) const { return fast_exp(x); }
};
struct RestLogMassMerge {
  __device__ __forceinline__ RestLogMass operator()(const RestLogMass& a, const RestLogMass& b) const {
    return RestLogMass{a.p.merged(b.p, FastExp{}), a.q.merged(b.q, FastExp{})};
  }
};
template <typename T>
__device__ __forceinline__ void exact_tiny_rests(const T* __restrict__ target, const T* __restrict__ draft, int64_t begin,
                                              int64_t end, int64_t draft_vocab, const Dist& pd, const Dist& qd,
                                              const TopBuckets& top, PassTwo& sums) {
  __shared__ int sides;  // bit 0: p's rest, bit 1: q's
  __shared__ typename cub::BlockReduce<RestLogMass, kThreads>::TempStorage temp;
  if (threadIdx.x == 0) sides = (sums.rest_p < kExactRestBelow ? 1 : 0) | (sums.rest_q < kExactRestBelow ? 2 : 0);
  __syncthreads();
  const int need = sides;
  if (need == 0) return;
  RestLogMass acc;
  block_for_each_pair<T>(target, draft, begin, end, draft_vocab, false, [&](int64_t j, const float* a, const float* b, auto width) {
#pragma unroll
    for (int i = 0; i < decltype(width)::value; ++i) {
      const float zt = clamp_logit(a[i]), zd = clamp_logit(b[i]);
      const float lp = pd.log_prob(zt, j + i);
      if (in_top_bucket(top, pd, zt, lp, j + i)) continue;
      if (need & 1) acc.p.add(lp, FastExp{});
      if (need & 2) acc.q.add(zd > -kInf ? qd.log_prob(zd, j + i) : -kInf, FastExp{});
    }
  });
  const RestLogMass total = cub::BlockReduce<RestLogMass, kThreads>(temp).Reduce(acc, RestLogMassMerge());
  if (threadIdx.x == 0) {
    if (need & 1) sums.rest_p = exp(total.p.log_value());
    if (need & 2) sums.rest_q = exp(total.q.log_value());
  }
  __syncthreads();  // `sides` and `temp` are reused by the block's next call
}

// Calls f(std::integral_constant<Divergence, kind>) for a runtime divergence kind, so a kernel
// holds one copy of the per-id loop per kind but one copy of everything else.
template <typename F>
__device__ __forceinline__ void with_divergence(Divergence kind, F&& f) {
  switch (kind) {
    case Divergence::KL: f(std::integral_constant<Divergence, Divergence::KL>{}); break;
    case Divergence::RKL: f(std::integral_constant<Divergence, Divergence::RKL>{}); break;
    case Divergence::JS: f(std::integral_constant<Divergence, Divergence::JS>{}); break;
    case Divergence::TV: f(std::integral_constant<Divergence, Divergence::TV>{}); break;
    case Divergence::MKL: f(std::integral_constant<Divergence, Divergence::MKL>{}); break;
  }
}

// The divergence from pass-2 sums (adds the rest bucket when bucketed).
__device__ __forceinline__ float finish_pass_two(Divergence kind, const PassTwo& sums, bool bucketed) {
  double total = sums.div;
  if (bucketed) {
    const DeviceLog log_fn;
    double rest = 0.0;
    with_divergence(kind, [&](auto tag) {
      constexpr Divergence D = decltype(tag)::value;
      rest = divergence_term<D, double>(sums.rest_p, log(sums.rest_p), sums.rest_q, log(sums.rest_q), log_fn);
    });
    total += rest;
  }
  return (float)finish_divergence(total);
}

// ---------------------------------------------------------------------------------------------
// Split paths (a row's vocabulary cut into chunks, one block each): combining the chunks' records.

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
