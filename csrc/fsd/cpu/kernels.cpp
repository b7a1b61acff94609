// CPU kernels: one verification step straight from the logits, rows in parallel.
//
// accept() runs in two phases:
//   1. per (row, position), in parallel: statistics of the target and draft rows (max, bad flag,
//      sum of exponentials at the sampling and divergence temperatures, filter cutoff), and D_i;
//   2. per row, in parallel: the acceptance scan over positions and the one correction or bonus
//      sample (inverse CDF over the logits, no probability array).
#include "fsd/cpu/kernels.h"

#include <cmath>
#include <vector>

#include "fsd/cpu/row_ops.h"
#include "fsd/philox.h"
#include "fsd/rules.h"

namespace fsd {
namespace cpu {

void serial_for(int64_t count, int64_t /*grain*/, const RangeFn& body) {
  if (count > 0) body(0, count);
}

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Per-thread scratch of the row passes. One per worker thread for the life of the thread
// (thread_local below), so a call allocates nothing once the buffers have grown to the largest
// vocabulary seen (at most 2 MB per thread at V = 262144).
struct Scratch {
  std::vector<float> filter;  // candidate values of the filter cutoffs (see filter_cutoff)
  // exp(s_j) of the target and draft rows, stored by their sum passes when a divergence follows
  std::vector<float> target_exps, draft_exps;
};

// `buffer` grown to n floats (it never shrinks).
float* at_least(std::vector<float>& buffer, int64_t n) {
  if ((int64_t)buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// Everything phase 2 needs to know about one vocabulary row (one model, one position).
struct RowStats {
  bool bad = true;     // NaN or no finite logit (or not computed: unused position)
  float max = 0.0f;
  int64_t argmax = 0;   // lowest id of the maximum
  Dist sample = softmax_dist(0.0f, 1.0f, -kInf, 1.0);  // the sampling distribution p_i / q_i
  bool has_sample = false;  // `sample` was computed (the greedy rule skips it)
};

// need_sampling = false (the greedy rule, which only compares and emits argmaxes) skips the
// sampling distribution's sum, a full pass over the row. `exps`: see sum_exp.
template <typename T>
RowStats row_stats(const T* row, int64_t n, float tau, const SamplingFilter& filter, std::vector<float>& scratch,
                   bool need_sampling = true, float* exps = nullptr) {
  RowStats stats;
  const RowScan scan = scan_row(row, n);
  stats.bad = scan.bad;
  if (scan.bad) return stats;
  stats.max = scan.max;
  stats.argmax = scan.argmax;
  if (need_sampling) stats.sample = sampling_dist(row, n, scan, tau, filter, scratch, exps);
  stats.has_sample = need_sampling;
  return stats;
}

// The distribution the divergence compares: the sampling one (div_temperature=None), or the
// unfiltered softmax at the divergence temperature (sharing the sampling sum when it is the same).
// `exps` must be the array row_stats stored into, if any: whichever sum pass ran last wrote the
// exponentials of the returned distribution.
template <typename T>
Dist divergence_dist(const T* row, int64_t n, const RowStats& stats, bool uses_sampling, float div_tau,
                     float* exps) {
  if (uses_sampling) return stats.sample;
  Dist d = softmax_dist(stats.max, inverse_temperature(div_tau), -kInf, 1.0);
  if (stats.has_sample && stats.sample.plain() && stats.sample.inv == d.inv) return stats.sample;
  d.sum = sum_exp(row, n, d, exps);
  d.log_sum = (float)std::log(d.sum);
  return d;
}

template <typename T>
struct AcceptKernel {
  const AcceptProblem& pb;
  std::vector<RowStats> target_stats;  // [B, K+1]
  std::vector<RowStats> draft_stats;   // [B, K]

  explicit AcceptKernel(const AcceptProblem& problem)
      : pb(problem),
        target_stats(problem.batch * (problem.max_draft + 1)),
        draft_stats(problem.batch * problem.max_draft) {}

  const T* target_row(int64_t b, int64_t i) const {
    return static_cast<const T*>(pb.target_logits) + b * pb.target_stride_b + i * pb.target_stride_k;
  }
  const T* draft_row(int64_t b, int64_t i) const {
    return static_cast<const T*>(pb.draft_logits) + b * pb.draft_stride_b + i * pb.draft_stride_k;
  }
  int64_t num_draft(int64_t b) const { return pb.num_draft ? pb.num_draft[b] : pb.max_draft; }
  int64_t draft_token(int64_t b, int64_t i) const {
    const int64_t at = b * pb.max_draft + i;
    return pb.tokens_int32 ? static_cast<const int32_t*>(pb.draft_tokens)[at]
                           : static_cast<const int64_t*>(pb.draft_tokens)[at];
  }

  // Phase 1: statistics and divergence of position i of row b.
  void position(int64_t b, int64_t i, Scratch& scratch) {
    const int64_t k = pb.max_draft, used = num_draft(b);
    if (used < 0 || used > k || i > used) return;  // unused position (or an invalid row)
    const float tau = pb.temperature.at(b);
    const bool greedy_rule = pb.rule == Rule::Greedy;
    const bool need_sampling = !greedy_rule || (pb.need_divergence && pb.div_uses_sampling);
    const bool divergence_follows = pb.need_divergence && i < used;
    float* target_exps = divergence_follows ? at_least(scratch.target_exps, pb.target_vocab) : nullptr;
    float* draft_exps = divergence_follows ? at_least(scratch.draft_exps, pb.draft_vocab) : nullptr;
    RowStats& t = target_stats[b * (k + 1) + i];
    t = row_stats(target_row(b, i), pb.target_vocab, tau, pb.filter, scratch.filter,
                  need_sampling, target_exps);
    if (i == used) return;  // the bonus position has no draft
    RowStats& d = draft_stats[b * k + i];
    d = row_stats(draft_row(b, i), pb.draft_vocab, tau, pb.filter, scratch.filter, need_sampling,
                  draft_exps);
    if (!pb.need_divergence || t.bad || d.bad) return;
    if (coin_acceptance_settles(pb.rule, pb.caller_reads_divergences())) {
      const int64_t token = draft_token(b, i);
      if (token >= 0 && token < pb.draft_vocab && coin_accepts(b, i, token)) {
        pb.divergences[b * k + i] = kNaN;  // accepted whatever D_i is: row() flips the same coin
        return;
      }
    }
    const float div_tau = pb.div_temperature.at(b);
    const bool dists = statistic_reads_dists(pb.rule);  // (else their sum passes are not needed)
    const Dist p = dists ? divergence_dist(target_row(b, i), pb.target_vocab, t, pb.div_uses_sampling, div_tau,
                                           target_exps)
                         : t.sample;
    const Dist q = dists ? divergence_dist(draft_row(b, i), pb.draft_vocab, d, pb.div_uses_sampling, div_tau,
                                           draft_exps)
                         : d.sample;
    const float sum = statistic_reads_sum(pb.rule)
                          ? divergence(pb.divergence, target_row(b, i), pb.target_vocab, p, draft_row(b, i),
                                       pb.draft_vocab, q, pb.div_top_k, scratch.filter, target_exps, draft_exps)
                          : kNaN;
    pb.divergences[b * k + i] = statistic(b, i, sum, p, q);
  }

  // s_i of rules.h from the sum and the divergence distributions p~, q~ of position i.
  float statistic(int64_t b, int64_t i, float sum, const Dist& p, const Dist& q) const {
    const Criterion criterion = rule_traits(pb.rule).criterion;
    if (criterion == Criterion::None || criterion == Criterion::Divergence) return sum;
    const int64_t token = draft_token(b, i);
    if (token < 0 || token >= pb.draft_vocab) return kNaN;  // an invalid row
    const T* target = target_row(b, i);
    const float pivot = load_logit(target, token);
    StatisticInputs in{sum, p.log_prob_precise(pivot, token), p.log_max_prob(), q.log_max_prob(), 0.0, 0.0, 0.0, 0.0};
    if (criterion == Criterion::Rank) {
      int64_t above = 0;
      for (int64_t j = 0; j < pb.target_vocab; ++j) above += load_logit(target, j) > pivot;
      in.rank = (double)above;
    }
    if (criterion == Criterion::Lenience) {
      const Coin c = coin(b, i, token);
      in.coin = c.u, in.p_token = c.p_token, in.q_token = c.q_token;
    }
    return (float)rule_statistic(pb.rule, in);
  }

  // p_i(d_i) and q_i(d_i) (sampling distributions; 0 under the greedy rule, which never reads them)
  // and the coin u_i of position i's acceptance decision.
  struct Coin {
    double p_token, q_token, u;
  };
  Coin coin(int64_t b, int64_t i, int64_t token) const {
    const RowStats& t = target_stats[b * (pb.max_draft + 1) + i];
    const RowStats& d = draft_stats[b * pb.max_draft + i];
    const bool greedy_rule = pb.rule == Rule::Greedy;
    const double p_token =
        greedy_rule ? 0.0 : std::exp(t.sample.log_prob_precise(load_logit(target_row(b, i), token), token));
    const double q_token =
        greedy_rule ? 0.0 : std::exp(d.sample.log_prob_precise(load_logit(draft_row(b, i), token), token));
    return Coin{p_token, q_token, draw_uniform(pb.key, b, i, Purpose::Accept)};
  }
  bool coin_accepts(int64_t b, int64_t i, int64_t token) const {
    const Coin c = coin(b, i, token);
    return accept_draft(Rule::SD, kNaN, 0.0f, c.u, c.p_token, c.q_token, false);
  }

  bool row_valid(int64_t b) const {
    const int64_t k = pb.max_draft, used = num_draft(b);
    if (used < 0 || used > k) return false;
    for (int64_t i = 0; i <= used; ++i)
      if (target_stats[b * (k + 1) + i].bad) return false;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t token = draft_token(b, i);
      if (draft_stats[b * k + i].bad || token < 0 || token >= pb.draft_vocab) return false;
    }
    return true;
  }

  // A sample of p_i (its argmax when the row is greedy).
  int64_t sample_target(int64_t b, int64_t i, double u) const {
    const RowStats& t = target_stats[b * (pb.max_draft + 1) + i];
    if (t.sample.one_hot >= 0) return t.sample.one_hot;
    const auto weight = kept_exp(target_row(b, i), t.sample);
    return inverse_cdf(pb.target_vocab, split_weight(pb.target_vocab, weight, weight), t.sample.sum, u);
  }

  // A sample of max(0, p_i - q_i), or of p_i when that has no mass.
  int64_t sample_residual(int64_t b, int64_t i, double u) const {
    const RowStats& t = target_stats[b * (pb.max_draft + 1) + i];
    const RowStats& d = draft_stats[b * pb.max_draft + i];
    if (t.sample.one_hot >= 0) return t.sample.one_hot;  // greedy: residual of one-hots is argmax p
    const T* target = target_row(b, i);
    const T* draft = draft_row(b, i);
    const Dist p = t.sample, q = d.sample;  // copies: loop-invariant locals for the vectoriser
    auto prob = [](const T* row, const Dist& dist, int64_t j) FSD_INLINE_LAMBDA {  // computed unconditionally: vectorises
      const float s = dist.scaled(load_logit(row, j));
      const float e = exp_nonpositive(s - dist.log_sum);
      return s >= dist.cut ? e : 0.0f;
    };
    auto residual = [&](int64_t j) FSD_INLINE_LAMBDA {
      const float diff = prob(target, p, j) - prob(draft, q, j);
      return diff > 0.0f ? diff : 0.0f;
    };
    auto target_only = [&](int64_t j) FSD_INLINE_LAMBDA { return prob(target, p, j); };  // ids >= V_d: q = 0
    const auto weight = split_weight(pb.draft_vocab, residual, target_only);
    const double mass = weight.sum(0, pb.target_vocab);
    if (mass <= kResidualMassEps) return sample_target(b, i, u);
    return inverse_cdf(pb.target_vocab, weight, mass, u);
  }

  int64_t target_argmax(int64_t b, int64_t i) const { return target_stats[b * (pb.max_draft + 1) + i].argmax; }

  // Phase 2: acceptance scan and the correction / bonus token of row b.
  void row(int64_t b) {
    const int64_t k = pb.max_draft;
    int64_t* tokens = pb.tokens + b * (k + 1);
    for (int64_t i = 0; i <= k; ++i) tokens[i] = -1;
    const bool valid = row_valid(b);
    pb.valid[b] = valid;
    pb.num_accepted[b] = 0;
    const int64_t used = valid ? num_draft(b) : 0;
    for (int64_t i = used; i < k; ++i) pb.divergences[b * k + i] = kNaN;
    if (!valid) return;
    if (!pb.need_divergence)
      for (int64_t i = 0; i < k; ++i) pb.divergences[b * k + i] = kNaN;

    const float threshold = pb.threshold.at(b);
    int64_t accepted = 0;
    for (; accepted < used; ++accepted) {
      const int64_t i = accepted, token = draft_token(b, i);
      const bool is_argmax = pb.rule == Rule::Greedy && token == target_argmax(b, i);
      const Coin c = coin(b, i, token);
      const float div = pb.need_divergence ? pb.divergences[b * k + i] : kNaN;
      if (!accept_draft(pb.rule, div, threshold, c.u, c.p_token, c.q_token, is_argmax)) break;
      tokens[i] = token;
    }
    const Emit emit = accepted < used ? correction_emit(pb.rule) : bonus_emit(pb.rule);
    const double u = draw_uniform(pb.key, b, accepted, Purpose::Sample);
    switch (emit) {
      case Emit::TargetArgmax: tokens[accepted] = target_argmax(b, accepted); break;
      case Emit::TargetSample: tokens[accepted] = sample_target(b, accepted, u); break;
      case Emit::Residual: tokens[accepted] = sample_residual(b, accepted, u); break;
    }
    pb.num_accepted[b] = accepted;
  }

  void run(const ParallelFor& parallel_for) {
    const int64_t positions = pb.max_draft + 1;
    parallel_for(pb.batch * positions, 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch scratch;
      for (int64_t item = begin; item < end; ++item) position(item / positions, item % positions, scratch);
    });
    parallel_for(pb.batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) row(b);
    });
  }
};

template <typename T>
void divergence_rows(const DivergenceProblem& pb, const ParallelFor& parallel_for) {
  parallel_for(pb.rows, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    const SamplingFilter no_filter;
    float* target_exps = at_least(scratch.target_exps, pb.target_vocab);
    float* draft_exps = at_least(scratch.draft_exps, pb.draft_vocab);
    for (int64_t r = begin; r < end; ++r) {
      const T* zt = static_cast<const T*>(pb.target_logits) + r * pb.target_stride;
      const T* zd = static_cast<const T*>(pb.draft_logits) + r * pb.draft_stride;
      const RowStats t = row_stats(zt, pb.target_vocab, pb.temperature, no_filter, scratch.filter,
                                   true, target_exps);
      const RowStats d = row_stats(zd, pb.draft_vocab, pb.temperature, no_filter, scratch.filter,
                                   true, draft_exps);
      pb.out[r] = t.bad || d.bad ? kNaN
                                 : divergence(pb.divergence, zt, pb.target_vocab, t.sample, zd,
                                              pb.draft_vocab, d.sample, pb.top_k, scratch.filter, target_exps,
                                              draft_exps);
    }
  });
}

template <typename T>
void sample_rows(const SampleProblem& pb, const ParallelFor& parallel_for) {
  parallel_for(pb.batch * pb.positions, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / pb.positions, s = item % pb.positions;
      const T* row = static_cast<const T*>(pb.logits) + b * pb.stride_b + s * pb.stride_s;
      // The sum pass stores the row's weights exp(s_j) (0 below a filter's cutoff), and the draw
      // adds those instead of computing every exponential a second time.
      float* exps = at_least(scratch.target_exps, pb.vocab);
      const RowStats stats = row_stats(row, pb.vocab, pb.temperature.at(b), pb.filter, scratch.filter, true, exps);
      if (stats.bad) {
        pb.tokens[item] = -1;
        continue;
      }
      const Dist& p = stats.sample;
      if (p.one_hot >= 0) {
        pb.tokens[item] = p.one_hot;
        continue;
      }
      const StoredWeights stored{exps};
      pb.tokens[item] = inverse_cdf(pb.vocab, split_weight(pb.vocab, stored, stored), p.sum,
                                    draw_uniform(pb.key, b, s, Purpose::Draft));
    }
  });
}

template <template <typename> class Body, typename... Args>
void dispatch_dtype(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::Float32: Body<float>::run(args...); break;
    case DType::BFloat16: Body<BFloat16>::run(args...); break;
    case DType::Float16: Body<Float16>::run(args...); break;
  }
}

template <typename T>
struct RunAccept {
  static void run(const AcceptProblem& pb, const ParallelFor& pf) { AcceptKernel<T>(pb).run(pf); }
};
template <typename T>
struct RunDivergence {
  static void run(const DivergenceProblem& pb, const ParallelFor& pf) { divergence_rows<T>(pb, pf); }
};
template <typename T>
struct RunSample {
  static void run(const SampleProblem& pb, const ParallelFor& pf) { sample_rows<T>(pb, pf); }
};

}  // namespace

void accept(const AcceptProblem& problem, const ParallelFor& parallel_for) {
  dispatch_dtype<RunAccept>(problem.dtype, problem, parallel_for);
}

void divergence(const DivergenceProblem& problem, const ParallelFor& parallel_for) {
  dispatch_dtype<RunDivergence>(problem.dtype, problem, parallel_for);
}

void sample(const SampleProblem& problem, const ParallelFor& parallel_for) {
  dispatch_dtype<RunSample>(problem.dtype, problem, parallel_for);
}

void philox_uniforms(const RandomKey& key, int64_t rows, int64_t positions, Purpose purpose, double* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < positions; ++i) out[r * positions + i] = draw_uniform(key, r, i, purpose);
}

}  // namespace cpu
}  // namespace fsd
