// Block-wide online-softmax statistics of one vocabulary range (the per-thread arithmetic, RowStat
// and its merge: streaming.cuh), and a Dist's probabilities and weights as the kernels take them.
#pragma once

#include "fsd/cuda/loads.cuh"

namespace fsd {
namespace cuda {

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

}  // namespace cuda
}  // namespace fsd
