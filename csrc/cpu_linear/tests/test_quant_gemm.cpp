// Tests of the quantised-weight linear kernel (cpu_linear/quant_gemm.h) against plain loops over the
// layout's definition, without torch (ctest). Buffers are allocated at their exact sizes, so the
// sanitizer build (scripts/sanitize.sh) catches any read past them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu_linear/quant_gemm.h"
#include "cpu_linear/skinny_gemm.h"
#include "expect.h"

namespace {

using fsd_cpu_linear::QuantFormat;
using fsd_cpu_linear::QuantPath;

// A random repacked matrix: codes and params as the layout stores them.
struct Matrix {
  QuantFormat format;
  int64_t in, out;
  std::vector<uint8_t> codes;
  std::vector<float> params;

  fsd_cpu_linear::QuantWeights view() const { return {codes.data(), params.data(), format, in, out}; }
};

Matrix random_matrix(QuantFormat format, int64_t in, int64_t out, std::mt19937& gen) {
  const int64_t blocks = (out + 3) / 4, groups = in / fsd_cpu_linear::quant_group_size(format);
  Matrix m{format, in, out, {}, {}};
  m.codes.resize(blocks * groups * fsd_cpu_linear::quant_code_bytes(format));
  m.params.resize(blocks * groups * fsd_cpu_linear::quant_params_per_group(format));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f), offset(-0.3f, 0.1f);
  for (auto& c : m.codes) c = (uint8_t)byte(gen);
  for (size_t i = 0; i < m.params.size(); ++i)
    m.params[i] = (format == QuantFormat::Q4 && i % 2 == 1) ? offset(gen) : scale(gen);
  return m;
}

// The layout's definition of weight (o, i), read straight from quant_gemm.h's description.
float weight_at(const Matrix& m, int64_t o, int64_t i) {
  const int64_t group = fsd_cpu_linear::quant_group_size(m.format), groups = m.in / group;
  const int64_t block = o / 4, b = o % 4, k = i / group, j = i % group;
  const int64_t cell = block * groups + k;
  const uint8_t* row_codes = m.codes.data() + cell * fsd_cpu_linear::quant_code_bytes(m.format) + fsd_cpu_linear::quant_row_code_bytes(m.format) * b;
  const float* p = m.params.data() + cell * fsd_cpu_linear::quant_params_per_group(m.format);
  if (m.format == QuantFormat::Q4) {
    const int code = j < 16 ? (row_codes[j] & 15) : (row_codes[j - 16] >> 4);
    return std::fma((float)code, p[2 * b], p[2 * b + 1]);
  }
  return (float)(int8_t)row_codes[j] * p[b];
}

constexpr QuantFormat kFormats[] = {QuantFormat::Q4, QuantFormat::Q8, QuantFormat::Q8G32};
constexpr QuantPath kPaths[] = {QuantPath::Best, QuantPath::Avx512, QuantPath::Avx2, QuantPath::Portable};

const fsd_cpu_linear::ParallelFor chunks_of_3 = [](int64_t count, int64_t, const fsd_cpu_linear::RangeFn& body) {
  for (int64_t begin = 0; begin < count; begin += 3) body(begin, std::min(count, begin + 3));
};

// Runs `product` on random x (rows x in, padded strides; bias on odd row counts) and checks every
// y[r][o] against the double sum of term(x value, o, i) (+ bias) within float32 summation error,
// and that the padding past out is untouched.
template <class Product, class Term>
void check_rows(const char* what, int format, int path, int64_t in, int64_t out, int64_t rows, std::mt19937& gen,
                Product product, Term term) {
  const int64_t x_stride = in + 3, y_stride = out + 2;
  std::vector<float> x(rows * x_stride), bias(out), y(rows * y_stride, -7.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(gen);
  for (int64_t o = 0; o < out; ++o) bias[o] = 0.125f * (float)o;
  fsd_cpu_linear::QuantGemm g;
  g.x = x.data(), g.x_stride = x_stride;
  g.bias = rows % 2 ? bias.data() : nullptr, g.y = y.data(), g.y_stride = y_stride;
  g.rows = rows;
  product(g);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double expected = g.bias ? bias[o] : 0.0, magnitude = std::fabs(expected);
      for (int64_t i = 0; i < in; ++i) {
        const double t = term(x[r * x_stride + i], o, i);
        expected += t, magnitude += std::fabs(t);
      }
      CHECK(std::fabs(y[r * y_stride + o] - expected) <= 1e-6 * magnitude + 1e-6,
            "%s: format %d path %d in %ld out %ld rows %ld: y[%ld][%ld] = %.8g, expected %.8g", what, format, path,
            (long)in, (long)out, (long)rows, (long)r, (long)o, y[r * y_stride + o], expected);
    }
    for (int64_t o = out; o < y_stride; ++o) EXPECT(y[r * y_stride + o] == -7.0f);
  }
}

// Every path this CPU has, every format; row counts 1..16 (one or several passes, column chunks
// from 16 rows' 384 columns up to whole rows), out not a multiple of 4 (padding rows never stored)
// and over one task of 64; padded strides, with and without bias; a task-splitting ParallelFor.
void test_products_match_the_definition() {
  std::printf("quant_gemm: AVX-512 path %s, AVX2 path %s\n",
              fsd_cpu_linear::quant_avx512_available() ? "checked" : "not on this CPU",
              fsd_cpu_linear::avx2_available() ? "checked" : "not on this CPU");
  std::mt19937 gen(5);
  for (QuantFormat format : kFormats) {
    const int64_t group = fsd_cpu_linear::quant_group_size(format);
    for (int64_t in : {group, 5 * group, int64_t(1280)}) {
      for (int64_t out : {1, 5, 44, 67, 130}) {
        const Matrix m = random_matrix(format, in, out, gen);
        std::vector<double> w(out * in);
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) w[o * in + i] = weight_at(m, o, i);
        for (QuantPath path : kPaths) {
          for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 9, 12, 16}) {
            check_rows("quant_gemm", (int)format, (int)path, in, out, rows, gen, [&](fsd_cpu_linear::QuantGemm& g) {
              g.w = m.view(), g.path = path;
              fsd_cpu_linear::quant_gemm(g, chunks_of_3);
            }, [&](float x, int64_t o, int64_t i) { return (double)x * w[o * in + i]; });
          }
        }
      }
    }
  }
}

// Dequantised rows are the definition's values to the bit (the prompt path multiplies them with
// the BLAS, so a prompt sees the same weights as a decoding step), from any first row.
void test_dequantize_is_exact() {
  std::mt19937 gen(6);
  for (QuantFormat format : kFormats) {
    const int64_t in = 3 * fsd_cpu_linear::quant_group_size(format), out = 11;
    const Matrix m = random_matrix(format, in, out, gen);
    for (int64_t begin : {0, 1, 4, 10}) {
      const int64_t end = std::min<int64_t>(out, begin + 6);
      std::vector<float> rows((end - begin) * in);
      std::vector<uint16_t> rows_bf16(rows.size());
      fsd_cpu_linear::quant_dequantize(m.view(), begin, end, rows.data(), nullptr, chunks_of_3);
      fsd_cpu_linear::quant_dequantize(m.view(), begin, end, nullptr, rows_bf16.data(), chunks_of_3);
      for (int64_t o = begin; o < end; ++o) {
        for (int64_t i = 0; i < in; ++i) {
          const float value = weight_at(m, o, i);
          CHECK(rows[(o - begin) * in + i] == value, "format %d row %ld col %ld", (int)format, (long)o, (long)i);
          // bfloat16: the nearest (ties to even) of the two bfloat16 values around the weight.
          const uint32_t bits = fsd_cpu_linear::float_to_bits(value);
          const float below = fsd_cpu_linear::bits_to_float(bits & 0xFFFF0000u);
          const float above = fsd_cpu_linear::bits_to_float((bits & 0xFFFF0000u) + 0x10000u);
          const float got = fsd_cpu_linear::bits_to_float((uint32_t)rows_bf16[(o - begin) * in + i] << 16);
          const double gap = std::fabs((double)got - value), other = std::fabs((double)(got == below ? above : below) - value);
          CHECK((got == below || got == above) && (gap < other || (gap == other && (rows_bf16[(o - begin) * in + i] & 1) == 0)),
                "bfloat16 of %.9g: %.9g", value, got);
        }
      }
    }
  }
}

// Hand-built codes where the answer is plain: a Q4 row of codes 0..15, 0..15 with scale 0.5 and
// offset -1 against x = 1 sums 2 x (0.5 x 120 - 16) = 88; a Q8 row of codes -8..7 with scale 2
// against x = 1 sums -16 (Q8G32: -8..7 twice, -32).
void test_golden_values() {
  for (QuantFormat format : kFormats) {
    const int64_t group = fsd_cpu_linear::quant_group_size(format);
    Matrix m{format, group, 1, std::vector<uint8_t>(fsd_cpu_linear::quant_code_bytes(format), 0), std::vector<float>(fsd_cpu_linear::quant_params_per_group(format), 0.0f)};
    for (int j = 0; j < (format == QuantFormat::Q4 ? 16 : group); ++j)
      m.codes[j] = format == QuantFormat::Q4 ? (uint8_t)(j | (j << 4)) : (uint8_t)(int8_t)(j % 16 - 8);
    if (format == QuantFormat::Q4) m.params[0] = 0.5f, m.params[1] = -1.0f;
    else m.params[0] = 2.0f;
    std::vector<float> x(group, 1.0f);
    for (QuantPath path : kPaths) {
      float y = 0.0f;
      fsd_cpu_linear::QuantGemm g;
      g.w = m.view(), g.x = x.data(), g.x_stride = group, g.y = &y, g.y_stride = 1, g.rows = 1, g.path = path;
      fsd_cpu_linear::quant_gemm(g);
      EXPECT(y == (format == QuantFormat::Q4 ? 88.0f : format == QuantFormat::Q8 ? -16.0f : -32.0f));
    }
  }
}

// x = 1 + 2^-23 (the last bit of its float32 significand set) against codes 1, scale 1: every
// path sums the group to group x (1 + 2^-23), which float32 holds exactly; a path that rounded x
// to bfloat16 would give exactly `group` instead.
void test_last_bit_of_x_counts() {
  const float x_value = 1.0f + std::ldexp(1.0f, -23);
  for (QuantFormat format : kFormats) {
    const int64_t group = fsd_cpu_linear::quant_group_size(format);
    Matrix m{format, group, 1, std::vector<uint8_t>(fsd_cpu_linear::quant_code_bytes(format), 0),
             std::vector<float>(fsd_cpu_linear::quant_params_per_group(format), 0.0f)};
    for (int j = 0; j < (format == QuantFormat::Q4 ? 16 : group); ++j)
      m.codes[j] = format == QuantFormat::Q4 ? (uint8_t)0x11 : (uint8_t)1;
    m.params[0] = 1.0f;
    const float expected = (float)group * x_value;
    EXPECT(expected != (float)group);
    for (QuantPath path : kPaths) {
      for (int64_t rows : {1, 2, 3}) {
        std::vector<float> x(rows * group, x_value), y(rows, 0.0f);
        fsd_cpu_linear::QuantGemm g;
        g.w = m.view(), g.x = x.data(), g.x_stride = group, g.y = y.data(), g.y_stride = 1;
        g.rows = rows, g.path = path;
        fsd_cpu_linear::quant_gemm(g);
        for (int64_t r = 0; r < rows; ++r)
          CHECK(y[r] == expected, "format %d path %d rows %ld: %.9g, expected %.9g", (int)format, (int)path,
                (long)rows, y[r], expected);
      }
    }
  }
}

}  // namespace

int main() {
  test_golden_values();
  test_last_bit_of_x_counts();
  test_dequantize_is_exact();
  test_products_match_the_definition();
  return fsd_test::verdict("test_quant_gemm");
}
