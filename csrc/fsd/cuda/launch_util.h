// Host-side helpers shared by the CUDA launchers: the error-check macro, the SM count and the
// compute capability.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "fsd/common.h"
#include "fsd/cuda/device.cuh"

// Returns the error of a CUDA runtime call from the enclosing function (which returns cudaError_t).
#define FSD_CUDA_CHECK(expr)                  \
  do {                                        \
    const cudaError_t fsd_error_ = (expr);    \
    if (fsd_error_ != cudaSuccess) return fsd_error_; \
  } while (0)

namespace fsd {
namespace cuda {

// Streaming multiprocessors of the current device (queried once per device; no synchronisation).
inline int multiprocessor_count() {
  static int cached[64] = {0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0)
      count = 132;
    cached[device] = count;
  }
  return cached[device];
}

// Major compute capability of the current device (queried once per device; 0 when unknown).
inline int compute_capability_major() {
  static int cached[64] = {0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = -1;
    cached[device] = major;
  }
  return cached[device] > 0 ? cached[device] : 0;
}

}  // namespace cuda
}  // namespace fsd
