// fsd_ext.accept on CUDA: one verification step straight from the logits in two launches.
//
// The vocabulary of every (row, position) is cut into `splits` chunks (more than one only when the
// batch alone would not fill the GPU, and never with filters or div_top_k). Grid of both kernels:
// B * (K+1) * splits blocks (flattened: chunk fastest, then position, then row), kThreads each.
//
//   accept_stats_kernel:  per (row, position, chunk): online-softmax statistics of the target and
//       draft chunk (max, lowest argmax, sums of exponentials at the sampling and divergence
//       temperatures, NaN / finite flags). With filters (splits == 1): the filter cutoffs and the
//       kept sums, and the div_top_k ranking threshold.
//   accept_decide_kernel: per (row, position, chunk): the full-row distributions from the chunk
//       statistics, then one pass over the chunk for the divergence terms and the residual mass.
//       The last block of a row to finish (atomic counter) sums the chunk results, runs the
//       acceptance scan (rules.h) and draws the one correction / bonus token by inverse CDF:
//       chunk totals first, then a block scan inside the chosen chunk.
//
// Nothing the size of the vocabulary is written: the workspace holds O(B * K * splits) records.
// Invalid rows (NaN / no finite logit in a used row, num_draft outside [0, K], a draft id outside
// [0, V_d)) get tokens -1, num_accepted 0, valid false, divergences NaN.
#pragma once

#include "fsd/cuda/device.cuh"
#include "fsd/philox.h"

namespace fsd {
namespace cuda {

// Filter results of one (row, position, model), splits == 1 only.
struct FilterInfo {
  double sum;        // sum of exp(s) over kept ids
  float cut;         // cutoff in s-space (-inf: none)
  uint32_t top_key;  // div_top_k: ranking key of the k-th id (target only)
  int64_t tie_last;  // div_top_k: last tied id inside the top k
  int32_t top_on;
  int32_t pad;
};

// Per (row, position): the full-row sampling distributions, written by the chunk-0 block.
struct PositionInfo {
  Dist p, q;
  int32_t flags_t, flags_d;
  int32_t argmax_t;
  int32_t pad;
};

struct AcceptWorkspace {
  RowStat* chunk_stats = nullptr;  // [B, K+1, 2, splits]  (model 0 target, 1 draft)
  FilterInfo* filters = nullptr;   // [B, K+1, 2]
  PositionInfo* positions = nullptr;  // [B, K+1]
  PassTwo* pass_two = nullptr;     // [B, K+1, splits]
  uint32_t* counters = nullptr;    // [B]
  int64_t splits = 1;
  int64_t chunk = 0;               // ids per split
};

template <typename T>
__device__ __forceinline__ const T* target_row(const AcceptProblem& pb, int64_t b, int64_t i) {
  return static_cast<const T*>(pb.target_logits) + b * pb.target_stride_b + i * pb.target_stride_k;
}
template <typename T>
__device__ __forceinline__ const T* draft_row(const AcceptProblem& pb, int64_t b, int64_t i) {
  return static_cast<const T*>(pb.draft_logits) + b * pb.draft_stride_b + i * pb.draft_stride_k;
}
__device__ __forceinline__ int64_t row_num_draft(const AcceptProblem& pb, int64_t b) {
  return pb.num_draft ? pb.num_draft[b] : pb.max_draft;
}
__device__ __forceinline__ int64_t draft_token(const AcceptProblem& pb, int64_t b, int64_t i) {
  const int64_t at = b * pb.max_draft + i;
  return pb.tokens_int32 ? (int64_t) static_cast<const int32_t*>(pb.draft_tokens)[at]
                         : static_cast<const int64_t*>(pb.draft_tokens)[at];
}

// The inverse temperatures of row b: sampling (inv_s) and divergence (inv_d). When the divergence
// compares the sampling distributions (or is not needed), or the row is greedy, they share one
// value so the statistics pass computes one exponential per id.
struct RowTemps {
  float inv_s, inv_d;
  bool greedy;
};
__device__ __forceinline__ RowTemps row_temps(const AcceptProblem& pb, int64_t b) {
  RowTemps t;
  const float tau = pb.temperature.at(b);
  t.greedy = tau == 0.0f;
  const bool div_own = pb.need_divergence && !pb.div_uses_sampling;
  t.inv_d = div_own ? inverse_temperature(pb.div_temperature.at(b)) : 1.0f;
  t.inv_s = t.greedy ? t.inv_d : inverse_temperature(tau);
  if (!div_own) t.inv_d = t.inv_s;
  return t;
}

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

// ---------------------------------------------------------------------------------------------
// Kernel 1.

template <typename T, bool kFiltered>
__global__ void __launch_bounds__(kThreads) accept_stats_kernel(const AcceptProblem pb, const AcceptWorkspace ws) {
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t c = blockIdx.x % splits, i = (blockIdx.x / splits) % positions, b = blockIdx.x / (splits * positions);
  if (c == 0 && i == 0 && threadIdx.x == 0) ws.counters[b] = 0;  // kernel 2 counts finished blocks
  const int64_t nd = row_num_draft(pb, b);
  if (nd < 0 || nd > k || i > nd) return;
  const RowTemps temps = row_temps(pb, b);

  __shared__ union {
    typename StatReduce<T>::TempStorage stat;
    typename cub::BlockReduce<double, kThreads>::TempStorage sum;
  } temp;
  __shared__ RowStat stat_out;
  const int64_t begin = c * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
  const T* target = target_row<T>(pb, b, i);
  const T* draft = draft_row<T>(pb, b, i);
  const int64_t slot = (b * positions + i) * 2;
  const RowStat st_t = block_row_stat(target, begin, end, temps.inv_s, temps.inv_d, temp.stat, stat_out);
  if (threadIdx.x == 0) ws.chunk_stats[slot * splits + c] = st_t;
  RowStat st_d = empty_stat();
  if (i < nd) {
    st_d = block_row_stat(draft, begin, min(end, pb.draft_vocab), temps.inv_s, temps.inv_d, temp.stat, stat_out);
    if (threadIdx.x == 0) ws.chunk_stats[(slot + 1) * splits + c] = st_d;
  }
  if constexpr (kFiltered) {
    // splits == 1 here: the statistics cover the whole row.
    __shared__ SelectShared select;
    __shared__ ScanShared scan;
    __shared__ double shared_double;
    FilterInfo info_t{st_t.sum_s, -kInf, 0u, -1, 0, 0};
    FilterInfo info_d{st_d.sum_s, -kInf, 0u, -1, 0, 0};
    const bool filtering = !temps.greedy && pb.filter.active();
    if (filtering && stat_good(st_t.flags)) {
      info_t.cut = block_filter_cutoff(target, pb.target_vocab, st_t.max, temps.inv_s, pb.filter, select, temp.sum,
                                       shared_double);
      info_t.sum = block_kept_sum(target, pb.target_vocab, st_t.max, temps.inv_s, info_t.cut, temp.sum, shared_double);
    }
    if (i < nd && filtering && stat_good(st_d.flags)) {
      info_d.cut = block_filter_cutoff(draft, pb.draft_vocab, st_d.max, temps.inv_s, pb.filter, select, temp.sum,
                                       shared_double);
      info_d.sum = block_kept_sum(draft, pb.draft_vocab, st_d.max, temps.inv_s, info_d.cut, temp.sum, shared_double);
    }
    const int64_t top_k = pb.div_top_k;
    if (pb.need_divergence && i < nd && top_k > 0 && top_k < pb.target_vocab && stat_good(st_t.flags) &&
        stat_good(st_d.flags)) {
      Dist pd;
      if (!pb.div_uses_sampling) pd = softmax_dist(st_t.max, temps.inv_d, -kInf, (double)st_t.sum_d);
      else if (temps.greedy) pd = one_hot_dist(st_t.max, st_t.argmax);
      else pd = softmax_dist(st_t.max, temps.inv_s, info_t.cut, info_t.sum);
      uint32_t greater;
      const uint32_t key = block_select_kth(target, pb.target_vocab, (uint32_t)top_k,
                                            [&](float z, int64_t id) { return rank_key(pd, z, id); }, select, greater);
      const int64_t tie_last = block_nth_tie(pb.target_vocab, key, (uint32_t)top_k - greater, [&](int64_t id) {
        return rank_key(pd, load_logit(target + id), id);
      }, scan);
      info_t.top_key = key;
      info_t.tie_last = tie_last;
      info_t.top_on = 1;
    }
    if (threadIdx.x == 0) {
      ws.filters[slot] = info_t;
      ws.filters[slot + 1] = info_d;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel 2.

// Full-row statistics of (row, position, model) from its chunk records: max, argmax, flags and the
// sums in double.
struct FullStat {
  float max;
  int32_t argmax, flags;
  double sum_s, sum_d;
};

__device__ __forceinline__ FullStat combine_chunks(const RowStat* chunks, int64_t splits, float inv_s, float inv_d) {
  FullStat out{-kInf, INT32_MAX, 0, 0.0, 0.0};
  for (int64_t c = 0; c < splits; ++c) {
    const RowStat s = chunks[c];
    out.flags |= s.flags;
    if (s.max > out.max) out.max = s.max, out.argmax = s.argmax;
  }
  if (out.max == -kInf) return out;
  for (int64_t c = 0; c < splits; ++c) {
    const RowStat s = chunks[c];
    if (s.max == -kInf) continue;
    out.sum_s += (double)s.sum_s * (s.max == out.max ? 1.0 : (double)expf((s.max - out.max) * inv_s));
    out.sum_d += (double)s.sum_d * (s.max == out.max ? 1.0 : (double)expf((s.max - out.max) * inv_d));
  }
  return out;
}

// Sampling distribution (p or q) of one (row, position, model).
__device__ __forceinline__ Dist sampling_dist(const FullStat& s, const RowTemps& t, const FilterInfo* filter) {
  if (t.greedy) return one_hot_dist(s.max, s.argmax);
  return softmax_dist(s.max, t.inv_s, filter ? filter->cut : -kInf, filter ? filter->sum : s.sum_s);
}

// The distribution the divergence compares.
__device__ __forceinline__ Dist divergence_dist(const FullStat& s, const RowTemps& t, const Dist& sampling,
                                                bool uses_sampling) {
  if (uses_sampling) return sampling;
  return softmax_dist(s.max, t.inv_d, -kInf, s.sum_d);
}

enum SampleMode : int32_t { kModeDone = 0, kModeTarget = 1, kModeResidual = 2 };

struct FinalShared {
  ScanShared scan;
  int64_t at;
  int64_t token;
  int64_t chunk;       // the chunk the sample lies in (-1: rounding ran past the end)
  int64_t last_chunk;  // the last chunk with positive weight
  double base, target;
  int32_t mode;
};

template <typename T>
__device__ void finish_row(const AcceptProblem& pb, const AcceptWorkspace& ws, int64_t b, FinalShared& sh) {
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t nd = row_num_draft(pb, b);
  const RowTemps temps = row_temps(pb, b);
  const bool bucketed = pb.div_top_k > 0 && pb.div_top_k < pb.target_vocab;
  int64_t* tokens = pb.tokens + b * positions;
  if (threadIdx.x == 0) {
    for (int64_t i = 0; i <= k; ++i) tokens[i] = -1;
    bool valid = nd >= 0 && nd <= k;
    for (int64_t i = 0; valid && i <= nd; ++i) {
      const PositionInfo info = load_coherent(ws.positions + b * positions + i);
      valid = stat_good(info.flags_t) && (i == nd || stat_good(info.flags_d));
      if (valid && i < nd) {
        const int64_t token = draft_token(pb, b, i);
        valid = token >= 0 && token < pb.draft_vocab;
      }
    }
    sh.mode = kModeDone;
    pb.valid[b] = valid;
    pb.num_accepted[b] = 0;
    if (!valid) {
      for (int64_t i = 0; i < k; ++i) pb.divergences[b * k + i] = __int_as_float(0x7FC00000);
    } else {
      for (int64_t i = 0; i < k; ++i) {
        float div = __int_as_float(0x7FC00000);
        if (pb.need_divergence && i < nd) {
          PassTwo sums;
          for (int64_t c = 0; c < splits; ++c) sums = PassTwoSum()(sums, load_coherent(ws.pass_two + (b * positions + i) * splits + c));
          div = finish_pass_two(pb.divergence, sums, bucketed);
        }
        pb.divergences[b * k + i] = div;
      }
      const float threshold = pb.threshold.at(b);
      int64_t accepted = 0;
      for (; accepted < nd; ++accepted) {
        const int64_t i = accepted, token = draft_token(pb, b, i);
        const PositionInfo info = load_coherent(ws.positions + b * positions + i);
        const double p_token = exp(info.p.log_prob_precise(load_logit(target_row<T>(pb, b, i) + token), token));
        const double q_token = exp(info.q.log_prob_precise(load_logit(draft_row<T>(pb, b, i) + token), token));
        const double coin = draw_uniform(pb.key, b, i, Purpose::Accept);
        const bool is_argmax = token == info.argmax_t;
        if (!accept_draft(pb.rule, pb.divergences[b * k + i], threshold, coin, p_token, q_token, is_argmax)) break;
        tokens[i] = token;
      }
      pb.num_accepted[b] = accepted;
      sh.at = accepted;
      const PositionInfo info = load_coherent(ws.positions + b * positions + accepted);
      const Emit emit = accepted < nd ? correction_emit(pb.rule) : bonus_emit(pb.rule);
      if (emit == Emit::TargetArgmax || info.p.one_hot >= 0) {
        tokens[accepted] = emit == Emit::TargetArgmax ? info.argmax_t : info.p.one_hot;
      } else {
        // Chunk totals of the weights: residual max(0, p - q), or exp(s) for p.
        int32_t mode = kModeTarget;
        const PassTwo* resid = ws.pass_two + (b * positions + accepted) * splits;
        if (emit == Emit::Residual) {
          double mass = 0.0;
          for (int64_t c = 0; c < splits; ++c) mass += load_coherent(resid + c).residual;
          if (mass > kResidualMassEps) mode = kModeResidual;
        }
        const RowStat* chunks = ws.chunk_stats + ((b * positions + accepted) * 2) * splits;
        auto chunk_total = [&](int64_t c) -> double {
          if (mode == kModeResidual) return load_coherent(resid + c).residual;
          if (splits == 1) return info.p.sum;
          const RowStat s = chunks[c];
          if (s.max == -kInf) return 0.0;
          return (double)s.sum_s * (s.max == info.p.max ? 1.0 : (double)expf((s.max - info.p.max) * info.p.inv));
        };
        double total = 0.0;
        for (int64_t c = 0; c < splits; ++c) total += chunk_total(c);
        const double u = draw_uniform(pb.key, b, accepted, Purpose::Sample);
        const double target = u * total;
        double base = 0.0;
        int64_t chosen = -1, last_chunk = 0;
        for (int64_t c = 0; c < splits; ++c) {
          const double w = chunk_total(c);
          if (w > 0.0) last_chunk = c;
          if (chosen < 0) {
            if (base + w > target) chosen = c;
            else base += w;
          }
        }
        sh.mode = mode;
        sh.chunk = chosen;
        sh.last_chunk = last_chunk;
        sh.base = base;
        sh.target = target;
      }
    }
  }
  __syncthreads();
  const int32_t mode = sh.mode;
  if (mode == kModeDone) return;
  const int64_t at = sh.at;
  const PositionInfo info = load_coherent(ws.positions + b * positions + at);
  const T* target = target_row<T>(pb, b, at);
  const T* draft = draft_row<T>(pb, b, at);
  const int64_t draft_vocab = at < nd ? pb.draft_vocab : 0;
  auto weight = [&](int64_t j) -> float {
    const float zt = load_logit(target + j);
    if (mode == kModeTarget) return info.p.weight(zt);
    const float pp = info.p.prob(zt, j);
    const float qq = j < draft_vocab ? info.q.prob(load_logit(draft + j), j) : 0.0f;
    return pp > qq ? pp - qq : 0.0f;
  };
  const int64_t chosen = sh.chunk, last_chunk = sh.last_chunk;
  const double base = sh.base, target_mass = sh.target;
  int64_t last_positive = -1, token = -1;
  if (chosen >= 0) {
    const int64_t begin = chosen * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
    token = block_inverse_cdf(begin, end, base, target_mass, weight, sh.scan, last_positive);
    if (token < 0) token = last_positive;
  }
  if (token < 0) {  // u * total rounded past the end: the last positive-weight id
    const int64_t begin = last_chunk * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
    block_inverse_cdf(begin, end, 0.0, (double)kInf, weight, sh.scan, last_positive);
    token = last_positive >= 0 ? last_positive : info.argmax_t;
  }
  if (threadIdx.x == 0) tokens[at] = token;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) accept_decide_kernel(const AcceptProblem pb, const AcceptWorkspace ws) {
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t c = blockIdx.x % splits, i = (blockIdx.x / splits) % positions, b = blockIdx.x / (splits * positions);
  const int64_t nd = row_num_draft(pb, b);
  const RowTemps temps = row_temps(pb, b);

  __shared__ Dist dists[4];  // p, q, pd, qd
  __shared__ int32_t good;
  __shared__ TopBuckets top;
  __shared__ union {
    typename cub::BlockReduce<PassTwo, kThreads>::TempStorage reduce;
    FinalShared final_shared;
  } temp;
  __shared__ bool last_block;

  if (nd >= 0 && nd <= k && i <= nd) {
    if (threadIdx.x == 0) {
      const int64_t slot = (b * positions + i) * 2;
      const bool filtered = ws.splits == 1 && ws.filters != nullptr;
      const FullStat st_t = combine_chunks(ws.chunk_stats + slot * splits, splits, temps.inv_s, temps.inv_d);
      const Dist p = sampling_dist(st_t, temps, filtered ? ws.filters + slot : nullptr);
      FullStat st_d{-kInf, INT32_MAX, 0, 0.0, 0.0};
      Dist q = one_hot_dist(0.0f, 0);
      if (i < nd) {
        st_d = combine_chunks(ws.chunk_stats + (slot + 1) * splits, splits, temps.inv_s, temps.inv_d);
        q = sampling_dist(st_d, temps, filtered ? ws.filters + slot + 1 : nullptr);
      }
      dists[0] = p;
      dists[1] = q;
      dists[2] = divergence_dist(st_t, temps, p, pb.div_uses_sampling);
      dists[3] = divergence_dist(st_d, temps, q, pb.div_uses_sampling);
      good = stat_good(st_t.flags) && (i == nd || stat_good(st_d.flags));
      TopBuckets t = no_buckets();
      if (filtered && ws.filters[slot].top_on) {
        t.on = true;
        t.key = ws.filters[slot].top_key;
        t.tie_last = ws.filters[slot].tie_last;
      }
      top = t;
      if (c == 0) ws.positions[b * positions + i] = PositionInfo{p, q, st_t.flags, st_d.flags, st_t.argmax, 0};
    }
    __syncthreads();
    const bool need_residual = (pb.rule == Rule::SD || pb.rule == Rule::FSD) && !temps.greedy;
    if (i < nd && good && (pb.need_divergence || need_residual)) {
      const int64_t begin = c * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
      PassTwo acc;
      const Dist p = dists[0], q = dists[1], pd = dists[2], qd = dists[3];
      const TopBuckets tb = top;
      with_divergence(pb.divergence, [&](auto tag) {
        pass_two<decltype(tag)::value>(target_row<T>(pb, b, i), draft_row<T>(pb, b, i), begin, end, pb.draft_vocab,
                                       pd, qd, p, q, pb.need_divergence, need_residual, tb, acc);
      });
      const PassTwo sums = cub::BlockReduce<PassTwo, kThreads>(temp.reduce).Reduce(acc, PassTwoSum());
      if (threadIdx.x == 0) ws.pass_two[(b * positions + i) * splits + c] = sums;
    }
  }
  // The last block of row b to get here finishes the row.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(ws.counters + b, 1u);
    last_block = done == (uint32_t)(splits * positions - 1);
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  finish_row<T>(pb, ws, b, temp.final_shared);
}

}  // namespace cuda
}  // namespace fsd
