// Random inputs of the framework-free kernels, shared by the C++ fuzzers: test_sanitize_core.cpp
// (the CPU kernels under ASan + UBSan: output invariants) and cuda_sim/test_cuda_sim.cpp (the CUDA
// kernels run on the CPU against the CPU kernel).
//
// Every logits buffer is a heap allocation of exactly the bytes the strides address (the last row
// ends at the end of the allocation), so a read one element past a row, a position or the batch
// is an ASan report. Inputs cover K = 0, V = 1, V not a multiple of the lane width, every dtype,
// rule, divergence and filter, temperatures 0 / tiny / huge, extreme logits (+-1e30, +inf, -inf
// runs, all -inf rows, NaN, subnormals, ties), ragged num_draft, int32 / int64 tokens and strided
// layouts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "fsd/common.h"
#include "fsd/rules.h"

namespace fsd_fuzz {

using fsd::DType;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (x != x) return 0x7FC0;
  return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to nearest even
}

inline uint16_t to_f16(float x) {
  const _Float16 h = (_Float16)x;
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float from_bf16(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

inline float from_f16(uint16_t b) {
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

// Fills l's storage (l.dtype, rows, vocab, row_stride and values set) from l.values, which it
// rounds to the dtype; padding between rows holds NaN.
inline void store_logits(Logits& l) {
  const int64_t rows = l.rows, vocab = l.vocab;
  const DType dtype = l.dtype;
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
}

inline Logits make_logits(Rng& rng, int64_t rows, int64_t vocab, DType dtype, int64_t pad) {
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
  store_logits(l);
  return l;
}

inline fsd::SamplingFilter random_filter(Rng& rng, int64_t vocab) {
  fsd::SamplingFilter f;
  if (rng.uniform() < 0.3) f.top_k = rng.pick((const int64_t[]){1, 2, 5}) + (rng.uniform() < 0.2 ? vocab : 0);
  if (rng.uniform() < 0.3) f.top_p = rng.pick((const float[]){1e-6f, 0.5f, 0.9f, 1.0f});
  if (rng.uniform() < 0.3) f.min_p = rng.pick((const float[]){1e-30f, 0.1f, 1.0f});
  return f;
}

// A random key: one scalar seed or per-row seeds, the offset a scalar or a one-element array (as
// the binding passes device tensors for graph replay). `storage` receives what the key points to:
// the per-row seeds [0, batch) and the offset [batch].
inline fsd::RandomKey random_key(Rng& rng, std::vector<int64_t>& storage, int64_t batch) {
  fsd::RandomKey key;
  storage.assign(batch + 1, 0);
  key.seed.scalar = (int64_t)rng.engine();
  key.offset.scalar = rng.integer(0, 1000);
  if (rng.uniform() < 0.5) {
    for (int64_t b = 0; b < batch; ++b) storage[b] = (int64_t)rng.engine();
    key.seed.per_row = storage.data();
    key.seed_per_row = true;
  }
  if (rng.uniform() < 0.3) {
    storage[batch] = key.offset.scalar + rng.integer(1, 1 << 20);
    key.offset.per_row = storage.data() + batch;
  }
  return key;
}

const float kTemperatures[] = {0.0f, 1.4e-45f, 1e-30f, 1e-8f, 0.3f, 1.0f, 2.5f, 1e30f};

// A vocabulary size: mostly small (1..40, a few lane-width edges); the caller's `large` sizes (the
// CUDA simulation's vector body and vocabulary chunks) with probability `large_rate`.
inline int64_t pick_vocab(Rng& rng, const std::vector<int64_t>& large = {}, double large_rate = 0.0) {
  if (!large.empty() && rng.uniform() < large_rate) return large[rng.integer(0, (int64_t)large.size() - 1)];
  return rng.uniform() < 0.2 ? rng.pick((const int64_t[]){1, 15, 16, 17, 33, 257}) : rng.integer(1, 40);
}

// Outputs of one accept call, pre-filled with values no kernel writes.
struct AcceptOutputs {
  std::vector<int64_t> tokens, accepted;
  std::unique_ptr<bool[]> valid;
  std::vector<float> divergences;
  void attach(fsd::AcceptProblem& p) {
    tokens.assign(p.batch * (p.max_draft + 1), -7);
    accepted.assign(p.batch, -7);
    valid.reset(new bool[p.batch > 0 ? p.batch : 1]);
    divergences.assign(p.batch * p.max_draft, -7.0f);
    p.tokens = tokens.data();
    p.num_accepted = accepted.data();
    p.valid = valid.get();
    p.divergences = divergences.data();
  }
};

// One random fsd_ext.accept problem and the storage its pointers address (not copyable: the problem
// points into it).
struct AcceptCase {
  Logits target, draft;  // rows [B*(K+1)] and [B*K], row stride V + pad (strided positions)
  std::vector<int64_t> num_draft, tokens64, key_storage;  // key_storage: see random_key
  std::vector<int32_t> tokens32;
  std::vector<float> thresholds, temperatures, div_temperatures;
  fsd::AcceptProblem problem;

  AcceptCase() = default;
  AcceptCase(const AcceptCase&) = delete;
  AcceptCase& operator=(const AcceptCase&) = delete;

  int64_t used(int64_t b) const { return num_draft[b]; }
  int64_t draft_token(int64_t b, int64_t i) const { return tokens64[b * problem.max_draft + i]; }
};

// Resets c.problem to the defaults and points it at c's logits, draft tokens (int32 or int64) and,
// when ragged, num_draft: batch rows of k draft positions.
inline void bind_accept_problem(AcceptCase& c, int64_t batch, int64_t k, bool ragged, bool int32) {
  fsd::AcceptProblem& p = c.problem;
  p = fsd::AcceptProblem{};
  p.batch = batch;
  p.max_draft = k;
  p.target_vocab = c.target.vocab;
  p.draft_vocab = c.draft.vocab;
  p.dtype = c.target.dtype;
  p.target_logits = c.target.data();
  p.target_stride_k = c.target.row_stride;
  p.target_stride_b = (k + 1) * c.target.row_stride;
  p.draft_logits = c.draft.data();
  p.draft_stride_k = c.draft.row_stride;
  p.draft_stride_b = k * c.draft.row_stride;
  p.tokens_int32 = int32;
  p.draft_tokens = int32 ? (const void*)c.tokens32.data() : (const void*)c.tokens64.data();
  p.num_draft = ragged ? c.num_draft.data() : nullptr;
}

// Fills `c` (fresh) with a random problem of up to `max_batch` rows and `max_k` draft positions,
// vocabulary sizes from pick_vocab(large, large_rate). Outputs are not attached.
inline void random_accept_case(Rng& rng, AcceptCase& c, int64_t max_batch = 5, int64_t max_k = 4,
                               const std::vector<int64_t>& large = {}, double large_rate = 0.0) {
  const int64_t batch = rng.integer(0, max_batch), k = rng.integer(0, max_k);
  const int64_t vt = pick_vocab(rng, large, large_rate);
  const int64_t vd = rng.uniform() < 0.5 ? vt : rng.integer(1, vt);
  const DType dtype = (DType)rng.integer(0, 2);
  const int64_t pad = rng.uniform() < 0.3 ? rng.integer(1, 5) : 0;
  c.target = make_logits(rng, batch * (k + 1), vt, dtype, pad);
  c.draft = make_logits(rng, batch * k, vd, dtype, pad);

  c.num_draft.assign(batch, k);
  c.tokens64.assign(batch * k, 0);
  c.tokens32.assign(batch * k, 0);
  const bool ragged = rng.uniform() < 0.5, int32 = rng.uniform() < 0.5;
  for (int64_t b = 0; b < batch; ++b) c.num_draft[b] = ragged ? rng.integer(0, k) : k;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < k; ++i) {
      // In range where used (the binding checks that); anything past num_draft.
      const int64_t token = i < c.num_draft[b]
                                ? (rng.uniform() < 0.5 ? c.draft.argmax(b * k + i) : rng.integer(0, vd - 1))
                                : rng.pick((const int64_t[]){-1, vd, 1 << 30});
      c.tokens64[b * k + i] = token;
      c.tokens32[b * k + i] = (int32_t)token;
    }
  c.thresholds.resize(batch);
  c.temperatures.resize(batch);
  c.div_temperatures.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    c.thresholds[b] = rng.pick((const float[]){0.0f, 1e-7f, 0.4f, 1.5f, 3.0f, 50.0f, kInf});
    c.temperatures[b] = rng.pick(kTemperatures);
    c.div_temperatures[b] = rng.pick((const float[]){1e-38f, 0.5f, 1.0f, 1e20f});
  }

  fsd::AcceptProblem& p = c.problem;
  bind_accept_problem(c, batch, k, ragged, int32);
  p.rule = (fsd::Rule)rng.integer(0, fsd::kRuleCount - 1);
  p.divergence = fsd::statistic_divergence(p.rule, (fsd::Divergence)rng.integer(0, fsd::kDivergenceCount - 1));
  if (rng.uniform() < 0.5) p.threshold.per_row = c.thresholds.data();
  else p.threshold.scalar = c.thresholds.empty() ? 0.3f : c.thresholds[0];
  if (rng.uniform() < 0.5) p.temperature.per_row = c.temperatures.data();
  else p.temperature.scalar = rng.pick(kTemperatures);
  if (rng.uniform() < 0.5) p.div_temperature.per_row = c.div_temperatures.data();
  else p.div_temperature.scalar = 1.0f;
  p.div_uses_sampling = rng.uniform() < 0.25;
  p.div_top_k = rng.uniform() < 0.3 ? rng.pick((const int64_t[]){1, 3}) + (rng.uniform() < 0.3 ? vt : 0) : 0;
  const fsd::Criterion criterion = fsd::rule_traits(p.rule).criterion;
  if (criterion != fsd::Criterion::None && criterion != fsd::Criterion::Divergence) p.div_top_k = 0;  // (refused)
  p.filter = random_filter(rng, vt);
  p.key = random_key(rng, c.key_storage, batch);
  p.divergences_wanted = rng.uniform() < 0.5;
  p.need_divergence = p.divergences_wanted || fsd::rule_needs_divergence(p.rule);
}

// One random fsd_ext.divergence problem of min_rows..max_rows rows and the logits it points to
// (not copyable). The caller sets problem.out.
struct DivergenceCase {
  Logits target, draft;
  fsd::DivergenceProblem problem;
  DivergenceCase() = default;
  DivergenceCase(const DivergenceCase&) = delete;
  DivergenceCase& operator=(const DivergenceCase&) = delete;
};
inline void random_divergence_case(Rng& rng, DivergenceCase& c, int64_t min_rows, int64_t max_rows,
                                   const std::vector<int64_t>& large = {}, double large_rate = 0.0) {
  const int64_t rows = rng.integer(min_rows, max_rows);
  const int64_t vt = pick_vocab(rng, large, large_rate);
  const int64_t vd = rng.uniform() < 0.5 ? vt : rng.integer(1, vt);
  const DType dtype = (DType)rng.integer(0, 2);
  c.target = make_logits(rng, rows, vt, dtype, rng.integer(0, 3));
  c.draft = make_logits(rng, rows, vd, dtype, rng.integer(0, 3));
  fsd::DivergenceProblem& p = c.problem;
  p = fsd::DivergenceProblem{};
  p.rows = rows;
  p.target_vocab = vt;
  p.draft_vocab = vd;
  p.dtype = dtype;
  p.target_logits = c.target.data();
  p.target_stride = c.target.row_stride;
  p.draft_logits = c.draft.data();
  p.draft_stride = c.draft.row_stride;
  p.divergence = (fsd::Divergence)rng.integer(0, 4);
  p.temperature = rng.pick((const float[]){1e-38f, 0.5f, 1.0f, 1e20f});
  p.top_k = rng.uniform() < 0.3 ? rng.integer(1, vt + 2) : 0;
}

// One random fsd_ext.sample problem of min_batch..max_batch rows and min_positions..max_positions
// positions, and what it points to (not copyable). The caller sets problem.tokens.
struct SampleCase {
  Logits logits;
  std::vector<float> temperatures;
  std::vector<int64_t> key_storage;  // see random_key
  fsd::SampleProblem problem;
  SampleCase() = default;
  SampleCase(const SampleCase&) = delete;
  SampleCase& operator=(const SampleCase&) = delete;
};
inline void random_sample_case(Rng& rng, SampleCase& c, int64_t min_batch, int64_t max_batch, int64_t min_positions,
                               int64_t max_positions, const std::vector<int64_t>& large = {},
                               double large_rate = 0.0) {
  const int64_t batch = rng.integer(min_batch, max_batch), positions = rng.integer(min_positions, max_positions);
  const int64_t vocab = pick_vocab(rng, large, large_rate);
  const DType dtype = (DType)rng.integer(0, 2);
  c.logits = make_logits(rng, batch * positions, vocab, dtype, rng.integer(0, 3));
  c.temperatures.resize(batch);
  for (auto& t : c.temperatures) t = rng.pick(kTemperatures);
  fsd::SampleProblem& p = c.problem;
  p = fsd::SampleProblem{};
  p.batch = batch;
  p.positions = positions;
  p.vocab = vocab;
  p.dtype = dtype;
  p.logits = c.logits.data();
  p.stride_s = c.logits.row_stride;
  p.stride_b = positions * c.logits.row_stride;
  if (rng.uniform() < 0.5) p.temperature.per_row = c.temperatures.data();
  else p.temperature.scalar = rng.pick(kTemperatures);
  p.filter = random_filter(rng, vocab);
  p.key = random_key(rng, c.key_storage, batch);
}

}  // namespace fsd_fuzz
