// A deterministic mini-fuzzer of the framework-free CPU kernels, written to run under
// AddressSanitizer and UndefinedBehaviorSanitizer (scripts/sanitize.sh; also a plain ctest). The
// inputs (fuzz_inputs.h) cover the edge cases and sit in buffers that end exactly at the last
// row. Besides "no report", each result is checked for the output invariants of docs/design.md
// section 2 (tokens in range, -1 padding, accepted prefix = drafts, valid flags).
//
// Usage: test_sanitize_core [iterations]   (default 10000; exit status 1 on a failed invariant)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "fsd/common.h"
#include "fsd/cpu/kernels.h"
#include "expect.h"
#include "fsd/rules.h"
#include "fuzz_inputs.h"

namespace {

using namespace fsd_fuzz;

// Parallel loop on std::threads, so the sanitizers also see concurrent row processing.
void thread_for(int64_t count, int64_t grain, const fsd::cpu::RangeFn& body) {
  (void)grain;
  const int64_t workers = std::min<int64_t>(3, count);
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w)
    threads.emplace_back([&, w] { body(count * w / workers, count * (w + 1) / workers); });
  for (auto& t : threads) t.join();
}

void fuzz_accept(Rng& rng, int iteration) {
  AcceptCase c;
  random_accept_case(rng, c);
  fsd::AcceptProblem& p = c.problem;
  const int64_t batch = p.batch, k = p.max_draft, vt = p.target_vocab;
  const Logits &target = c.target, &draft = c.draft;
  AcceptOutputs out;
  out.attach(p);
  const std::vector<int64_t>& out_tokens = out.tokens;
  const std::vector<int64_t>& accepted = out.accepted;
  const bool* valid = out.valid.get();
  const std::vector<float>& divergences = out.divergences;
  // Without divergences_wanted, sd / fsd leave D_i NaN where the coin accepts: such a position is
  // accepted whenever it is reached, so it is never the first rejection.
  const bool coin_settles = fsd::coin_acceptance_settles(p.rule, p.caller_reads_divergences());
  if (rng.uniform() < 0.3) fsd::cpu::accept(p, thread_for); else fsd::cpu::accept(p);

  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = c.used(b);
    bool expect_valid = true;
    for (int64_t i = 0; i <= used; ++i) expect_valid &= !target.bad(b * (k + 1) + i);
    for (int64_t i = 0; i < used; ++i) expect_valid &= !draft.bad(b * k + i);
    CHECK(valid[b] == expect_valid, "iteration %d row %ld: valid %d, expected %d", iteration, (long)b, valid[b], expect_valid);
    const int64_t n = accepted[b];
    CHECK(n >= 0 && n <= used, "iteration %d row %ld: num_accepted %ld of %ld", iteration, (long)b, (long)n, (long)used);
    const int64_t* row = &out_tokens[b * (k + 1)];
    for (int64_t i = 0; i <= k; ++i) {
      CHECK(row[i] >= -1 && row[i] < vt, "iteration %d row %ld: token %ld out of range", iteration, (long)b, (long)row[i]);
      const bool emitted = valid[b] && i <= n;
      CHECK((row[i] != -1) == emitted, "iteration %d row %ld pos %ld: token %ld (n=%ld valid=%d)", iteration, (long)b,
            (long)i, (long)row[i], (long)n, valid[b]);
      if (valid[b] && i < n) CHECK(row[i] == c.draft_token(b, i), "iteration %d: accepted token differs from draft", iteration);
      if (i < k && !(valid[b] && i < used)) CHECK(std::isnan(divergences[b * k + i]), "iteration %d: divergence not NaN", iteration);
      if (i < k && valid[b] && i < used && p.need_divergence) {
        const float div = divergences[b * k + i];
        if (coin_settles && std::isnan(div))
          CHECK(i != n, "iteration %d row %ld: the first rejection %ld has no divergence", iteration, (long)b, (long)i);
        else  // (lenient SD's log(u q(d) / p(d)) is the one statistic that may be negative)
          CHECK(div >= 0.0f || (fsd::rule_traits(p.rule).criterion == fsd::Criterion::Lenience && !std::isnan(div)),
                "iteration %d: statistic %g", iteration, div);
      }
    }
    if (valid[b] && n <= k && row[n] >= 0) {
      CHECK(target.at(b * (k + 1) + n, row[n]) > -kInf, "iteration %d row %ld: emitted a token of probability 0", iteration, (long)b);
      if (p.temperature.at(b) == 0.0f || p.rule == fsd::Rule::Greedy)
        CHECK(row[n] == target.argmax(b * (k + 1) + n), "iteration %d row %ld: not the argmax", iteration, (long)b);
    }
  }
}

void fuzz_divergence(Rng& rng, int iteration) {
  DivergenceCase c;
  random_divergence_case(rng, c, 0, 6);
  fsd::DivergenceProblem& p = c.problem;
  const int64_t rows = p.rows;
  const Logits &target = c.target, &draft = c.draft;
  std::vector<float> out(rows, -7.0f);
  p.out = out.data();
  fsd::cpu::divergence(p);
  for (int64_t r = 0; r < rows; ++r) {
    const bool bad = target.bad(r) || draft.bad(r);
    CHECK(std::isnan(out[r]) == bad, "iteration %d row %ld: divergence %g, bad %d", iteration, (long)r, out[r], bad);
    if (!bad) CHECK(out[r] >= 0.0f, "iteration %d: negative divergence %g", iteration, out[r]);
  }
}

void fuzz_sample(Rng& rng, int iteration) {
  SampleCase c;
  random_sample_case(rng, c, 0, 5, 0, 4);
  fsd::SampleProblem& p = c.problem;
  const int64_t positions = p.positions, vocab = p.vocab;
  const Logits& logits = c.logits;
  std::vector<int64_t> tokens(p.batch * positions, -7);
  p.tokens = tokens.data();
  fsd::cpu::sample(p);
  for (int64_t r = 0; r < p.batch * positions; ++r) {
    CHECK((tokens[r] == -1) == logits.bad(r), "iteration %d row %ld: token %ld, bad %d", iteration, (long)r, (long)tokens[r], logits.bad(r));
    CHECK(tokens[r] >= -1 && tokens[r] < vocab, "iteration %d: token %ld out of range", iteration, (long)tokens[r]);
    if (tokens[r] >= 0) {
      CHECK(logits.at(r, tokens[r]) > -kInf, "iteration %d row %ld: sampled a token of probability 0", iteration, (long)r);
      if (p.temperature.at(r / std::max<int64_t>(positions, 1)) == 0.0f)
        CHECK(tokens[r] == logits.argmax(r), "iteration %d row %ld: not the argmax", iteration, (long)r);
    }
  }
}

void philox_smoke() {
  fsd::RandomKey key;
  key.seed.scalar = -1;
  key.offset.scalar = (int64_t)1 << 40;
  std::vector<double> out(7 * 5);
  fsd::cpu::philox_uniforms(key, 7, 5, fsd::Purpose::Accept, out.data());
  for (double u : out) CHECK(u >= 0.0 && u < 1.0, "uniform %g", u);
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 10000;
  Rng rng(20251129);
  for (int it = 0; it < iterations; ++it) {
    fuzz_accept(rng, it);
    if (it % 2 == 0) fuzz_divergence(rng, it);
    if (it % 2 == 1) fuzz_sample(rng, it);
  }
  philox_smoke();
  if (fsd_test::failures) {
    std::fprintf(stderr, "test_sanitize_core: %d failed checks\n", fsd_test::failures);
    return 1;
  }
  std::printf("test_sanitize_core: %d iterations passed\n", iterations);
  return 0;
}
