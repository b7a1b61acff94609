// Instantiations and host launcher of fsd_ext.accept on CUDA (see accept.cuh).
#include "fsd/cuda/accept.cuh"
#include "fsd/cuda/launch.h"
#include "fsd/cuda/launch_util.h"

namespace fsd {
namespace cuda {
namespace {

constexpr int64_t kMinChunk = 4096;  // ids per vocabulary chunk at least (split path)
constexpr int64_t kMaxSplits = 64;
constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct AcceptPlan {
  bool filtered = false;
  int64_t splits = 1, chunk = 0;
  size_t stats = 0, filters = 0, positions = 0, pass_two = 0, counters = 0, total = 0;
};

AcceptPlan plan_accept(const AcceptProblem& pb) {
  AcceptPlan plan;
  const int64_t positions = pb.max_draft + 1;
  plan.filtered = pb.filter.active() ||
                  (pb.need_divergence && pb.div_top_k > 0 && pb.div_top_k < pb.target_vocab);
  plan.splits = 1;
  if (!plan.filtered) {
    // Split the vocabulary when the batch alone leaves SMs idle (the fused kernel runs 2 blocks
    // per SM); then aim for ~4 blocks per SM.
    const int64_t sms = (int64_t)multiprocessor_count();
    const int64_t want_blocks = pb.batch * positions >= 2 * sms ? 0 : 4 * sms;
    const int64_t blocks = pb.batch * positions;
    if (blocks > 0 && blocks < want_blocks) {
      const int64_t by_vocab = (pb.target_vocab + kMinChunk - 1) / kMinChunk;
      plan.splits = std::max<int64_t>(1, std::min({(want_blocks + blocks - 1) / blocks, by_vocab, kMaxSplits}));
    }
  }
  const int64_t granule = 2048;
  plan.chunk = ((pb.target_vocab + plan.splits - 1) / plan.splits + granule - 1) / granule * granule;
  plan.splits = (pb.target_vocab + plan.chunk - 1) / plan.chunk;
  const size_t rows = (size_t)pb.batch, pos = (size_t)positions, splits = (size_t)plan.splits;
  plan.stats = 0;
  plan.filters = plan.stats + align_up(rows * pos * 2 * splits * sizeof(RowStat));
  plan.positions = plan.filters + (plan.filtered ? align_up(rows * pos * 2 * sizeof(FilterInfo)) : 0);
  plan.pass_two = plan.positions + align_up(rows * pos * sizeof(PositionInfo));
  plan.counters = plan.pass_two + align_up(rows * pos * splits * sizeof(PassTwo));
  plan.total = plan.counters + align_up(rows * sizeof(uint32_t));
  return plan;
}

template <typename T>
cudaError_t launch_typed(const AcceptProblem& pb, const AcceptPlan& plan, char* base, cudaStream_t stream) {
  AcceptWorkspace ws;
  ws.chunk_stats = reinterpret_cast<RowStat*>(base + plan.stats);
  ws.filters = plan.filtered ? reinterpret_cast<FilterInfo*>(base + plan.filters) : nullptr;
  ws.positions = reinterpret_cast<PositionInfo*>(base + plan.positions);
  ws.pass_two = reinterpret_cast<PassTwo*>(base + plan.pass_two);
  ws.counters = reinterpret_cast<uint32_t*>(base + plan.counters);
  ws.splits = plan.splits;
  ws.chunk = plan.chunk;
  const int64_t blocks = pb.batch * (pb.max_draft + 1) * plan.splits;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const unsigned grid = (unsigned)blocks;
  if (plan.splits == 1) {  // one fused launch; its row counters start from zero
    FSD_CUDA_CHECK(cudaMemsetAsync(ws.counters, 0, (size_t)pb.batch * sizeof(uint32_t), stream));
    if (plan.filtered) accept_stats_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(pb, ws);
    else accept_stats_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(pb, ws);
    FSD_CUDA_CHECK(cudaGetLastError());
  } else {
    accept_stats_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(pb, ws);
    FSD_CUDA_CHECK(cudaGetLastError());
    accept_decide_kernel<T><<<grid, kThreads, 0, stream>>>(pb, ws);
    FSD_CUDA_CHECK(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace

size_t accept_workspace_bytes(const AcceptProblem& problem) { return plan_accept(problem).total; }

cudaError_t launch_accept(const AcceptProblem& problem, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  if (problem.batch == 0) return cudaSuccess;
  const AcceptPlan plan = plan_accept(problem);
  if (workspace == nullptr || workspace_bytes < plan.total) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(workspace);
  switch (problem.dtype) {
    case DType::Float32: return launch_typed<float>(problem, plan, base, stream);
    case DType::BFloat16: return launch_typed<BFloat16>(problem, plan, base, stream);
    case DType::Float16: return launch_typed<Float16>(problem, plan, base, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fsd
