// The torch binding: op schemas (once, here) and the CPU implementations. The CUDA implementations
// register for the same schemas in ops_cuda.cpp when the extension is built with CUDA.
#include <Python.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fsd/cpu/kernels.h"
#include "fsd/cpu/quant_gemm.h"
#include "fsd/cpu/skinny_gemm.h"
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
// checked in problem.h); on the CPU reading them is free.
void check_row_values(const OptTensor& values, const RowArg& arg) {
  if (!values.has_value()) return;
  const float* v = values->data_ptr<float>();
  for (int64_t b = 0; b < values->numel(); ++b)
    TORCH_CHECK(arg.in_range(v[b]), arg.name, "[", b, "] = ", v[b], " must be ", arg.range);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> accept_cpu(
    const Tensor& target_logits, const Tensor& draft_logits, const Tensor& draft_tokens,
    const OptTensor& num_draft, const OptTensor& threshold_t, double threshold,
    const OptTensor& temperature_t, double temperature, const OptTensor& div_temperature_t,
    double div_temperature, bool div_uses_sampling, const OptTensor& seed_t, int64_t seed,
    bool seed_per_row, const OptTensor& offset_t, int64_t offset, int64_t rule, int64_t divergence,
    int64_t top_k, double top_p, double min_p, int64_t div_top_k, bool return_divergence) {
  AcceptOutputs out;
  const AcceptArgs args{target_logits, draft_logits, draft_tokens, num_draft, threshold_t, threshold,
                        temperature_t, temperature, div_temperature_t, div_temperature,
                        div_uses_sampling, seed_t, seed, seed_per_row, offset_t, offset, rule,
                        divergence, top_k, top_p, min_p, div_top_k, return_divergence};
  const fsd::AcceptProblem problem = make_accept_problem(args, out);
  check_draft_tokens(draft_tokens, num_draft, problem.draft_vocab);
  check_row_values(threshold_t, kThresholdArg);
  check_row_values(temperature_t, kTemperatureArg);
  if (!div_uses_sampling) check_row_values(div_temperature_t, kDivTemperatureArg);
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
  fsd::cpu::sample(problem, torch_parallel_for);
  return out;
}

Tensor philox_uniforms_cpu(const Tensor& seed, const Tensor& offset, bool seed_per_row, int64_t rows,
                           int64_t positions, int64_t purpose) {
  check_uniform_args(seed, offset, seed_per_row, rows, positions, purpose);
  const fsd::RandomKey key = random_key(seed, 0, seed_per_row, offset, 0, rows, seed);
  Tensor out = at::empty({rows, positions}, seed.options().dtype(at::kDouble));
  fsd::cpu::philox_uniforms(key, rows, positions, (fsd::Purpose)purpose, out.data_ptr<double>());
  return out;
}

// x [..., in] @ weight[out, in]^T + bias for at most kSkinnyMaxRows rows of x, all float32, all
// bfloat16, or float32 x and bias with a bfloat16 weight (cpu_linear.Bfloat16WeightLinear: half the
// weight bytes to read, the rest float32). As F.linear: the result has x's dtype; sums in float32,
// rounded once. The weight is read in place (rows of W must be contiguous); x and the bias are
// small and are made contiguous float32 copies (x stays bfloat16 for the AVX512-BF16 path).
Tensor skinny_linear_cpu(const Tensor& x, const Tensor& weight, const OptTensor& bias) {
  const auto dtype = x.scalar_type(), w_dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && (w_dtype == dtype || w_dtype == at::kBFloat16),
              "skinny_linear: x and weight must be both float32, both bfloat16, or float32 and bfloat16, got ",
              dtype, " and ", w_dtype);
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.size(0) >= 1,
              "skinny_linear: weight must be [out, in] with contiguous rows, got sizes ",
              weight.sizes(), " strides ", weight.strides());
  const int64_t in = weight.size(1), out = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "skinny_linear: x must be [..., ", in,
              "] to match weight [", out, ", ", in, "], got ", x.sizes());
  const int64_t rows = in > 0 ? x.numel() / in : 0;
  TORCH_CHECK(rows >= 1 && rows <= fsd::cpu::kSkinnyMaxRows, "skinny_linear: x must hold 1 to ",
              fsd::cpu::kSkinnyMaxRows, " rows of ", in, " (and in >= 1), got ", x.sizes());
  Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == out,
                "skinny_linear: bias must be a ", dtype, " [", out, "] (x's dtype), got ", bias->scalar_type(), " ",
                bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const Tensor x_stored = x.reshape({rows, in}).contiguous();
  // The AVX512-BF16 path reads bfloat16 x as stored; every other path needs it as float32.
  const bool bf16_dot = dtype == at::kBFloat16 && fsd::cpu::bf16_dot_available();
  const Tensor x_rows = bf16_dot ? Tensor() : x_stored.to(at::kFloat);
  Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  fsd::cpu::SkinnyGemm problem;
  problem.x = bf16_dot ? nullptr : x_rows.data_ptr<float>();
  problem.x_stride = in;
  if (dtype == at::kBFloat16) problem.x_bf16 = reinterpret_cast<const uint16_t*>(x_stored.data_ptr());
  problem.w = weight.data_ptr();
  problem.w_stride = weight.stride(0);
  problem.w_dtype = w_dtype == at::kBFloat16 ? fsd::DType::BFloat16 : fsd::DType::Float32;
  problem.bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  problem.y = y.data_ptr<float>();
  problem.y_stride = out;
  problem.rows = rows;
  problem.in = in;
  problem.out = out;
  fsd::cpu::skinny_gemm(problem, torch_parallel_for);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return (dtype == at::kFloat ? y : y.to(dtype)).view(shape);
}

// The repacked weight of a quant_linear / quant_dequantize call (fsd/cpu/quant_gemm.h's layout):
// codes uint8 [blocks, groups, 64 (Q4, Q8) or 128 (Q8G32)] and params float32 [blocks, groups, 8
// (Q4) or 4 (Q8, Q8G32)], both contiguous, for a matrix [out_features, groups x group size] with
// blocks = ceil(out_features / 4).
fsd::cpu::QuantWeights quant_weights(const char* op, const Tensor& codes, const Tensor& params, int64_t format,
                                     int64_t out_features) {
  TORCH_CHECK(format >= 0 && format <= 2, op, ": format must be 0 (Q4), 1 (Q8) or 2 (Q8G32), got ", format);
  const auto quant_format = static_cast<fsd::cpu::QuantFormat>(format);
  const int64_t param_count = fsd::cpu::quant_params_per_group(quant_format);
  const int64_t code_bytes = fsd::cpu::quant_code_bytes(quant_format);
  TORCH_CHECK(codes.device().is_cpu() && params.device().is_cpu(), op, ": codes and params must be CPU tensors");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == code_bytes &&
                  codes.is_contiguous(),
              op, ": codes must be a contiguous uint8 [blocks, groups, ", code_bytes, "], got ", codes.scalar_type(),
              " ", codes.sizes());
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.dim() == 3 && params.size(0) == codes.size(0) &&
                  params.size(1) == codes.size(1) && params.size(2) == param_count && params.is_contiguous(),
              op, ": params must be a contiguous float32 [", codes.size(0), ", ", codes.size(1), ", ", param_count,
              "] to match codes, got ", params.scalar_type(), " ", params.sizes());
  TORCH_CHECK(out_features >= 1 && (out_features + 3) / 4 == codes.size(0), op, ": out_features must be in (",
              4 * (codes.size(0) - 1), ", ", 4 * codes.size(0), "] for ", codes.size(0), " blocks of 4 rows, got ",
              out_features);
  TORCH_CHECK(codes.size(1) >= 1, op, ": codes must hold at least one group of columns, got ", codes.sizes());
  return {codes.data_ptr<uint8_t>(), params.data_ptr<float>(), quant_format,
          codes.size(1) * fsd::cpu::quant_group_size(quant_format), out_features};
}

// x [..., in] float32 times the repacked weight's transpose (+ bias float32 [out]): quant_linear
// for at most kQuantMaxRows rows (cpu_linear.QuantWeightLinear's decoding steps, exact weights),
// quant_linear_prompt for any number (its prompts, W and x rounded to bfloat16, float32 sums).
Tensor quant_product(const char* op, bool prompt, const Tensor& x, const Tensor& codes, const Tensor& params,
                     int64_t format, int64_t out_features, const OptTensor& bias) {
  const fsd::cpu::QuantWeights w = quant_weights(op, codes, params, format, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.in, op, ": x must be [..., ", w.in, "] to match the weight [", w.out,
              ", ", w.in, "], got ", x.sizes());
  const int64_t rows = x.numel() / w.in;
  TORCH_CHECK(rows >= 1 && (prompt || rows <= fsd::cpu::kQuantMaxRows), op, ": x must hold ",
              prompt ? "at least 1 row" : "1 to 16 rows", " of ", w.in, ", got ", x.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == w.out && bias->device().is_cpu(),
                op, ": bias must be a float32 [", w.out, "] CPU tensor, got ", bias->scalar_type(), " ", bias->sizes());
  }
  const Tensor x_rows = x.reshape({rows, w.in}).contiguous();
  const Tensor bias_c = bias.has_value() ? bias->contiguous() : Tensor();
  Tensor y = at::empty({rows, w.out}, x.options());
  fsd::cpu::QuantGemm problem;
  problem.w = w;
  problem.x = x_rows.data_ptr<float>();
  problem.x_stride = w.in;
  problem.bias = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  problem.y = y.data_ptr<float>();
  problem.y_stride = w.out;
  problem.rows = rows;
  if (prompt)
    fsd::cpu::quant_prompt_gemm(problem, torch_parallel_for);
  else
    fsd::cpu::quant_gemm(problem, torch_parallel_for);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.out;
  return y.view(shape);
}

Tensor quant_linear_cpu(const Tensor& x, const Tensor& codes, const Tensor& params, int64_t format,
                        int64_t out_features, const OptTensor& bias) {
  return quant_product("quant_linear", false, x, codes, params, format, out_features, bias);
}

Tensor quant_linear_prompt_cpu(const Tensor& x, const Tensor& codes, const Tensor& params, int64_t format,
                               int64_t out_features, const OptTensor& bias) {
  return quant_product("quant_linear_prompt", true, x, codes, params, format, out_features, bias);
}

// The repacked weight as float32, or rounded to bfloat16, [out_features, in] (the prompt path
// dequantises a few blocks of rows at a time for the BLAS).
Tensor quant_dequantize_cpu(const Tensor& codes, const Tensor& params, int64_t format, int64_t out_features,
                            std::optional<at::ScalarType> dtype) {
  const fsd::cpu::QuantWeights w = quant_weights("quant_dequantize", codes, params, format, out_features);
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "quant_dequantize: dtype must be float32 or bfloat16, got ", out_dtype);
  Tensor out = at::empty({w.out, w.in}, params.options().dtype(out_dtype));
  const bool bf16 = out_dtype == at::kBFloat16;
  fsd::cpu::quant_dequantize(w, 0, w.out, bf16 ? nullptr : out.data_ptr<float>(),
                             bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr, torch_parallel_for);
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
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Whether skinny_linear's bfloat16 products take the AVX512-BF16 path on this CPU (no tensors:
  // one kernel for every backend).
  m.def("skinny_linear_bf16_dot() -> bool", [] { return fsd::cpu::bf16_dot_available(); });
  // Whether skinny_linear takes the AVX2 + FMA path for float32 x on this CPU.
  m.def("skinny_linear_avx2() -> bool", [] { return fsd::cpu::avx2_available(); });
  m.def("quant_linear(Tensor x, Tensor codes, Tensor params, int format, int out_features, Tensor? bias) -> Tensor");
  // Any number of rows, W and x rounded to bfloat16 (fsd/cpu/quant_gemm.h: quant_prompt_gemm): AMX
  // tiles where quant_linear_amx(), else plain loops (slow: there a prompt takes quant_dequantize).
  m.def("quant_linear_prompt(Tensor x, Tensor codes, Tensor params, int format, int out_features, Tensor? bias) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor params, int format, int out_features, ScalarType? dtype=None) -> Tensor");
  // Which loops quant_linear runs on this CPU: "avx512", "avx2" or "portable".
  m.def("quant_linear_path() -> str", [] {
    return std::string(fsd::cpu::quant_avx512_available() ? "avx512"
                       : fsd::cpu::avx2_available() ? "avx2" : "portable");
  });
  // Whether quant_linear multiplies 10..16 rows (of a weight of 1024 rows or more) on AMX-BF16
  // tiles here: the CPU has them, Linux lets the process use them, quant_linear_use_amx has not
  // turned them off.
  m.def("quant_linear_amx() -> bool", [] { return fsd::cpu::quant_amx_available(); });
  // Turns the AMX path off or back on for the whole process; returns the previous setting.
  m.def("quant_linear_use_amx(bool enabled) -> bool",
        [](bool enabled) { return fsd::cpu::set_quant_amx_enabled(enabled); });
}

TORCH_LIBRARY_IMPL(fsd_ext, CPU, m) {
  m.impl("accept", &fsd_torch::accept_cpu);
  m.impl("divergence", &fsd_torch::divergence_cpu);
  m.impl("sample", &fsd_torch::sample_cpu);
  m.impl("philox_uniforms", &fsd_torch::philox_uniforms_cpu);
  m.impl("skinny_linear", &fsd_torch::skinny_linear_cpu);
  m.impl("quant_linear", &fsd_torch::quant_linear_cpu);
  m.impl("quant_linear_prompt", &fsd_torch::quant_linear_prompt_cpu);
  m.impl("quant_dequantize", &fsd_torch::quant_dequantize_cpu);
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
