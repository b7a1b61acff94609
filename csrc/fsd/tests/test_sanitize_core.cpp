// A deterministic mini-fuzzer of the framework-free CPU kernels, written to run under
// AddressSanitizer and UndefinedBehaviorSanitizer (scripts/sanitize.sh; also a plain ctest).
//
// Every logits buffer is a heap allocation of exactly the bytes the strides address (the last row
// ends at the end of the allocation), so a read one element past a row, a position or the batch
// is an ASan report. Inputs cover K = 0, V = 1, V not a multiple of the lane width, every dtype,
// rule, divergence and filter, temperatures 0 / tiny / huge, extreme logits (+-1e30, +inf, -inf
// runs, all -inf rows, NaN, subnormals, ties), ragged num_draft, int32 / int64 tokens and strided
// layouts. Besides "no report", each result is checked for the output invariants of
// DESIGN.md section 2 (tokens in range, -1 padding, accepted prefix = drafts, valid flags).
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
#include "fsd/rules.h"

namespace {

using fsd::DType;

int failures = 0;

#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      if (++failures <= 20) {                                                   \
        std::fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
        std::fprintf(stderr, __VA_ARGS__);                                      \
        std::fprintf(stderr, "\n");                                             \
      }                                                                         \
    }                                                                           \
  } while (0)

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (x != x) return 0x7FC0;
  return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to nearest even
}

uint16_t to_f16(float x) {
  const _Float16 h = (_Float16)x;
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

float from_bf16(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

float from_f16(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return (float)h;
}

// Logits of `rows` vocabulary rows of `vocab` values, as float (the values the kernels see after
// the dtype round trip), with `row_stride` elements between rows in a buffer that ends exactly
// after the last row.
struct Logits {
  DType dtype = DType::Float32;
  int64_t rows = 0, vocab = 0, row_stride = 0;
  std::vector<float> values;  // [rows, vocab], after the dtype round trip
  std::vector<float> f32;     // storage for Float32
  std::vector<uint16_t> u16;  // storage for BFloat16 / Float16

  const void* data() const { return dtype == DType::Float32 ? (const void*)f32.data() : (const void*)u16.data(); }
  float at(int64_t r, int64_t j) const { return values[r * vocab + j]; }
  bool bad(int64_t r) const {
    bool nan = false, finite = false;
    for (int64_t j = 0; j < vocab; ++j) nan |= std::isnan(at(r, j)), finite |= std::isfinite(at(r, j));
    return nan || !finite;
  }
  int64_t argmax(int64_t r) const {  // +inf counts as FLT_MAX, lowest id on ties
    int64_t best = 0;
    auto clamp = [](float x) { return x > std::numeric_limits<float>::max() ? std::numeric_limits<float>::max() : x; };
    for (int64_t j = 1; j < vocab; ++j)
      if (clamp(at(r, j)) > clamp(at(r, best))) best = j;
    return best;
  }
};

struct Rng {
  std::mt19937_64 engine;
  explicit Rng(uint64_t seed) : engine(seed) {}
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine); }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(engine); }
  float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(engine); }
  template <typename T, size_t N>
  T pick(const T (&choices)[N]) { return choices[integer(0, N - 1)]; }
};

Logits make_logits(Rng& rng, int64_t rows, int64_t vocab, DType dtype, int64_t pad) {
  Logits l;
  l.dtype = dtype;
  l.rows = rows;
  l.vocab = vocab;
  l.row_stride = vocab + pad;
  const float scales[] = {1e-3f, 1.0f, 8.0f, 1e4f, 1e30f};
  const float scale = rng.pick(scales);
  const double special_rate = rng.pick((const double[]){0.0, 0.05, 0.3, 1.0});
  l.values.resize(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = &l.values[r * vocab];
    for (int64_t j = 0; j < vocab; ++j) row[j] = rng.normal() * scale;
    if (rng.uniform() >= special_rate) continue;
    switch (rng.integer(0, 7)) {
      case 0: row[rng.integer(0, vocab - 1)] = kNaN; break;
      case 1: row[rng.integer(0, vocab - 1)] = kInf; break;
      case 2: {
        const int64_t start = rng.integer(0, vocab - 1), len = rng.integer(1, vocab);
        for (int64_t j = start; j < std::min(vocab, start + len); ++j) row[j] = -kInf;
        break;
      }
      case 3: for (int64_t j = 0; j < vocab; ++j) row[j] = -kInf; break;
      case 4: for (int64_t j = 0; j < vocab; ++j) row[j] = rng.uniform() < 0.5 ? (rng.uniform() < 0.5 ? -1e30f : 1e30f) : row[j]; break;
      case 5: for (int64_t j = 0; j < vocab; ++j) row[j] *= 1e-40f; break;
      case 6: for (int64_t j = 0; j < vocab; ++j) row[j] = std::fmax(-2.0f, std::fmin(2.0f, std::round(row[j]))); break;
      case 7: for (int64_t j = 0; j < vocab; ++j) row[j] = kInf; break;
    }
  }
  const int64_t size = rows == 0 ? 0 : (rows - 1) * l.row_stride + vocab;  // ends at the last row
  if (dtype == DType::Float32) {
    l.f32.assign(size, kNaN);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < vocab; ++j) l.f32[r * l.row_stride + j] = l.values[r * vocab + j];
  } else {
    l.u16.assign(size, dtype == DType::BFloat16 ? to_bf16(kNaN) : to_f16(kNaN));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < vocab; ++j) {
        float& v = l.values[r * vocab + j];
        const uint16_t bits = dtype == DType::BFloat16 ? to_bf16(v) : to_f16(v);
        l.u16[r * l.row_stride + j] = bits;
        v = dtype == DType::BFloat16 ? from_bf16(bits) : from_f16(bits);
      }
  }
  return l;
}

fsd::SamplingFilter random_filter(Rng& rng, int64_t vocab) {
  fsd::SamplingFilter f;
  if (rng.uniform() < 0.3) f.top_k = rng.pick((const int64_t[]){1, 2, 5}) + (rng.uniform() < 0.2 ? vocab : 0);
  if (rng.uniform() < 0.3) f.top_p = rng.pick((const float[]){1e-6f, 0.5f, 0.9f, 1.0f});
  if (rng.uniform() < 0.3) f.min_p = rng.pick((const float[]){1e-30f, 0.1f, 1.0f});
  return f;
}

fsd::RandomKey random_key(Rng& rng, std::vector<int64_t>& seeds, int64_t batch) {
  fsd::RandomKey key;
  key.seed.scalar = (int64_t)rng.engine();
  key.offset.scalar = rng.integer(0, 1000);
  if (rng.uniform() < 0.5) {
    seeds.resize(batch);
    for (auto& s : seeds) s = (int64_t)rng.engine();
    key.seed.per_row = seeds.data();
    key.seed_per_row = true;
  }
  return key;
}

const float kTemperatures[] = {0.0f, 1.4e-45f, 1e-30f, 1e-8f, 0.3f, 1.0f, 2.5f, 1e30f};

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
  const int64_t batch = rng.integer(0, 5), k = rng.integer(0, 4);
  const int64_t vt = rng.uniform() < 0.2 ? rng.pick((const int64_t[]){1, 15, 16, 17, 33, 257}) : rng.integer(1, 40);
  const int64_t vd = rng.uniform() < 0.5 ? vt : rng.integer(1, vt);
  const DType dtype = (DType)rng.integer(0, 2);
  const int64_t pad = rng.uniform() < 0.3 ? rng.integer(1, 5) : 0;
  // Target rows [B*(K+1)] and draft rows [B*K] with a row stride of V + pad (strided positions).
  const Logits target = make_logits(rng, batch * (k + 1), vt, dtype, pad);
  const Logits draft = make_logits(rng, batch * k, vd, dtype, pad);

  std::vector<int64_t> num_draft(batch), tokens64(batch * k), seeds;
  std::vector<int32_t> tokens32(batch * k);
  const bool ragged = rng.uniform() < 0.5, int32 = rng.uniform() < 0.5;
  for (int64_t b = 0; b < batch; ++b) num_draft[b] = ragged ? rng.integer(0, k) : k;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < k; ++i) {
      // In range where used (the binding checks that); anything past num_draft.
      const int64_t token = i < num_draft[b] ? (rng.uniform() < 0.5 ? draft.argmax(b * k + i) : rng.integer(0, vd - 1))
                                             : rng.pick((const int64_t[]){-1, vd, 1 << 30});
      tokens64[b * k + i] = token;
      tokens32[b * k + i] = (int32_t)token;
    }
  std::vector<float> thresholds(batch), temperatures(batch), div_temperatures(batch);
  for (int64_t b = 0; b < batch; ++b) {
    thresholds[b] = rng.pick((const float[]){0.0f, 1e-7f, 0.4f, 50.0f, kInf});
    temperatures[b] = rng.pick(kTemperatures);
    div_temperatures[b] = rng.pick((const float[]){1e-38f, 0.5f, 1.0f, 1e20f});
  }

  fsd::AcceptProblem p;
  p.batch = batch;
  p.max_draft = k;
  p.target_vocab = vt;
  p.draft_vocab = vd;
  p.dtype = dtype;
  p.target_logits = target.data();
  p.target_stride_k = target.row_stride;
  p.target_stride_b = (k + 1) * target.row_stride;
  p.draft_logits = draft.data();
  p.draft_stride_k = draft.row_stride;
  p.draft_stride_b = k * draft.row_stride;
  p.tokens_int32 = int32;
  p.draft_tokens = int32 ? (const void*)tokens32.data() : (const void*)tokens64.data();
  p.num_draft = ragged ? num_draft.data() : nullptr;
  p.rule = (fsd::Rule)rng.integer(0, 3);
  p.divergence = (fsd::Divergence)rng.integer(0, 4);
  if (rng.uniform() < 0.5) p.threshold.per_row = thresholds.data(); else p.threshold.scalar = thresholds.empty() ? 0.3f : thresholds[0];
  if (rng.uniform() < 0.5) p.temperature.per_row = temperatures.data(); else p.temperature.scalar = rng.pick(kTemperatures);
  if (rng.uniform() < 0.5) p.div_temperature.per_row = div_temperatures.data(); else p.div_temperature.scalar = 1.0f;
  p.div_uses_sampling = rng.uniform() < 0.25;
  p.div_top_k = rng.uniform() < 0.3 ? rng.pick((const int64_t[]){1, 3}) + (rng.uniform() < 0.3 ? vt : 0) : 0;
  p.filter = random_filter(rng, vt);
  p.key = random_key(rng, seeds, batch);

  std::vector<int64_t> out_tokens(batch * (k + 1), -7), accepted(batch, -7);
  std::unique_ptr<bool[]> valid(new bool[batch > 0 ? batch : 1]);
  std::vector<float> divergences(batch * k, -7.0f);
  p.tokens = out_tokens.data();
  p.num_accepted = accepted.data();
  p.valid = valid.get();
  p.divergences = divergences.data();
  p.divergences_wanted = rng.uniform() < 0.5;
  p.need_divergence = p.divergences_wanted || fsd::rule_needs_divergence(p.rule);
  // Without divergences_wanted, sd / fsd leave D_i NaN where the coin accepts: such a position is
  // accepted whenever it is reached, so it is never the first rejection.
  const bool coin_settles = fsd::coin_acceptance_settles(p.rule, p.caller_reads_divergences());
  if (rng.uniform() < 0.3) fsd::cpu::accept(p, thread_for); else fsd::cpu::accept(p);

  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = num_draft[b];
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
      if (valid[b] && i < n) CHECK(row[i] == tokens64[b * k + i], "iteration %d: accepted token differs from draft", iteration);
      if (i < k && !(valid[b] && i < used)) CHECK(std::isnan(divergences[b * k + i]), "iteration %d: divergence not NaN", iteration);
      if (i < k && valid[b] && i < used && p.need_divergence) {
        const float div = divergences[b * k + i];
        if (coin_settles && std::isnan(div))
          CHECK(i != n, "iteration %d row %ld: the first rejection %ld has no divergence", iteration, (long)b, (long)i);
        else
          CHECK(div >= 0.0f, "iteration %d: divergence %g", iteration, div);
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
  const int64_t rows = rng.integer(0, 6);
  const int64_t vt = rng.uniform() < 0.2 ? rng.pick((const int64_t[]){1, 16, 17, 257}) : rng.integer(1, 40);
  const int64_t vd = rng.uniform() < 0.5 ? vt : rng.integer(1, vt);
  const DType dtype = (DType)rng.integer(0, 2);
  const Logits target = make_logits(rng, rows, vt, dtype, rng.integer(0, 3));
  const Logits draft = make_logits(rng, rows, vd, dtype, rng.integer(0, 3));
  fsd::DivergenceProblem p;
  p.rows = rows;
  p.target_vocab = vt;
  p.draft_vocab = vd;
  p.dtype = dtype;
  p.target_logits = target.data();
  p.target_stride = target.row_stride;
  p.draft_logits = draft.data();
  p.draft_stride = draft.row_stride;
  p.divergence = (fsd::Divergence)rng.integer(0, 4);
  p.temperature = rng.pick((const float[]){1e-38f, 0.5f, 1.0f, 1e20f});
  p.top_k = rng.uniform() < 0.3 ? rng.integer(1, vt + 2) : 0;
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
  const int64_t batch = rng.integer(0, 5), positions = rng.integer(0, 4);
  const int64_t vocab = rng.uniform() < 0.2 ? rng.pick((const int64_t[]){1, 16, 17, 257}) : rng.integer(1, 40);
  const DType dtype = (DType)rng.integer(0, 2);
  const Logits logits = make_logits(rng, batch * positions, vocab, dtype, rng.integer(0, 3));
  std::vector<float> temperatures(batch);
  for (auto& t : temperatures) t = rng.pick(kTemperatures);
  std::vector<int64_t> seeds, tokens(batch * positions, -7);
  fsd::SampleProblem p;
  p.batch = batch;
  p.positions = positions;
  p.vocab = vocab;
  p.dtype = dtype;
  p.logits = logits.data();
  p.stride_s = logits.row_stride;
  p.stride_b = positions * logits.row_stride;
  if (rng.uniform() < 0.5) p.temperature.per_row = temperatures.data(); else p.temperature.scalar = rng.pick(kTemperatures);
  p.filter = random_filter(rng, vocab);
  p.key = random_key(rng, seeds, batch);
  p.tokens = tokens.data();
  fsd::cpu::sample(p);
  for (int64_t r = 0; r < batch * positions; ++r) {
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
  if (failures) {
    std::fprintf(stderr, "test_sanitize_core: %d failed checks\n", failures);
    return 1;
  }
  std::printf("test_sanitize_core: %d iterations passed\n", iterations);
  return 0;
}
