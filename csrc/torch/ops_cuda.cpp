// The CUDA implementations of the fsd_ext ops (schemas in ops.cpp). Each checks and normalises its
// arguments with the shared builders of problem.h (the same checks and messages as on the CPU),
// allocates the outputs (and accept's small workspace) through the caching allocator, and
// enqueues the framework-free kernels of csrc/fsd/cuda on the current stream: no host
// synchronisation, no copy, so every op can be captured in a CUDA graph.
//
// Difference from the CPU binding: draft ids outside [0, V_d), num_draft outside [0, K] and values
// of per-row threshold / temperature / div_temperature tensors out of range cannot raise without a
// host sync; the kernel marks such a row invalid (valid=False, tokens -1; sample: token -1).
//
// Launch options: the planner's defaults, or what FSD_EXT_CUDA_LAUNCH asks for (experiments and
// benchmarks; docs/cuda.md, "Launch options"), read on every call so a test can change it.
//
// Compiled only into CUDA builds (setup.py drops *_cuda.cpp otherwise).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "fsd/cuda/launch.h"
#include "torch/problem.h"

namespace fsd_torch {
namespace {

void check_launch(cudaError_t error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, "fsd_ext.", op, ": CUDA launch failed: ", cudaGetErrorString(error));
}

void check_cuda(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor here, got ", t.device());
}

// The one switch of the CUDA launchers, e.g. FSD_EXT_CUDA_LAUNCH="splits=8,pdl=1,log=1".
fsd::cuda::LaunchOptions launch_options() {
  fsd::cuda::LaunchOptions options;
  const char* text = std::getenv("FSD_EXT_CUDA_LAUNCH");
  if (text == nullptr) return options;
  const std::string error = fsd::cuda::parse_launch_options(text, options);
  TORCH_CHECK(error.empty(), "FSD_EXT_CUDA_LAUNCH='", text, "': ", error);
  return options;
}

AcceptResult accept_cuda(const AcceptArgs& args) {
  const Tensor& target_logits = args.target_logits;
  check_cuda(target_logits, "target_logits");
  const c10::cuda::CUDAGuard device_guard(target_logits.device());
  AcceptOutputs out;
  const fsd::AcceptProblem problem = make_accept_problem(args, out);
  TORCH_CHECK(problem.max_draft < (int64_t(1) << 24), "K must be < 2^24, got ", problem.max_draft);
  const fsd::cuda::LaunchOptions options = launch_options();
  const size_t bytes = fsd::cuda::accept_workspace_bytes(problem, options);
  const Tensor workspace = at::empty({(int64_t)bytes}, target_logits.options().dtype(at::kByte));
  check_launch(fsd::cuda::launch_accept(problem, options, workspace.data_ptr(), bytes,
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "accept");
  return {out.tokens, out.num_accepted, out.valid, out.divergence};
}

Tensor divergence_cuda(const Tensor& target_logits, const Tensor& draft_logits, int64_t kind,
                       double temperature, int64_t top_k) {
  check_cuda(target_logits, "target_logits");
  const c10::cuda::CUDAGuard device_guard(target_logits.device());
  Tensor out;
  const fsd::DivergenceProblem problem =
      make_divergence_problem(target_logits, draft_logits, kind, temperature, top_k, out);
  TORCH_CHECK(problem.rows < (int64_t(1) << 31), "divergence: too many rows (", problem.rows, ")");
  check_launch(fsd::cuda::launch_divergence(problem, c10::cuda::getCurrentCUDAStream().stream()), "divergence");
  return out;
}

Tensor sample_cuda(const Tensor& logits, const OptTensor& temperature_t, double temperature, int64_t top_k,
                   double top_p, double min_p, const OptTensor& seed_t, int64_t seed, bool seed_per_row,
                   const OptTensor& offset_t, int64_t offset) {
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  Tensor out;
  const fsd::SampleProblem problem = make_sample_problem(logits, temperature_t, temperature, top_k, top_p,
                                                         min_p, seed_t, seed, seed_per_row, offset_t,
                                                         offset, out);
  TORCH_CHECK(problem.batch <= 65535, "sample: batch must be <= 65535 on CUDA, got ", problem.batch);
  TORCH_CHECK(problem.positions < (int64_t(1) << 31), "sample: too many positions");
  const fsd::cuda::LaunchOptions options = launch_options();
  const size_t bytes = fsd::cuda::sample_workspace_bytes(problem, options);  // 0 on the one-block path
  Tensor workspace;
  if (bytes > 0) workspace = at::empty({(int64_t)bytes}, logits.options().dtype(at::kByte));
  check_launch(fsd::cuda::launch_sample(problem, options, bytes ? workspace.data_ptr() : nullptr, bytes,
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "sample");
  return out;
}

Tensor philox_uniforms_cuda(const Tensor& seed, const Tensor& offset, bool seed_per_row, int64_t rows,
                            int64_t positions, int64_t purpose) {
  check_cuda(seed, "seed");
  const c10::cuda::CUDAGuard device_guard(seed.device());
  check_uniform_args(seed, offset, seed_per_row, rows, positions, purpose);
  const fsd::RandomKey key = random_key(seed, 0, seed_per_row, offset, 0, rows, seed);
  Tensor out = at::empty({rows, positions}, seed.options().dtype(at::kDouble));
  check_launch(fsd::cuda::launch_philox_uniforms(key, rows, positions, (fsd::Purpose)purpose,
                                                 out.data_ptr<double>(),
                                                 c10::cuda::getCurrentCUDAStream().stream()),
               "philox_uniforms");
  return out;
}

}  // namespace
}  // namespace fsd_torch

TORCH_LIBRARY_IMPL(fsd_ext, CUDA, m) {
  m.impl("accept", &fsd_torch::accept_op<fsd_torch::accept_cuda>);
  m.impl("divergence", &fsd_torch::divergence_cuda);
  m.impl("sample", &fsd_torch::sample_cuda);
  m.impl("philox_uniforms", &fsd_torch::philox_uniforms_cuda);
}
