// Pass 2: the divergence terms (optionally bucketed) and the residual mass over a range of ids: the
// plain path of streaming.cuh for the default configuration, a general per-id path for filters,
// one-hot rows and top-k buckets.
#pragma once

#include "fsd/cuda/block_stats.cuh"
#include "fsd/cuda/radix_select.cuh"

namespace fsd {
namespace cuda {

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
  double rank = 0.0;  // the rank criterion: target logits above the drafted id's (accept.cuh)
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
    out.rank = a.rank + b.rank;
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

}  // namespace cuda
}  // namespace fsd
