// The torch binding: op schemas (once, here) and the CPU implementations. The CUDA implementations
// register for the same schemas in ops_cuda.cpp when the extension is built with CUDA.
#include <Python.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fsd/cpu/kernels.h"
#include "torch/problem.h"

// `import fsd_ext._C` loads this library, which registers the ops below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace fsd_torch {
namespace {

void torch_parallel_for(int64_t count, int64_t grain, const fsd::cpu::RangeFn& body) {
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { body(begin, end); });
}

// Draft ids must lie in the draft vocabulary for every position a row uses. Checked here (one pass
// over [B, K] ints) so the CPU path raises; the CUDA kernel cannot raise without a host sync and
// marks such a row invalid instead.
void check_draft_tokens(const Tensor& tokens, const OptTensor& num_draft, int64_t draft_vocab) {
  const int64_t batch = tokens.size(0), k = tokens.size(1);
  const Tensor ids = tokens.to(at::kLong);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* nd = num_draft.has_value() ? num_draft->data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = nd ? nd[b] : k;
    TORCH_CHECK(used >= 0 && used <= k, "num_draft[", b, "] = ", used, " must be in [0, K=", k, "]");
    for (int64_t i = 0; i < used; ++i) {
      TORCH_CHECK(id[b * k + i] >= 0 && id[b * k + i] < draft_vocab, "draft_tokens[", b, ", ", i,
                  "] = ", id[b * k + i], " is outside the draft vocabulary [0, ", draft_vocab, ")");
    }
  }
}

// Per-row float arguments given as tensors must hold valid values too (the scalar forms are
// checked in problem.h); on the CPU reading them is free. ValueError, as for the scalar forms.
void check_row_values(const OptTensor& values, const RowArg& arg) {
  if (!values.has_value()) return;
  const float* v = values->data_ptr<float>();
  for (int64_t b = 0; b < values->numel(); ++b)
    TORCH_CHECK_VALUE(arg.in_range(v[b]), arg.name, "[", b, "] = ", v[b], " must be ", arg.range);
}

// An offset tensor must hold a value >= 0 like the int form (problem.h); the CUDA kernels read it on
// the device (graph-capturable), so only the CPU path can raise.
void check_offset_value(const OptTensor& offset_t) {
  if (!offset_t.has_value()) return;
  const int64_t offset = offset_t->data_ptr<int64_t>()[0];
  TORCH_CHECK_VALUE(offset >= 0, "offset must be >= 0, got ", offset);
}

AcceptResult accept_cpu(const AcceptArgs& args) {
  AcceptOutputs out;
  const fsd::AcceptProblem problem = make_accept_problem(args, out);
  check_draft_tokens(args.draft_tokens, args.num_draft, problem.draft_vocab);
  check_row_values(args.threshold_t, kThresholdArg);
  check_row_values(args.temperature_t, kTemperatureArg);
  if (!args.div_uses_sampling) check_row_values(args.div_temperature_t, kDivTemperatureArg);
  check_offset_value(args.offset_t);
  fsd::cpu::accept(problem, torch_parallel_for);
  return {out.tokens, out.num_accepted, out.valid, out.divergence};
}

Tensor divergence_cpu(const Tensor& target_logits, const Tensor& draft_logits, int64_t kind,
                      double temperature, int64_t top_k) {
  Tensor out;
  const fsd::DivergenceProblem problem =
      make_divergence_problem(target_logits, draft_logits, kind, temperature, top_k, out);
  fsd::cpu::divergence(problem, torch_parallel_for);
  return out;
}

Tensor sample_cpu(const Tensor& logits, const OptTensor& temperature_t, double temperature, int64_t top_k,
                  double top_p, double min_p, const OptTensor& seed_t, int64_t seed, bool seed_per_row,
                  const OptTensor& offset_t, int64_t offset) {
  Tensor out;
  const fsd::SampleProblem problem = make_sample_problem(logits, temperature_t, temperature, top_k, top_p,
                                                         min_p, seed_t, seed, seed_per_row, offset_t,
                                                         offset, out);
  check_row_values(temperature_t, kTemperatureArg);
  check_offset_value(offset_t);
  fsd::cpu::sample(problem, torch_parallel_for);
  return out;
}

Tensor philox_uniforms_cpu(const Tensor& seed, const Tensor& offset, bool seed_per_row, int64_t rows,
                           int64_t positions, int64_t purpose) {
  check_uniform_args(seed, offset, seed_per_row, rows, positions, purpose);
  const fsd::RandomKey key = random_key(seed, 0, seed_per_row, offset, 0, rows, seed);
  check_offset_value(offset);
  Tensor out = at::empty({rows, positions}, seed.options().dtype(at::kDouble));
  fsd::cpu::philox_uniforms(key, rows, positions, (fsd::Purpose)purpose, out.data_ptr<double>());
  return out;
}

}  // namespace
}  // namespace fsd_torch

TORCH_LIBRARY(fsd_ext, m) {
  m.def(
      "accept(Tensor target_logits, Tensor draft_logits, Tensor draft_tokens, Tensor? num_draft, "
      "Tensor? threshold_t, float threshold, Tensor? temperature_t, float temperature, "
      "Tensor? div_temperature_t, float div_temperature, bool div_uses_sampling, Tensor? seed_t, "
      "int seed, bool seed_per_row, Tensor? offset_t, int offset, int rule, int divergence, "
      "int top_k, float top_p, float min_p, int div_top_k, bool return_divergence) "
      "-> (Tensor tokens, Tensor num_accepted, Tensor valid, Tensor divergence)");
  m.def("divergence(Tensor target_logits, Tensor draft_logits, int kind, float temperature, int top_k) -> Tensor");
  m.def(
      "sample(Tensor logits, Tensor? temperature_t, float temperature, int top_k, float top_p, "
      "float min_p, Tensor? seed_t, int seed, bool seed_per_row, Tensor? offset_t, int offset) -> Tensor");
  m.def(
      "philox_uniforms(Tensor seed, Tensor offset, bool seed_per_row, int rows, int positions, "
      "int purpose) -> Tensor");
}

TORCH_LIBRARY_IMPL(fsd_ext, CPU, m) {
  m.impl("accept", &fsd_torch::accept_op<fsd_torch::accept_cpu>);
  m.impl("divergence", &fsd_torch::divergence_cpu);
  m.impl("sample", &fsd_torch::sample_cpu);
  m.impl("philox_uniforms", &fsd_torch::philox_uniforms_cpu);
}

// The ops are not differentiable (token ids, flags; the divergences have no backward): a
// fallthrough Autograd kernel makes their outputs plain tensors even for inputs that require grad,
// instead of the autograd-not-implemented fallback that warns and backpropagates nothing.
TORCH_LIBRARY_IMPL(fsd_ext, Autograd, m) {
  m.impl("accept", torch::CppFunction::makeFallthrough());
  m.impl("divergence", torch::CppFunction::makeFallthrough());
  m.impl("sample", torch::CppFunction::makeFallthrough());
  m.impl("philox_uniforms", torch::CppFunction::makeFallthrough());
}
