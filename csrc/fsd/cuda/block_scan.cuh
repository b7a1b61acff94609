// Block scans over ids in tiles of kThreads * kScanItems (each thread kScanItems contiguous ids):
// inverse-CDF sampling over a range, the total its scan adds, the n-th tied id.
#pragma once

#include "fsd/cuda/loads.cuh"

namespace fsd {
namespace cuda {

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

}  // namespace cuda
}  // namespace fsd
