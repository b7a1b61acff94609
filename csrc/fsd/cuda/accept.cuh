// fsd_ext.accept on CUDA: one verification step straight from the logits in at most two launches.
//
// Grid: B * (K+1) * splits blocks (flattened: chunk fastest, then position, then row), kThreads
// each. The vocabulary of a (row, position) is cut into `splits` chunks (never with filters or
// div_top_k): many when the batch alone would leave SMs idle, else chunks of at most 16384 ids
// (the planner in accept.cu says why).
//
//   statistics, per (row, position, chunk): online-softmax statistics of the target and draft chunk
//       (max, lowest argmax, sums of exponentials at the sampling and divergence temperatures,
//       NaN / finite flags); with filters, the cutoffs, kept sums and the div_top_k threshold.
//   decision, per (row, position, chunk): the full-row distributions from the chunk statistics,
//       then one pass over the chunk for the divergence terms and the residual mass (skipped
//       where the coin already accepts the draft under sd or fsd and the caller does not read the
//       divergences: rules.h, coin_acceptance_settles; on the split path, under sd, also after an
//       earlier position whose coin rejects: coin_rejection_settles); where the position's token
//       would be drawn from p (the bonus position, FSD-strict's corrections), the chunk's sum of
//       p's weights as the draw's scan adds them (so the draw is that of its float weights summed
//       exactly). The last block of a row to finish (atomic counter) sums the chunk results, runs
//       the acceptance scan (rules.h) and draws the one correction / bonus token by inverse CDF:
//       chunk totals first, then a block scan inside the chosen chunk.
//
// splits == 1 (filters, a one-chunk vocabulary, greedy without divergences): one launch,
// accept_stats_kernel<..., kFused=true> does both phases per block, pass 2 backwards right after
// pass 1 (L2 reuse); the launcher zeroes the row counters with a memset first. splits > 1:
// accept_stats_kernel then accept_decide_kernel.
// Clusters (opt-in, LaunchOptions::cluster, sm_90+, no filters): one launch of
// accept_cluster_kernel, a thread-block cluster per (row, position), one chunk per block; a
// cluster barrier between the two phases replaces the second launch, and pass 2 re-reads its chunk
// right after pass 1, while it is in L2.
//
// Nothing the size of the vocabulary is written: the workspace holds O(B * K * splits) records.
// Invalid rows (NaN / no finite logit in a used row, num_draft outside [0, K], a draft id outside
// [0, V_d), a per-row threshold or temperature out of range) get tokens -1, num_accepted 0, valid
// false, divergences NaN.
#pragma once

#include <cooperative_groups.h>

#include "fsd/cuda/device.cuh"
#include "fsd/cuda/trace.cuh"
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
  Dist pd, qd;  // the distributions the divergence compares (a rule's statistic reads them)
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
  bool reverse_decide = false;     // split path: accept_decide_kernel's items in reverse order
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
  // A row whose values are out of range comes out invalid (finish_row); until then, plain values
  // keep its statistics finite.
  if (!pb.row_values_in_range(b)) return RowTemps{1.0f, 1.0f, false};
  const float tau = pb.temperature.at(b);
  t.greedy = tau == 0.0f;
  const bool div_own = pb.need_divergence && !pb.div_uses_sampling;
  t.inv_d = div_own ? inverse_temperature(pb.div_temperature.at(b)) : 1.0f;
  t.inv_s = t.greedy ? t.inv_d : inverse_temperature(tau);
  if (!div_own) t.inv_d = t.inv_s;
  return t;
}

// ---------------------------------------------------------------------------------------------
// Kernel 1.

// Statistics (and, with filters, cutoffs and div_top_k thresholds) of one (row, position, chunk).
template <typename T, bool kFiltered>
__device__ __forceinline__ void position_stats(const AcceptProblem& pb, const AcceptWorkspace& ws, int64_t c,
                                               int64_t i, int64_t b, int64_t nd) {
  const int64_t positions = pb.max_draft + 1, splits = ws.splits;
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
  FSD_TRACE(pb, kTraceStatsTarget);
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
  FSD_TRACE(pb, kTraceStatsEnd);
}

// ---------------------------------------------------------------------------------------------
// Kernel 2.

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

// What the acceptance decision of position i reads besides the distributions: the draft id and
// the target and draft logits there (token -1 outside the draft vocabulary: the row is invalid).
struct DraftLogits {
  int64_t token;
  float target, draft;
};
template <typename T>
__device__ __forceinline__ DraftLogits draft_logits_of(const AcceptProblem& pb, int64_t b, int64_t i) {
  const int64_t token = draft_token(pb, b, i);
  if (token < 0 || token >= pb.draft_vocab) return DraftLogits{-1, 0.0f, 0.0f};
  return DraftLogits{token, load_logit(target_row<T>(pb, b, i) + token), load_logit(draft_row<T>(pb, b, i) + token)};
}

// The acceptance decision of draft position i of row b (rules.h) from its sampling distributions p,
// q, the target's argmax, the divergence and draft_logits_of(i) (inside the draft vocabulary).
// finish_row and decide_position (a coin that settles a position before pass 2) share it, so they
// always agree.
__device__ __forceinline__ bool position_accepts(const AcceptProblem& pb, int64_t b, int64_t i, const Dist& p,
                                                 const Dist& q, int32_t argmax_t, float divergence,
                                                 const DraftLogits& drafted) {
  const double p_token = exp(p.log_prob_precise(drafted.target, drafted.token));
  const double q_token = exp(q.log_prob_precise(drafted.draft, drafted.token));
  const double coin = draw_uniform(pb.key, b, i, Purpose::Accept);
  return accept_draft(pb.rule, divergence, pb.threshold.at(b), coin, p_token, q_token, drafted.token == argmax_t);
}

// s_i of rules.h at draft position i of row b from its records: the pass-2 sum (D, H or TV, nats),
// the rank count, and the position's distributions, coin and draft_logits_of(i). The divergence
// criterion's s_i is the sum itself.
__device__ __forceinline__ float position_statistic(const AcceptProblem& pb, int64_t b, int64_t i, const PositionInfo& info,
                                                    double sum, double rank, const DraftLogits& drafted) {
  const Criterion criterion = rule_traits(pb.rule).criterion;
  if (criterion == Criterion::None || criterion == Criterion::Divergence) return (float)sum;
  const StatisticInputs in{sum,
                           info.pd.log_prob_precise(drafted.target, drafted.token),
                           info.pd.log_max_prob(),
                           info.qd.log_max_prob(),
                           rank,
                           draw_uniform(pb.key, b, i, Purpose::Accept),
                           exp(info.p.log_prob_precise(drafted.target, drafted.token)),
                           exp(info.q.log_prob_precise(drafted.draft, drafted.token))};
  return (float)rule_statistic(pb.rule, in);
}

// The filter records of a (row, position) slot, target then draft; nullptr where there are none
// (no filter, or the split path: the planner never splits a filtered call).
__device__ __forceinline__ const FilterInfo* slot_filters(const AcceptWorkspace& ws, int64_t slot) {
  return ws.splits == 1 && ws.filters != nullptr ? ws.filters + slot : nullptr;
}

// Position j of row b from its chunk records (warp-collective, the results on lane 0): the target
// and draft statistics and the sampling distributions p and q (q one-hot at the bonus position
// j == nd, which has no draft row).
struct PositionView {
  FullStat st_t, st_d;
  Dist p, q;
};
__device__ __forceinline__ PositionView warp_view_position(const AcceptProblem& pb, const AcceptWorkspace& ws, int64_t b,
                                                           int64_t j, int64_t nd, const RowTemps& temps) {
  const int64_t slot = (b * (pb.max_draft + 1) + j) * 2;
  const FilterInfo* filters = slot_filters(ws, slot);
  PositionView v;
  warp_combine_position(ws.chunk_stats + slot * ws.splits, ws.splits, j < nd, temps.inv_s, temps.inv_d, v.st_t, v.st_d);
  if ((threadIdx.x & 31) == 0) {
    v.p = sampling_dist(v.st_t, temps, filters);
    v.q = j < nd ? sampling_dist(v.st_d, temps, filters ? filters + 1 : nullptr) : one_hot_dist(0.0f, 0);
  }
  return v;
}

// Whether the coin of drafted position j of row b rejects it (or j makes the row invalid), decided
// from the same records, distributions and coin as finish_row decides it, before pass 2: where
// coin_rejection_settles, the row's acceptance scan then stops at j or earlier. Warp-collective,
// the result on lane 0 (false on the others).
template <typename T>
__device__ __forceinline__ bool warp_coin_rejects(const AcceptProblem& pb, const AcceptWorkspace& ws, int64_t b, int64_t j,
                                                  int64_t nd, const RowTemps& temps) {
  DraftLogits drafted{-1, 0.0f, 0.0f};
  if ((threadIdx.x & 31) == 0) drafted = draft_logits_of<T>(pb, b, j);  // in flight during the combine
  const PositionView v = warp_view_position(pb, ws, b, j, nd, temps);
  if ((threadIdx.x & 31) != 0) return false;
  const bool good = stat_good(v.st_t.flags) && stat_good(v.st_d.flags) && drafted.token >= 0;
  return !good || !position_accepts(pb, b, j, v.p, v.q, v.st_t.argmax, __int_as_float(0x7FC00000), drafted);
}

// Whether the token drawn at position i (when the acceptance scan stops there) comes from p itself:
// the bonus position, and FSD-strict's corrections (rules.h); greedy rows take p's argmax.
__device__ __forceinline__ bool draws_from_p(Rule rule, int64_t i, int64_t nd, bool greedy) {
  return !greedy && (i < nd ? correction_emit(rule) : bonus_emit(rule)) == Emit::TargetSample;
}

// The pass-2 record of a chunk whose position skipped pass 2: D_i reads NaN.
__device__ __forceinline__ PassTwo skipped_pass_two() {
  const double nan = __longlong_as_double(0x7FF8000000000000LL);
  return PassTwo{nan, nan, nan, nan, nan};
}

enum SampleMode : int32_t { kModeDone = 0, kModeTarget = 1, kModeResidual = 2 };

struct FinalShared {
  ScanShared scan;
  int64_t at;
  int64_t chunk;       // the chunk the sample lies in (-1: rounding ran past the end)
  int64_t last_chunk;  // the last chunk with positive weight
  double within;       // where u * total falls inside `chunk`: the amount of the scan's own sums below
                       // it (own_sums), else its share of the chunk's total in step 4's sums
  bool own_sums;       // step 4's chunk totals are the scan's own sums (pass 2's block_weight_total)
  int32_t mode;         // after the acceptance scan: done, or what to sample
  int32_t sample_mode;  // after step 4: mode, or p when the residual has no mass (a separate
                        // field: other warps may still be reading mode while warp 0 decides)
};

// The last block of row b: validity, divergences, the acceptance scan, the correction / bonus token.
// Serial parts run on thread 0, sums over chunks on warp 0, the inverse-CDF scan on the block.
template <typename T>
__device__ void finish_row(const AcceptProblem& pb, const AcceptWorkspace& ws, int64_t b, FinalShared& sh) {
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t nd = row_num_draft(pb, b);
  const bool bucketed = pb.div_top_k > 0 && pb.div_top_k < pb.target_vocab;
  const float kNaN = __int_as_float(0x7FC00000);
  int64_t* tokens = pb.tokens + b * positions;
  const PositionInfo* infos = ws.positions + b * positions;
  const PassTwo* row_pass_two = ws.pass_two + b * positions * splits;

  // 1. Validity: one thread per position checks its flags and draft id. The thread keeps the draft
  //    id and the logits there of its first position (i = threadIdx.x): step 3 decides that
  //    position, and the loads are then behind it (two dependent ones, on a small batch's critical
  //    path).
  const bool nd_ok = nd >= 0 && nd <= k;
  bool position_ok = true;
  DraftLogits own_drafted{-1, 0.0f, 0.0f};
  for (int64_t i = threadIdx.x; nd_ok && i <= nd; i += blockDim.x) {
    const PositionInfo info = load_coherent(infos + i);
    position_ok = position_ok && stat_good(info.flags_t) && (i == nd || stat_good(info.flags_d));
    if (i < nd) {
      const DraftLogits drafted = draft_logits_of<T>(pb, b, i);
      position_ok = position_ok && drafted.token >= 0;  // inside the draft vocabulary
      if (i == threadIdx.x) own_drafted = drafted;
    }
  }
  const bool valid = __syncthreads_and(nd_ok && position_ok && pb.row_values_in_range(b)) != 0;
  for (int64_t i = threadIdx.x; i <= k; i += blockDim.x) tokens[i] = -1;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
    if (!valid || i >= nd || !pb.need_divergence) pb.divergences[b * k + i] = kNaN;
  if (threadIdx.x == 0) {
    pb.valid[b] = valid;
    pb.num_accepted[b] = 0;
    sh.mode = kModeDone;
  }
  __syncthreads();
  FSD_TRACE(pb, kTraceFinishValid);
  if (!valid) return;

  // 2. Divergences of the used positions: one warp per position sums its chunk records.
  if (pb.need_divergence) {
    const int64_t warps = blockDim.x / 32;
    for (int64_t i = threadIdx.x / 32; i < nd; i += warps) {
      const PassTwo* parts = row_pass_two + i * splits;
      PassTwo sums;
      sums.div = warp_sum_chunks(splits, [&](int64_t c) { return __ldcg(&parts[c].div); });
      if (bucketed) {
        sums.rest_p = warp_sum_chunks(splits, [&](int64_t c) { return __ldcg(&parts[c].rest_p); });
        sums.rest_q = warp_sum_chunks(splits, [&](int64_t c) { return __ldcg(&parts[c].rest_q); });
      }
      if (rule_traits(pb.rule).criterion == Criterion::Rank)
        sums.rank = warp_sum_chunks(splits, [&](int64_t c) { return __ldcg(&parts[c].rank); });
      if ((threadIdx.x & 31) == 0) {  // (NaN: pass 2 was skipped, a coin accepts the position)
        const DraftLogits drafted = i == threadIdx.x ? own_drafted : draft_logits_of<T>(pb, b, i);
        pb.divergences[b * k + i] =
            sums.div == sums.div ? position_statistic(pb, b, i, load_coherent(infos + i),
                                                      finish_pass_two(pb.divergence, sums, bucketed), sums.rank, drafted)
                                 : kNaN;
      }
    }
  }
  __syncthreads();
  FSD_TRACE(pb, kTraceFinishDiv);

  // 3. Acceptance scan: every used position's decision in parallel (one thread each; the coins
  //    are counter-based, so deciding speculatively changes nothing), then the first rejection.
  int64_t accepted = nd;
  for (int64_t first = 0; first < nd; first += blockDim.x) {
    const int64_t i = first + threadIdx.x;
    int64_t rejected = INT64_MAX;
    if (i < nd) {
      const PositionInfo info = load_coherent(infos + i);
      const float divergence = pb.divergences[b * k + i];
      const DraftLogits drafted = first == 0 ? own_drafted : draft_logits_of<T>(pb, b, i);
      if (!position_accepts(pb, b, i, info.p, info.q, info.argmax_t, divergence, drafted)) rejected = i;
    }
    const int64_t first_rejected = cub::BlockReduce<int64_t, kThreads>(sh.scan.reduce).Reduce(rejected, MinOp());
    if (threadIdx.x == 0) sh.at = first_rejected;
    __syncthreads();
    const int64_t found = sh.at;
    __syncthreads();
    if (found != INT64_MAX) {
      accepted = found;
      break;
    }
  }
  for (int64_t i = threadIdx.x; i < accepted; i += blockDim.x)
    tokens[i] = i == threadIdx.x ? own_drafted.token : draft_token(pb, b, i);
  if (threadIdx.x == 0) {
    pb.num_accepted[b] = accepted;
    sh.at = accepted;
    const PositionInfo info = load_coherent(infos + accepted);
    const Emit emit = accepted < nd ? correction_emit(pb.rule) : bonus_emit(pb.rule);
    if (emit == Emit::TargetArgmax || info.p.one_hot >= 0) {
      tokens[accepted] = emit == Emit::TargetArgmax ? info.argmax_t : info.p.one_hot;
      sh.mode = kModeDone;
    } else {
      sh.mode = emit == Emit::Residual ? kModeResidual : kModeTarget;
    }
  }
  __syncthreads();
  FSD_TRACE(pb, kTraceFinishScan);
  if (sh.mode == kModeDone) return;
  const int64_t at = sh.at;
  const PositionInfo info = load_coherent(infos + at);

  // 4. Chunk totals of the weights (warp 0): residual max(0, p - q), or exp(s) for p; the chunk
  //    holding u * total. Pass 2 summed them per chunk (draw_mass), p's weights exactly as step
  //    5's scan adds them, so the draw lands where an exact sum of the same float weights puts it
  //    (as does the CPU kernel's: it sums in double lanes) and step 5 needs
  //    no second pass for the chunk's own total. (The statistics pass's online sums, rescaled per
  //    chunk, are ~1e-7 relative off those weights: that moved about V * 1e-8 of the draws.)
  if (threadIdx.x < 32) {
    const PassTwo* parts = row_pass_two + at * splits;
    int32_t mode = sh.mode;
    const bool p_summed = mode == kModeTarget;  // draws_from_p: pass 2 summed p's weights
    if (mode == kModeResidual) {
      const double mass = warp_sum_chunks(splits, [&](int64_t c) { return __ldcg(&parts[c].draw_mass); });
      if (!(mass > kResidualMassEps)) mode = kModeTarget;  // p == q up to rounding: sample p
    }
    const RowStat* chunks = ws.chunk_stats + ((b * positions + at) * 2) * splits;
    auto chunk_total = [&](int64_t c) -> double {
      if (mode == kModeResidual) return __ldcg(&parts[c].draw_mass);
      if (splits == 1) return info.p.sum;  // one chunk: its total only scales u (the scan measures own sums)
      if (p_summed) return __ldcg(&parts[c].draw_mass);
      // p where the residual has no mass (rare): the statistics pass's sums.
      const RowStat s = load_coherent(chunks + c);
      if (s.max == -kInf) return 0.0;
      return (double)s.sum_s * (s.max == info.p.max ? 1.0 : (double)expf((s.max - info.p.max) * info.p.inv));
    };
    const double total = warp_sum_chunks(splits, chunk_total);
    const double u = draw_uniform(pb.key, b, at, Purpose::Sample);
    const double target = u * total;
    const ChunkChoice choice = warp_choose_chunk(splits, target, chunk_total);
    if (threadIdx.x == 0) {
      sh.sample_mode = mode;
      sh.chunk = choice.chunk;
      sh.last_chunk = choice.last_chunk;
      sh.own_sums = p_summed && splits > 1;
      sh.within = sh.own_sums ? target - choice.base : choice.mass > 0.0 ? (target - choice.base) / choice.mass : 0.0;
    }
  }
  __syncthreads();
  FSD_TRACE(pb, kTraceFinishChunk);

  // 5. Inverse CDF inside the chosen chunk (block scan over tiles).
  const int32_t mode = sh.sample_mode;
  const T* target = target_row<T>(pb, b, at);
  const T* draft = draft_row<T>(pb, b, at);
  const int64_t draft_vocab = at < nd ? pb.draft_vocab : 0;
  auto weight = [&](int64_t j) -> float {
    const float zt = load_logit(target + j);
    if (mode == kModeTarget) return sampling_weight(info.p, zt);
    const float pp = prob(info.p, zt, j);
    const float qq = j < draft_vocab ? prob(info.q, load_logit(draft + j), j) : 0.0f;
    return pp > qq ? pp - qq : 0.0f;
  };
  const int64_t chosen = sh.chunk, last_chunk = sh.last_chunk;
  int64_t last_positive = -1, token = -1;
  if (chosen >= 0) {
    // Totals from other sums (the residual's, or p's from the statistics): the same share of the
    // chunk's mass, measured in the weights the scan adds up (their own total, block_weight_total).
    const int64_t begin = chosen * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
    const double within = sh.own_sums ? sh.within : sh.within * block_weight_total(begin, end, weight, sh.scan);
    token = block_inverse_cdf(begin, end, 0.0, within, weight, sh.scan, last_positive);
    if (token < 0) token = last_positive;
  }
  if (token < 0) {  // u * total rounded past the end: the last positive-weight id
    const int64_t begin = last_chunk * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
    block_inverse_cdf(begin, end, 0.0, (double)kInf, weight, sh.scan, last_positive);
    token = last_positive >= 0 ? last_positive : info.argmax_t;
  }
  if (threadIdx.x == 0) tokens[at] = token;
}

struct DecideShared {
  Dist dists[4];  // p, q, pd, qd
  TopBuckets top;
  float rank_pivot;  // the rank criterion: the target logit of the drafted id
  int32_t good;
  bool accepted_early;  // this position is accepted whatever pass 2 finds, so pass 2 is skipped
  bool last_block;
  union {
    typename cub::BlockReduce<PassTwo, kThreads>::TempStorage reduce;
    FinalShared final_shared;
  } temp;
};

// Whether, when decide_position runs, the chunk records of the row's other positions are complete
// (the split path's second kernel) or may still be in flight (the one-launch paths).
enum class OtherPositions : bool { InFlight, Done };

// Pass 2 of one (row, position, chunk) and, in the last block of the row to get there, the row's
// finish. Every block of the grid calls it exactly once (the counter counts them all). Pass 2 reads
// the chunk through `target` / `draft`, the logit rows (indexed by vocabulary id).
template <typename T>
__device__ __forceinline__ void decide_position(const AcceptProblem& pb, const AcceptWorkspace& ws, int64_t c,
                                                int64_t i, int64_t b, bool reverse, OtherPositions others,
                                                const T* target, const T* draft, DecideShared& sh) {
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t nd = row_num_draft(pb, b);
  const RowTemps temps = row_temps(pb, b);
  FSD_TRACE(pb, kTraceDecideBegin);
  if (nd >= 0 && nd <= k && i <= nd) {
    // Under sd a coin's rejection is settled before pass 2, so a position after a rejected one is
    // never accepted nor sampled from: its blocks skip pass 2 (with random drafts, most blocks of
    // the positions after the first). Only where the earlier positions' records are complete;
    // greedy rows have no pass 2 to skip.
    const bool check_earlier = others == OtherPositions::Done && i > 0 && !temps.greedy &&
                               coin_rejection_settles(pb.rule, pb.caller_reads_divergences());
    bool earlier_rejected = false;
    if (threadIdx.x < 32) {  // warp 0 combines the chunk records of this position
      const int64_t slot = (b * positions + i) * 2;
      // The coin's inputs first: these loads (the draft id, then the logits there) overlap the
      // combine's instead of following it on this block's critical path.
      const bool coin_first = coin_acceptance_settles(pb.rule, pb.caller_reads_divergences()) && i < nd;
      const bool ranks = rule_traits(pb.rule).criterion == Criterion::Rank && i < nd;
      DraftLogits drafted{-1, 0.0f, 0.0f};
      if (threadIdx.x == 0 && (coin_first || ranks)) drafted = draft_logits_of<T>(pb, b, i);
      const PositionView view = warp_view_position(pb, ws, b, i, nd, temps);
      if (threadIdx.x == 0) {
        const FilterInfo* filters = slot_filters(ws, slot);
        const FullStat &st_t = view.st_t, &st_d = view.st_d;
        const Dist p = view.p, q = view.q;
        sh.dists[0] = p;
        sh.dists[1] = q;
        sh.dists[2] = divergence_dist(st_t, temps, p, pb.div_uses_sampling);
        sh.dists[3] = divergence_dist(st_d, temps, q, pb.div_uses_sampling);
        sh.good = stat_good(st_t.flags) && (i == nd || stat_good(st_d.flags));
        TopBuckets t = no_buckets();
        if (filters && filters->top_on) {  // the target's record holds div_top_k's threshold
          t.on = true;
          t.key = filters->top_key;
          t.tie_last = filters->tie_last;
        }
        sh.top = t;
        sh.rank_pivot = drafted.target;
        if (c == 0)
          ws.positions[b * positions + i] =
              PositionInfo{p, q, sh.dists[2], sh.dists[3], st_t.flags, st_d.flags, st_t.argmax, 0};
        // A position whose coin accepts the draft is accepted whatever pass 2 finds (sd, and fsd
        // without returned divergences: rules.h), and its residual is never sampled: pass 2 is
        // skipped. finish_row then sees D_i = NaN and flips the same coin.
        const bool accepted_early = coin_first && sh.good && drafted.token >= 0 &&
                                    position_accepts(pb, b, i, p, q, st_t.argmax, __int_as_float(0x7FC00000), drafted);
        sh.accepted_early = accepted_early;
        if (accepted_early && pb.need_divergence)  // D_i not computed: finish_row writes NaN
          ws.pass_two[(b * positions + i) * splits + c] = skipped_pass_two();
      }
    } else if (check_earlier) {  // warps 1.. decide the earlier positions, as finish_row will
      for (int64_t j = threadIdx.x / 32 - 1; j < i; j += kThreads / 32 - 1)
        earlier_rejected = warp_coin_rejects<T>(pb, ws, b, j, nd, temps) || earlier_rejected;
    }
    const bool after_rejection = __syncthreads_and(!earlier_rejected) == 0;
    FSD_TRACE(pb, kTraceDists);
    if (after_rejection && threadIdx.x == 0)  // nothing reads the record; NaN rather than stale
      ws.pass_two[(b * positions + i) * splits + c] = skipped_pass_two();
    const bool need_residual = correction_emit(pb.rule) == Emit::Residual && !temps.greedy;
    const bool used = sh.good && !sh.accepted_early && !after_rejection;
    const bool run_pass_two = used && i < nd && (pb.need_divergence || need_residual);
    // Where the draw at i would come from p and the vocabulary is split, the chunk's total of p's
    // weights for finish_row's chunk choice (its step 4 says why). The bonus position's blocks have
    // no other pass 2; on a batch too large to keep the rows in L2 this reads 1 more of 2K + 1 rows.
    const bool sum_p = used && splits > 1 && draws_from_p(pb.rule, i, nd, temps.greedy);
    if (run_pass_two || sum_p) {
      const int64_t begin = c * ws.chunk, end = min(pb.target_vocab, begin + ws.chunk);
      const Dist p = sh.dists[0], q = sh.dists[1], pd = sh.dists[2], qd = sh.dists[3];
      PassTwo sums;
      if (run_pass_two) {
        PassTwo acc;
        const TopBuckets tb = sh.top;
        with_divergence(pb.divergence, [&](auto tag) {
          pass_two<decltype(tag)::value>(target, draft, begin, end, pb.draft_vocab, pd, qd, p, q,
                                         pb.need_divergence, need_residual, tb, reverse, acc);
        });
        sums = cub::BlockReduce<PassTwo, kThreads>(sh.temp.reduce).Reduce(acc, PassTwoSum());
        if (tb.on && pb.need_divergence)
          exact_tiny_rests(target, draft, begin, end, pb.draft_vocab, pd, qd, tb, sums);
        if (rule_traits(pb.rule).criterion == Criterion::Rank) {  // the chunk's ids above d's logit
          __syncthreads();  // the scan's storage overlays the reduction's
          const float pivot = sh.rank_pivot;
          sums.rank = block_weight_total(
              begin, end, [&](int64_t j) { return load_logit(target + j) > pivot ? 1.0f : 0.0f; },
              sh.temp.final_shared.scan);
        }
        FSD_TRACE(pb, kTracePassTwo);
      }
      if (sum_p) {  // (need_residual is false here: draw_mass was free)
        if (run_pass_two) __syncthreads();  // the scan's storage overlays the reduction's
        sums.draw_mass = block_weight_total(
            begin, end, [&](int64_t j) { return sampling_weight(p, load_logit(target + j)); }, sh.temp.final_shared.scan);
      }
      if (threadIdx.x == 0) ws.pass_two[(b * positions + i) * splits + c] = sums;
    }
  }
  // The last block of row b to get here finishes the row.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(ws.counters + b, 1u);
    sh.last_block = done == (uint32_t)(splits * positions - 1);
  }
  __syncthreads();
  FSD_TRACE(pb, kTraceCounted);
  if (!sh.last_block) return;
  __threadfence();
  finish_row<T>(pb, ws, b, sh.temp.final_shared);
  FSD_TRACE(pb, kTraceFinishEnd);
}

// Programmatic dependent launch (sm_90+, opt-in: LaunchOptions::dependent_launch, see accept.cu).
// The split path's decision kernel may then be launched once every statistics block has started, so its
// blocks are resident when the statistics grid ends instead of a launch latency later; it waits for
// the whole statistics grid (its memory included) before reading anything. Without such a launch
// both instructions do nothing.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Split path (splits > 1), second launch. With ws.reverse_decide (opt-in) block 0 takes the last
// (row, position, chunk) item: blocks start roughly in index order, and the statistics kernel read
// the batch's last rows last, so the first pass-2 re-reads are of the chunks likeliest still in L2
// (at B=64, K=5, V=128256 bf16 the logits are 180 MB and the H200's L2 50 MB; in forward order the
// first re-reads miss and evict that tail before it is reached).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) accept_decide_kernel(const AcceptProblem pb, const AcceptWorkspace ws) {
  wait_for_primary_grid();  // first: everything below reads the statistics kernel's results
  const int64_t positions = pb.max_draft + 1, splits = ws.splits;
  const int64_t item = ws.reverse_decide ? (int64_t)gridDim.x - 1 - (int64_t)blockIdx.x : (int64_t)blockIdx.x;
  const int64_t c = item % splits, i = (item / splits) % positions, b = item / (splits * positions);
  __shared__ DecideShared sh;
  decide_position<T>(pb, ws, c, i, b, false, OtherPositions::Done, target_row<T>(pb, b, i), draft_row<T>(pb, b, i),
                     sh);
}

// First launch: statistics per (row, position, chunk); with splits == 1 also everything else.
template <typename T, bool kFiltered, bool kFused>
__global__ void __launch_bounds__(kThreads, kFused ? 2 : 4) accept_stats_kernel(const AcceptProblem pb, const AcceptWorkspace ws) {
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t c = blockIdx.x % splits, i = (blockIdx.x / splits) % positions, b = blockIdx.x / (splits * positions);
  if constexpr (!kFused) allow_dependent_launch();  // (it changes nothing about what kernel 2 sees)
  // Split path: kernel 2 counts finished blocks from 0 (fused path: the launcher zeroes them).
  if (!kFused && c == 0 && i == 0 && threadIdx.x == 0) ws.counters[b] = 0;
  FSD_TRACE(pb, kTraceStatsBegin);
  const int64_t nd = row_num_draft(pb, b);
  if (nd >= 0 && nd <= k && i <= nd) position_stats<T, kFiltered>(pb, ws, c, i, b, nd);
  if constexpr (kFused) {
    // splits == 1: this block holds the whole row; pass 2 right away, backwards, so the ids read
    // last in pass 1 are still in L2.
    __shared__ DecideShared sh;
    __syncthreads();
    decide_position<T>(pb, ws, c, i, b, true, OtherPositions::InFlight, target_row<T>(pb, b, i), draft_row<T>(pb, b, i),
                       sh);
  }
}

// Cluster path (sm_90 and newer, no filters; opt-in, see accept.cu): a thread-block cluster of
// `splits` blocks per (row, position), one vocabulary chunk each. The cluster barrier between the
// phases publishes every chunk's statistics to the whole position (one launch instead of two).
// Pass 2 then re-reads the chunk right after pass 1 (backwards: what was read last is the likeliest
// to be in L1 / L2).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) accept_cluster_kernel(const AcceptProblem pb, const AcceptWorkspace ws) {
#if FSD_CLUSTER_KERNELS
  const int64_t k = pb.max_draft, positions = k + 1, splits = ws.splits;
  const int64_t c = blockIdx.x % splits, i = (blockIdx.x / splits) % positions, b = blockIdx.x / (splits * positions);
  const int64_t nd = row_num_draft(pb, b);
  FSD_TRACE(pb, kTraceStatsBegin);
  __shared__ DecideShared sh;
  if (nd >= 0 && nd <= k && i <= nd) position_stats<T, false>(pb, ws, c, i, b, nd);
  // Release / acquire at cluster scope: after it every chunk record of this position is visible
  // to the L2 loads in decide_position.
  cooperative_groups::this_cluster().sync();
  decide_position<T>(pb, ws, c, i, b, true, OtherPositions::InFlight, target_row<T>(pb, b, i), draft_row<T>(pb, b, i),
                     sh);
#endif
}

}  // namespace cuda
}  // namespace fsd
