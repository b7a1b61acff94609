// fsd_ext.divergence, fsd_ext.sample and fsd_ext.philox_uniforms on CUDA: one block per row.
#pragma once

#include "fsd/cuda/device.cuh"
#include "fsd/philox.h"

namespace fsd {
namespace cuda {

// D(softmax(target / T) || softmax(draft / T)) per row; NaN for bad rows. Grid: N blocks.
// Two blocks per SM: with the block size alone, ptxas (CUDA 13, sm_90, -DNDEBUG as CMake's Release
// build sets it) capped the float kernel at 64 registers and spilled; with a minimum of two blocks
// it takes 84-97 registers and no spill.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) divergence_rows_kernel(const DivergenceProblem pb) {
  const int64_t r = blockIdx.x;
  const T* target = static_cast<const T*>(pb.target_logits) + r * pb.target_stride;
  const T* draft = static_cast<const T*>(pb.draft_logits) + r * pb.draft_stride;
  const float inv = inverse_temperature(pb.temperature);
  __shared__ union {
    typename StatReduce<T>::TempStorage stat;
    typename cub::BlockReduce<PassTwo, kThreads>::TempStorage reduce;
  } temp;
  __shared__ RowStat stat_out;
  __shared__ SelectShared select;
  __shared__ ScanShared scan;
  const RowStat st_t = block_row_stat(target, 0, pb.target_vocab, inv, inv, temp.stat, stat_out);
  const RowStat st_d = block_row_stat(draft, 0, pb.draft_vocab, inv, inv, temp.stat, stat_out);
  if (!stat_good(st_t.flags) || !stat_good(st_d.flags)) {
    if (threadIdx.x == 0) pb.out[r] = __int_as_float(0x7FC00000);
    return;
  }
  const Dist p = softmax_dist(st_t.max, inv, -kInf, (double)st_t.sum_s);
  const Dist q = softmax_dist(st_d.max, inv, -kInf, (double)st_d.sum_s);
  TopBuckets top = no_buckets();
  if (pb.top_k > 0 && pb.top_k < pb.target_vocab) {
    uint32_t greater;
    const uint32_t key = block_select_kth(target, pb.target_vocab, (uint32_t)pb.top_k,
                                          [&](float z, int64_t id) { return rank_key(p, z, id); }, select, greater);
    top.tie_last = block_nth_tie(pb.target_vocab, key, (uint32_t)pb.top_k - greater, [&](int64_t id) {
      return rank_key(p, load_logit(target + id), id);
    }, scan);
    top.key = key;
    top.on = true;
  }
  PassTwo acc;
  with_divergence(pb.divergence, [&](auto tag) {
    pass_two<decltype(tag)::value>(target, draft, 0, pb.target_vocab, pb.draft_vocab, p, q, p, q, true, false, top, true, acc);
  });
  const PassTwo sums = cub::BlockReduce<PassTwo, kThreads>(temp.reduce).Reduce(acc, PassTwoSum());
  if (threadIdx.x == 0) pb.out[r] = finish_pass_two(pb.divergence, sums, top.on);
}

// One token per (row, position) by inverse CDF on the Draft stream; -1 for bad rows (NaN or no
// finite logit, or a per-row temperature out of range).
// Grid: (positions, batch).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) sample_rows_kernel(const SampleProblem pb) {
  const int64_t s = blockIdx.x, b = blockIdx.y;
  const T* row = static_cast<const T*>(pb.logits) + b * pb.stride_b + s * pb.stride_s;
  int64_t* out = pb.tokens + b * pb.positions + s;
  const float tau = pb.temperature.at(b);
  if (!temperature_in_range(tau)) {  // block-uniform
    if (threadIdx.x == 0) *out = -1;
    return;
  }
  const float inv = tau == 0.0f ? 1.0f : inverse_temperature(tau);
  __shared__ union {
    typename StatReduce<T>::TempStorage stat;
    typename cub::BlockReduce<double, kThreads>::TempStorage sum;
  } temp;
  __shared__ RowStat stat_out;
  __shared__ SelectShared select;
  __shared__ ScanShared scan;
  __shared__ double shared_double;
  const RowStat st = block_row_stat(row, 0, pb.vocab, inv, inv, temp.stat, stat_out);
  if (!stat_good(st.flags) || tau == 0.0f) {
    if (threadIdx.x == 0) *out = stat_good(st.flags) ? (int64_t)st.argmax : -1;
    return;
  }
  const float cut = pb.filter.active()
                        ? block_filter_cutoff(row, pb.vocab, st.max, inv, pb.filter, select, temp.sum, shared_double)
                        : -kInf;
  // The draw is u times the total of the very weights the scan adds up (block_weight_total), so
  // p's weights need no normaliser (its sum, which weight() does not read, is the unfiltered one).
  const Dist p = softmax_dist(st.max, inv, cut, (double)st.sum_s);
  const double u = draw_uniform(pb.key, b, s, Purpose::Draft);
  auto weight = [&](int64_t j) { return p.weight(load_logit(row + j)); };
  const double total = block_weight_total(0, pb.vocab, weight, scan);
  int64_t last_positive = -1;
  int64_t token = block_inverse_cdf(0, pb.vocab, 0.0, u * total, weight, scan, last_positive);
  if (token < 0) token = last_positive >= 0 ? last_positive : st.argmax;
  if (threadIdx.x == 0) *out = token;
}

__global__ void philox_uniforms_kernel(const RandomKey key, int64_t rows, int64_t positions, Purpose purpose,
                                       double* out) {
  const int64_t total = rows * positions;
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x)
    out[n] = draw_uniform(key, n / positions, n % positions, purpose);
}

}  // namespace cuda
}  // namespace fsd
