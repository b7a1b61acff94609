// The per-dtype half of fsd_ext.accept's host launcher: kernel launches and the cluster path's
// occupancy query. Included once per logits dtype (accept_float.cu, accept_bf16.cu,
// accept_f16.cu), which instantiate it.
#pragma once

#include "fsd/cuda/accept.cuh"
#include "fsd/cuda/accept_plan.h"
#include "fsd/cuda/launch_util.h"

namespace fsd {
namespace cuda {

// kernel_config (launch_util.h) with one launch attribute (which the caller keeps alive until the
// launch).
inline cudaLaunchConfig_t attributed_config(unsigned grid, cudaStream_t stream, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = kernel_config(dim3(grid), stream);
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// The cluster kernel: clusters of `cluster` blocks along x.
inline cudaLaunchConfig_t cluster_config(unsigned grid, int64_t cluster, cudaStream_t stream,
                                        cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = (unsigned)cluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  return attributed_config(grid, stream, attribute);
}

// Whether a cluster of `cluster` blocks of accept_cluster_kernel<T> can be resident on the current
// device (asked once per device, dtype and cluster size).
template <typename T>
bool cluster_fits(int64_t cluster) {
  const auto kernel = accept_cluster_kernel<T>;
  struct Entry { int device = -1; int64_t cluster = 0; bool fits = false; };
  constexpr int kEntries = 16;
  static thread_local Entry cache[kEntries];
  static thread_local int next = 0;
  int device = 0;
  // An error already pending on this thread belongs to the caller: leave it there (and stay on the
  // other paths for this call) rather than clear it with ours.
  if (cudaPeekAtLastError() != cudaSuccess || cudaGetDevice(&device) != cudaSuccess) return false;
  for (const Entry& e : cache)
    if (e.device == device && e.cluster == cluster) return e.fits;
  // The kernel body exists only in code compiled for sm_90 or newer (not in, say, sm_80 PTX that the
  // driver compiled for this device).
  cudaFuncAttributes attributes;
  bool answered = cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess;
  bool fits = answered && attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90;
  if (fits) {
    answered = cluster <= 8 ||
               cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_config((unsigned)cluster, cluster, nullptr, &attribute);
    int clusters = 0;
    answered = answered && cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess;
    fits = answered && clusters > 0;
  }
  if (!answered) {
    (void)cudaGetLastError();  // our failed query (e.g. not allowed while a graph is captured)
    return false;              // not cached: ask again next time
  }
  cache[next] = Entry{device, cluster, fits};
  next = (next + 1) % kEntries;
  return fits;
}

// The wait exists only in code compiled for sm_90 or newer: sm_80 PTX that the driver compiled for
// this device has none, and launched early it would read the statistics before they are written.
// Asked once per device and dtype.
template <typename T>
bool decide_kernel_waits() {
  static thread_local int8_t cached[64] = {0};  // 0: not asked, 1: no, 2: yes
  int device = 0;
  // As in cluster_fits: an error already pending belongs to the caller.
  if (cudaPeekAtLastError() != cudaSuccess || cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64)
    return false;
  if (cached[device] == 0) {
    cudaFuncAttributes attributes;
    if (cudaFuncGetAttributes(&attributes, accept_decide_kernel<T>) != cudaSuccess) {
      (void)cudaGetLastError();  // our failed query: ask again next time
      return false;
    }
    cached[device] = attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90 ? 2 : 1;
  }
  return cached[device] == 2;
}

template <typename T>
cudaError_t launch_accept_typed(const AcceptProblem& pb, const AcceptPlan& plan, char* base, cudaStream_t stream) {
  AcceptWorkspace ws;
  ws.chunk_stats = reinterpret_cast<RowStat*>(base + plan.stats);
  ws.filters = plan.filtered ? reinterpret_cast<FilterInfo*>(base + plan.filters) : nullptr;
  ws.positions = reinterpret_cast<PositionInfo*>(base + plan.positions);
  ws.pass_two = reinterpret_cast<PassTwo*>(base + plan.pass_two);
  ws.counters = reinterpret_cast<uint32_t*>(base + plan.counters);
  ws.splits = plan.splits;
  ws.chunk = plan.chunk;
  ws.reverse_decide = plan.reverse_decide;
  const int64_t blocks = pb.batch * (pb.max_draft + 1) * plan.splits;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const unsigned grid = (unsigned)blocks;
  if (plan.clustered) {  // one launch; its row counters start from zero
    FSD_CUDA_CHECK(cudaMemsetAsync(ws.counters, 0, (size_t)pb.batch * sizeof(uint32_t), stream));
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_config(grid, plan.splits, stream, &attribute);
    FSD_CUDA_CHECK(cudaLaunchKernelEx(&config, accept_cluster_kernel<T>, pb, ws));
  } else if (plan.splits == 1) {  // one fused launch; its row counters start from zero
    FSD_CUDA_CHECK(cudaMemsetAsync(ws.counters, 0, (size_t)pb.batch * sizeof(uint32_t), stream));
    if (plan.filtered) FSD_CUDA_CHECK(launch_kernel(accept_stats_kernel<T, true, true>, grid, stream, pb, ws));
    else FSD_CUDA_CHECK(launch_kernel(accept_stats_kernel<T, false, true>, grid, stream, pb, ws));
  } else {
    FSD_CUDA_CHECK(launch_kernel(accept_stats_kernel<T, false, false>, grid, stream, pb, ws));
    if (plan.dependent_launch) {
      cudaLaunchAttribute attribute;
      attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
      const cudaLaunchConfig_t config = attributed_config(grid, stream, &attribute);
      FSD_CUDA_CHECK(cudaLaunchKernelEx(&config, accept_decide_kernel<T>, pb, ws));
    } else {
      FSD_CUDA_CHECK(launch_kernel(accept_decide_kernel<T>, grid, stream, pb, ws));
    }
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace fsd
