// The small ops of a decoding step around its linear products (torch_int8.cpp's decoder_layer):
// RMSNorm and grouped-query attention over a KV cache. Each row of the result depends on that row
// alone, computed in a fixed order (a query's scores, its softmax, its weighted sum of values), so a
// token gets the same bits in a one-token forward as among the K+1 of a verification: exact greedy
// speculative decoding gives the target's own greedy tokens.
#pragma once

#include <cstdint>

#include "cpu_linear/int8_gemm.h"  // ParallelFor

namespace fsd_cpu_linear {

// y[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r < rows of width n (x and y row-major,
// y may be x). Parallel over rows.
void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t n, float* y,
              const ParallelFor& parallel_for = serial_for);

// out = softmax(q K^T * scale + mask) V per (batch row b, query head h, step s), h reading kv head
// h / (heads / kv_heads), over the first `length` cache slots.
struct DecodeAttention {
  const float* q = nullptr;  // row (b, s) at q + (b * steps + s) * q_stride, head h at + h * dim
  int64_t q_stride = 0;
  const float* keys = nullptr;  // [b][g][slot][dim]: at keys + b * kv_batch_stride + g * kv_head_stride + slot * dim
  const float* values = nullptr;  // as keys
  int64_t kv_batch_stride = 0, kv_head_stride = 0;
  const float* mask = nullptr;  // additive, [batch][steps][length] contiguous
  float* out = nullptr;  // row (b, s) at out + (b * steps + s) * out_stride, head h at + h * dim
  int64_t out_stride = 0;
  int64_t batch = 0, steps = 0, heads = 0, kv_heads = 0, dim = 0, length = 0;
  float scale = 1.0f;
};

// Parallel over (batch row, kv head).
void decode_attention(const DecodeAttention& problem, const ParallelFor& parallel_for = serial_for);

}  // namespace fsd_cpu_linear
