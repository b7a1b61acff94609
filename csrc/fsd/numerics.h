// Numerics the CPU and CUDA kernels share, defined once for both (host and device): the logits'
// storage types and their conversion to float, the +inf clamp of a logit, and the per-row
// distribution record Dist. Each backend keeps only its parallel code (cpu/vec.h, cuda/device.cuh).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fsd/common.h"

// Host and device, always inlined: the CPU's vector loops call these per element and vectorise only
// what is inlined.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define FSD_NUMERIC FSD_HOST_DEVICE __forceinline__
#elif defined(__GNUC__)
#define FSD_NUMERIC inline __attribute__((always_inline))
#else
#define FSD_NUMERIC inline
#endif

namespace fsd {

constexpr float kInf = __builtin_huge_valf();

// Storage types of the logits (bit patterns; converted to float on load).
struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };

FSD_NUMERIC float bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

FSD_NUMERIC uint32_t float_to_bits(float value) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

FSD_NUMERIC float to_float(float x) { return x; }
FSD_NUMERIC float to_float(BFloat16 x) { return bits_to_float((uint32_t)x.bits << 16); }
FSD_NUMERIC float to_float(Float16 x) {
#ifdef __CUDA_ARCH__
  float out;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(out) : "h"(x.bits));
  return out;
#else
  // Shift the half's exponent and mantissa into float position, then rescale the exponent bias
  // (15 -> 127) with one multiply; this also turns half subnormals into the right floats.
  const uint32_t magnitude = x.bits & 0x7FFFu;
  float value = bits_to_float(magnitude << 13) * 0x1p112f;
  const float special = bits_to_float((magnitude << 13) | 0x7F800000u);  // inf / NaN
  value = magnitude >= 0x7C00u ? special : value;
  return bits_to_float(float_to_bits(value) | ((uint32_t)(x.bits & 0x8000u) << 16));
#endif
}

// A logit as the kernels see it: +inf counts as the largest finite float (docs/design.md: the
// limit of a huge logit), so softmax stays defined; NaN stays NaN (it only reaches invalid rows).
FSD_NUMERIC float clamp_logit(float x) { return x == kInf ? FLT_MAX : x; }

// A distribution over one vocabulary row, described by the logits plus a few scalars:
//   s_j = (z_j - max) * inv,   log p_j = s_j - log_sum  if s_j >= cut,  else -inf
// or one-hot at `one_hot` (temperature 0). No default member values: CUDA keeps it in shared
// memory, which takes no initialiser; softmax_dist / one_hot_dist make one.
struct Dist {
  float max;
  float inv;       // 1 / temperature (inverse_temperature)
  float cut;       // filter cutoff in s-space; -inf = no filter
  float log_sum;   // (float) log(sum)
  double sum;      // sum over kept j of exp(s_j)
  int64_t one_hot; // >= 0: one-hot at this id

  FSD_NUMERIC bool plain() const { return one_hot < 0 && cut == -kInf; }
  FSD_NUMERIC float scaled(float logit) const { return (logit - max) * inv; }
  // log p_j in float.
  FSD_NUMERIC float log_prob(float logit, int64_t id) const {
    if (one_hot >= 0) return id == one_hot ? 0.0f : -kInf;
    const float s = scaled(logit);
    return s >= cut ? s - log_sum : -kInf;
  }
  // log p_j in float as a select of both values: GCC vectorises this form in the CPU's row loops
  // and not log_prob's. A member, not a lambda there: GCC 13.2-14.2 (Ubuntu 24.04's g++-13/14,
  // Debian 13's g++) crash in the targetclone pass (ICE in add_to_same_comdat_group) when a lambda
  // that calls another lambda of the same inline or template function instantiates an
  // FSD_CPU_CLONES template such as sum_range.
  FSD_NUMERIC float log_prob_float(float logit, int64_t id) const {
    const float s = scaled(logit), lp = s - log_sum;
    const float kept = s >= cut ? lp : -kInf;
    const float hot = id == one_hot ? 0.0f : -kInf;
    return one_hot >= 0 ? hot : kept;
  }
  // log p_j in double (the acceptance decision and the reference comparison want the precision).
  FSD_NUMERIC double log_prob_precise(float logit, int64_t id) const {
    if (one_hot >= 0) return id == one_hot ? 0.0 : -(double)kInf;
    const float s = scaled(logit);
    return s >= cut ? (double)s - ::log(sum) : -(double)kInf;
  }
  // log of the largest probability (that of the row's maximum, which no filter cuts).
  FSD_NUMERIC double log_max_prob() const { return one_hot >= 0 ? 0.0 : -::log(sum); }
};

// A softmax at inverse temperature `inv` with cutoff `cut` and sum `sum` of the kept exp(s_j).
FSD_NUMERIC Dist softmax_dist(float max, float inv, float cut, double sum) {
  return Dist{max, inv, cut, (float)::log(sum), sum, -1};
}

FSD_NUMERIC Dist one_hot_dist(float max, int64_t id) { return Dist{max, 1.0f, -kInf, 0.0f, 1.0, id}; }

}  // namespace fsd
