// Per-thread arithmetic of the two streaming passes over a vocabulary row, one vector of logits at
// a time: the online-softmax statistics of pass 1 and the divergence / residual terms of pass 2.
//
// These loops are where the kernels spend their instructions (every logit of every row goes
// through them), so the common case is kept short: pass 1 spends five arithmetic instructions per
// logit (a NaN-propagating max, a subtraction, a multiply, an SFU exponential, an add); the argmax
// search, the rescale and the per-value checks run only for a vector that raises the row maximum
// or holds a NaN or an infinity. Pass 2 has a plain path for the default configuration (no filter
// cut, no one-hot row, no top-k buckets, the divergence compares the sampling distributions) that
// works in log2 units: a subtraction and an FFMA per log-probability, one SFU exponential per
// probability (kl, rkl, tv); js / mkl take the larger probability and the ratio of the two from the
// SFU and add one SFU logarithm of a value in [1, 2] (no logarithm of a probability: js_mkl_add).
// (At the edge of the float range, a +inf logit, which counts as FLT_MAX, sends the other ids'
// log2 p to -inf or past -2^67: 0 by construction either way, as rules.h's
// kZeroByConstructionBelow makes it in every kernel and the reference.)
//
// Host-compilable (FSD_INLINE; the SFU instructions fall back to libm off the GPU), so that
// csrc/fsd/tests/test_streaming.cu checks this arithmetic against double-precision sums without a
// GPU.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "fsd/common.h"
#include "fsd/numerics.h"
#include "fsd/rules.h"

namespace fsd {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr double kLn2 = 0.69314718055994530942;
constexpr float kLog2ZeroInDouble = (float)(kLogZeroInDouble / kLn2);  // rules.h, in log2 units
constexpr float kLog2ZeroByConstructionBelow = (float)(kZeroByConstructionBelow / kLn2);  // likewise

// 2^x on the special-function unit (ex2.approx.ftz): relative error about 2^-22, results below
// 2^-126 flush to 0. The streaming sums use it; decisions (p and q of a draft token) keep double.
FSD_INLINE float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = std::exp2(x);
  return y < FLT_MIN ? 0.0f : y;
#endif
}

// e^x as 2^(x log2 e): relative error about 2^-22 plus |x| 2^-24 (from the product).
FSD_INLINE float fast_exp(float x) { return fast_exp2(x * kLog2e); }

// log2 x on the special-function unit (lg2.approx.ftz): for x in [1, 2], the only arguments js_mkl_add
// passes, its absolute error is at most 2^-22 (CUDA Programming Guide, __log2f).
FSD_INLINE float fast_log2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

// The larger of a and b, NaN when either is NaN (one instruction from sm_80).
FSD_INLINE float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  if (a != a || b != b) return a + b;
  return a > b ? a : b;
#endif
}

// FSD_RARE(c): a condition the streaming loops expect to be false on almost every vector (a new
// running maximum, a NaN or an infinity). Normally just c. benchmarks/sass_census.cu builds with
// FSD_CENSUS_COMMON_CASE, where a true c traps instead, so that the census counts the instructions of
// the common case (the test and the branch stay, the rare body is compiled away).
#ifdef FSD_CENSUS_COMMON_CASE
FSD_INLINE bool census_trap_if(bool c) {
#ifdef __CUDA_ARCH__
  if (c) __trap();
#endif
  return false;
}
#define FSD_RARE(c) ::fsd::cuda::census_trap_if(c)
#else
#define FSD_RARE(c) (c)
#endif

// ---------------------------------------------------------------------------------------------
// Pass 1: online-softmax statistics.

enum StatFlags : int32_t { kHasNaN = 1, kHasFinite = 2 };

struct RowStat {
  float max;       // clamped maximum (-inf when the range has no value above -inf)
  int32_t argmax;  // lowest id holding the maximum (INT32_MAX when none)
  float sum_s;     // sum of exp((z - max) * inv_s): sampling temperature
  float sum_d;     // sum of exp((z - max) * inv_d): divergence temperature
  int32_t flags;   // StatFlags
};

FSD_INLINE RowStat empty_stat() { return RowStat{-kInf, INT32_MAX, 0.0f, 0.0f, 0}; }

FSD_INLINE float rescale(float sum, float from_max, float to_max, float inv) {
  if (from_max == to_max) return sum;
  return from_max == -kInf ? 0.0f : sum * expf((from_max - to_max) * inv);
}

struct StatMerge {
  float inv_s, inv_d;
  FSD_INLINE RowStat operator()(const RowStat& a, const RowStat& b) const {
    RowStat out;
    out.max = a.max > b.max ? a.max : b.max;
    out.argmax = a.max > b.max ? a.argmax : (b.max > a.max ? b.argmax : (a.argmax < b.argmax ? a.argmax : b.argmax));
    out.sum_s = rescale(a.sum_s, a.max, out.max, inv_s) + rescale(b.sum_s, b.max, out.max, inv_s);
    out.sum_d = rescale(a.sum_d, a.max, out.max, inv_d) + rescale(b.sum_d, b.max, out.max, inv_d);
    out.flags = a.flags | b.flags;
    return out;
  }
};

// An inverse temperature in log2 units. inverse_temperature (common.h) leaves room for the factor;
// the saturation only guards a caller's larger value (0 * inf would be NaN at the maximum).
FSD_INLINE float log2_scale(float inv) {
  const float scale = inv * kLog2e;
  return scale < FLT_MAX ? scale : FLT_MAX;
}

// The temperatures of a statistics pass: inverse temperatures (rescaling sums) and the same in
// log2 units (the per-id exponentials).
struct StatScales {
  float inv_s, inv_d;
  float log2_s, log2_d;
};
FSD_INLINE StatScales stat_scales(float inv_s, float inv_d) {
  return StatScales{inv_s, inv_d, log2_scale(inv_s), log2_scale(inv_d)};
}

// N values, by value (a call passes them in registers).
template <int N>
struct Values {
  float v[N];
};

// stat_add for a vector holding a NaN, an infinity or nothing above -inf: every value checked and
// clamped, the running maximum raised value by value. Out of line: it is rare, and the hot loop
// stays short.
template <int N, bool kSameInv>
__host__ __device__ __noinline__ RowStat stat_add_checked(RowStat st, int64_t id, Values<N> raw, StatScales sc) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float r = raw.v[i];
    st.flags |= (r != r ? kHasNaN : 0) | (fabsf(r) < kInf ? kHasFinite : 0);
    const float x = clamp_logit(r);
    if (x > st.max) {
      st.sum_s = rescale(st.sum_s, st.max, x, sc.inv_s);
      if (!kSameInv) st.sum_d = rescale(st.sum_d, st.max, x, sc.inv_d);
      st.max = x;
      st.argmax = (int32_t)(id + i);
    }
    if (st.max == -kInf) continue;  // nothing above -inf yet: the value contributes 0
    const float diff = x - st.max;
    st.sum_s += fast_exp2(diff * sc.log2_s);
    if (!kSameInv) st.sum_d += fast_exp2(diff * sc.log2_d);
  }
  return st;
}

// Adds N raw values at ids id.. to a thread's statistics. With kSameInv (one temperature) only
// sum_s is kept; the caller copies it to sum_d.
template <int N, bool kSameInv>
FSD_INLINE void stat_add(RowStat& st, int64_t id, const float* raw, const StatScales& sc) {
  float vmax = raw[0];
#pragma unroll
  for (int i = 1; i < N; ++i) vmax = max_nan(vmax, raw[i]);
  if (FSD_RARE(!(fabsf(vmax) < kInf))) {  // a NaN, +inf, or every value -inf
    Values<N> values;
#pragma unroll
    for (int i = 0; i < N; ++i) values.v[i] = raw[i];
    st = stat_add_checked<N, kSameInv>(st, id, values, sc);
    return;
  }
  st.flags |= kHasFinite;
  if (FSD_RARE(vmax > st.max)) {  // a new maximum: its lowest id (earlier vectors hold only smaller values)
    int32_t arg = (int32_t)id;
#pragma unroll
    for (int i = N - 1; i >= 0; --i)
      if (raw[i] == vmax) arg = (int32_t)(id + i);
    st.sum_s = rescale(st.sum_s, st.max, vmax, sc.inv_s);
    if (!kSameInv) st.sum_d = rescale(st.sum_d, st.max, vmax, sc.inv_d);
    st.max = vmax;
    st.argmax = arg;
  }
  float sum_s = 0.0f, sum_d = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float diff = raw[i] - st.max;  // -inf for a -inf logit: 2^-inf = 0
    const float es = fast_exp2(diff * sc.log2_s);
    sum_s = i == 0 ? es : sum_s + es;
    if (!kSameInv) {
      const float ed = fast_exp2(diff * sc.log2_d);
      sum_d = i == 0 ? ed : sum_d + ed;
    }
  }
  st.sum_s += sum_s;
  if (!kSameInv) st.sum_d += sum_d;
}

// ---------------------------------------------------------------------------------------------
// Pass 2, plain path: p = softmax(z_t * inv_t), q = softmax(z_d * inv_d) over the whole row.

struct PlainPair {
  float max_t, max_d;      // row maxima (clamped)
  float scale_t, scale_d;  // inverse temperatures in log2 units
  float lsum_t, lsum_d;    // log2 of the sums of exponentials
};

FSD_INLINE PlainPair plain_pair(float max_t, float inv_t, double sum_t, float max_d, float inv_d, double sum_d) {
  return PlainPair{max_t, max_d, log2_scale(inv_t), log2_scale(inv_d), (float)::log2(sum_t), (float)::log2(sum_d)};
}

// What one unit of a term adds in nats: the log-based divergences are summed in bits, and js / mkl
// (js_mkl_add) leave out their factor 1/2 per term.
template <Divergence D>
constexpr double plain_term_unit() {
  return D == Divergence::TV ? 1.0 : (D == Divergence::JS || D == Divergence::MKL) ? 0.5 * kLn2 : kLn2;
}

// Twice the js / mkl term of one id, in bits, with hi = max(lp, lq), d = min(lp, lq) - hi <= 0 and
// r = 2^d, so that the midpoint m = (p + q) / 2 = 2^hi (1 + r) / 2 and
//   log2(m) = hi + L - 1,  L = log2(1 + r) in [0, 1]:
//   js:  p log2(p / m) + q log2(q / m) = (p + q) (1 - L) + min(p, q) d
//   mkl: m (2 log2 m - lp - lq)        = (p + q) (L - 1 - d / 2)
// Only L needs a logarithm, of 1 + r in [1, 2] where the SFU's is accurate to 2^-22 in absolute
// terms: the row's sum is then off by at most about 2^-22 bits (the weights p + q sum to 2, the
// factor 1/2 is in the unit), where log2 of each probability (|log2 m| up to ~17 on a flat row)
// would cost up to 17x that and lose it again in the difference lp - lm. The larger probability
// and r come from the SFU too (min(p, q) = 2^hi r): three SFU instructions per id, no branch.
// Also returns the residual term max(0, p - q).
// (Log2Fn: fast_log2; test_streaming.cu passes one that errs on purpose, to bound what the SFU's
// error does to a row's sum.)
struct FastLog2 {
  FSD_INLINE float operator()(float x) const { return fast_log2(x); }
};
template <Divergence D, typename Log2Fn = FastLog2>
FSD_INLINE float js_mkl_add(float lp, float lq, float& residual_term, Log2Fn log2_fn = {}) {
  const bool p_larger = lp > lq;
  const float hi = p_larger ? lp : lq;
  // fminf(NaN, 0) = 0: with p = q = 0 (hi = -inf) everything below comes out 0.
  const float d = fminf((p_larger ? lq : lp) - hi, 0.0f);  // -inf when only one of them is 0
  const float big = fast_exp2(hi), r = fast_exp2(d);
  const float small = big * r, both = big + small;
  residual_term = p_larger ? big - small : 0.0f;
  const float L = log2_fn(1.0f + r);
  // (small d: 0 when small is 0, also where d is -inf.)
  if (D == Divergence::JS) return both * (1.0f - L) + small * fmaxf(d, -FLT_MAX);
  // mkl: 0 where both are 0 in float64; otherwise p + q floored as divergence_term floors m, and
  // +inf where one probability is 0 by construction, also where the other flushed to 0 here: d =
  // -inf, or d below the bound, -2^67 in log2 units, where d 2^61 overflows to -inf (one multiply
  // where a compare and a select cost two; exact elsewhere, and hi is within 1075 of 0, far below
  // the bound's float rounding).
  static_assert(kLog2ZeroByConstructionBelow == -0x1p67f, "d * 2^61 overflows exactly below the bound");
  const float d_or_minus_inf = d * 0x1p61f;
  return hi > kLog2ZeroInDouble ? floored_prob(both) * fmaf(d_or_minus_inf, -0x1p-62f, L - 1.0f) : 0.0f;
}

// divergence_term's logarithm for kl, rkl and tv, which never call it.
struct NoLog {
  FSD_INLINE float operator()(float x) const { return x; }
};

// Adds one id's divergence term (in the unit of plain_term_unit) and residual max(0, p - q). zd is
// -inf beyond the draft vocabulary (q = 0 there).
// (fminf clamps +inf in one instruction; it would also turn a NaN into FLT_MAX, but a row with a
// NaN never reaches pass 2.)
template <Divergence D, bool kDiv, bool kResidual, typename Log2Fn = FastLog2>
FSD_INLINE void plain_add(const PlainPair& pl, float zt, float zd, float& div, float& residual, Log2Fn log2_fn = {}) {
  const float lp = fmaf(fminf(zt, FLT_MAX) - pl.max_t, pl.scale_t, -pl.lsum_t);  // log2 p
  const float lq = fmaf(fminf(zd, FLT_MAX) - pl.max_d, pl.scale_d, -pl.lsum_d);  // log2 q (-inf: q = 0)
  if (kDiv && (D == Divergence::JS || D == Divergence::MKL)) {
    float residual_term;
    div += js_mkl_add<D>(lp, lq, residual_term, log2_fn);
    if (kResidual) residual += residual_term;
    return;
  }
  const float pp = fast_exp2(lp), qq = fast_exp2(lq);
  if (kDiv) div += divergence_term<D, float>(pp, lp, qq, lq, NoLog{}, kLog2ZeroInDouble, kLog2ZeroByConstructionBelow);
  if (kResidual) residual += pp > qq ? pp - qq : 0.0f;
}

}  // namespace cuda
}  // namespace fsd
