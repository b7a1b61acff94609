// Instantiations and host launchers of fsd_ext.divergence, fsd_ext.sample and
// fsd_ext.philox_uniforms on CUDA (see rows.cuh).
#include "fsd/cuda/launch.h"
#include "fsd/cuda/launch_util.h"
#include "fsd/cuda/rows.cuh"

namespace fsd {
namespace cuda {

cudaError_t launch_divergence(const DivergenceProblem& problem, cudaStream_t stream) {
  if (problem.rows == 0) return cudaSuccess;
  if (problem.rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid((unsigned)problem.rows);
  switch (problem.dtype) {
    case DType::Float32: return launch_kernel(divergence_rows_kernel<float>, grid, stream, problem);
    case DType::BFloat16: return launch_kernel(divergence_rows_kernel<BFloat16>, grid, stream, problem);
    case DType::Float16: return launch_kernel(divergence_rows_kernel<Float16>, grid, stream, problem);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_sample(const SampleProblem& problem, cudaStream_t stream) {
  if (problem.batch == 0 || problem.positions == 0) return cudaSuccess;
  if (problem.positions > INT32_MAX || problem.batch > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid((unsigned)problem.positions, (unsigned)problem.batch);
  switch (problem.dtype) {
    case DType::Float32: return launch_kernel(sample_rows_kernel<float>, grid, stream, problem);
    case DType::BFloat16: return launch_kernel(sample_rows_kernel<BFloat16>, grid, stream, problem);
    case DType::Float16: return launch_kernel(sample_rows_kernel<Float16>, grid, stream, problem);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_philox_uniforms(const RandomKey& key, int64_t rows, int64_t positions, Purpose purpose,
                                   double* out, cudaStream_t stream) {
  const int64_t total = rows * positions;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 4096);
  return launch_kernel(philox_uniforms_kernel, dim3((unsigned)blocks), stream, key, rows, positions, purpose, out);
}

}  // namespace cuda
}  // namespace fsd
