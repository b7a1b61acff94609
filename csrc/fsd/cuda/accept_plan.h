// What the host planner of fsd_ext.accept (accept.cu) shares with the per-dtype launchers
// (accept_float.cu, accept_bf16.cu, accept_f16.cu: one translation unit per logits dtype, so the
// three compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fsd/common.h"
#include "fsd/cuda/device.cuh"

namespace fsd {
namespace cuda {

// Cluster path: a cluster of at most 16 blocks per (row, position) (above 8, the portable size,
// only where the device allows it).
constexpr int64_t kMaxCluster = 16;

// How one accept call is laid out: the path, the vocabulary chunks and the workspace offsets.
struct AcceptPlan {
  bool filtered = false;
  bool clustered = false;  // one launch of the cluster kernel
  bool dependent_launch = false;  // split path: kernel 2 by programmatic dependent launch
  bool reverse_decide = false;    // split path: kernel 2 takes the work in reverse order
  int64_t splits = 1, chunk = 0;
  size_t stats = 0, filters = 0, positions = 0, pass_two = 0, counters = 0, total = 0;
};

// Enqueues the kernels of `plan` for logits of type T (workspace at `base`).
template <typename T>
cudaError_t launch_accept_typed(const AcceptProblem& pb, const AcceptPlan& plan, char* base, cudaStream_t stream);

// Whether a cluster of `cluster` blocks of the cluster kernel can be resident on the current device
// (cached per device and cluster size).
template <typename T>
bool cluster_fits(int64_t cluster);

// Whether the split path's decision kernel, as the current device runs it, waits for the statistics
// grid (griddepcontrol.wait): only then may it be launched by programmatic dependent launch.
template <typename T>
bool decide_kernel_waits();

}  // namespace cuda
}  // namespace fsd
