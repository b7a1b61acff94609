// Host planner of fsd_ext.accept on CUDA: picks the path (fused, split, the opt-in cluster path),
// the vocabulary chunks and the workspace layout from the problem and the caller's LaunchOptions, then hands over to the per-dtype launcher
// (accept_typed.cuh; the kernels are in accept.cuh).
#include <algorithm>
#include <cstdio>

#include "fsd/cuda/accept.cuh"  // workspace records (no kernel is instantiated here)
#include "fsd/cuda/accept_plan.h"
#include "fsd/cuda/launch.h"
#include "fsd/cuda/launch_util.h"

namespace fsd {
namespace cuda {
namespace {

// With enough rows, vocabulary chunks of at most this many ids (when the step samples or needs
// divergences): on the H200 at B=64 they beat whole rows in one fused launch and 4x smaller chunks
// (docs/cuda.md, "Measured on a GPU"). A whole-row block ends with the row's inverse-CDF scan
// over up to V ids on one block, and 6 rows of blocks per batch row leave the last wave half empty.
constexpr int64_t kBatchChunk = 16384;

// f(T{}) for the logits type T of `dtype` (the per-dtype launchers are templates); `otherwise` for
// a dtype no launcher has.
template <typename R, typename F>
R with_logits_type(DType dtype, R otherwise, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(float{});
    case DType::BFloat16: return f(BFloat16{});
    case DType::Float16: return f(Float16{});
  }
  return otherwise;
}

// The opt-in paths need sm_90+: thread-block clusters, and a decision kernel that waits for the
// statistics grid (decide_kernel_waits) before a dependent launch may start it early.
bool cluster_path_allowed() { return compute_capability_major() >= 9; }

bool dependent_launch_allowed(DType dtype) {
  if (compute_capability_major() < 9) return false;
  return with_logits_type(dtype, false, [](auto t) { return decide_kernel_waits<decltype(t)>(); });
}

bool cluster_fits_dtype(DType dtype, int64_t cluster) {
  return with_logits_type(dtype, false, [&](auto t) { return cluster_fits<decltype(t)>(cluster); });
}

// The vocabulary chunk of each of `n` cluster blocks (a multiple of 64 ids).
int64_t cluster_chunk(int64_t vocab, int64_t n) { return ((vocab + n - 1) / n + 63) / 64 * 64; }

// LaunchOptions::cluster: the split path's chunks as one launch of clusters, the smallest
// power of two of at least the planner's chunk count (at most kMaxCluster), halved while the
// vocabulary does not fill that many chunks or the device cannot hold such a cluster.
void plan_cluster(const AcceptProblem& pb, AcceptPlan& plan) {
  int64_t cluster = 1;
  while (cluster < plan.splits && cluster < kMaxCluster) cluster *= 2;
  for (; cluster >= 2 && !plan.clustered; cluster /= 2) {
    const int64_t chunk = cluster_chunk(pb.target_vocab, cluster);
    if ((pb.target_vocab + chunk - 1) / chunk == cluster && cluster_fits_dtype(pb.dtype, cluster)) {
      plan.clustered = true;
      plan.splits = cluster;
      plan.chunk = chunk;
    }
  }
}

AcceptPlan plan_accept(const AcceptProblem& pb, const LaunchOptions& options) {
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
    const int64_t by_vocab = std::max<int64_t>(1, (pb.target_vocab + kMinChunk - 1) / kMinChunk);
    if (blocks > 0 && blocks < want_blocks) {
      plan.splits = std::max<int64_t>(1, std::min({(want_blocks + blocks - 1) / blocks, by_vocab, kMaxSplits}));
    } else if (pb.rule != Rule::Greedy || pb.need_divergence) {
      // Greedy without divergences reads each row once and never samples: whole rows stay faster
      // there (the same H200 run: docs/cuda.md).
      plan.splits = std::min((pb.target_vocab + kBatchChunk - 1) / kBatchChunk, kMaxSplits);
    }
    if (const int64_t requested = splits_requested(options); requested > 0)
      plan.splits = std::min(requested, by_vocab);
    if (plan.splits > 1 && options.cluster && cluster_path_allowed()) plan_cluster(pb, plan);
  }
  if (!plan.clustered) {
    const int64_t granule = 2048;
    plan.chunk = ((pb.target_vocab + plan.splits - 1) / plan.splits + granule - 1) / granule * granule;
    plan.splits = (pb.target_vocab + plan.chunk - 1) / plan.chunk;
    plan.dependent_launch = plan.splits > 1 && options.dependent_launch && dependent_launch_allowed(pb.dtype);
    plan.reverse_decide = plan.splits > 1 && options.reverse_decide;
  }
  const size_t rows = (size_t)pb.batch, pos = (size_t)positions, splits = (size_t)plan.splits;
  plan.stats = 0;
  plan.filters = plan.stats + align_up(rows * pos * 2 * splits * sizeof(RowStat));
  plan.positions = plan.filters + (plan.filtered ? align_up(rows * pos * 2 * sizeof(FilterInfo)) : 0);
  plan.pass_two = plan.positions + align_up(rows * pos * sizeof(PositionInfo));
  plan.counters = plan.pass_two + align_up(rows * pos * splits * sizeof(PassTwo));
  plan.total = plan.counters + align_up(rows * sizeof(uint32_t));
  return plan;
}

}  // namespace

size_t accept_workspace_bytes(const AcceptProblem& problem, const LaunchOptions& options) {
  return plan_accept(problem, options).total;
}

cudaError_t launch_accept(const AcceptProblem& problem, const LaunchOptions& options, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  if (problem.batch == 0) return cudaSuccess;
  const AcceptPlan plan = plan_accept(problem, options);
  if (workspace == nullptr || workspace_bytes < plan.total) return cudaErrorInvalidValue;
  if (options.log) {
    const char* path = plan.clustered     ? "cluster"
                       : plan.splits > 1 ? "split"
                       : plan.filtered   ? "fused-filtered"
                                         : "fused";
    std::fprintf(stderr, "fsd_ext.accept cuda: path=%s splits=%lld chunk=%lld pdl=%d reverse=%d\n", path,
                 (long long)plan.splits, (long long)plan.chunk, (int)plan.dependent_launch, (int)plan.reverse_decide);
  }
  char* base = static_cast<char*>(workspace);
  return with_logits_type(problem.dtype, cudaErrorInvalidValue, [&](auto t) {
    return launch_accept_typed<decltype(t)>(problem, plan, base, stream);
  });
}

}  // namespace cuda
}  // namespace fsd
