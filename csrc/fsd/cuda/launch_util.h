// Host-side helpers shared by the CUDA launchers: the error-check macro and the SM count.
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

}  // namespace cuda
}  // namespace fsd
