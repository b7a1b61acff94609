// The divergence D(p || q) of two rows' distributions: one vectorised pass over both rows (or over
// the exponentials a sum pass stored), and div_top_k's k+1 buckets.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fsd/cpu/filter_cutoffs.h"
#include "fsd/cpu/row_sums.h"
#include "fsd/cpu/vec.h"
#include "fsd/rules.h"

namespace fsd {
namespace cpu {

// sum_j divergence_term(p_j, q_j) for target row zt [vt] and draft row zd [vd], vd <= vt; ids >= vd
// have q = 0. Any p and q (cutoffs, one-hot); plain ones with stored exponentials take
// divergence_sum_stored instead.
template <Divergence D, typename T>
double divergence_sum(const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd, const Dist& q) {
  const FastLog log_fn;
  auto both = [=](int64_t j) FSD_INLINE_LAMBDA {
    const float lp = p.log_prob_float(load_logit(zt, j), j), lq = q.log_prob_float(load_logit(zd, j), j);
    return divergence_term<D>(exp_nonpositive(lp), lp, exp_nonpositive(lq), lq, log_fn);
  };
  auto target_only = [=](int64_t j) FSD_INLINE_LAMBDA {  // ids >= vd: q = 0
    const float lp = p.log_prob_float(load_logit(zt, j), j);
    return divergence_term<D>(exp_nonpositive(lp), lp, 0.0f, -kInf, log_fn);
  };
  const auto term = split_weight(vd, both, target_only);
  if (p.one_hot >= 0 && q.one_hot >= 0) {  // temperature 0: every other id has p = q = 0, term 0
    const double at_target = term(p.one_hot);
    return q.one_hot == p.one_hot ? at_target : at_target + term(q.one_hot);
  }
  return term.template sum<SumOf::Terms>(0, vt);
}

// p_j and log p_j of a plain distribution from the stored e_j = exp(s_j) and
// scale = exp(-log_sum). log p_j = s_j - log_sum is rounded to float, and p_j must be exp of that
// rounded value, not e_j * scale: the divergences are stationary under consistent perturbations of
// (p, log p) but not under inconsistent ones (JS would be off by up to ~4e-7 at V = 151936 instead
// of ~4e-8). So the subtraction's rounding error r (exact, Knuth's two-sum) corrects p_j by
// exp(-r) ~ 1 - r. TV uses no logs and skips the correction. An id of logit -inf (s_j = -inf) has
// p_j = 0 exactly: its two-sum would be inf - inf = NaN, and a NaN p_j makes a JS / MKL term 0
// (m = NaN fails m > 0) instead of the p ln 2 / 2 or +inf that the other side's mass gives it.
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
    // scale used unconditionally: under the select GCC made its load a masked one and then
    // vectorised none of these loops (KL, RKL, JS and MKL ran scalar; JS 4x slower than KL).
    p = e * scale * (lp > -kInf ? 1.0f - r : 0.0f);
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
  return split_weight(vd, both, target_only).template sum<SumOf::Terms>(0, vt);
}

// The k ids of div_top_k's buckets, ascending: the k most probable under p, lowest ids on ties.
// Their log p: s_j where kept, -inf elsewhere (one-hot: 0 at one_hot), so the k-th largest value
// is a top-k walk (walk_cutoff); every id above it is in, and the lowest ids at it fill the k.
template <typename T>
std::vector<int64_t> top_ids(const T* zt, int64_t vt, const Dist& p, int64_t k, std::vector<float>& scratch) {
  std::vector<int64_t> top, ties;
  if (p.one_hot >= 0) {
    top.push_back(p.one_hot);
    for (int64_t j = 0; (int64_t)top.size() < k; ++j)
      if (j != p.one_hot) top.push_back(j);
  } else {
    const float kth = walk_cutoff<Walk::Count>(zt, vt, p, p.cut, (double)k, k <= kFewValues, scratch);
    auto key = [p](float logit) FSD_INLINE_LAMBDA {
      const float s = p.scaled(logit);
      return s >= p.cut ? s : -kInf;
    };
    for_each_picked(
        vt, [&](int64_t j) FSD_INLINE_LAMBDA { return key(load_logit(zt, j)) >= kth; },
        [&](int64_t j) {
          if (key(load_logit(zt, j)) > kth) top.push_back(j);  // fewer than k of these
          else if ((int64_t)ties.size() < k) ties.push_back(j);
        });
    ties.resize(std::min<size_t>(ties.size(), (size_t)k - top.size()));
    top.insert(top.end(), ties.begin(), ties.end());
  }
  std::sort(top.begin(), top.end());
  return top;
}

// Calls f(from, to) for each gap of [0, n) between the ids of `top` (sorted): div_top_k's rest.
template <typename F>
void for_each_gap(const std::vector<int64_t>& top, int64_t n, F&& f) {
  int64_t begin = 0;
  for (const int64_t id : top) {
    f(begin, std::min(id, n));
    begin = id + 1;
  }
  f(begin, n);
}

// log of the rest bucket's mass: the ids of [0, n) outside `top` (sorted), for a rest whose float
// sum fell below kExactRestBelow (rules.h). The sum again, relative to the rest's own largest
// kept s_j (vectorised gap sums, as the first), so ids below float's range count and its log is
// right to float rounding; -inf where the rest keeps nothing.
template <typename T>
double exact_log_rest(const T* row, int64_t n, const Dist& d, const std::vector<int64_t>& top) {
  float s_top = -kInf;
  for_each_gap(top, n, [&](int64_t from, int64_t to) {
    for (int64_t j = from; j < to; ++j) {
      const float s = d.scaled(load_logit(row, j));
      s_top = s >= d.cut && s > s_top ? s : s_top;
    }
  });
  if (!(s_top > -kInf)) return -(double)kInf;
  const auto weight = kept_exp_below(row, d, s_top);
  double sum = 0.0;
  for_each_gap(top, n, [&](int64_t from, int64_t to) { sum += sum_range<SumOf::Weights>(from, to, weight); });
  const double log_rest = (double)s_top - std::log(d.sum) + std::log(sum);
  return log_rest > kLogZeroInDouble ? log_rest : -(double)kInf;  // 0 in float64 too
}

// div_top_k: the divergence over k+1 buckets, the k most probable ids under p (top_ids) and one
// bucket with the rest of the mass, for p and q alike; the rest is summed over the gaps between
// the k ids (vectorised). Any p and q (cutoffs, one-hot).
template <Divergence D, typename T>
double divergence_bucketed(const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd, const Dist& q,
                           int64_t k, std::vector<float>& scratch) {
  const std::vector<int64_t> top = top_ids(zt, vt, p, k, scratch);
  const PreciseLog log_fn;
  double total = 0.0;
  for (const int64_t j : top) {
    const double a = p.log_prob_precise(load_logit(zt, j), j);
    const double b = j < vd ? q.log_prob_precise(load_logit(zd, j), j) : -(double)kInf;
    total += divergence_term<D>(std::exp(a), a, std::exp(b), b, log_fn);
  }
  struct Mass {
    double value, log;
  };
  auto rest_of = [&top](const T* row, int64_t n, const Dist& d) -> Mass {
    if (d.one_hot >= 0) {
      const double rest = d.one_hot < n && !std::binary_search(top.begin(), top.end(), d.one_hot) ? 1.0 : 0.0;
      return {rest, std::log(rest)};
    }
    const auto weight = kept_exp(row, d);
    double rest = 0.0;
    for_each_gap(top, n, [&](int64_t from, int64_t to) { rest += sum_range<SumOf::Weights>(from, to, weight); });
    rest /= d.sum;
    if (rest >= kExactRestBelow) return {rest, std::log(rest)};
    const double log_rest = exact_log_rest(row, n, d, top);  // below float's range: its log matters
    return {std::exp(log_rest), log_rest};
  };
  const Mass rest_p = rest_of(zt, vt, p), rest_q = rest_of(zd, vd, q);
  return total + divergence_term<D>(rest_p.value, rest_p.log, rest_q.value, rest_q.log, log_fn);
}

// D(p || q). `exps_t` / `exps_d` (optional): the exponentials sum_exp stored while computing p.sum
// and q.sum, used when both distributions are plain.
template <typename T>
float divergence(Divergence kind, const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd,
                 const Dist& q, int64_t bucket_top_k, std::vector<float>& scratch,
                 const float* exps_t = nullptr, const float* exps_d = nullptr) {
  const bool bucketed = bucket_top_k > 0 && bucket_top_k < vt;
  const bool general = !p.plain() || !q.plain();
  const bool stored = exps_t != nullptr && exps_d != nullptr;
  auto run = [&](auto tag) -> double {
    constexpr Divergence kKind = decltype(tag)::value;
    if (bucketed) return divergence_bucketed<kKind>(zt, vt, p, zd, vd, q, bucket_top_k, scratch);
    if (stored && !general) return divergence_sum_stored<kKind>(zt, exps_t, vt, p, zd, exps_d, vd, q);
    return divergence_sum<kKind>(zt, vt, p, zd, vd, q);
  };
  double sum = 0.0;
  with_divergence(kind, [&](auto tag) { sum = run(tag); });
  return (float)finish_divergence(sum);
}

}  // namespace cpu
}  // namespace fsd
