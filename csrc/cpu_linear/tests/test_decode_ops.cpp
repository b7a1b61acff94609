// Tests of decode_ops.h without torch (ctest): RMSNorm and the decoding attention against double
// precision loops over their definitions, a token computed alone against the same token among a
// step's others (bit for bit: exact greedy speculative decoding relies on it), and NaN propagation.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu_linear/decode_ops.h"
#include "expect.h"

namespace {

using fsd_cpu_linear::DecodeAttention;

std::vector<float> normal(size_t n, std::mt19937& gen, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

void test_rms_norm() {
  std::mt19937 gen(1);
  const int64_t rows = 3, n = 100;
  const std::vector<float> x = normal(rows * n, gen), w = normal(n, gen);
  std::vector<float> y(rows * n);
  fsd_cpu_linear::rms_norm(x.data(), w.data(), 1e-6f, rows, n, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (double)x[r * n + j] * x[r * n + j];
    const double inverse = 1 / std::sqrt(sum / n + 1e-6);
    for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(y[r * n + j], w[j] * x[r * n + j] * inverse, 1e-5 * std::fabs(w[j]) + 1e-7);
  }
}

struct Case {
  int64_t batch, steps, heads, kv_heads, dim, length, capacity;
  std::vector<float> q, keys, values, mask;
};

Case make_case(int64_t batch, int64_t steps, int64_t heads, int64_t kv_heads, int64_t dim, int64_t length, std::mt19937& gen) {
  Case c{batch, steps, heads, kv_heads, dim, length, length + 3, {}, {}, {}, {}};
  c.q = normal(batch * steps * heads * dim, gen);
  c.keys = normal(batch * kv_heads * c.capacity * dim, gen);
  c.values = normal(batch * kv_heads * c.capacity * dim, gen);
  c.mask.assign(batch * steps * length, 0.0f);
  for (int64_t b = 0; b < batch; ++b)  // row b sees slots [b, length - steps + s]
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t l = 0; l < length; ++l)
        if (l < b || l > length - steps + s) c.mask[(b * steps + s) * length + l] = -3.4e38f;
  return c;
}

std::vector<float> attend(const Case& c, int64_t first_step = 0, int64_t steps = -1) {
  steps = steps < 0 ? c.steps : steps;
  // the queries and mask rows of steps [first_step, first_step + steps) only
  std::vector<float> q, mask;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t s = first_step; s < first_step + steps; ++s) {
      q.insert(q.end(), c.q.begin() + (b * c.steps + s) * c.heads * c.dim, c.q.begin() + (b * c.steps + s + 1) * c.heads * c.dim);
      mask.insert(mask.end(), c.mask.begin() + (b * c.steps + s) * c.length, c.mask.begin() + (b * c.steps + s + 1) * c.length);
    }
  std::vector<float> out(c.batch * steps * c.heads * c.dim, -7.0f);
  DecodeAttention a;
  a.q = q.data();
  a.q_stride = c.heads * c.dim;
  a.keys = c.keys.data();
  a.values = c.values.data();
  a.kv_batch_stride = c.kv_heads * c.capacity * c.dim;
  a.kv_head_stride = c.capacity * c.dim;
  a.mask = mask.data();
  a.out = out.data();
  a.out_stride = c.heads * c.dim;
  a.batch = c.batch;
  a.steps = steps;
  a.heads = c.heads;
  a.kv_heads = c.kv_heads;
  a.dim = c.dim;
  a.length = c.length;
  a.scale = 1.0f / std::sqrt((float)c.dim);
  fsd_cpu_linear::decode_attention(a);
  return out;
}

void test_attention_matches_the_definition() {
  std::mt19937 gen(2);
  for (int64_t dim : {24, 64, 128}) {  // 24: the portable loops; 64, 128: the vector ones where present
    for (int64_t steps : {1, 5}) {
      const Case c = make_case(2, steps, 6, 2, dim, 37, gen);
      const std::vector<float> out = attend(c);
      const int64_t groups = c.heads / c.kv_heads;
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t s = 0; s < steps; ++s)
          for (int64_t h = 0; h < c.heads; ++h) {
            const float* q = c.q.data() + ((b * steps + s) * c.heads + h) * dim;
            const int64_t base = (b * c.kv_heads + h / groups) * c.capacity * dim;
            std::vector<double> p(c.length);
            double max = -1e300, sum = 0;
            for (int64_t l = 0; l < c.length; ++l) {
              double dot = 0;
              for (int64_t j = 0; j < dim; ++j) dot += (double)q[j] * c.keys[base + l * dim + j];
              p[l] = dot / std::sqrt((double)dim) + c.mask[(b * steps + s) * c.length + l];
              max = std::max(max, p[l]);
            }
            for (auto& v : p) sum += (v = std::exp(v - max));
            for (int64_t j = 0; j < dim; ++j) {
              double expected = 0;
              for (int64_t l = 0; l < c.length; ++l) expected += p[l] / sum * c.values[base + l * dim + j];
              const float got = out[((b * steps + s) * c.heads + h) * dim + j];
              CHECK(std::fabs(got - expected) <= 1e-5, "dim %lld steps %lld b %lld s %lld h %lld: %g vs %g", (long long)dim,
                    (long long)steps, (long long)b, (long long)s, (long long)h, got, expected);
            }
          }
    }
  }
}

void test_a_token_alone_equals_the_token_among_others() {
  std::mt19937 gen(3);
  for (int64_t dim : {24, 128}) {
    const Case c = make_case(2, 6, 12, 2, dim, 50, gen);
    const std::vector<float> all = attend(c);
    for (int64_t s = 0; s < c.steps; ++s) {
      const std::vector<float> alone = attend(c, s, 1);
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t k = 0; k < c.heads * dim; ++k)
          EXPECT(alone[b * c.heads * dim + k] == all[(b * c.steps + s) * c.heads * dim + k]);
    }
  }
}

void test_nan_stays_in_its_query() {
  std::mt19937 gen(4);
  Case c = make_case(1, 2, 4, 2, 64, 20, gen);
  c.q[1 * 4 * 64 + 0] = NAN;  // step 1, head 0
  const std::vector<float> out = attend(c);
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t j = 0; j < 64; ++j) {
      EXPECT(std::isfinite(out[h * 64 + j]));  // step 0
      EXPECT(std::isnan(out[(4 + h) * 64 + j]) == (h == 0));
    }
}

}  // namespace

int main() {
  test_rms_norm();
  test_attention_matches_the_definition();
  test_a_token_alone_equals_the_token_among_others();
  test_nan_stays_in_its_query();
  return fsd_test::verdict("test_decode_ops");
}
