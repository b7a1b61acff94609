// The torch binding of the CPU linear kernels (fsd_ext.cpu_linear): op schemas under the
// `fsd_cpu_linear` namespace and their CPU implementations. A library of its own, so that the FSD
// ops (fsd_ext._C) neither build nor load these.
#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "cpu_linear/quant_gemm.h"
#include "cpu_linear/skinny_gemm.h"

// `import fsd_ext.cpu_linear._C` loads this library, which registers the ops below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace fsd_cpu_linear {
namespace {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

void torch_parallel_for(int64_t count, int64_t grain, const RangeFn& body) {
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { body(begin, end); });
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
  TORCH_CHECK(rows >= 1 && rows <= kSkinnyMaxRows, "skinny_linear: x must hold 1 to ",
              kSkinnyMaxRows, " rows of ", in, " (and in >= 1), got ", x.sizes());
  Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == out,
                "skinny_linear: bias must be a ", dtype, " [", out, "] (x's dtype), got ", bias->scalar_type(), " ",
                bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const Tensor x_stored = x.reshape({rows, in}).contiguous();
  // The AVX512-BF16 path reads bfloat16 x as stored; every other path needs it as float32.
  const bool bf16_dot = dtype == at::kBFloat16 && bf16_dot_available();
  const Tensor x_rows = bf16_dot ? Tensor() : x_stored.to(at::kFloat);
  Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  SkinnyGemm problem;
  problem.x = bf16_dot ? nullptr : x_rows.data_ptr<float>();
  problem.x_stride = in;
  if (dtype == at::kBFloat16) problem.x_bf16 = reinterpret_cast<const uint16_t*>(x_stored.data_ptr());
  problem.w = weight.data_ptr();
  problem.w_stride = weight.stride(0);
  problem.w_dtype = w_dtype == at::kBFloat16 ? WeightDType::BFloat16 : WeightDType::Float32;
  problem.bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  problem.y = y.data_ptr<float>();
  problem.y_stride = out;
  problem.rows = rows;
  problem.in = in;
  problem.out = out;
  skinny_gemm(problem, torch_parallel_for);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return (dtype == at::kFloat ? y : y.to(dtype)).view(shape);
}

// The repacked weight of a quant_linear / quant_dequantize call (cpu_linear/quant_gemm.h's layout):
// codes uint8 [blocks, groups, 64 (Q4, Q8) or 128 (Q8G32)] and params float32 [blocks, groups, 8
// (Q4) or 4 (Q8, Q8G32)], both contiguous, for a matrix [out_features, groups x group size] with
// blocks = ceil(out_features / 4).
QuantWeights quant_weights(const char* op, const Tensor& codes, const Tensor& params, int64_t format,
                                     int64_t out_features) {
  TORCH_CHECK(format >= 0 && format <= 2, op, ": format must be 0 (Q4), 1 (Q8) or 2 (Q8G32), got ", format);
  const auto quant_format = static_cast<QuantFormat>(format);
  const int64_t param_count = quant_params_per_group(quant_format);
  const int64_t code_bytes = quant_code_bytes(quant_format);
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
          codes.size(1) * quant_group_size(quant_format), out_features};
}

// x [..., in] float32 times the repacked weight's transpose (+ bias float32 [out]) for at most
// kQuantMaxRows rows (cpu_linear.QuantWeightLinear's decoding steps, exact weights).
Tensor quant_linear_cpu(const Tensor& x, const Tensor& codes, const Tensor& params, int64_t format,
                        int64_t out_features, const OptTensor& bias) {
  const char* op = "quant_linear";
  const QuantWeights w = quant_weights(op, codes, params, format, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.in, op, ": x must be [..., ", w.in, "] to match the weight [", w.out,
              ", ", w.in, "], got ", x.sizes());
  const int64_t rows = x.numel() / w.in;
  TORCH_CHECK(rows >= 1 && rows <= kQuantMaxRows, op, ": x must hold 1 to ", kQuantMaxRows,
              " rows of ", w.in, ", got ", x.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == w.out && bias->device().is_cpu(),
                op, ": bias must be a float32 [", w.out, "] CPU tensor, got ", bias->scalar_type(), " ", bias->sizes());
  }
  const Tensor x_rows = x.reshape({rows, w.in}).contiguous();
  const Tensor bias_c = bias.has_value() ? bias->contiguous() : Tensor();
  Tensor y = at::empty({rows, w.out}, x.options());
  QuantGemm problem;
  problem.w = w;
  problem.x = x_rows.data_ptr<float>();
  problem.x_stride = w.in;
  problem.bias = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  problem.y = y.data_ptr<float>();
  problem.y_stride = w.out;
  problem.rows = rows;
  quant_gemm(problem, torch_parallel_for);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.out;
  return y.view(shape);
}

// The repacked weight as float32, or rounded to bfloat16, [out_features, in] (the prompt path
// dequantises a few blocks of rows at a time for the BLAS).
Tensor quant_dequantize_cpu(const Tensor& codes, const Tensor& params, int64_t format, int64_t out_features,
                            std::optional<at::ScalarType> dtype) {
  const QuantWeights w = quant_weights("quant_dequantize", codes, params, format, out_features);
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "quant_dequantize: dtype must be float32 or bfloat16, got ", out_dtype);
  Tensor out = at::empty({w.out, w.in}, params.options().dtype(out_dtype));
  const bool bf16 = out_dtype == at::kBFloat16;
  quant_dequantize(w, 0, w.out, bf16 ? nullptr : out.data_ptr<float>(),
                             bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr, torch_parallel_for);
  return out;
}

}  // namespace
}  // namespace fsd_cpu_linear

TORCH_LIBRARY(fsd_cpu_linear, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Whether skinny_linear's bfloat16 products take the AVX512-BF16 path on this CPU (no tensors:
  // one kernel for every backend).
  m.def("skinny_linear_bf16_dot() -> bool", [] { return fsd_cpu_linear::bf16_dot_available(); });
  // Whether skinny_linear takes the AVX2 + FMA path for float32 x on this CPU.
  m.def("skinny_linear_avx2() -> bool", [] { return fsd_cpu_linear::avx2_available(); });
  m.def("quant_linear(Tensor x, Tensor codes, Tensor params, int format, int out_features, Tensor? bias) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor params, int format, int out_features, ScalarType? dtype=None) -> Tensor");
  // Which loops quant_linear runs on this CPU: "avx512", "avx2" or "portable".
  m.def("quant_linear_path() -> str", [] {
    return std::string(fsd_cpu_linear::quant_avx512_available() ? "avx512"
                       : fsd_cpu_linear::avx2_available() ? "avx2" : "portable");
  });
}

TORCH_LIBRARY_IMPL(fsd_cpu_linear, CPU, m) {
  m.impl("skinny_linear", &fsd_cpu_linear::skinny_linear_cpu);
  m.impl("quant_linear", &fsd_cpu_linear::quant_linear_cpu);
  m.impl("quant_dequantize", &fsd_cpu_linear::quant_dequantize_cpu);
}
