// See decode_ops.h. The attention of a (batch row, kv head) pair walks the cache once: each key is
// read once for all the queries that share it (the kv head's query heads x the step's tokens), each
// value once for their weighted sums. Two paths, AVX-512 and portable; a query's result depends on
// that query alone within either.
#include "cpu_linear/decode_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSD_DECODE_X86 1
#include <immintrin.h>
#endif

namespace fsd_cpu_linear {
namespace {

bool avx512_available() {
#if FSD_DECODE_X86
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
#else
  return false;
#endif
}

// ---- portable ------------------------------------------------------------------------------------

float dot_portable(const float* a, const float* b, int64_t n) {
  float lanes[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) lanes[k] += a[j + k] * b[j + k];
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

void axpy_portable(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += alpha * x[j];
}

// e[l] = exp(s[l] - max) for l < n; returns their sum (s is overwritten by e).
float softmax_numerators_portable(float* s, int64_t n, float max) {
  float sum = 0.0f;
  for (int64_t l = 0; l < n; ++l) {
    s[l] = std::exp(s[l] - max);
    sum += s[l];
  }
  return sum;
}

// ---- AVX-512 -------------------------------------------------------------------------------------

#if FSD_DECODE_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // (GCC 12's unmasked intrinsics)
#pragma GCC diagnostic ignored "-Wuninitialized"

// n a multiple of 16 (the head sizes of the models: 64, 128).
float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  return _mm512_reduce_add_ps(acc);
}

void axpy_avx512(float alpha, const float* x, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t j = 0; j < n; j += 16)
    _mm512_storeu_ps(y + j, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + j), _mm512_loadu_ps(y + j)));
}

// exp(x) for x <= 0: x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by a degree-6 polynomial (relative error
// ~2e-7), scaled by 2^n; below -87.3 (exp underflows float32) 0.
__m512 exp_nonpositive(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // (the second operand when either is NaN: NaN stays)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

float softmax_numerators_avx512(float* s, int64_t n, float max) {
  const __m512 m = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + l), m));
    _mm512_storeu_ps(s + l, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (l < n) {
    const __mmask16 rest = (__mmask16)((1u << (n - l)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(rest, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, s + l), m)));
    _mm512_mask_storeu_ps(s + l, rest, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

struct Ops {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float, const float*, float*, int64_t);
  float (*softmax_numerators)(float*, int64_t, float);
};

Ops select_ops(int64_t dim) {
#if FSD_DECODE_X86
  if (avx512_available() && dim % 16 == 0) return {dot_avx512, axpy_avx512, softmax_numerators_avx512};
#endif
  return {dot_portable, axpy_portable, softmax_numerators_portable};
}

}  // namespace

void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t n, float* y,
              const ParallelFor& parallel_for) {
  parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * n;
      float lanes[16] = {};
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; ++k) lanes[k] += row[j + k] * row[j + k];
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += lanes[k];
      for (; j < n; ++j) sum += row[j] * row[j];
      const float inverse = 1.0f / std::sqrt(sum / (float)n + eps);
      for (int64_t k = 0; k < n; ++k) y[r * n + k] = weight[k] * (row[k] * inverse);
    }
  });
}

void decode_attention(const DecodeAttention& a, const ParallelFor& parallel_for) {
  const int64_t groups = a.heads / a.kv_heads, queries = groups * a.steps;
  const Ops ops = select_ops(a.dim);
  parallel_for(a.batch * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(queries * a.length);  // [query][slot], query = r * steps + s
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / a.kv_heads, g = task % a.kv_heads;
      const float* keys = a.keys + b * a.kv_batch_stride + g * a.kv_head_stride;
      const float* values = a.values + b * a.kv_batch_stride + g * a.kv_head_stride;
      auto query = [&](int64_t i) { return a.q + (b * a.steps + i % a.steps) * a.q_stride + (g * groups + i / a.steps) * a.dim; };
      auto output = [&](int64_t i) { return a.out + (b * a.steps + i % a.steps) * a.out_stride + (g * groups + i / a.steps) * a.dim; };
      for (int64_t l = 0; l < a.length; ++l) {
        const float* key = keys + l * a.dim;
        for (int64_t i = 0; i < queries; ++i)
          scores[i * a.length + l] = ops.dot(query(i), key, a.dim) * a.scale + a.mask[(b * a.steps + i % a.steps) * a.length + l];
      }
      std::vector<float> inverse_sum(queries);
      for (int64_t i = 0; i < queries; ++i) {
        float* s = scores.data() + i * a.length;
        const float max = *std::max_element(s, s + a.length);
        inverse_sum[i] = 1.0f / ops.softmax_numerators(s, a.length, max);
        std::fill(output(i), output(i) + a.dim, 0.0f);
      }
      for (int64_t l = 0; l < a.length; ++l) {
        const float* value = values + l * a.dim;
        for (int64_t i = 0; i < queries; ++i) ops.axpy(scores[i * a.length + l], value, output(i), a.dim);
      }
      for (int64_t i = 0; i < queries; ++i) {
        float* o = output(i);
        for (int64_t j = 0; j < a.dim; ++j) o[j] *= inverse_sum[i];
      }
    }
  });
}

}  // namespace fsd_cpu_linear
