// The torch binding of the int8-activation products (int8_gemm.h) and of what CPU decoding runs around
// them: rotary embedding in place and a whole decoder layer in one call (decoder_layer), ops under
// `fsd_cpu_linear` beside those of torch_ops.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "cpu_linear/decode_ops.h"
#include "cpu_linear/int8_gemm.h"

namespace fsd_cpu_linear {
namespace {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

void torch_parallel_for(int64_t count, int64_t grain, const RangeFn& body) {
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { body(begin, end); });
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

// One decoder layer of a Qwen2 / Llama-style model for a decoding step, in one call: RMSNorm, q|k|v
// (int8 products), rotary embedding, the new keys and values written into the cache at `slots`,
// grouped-query attention over the cache's first L slots (L = mask's last size), o_proj and the
// residual, RMSNorm, gate|up, silu(gate) * up, down and the residual. What fused.py's modules compute
// op by op, less the Python and dispatch between them; norms and attention by decode_ops.h's loops
// (each token's result independent of the step's other tokens; not SDPA's summation order).
// hidden [B, S, H] float32; keys / values [B, H_kv, capacity, D] (the layer's cache, written in
// place); slots [B, S] int64; mask [B, 1, S, L] additive float32; cos / sin [B or 1, S, D].
Tensor decoder_layer_cpu(const Tensor& hidden, const Tensor& input_norm, const Tensor& post_norm, double eps,
                         at::TensorList qkv, at::IntArrayRef qkv_formats, at::IntArrayRef qkv_outs,
                         const OptTensor& qkv_bias, const Tensor& o_proj, int64_t o_format, const OptTensor& o_bias,
                         at::TensorList gate_up, at::IntArrayRef gate_up_formats, at::IntArrayRef gate_up_outs,
                         const Tensor& down, int64_t down_format, const OptTensor& down_bias, const Tensor& cos,
                         const Tensor& sin, Tensor& keys, Tensor& values, const Tensor& slots, const Tensor& mask,
                         int64_t heads, int64_t kv_heads, double scaling) {
  const char* op = "decoder_layer";
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 3, op, ": hidden must be float32 [B, S, H], got ",
              hidden.scalar_type(), " ", hidden.sizes());
  const int64_t batch = hidden.size(0), steps = hidden.size(1), width = hidden.size(2);
  TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && qkv_outs.size() == 3, op,
              ": heads must be a multiple of kv_heads and qkv three weights, got ", heads, ", ", kv_heads, ", ",
              qkv_outs.size());
  const int64_t dim = qkv_outs[0] / heads;
  TORCH_CHECK(qkv_outs[0] == heads * dim && qkv_outs[1] == kv_heads * dim && qkv_outs[2] == kv_heads * dim, op,
              ": q, k and v must have heads x D, kv_heads x D and kv_heads x D outputs, got ", qkv_outs);
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.sizes() == keys.sizes() && keys.dim() == 4 &&
                  keys.size(0) == batch && keys.size(1) == kv_heads && keys.size(3) == dim && keys.stride(3) == 1 &&
                  values.stride(3) == 1 && values.scalar_type() == at::kFloat,
              op, ": keys and values must be float32 [", batch, ", ", kv_heads, ", capacity, ", dim, "], got ",
              keys.sizes(), " and ", values.sizes());
  const int64_t capacity = keys.size(2), length = mask.size(-1);
  TORCH_CHECK(mask.scalar_type() == at::kFloat && mask.dim() == 4 && mask.size(0) == batch && mask.size(1) == 1 &&
                  mask.size(2) == steps && length <= capacity,
              op, ": mask must be float32 [", batch, ", 1, ", steps, ", L <= ", capacity, "], got ", mask.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.sizes() == at::IntArrayRef({batch, steps}), op,
              ": slots must be int64 [", batch, ", ", steps, "], got ", slots.scalar_type(), " ", slots.sizes());
  const auto slot = slots.contiguous();
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * steps; ++i)
    TORCH_CHECK(slot_p[i] >= 0 && slot_p[i] < length, op, ": slots must be in [0, ", length, "), got ", slot_p[i]);

  TORCH_CHECK(input_norm.scalar_type() == at::kFloat && post_norm.scalar_type() == at::kFloat &&
                  input_norm.numel() == width && post_norm.numel() == width,
              op, ": the norms' weights must be float32 [", width, "]");
  const Tensor x = hidden.contiguous(), input_weight = input_norm.contiguous(), post_weight = post_norm.contiguous();
  const int64_t rows = batch * steps;
  Tensor normed = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), input_weight.data_ptr<float>(), (float)eps, rows, width, normed.data_ptr<float>(),
           torch_parallel_for);
  Tensor qkv_out = int8_linear_cat_cpu(normed, qkv, qkv_formats, qkv_outs, qkv_bias);
  rotate_half_cpu(qkv_out, cos, sin, heads + kv_heads);
  // the new keys and values into the cache: qkv_out[b, s, (heads + g) D + d] -> keys[b, g, slot, d]
  const float* qkv_p = qkv_out.data_ptr<float>();
  const int64_t qkv_width = qkv_out.size(2);
  float *keys_p = keys.data_ptr<float>(), *values_p = values.data_ptr<float>();
  TORCH_CHECK(keys.stride(2) == dim && values.stride(2) == dim && keys.strides() == values.strides(), op,
              ": keys and values must have contiguous slots of the same strides");
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t g = 0; g < kv_heads; ++g) {
        const float* row = qkv_p + (b * steps + s) * qkv_width;
        const int64_t at = b * keys.stride(0) + g * keys.stride(1) + slot_p[b * steps + s] * dim;
        std::copy(row + (heads + g) * dim, row + (heads + g + 1) * dim, keys_p + at);
        std::copy(row + (heads + kv_heads + g) * dim, row + (heads + kv_heads + g + 1) * dim, values_p + at);
      }
  Tensor attn = at::empty({batch, steps, heads * dim}, x.options());
  const Tensor mask_c = mask.contiguous();
  DecodeAttention attention;
  attention.q = qkv_p;
  attention.q_stride = qkv_width;
  attention.keys = keys_p;
  attention.values = values_p;
  attention.kv_batch_stride = keys.stride(0);
  attention.kv_head_stride = keys.stride(1);
  attention.mask = mask_c.data_ptr<float>();
  attention.out = attn.data_ptr<float>();
  attention.out_stride = heads * dim;
  attention.batch = batch;
  attention.steps = steps;
  attention.heads = heads;
  attention.kv_heads = kv_heads;
  attention.dim = dim;
  attention.length = length;
  attention.scale = (float)scaling;
  decode_attention(attention, torch_parallel_for);
  const Tensor after_attention = x + int8_linear_cat_cpu(attn, {o_proj}, {o_format}, {width}, o_bias);
  rms_norm(after_attention.data_ptr<float>(), post_weight.data_ptr<float>(), (float)eps, rows, width,
           normed.data_ptr<float>(), torch_parallel_for);
  const Tensor gate_up_out = int8_linear_cat_cpu(normed, gate_up, gate_up_formats, gate_up_outs, std::nullopt);
  const Tensor activated = at::silu(gate_up_out.narrow(2, 0, gate_up_outs[0])).mul_(
      gate_up_out.narrow(2, gate_up_outs[0], gate_up_outs[1]));
  return after_attention + int8_linear_cat_cpu(activated, {down}, {down_format}, {width}, down_bias);
}

}  // namespace
}  // namespace fsd_cpu_linear

TORCH_LIBRARY_FRAGMENT(fsd_cpu_linear, m) {
  m.def("int8_linear(Tensor x, Tensor weight, int format, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_linear_cat(Tensor x, Tensor[] weights, int[] formats, int[] out_features, Tensor? bias) -> Tensor");
  m.def("int8_dequantize(Tensor weight, int format, int out_features) -> Tensor");
  // Which loops int8_linear runs on this CPU: "avx512-vnni" or "portable".
  m.def("int8_linear_path() -> str", [] {
    return std::string(fsd_cpu_linear::int8_vnni_available() ? "avx512-vnni" : "portable");
  });
  m.def("rotate_half_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("decoder_layer(Tensor hidden, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qkv, int[] qkv_formats, "
        "int[] qkv_outs, Tensor? qkv_bias, Tensor o_proj, int o_format, Tensor? o_bias, Tensor[] gate_up, "
        "int[] gate_up_formats, int[] gate_up_outs, Tensor down, int down_format, Tensor? down_bias, Tensor cos, "
        "Tensor sin, Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor mask, int heads, int kv_heads, "
        "float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(fsd_cpu_linear, CPU, m) {
  m.impl("int8_linear", &fsd_cpu_linear::int8_linear_cpu);
  m.impl("int8_linear_cat", &fsd_cpu_linear::int8_linear_cat_cpu);
  m.impl("int8_dequantize", &fsd_cpu_linear::int8_dequantize_cpu);
  m.impl("rotate_half_", &fsd_cpu_linear::rotate_half_cpu);
  m.impl("decoder_layer", &fsd_cpu_linear::decoder_layer_cpu);
}
