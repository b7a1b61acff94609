// One-vocabulary-row primitives of the CPU kernels: statistics, filter cutoffs, divergence sums and
// inverse-CDF sampling, each a single pass (or less) over the logits with no probability array
// materialised. Scratch: a copy of the row for the optional filters, double arrays for div_top_k
// buckets, and the exp(s_j) a sum pass stores for the divergence pass that follows it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "fsd/common.h"
#include "fsd/cpu/vec.h"
#include "fsd/rules.h"

namespace fsd {
namespace cpu {

// A distribution over one vocabulary row, described by the logits plus a few scalars:
//   s_j = (z_j - max) * inv_tau,   log p_j = s_j - log_sum  if s_j >= cut,  else -inf
// or one-hot at `one_hot` (temperature 0).
struct Dist {
  float max = 0.0f;
  float inv_tau = 1.0f;
  float cut = -kInf;      // filter cutoff in s-space; -inf = no filter
  double sum = 1.0;       // sum over kept j of exp(s_j)
  float log_sum = 0.0f;
  int64_t one_hot = -1;   // >= 0: one-hot at this id

  bool plain() const { return one_hot < 0 && cut == -kInf; }
  FSD_ALWAYS_INLINE float scaled(float logit) const { return (logit - max) * inv_tau; }
  // log p_j in double (the decision and the reference comparison want the extra precision).
  double log_prob(float logit, int64_t id) const {
    if (one_hot >= 0) return id == one_hot ? 0.0 : -(double)kInf;
    const float s = scaled(logit);
    return s >= cut ? (double)s - std::log(sum) : -(double)kInf;
  }
};

inline float inverse_temperature(float tau) {
  const float inv = 1.0f / tau;
  return inv < FLT_MAX ? inv : FLT_MAX;  // tiny tau: s stays 0 at the max, -huge elsewhere
}

struct RowScan {
  float max = -kInf;    // the largest logit as load_logit sees it (+inf counts as FLT_MAX)
  int64_t argmax = 0;   // the lowest id holding it
  bool bad = false;     // holds NaN, or no finite logit
};

// One pass: max, argmax (lowest id on ties) and the bad-row check. Each lane keeps the block of its
// first maximum (an int32 block index, so the argmax costs two selects per element and rows up to
// 2^35 ids); the lowest id among the lanes holding the row maximum wins.
template <typename T>
FSD_CPU_CLONES RowScan scan_row(const T* row, int64_t n) {
  float lane_max[kLanes], lane_check[kLanes];
  int32_t lane_block[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -kInf, lane_check[l] = 0.0f, lane_block[l] = 0;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const int32_t block = (int32_t)(j / kLanes);
    FSD_SIMD
    for (int l = 0; l < kLanes; ++l) {
      const float raw = to_float(row[j + l]);
      const float x = raw < FLT_MAX ? raw : (raw == kInf ? FLT_MAX : raw);  // load_logit
      const bool higher = x > lane_max[l];  // false for NaN
      lane_max[l] = higher ? x : lane_max[l];
      lane_block[l] = higher ? block : lane_block[l];
      lane_check[l] += raw - raw;  // NaN from here on iff some logit is NaN or +-inf
    }
  }
  RowScan scan;
  float check = 0.0f;
  for (int l = 0; l < kLanes; ++l) {
    const int64_t id = (int64_t)lane_block[l] * kLanes + l;
    if (lane_max[l] > scan.max || (lane_max[l] == scan.max && id < scan.argmax))
      scan.max = lane_max[l], scan.argmax = id;
    check += lane_check[l];
  }
  for (; j < n; ++j) {  // the tail's ids are above every lane's: strictly higher wins
    const float raw = to_float(row[j]);
    const float x = load_logit(row, j);
    if (x > scan.max) scan.max = x, scan.argmax = j;
    check += raw - raw;
  }
  if (check != check) {  // rare: some non-finite value, classify it
    bool has_nan = false, has_finite = false;
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_float(row[i]);
      has_nan |= x != x;
      has_finite |= std::isfinite(x);
    }
    scan.bad = has_nan || !has_finite;
  }
  return scan;
}

// sum of w(j) over [begin, end), kLanes at a time; `w` must be branch-free to vectorise.
template <typename WeightFn>
FSD_CPU_CLONES double sum_range(int64_t begin, int64_t end, const WeightFn& w) {
  double total = 0.0;
  float lane[kLanes] = {};
  int64_t j = begin, since_flush = 0;
  for (; j + kLanes <= end; j += kLanes) {
    FSD_SIMD
    for (int l = 0; l < kLanes; ++l) lane[l] += w(j + l);
    if ((since_flush += kLanes) >= kFlushEvery) {
      for (int l = 0; l < kLanes; ++l) total += lane[l], lane[l] = 0.0f;
      since_flush = 0;
    }
  }
  for (int l = 0; l < kLanes; ++l) total += lane[l];
  for (; j < end; ++j) total += w(j);
  return total;
}

// Weights over ids [0, n) given by `below(j)` for j < split and `above(j)` for j >= split, so that
// each side is branch-free (e.g. the residual max(0, p - q) needs draft logits only below V_d).
template <typename Below, typename Above>
struct SplitWeight {
  int64_t split;
  Below below;
  Above above;
  float operator()(int64_t j) const { return j < split ? below(j) : above(j); }
  double sum(int64_t begin, int64_t end) const {
    const int64_t mid = std::max(begin, std::min(end, split));
    return sum_range(begin, mid, below) + sum_range(mid, end, above);
  }
};

template <typename Below, typename Above>
SplitWeight<Below, Above> split_weight(int64_t split, Below below, Above above) {
  return {split, below, above};
}

// exp(s_j) over kept ids, unnormalised: the weights of a sample of p (total = d.sum).
template <typename T>
auto kept_exp(const T* row, const Dist& d) {
  return [row, d](int64_t j) FSD_INLINE_LAMBDA {  // d by value: loop-invariant fields, so the loop vectorises
    const float s = d.scaled(load_logit(row, j));
    const float e = exp_nonpositive(s);
    return s >= d.cut ? e : 0.0f;
  };
}

// sum over j with s_j >= cut of exp(s_j). With `exps`, also stores each exp(s_j) (0 below the
// cut) in exps[0, n): the divergence pass that follows then takes p_j from exps[j] instead of
// recomputing two exponentials per id, most of its arithmetic.
template <typename T>
double sum_exp(const T* row, int64_t n, const Dist& d, float* exps = nullptr) {
  if (exps == nullptr) return sum_range(0, n, kept_exp(row, d));
  return sum_range(0, n, [kept = kept_exp(row, d), exps](int64_t j) FSD_INLINE_LAMBDA {
    const float e = kept(j);
    exps[j] = e;
    return e;
  });
}

// The filter cutoff in s-space (see SamplingFilter): top-k, then top-p on the renormalised top-k
// set, then min-p. Uses `scratch` for a copy of the row.
template <typename T>
float filter_cutoff(const T* row, int64_t n, const Dist& d, const SamplingFilter& filter,
                    std::vector<float>& scratch) {
  float cut = -kInf;
  scratch.resize(n);
  for (int64_t j = 0; j < n; ++j) scratch[j] = d.scaled(load_logit(row, j));
  if (filter.top_k > 0 && filter.top_k < n) {
    std::nth_element(scratch.begin(), scratch.begin() + (filter.top_k - 1), scratch.end(), std::greater<float>());
    cut = scratch[filter.top_k - 1];
  }
  if (filter.top_p < 1.0f) {
    auto kept_end = std::partition(scratch.begin(), scratch.end(), [&](float s) { return s >= cut && s > -kInf; });
    std::sort(scratch.begin(), kept_end, std::greater<float>());
    const int64_t kept = kept_end - scratch.begin();
    double total = 0.0;
    for (int64_t i = 0; i < kept; ++i) total += std::exp((double)scratch[i]);
    double cumulative = 0.0;
    int64_t last = 0;
    for (; last < kept - 1; ++last) {
      cumulative += std::exp((double)scratch[last]) / total;
      if (!(cumulative < (double)filter.top_p)) break;
    }
    cut = std::max(cut, scratch[std::max<int64_t>(0, last)]);
  }
  if (filter.min_p > 0.0f) cut = std::max(cut, (float)std::log((double)filter.min_p));
  return cut;
}

// Fills `d` for sampling at temperature `tau` (0 = one-hot at the argmax) under `filter`; `exps`
// (optional, [n]) receives the exponentials, see sum_exp.
template <typename T>
Dist sampling_dist(const T* row, int64_t n, const RowScan& scan, float tau, const SamplingFilter& filter,
                   std::vector<float>& scratch, float* exps = nullptr) {
  Dist d;
  d.max = scan.max;
  if (tau == 0.0f) {
    d.one_hot = scan.argmax;
    return d;
  }
  d.inv_tau = inverse_temperature(tau);
  if (filter.active()) d.cut = filter_cutoff(row, n, d, filter, scratch);
  d.sum = sum_exp(row, n, d, exps);
  d.log_sum = (float)std::log(d.sum);
  return d;
}

// sum_j divergence_term(p_j, q_j) for target row zt [vt] and draft row zd [vd], vd <= vt; ids >= vd
// have q = 0. Any p and q (cutoffs, one-hot); plain ones with stored exponentials take
// divergence_sum_stored instead.
template <Divergence D, typename T>
double divergence_sum(const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd, const Dist& q) {
  const FastLog log_fn;
  auto log_prob = [](const Dist& d, float logit, int64_t id) FSD_INLINE_LAMBDA {
    // Both values computed, then selected: GCC vectorises this form and not `cut ? s - log_sum : ..`.
    const float s = d.scaled(logit), lp = s - d.log_sum;
    const float kept = s >= d.cut ? lp : -kInf;
    const float one_hot = id == d.one_hot ? 0.0f : -kInf;
    return d.one_hot >= 0 ? one_hot : kept;
  };
  auto both = [=](int64_t j) FSD_INLINE_LAMBDA {
    const float lp = log_prob(p, load_logit(zt, j), j), lq = log_prob(q, load_logit(zd, j), j);
    return divergence_term<D>(exp_nonpositive(lp), lp, exp_nonpositive(lq), lq, log_fn);
  };
  auto target_only = [=](int64_t j) FSD_INLINE_LAMBDA {  // ids >= vd: q = 0
    const float lp = log_prob(p, load_logit(zt, j), j);
    return divergence_term<D>(exp_nonpositive(lp), lp, 0.0f, -kInf, log_fn);
  };
  const auto term = split_weight(vd, both, target_only);
  if (p.one_hot >= 0 && q.one_hot >= 0) {  // temperature 0: every other id has p = q = 0, term 0
    const double at_target = term(p.one_hot);
    return q.one_hot == p.one_hot ? at_target : at_target + term(q.one_hot);
  }
  return term.sum(0, vt);
}

// p_j and log p_j of a plain distribution from the stored e_j = exp(s_j) and
// scale = exp(-log_sum). log p_j = s_j - log_sum is rounded to float, and p_j must be exp of that
// rounded value, not e_j * scale: the divergences are stationary under consistent perturbations of
// (p, log p) but not under inconsistent ones (JS would be off by up to ~4e-7 at V = 151936 instead
// of ~4e-8). So the subtraction's rounding error r (exact, Knuth's two-sum) corrects p_j by
// exp(-r) ~ 1 - r. TV uses no logs and skips the correction.
template <bool kUsesLog>
struct ProbFromStored {
  float log_sum, scale;
  FSD_ALWAYS_INLINE void operator()(float s, float e, float& p, float& lp) const {
    const float minus = -log_sum;
    lp = s + minus;
    if (!kUsesLog) {
      p = e * scale;
      return;
    }
    const float s_part = lp - minus, minus_part = lp - s_part;
    const float r = (s - s_part) + (minus - minus_part);  // (s - log_sum) - lp, exactly
    p = e * scale * (1.0f - r);
  }
};

// divergence_sum for plain p and q whose exponentials sum_exp stored in exps_t [vt] and
// exps_d [vd]: no exp is left in this pass (JS and MKL keep one log per id).
template <Divergence D, typename T>
double divergence_sum_stored(const T* zt, const float* exps_t, int64_t vt, const Dist& p, const T* zd,
                             const float* exps_d, int64_t vd, const Dist& q) {
  const FastLog log_fn;
  constexpr bool kUsesLog = D != Divergence::TV;
  const ProbFromStored<kUsesLog> target{p.log_sum, (float)std::exp(-(double)p.log_sum)};
  const ProbFromStored<kUsesLog> draft{q.log_sum, (float)std::exp(-(double)q.log_sum)};
  auto both = [=](int64_t j) FSD_INLINE_LAMBDA {
    float p_j, lp, q_j, lq;
    target(p.scaled(load_logit(zt, j)), exps_t[j], p_j, lp);
    draft(q.scaled(load_logit(zd, j)), exps_d[j], q_j, lq);
    return divergence_term<D>(p_j, lp, q_j, lq, log_fn);
  };
  auto target_only = [=](int64_t j) FSD_INLINE_LAMBDA {  // ids >= vd: q = 0
    float p_j, lp;
    target(p.scaled(load_logit(zt, j)), exps_t[j], p_j, lp);
    return divergence_term<D>(p_j, lp, 0.0f, -kInf, log_fn);
  };
  return split_weight(vd, both, target_only).sum(0, vt);
}

// div_top_k: the divergence over k+1 buckets, the k most probable ids under p (lowest id on ties)
// and one bucket with the rest of the mass, for p and q alike. A slow path with double scratch.
template <Divergence D, typename T>
double divergence_bucketed(const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd, const Dist& q,
                           int64_t k) {
  std::vector<double> lp(vt), lq(vt);
  for (int64_t j = 0; j < vt; ++j) {
    lp[j] = p.log_prob(load_logit(zt, j), j);
    lq[j] = j < vd ? q.log_prob(load_logit(zd, j), j) : -(double)kInf;
  }
  std::vector<int64_t> ids(vt);
  std::iota(ids.begin(), ids.end(), 0);
  auto more_probable = [&](int64_t a, int64_t b) { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); };
  std::nth_element(ids.begin(), ids.begin() + (k - 1), ids.end(), more_probable);
  double rest_p = 0.0, rest_q = 0.0, total = 0.0;
  for (int64_t i = k; i < vt; ++i) rest_p += std::exp(lp[ids[i]]), rest_q += std::exp(lq[ids[i]]);
  const PreciseLog log_fn;
  for (int64_t i = 0; i < k; ++i) {
    const double a = lp[ids[i]], b = lq[ids[i]];
    total += divergence_term<D>(std::exp(a), a, std::exp(b), b, log_fn);
  }
  return total + divergence_term<D>(rest_p, std::log(rest_p), rest_q, std::log(rest_q), log_fn);
}

// D(p || q). `exps_t` / `exps_d` (optional): the exponentials sum_exp stored while computing p.sum
// and q.sum, used when both distributions are plain.
template <typename T>
float divergence(Divergence kind, const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd,
                 const Dist& q, int64_t bucket_top_k, const float* exps_t = nullptr,
                 const float* exps_d = nullptr) {
  const bool bucketed = bucket_top_k > 0 && bucket_top_k < vt;
  const bool general = !p.plain() || !q.plain();
  const bool stored = exps_t != nullptr && exps_d != nullptr;
  auto run = [&](auto tag) -> double {
    constexpr Divergence kKind = decltype(tag)::value;
    if (bucketed) return divergence_bucketed<kKind>(zt, vt, p, zd, vd, q, bucket_top_k);
    if (stored && !general) return divergence_sum_stored<kKind>(zt, exps_t, vt, p, zd, exps_d, vd, q);
    return divergence_sum<kKind>(zt, vt, p, zd, vd, q);
  };
  double sum = 0.0;
  switch (kind) {
    case Divergence::KL: sum = run(std::integral_constant<Divergence, Divergence::KL>{}); break;
    case Divergence::RKL: sum = run(std::integral_constant<Divergence, Divergence::RKL>{}); break;
    case Divergence::JS: sum = run(std::integral_constant<Divergence, Divergence::JS>{}); break;
    case Divergence::TV: sum = run(std::integral_constant<Divergence, Divergence::TV>{}); break;
    case Divergence::MKL: sum = run(std::integral_constant<Divergence, Divergence::MKL>{}); break;
  }
  return (float)finish_divergence(sum);
}

// Inverse-CDF sampling over non-negative weights (a SplitWeight) of ids [0, n) with total `total`:
// the first id whose cumulative weight exceeds u * total (the last positive-weight id if rounding
// runs past the end). Vectorised block sums first, then one block element by element.
template <typename Weights>
int64_t inverse_cdf(int64_t n, const Weights& weight, double total, double u) {
  constexpr int64_t kBlock = 256;
  const double target = u * total;
  double cumulative = 0.0;
  int64_t last_positive_block = -1;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    const double block = weight.sum(start, end);
    if (!(block > 0.0)) continue;
    last_positive_block = start;
    if (cumulative + block * (1.0 + 1e-6) <= target) {  // clearly not in this block
      cumulative += block;
      continue;
    }
    for (int64_t j = start; j < end; ++j) {
      cumulative += (double)weight(j);
      if (cumulative > target) return j;
    }
  }
  if (last_positive_block < 0) return 0;
  for (int64_t j = std::min(n, last_positive_block + kBlock) - 1; j > last_positive_block; --j)
    if (weight(j) > 0.0f) return j;
  return last_positive_block;
}

}  // namespace cpu
}  // namespace fsd
