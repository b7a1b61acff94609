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

#include "cpu_linear/int8_gemm.h"
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

void torch_parallel_for(int64_t count, int64_t grain, const fsd::cpu::RangeFn& body) {
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

// The repacked weight of a quant_linear / quant_dequantize call (cpu_linear/quant_gemm.h's layout):
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

// x [..., in] float32 times the repacked weight's transpose (+ bias float32 [out]) for at most
// kQuantMaxRows rows (cpu_linear.QuantWeightLinear's decoding steps, exact weights).
Tensor quant_linear_cpu(const Tensor& x, const Tensor& codes, const Tensor& params, int64_t format,
                        int64_t out_features, const OptTensor& bias) {
  const char* op = "quant_linear";
  const fsd::cpu::QuantWeights w = quant_weights(op, codes, params, format, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.in, op, ": x must be [..., ", w.in, "] to match the weight [", w.out,
              ", ", w.in, "], got ", x.sizes());
  const int64_t rows = x.numel() / w.in;
  TORCH_CHECK(rows >= 1 && rows <= fsd::cpu::kQuantMaxRows, op, ": x must hold 1 to ", fsd::cpu::kQuantMaxRows,
              " rows of ", w.in, ", got ", x.sizes());
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
  fsd::cpu::quant_gemm(problem, torch_parallel_for);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.out;
  return y.view(shape);
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

// A weight in int8_gemm.h's layout: uint8 [ceil(out_features / 16), tile bytes], contiguous, for a
// matrix [out_features, in] whose `in` the tile size gives.
Int8Weights int8_weights(const char* op, const Tensor& weight, int64_t format, int64_t out_features) {
  TORCH_CHECK(format >= 0 && format < kInt8FormatCount, op, ": format must be 0 (Q4_K), 1 (Q6_K), 2 (Q5_0) or 3 (Q8_0), got ",
              format);
  const auto f = static_cast<Int8Format>(format);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              op, ": weight must be a contiguous uint8 CPU tensor [tiles, tile bytes], got ", weight.scalar_type(), " ",
              weight.sizes(), " on ", weight.device());
  const int64_t block_bytes = int8_block_bytes(f);
  TORCH_CHECK(weight.size(1) >= block_bytes && weight.size(1) % block_bytes == 0, op, ": a tile of format ", format,
              " holds whole blocks of ", block_bytes, " bytes, got tiles of ", weight.size(1));
  TORCH_CHECK(out_features >= 1 && (out_features + kTileRows - 1) / kTileRows == weight.size(0), op,
              ": out_features must be in (", kTileRows * (weight.size(0) - 1), ", ", kTileRows * weight.size(0), "] for ",
              weight.size(0), " tiles of ", kTileRows, " rows, got ", out_features);
  return {weight.data_ptr<uint8_t>(), f, weight.size(1) / block_bytes * int8_block_cols(f), out_features};
}

// x [..., in] (float32; other floating dtypes are computed in float32 and cast back) times the
// transposes of weights[0], weights[1], ... side by side: y [..., sum of out_features] (+ bias
// float32 [sum of out_features]). x is quantised to int8 per group of 32 once (int8_gemm.h), and all
// products share one parallel region (a layer's q, k, v projections, or its gate and up ones).
Tensor int8_linear_cat_cpu(const Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                           at::IntArrayRef out_features, const OptTensor& bias) {
  const char* op = "int8_linear";
  const int64_t count = (int64_t)weights.size();
  TORCH_CHECK(count >= 1 && (int64_t)formats.size() == count && (int64_t)out_features.size() == count, op,
              ": weights, formats and out_features must have the same length >= 1, got ", count, ", ",
              formats.size(), " and ", out_features.size());
  std::vector<Int8Weights> w;
  int64_t total_out = 0;
  for (int64_t p = 0; p < count; ++p) {
    w.push_back(int8_weights(op, weights[p], formats[p], out_features[p]));
    TORCH_CHECK(w[p].in == w[0].in, op, ": every weight must have the same in_features, got ", w[0].in, " and ",
                w[p].in);
    total_out += w[p].out;
  }
  const int64_t in = w[0].in;
  TORCH_CHECK(x.device().is_cpu() && at::isFloatingType(x.scalar_type()), op, ": x must be a floating CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, op, ": x must be [..., ", in, "] to match the weight [", total_out,
              ", ", in, "], got ", x.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == total_out &&
                    bias->device().is_cpu(),
                op, ": bias must be a float32 [", total_out, "] CPU tensor, got ", bias->scalar_type(), " ",
                bias->sizes());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total_out;
  const int64_t rows = x.numel() / in;
  Tensor y = at::empty({rows, total_out}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    const Tensor x_rows = x.reshape({rows, in}).to(at::kFloat).contiguous();
    Tensor quantised = at::empty({rows * int8_act_row_bytes(in)}, x.options().dtype(at::kByte));
    int8_quantize(x_rows.data_ptr<float>(), in, rows, in, quantised.data_ptr<uint8_t>(), Int8Path::Best,
                  torch_parallel_for);
    const Tensor bias_c = bias.has_value() ? bias->contiguous() : Tensor();
    std::vector<Int8Gemm> problems(count);
    for (int64_t p = 0, column = 0; p < count; column += w[p].out, ++p) {
      problems[p].w = w[p];
      problems[p].x = quantised.data_ptr<uint8_t>();
      problems[p].bias = bias_c.defined() ? bias_c.data_ptr<float>() + column : nullptr;
      problems[p].y = y.data_ptr<float>() + column;
      problems[p].y_stride = total_out;
      problems[p].rows = rows;
    }
    int8_gemm_many(problems.data(), count, torch_parallel_for);
  }
  return (x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type())).view(shape);
}

Tensor int8_linear_cpu(const Tensor& x, const Tensor& weight, int64_t format, int64_t out_features,
                       const OptTensor& bias) {
  return int8_linear_cat_cpu(x, {weight}, {format}, {out_features}, bias);
}

// Rotary position embedding in place on the first `heads` heads of x [B, S, heads' x D] (a layer's
// fused q | k | v output: the q and k heads), as transformers' apply_rotary_pos_emb computes it:
// x * cos + rotate_half(x) * sin, with cos and sin [B or 1, S, D] (the halves of each pair D / 2
// apart). The same float operations in the same order, so the same bits.
void rotate_half_cpu(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t heads) {
  const char* op = "rotate_half_";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous(), op,
              ": x must be a contiguous float32 CPU tensor [B, S, N], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.size(1) == x.size(1) &&
                  (cos.size(0) == x.size(0) || cos.size(0) == 1) && cos.size(2) % 2 == 0,
              op, ": cos and sin must be float32 [", x.size(0), " or 1, ", x.size(1), ", D] with D even, got ",
              cos.sizes(), " and ", sin.sizes());
  const int64_t dim = cos.size(2), half = dim / 2, batch = x.size(0), steps = x.size(1), width = x.size(2);
  TORCH_CHECK(heads >= 0 && heads * dim <= width, op, ": heads x D must fit in x's last dimension ", width, ", got ",
              heads, " x ", dim);
  const Tensor c = cos.contiguous(), s = sin.contiguous();
  float* data = x.data_ptr<float>();
  const float *cos_p = c.data_ptr<float>(), *sin_p = s.data_ptr<float>();
  at::parallel_for(0, batch * steps, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t at = (cos.size(0) == 1 ? row % steps : row) * dim;
      const float *cr = cos_p + at, *sr = sin_p + at;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = data + row * width + h * dim;
        for (int64_t j = 0; j < half; ++j) {
          const float first = v[j], second = v[j + half];
          const float low_a = first * cr[j], low_b = -second * sr[j];
          const float high_a = second * cr[j + half], high_b = first * sr[j + half];
          v[j] = low_a + low_b;
          v[j + half] = high_a + high_b;
        }
      }
    }
  });
}

// The weight as float32 [out_features, in]: the values of gguf's own dequantisation.
Tensor int8_dequantize_cpu(const Tensor& weight, int64_t format, int64_t out_features) {
  const Int8Weights w = int8_weights("int8_dequantize", weight, format, out_features);
  Tensor out = at::empty({w.out, w.in}, weight.options().dtype(at::kFloat));
  int8_dequantize(w, 0, w.out, out.data_ptr<float>(), torch_parallel_for);
  return out;
}

}  // namespace
}  // namespace fsd_cpu_linear

TORCH_LIBRARY(fsd_cpu_linear, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Whether skinny_linear's bfloat16 products take the AVX512-BF16 path on this CPU (no tensors:
  // one kernel for every backend).
  m.def("skinny_linear_bf16_dot() -> bool", [] { return fsd::cpu::bf16_dot_available(); });
  // Whether skinny_linear takes the AVX2 + FMA path for float32 x on this CPU.
  m.def("skinny_linear_avx2() -> bool", [] { return fsd::cpu::avx2_available(); });
  m.def("quant_linear(Tensor x, Tensor codes, Tensor params, int format, int out_features, Tensor? bias) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor params, int format, int out_features, ScalarType? dtype=None) -> Tensor");
  // Which loops quant_linear runs on this CPU: "avx512", "avx2" or "portable".
  m.def("int8_linear(Tensor x, Tensor weight, int format, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_linear_cat(Tensor x, Tensor[] weights, int[] formats, int[] out_features, Tensor? bias) -> Tensor");
  m.def("int8_dequantize(Tensor weight, int format, int out_features) -> Tensor");
  m.def("rotate_half_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  // Which loops int8_linear runs on this CPU: "avx512-vnni" or "portable".
  m.def("int8_linear_path() -> str", [] {
    return std::string(fsd_cpu_linear::int8_vnni_available() ? "avx512-vnni" : "portable");
  });
  m.def("quant_linear_path() -> str", [] {
    return std::string(fsd::cpu::quant_avx512_available() ? "avx512"
                       : fsd::cpu::avx2_available() ? "avx2" : "portable");
  });
}

TORCH_LIBRARY_IMPL(fsd_cpu_linear, CPU, m) {
  m.impl("skinny_linear", &fsd_cpu_linear::skinny_linear_cpu);
  m.impl("quant_linear", &fsd_cpu_linear::quant_linear_cpu);
  m.impl("quant_dequantize", &fsd_cpu_linear::quant_dequantize_cpu);
  m.impl("int8_linear", &fsd_cpu_linear::int8_linear_cpu);
  m.impl("int8_linear_cat", &fsd_cpu_linear::int8_linear_cat_cpu);
  m.impl("rotate_half_", &fsd_cpu_linear::rotate_half_cpu);
  m.impl("int8_dequantize", &fsd_cpu_linear::int8_dequantize_cpu);
}
