// fsd-ext core: shared definitions for the CPU and CUDA kernels.
//
// Framework-free: this header (and everything in csrc/fsd/) compiles with g++ and nvcc alone, with
// no torch headers. The torch binding in csrc/torch/ fills the problem structs below with raw
// pointers and calls the kernels.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FSD_HOST_DEVICE __host__ __device__
#define FSD_INLINE __host__ __device__ __forceinline__
#else
#define FSD_HOST_DEVICE
#define FSD_INLINE inline
#endif

namespace fsd {

// Acceptance rules of docs/design.md section 2.5 (rules.h: rule_traits). The numeric values are part of
// the op ABI (the Python front end passes them as ints), so never renumber.
enum class Rule : int32_t {
  Greedy = 0, SD = 1, FSD = 2, FSDStrict = 3,
  Typical = 4, TypicalStrict = 5, LenientSD = 6, ProbFloor = 7, Rank = 8, RankStrict = 9, Cascade = 10,
};
constexpr int32_t kRuleCount = 11;

// Divergences of docs/design.md section 2.4. Same ABI note as Rule. Entropy is not one a caller picks
// (kDivergenceCount counts those): it is the typical rules' sum, H(p), which ignores q.
enum class Divergence : int32_t { KL = 0, RKL = 1, JS = 2, TV = 3, MKL = 4, Entropy = 5 };
constexpr int32_t kDivergenceCount = 5;

// Calls f(std::integral_constant<Divergence, kind>{}) for a runtime divergence kind: the one
// dispatch of the CPU and CUDA kernels, so that each holds one copy of its per-id loop per kind and
// one of everything else. A new divergence is a case here and its terms in rules.h.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <typename F>
FSD_INLINE void with_divergence(Divergence kind, F&& f) {
  switch (kind) {
    case Divergence::KL: f(std::integral_constant<Divergence, Divergence::KL>{}); break;
    case Divergence::RKL: f(std::integral_constant<Divergence, Divergence::RKL>{}); break;
    case Divergence::JS: f(std::integral_constant<Divergence, Divergence::JS>{}); break;
    case Divergence::TV: f(std::integral_constant<Divergence, Divergence::TV>{}); break;
    case Divergence::MKL: f(std::integral_constant<Divergence, Divergence::MKL>{}); break;
    case Divergence::Entropy: f(std::integral_constant<Divergence, Divergence::Entropy>{}); break;
  }
}

// Independent random streams (docs/design.md section 3). Part of the RNG keying: never renumber.
enum class Purpose : uint32_t {
  Accept = 1,  // the coin u_i of the sd / fsd rules, one per (row, position)
  Sample = 2,  // the correction (residual / p_i) or bonus sample, one per (row, position)
  Draft = 3,   // fsd_ext.sample: drafting tokens from the draft model
};

enum class DType : int32_t { Float32 = 0, BFloat16 = 1, Float16 = 2 };

// Residual max(0, p - q) with total mass at or below this is "no mass" (p == q up to rounding):
// the correction is then sampled from p. Mirrors RESIDUAL_MASS_EPS in fsd_ext/reference.py.
constexpr double kResidualMassEps = 1e-6;

// Ranges of the per-row float arguments (NaN is in none). The bindings raise outside them; the
// CUDA kernels, which cannot check a [B] device tensor without a host sync, mark a row whose value
// lies outside them invalid (as a NaN row). Templates: the bindings check scalars as doubles.
template <typename F>
FSD_INLINE bool threshold_in_range(F threshold) { return threshold >= F(0); }
template <typename F>  // 0 = greedy; an infinite one would turn the scaled -inf logits into NaN
FSD_INLINE bool temperature_in_range(F tau) { return tau >= F(0) && tau <= F(FLT_MAX); }
template <typename F>
FSD_INLINE bool div_temperature_in_range(F tau) { return tau > F(0) && tau <= F(FLT_MAX); }

// 1 / tau for a temperature tau > 0, saturated at kMaxInverseTemperature where it overflows (tau
// below about 6e-39). Every kernel scales logits by this one factor; the bound leaves the CUDA
// kernels room for it in log2 units (inv * log2 e). The reference divides by tau instead: for such
// a tiny tau the two differ only at logits within ~1e-36 of the row maximum but not equal to it.
constexpr float kMaxInverseTemperature = FLT_MAX / 2;
FSD_INLINE float inverse_temperature(float tau) {
  const float inv = 1.0f / tau;
  return inv < kMaxInverseTemperature ? inv : kMaxInverseTemperature;
}

// Optional top-k / top-p / min-p filter, applied identically to target and draft (docs/design.md 2.3).
// Each is a logit cutoff: a token survives when its logit is >= the cutoff. Applied in order
// top-k, top-p (on the top-k renormalised distribution), min-p.
struct SamplingFilter {
  int64_t top_k = 0;    // 0 = off; keep tokens whose logit >= the k-th largest logit
  float top_p = 1.0f;   // 1 = off; keep the smallest most-probable set with mass >= top_p
  float min_p = 0.0f;   // 0 = off; keep tokens with prob >= min_p * max prob
  FSD_INLINE bool active() const { return top_k > 0 || top_p < 1.0f || min_p > 0.0f; }
  // Whether the cutoff ranks a row's ids (top-k below the vocabulary size, top-p). min-p alone
  // keeps a fixed share of the largest probability: known as soon as the row's maximum is, so a
  // kernel that splits the row over blocks can apply it (CUDA sample's split path).
  FSD_INLINE bool ranks(int64_t vocab) const { return (top_k > 0 && top_k < vocab) || top_p < 1.0f; }
  // min-p's cutoff in s-space (s = (z - max) / T, so s >= log(min_p) keeps p >= min_p p_max);
  // -inf when off. The one place both kernels take it from, so they cut at the same float.
  FSD_INLINE float min_p_cut() const { return min_p > 0.0f ? (float)::log((double)min_p) : -HUGE_VALF; }
};

// A per-row scalar argument: a device/host array of B values, or one value for every row.
template <typename T>
struct RowValue {
  const T* per_row = nullptr;  // [B] or nullptr
  T scalar{};
  FSD_INLINE T at(int64_t row) const { return per_row ? per_row[row] : scalar; }
};

// Where the random numbers of one call come from (docs/design.md section 3). With per-row seeds a row's
// draws depend on its seed only (batch invariance); with one scalar seed the row index is mixed in.
struct RandomKey {
  RowValue<int64_t> seed;
  RowValue<int64_t> offset;  // per_row here means "a one-element device array" (graph replay)
  bool seed_per_row = false;
  FSD_INLINE uint64_t row_seed(int64_t row) const { return (uint64_t)seed.at(seed_per_row ? row : 0); }
  FSD_INLINE uint32_t row_stream(int64_t row) const { return seed_per_row ? 0u : (uint32_t)row; }
  FSD_INLINE uint64_t call_offset() const { return (uint64_t)(offset.per_row ? offset.per_row[0] : offset.scalar); }
};

// One verification step (fsd_ext.accept). Logits are strided over (batch, position) and contiguous
// over the vocabulary. All strides are in elements.
struct AcceptProblem {
  int64_t batch = 0;
  int64_t max_draft = 0;     // K: draft_logits holds K positions, target_logits K + 1
  int64_t target_vocab = 0;  // V_t
  int64_t draft_vocab = 0;   // V_d <= V_t; ids >= V_d have draft probability 0

  DType dtype = DType::Float32;
  const void* target_logits = nullptr;  // [B, K+1, V_t]
  int64_t target_stride_b = 0, target_stride_k = 0;
  const void* draft_logits = nullptr;   // [B, K, V_d]
  int64_t draft_stride_b = 0, draft_stride_k = 0;

  const void* draft_tokens = nullptr;   // [B, K] contiguous, int32 or int64
  bool tokens_int32 = false;
  const int64_t* num_draft = nullptr;   // [B] ragged K, or nullptr for K everywhere

  Rule rule = Rule::FSD;
  Divergence divergence = Divergence::JS;  // the sum of the rule's statistic: statistic_divergence (rules.h)
  RowValue<float> threshold;
  RowValue<float> temperature;      // 0 = greedy
  RowValue<float> div_temperature;  // used when !div_uses_sampling
  bool div_uses_sampling = false;   // div_temperature=None: D on the sampling distributions
  int64_t div_top_k = 0;            // 0 = off; the divergence criterion's only (fsd, fsd_strict, sd / greedy)
  SamplingFilter filter;
  RandomKey key;

  // Outputs.
  int64_t* tokens = nullptr;        // [B, K+1]
  int64_t* num_accepted = nullptr;  // [B]
  bool* valid = nullptr;            // [B]
  float* divergences = nullptr;     // [B, K] the rule's statistic (rules.h; D_i for fsd, sd, greedy);
                                    // NaN past num_draft, on invalid rows, and everywhere
  bool need_divergence = true;      // when false (no rule or caller needs D): all NaN, not computed
  bool divergences_wanted = true;   // the caller reads `divergences` (return_divergence); when not,
                                    // a kernel may leave NaN the D of a position that an sd / fsd
                                    // coin accepts, since nothing else reads it (caller_reads_divergences)

#ifdef FSD_CUDA_TRACE
  // A device fsd::cuda::TraceSink for the kernels' phase trace, or nullptr (csrc/fsd/cuda/trace.cuh;
  // only in builds with -DFSD_CUDA_TRACE: benchmarks/accept_trace.cu).
  const void* trace = nullptr;
#endif

  // Whether anything outside the kernel reads `divergences` (rules.h: coin_acceptance_settles).
  FSD_INLINE bool caller_reads_divergences() const { return need_divergence && divergences_wanted; }

  // Whether row b's threshold and temperatures lie in their ranges (see temperature_in_range).
  FSD_INLINE bool row_values_in_range(int64_t b) const {
    return threshold_in_range(threshold.at(b)) && temperature_in_range(temperature.at(b)) &&
           (div_uses_sampling || div_temperature_in_range(div_temperature.at(b)));
  }
};

// fsd_ext.divergence: rows of logits [N, V] -> [N] float32.
struct DivergenceProblem {
  int64_t rows = 0, target_vocab = 0, draft_vocab = 0;
  DType dtype = DType::Float32;
  const void* target_logits = nullptr;  // [N, V_t] rows contiguous, row stride below
  int64_t target_stride = 0;
  const void* draft_logits = nullptr;   // [N, V_d]
  int64_t draft_stride = 0;
  Divergence divergence = Divergence::JS;
  float temperature = 1.0f;             // > 0
  int64_t top_k = 0;                    // div_top_k bucketing, 0 = off
  float* out = nullptr;                 // [N]
};

// fsd_ext.sample: rows of logits [B, S, V] -> tokens [B, S] (-1 for rows with NaN / no finite logit).
struct SampleProblem {
  int64_t batch = 0, positions = 0, vocab = 0;
  DType dtype = DType::Float32;
  const void* logits = nullptr;
  int64_t stride_b = 0, stride_s = 0;
  RowValue<float> temperature;  // per batch row; 0 = argmax
  SamplingFilter filter;
  RandomKey key;
  int64_t* tokens = nullptr;    // [B, S]
};

}  // namespace fsd
