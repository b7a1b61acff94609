// Host-side helpers shared by the CUDA launchers: the error-check macro, the one launch form, the SM
// count and the compute capability.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "fsd/common.h"
#include "fsd/cuda/device.cuh"
#include "fsd/cuda/launch_options.h"

// Returns the error of a CUDA runtime call from the enclosing function (which returns cudaError_t).
#define FSD_CUDA_CHECK(expr)                  \
  do {                                        \
    const cudaError_t fsd_error_ = (expr);    \
    if (fsd_error_ != cudaSuccess) return fsd_error_; \
  } while (0)

namespace fsd {
namespace cuda {

// Launch configuration of `grid` blocks of kThreads on `stream` (no dynamic shared memory), no
// launch attributes.
inline cudaLaunchConfig_t kernel_config(dim3 grid, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  return config;
}

// Launches `kernel` on `grid` blocks of kThreads on `stream` and returns the launch's error.
// cudaLaunchKernelEx, not <<< >>>: the one launch form of the library (the cluster and dependent
// launches need it anyway), which the CPU simulation of the kernels (csrc/fsd/tests/cuda_sim) also
// implements.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, cudaStream_t stream, Args&&... args) {
  const cudaLaunchConfig_t config = kernel_config(grid, stream);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// An attribute of the current device, queried once per device (kSlot: one cache per attribute);
// `fallback` when there is no device or the query fails.
template <int kSlot>
inline int cached_device_attribute(cudaDeviceAttr attribute, int fallback) {
  static int cached[64] = {0};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return fallback;
  if (cached[device] == 0) {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess || value <= 0) value = fallback;
    cached[device] = value;
  }
  return cached[device];
}

// The start of a workspace piece: 256-byte aligned, as cudaMalloc's memory.
inline size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

// Vocabulary chunks of the split paths (accept, sample): at least kMinChunk ids each, at most
// kMaxSplits per row.
constexpr int64_t kMinChunk = 4096;
constexpr int64_t kMaxSplits = 64;

// LaunchOptions::splits as a planner takes it: at most kMaxSplits chunks (0: the planner's choice).
inline int64_t splits_requested(const LaunchOptions& options) { return std::min(options.splits, kMaxSplits); }

// Streaming multiprocessors of the current device (no synchronisation).
inline int multiprocessor_count() { return cached_device_attribute<0>(cudaDevAttrMultiProcessorCount, 132); }

// Major compute capability of the current device (0 when unknown).
inline int compute_capability_major() {
  return cached_device_attribute<1>(cudaDevAttrComputeCapabilityMajor, 0);
}

}  // namespace cuda
}  // namespace fsd
