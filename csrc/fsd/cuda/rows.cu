// Instantiations and host launchers of fsd_ext.divergence, fsd_ext.sample and
// fsd_ext.philox_uniforms on CUDA (see rows.cuh).
#include <cstdio>

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

namespace {

// The sample op's path: one block per row (splits == 1), or the split path's chunks and workspace.
struct SamplePlan {
  int64_t splits = 1, chunk = 0;
  size_t stats = 0, totals = 0, counters = 0, total = 0;  // workspace layout (bytes)
};

// Few rows and no ranking filter (a top-k / top-p cutoff needs the whole row in one block; min-p
// needs only the row's maximum): chunks so that the grid holds about 4 blocks per SM, as accept's
// split path. The one-block kernel runs 2 blocks per
// SM, so from 2 rows per SM on every SM is busy without splitting.
SamplePlan plan_sample(const SampleProblem& pb, const LaunchOptions& options) {
  SamplePlan plan;
  const int64_t rows = pb.batch * pb.positions, sms = (int64_t)multiprocessor_count();
  if (pb.filter.ranks(pb.vocab) || rows == 0) return plan;
  const int64_t by_vocab = std::max<int64_t>(1, (pb.vocab + kMinChunk - 1) / kMinChunk);
  if (rows < 2 * sms) plan.splits = std::min({(4 * sms + rows - 1) / rows, by_vocab, kMaxSplits});
  if (const int64_t requested = splits_requested(options); requested > 0) plan.splits = std::min(requested, by_vocab);
  if (plan.splits <= 1) return SamplePlan{};
  const int64_t granule = 2048;
  plan.chunk = ((pb.vocab + plan.splits - 1) / plan.splits + granule - 1) / granule * granule;
  plan.splits = (pb.vocab + plan.chunk - 1) / plan.chunk;
  if (plan.splits <= 1) return SamplePlan{};
  const size_t pieces = (size_t)rows * (size_t)plan.splits;
  plan.totals = plan.stats + align_up(pieces * sizeof(RowStat));
  plan.counters = plan.totals + align_up(pieces * sizeof(double));
  plan.total = plan.counters + align_up((size_t)rows * sizeof(uint32_t));
  return plan;
}

template <typename T>
cudaError_t launch_sample_typed(const SampleProblem& pb, const SamplePlan& plan, char* base, cudaStream_t stream) {
  if (plan.splits == 1) {
    const dim3 grid((unsigned)pb.positions, (unsigned)pb.batch);
    return launch_kernel(sample_rows_kernel<T>, grid, stream, pb);
  }
  SampleWorkspace ws;
  ws.chunk_stats = reinterpret_cast<RowStat*>(base + plan.stats);
  ws.chunk_totals = reinterpret_cast<double*>(base + plan.totals);
  ws.counters = reinterpret_cast<uint32_t*>(base + plan.counters);
  ws.splits = plan.splits;
  ws.chunk = plan.chunk;
  const int64_t blocks = pb.batch * pb.positions * plan.splits;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  FSD_CUDA_CHECK(launch_kernel(sample_stats_kernel<T>, dim3((unsigned)blocks), stream, pb, ws));
  return launch_kernel(sample_draw_kernel<T>, dim3((unsigned)blocks), stream, pb, ws);
}

}  // namespace

size_t sample_workspace_bytes(const SampleProblem& problem, const LaunchOptions& options) {
  return plan_sample(problem, options).total;
}

cudaError_t launch_sample(const SampleProblem& problem, const LaunchOptions& options, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  if (problem.batch == 0 || problem.positions == 0) return cudaSuccess;
  if (problem.positions > INT32_MAX || problem.batch > 65535) return cudaErrorInvalidConfiguration;
  const SamplePlan plan = plan_sample(problem, options);
  if (plan.splits > 1 && (workspace == nullptr || workspace_bytes < plan.total)) return cudaErrorInvalidValue;
  if (options.log)
    std::fprintf(stderr, "fsd_ext.sample cuda: path=%s splits=%lld chunk=%lld\n", plan.splits > 1 ? "split" : "rows",
                 (long long)plan.splits, (long long)plan.chunk);
  char* base = static_cast<char*>(workspace);
  switch (problem.dtype) {
    case DType::Float32: return launch_sample_typed<float>(problem, plan, base, stream);
    case DType::BFloat16: return launch_sample_typed<BFloat16>(problem, plan, base, stream);
    case DType::Float16: return launch_sample_typed<Float16>(problem, plan, base, stream);
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
