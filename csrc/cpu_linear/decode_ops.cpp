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

// The sums of a0..a3 in lanes 0..3, each added up in the same order whatever its position (so a
// query's score does not depend on which queries share its block).
__m128 sum4_symmetric(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))));
  const __m512 v = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 w = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(w);
}

// Scores of the queries q[0..3] with every cached key l < length (dim = 16 kChunks):
// scores[c][l] = dot(q[c], key l) * scale + mask[c][l]. (Unused entries may repeat q[0].)
template <int kChunks>
void scores4_avx512(const float* const* q, const float* keys, const float* const* mask, int64_t length, float scale,
                    float* const* scores) {
  __m512 query[4][kChunks];
  for (int c = 0; c < 4; ++c)
    for (int k = 0; k < kChunks; ++k) query[c][k] = _mm512_loadu_ps(q[c] + 16 * k);
  for (int64_t l = 0; l < length; ++l) {
    const float* key = keys + l * 16 * kChunks;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int k = 0; k < kChunks; ++k) {
      const __m512 kv = _mm512_loadu_ps(key + 16 * k);
      for (int c = 0; c < 4; ++c) acc[c] = _mm512_fmadd_ps(query[c][k], kv, acc[c]);
    }
    alignas(16) float dots[4];
    _mm_store_ps(dots, sum4_symmetric(acc[0], acc[1], acc[2], acc[3]));
    for (int c = 0; c < 4; ++c) scores[c][l] = dots[c] * scale + mask[c][l];
  }
}

// out[c] = sum over l of weights[c][l] * value l, for kQueries queries (dim = 16 kChunks).
template <int kChunks, int kQueries>
void weighted_values_avx512(const float* const* weights, const float* values, int64_t length, float* const* out) {
  __m512 acc[kQueries][kChunks];
  for (int c = 0; c < kQueries; ++c)
    for (int k = 0; k < kChunks; ++k) acc[c][k] = _mm512_setzero_ps();
  for (int64_t l = 0; l < length; ++l) {
    const float* value = values + l * 16 * kChunks;
    for (int k = 0; k < kChunks; ++k) {
      const __m512 v = _mm512_loadu_ps(value + 16 * k);
      for (int c = 0; c < kQueries; ++c) acc[c][k] = _mm512_fmadd_ps(_mm512_set1_ps(weights[c][l]), v, acc[c][k]);
    }
  }
  for (int c = 0; c < kQueries; ++c)
    for (int k = 0; k < kChunks; ++k) _mm512_storeu_ps(out[c] + 16 * k, acc[c][k]);
}

// weighted_values_avx512 for a block of `count` (1..24 / kChunks) queries.
template <int kChunks, int kQueries = 24 / kChunks>
void weighted_values_block(int count, const float* const* weights, const float* values, int64_t length,
                           float* const* out) {
  if constexpr (kQueries > 1) {
    if (count < kQueries) return weighted_values_block<kChunks, kQueries - 1>(count, weights, values, length, out);
  }
  weighted_values_avx512<kChunks, kQueries>(weights, values, length, out);
}

// Attention of one (batch row, kv head) task's queries, dim = 16 kChunks.
template <int kChunks>
void attend_avx512(const float* const* query, const float* const* mask, int64_t queries, const float* keys,
                   const float* values, int64_t length, float scale, float* scores, float* const* out) {
  for (int64_t i = 0; i < queries; i += 4) {
    const float* q[4];
    const float* m[4];
    float* s[4];
    for (int c = 0; c < 4; ++c) {
      const int64_t at = i + c < queries ? i + c : i;  // (a repeat of query i fills a short block)
      q[c] = query[at];
      m[c] = mask[at];
      s[c] = scores + at * length;
    }
    scores4_avx512<kChunks>(q, keys, m, length, scale, s);
  }
  std::vector<float> inverse_sum(queries);
  for (int64_t i = 0; i < queries; ++i) {
    float* s = scores + i * length;
    inverse_sum[i] = 1.0f / softmax_numerators_avx512(s, length, *std::max_element(s, s + length));
  }
  constexpr int kBlock = 24 / kChunks;
  for (int64_t i = 0; i < queries; i += kBlock) {
    const int count = (int)std::min<int64_t>(kBlock, queries - i);
    const float* w[kBlock];
    float* o[kBlock];
    for (int c = 0; c < count; ++c) {
      w[c] = scores + (i + c) * length;
      o[c] = out[i + c];
    }
    weighted_values_block<kChunks>(count, w, values, length, o);
  }
  for (int64_t i = 0; i < queries; ++i)
    for (int64_t j = 0; j < 16 * kChunks; ++j) out[i][j] *= inverse_sum[i];
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
    std::vector<const float*> query(queries), mask(queries);
    std::vector<float*> output(queries);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / a.kv_heads, g = task % a.kv_heads;
      const float* keys = a.keys + b * a.kv_batch_stride + g * a.kv_head_stride;
      const float* values = a.values + b * a.kv_batch_stride + g * a.kv_head_stride;
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t row = b * a.steps + i % a.steps, head = g * groups + i / a.steps;
        query[i] = a.q + row * a.q_stride + head * a.dim;
        output[i] = a.out + row * a.out_stride + head * a.dim;
        mask[i] = a.mask + row * a.length;
      }
#if FSD_DECODE_X86
      if (avx512_available() && (a.dim == 64 || a.dim == 128)) {
        if (a.dim == 64) attend_avx512<4>(query.data(), mask.data(), queries, keys, values, a.length, a.scale, scores.data(), output.data());
        else attend_avx512<8>(query.data(), mask.data(), queries, keys, values, a.length, a.scale, scores.data(), output.data());
        continue;
      }
#endif
      for (int64_t l = 0; l < a.length; ++l) {
        const float* key = keys + l * a.dim;
        for (int64_t i = 0; i < queries; ++i)
          scores[i * a.length + l] = ops.dot(query[i], key, a.dim) * a.scale + mask[i][l];
      }
      std::vector<float> inverse_sum(queries);
      for (int64_t i = 0; i < queries; ++i) {
        float* s = scores.data() + i * a.length;
        const float max = *std::max_element(s, s + a.length);
        inverse_sum[i] = 1.0f / ops.softmax_numerators(s, a.length, max);
        std::fill(output[i], output[i] + a.dim, 0.0f);
      }
      for (int64_t l = 0; l < a.length; ++l) {
        const float* value = values + l * a.dim;
        for (int64_t i = 0; i < queries; ++i) ops.axpy(scores[i * a.length + l], value, output[i], a.dim);
      }
      for (int64_t i = 0; i < queries; ++i)
        for (int64_t j = 0; j < a.dim; ++j) output[i][j] *= inverse_sum[i];
    }
  });
}

}  // namespace fsd_cpu_linear
