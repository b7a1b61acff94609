// Tests of the int8-activation kernel (cpu_linear/int8_gemm.h) without torch (ctest): the products
// against plain loops over the layout's definition in double precision, the vector path against
// the portable one bit for bit, a row alone against the same row among others (batch invariance),
// and x's quantisation (NaN and infinite groups included). Buffers have their exact sizes, so the
// sanitizer build catches a read past them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu_linear/int8_gemm.h"
#include "expect.h"

namespace {

using fsd_cpu_linear::Int8Format;
using fsd_cpu_linear::Int8Path;
using fsd_cpu_linear::kGroupCols;
using fsd_cpu_linear::kTileRows;

constexpr Int8Format kFormats[] = {Int8Format::Q4_K, Int8Format::Q6_K, Int8Format::Q5_0, Int8Format::Q8_0};
const char* name(Int8Format f) {
  return f == Int8Format::Q4_K ? "Q4_K" : f == Int8Format::Q6_K ? "Q6_K" : f == Int8Format::Q5_0 ? "Q5_0" : "Q8_0";
}

uint16_t to_half(float v) {  // v a normal float16 value (the tests pick such values)
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t exponent = ((bits >> 23) & 0xFF) - 112;
  return (uint16_t)(((bits >> 16) & 0x8000u) | (exponent << 10) | ((bits >> 13) & 0x3FFu));
}
double from_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  const double v = exponent ? std::ldexp(1024 + mantissa, exponent - 25) : std::ldexp(mantissa, -24);
  return (h & 0x8000) ? -v : v;
}

struct Matrix {
  Int8Format format;
  int64_t in, out;
  std::vector<uint8_t> data;
  fsd_cpu_linear::Int8Weights view() const { return {data.data(), format, in, out}; }
};

// Random codes; scales of float16 values in [2^-9, 2^-6), sub-scales and mins in their ranges.
Matrix random_matrix(Int8Format f, int64_t in, int64_t out, std::mt19937& gen) {
  Matrix m{f, in, out, {}};
  const int64_t tiles = (out + kTileRows - 1) / kTileRows;
  m.data.resize(tiles * fsd_cpu_linear::int8_tile_bytes(f, in));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : m.data) b = (uint8_t)byte(gen);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  std::uniform_int_distribution<int> power(-9, -7);
  auto half = [&](uint8_t* p) {
    const uint16_t h = to_half(std::ldexp(std::round(unit(gen) * 1024) / 1024, power(gen)));
    std::memcpy(p, &h, 2);
  };
  const int64_t groups = fsd_cpu_linear::int8_group_count(f), group_bytes = fsd_cpu_linear::int8_group_bytes(f);
  for (uint8_t* p = m.data.data(); p < m.data.data() + m.data.size();) {
    for (int i = 0; i < 16 * (f == Int8Format::Q4_K ? 2 : f == Int8Format::Q6_K ? 1 : 0); ++i) half(p + 2 * i);
    p += fsd_cpu_linear::int8_header_bytes(f);
    for (int64_t k = 0; k < groups; ++k, p += group_bytes) {
      uint8_t* params = p + group_bytes - 32;
      for (int i = 0; i < 32; ++i) {
        if (f == Int8Format::Q4_K) params[i] = (uint8_t)(byte(gen) % 64);
        if (f == Int8Format::Q6_K) params[i] = (uint8_t)(int8_t)(byte(gen) % 255 - 127);
      }
      if (f == Int8Format::Q5_0 || f == Int8Format::Q8_0)
        for (int i = 0; i < 16; ++i) half(params + 2 * i);
    }
  }
  return m;
}

// The weight (row o, feature c) and the unsigned code, read as int8_gemm.h defines the layout.
double weight(const Matrix& m, int64_t o, int64_t c) {
  const Int8Format f = m.format;
  const int64_t i = o % kTileRows, block = c / fsd_cpu_linear::int8_block_cols(f);
  const uint8_t* b = m.data.data() + o / kTileRows * fsd_cpu_linear::int8_tile_bytes(f, m.in) +
                     block * fsd_cpu_linear::int8_block_bytes(f);
  const int64_t k = c % fsd_cpu_linear::int8_block_cols(f) / kGroupCols, j = c % kGroupCols;
  const uint8_t* g = b + fsd_cpu_linear::int8_header_bytes(f) + k * fsd_cpu_linear::int8_group_bytes(f);
  const int64_t operand = j / 4, bit = 4 * i + j % 4;
  int u;
  if (f == Int8Format::Q8_0) {
    u = g[64 * operand + bit];
  } else {
    const uint8_t byte = g[64 * (operand % 4) + bit];
    u = operand < 4 ? byte & 15 : byte >> 4;
    if (f == Int8Format::Q5_0) u |= ((g[256 + 8 * operand + bit / 8] >> (bit % 8)) & 1) << 4;
    if (f == Int8Format::Q6_K) u |= ((g[256 + 64 * (operand / 4) + bit] >> (2 * (operand % 4))) & 3) << 4;
  }
  const uint8_t* params = g + fsd_cpu_linear::int8_group_bytes(f) - 32;
  switch (f) {
    case Int8Format::Q4_K: return from_half(b + 2 * i) * params[i] * u - from_half(b + 32 + 2 * i) * params[16 + i];
    case Int8Format::Q6_K: return from_half(b + 2 * i) * (int8_t)params[16 * (j / 16) + i] * (u - 32);
    case Int8Format::Q5_0: return from_half(params + 2 * i) * (u - 16);
    case Int8Format::Q8_0: return from_half(params + 2 * i) * (u - 128);
  }
  return 0;
}

std::vector<float> random_x(int64_t rows, int64_t in, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * in);
  for (auto& v : x) v = normal(gen);
  return x;
}

std::vector<uint8_t> quantize(const std::vector<float>& x, int64_t rows, int64_t in, Int8Path path) {
  std::vector<uint8_t> q(rows * fsd_cpu_linear::int8_act_row_bytes(in));
  fsd_cpu_linear::int8_quantize(x.data(), in, rows, in, q.data(), path);
  return q;
}

std::vector<float> product(const Matrix& m, const std::vector<uint8_t>& xq, int64_t rows, const float* bias,
                           Int8Path path) {
  const int64_t y_stride = m.out + 3;  // a gap after each row, which must stay untouched
  std::vector<float> y(rows * y_stride, -7.0f);
  fsd_cpu_linear::Int8Gemm g;
  g.w = m.view();
  g.x = xq.data();
  g.bias = bias;
  g.y = y.data();
  g.y_stride = y_stride;
  g.rows = rows;
  g.path = path;
  fsd_cpu_linear::int8_gemm(g);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = m.out; o < y_stride; ++o) EXPECT(y[r * y_stride + o] == -7.0f);
  return y;
}

// The definition: dequantised x (its codes times dx) times the layout's weights, in double.
void test_products_match_the_definition() {
  std::mt19937 gen(1);
  for (Int8Format f : kFormats) {
    for (int64_t out : {16, 37}) {
      const int64_t in = 2 * fsd_cpu_linear::int8_block_cols(f), rows = 3;
      const Matrix m = random_matrix(f, in, out, gen);
      const std::vector<float> x = random_x(rows, in, gen);
      std::vector<float> bias(out);
      for (int64_t o = 0; o < out; ++o) bias[o] = 0.25f * (float)(o % 5);
      const std::vector<uint8_t> xq = quantize(x, rows, in, Int8Path::Portable);
      for (Int8Path path : {Int8Path::Portable, Int8Path::Best}) {
        const std::vector<float> y = product(m, xq, rows, bias.data(), path);
        for (int64_t r = 0; r < rows; ++r) {
          const uint8_t* row = xq.data() + r * fsd_cpu_linear::int8_act_row_bytes(in);
          const float* scales = reinterpret_cast<const float*>(row + in);
          for (int64_t o = 0; o < out; ++o) {
            double expected = bias[o], magnitude = std::fabs(bias[o]);
            for (int64_t c = 0; c < in; ++c) {
              const double term = weight(m, o, c) * (int8_t)row[c] * scales[4 * (c / kGroupCols)];
              expected += term;
              magnitude += std::fabs(term);
            }
            CHECK(std::fabs(y[r * (out + 3) + o] - expected) <= 1e-5 * magnitude + 1e-6, "%s out=%lld r=%lld o=%lld: %g vs %g",
                  name(f), (long long)out, (long long)r, (long long)o, y[r * (out + 3) + o], expected);
          }
        }
      }
    }
  }
}

// The codes of x: round(x / dx) with dx = amax / 127, the sums, and the vector path's bits.
void test_quantize() {
  std::mt19937 gen(2);
  const int64_t in = 96, rows = 4;
  std::vector<float> x = random_x(rows, in, gen);
  x[1 * in + 5] = NAN;            // row 1, group 0
  x[2 * in + 40] = INFINITY;      // row 2, group 1
  for (int j = 64; j < 96; ++j) x[3 * in + j] = 0.0f;  // row 3, group 2: all zero
  const std::vector<uint8_t> portable = quantize(x, rows, in, Int8Path::Portable);
  const std::vector<uint8_t> best = quantize(x, rows, in, Int8Path::Best);
  const int64_t row_bytes = fsd_cpu_linear::int8_act_row_bytes(in);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(portable.data() + r * row_bytes);
    const float* params = reinterpret_cast<const float*>(portable.data() + r * row_bytes + in);
    for (int64_t g = 0; g < in / kGroupCols; ++g) {
      const bool bad = (r == 1 && g == 0) || (r == 2 && g == 1);
      float amax = 0.0f;
      int sums[2] = {0, 0};
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[r * in + g * 32 + j]));
      for (int j = 0; j < 32; ++j) {
        const int q = codes[g * 32 + j];
        sums[j / 16] += q;
        if (bad || amax == 0.0f) {
          EXPECT(q == 0);
        } else {
          EXPECT(q >= -127 && q <= 127);
          EXPECT_NEAR(q * (amax / 127.0f), x[r * in + g * 32 + j], 0.5001 * amax / 127.0f);
        }
      }
      int32_t stored[2];
      std::memcpy(stored, params + 4 * g + 2, 8);
      EXPECT(stored[0] == sums[0] && stored[1] == sums[1]);
      if (bad) {
        EXPECT(std::isnan(params[4 * g]) && std::isnan(params[4 * g + 1]));
      } else {
        EXPECT(params[4 * g] == amax / 127.0f);
        EXPECT(params[4 * g + 1] == params[4 * g] * (float)(sums[0] + sums[1]));
      }
    }
  }
  bool same = true;  // bitwise, NaN params included
  for (size_t i = 0; i < portable.size(); ++i) same = same && portable[i] == best[i];
  EXPECT(same);
}

// A NaN in x makes its row's outputs NaN and leaves the other rows alone.
void test_nan_rows() {
  std::mt19937 gen(3);
  for (Int8Format f : kFormats) {
    const int64_t in = fsd_cpu_linear::int8_block_cols(f), out = 32, rows = 2;
    const Matrix m = random_matrix(f, in, out, gen);
    std::vector<float> x = random_x(rows, in, gen);
    x[in + 3] = NAN;
    for (Int8Path path : {Int8Path::Portable, Int8Path::Best}) {
      const std::vector<float> y = product(m, quantize(x, rows, in, path), rows, nullptr, path);
      for (int64_t o = 0; o < out; ++o) {
        EXPECT(std::isfinite(y[o]));
        EXPECT(std::isnan(y[(out + 3) + o]));
      }
    }
  }
}

// Every path and row count: the same bits as the portable loops, and as the row computed alone.
void test_paths_and_batch_invariance() {
  std::mt19937 gen(4);
  for (Int8Format f : kFormats) {
    const int64_t in = 3 * fsd_cpu_linear::int8_block_cols(f), out = 48 + 5;
    const Matrix m = random_matrix(f, in, out, gen);
    const int64_t rows = 19;  // passes of 8, 8 and 3
    const std::vector<float> x = random_x(rows, in, gen);
    const std::vector<uint8_t> xq = quantize(x, rows, in, Int8Path::Best);
    const std::vector<float> reference = product(m, xq, rows, nullptr, Int8Path::Portable);
    for (int64_t count : {1, 2, 6, 8, 9, 16, 19}) {
      const std::vector<float> y = product(m, xq, count, nullptr, Int8Path::Best);
      int64_t differ = 0;
      for (int64_t r = 0; r < count; ++r)
        for (int64_t o = 0; o < out; ++o) differ += y[r * (out + 3) + o] != reference[r * (out + 3) + o];
      CHECK(differ == 0, "%s, %lld rows: %lld outputs differ from the portable loops' over 19 rows", name(f),
            (long long)count, (long long)differ);
    }
    // row 5 alone (its quantised bytes moved to row 0) equals row 5 among 19
    const int64_t row_bytes = fsd_cpu_linear::int8_act_row_bytes(in);
    const std::vector<uint8_t> alone(xq.begin() + 5 * row_bytes, xq.begin() + 6 * row_bytes);
    const std::vector<float> y = product(m, alone, 1, nullptr, Int8Path::Best);
    EXPECT(std::equal(y.begin(), y.begin() + out, reference.begin() + 5 * (out + 3)));
  }
}

// A negative control for the comparisons above: a changed code must change the product.
void test_a_changed_code_is_seen() {
  std::mt19937 gen(5);
  for (Int8Format f : kFormats) {
    const int64_t in = fsd_cpu_linear::int8_block_cols(f), out = 16;
    Matrix m = random_matrix(f, in, out, gen);
    const int64_t params = fsd_cpu_linear::int8_header_bytes(f) + fsd_cpu_linear::int8_group_bytes(f) - 32;
    if (f == Int8Format::Q4_K || f == Int8Format::Q6_K) m.data[params + 3] = 5;  // row 3's sub-scale
    std::vector<float> x = random_x(1, in, gen);
    for (auto& v : x) v = std::fabs(v) + 0.5f;  // every code of x positive
    const std::vector<uint8_t> xq = quantize(x, 1, in, Int8Path::Best);
    const std::vector<float> before = product(m, xq, 1, nullptr, Int8Path::Best);
    m.data[fsd_cpu_linear::int8_header_bytes(f) + 4 * 3] ^= 1;  // lowest bit of row 3's first code
    const std::vector<float> after = product(m, xq, 1, nullptr, Int8Path::Best);
    int64_t changed = 0;
    for (int64_t o = 0; o < out; ++o) changed += before[o] != after[o];
    CHECK(changed == 1 && before[3] != after[3], "%s: %lld outputs changed", name(f), (long long)changed);
  }
}

}  // namespace

int main() {
  std::printf("int8 path: %s\n", fsd_cpu_linear::int8_vnni_available() ? "avx512-vnni" : "portable");
  test_products_match_the_definition();
  test_quantize();
  test_nan_rows();
  test_paths_and_batch_invariance();
  test_a_changed_code_is_seen();
  return fsd_test::verdict("test_int8_gemm");
}
