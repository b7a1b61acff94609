// Building blocks of the CPU kernels that the compiler can vectorise: logit loads and branch-free
// exp/log (the dtypes and their conversions: fsd/numerics.h, shared with CUDA). The row loops in
// row_ops.h process kLanes elements at a time with fixed-size lane arrays, which GCC and Clang
// turn into SIMD code (SSE2, or AVX/AVX2/AVX-512 clones, see FSD_CPU_CLONES) without intrinsics,
// so the same source builds anywhere.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/simd.h"
#include "fsd/numerics.h"


namespace fsd {
namespace cpu {

constexpr int kLanes = 16;

// The shared numerics (fsd/numerics.h) under the names the CPU code uses.
using fsd::BFloat16;
using fsd::bits_to_float;
using fsd::clamp_logit;
using fsd::Dist;
using fsd::Float16;
using fsd::float_to_bits;
using fsd::kInf;
using fsd::one_hot_dist;
using fsd::softmax_dist;
using fsd::to_float;

// A logit as the kernels see it (clamp_logit: +inf counts as FLT_MAX).
template <typename T>
FSD_ALWAYS_INLINE float load_logit(const T* row, int64_t j) {
  return clamp_logit(to_float(row[j]));
}

// exp(x) for x <= 0 (all the kernels need), within 2 ulp of std::exp; exactly 0 below -87 and for
// -inf. Cody-Waite range reduction and the Cephes expf polynomial.
FSD_ALWAYS_INLINE float exp_nonpositive(float x) {
  const float clamped = x > -87.0f ? (x < 0.0f ? x : 0.0f) : -87.0f;
  const float t = clamped * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 trick
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = bits_to_float((uint32_t)((int32_t)n + 127) << 23);
  return x > -87.0f ? y * scale : 0.0f;
}

// log(x) for x >= 0 (log 0 = -inf), within 2 ulp of std::log for normal x. Cephes logf.
FSD_ALWAYS_INLINE float log_nonnegative(float x) {
  const float safe = x > FLT_MIN ? x : FLT_MIN;
  const uint32_t bits = float_to_bits(safe);
  float e = (float)((int32_t)(bits >> 23) - 126);
  float m = bits_to_float((bits & 0x007FFFFFu) | 0x3F000000u);  // mantissa in [0.5, 1)
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1.0f : e;
  m = low ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += e * -2.12194440e-4f;
  y += -0.5f * z;
  const float result = (m + y) + e * 0.693359375f;
  return x > 0.0f ? result : -kInf;
}

struct FastLog {
  FSD_ALWAYS_INLINE float operator()(float x) const { return log_nonnegative(x); }
};

struct PreciseLog {
  inline double operator()(double x) const { return std::log(x); }
};

// Float lanes are flushed into a double every this many elements, so sums over 262144 entries
// keep ~1e-7 relative accuracy.
constexpr int64_t kFlushEvery = 1024;

}  // namespace cpu
}  // namespace fsd
