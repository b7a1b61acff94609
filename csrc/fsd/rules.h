// The divergences and acceptance rules of docs/design.md section 2: the one place in C++/CUDA where
// their formulas live (fsd_ext/reference.py is the executable spec they are tested against).
#pragma once

#include <cmath>

#include "common.h"

namespace fsd {

// Below this log-probability (nats) a probability is 0 in float64 too: exp rounds to 0 under about
// -745.13 (the smallest subnormal double is e^-744.44). Between it and about -87 a probability is 0
// in float but not in float64, the precision of fsd_ext/reference.py.
constexpr double kLogZeroInDouble = -745.13;

// Below this log-probability (nats) a probability counts as 0 by construction (log -inf), as a
// filtered token or a -inf logit is: fsd_ext/reference.py does the same. Only gaps no model produces
// reach it, above all a +inf logit (counted as FLT_MAX), whose row's other ids sit near -3.4e38: 0
// is the limit that +inf stands for. Without the rule such a finite log is -inf in float wherever
// the temperature scales it past float's range (and in CUDA's log2 units) but finite in float64,
// and a term q (lq - lp) with q > 0 is then +inf in one precision and ~1e-87 in the other. Above
// the bound, a p that flushed to 0 in float leaves out at most e^-87 x 1e20 (2e-18) of a term. The
// bound is -2^67 in log2 units (about -1.02e20 nats), so that CUDA's plain path can find it by
// overflow (streaming.cuh, js_mkl_add).
constexpr double kZeroByConstructionBelow = -0x1p67 * 0.69314718055994530942;

// The least a midpoint m = (p + q) / 2 that is > 0 in float64 counts as (a normal float) in mkl, so
// that a flushed m is not log 0: the floor adds at most 1e-37 x 2e20 to a term whose logs are above
// kZeroByConstructionBelow.
constexpr float kFloorProb = 1e-37f;
template <typename F>
FSD_INLINE F floored_prob(F p) {
  const F tiny = F(kFloorProb);
  return p > tiny ? p : tiny;
}

// div_top_k's rest bucket: both kernels sum its mass from float probabilities, which is exact to
// float rounding down to about this (ids flushed to 0 or subnormal add at most 262144 x 1.2e-38).
// A rest summed below it is recomputed as a log-sum-exp (LogMass) over the rest's ids, so its log is
// right where every id is below float's range, as RKL and MKL need it (tests/helpers.py
// tiny_rest_cases: RKL 26.75, where a sum floored at kFloorProb gave 3.65 and an unfloored one +inf).
constexpr double kExactRestBelow = 1e-20;

// A log-sum-exp added up one log-probability at a time: log(sum) = max + log(sum_of_scaled) (CUDA's
// rescan of a rest below kExactRestBelow, exact_tiny_rests). Only logs above kLogZeroInDouble count
// (their exp is > 0 in float64, as in the reference).
template <typename F>
struct LogMass {
  F max = -F(HUGE_VAL);  // the largest log added (-inf: none)
  F scaled = F(0);       // sum of exp(l - max)
  template <typename ExpFn>
  FSD_INLINE void add(F l, ExpFn exp_fn) {
    if (!(l > F(kLogZeroInDouble))) return;
    if (l > max) {
      scaled = scaled * exp_fn(max - l) + F(1);
      max = l;
    } else {
      scaled += exp_fn(l - max);
    }
  }
  template <typename ExpFn>
  FSD_INLINE LogMass merged(const LogMass& o, ExpFn exp_fn) const {
    if (!(o.max > -F(HUGE_VAL))) return *this;
    if (!(max > -F(HUGE_VAL))) return o;
    LogMass out;
    out.max = max > o.max ? max : o.max;
    out.scaled = scaled * exp_fn(max - out.max) + o.scaled * exp_fn(o.max - out.max);
    return out;
  }
  FSD_INLINE double log_value() const {  // log of the mass; -inf when nothing was added
    return max > -F(HUGE_VAL) ? (double)max + ::log((double)scaled) : -HUGE_VAL;
  }
};

// One vocabulary entry's contribution to D(p || q), from probabilities and their exact logs
// (log-space, so an underflowed p still has a finite lp; lp = -inf, or below `zero_below`, when p
// is 0 by construction, e.g. a filtered token, a -inf logit or a target id beyond the draft
// vocabulary). 0 log 0 = 0. One side 0 by construction against the other > 0 in float64 gives +inf
// for kl (p > 0 = q), rkl (q > 0 = p) and mkl (either way), also where that other side's p or q has
// flushed to 0 in float: e^-200 past the draft vocabulary makes KL infinite, as in the reference.
// `log_fn` is the backend's log (a vectorisable one on the CPU, logf on CUDA); `log_zero` and
// `zero_below` are kLogZeroInDouble and kZeroByConstructionBelow in the unit of lp and lq (CUDA's
// plain path passes log2 ones).
template <Divergence D, typename F, typename LogFn>
FSD_INLINE F divergence_term(F p, F lp, F q, F lq, LogFn log_fn, F log_zero = F(kLogZeroInDouble),
                             F zero_below = F(kZeroByConstructionBelow)) {
  const F half = F(0.5), zero = F(0), inf = F(HUGE_VAL);
  // p > 0 in float64 (lp > log_zero) against q = 0 by construction weighs the term by +inf, even
  // where p flushed to 0 in float; lp - lq > 0 there, so the product is +inf.
  if (D == Divergence::KL) return lp > log_zero ? (lq > zero_below ? p : inf) * (lp - lq) : zero;
  if (D == Divergence::RKL) return lq > log_zero ? (lp > zero_below ? q : inf) * (lq - lp) : zero;
  if (D == Divergence::TV) return half * (p > q ? p - q : q - p);
  if (D == Divergence::Entropy) return lp > log_zero ? -p * lp : zero;  // H(p): q unused
  if (D == Divergence::MKL) {  // 0.5 KL(m || p) + 0.5 KL(m || q)
    // m > 0 in float64 where p or q is; +inf where the other is 0 by construction (lm - that log
    // is +inf, the other difference is at least -ln 2).
    if (!((lp > lq ? lp : lq) > log_zero)) return zero;
    const F m = floored_prob(half * (p + q));
    const F lm = log_fn(m);
    return half * ((lp < lq ? lp : lq) > zero_below ? m : inf) * ((lm - lp) + (lm - lq));
  }
  const F m = half * (p + q);
  // m can underflow to 0 while p or q is a subnormal > 0; such a term is below the smallest
  // float anyway, and log(0) = -inf would turn it into +inf.
  if (!(m > zero)) return zero;
  const F lm = log_fn(m);
  return half * ((p > zero ? p * (lp - lm) : zero) + (q > zero ? q * (lq - lm) : zero));  // JS
}

// The sum of the terms is the divergence up to rounding; rounding can push a true 0 slightly
// negative, which no divergence can be.
template <typename F>
FSD_INLINE F finish_divergence(F sum) {
  return sum > F(0) ? sum : F(0);
}

// What a rule tests at draft position i besides exact SD's coin (docs/design.md section 2.5): a
// statistic s_i of the position, accepted when s_i < T (fsd_strict: s_i <= T). Each lenient rule
// is a hybrid (accept if the coin or the test does; SD's residual at the first rejection, so T = 0
// is exact SD) or strict (the test alone; the correction is a sample of p).
enum class Criterion : int32_t {
  None,        // greedy, sd
  Divergence,  // fsd: s = D(p~, q~)
  Typical,     // Medusa's typical acceptance with eps = 1 / T: s = 1 / max(p~(d), p~(d)^2 e^{2 H(p~)})
  Lenience,    // lenient SD with l = e^{-T}: s = log(u q(d) / p(d))
  ProbFloor,   // target-probability floor t = e^{-T}: s = -log p~(d)
  Rank,        // top-k lenience with k = T: s = d's rank, the number of target logits above d's
  Cascade,     // cascade deferral with alpha = T - 1: s = (max p~ - max q~) / TV(p~, q~) + 1
};
struct RuleTraits {
  Criterion criterion;
  bool strict;
};
FSD_INLINE RuleTraits rule_traits(Rule rule) {
  switch (rule) {
    case Rule::FSD: return {Criterion::Divergence, false};
    case Rule::FSDStrict: return {Criterion::Divergence, true};
    case Rule::Typical: return {Criterion::Typical, false};
    case Rule::TypicalStrict: return {Criterion::Typical, true};
    case Rule::LenientSD: return {Criterion::Lenience, false};
    case Rule::ProbFloor: return {Criterion::ProbFloor, false};
    case Rule::Rank: return {Criterion::Rank, false};
    case Rule::RankStrict: return {Criterion::Rank, true};
    case Rule::Cascade: return {Criterion::Cascade, false};
    default: return {Criterion::None, false};
  }
}

FSD_INLINE bool rule_needs_divergence(Rule rule) { return rule_traits(rule).criterion != Criterion::None; }

// The vocabulary sum a rule's statistic reads, which the kernels compute as they compute a
// divergence (AcceptProblem::divergence holds it): the chosen divergence under fsd (and for the
// D_i that sd and greedy return on request), H(p~) for typical, TV for cascade. The other criteria
// read no sum (statistic_reads_sum); they name TV, which the CUDA kernels add up alongside the
// residual they need anyway, and which the CPU kernel skips.
FSD_INLINE Divergence statistic_divergence(Rule rule, Divergence chosen) {
  switch (rule_traits(rule).criterion) {
    case Criterion::None:
    case Criterion::Divergence: return chosen;
    case Criterion::Typical: return Divergence::Entropy;
    default: return Divergence::TV;
  }
}
FSD_INLINE bool statistic_reads_sum(Rule rule) {
  const Criterion c = rule_traits(rule).criterion;
  return c == Criterion::None || c == Criterion::Divergence || c == Criterion::Typical || c == Criterion::Cascade;
}
// Whether it reads p~ or q~ at all (lenient SD reads the sampling p and q, rank the logits): a
// kernel that builds p~ and q~ with passes of their own may skip them otherwise.
FSD_INLINE bool statistic_reads_dists(Rule rule) {
  const Criterion c = rule_traits(rule).criterion;
  return c != Criterion::Lenience && c != Criterion::Rank;
}

// What the statistic of draft position i (token d) is computed from. p~, q~: the distributions the
// divergence compares (div_temperature, or the sampling ones); p, q: the sampling distributions.
struct StatisticInputs {
  double sum;                 // the statistic_divergence sum, nats
  double log_p_token;         // log p~(d)
  double log_max_p, log_max_q;  // log max p~, log max q~
  double rank;                // the number of target logits above d's (+inf counted as FLT_MAX)
  double coin, p_token, q_token;  // u_i, p(d), q(d)
};

// s_i of the rule's criterion (Criterion lists them). +inf where d has p~(d) = 0 (typical, floor)
// or p(d) = 0 (lenience): never accepted by the test.
FSD_INLINE double rule_statistic(Rule rule, const StatisticInputs& in) {
  switch (rule_traits(rule).criterion) {
    case Criterion::Typical: {  // exp(-max(log p~(d), 2 log p~(d) + 2 H))
      const double a = in.log_p_token, b = 2.0 * (in.log_p_token + in.sum);
      return ::exp(-(a > b ? a : b));
    }
    case Criterion::Lenience: return in.p_token > 0.0 ? ::log(in.coin * in.q_token) - ::log(in.p_token) : HUGE_VAL;
    case Criterion::ProbFloor: return -in.log_p_token;
    case Criterion::Rank: return in.rank;
    case Criterion::Cascade: {
      if (!(in.sum > 0.0)) return 0.0;  // p~ = q~: the test holds for every T > 0
      // |max p~ - max q~| <= TV: s in [0, 2] up to rounding
      const double s = (::exp(in.log_max_p) - ::exp(in.log_max_q)) / in.sum + 1.0;
      return s < 0.0 ? 0.0 : s > 2.0 ? 2.0 : s;
    }
    default: return in.sum;
  }
}

// Whether drafted token d_i is accepted. `coin` is u_i, `p_draft`/`q_draft` are p_i(d_i)/q_i(d_i)
// (sampling distributions), `statistic` is s_i (unused by greedy and sd).
FSD_INLINE bool accept_draft(Rule rule, float statistic, float threshold, double coin, double p_draft,
                             double q_draft, bool draft_is_target_argmax) {
  if (rule == Rule::Greedy) return draft_is_target_argmax;
  const bool coin_accepts = coin * q_draft <= p_draft;
  const RuleTraits traits = rule_traits(rule);
  if (traits.criterion == Criterion::None) return coin_accepts;
  if (rule == Rule::FSDStrict) return statistic <= threshold && statistic < INFINITY;
  const bool test = statistic < threshold;
  return traits.strict ? test : test || coin_accepts;
}

// Whether s_i may be left uncomputed (NaN) at a position whose coin accepts d_i: under sd and the
// hybrid rules the coin alone then accepts, the position is never the one sampled, and only a
// caller that asked for the statistics would read s_i. (Most positions of a good draft: the step's
// largest saving.)
FSD_INLINE bool coin_acceptance_settles(Rule rule, bool caller_reads_divergences) {
  return rule != Rule::Greedy && !rule_traits(rule).strict && !caller_reads_divergences;
}

// Whether a coin that rejects d_i settles the rejection before s_i is known: under sd the coin
// alone decides, so the positions after it are neither accepted nor sampled from, and only a
// caller that asked for the divergences would read theirs. (Under a hybrid rule the test may
// still accept the position.)
FSD_INLINE bool coin_rejection_settles(Rule rule, bool caller_reads_divergences) {
  return rule == Rule::SD && !caller_reads_divergences;
}

// What is emitted after the accepted prefix.
enum class Emit : int32_t {
  TargetArgmax,  // argmax p_i (lowest id on ties)
  Residual,      // a sample of max(0, p_i - q_i), or of p_i when that has no mass
  TargetSample,  // a sample of p_i (argmax when the row is greedy, temperature 0)
};

FSD_INLINE Emit correction_emit(Rule rule) {
  if (rule == Rule::Greedy) return Emit::TargetArgmax;
  return rule_traits(rule).strict ? Emit::TargetSample : Emit::Residual;
}

// All K drafts accepted: the bonus token from p_K (greedy rule: its argmax).
FSD_INLINE Emit bonus_emit(Rule rule) {
  return rule == Rule::Greedy ? Emit::TargetArgmax : Emit::TargetSample;
}

}  // namespace fsd
