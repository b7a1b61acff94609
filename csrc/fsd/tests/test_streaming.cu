// Host checks of the CUDA kernels' per-thread streaming arithmetic (csrc/fsd/cuda/streaming.cuh)
// against double-precision sums, without a GPU: nvcc compiles the same functions for the host,
// where the SFU instructions fall back to libm. What this covers is the arithmetic (the fast and
// the checked statistics path, their merge, the log2-unit pass-2 terms of every divergence and the
// residual); the SFU's accuracy, the loads and the block reductions are covered by the CUDA tests
// on a GPU (tests/test_cuda.py).
//
//   nvcc -std=c++17 -Icsrc csrc/fsd/tests/test_streaming.cu -o test_streaming && ./test_streaming
//   (scripts/check_cuda_compile.sh builds and runs it.)
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "fsd/cuda/streaming.cuh"
#include "expect.h"

namespace {

using fsd::clamp_logit;
using fsd::Divergence;
using namespace fsd::cuda;

bool close(double got, double want, double rel, double abs_tol) {
  if (std::isinf(want)) return got == want;
  // Astronomically large (a +inf logit against a finite one under rkl / mkl): the reference's
  // double sum stays just below FLT_MAX, float log-probabilities overflow to inf first.
  if (want > 1e37) return got > 1e37;
  return std::fabs(got - want) <= rel * std::fabs(want) + abs_tol;
}

// ---------------------------------------------------------------------------------------------
// Statistics.

struct RefStat {
  double max = -INFINITY;
  int64_t argmax = INT32_MAX;
  double sum_s = 0.0, sum_d = 0.0;
  bool nan = false, finite = false;
};

RefStat reference_stat(const std::vector<float>& row, float inv_s, float inv_d) {
  RefStat r;
  for (size_t j = 0; j < row.size(); ++j) {
    const float z = row[j];
    r.nan |= std::isnan(z);
    r.finite |= std::isfinite(z);
    const float x = clamp_logit(z);
    if (x > r.max) r.max = x, r.argmax = (int64_t)j;
  }
  if (r.max == -INFINITY) return r;
  for (float z : row) {
    const double x = clamp_logit(z);
    if (std::isnan(x) || x == -INFINITY) continue;
    r.sum_s += std::exp((x - r.max) * (double)inv_s);
    r.sum_d += std::exp((x - r.max) * (double)inv_d);
  }
  return r;
}

// The block's statistics as the kernel computes them: `threads` threads, thread t taking vectors
// t, t + threads, ... of N ids (8: 16-bit logits, 4: float32; a scalar head of `head` ids and a
// scalar tail), merged pairwise.
template <bool kSame, int N = 8>
RowStat emulated_stat(const std::vector<float>& row, float inv_s, float inv_d, int threads, int head) {
  const StatScales scales = stat_scales(inv_s, inv_d);
  const int64_t n = (int64_t)row.size();
  const int64_t head_end = std::min<int64_t>(head, n);
  const int64_t vectors = (n - head_end) / N;
  std::vector<RowStat> st(threads, empty_stat());
  for (int64_t j = 0; j < head_end; ++j) stat_add<1, kSame>(st[j % threads], j, &row[j], scales);
  for (int64_t v = 0; v < vectors; ++v)
    stat_add<N, kSame>(st[v % threads], head_end + v * N, &row[head_end + v * N], scales);
  for (int64_t j = head_end + vectors * N; j < n; ++j) stat_add<1, kSame>(st[j % threads], j, &row[j], scales);
  for (RowStat& s : st)
    if (kSame) s.sum_d = s.sum_s;
  const StatMerge merge{inv_s, inv_d};
  for (int width = 1; width < threads; width *= 2)
    for (int t = 0; t + width < threads; t += 2 * width) st[t] = merge(st[t], st[t + width]);
  return st[0];
}

// Sums within 4e-6 plus the float rounding of a thread's sequential sum (~sqrt(terms) half-ulps).
void check_stat_of(const RefStat& ref, const RowStat& got, double terms_per_thread, const char* what) {
  const double rel = 4e-6 + 3e-8 * std::sqrt(terms_per_thread);
  const bool flags_ok = ((got.flags & kHasNaN) != 0) == ref.nan && ((got.flags & kHasFinite) != 0) == ref.finite;
  bool ok = flags_ok;
  if (!ref.nan && ref.finite) {  // the statistics of a usable row
    ok = ok && got.max == (float)ref.max && got.argmax == ref.argmax && close(got.sum_s, ref.sum_s, rel, 0) &&
         close(got.sum_d, ref.sum_d, rel, 0);
  }
  if (!ok) {
    std::fprintf(stderr, "stat mismatch (%s): max %g/%g argmax %d/%lld sum_s %.9g/%.9g sum_d %.9g/%.9g flags %d\n",
                 what, got.max, ref.max, got.argmax, (long long)ref.argmax, got.sum_s, ref.sum_s, got.sum_d,
                 ref.sum_d, got.flags);
    ++fsd_test::failures;
  }
}

void check_stat(const std::vector<float>& row, float inv_s, float inv_d, int threads, int head, const char* what) {
  const RefStat ref = reference_stat(row, inv_s, inv_d);
  // 8-wide vectors (bf16 / f16) with `threads` threads; 4-wide (float32) with one thread fewer.
  const bool same = inv_s == inv_d;
  const double n = (double)row.size();
  check_stat_of(ref, same ? emulated_stat<true>(row, inv_s, inv_d, threads, head)
                          : emulated_stat<false>(row, inv_s, inv_d, threads, head), n / threads, what);
  check_stat_of(ref, same ? emulated_stat<true, 4>(row, inv_s, inv_d, threads - 1, head)
                          : emulated_stat<false, 4>(row, inv_s, inv_d, threads - 1, head), n / (threads - 1), what);
}

void test_statistics() {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  const int sizes[] = {1, 7, 8, 9, 100, 1003, 32001};
  for (int n : sizes) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<float> row(n);
      for (float& z : row) z = normal(rng) + (trial == 5 ? 1000.0f : 0.0f);
      if (trial == 1) for (int j = 0; j < n; j += 3) row[j] = -INFINITY;  // masked ids
      if (trial == 2) row[n / 2] = row[n - 1] = 40.0f;                      // tied maximum: lowest id
      if (trial == 3 && n > 2) row[n / 3] = INFINITY;                      // +inf: clamped to FLT_MAX
      if (trial == 4) row[n - 1] = NAN;                                    // a NaN: flagged
      for (int threads : {3, 32, 256}) {
        for (int head : {0, 3}) {
          check_stat(row, 1.0f, 1.0f, threads, head, "one temperature");
          check_stat(row, 1.0f / 0.7f, 1.0f / 1.3f, threads, head, "two temperatures");
        }
      }
    }
  }
  // Increasing rows: every vector raises the maximum (the rescale path every time).
  std::vector<float> rising(4096);
  for (size_t j = 0; j < rising.size(); ++j) rising[j] = 0.01f * (float)j;
  check_stat(rising, 1.0f, 0.5f, 4, 0, "rising");
  // Nothing above -inf; only +inf and -inf (no finite value); all NaN.
  check_stat(std::vector<float>(50, -INFINITY), 1.0f, 1.0f, 4, 1, "all -inf");
  std::vector<float> infs(50, -INFINITY);
  infs[7] = INFINITY;
  check_stat(infs, 1.0f, 1.0f, 4, 1, "+inf and -inf");
  check_stat(std::vector<float>(50, NAN), 1.0f, 1.0f, 4, 1, "all NaN");
  // A tiny temperature (inverse saturated at FLT_MAX): the maximum counts 1, everything else 0.
  std::vector<float> spread = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f, 2.9f, 1.5f, 3.0f};
  check_stat(spread, FLT_MAX, FLT_MAX, 2, 0, "tiny temperature");
  const RowStat tiny = emulated_stat<true>(spread, FLT_MAX, FLT_MAX, 2, 0);
  EXPECT(tiny.sum_s == 3.0f && tiny.argmax == 1);
}

// ---------------------------------------------------------------------------------------------
// Pass 2, plain path.

struct Softmax {
  float max, inv;
  double sum;  // sum of exp((z - max) inv)
};

Softmax softmax_of(const std::vector<float>& row, float inv) {
  const RefStat r = reference_stat(row, inv, inv);
  return Softmax{(float)r.max, inv, r.sum_s};
}

double log_prob(const Softmax& s, float z) {
  const double x = clamp_logit(z);
  return x == -INFINITY ? -INFINITY : (x - s.max) * (double)s.inv - std::log(s.sum);
}

// D(p || q) of docs/design.md 2.4 in double, and the residual mass sum max(0, p - q).
void reference_pass_two(Divergence kind, const std::vector<float>& target, const std::vector<float>& draft,
                        const Softmax& p, const Softmax& q, double& div, double& residual) {
  div = residual = 0.0;
  for (size_t j = 0; j < target.size(); ++j) {
    const double lp = log_prob(p, target[j]);
    const double lq = j < draft.size() ? log_prob(q, draft[j]) : -INFINITY;
    const double pp = std::exp(lp), qq = std::exp(lq), m = 0.5 * (pp + qq);
    const double lm = std::log(m);
    residual += pp > qq ? pp - qq : 0.0;
    switch (kind) {
      case Divergence::KL: div += pp > 0 ? pp * (lp - lq) : 0.0; break;
      case Divergence::RKL: div += qq > 0 ? qq * (lq - lp) : 0.0; break;
      case Divergence::TV: div += 0.5 * std::fabs(pp - qq); break;
      case Divergence::JS:
        if (m > 0) div += 0.5 * ((pp > 0 ? pp * (lp - lm) : 0.0) + (qq > 0 ? qq * (lq - lm) : 0.0));
        break;
      case Divergence::MKL:
        if (m > 0) div += 0.5 * m * ((lm - lp) + (lm - lq));
        break;
    }
  }
}

// The kernel's accumulation: float partials over 256 ids, flushed to double (in nats).
template <Divergence D, typename Log2Fn = FastLog2>
void emulated_pass_two(const std::vector<float>& target, const std::vector<float>& draft, const Softmax& p,
                       const Softmax& q, double& div, double& residual, Log2Fn log2_fn = {}) {
  const PlainPair pair = plain_pair(p.max, p.inv, p.sum, q.max, q.inv, q.sum);
  div = residual = 0.0;
  float part_div = 0.0f, part_residual = 0.0f;
  for (size_t j = 0; j < target.size(); ++j) {
    const float zd = j < draft.size() ? draft[j] : -INFINITY;
    plain_add<D, true, true>(pair, target[j], zd, part_div, part_residual, log2_fn);
    if (j % 256 == 255 || j + 1 == target.size()) {
      div += part_div * plain_term_unit<D>();
      residual += part_residual;
      part_div = part_residual = 0.0f;
    }
  }
}

void run_pass_two(Divergence kind, const std::vector<float>& target, const std::vector<float>& draft,
                  const Softmax& p, const Softmax& q, double& div, double& residual) {
  switch (kind) {
    case Divergence::KL: emulated_pass_two<Divergence::KL>(target, draft, p, q, div, residual); break;
    case Divergence::RKL: emulated_pass_two<Divergence::RKL>(target, draft, p, q, div, residual); break;
    case Divergence::JS: emulated_pass_two<Divergence::JS>(target, draft, p, q, div, residual); break;
    case Divergence::TV: emulated_pass_two<Divergence::TV>(target, draft, p, q, div, residual); break;
    case Divergence::MKL: emulated_pass_two<Divergence::MKL>(target, draft, p, q, div, residual); break;
  }
}

void check_pass_two(const std::vector<float>& target, const std::vector<float>& draft, float inv, const char* what) {
  const Softmax p = softmax_of(target, inv), q = softmax_of(draft, inv);
  for (int k = 0; k < 5; ++k) {
    const Divergence kind = (Divergence)k;
    double want_div, want_residual, got_div, got_residual;
    reference_pass_two(kind, target, draft, p, q, want_div, want_residual);
    run_pass_two(kind, target, draft, p, q, got_div, got_residual);
    if (!close(got_div, want_div, 1e-5, 1e-7) || !close(got_residual, want_residual, 1e-5, 1e-7)) {
      std::fprintf(stderr, "pass 2 mismatch (%s, divergence %d): div %.9g / %.9g residual %.9g / %.9g\n", what, k,
                   got_div, want_div, got_residual, want_residual);
      ++fsd_test::failures;
    }
  }
}

void test_pass_two() {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int n : {5, 64, 1000, 32001}) {
    std::vector<float> target(n), draft(n);
    for (int j = 0; j < n; ++j) {
      target[j] = normal(rng);
      draft[j] = target[j] + 0.5f * normal(rng);  // a close draft
    }
    check_pass_two(target, draft, 1.0f, "close draft");
    check_pass_two(target, draft, 1.0f / 0.6f, "temperature 0.6");
    check_pass_two(target, target, 1.0f, "identical rows");
    std::vector<float> far(n);
    for (float& z : far) z = normal(rng);
    check_pass_two(target, far, 1.0f, "unrelated draft");
    // Masked ids (-inf) on either side: zero probabilities, infinite kl / rkl / mkl where one is 0.
    std::vector<float> masked_t = target, masked_d = draft;
    for (int j = 0; j < n; j += 4) masked_t[j] = -INFINITY;
    for (int j = 2; j < n; j += 4) masked_d[j] = -INFINITY;
    check_pass_two(masked_t, masked_d, 1.0f, "masked ids");
    check_pass_two(masked_t, masked_t, 1.0f, "same masked ids");
    // A smaller draft vocabulary: q = 0 beyond it.
    check_pass_two(target, std::vector<float>(draft.begin(), draft.begin() + (n + 1) / 2), 1.0f, "short draft");
    // +inf logits clamp to FLT_MAX: p puts all its mass there.
    std::vector<float> inf_t = target;
    inf_t[n / 2] = INFINITY;
    check_pass_two(inf_t, draft, 1.0f, "+inf target logit");
  }
  // Identical rows: every divergence is 0 up to rounding.
  std::vector<float> row(1000);
  for (float& z : row) z = normal(rng);
  const Softmax s = softmax_of(row, 1.0f);
  for (int k = 0; k < 5; ++k) {
    double div, residual;
    run_pass_two((Divergence)k, row, row, s, s, div, residual);
    EXPECT(std::fabs(div) < 1e-6 && residual == 0.0);
  }
  // Negative control: the comparison must see a pass 2 that forgot the bits-to-nats unit.
  std::vector<float> other(1000);
  for (float& z : other) z = normal(rng);
  const Softmax o = softmax_of(other, 1.0f);
  double want, want_residual, got, got_residual;
  reference_pass_two(Divergence::KL, row, other, s, o, want, want_residual);
  run_pass_two(Divergence::KL, row, other, s, o, got, got_residual);
  EXPECT(close(got, want, 1e-5, 1e-7) && !close(got / kLn2, want, 1e-5, 1e-7));
}

// js / mkl take one logarithm per id, of 1 + r in [1, 2], on the SFU (absolute error <= 2^-22
// there). A logarithm that errs by that much in the same direction on every id of a long flat row
// (the worst case: every id's weight counts) keeps the sums within the CUDA tests' tolerance
// (rtol 1e-5, atol 1e-6); one that errs by 2^-17 does not (the check can fail).
struct ErringLog2 {
  float error;
  FSD_INLINE float operator()(float x) const { return std::log2(x) + error; }
};

bool log_error_tolerated(Divergence kind, const std::vector<float>& target, const std::vector<float>& draft,
                         float error) {
  const Softmax p = softmax_of(target, 1.0f), q = softmax_of(draft, 1.0f);
  double want, want_residual, got, got_residual;
  reference_pass_two(kind, target, draft, p, q, want, want_residual);
  if (kind == Divergence::JS) emulated_pass_two<Divergence::JS>(target, draft, p, q, got, got_residual, ErringLog2{error});
  else emulated_pass_two<Divergence::MKL>(target, draft, p, q, got, got_residual, ErringLog2{error});
  return close(got, want, 1e-5, 1e-6);
}

// js_mkl_add at its edges: both probabilities 0; one 0; the larger one flushed to 0 by the SFU
// while the other is 0 (below the float range: js's term is 0, not NaN; mkl's is +inf while the
// probability is > 0 in float64, as in the reference, and 0 below that, log2 p < -1075).
void test_js_mkl_edges() {
  float residual = -1.0f;
  EXPECT(js_mkl_add<Divergence::JS>(-INFINITY, -INFINITY, residual) == 0.0f && residual == 0.0f);
  EXPECT(js_mkl_add<Divergence::MKL>(-INFINITY, -INFINITY, residual) == 0.0f && residual == 0.0f);
  EXPECT(js_mkl_add<Divergence::JS>(-1.0f, -INFINITY, residual) == 0.5f && residual == 0.5f);  // p log2(2)
  EXPECT(js_mkl_add<Divergence::JS>(-INFINITY, -1.0f, residual) == 0.5f && residual == 0.0f);
  EXPECT(std::isinf(js_mkl_add<Divergence::MKL>(-1.0f, -INFINITY, residual)));
  EXPECT(std::isinf(js_mkl_add<Divergence::MKL>(-300.0f, -INFINITY, residual)) && residual == 0.0f);
  EXPECT(std::isinf(js_mkl_add<Divergence::MKL>(-INFINITY, -300.0f, residual)) && residual == 0.0f);
  EXPECT(js_mkl_add<Divergence::MKL>(-1100.0f, -INFINITY, residual) == 0.0f && residual == 0.0f);
  EXPECT(js_mkl_add<Divergence::JS>(-300.0f, -INFINITY, residual) == 0.0f);
  EXPECT(js_mkl_add<Divergence::JS>(-2.0f, -2.0f, residual) == 0.0f && residual == 0.0f);  // p == q
  // A finite log2 below kLog2ZeroByConstructionBelow (-2^67, -1.48e20) is 0 by construction: mkl
  // +inf, as for -inf; just above it the term is finite (the other probability's mass times |d| / 2).
  EXPECT(std::isinf(js_mkl_add<Divergence::MKL>(-1.0f, -2e20f, residual)) && residual == 0.5f);
  EXPECT(std::isinf(js_mkl_add<Divergence::MKL>(-2e20f, -300.0f, residual)) && residual == 0.0f);
  EXPECT(std::isfinite(js_mkl_add<Divergence::MKL>(-1.0f, -1e20f, residual)) && residual == 0.5f);
  EXPECT(js_mkl_add<Divergence::JS>(-1.0f, -2e20f, residual) == 0.5f);
}

// divergence_term (rules.h) against a log below kZeroByConstructionBelow (about -1.02e20 nats): kl, rkl and
// mkl +inf as for a -inf log, also where the weighing probability flushed to 0 in float (e^-300);
// above the bound a finite product, and 0 where that probability flushed.
struct NaturalLog {
  FSD_INLINE float operator()(float x) const { return ::logf(x); }
};
void test_zero_by_construction_terms() {
  const NoLog none;
  const auto kl = [&](float p, float lp, float lq) {
    return fsd::divergence_term<Divergence::KL, float>(p, lp, 0.0f, lq, none);
  };
  EXPECT(std::isinf(kl(0.5f, std::log(0.5f), -2e20f)) && std::isinf(kl(0.0f, -300.0f, -2e20f)));
  EXPECT(kl(0.5f, std::log(0.5f), -1e19f) == 0.5f * (std::log(0.5f) + 1e19f));
  EXPECT(kl(0.0f, -300.0f, -1e19f) == 0.0f && kl(0.0f, -800.0f, -2e20f) == 0.0f);
  EXPECT(std::isinf(fsd::divergence_term<Divergence::RKL, float>(0.0f, -2e20f, 0.25f, std::log(0.25f), none)));
  const auto mkl = [](float lp) {
    return fsd::divergence_term<Divergence::MKL, float>(0.0f, lp, 0.25f, std::log(0.25f), NaturalLog{});
  };
  EXPECT(std::isinf(mkl(-2e20f)) && std::isfinite(mkl(-1e19f)));
}

void test_js_mkl_log_error() {
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  const int n = 151936;  // a flat row: log2 m near -17 on every id
  std::vector<float> target(n), draft(n);
  for (int j = 0; j < n; ++j) {
    target[j] = noise(rng);
    draft[j] = noise(rng);
  }
  const float sfu = std::ldexp(1.0f, -22);
  for (Divergence kind : {Divergence::JS, Divergence::MKL}) {
    EXPECT(log_error_tolerated(kind, target, draft, sfu));
    EXPECT(log_error_tolerated(kind, target, draft, -sfu));
    EXPECT(!log_error_tolerated(kind, target, draft, std::ldexp(1.0f, -17)));  // negative control
  }
}

// The SFU stand-ins at their edges (the device instructions behave the same way there).
void test_fast_functions() {
  EXPECT(fast_exp2(-INFINITY) == 0.0f && fast_exp2(0.0f) == 1.0f && fast_exp2(-130.0f) == 0.0f);
  EXPECT(std::isnan(max_nan(1.0f, NAN)) && std::isnan(max_nan(NAN, 1.0f)) && max_nan(-INFINITY, 2.0f) == 2.0f);
  EXPECT(log2_scale(FLT_MAX) == FLT_MAX && log2_scale(1.0f) == kLog2e);
  // The saturated inverse temperature of a tiny tau still has an exact-factor log2 scale, so the
  // statistics (2^(x log2_scale)) and the sampling weights (e^(x inv)) use one distribution.
  const float inv = fsd::inverse_temperature(1.4e-45f);
  EXPECT(inv == fsd::kMaxInverseTemperature && log2_scale(inv) < FLT_MAX && log2_scale(inv) == inv * kLog2e);
  EXPECT(fast_log2(1.0f) == 0.0f && fast_log2(2.0f) == 1.0f);
}

}  // namespace

int main() {
  test_fast_functions();
  test_statistics();
  test_pass_two();
  test_js_mkl_edges();
  test_zero_by_construction_terms();
  test_js_mkl_log_error();
  return fsd_test::verdict("test_streaming");
}
