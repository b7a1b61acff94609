// What the CPU linear kernels share: their ParallelFor (the torch binding passes at::parallel_for;
// tests a serial or chunked loop), float bit casts, and the weight dtypes. The component includes
// no header of the FSD core but the shared compiler attributes (common/simd.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>

#include "common/simd.h"

namespace fsd_cpu_linear {

using RangeFn = std::function<void(int64_t begin, int64_t end)>;
using ParallelFor = std::function<void(int64_t count, int64_t grain, const RangeFn& body)>;

// Runs body(0, count) on the calling thread.
inline void serial_for(int64_t count, int64_t /*grain*/, const RangeFn& body) {
  if (count > 0) body(0, count);
}

enum class WeightDType : int32_t { Float32 = 0, BFloat16 = 1 };

FSD_ALWAYS_INLINE float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

FSD_ALWAYS_INLINE uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

}  // namespace fsd_cpu_linear
