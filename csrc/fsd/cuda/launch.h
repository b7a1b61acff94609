// Host entry points of the CUDA kernels (framework-free: CUDA runtime only). Each launcher checks
// nothing about the problem (the torch binding did), enqueues its kernels on `stream` and returns
// the first CUDA error; none synchronises, allocates or copies, so all of them can be captured in
// a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "fsd/common.h"
#include "fsd/cuda/launch_options.h"

namespace fsd {
namespace cuda {

// Bytes of device workspace fsd_ext.accept needs for `problem` under `options` on the current
// device (a few records per row, position and vocabulary chunk; 256-byte aligned pieces).
size_t accept_workspace_bytes(const AcceptProblem& problem, const LaunchOptions& options);

// fsd_ext.accept: one or two launches (plus a memset of the row counters; see accept.cuh for the
// paths). `workspace` must hold accept_workspace_bytes(problem, options) bytes of device memory
// (uninitialised is fine; the same options, since they choose the chunks) and stay untouched until
// the launches finish.
cudaError_t launch_accept(const AcceptProblem& problem, const LaunchOptions& options, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

// fsd_ext.divergence: one launch, one block per row.
cudaError_t launch_divergence(const DivergenceProblem& problem, cudaStream_t stream);

// Bytes of device workspace fsd_ext.sample needs for `problem` under `options` on the current
// device: 0 on the one-block-per-row path, a few records per row and vocabulary chunk on the split
// path (few rows, no filter; rows.cuh).
size_t sample_workspace_bytes(const SampleProblem& problem, const LaunchOptions& options);

// fsd_ext.sample: one launch, one block per (row, position); or two on the split path, whose
// `workspace` must hold sample_workspace_bytes(problem, options) bytes of device memory
// (uninitialised is fine; nullptr when that is 0) and stay untouched until the launches finish.
cudaError_t launch_sample(const SampleProblem& problem, const LaunchOptions& options, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

// fsd_ext.philox_uniforms: out [rows, positions] float64 on the device.
cudaError_t launch_philox_uniforms(const RandomKey& key, int64_t rows, int64_t positions, Purpose purpose,
                                   double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace fsd
