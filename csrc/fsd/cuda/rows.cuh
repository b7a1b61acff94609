// fsd_ext.divergence, fsd_ext.sample and fsd_ext.philox_uniforms on CUDA: one block per row, or for
// sample with few rows and no top-k / top-p, one block per vocabulary chunk of a row (the split path).
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
  PassTwo sums = cub::BlockReduce<PassTwo, kThreads>(temp.reduce).Reduce(acc, PassTwoSum());
  if (top.on) exact_tiny_rests(target, draft, 0, pb.target_vocab, pb.draft_vocab, p, q, top, sums);
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
  // p's weights need no normaliser (its sum, which sampling_weight does not read, is the unfiltered one).
  const Dist p = softmax_dist(st.max, inv, cut, (double)st.sum_s);
  const double u = draw_uniform(pb.key, b, s, Purpose::Draft);
  auto weight = [&](int64_t j) { return sampling_weight(p, load_logit(row + j)); };
  const double total = block_weight_total(0, pb.vocab, weight, scan);
  int64_t last_positive = -1;
  int64_t token = block_inverse_cdf(0, pb.vocab, 0.0, u * total, weight, scan, last_positive);
  if (token < 0) token = last_positive >= 0 ? last_positive : st.argmax;
  if (threadIdx.x == 0) *out = token;
}

// Split path of fsd_ext.sample (few rows, no filter but min-p; the planner is in rows.cu): each (row,
// position) cut into `splits` vocabulary chunks of `chunk` ids, one block each, in two launches,
// so that a batch of one reads its row with many SMs instead of one. Rows are flattened as
// r = b * positions + s, chunks fastest.
struct SampleWorkspace {
  RowStat* chunk_stats = nullptr;  // [rows, splits]
  double* chunk_totals = nullptr;  // [rows, splits]: the chunk's sum of p's weights, as the scan adds them
  uint32_t* counters = nullptr;    // [rows]: blocks of the row done with launch 2
  int64_t splits = 1, chunk = 0;
};

// The (row, position) of split block blockIdx.x: its logits, output slot, chunk, temperature.
template <typename T>
struct SampleChunk {
  int64_t r, b, s, c, begin, end;
  const T* row;
  int64_t* out;
  float tau, inv;
  __device__ __forceinline__ SampleChunk(const SampleProblem& pb, const SampleWorkspace& ws) {
    c = blockIdx.x % ws.splits;
    r = blockIdx.x / ws.splits;
    b = r / pb.positions;
    s = r % pb.positions;
    begin = c * ws.chunk;
    end = min(pb.vocab, begin + ws.chunk);
    row = static_cast<const T*>(pb.logits) + b * pb.stride_b + s * pb.stride_s;
    out = pb.tokens + r;
    tau = pb.temperature.at(b);
    inv = tau == 0.0f ? 1.0f : inverse_temperature(tau);
  }
};

// Split path, launch 1: the online-softmax statistics of one chunk (and the row's counter reset).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) sample_stats_kernel(const SampleProblem pb, const SampleWorkspace ws) {
  const SampleChunk<T> at(pb, ws);
  if (at.c == 0 && threadIdx.x == 0) ws.counters[at.r] = 0;
  if (!temperature_in_range(at.tau)) return;  // launch 2 writes -1
  __shared__ typename StatReduce<T>::TempStorage temp;
  __shared__ RowStat stat_out;
  const RowStat st = block_row_stat(at.row, at.begin, at.end, at.inv, at.inv, temp, stat_out);
  if (threadIdx.x == 0) ws.chunk_stats[at.r * ws.splits + at.c] = st;
}

// Split path, launch 2: every block combines its row's chunk statistics and sums its chunk's
// weights exactly as the scan adds them (block_weight_total); the row's last block to finish
// (atomic counter) chooses the chunk holding u times the sum of those totals, then scans it. So
// the draw is measured in the very weights the scans add up, as on the one-block path.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) sample_draw_kernel(const SampleProblem pb, const SampleWorkspace ws) {
  const SampleChunk<T> at(pb, ws);
  if (!temperature_in_range(at.tau)) {  // block-uniform
    if (at.c == 0 && threadIdx.x == 0) *at.out = -1;
    return;
  }
  __shared__ FullStat full;
  __shared__ ScanShared scan;
  __shared__ ChunkChoice choice;
  __shared__ double within;  // u * total - the chosen chunk's base
  __shared__ bool last_block;
  if (threadIdx.x < 32) {
    FullStat st, unused;
    warp_combine_position(ws.chunk_stats + at.r * ws.splits, ws.splits, false, at.inv, at.inv, st, unused);
    if (threadIdx.x == 0) full = st;
  }
  __syncthreads();
  const FullStat st = full;
  if (!stat_good(st.flags) || at.tau == 0.0f) {  // block-uniform: argmax, or -1 for a bad row
    if (at.c == 0 && threadIdx.x == 0) *at.out = stat_good(st.flags) ? (int64_t)st.argmax : -1;
    return;
  }
  // (sum_s, the unfiltered sum, is never read: the draw measures u in the weights' own total.)
  const Dist p = softmax_dist(st.max, at.inv, pb.filter.min_p_cut(), st.sum_s);
  auto weight = [&](int64_t j) { return sampling_weight(p, load_logit(at.row + j)); };
  const double own = block_weight_total(at.begin, at.end, weight, scan);
  const double* totals = ws.chunk_totals + at.r * ws.splits;
  if (threadIdx.x == 0) {
    ws.chunk_totals[at.r * ws.splits + at.c] = own;
    __threadfence();
    last_block = atomicAdd(ws.counters + at.r, 1u) == (uint32_t)(ws.splits - 1);
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  if (threadIdx.x < 32) {
    auto total_of = [&](int64_t c) { return __ldcg(totals + c); };
    const double target = draw_uniform(pb.key, at.b, at.s, Purpose::Draft) * warp_sum_chunks(ws.splits, total_of);
    const ChunkChoice found = warp_choose_chunk(ws.splits, target, total_of);
    if (threadIdx.x == 0) choice = found, within = target - found.base;
  }
  __syncthreads();
  const ChunkChoice chosen = choice;
  int64_t last_positive = -1, token = -1;
  if (chosen.chunk >= 0) {
    // The chunk's total came from the same sums as this scan's (block_weight_total), so the
    // target's remainder inside the chunk is below the scan's own cumulative total there.
    const int64_t begin = chosen.chunk * ws.chunk, end = min(pb.vocab, begin + ws.chunk);
    token = block_inverse_cdf(begin, end, 0.0, within, weight, scan, last_positive);
    if (token < 0) token = last_positive;
  }
  if (token < 0) {  // u * total rounded past the end: the last positive-weight id
    const int64_t begin = chosen.last_chunk * ws.chunk, end = min(pb.vocab, begin + ws.chunk);
    block_inverse_cdf(begin, end, 0.0, (double)kInf, weight, scan, last_positive);
    token = last_positive >= 0 ? last_positive : st.argmax;
  }
  if (threadIdx.x == 0) *at.out = token;
}

__global__ void philox_uniforms_kernel(const RandomKey key, int64_t rows, int64_t positions, Purpose purpose,
                                       double* out) {
  const int64_t total = rows * positions;
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x)
    out[n] = draw_uniform(key, n / positions, n % positions, purpose);
}

}  // namespace cuda
}  // namespace fsd
