// Unit tests of the framework-free core against hand-computed values, without torch (ctest).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fsd/cpu/kernels.h"
#include "fsd/cpu/row_ops.h"
#include "fsd/philox.h"
#include "fsd/rules.h"
#include "expect.h"

namespace {

void test_philox_known_answer() {
  // Random123's published known-answer vector for Philox4x32-10: counter and key all ones bits.
  fsd::Philox4x32 counter = {{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}};
  fsd::Philox4x32 out = fsd::philox4x32_10(counter, 0xFFFFFFFFu, 0xFFFFFFFFu);
  EXPECT(out.v[0] == 0x408f276du && out.v[1] == 0x41c83b0eu && out.v[2] == 0xa20bc7c6u &&
         out.v[3] == 0x6d5451fdu);
  fsd::Philox4x32 zero = {{0, 0, 0, 0}};
  out = fsd::philox4x32_10(zero, 0, 0);
  EXPECT(out.v[0] == 0x6627e8d5u && out.v[1] == 0xe169c58du && out.v[2] == 0xbc57ac4cu &&
         out.v[3] == 0x9b00dbd8u);
}

void test_uniforms_in_range_and_streams_differ() {
  double sum = 0.0;
  for (uint32_t i = 0; i < 10000; ++i) {
    const double u = fsd::philox_uniform(42, 0, 0, i, fsd::Purpose::Accept);
    EXPECT(u >= 0.0 && u < 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.01);
  EXPECT(fsd::philox_uniform(1, 0, 0, 0, fsd::Purpose::Accept) !=
         fsd::philox_uniform(1, 0, 0, 0, fsd::Purpose::Sample));
  EXPECT(fsd::philox_uniform(1, 0, 0, 0, fsd::Purpose::Accept) !=
         fsd::philox_uniform(1, 1, 0, 0, fsd::Purpose::Accept));
}

void test_fast_exp_and_log() {
  for (float x = -86.9f; x <= 0.0f; x += 0.37f)
    EXPECT_NEAR(fsd::cpu::exp_nonpositive(x), std::exp(x), 3e-7 * std::exp(x) + 1e-38);
  EXPECT(fsd::cpu::exp_nonpositive(-INFINITY) == 0.0f);
  EXPECT(fsd::cpu::exp_nonpositive(-100.0f) == 0.0f);
  for (float x = 1e-30f; x <= 1.0f; x *= 1.7f)
    EXPECT_NEAR(fsd::cpu::log_nonnegative(x), std::log(x), 3e-7 * std::fabs(std::log(x)) + 1e-7);
  EXPECT(fsd::cpu::log_nonnegative(0.0f) == -INFINITY);
}

// Sampling weights are summed exactly enough that an inverse CDF draws what an exact sum of the
// same float weights draws. With V = 151936 ids carrying mass a boundary sits every ~1/V of the
// total, so a total off by e relative moves about V x e x u of the draws: float lane sums (e ~ 4e-10
// here) moved about 1 in 1000 bonus draws of the CUDA simulation's rows.
void test_weight_sums_are_exact() {
  const int64_t vocab = 151936;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  std::vector<float> logits(vocab), weights(vocab);
  for (float& z : logits) z = normal(gen);
  const float max = *std::max_element(logits.begin(), logits.end());
  for (int64_t j = 0; j < vocab; ++j) weights[j] = fsd::cpu::exp_nonpositive(logits[j] - max);
  std::vector<long double> cumulative(vocab);
  long double running = 0.0L;
  for (int64_t j = 0; j < vocab; ++j) cumulative[j] = running += weights[j];
  const long double exact = running;
  const fsd::cpu::StoredWeights weight{weights.data()};
  const double total = fsd::cpu::sum_range<fsd::cpu::SumOf::Weights>(0, vocab, weight);
  const double float_lanes = fsd::cpu::sum_range<fsd::cpu::SumOf::Terms>(0, vocab, weight);
  EXPECT(std::fabs((long double)total - exact) <= 1e-13L * exact);
  EXPECT(std::fabs((long double)float_lanes - exact) > 1e-11L * exact);  // the lanes do differ

  // Draws: the exact inverse CDF (first id whose cumulative weight exceeds u x total) against
  // inverse_cdf given the double-lane total, and (negative control: ~15 of 20000 expected) a total
  // 1e-8 relative off.
  const auto both = fsd::cpu::split_weight(vocab, weight, weight);
  int64_t off = 0, off_perturbed = 0;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    const double u = fsd::philox_uniform(5, 0, 0, (uint32_t)i, fsd::Purpose::Sample);
    const int64_t expected =
        std::upper_bound(cumulative.begin(), cumulative.end(), (long double)u * exact) - cumulative.begin();
    off += fsd::cpu::inverse_cdf(vocab, both, total, u) != expected;
    off_perturbed += fsd::cpu::inverse_cdf(vocab, both, total * (1.0 + 1e-8), u) != expected;
  }
  std::printf("weight sums: double lanes %.2e, float lanes %.2e relative off; draws off the exact one: %lld "
              "(total 1e-8 off: %lld) of %d\n", (double)(((long double)total - exact) / exact),
              (double)(((long double)float_lanes - exact) / exact), (long long)off, (long long)off_perturbed, draws);
  EXPECT(off == 0);
  EXPECT(off_perturbed > 0);
}

// block_maxima<true>, top-p's first pass, against plain loops: each block's largest value (of the
// blocks a walk visits), the visited values' total weight (float lanes flushed every kFlushEvery
// ids: within 1e-6 of an exact sum) and their smallest value; rows with -inf logits, with and
// without a floor, and lengths that leave a partial last block.
void test_top_p_first_pass() {
  std::mt19937 gen(13);
  std::normal_distribution<float> normal;
  for (int64_t n : {63, 1000, 151937}) {
    std::vector<float> z(n);
    for (int64_t j = 0; j < n; ++j) z[j] = j % 97 == 5 ? -INFINITY : 2.0f * normal(gen);
    const fsd::Dist d = fsd::softmax_dist(*std::max_element(z.begin(), z.end()), 1.0f / 0.7f, -INFINITY, 1.0);
    for (const float floor : {-INFINITY, -3.0f}) {
      std::vector<float> maxima, expected_maxima;
      fsd::cpu::Visited visited;
      fsd::cpu::block_maxima<true>(z.data(), n, d, floor, maxima, visited);
      long double exact = 0.0L;
      float smallest = 0.0f;
      for (int64_t start = 0; start < n; start += fsd::cpu::kSelectBlock) {
        float top = -INFINITY;
        for (int64_t j = start; j < std::min(n, start + fsd::cpu::kSelectBlock); ++j) {
          const float s = d.scaled(z[j]);
          top = std::max(top, s);
          if (!fsd::cpu::walk_visits(s, floor)) continue;
          exact += fsd::cpu::exp_nonpositive(s);
          smallest = std::min(smallest, s);
        }
        if (fsd::cpu::walk_visits(top, floor)) expected_maxima.push_back(top);
      }
      EXPECT(maxima == expected_maxima);
      EXPECT(std::fabs((long double)visited.total - exact) <= 1e-6L * exact);
      EXPECT(visited.smallest == smallest);
    }
  }
}

void test_half_conversions() {
  EXPECT(fsd::cpu::to_float(fsd::cpu::Float16{0x3C00}) == 1.0f);
  EXPECT(fsd::cpu::to_float(fsd::cpu::Float16{0xC000}) == -2.0f);
  EXPECT(fsd::cpu::to_float(fsd::cpu::Float16{0x0001}) == std::ldexp(1.0f, -24));  // subnormal
  EXPECT(std::isinf(fsd::cpu::to_float(fsd::cpu::Float16{0x7C00})));
  EXPECT(std::isnan(fsd::cpu::to_float(fsd::cpu::Float16{0x7E00})));
  EXPECT(fsd::cpu::to_float(fsd::cpu::BFloat16{0x3F80}) == 1.0f);
}

void test_rules_table() {
  using fsd::Rule;
  // sd: accept when u q(d) <= p(d).
  EXPECT(fsd::accept_draft(Rule::SD, 0.f, 0.f, 0.5, 0.4, 0.2, false));
  EXPECT(!fsd::accept_draft(Rule::SD, 0.f, 0.f, 0.9, 0.4, 0.5, false));
  // fsd: also when D < T; T = 0 is sd.
  EXPECT(fsd::accept_draft(Rule::FSD, 0.1f, 0.2f, 0.9, 0.4, 0.5, false));
  EXPECT(!fsd::accept_draft(Rule::FSD, 0.2f, 0.2f, 0.9, 0.4, 0.5, false));
  EXPECT(!fsd::accept_draft(Rule::FSD, 0.0f, 0.0f, 0.9, 0.4, 0.5, false));
  // fsd_strict: D <= T only, infinite D never.
  EXPECT(fsd::accept_draft(Rule::FSDStrict, 0.2f, 0.2f, 0.0, 1.0, 0.0, false));
  EXPECT(!fsd::accept_draft(Rule::FSDStrict, INFINITY, INFINITY, 0.0, 1.0, 0.0, false));
  EXPECT(fsd::accept_draft(Rule::Greedy, 9.f, 0.f, 0.9, 0.0, 1.0, true));
  EXPECT(fsd::correction_emit(Rule::SD) == fsd::Emit::Residual);
  EXPECT(fsd::correction_emit(Rule::FSDStrict) == fsd::Emit::TargetSample);
  EXPECT(fsd::bonus_emit(Rule::Greedy) == fsd::Emit::TargetArgmax);
}

// p = (1/2, 1/2), q = (1/4, 3/4) by hand.
void test_divergences_by_hand() {
  const float target[2] = {0.0f, 0.0f};
  const float draft[2] = {std::log(0.25f), std::log(0.75f)};
  fsd::DivergenceProblem pb;
  pb.rows = 1;
  pb.target_vocab = pb.draft_vocab = 2;
  pb.target_logits = target;
  pb.draft_logits = draft;
  pb.target_stride = pb.draft_stride = 2;
  const double m0 = 0.375, m1 = 0.625;
  const double expected[5] = {
      0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0),
      0.25 * std::log(0.5) + 0.75 * std::log(1.5),
      0.5 * (0.5 * std::log(0.5 / m0) + 0.5 * std::log(0.5 / m1)) +
          0.5 * (0.25 * std::log(0.25 / m0) + 0.75 * std::log(0.75 / m1)),
      0.25,
      0.5 * (m0 * std::log(m0 / 0.5) + m1 * std::log(m1 / 0.5)) +
          0.5 * (m0 * std::log(m0 / 0.25) + m1 * std::log(m1 / 0.75)),
  };
  for (int kind = 0; kind < 5; ++kind) {
    float out = -1.0f;
    pb.divergence = (fsd::Divergence)kind;
    pb.out = &out;
    fsd::cpu::divergence(pb);
    EXPECT_NEAR(out, expected[kind], 1e-6);
  }
}

// A draft that equals the target is always accepted under sd; a NaN row is invalid.
void test_accept_end_to_end() {
  const int64_t batch = 2, k = 2, vocab = 5;
  std::vector<float> target(batch * (k + 1) * vocab), draft(batch * k * vocab);
  for (size_t i = 0; i < target.size(); ++i) target[i] = (float)((i * 7) % 5) * 0.5f;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < k; ++i)
      std::memcpy(&draft[(b * k + i) * vocab], &target[(b * (k + 1) + i) * vocab], vocab * sizeof(float));
  draft[(1 * k + 1) * vocab + 2] = NAN;
  std::vector<int64_t> tokens = {1, 3, 0, 4}, out_tokens(batch * (k + 1)), accepted(batch);
  std::vector<float> divergences(batch * k);
  bool valid[2] = {false, false};
  fsd::AcceptProblem pb;
  pb.batch = batch;
  pb.max_draft = k;
  pb.target_vocab = pb.draft_vocab = vocab;
  pb.target_logits = target.data();
  pb.target_stride_b = (k + 1) * vocab;
  pb.target_stride_k = vocab;
  pb.draft_logits = draft.data();
  pb.draft_stride_b = k * vocab;
  pb.draft_stride_k = vocab;
  pb.draft_tokens = tokens.data();
  pb.rule = fsd::Rule::SD;
  pb.threshold.scalar = 0.0f;
  pb.temperature.scalar = 1.0f;
  pb.div_temperature.scalar = 1.0f;
  pb.key.seed.scalar = 3;
  pb.tokens = out_tokens.data();
  pb.num_accepted = accepted.data();
  pb.valid = valid;
  pb.divergences = divergences.data();
  fsd::cpu::accept(pb);
  EXPECT(valid[0] && !valid[1]);
  EXPECT(accepted[0] == 2 && out_tokens[0] == 1 && out_tokens[1] == 3);
  EXPECT(out_tokens[2] >= 0 && out_tokens[2] < vocab);
  EXPECT(out_tokens[3] == -1 && out_tokens[4] == -1 && out_tokens[5] == -1 && accepted[1] == 0);
  EXPECT(std::fabs(divergences[0]) < 1e-6f && std::isnan(divergences[2]));
  // A caller that does not read the divergences: sd's coin accepts both drafts (p == q), so their
  // divergences are left NaN, and the tokens are the same.
  const std::vector<int64_t> with_divergences = out_tokens;
  pb.divergences_wanted = false;
  fsd::cpu::accept(pb);
  EXPECT(out_tokens == with_divergences && accepted[0] == 2);
  EXPECT(std::isnan(divergences[0]) && std::isnan(divergences[1]));
}

}  // namespace

// The filter cutoff by sorting the whole row: what filter_cutoff computes without a sort (same float
// s_j, same float weights summed in double). `near`: the top-p walk passes within `slack` of its
// target, where another summation order may stop one value earlier or later.
float sorted_cutoff(const std::vector<float>& z, const fsd::cpu::Dist& d, const fsd::SamplingFilter& f,
                    double slack, bool& near) {
  using fsd::cpu::exp_nonpositive;
  const int64_t n = (int64_t)z.size();
  std::vector<float> s(n);
  for (int64_t j = 0; j < n; ++j) s[j] = d.scaled(fsd::cpu::load_logit(z.data(), j));
  std::sort(s.begin(), s.end(), std::greater<float>());
  float cut = -INFINITY;
  if (f.top_k > 0 && f.top_k < n) cut = s[f.top_k - 1];
  near = false;
  if (f.top_p < 1.0f) {
    double total = 0.0;
    for (float v : s) total += v >= cut && v > -INFINITY ? (double)exp_nonpositive(v) : 0.0;
    const double target = (double)f.top_p * total;
    double cumulative = 0.0;
    for (float v : s) {
      if (!(v >= cut && v > -INFINITY)) break;
      const double before = cumulative;
      cumulative += (double)exp_nonpositive(v);
      near |= std::fabs(before - target) <= slack * total || std::fabs(cumulative - target) <= slack * total;
      if (!(cumulative < target)) {
        cut = std::max(cut, v);
        break;
      }
    }
  }
  if (f.min_p > 0.0f) cut = std::max(cut, std::log(f.min_p));
  return cut;
}

// filter_cutoff (a short walk over the largest few values, or the bucket walk) equals sorting the
// row, over shapes that put the walk's end among the largest 256 values or deep in the row, ties
// at the cutoff (more than 256 at a top-k floor below top-p), a narrow value range, -inf and huge
// negative logits, fewer finite values than k.
void test_filter_cutoffs_equal_sorting() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> scratch;
  int compared = 0, skipped = 0;
  for (int64_t n : {1000, 6007, 151936}) {
    for (int shape = 0; shape < 8; ++shape) {
      std::vector<float> z(n);
      for (int64_t j = 0; j < n; ++j) {
        const float x = normal(rng);
        switch (shape) {
          case 0: z[j] = 0.5f * x; break;                            // flat: walks cover most ids
          case 1: z[j] = 3.0f * x; break;                            // a few thousand ids
          case 2: z[j] = 6.0f * x; break;                            // peaked: tens of ids
          case 3: z[j] = (float)(rng() % 6); break;                  // six values, ties everywhere
          case 4: z[j] = 1e-3f * x; break;                           // a narrow range of values
          case 5: z[j] = j % 3 == 0 ? -INFINITY : j % 7 == 1 ? -1e9f : 3.0f * x; break;
          case 6: z[j] = 12.0f * (float)j / (float)n + x; break;     // rising: the selection cuts often
          case 7: z[j] = j < 100 ? 5.0f + x : 0.0f; break;           // a top-k floor tied by most ids
        }
      }
      if (shape == 5 && n == 1000) std::fill(z.begin() + 10, z.end(), -INFINITY);  // < k finite
      const float max = *std::max_element(z.begin(), z.end());
      for (float tau : {1.0f, 0.7f, 2.0f}) {
        const fsd::Dist d = fsd::softmax_dist(max, 1.0f / tau, -INFINITY, 1.0);
        const fsd::SamplingFilter filters[] = {
            {1, 1.0f, 0.0f},    {50, 1.0f, 0.0f},    {256, 1.0f, 0.0f},  {257, 1.0f, 0.0f},
            {1500, 1.0f, 0.0f}, {n - 1, 1.0f, 0.0f}, {0, 0.3f, 0.0f},    {0, 0.9f, 0.0f},
            {0, 0.99f, 0.0f},   {1500, 0.9f, 0.0f},  {200, 0.95f, 0.01f}, {255, 0.9f, 0.0f}};
        for (const fsd::SamplingFilter& f : filters) {
          bool near = false;
          const float expected = sorted_cutoff(z, d, f, 1e-6, near);
          if (near) {
            ++skipped;
            continue;
          }
          ++compared;
          const float cut = fsd::cpu::filter_cutoff(z.data(), n, d, f, scratch);
          if (!(cut == expected)) {
            std::fprintf(stderr, "n=%lld shape=%d tau=%g top_k=%lld top_p=%g: cutoff %.9g, sorting %.9g\n",
                         (long long)n, shape, tau, (long long)f.top_k, f.top_p, cut, expected);
            ++fsd_test::failures;
          }
        }
      }
    }
  }
  EXPECT(compared >= 9 * (compared + skipped) / 10);  // the comparison is not mostly skipped

  // top-p's bound on what the 256 largest values can weigh: 256 values at most e^0 = 1 weigh at most
  // 256, so a target of 300 cannot be reached (the selection is skipped), 256 can.
  const std::vector<float> maxima(10, 0.0f);
  EXPECT(!fsd::cpu::few_values_can_reach(maxima, 10, 300.0) && fsd::cpu::few_values_can_reach(maxima, 10, 256.0));

  // top_k = 2: the selection's buffer (k + 1024 values) fills at 1025, is cut to {1025, 1024}, and
  // the last value, 1024.5, must still get in: the cutoff is the 2nd largest, 1024.5.
  std::vector<float> rising(1027);
  for (int j = 0; j < 1026; ++j) rising[j] = (float)j;
  rising[1026] = 1024.5f;
  const fsd::Dist d = fsd::softmax_dist(1025.0f, 1.0f, -INFINITY, 1.0);
  EXPECT(fsd::cpu::filter_cutoff(rising.data(), 1027, d, {2, 1.0f, 0.0f}, scratch) == -0.5f);
}

int main() {
  test_philox_known_answer();
  test_uniforms_in_range_and_streams_differ();
  test_fast_exp_and_log();
  test_weight_sums_are_exact();
  test_top_p_first_pass();
  test_half_conversions();
  test_rules_table();
  test_divergences_by_hand();
  test_accept_end_to_end();
  test_filter_cutoffs_equal_sorting();
  return fsd_test::verdict("test_core");
}
