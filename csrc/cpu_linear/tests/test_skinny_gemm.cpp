// Unit tests of the CPU linear component's few-row kernel (skinny_gemm) against a double-precision
// loop, without torch (ctest).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cpu_linear/skinny_gemm.h"
#include "expect.h"

namespace {

// Every row count 1..16 (full and partial row groups), odd `in` (the % 8 and % 32 tails) and odd
// `out` (a lone last weight row, a short last block of four), padded strides, with and without
// bias, against a double-precision loop; a task-splitting ParallelFor, so out ranges that start
// mid-matrix are covered; float32 and bfloat16 weights (each by the AVX2 path where the CPU has it,
// and by the portable one), and bfloat16 weights with x given as bfloat16 too (the AVX512-BF16 path
// where the CPU has it). Values that bfloat16 holds exactly, so one expected result serves every
// mode.
void test_skinny_gemm() {
  std::printf("skinny_gemm: AVX512-BF16 path %s, AVX2 path %s\n",
              fsd_cpu_linear::bf16_dot_available() ? "checked" : "not on this CPU",
              fsd_cpu_linear::avx2_available() ? "checked" : "not on this CPU");
  const fsd_cpu_linear::ParallelFor chunks_of_3 = [](int64_t count, int64_t, const fsd_cpu_linear::RangeFn& body) {
    for (int64_t begin = 0; begin < count; begin += 3) body(begin, std::min(count, begin + 3));
  };
  auto bfloat16_of = [](double value) {  // value truncated to bfloat16
    return (uint16_t)(fsd_cpu_linear::float_to_bits((float)value) >> 16);
  };
  enum class Mode { Float32, Float32Portable, BFloat16, BFloat16Portable, BFloat16Dot };
  for (const Mode mode : {Mode::Float32, Mode::Float32Portable, Mode::BFloat16, Mode::BFloat16Portable,
                          Mode::BFloat16Dot}) {
  for (int64_t in : {1, 8, 13, 40, 77, 2085}) {  // 2085: large blocks (L2 prefetch; 3 column chunks at 5+ rows)
    for (int64_t out : {1, 2, 7, 131, 200}) {
      for (int64_t rows = 1; rows <= fsd_cpu_linear::kSkinnyMaxRows; ++rows) {
        const int64_t x_stride = in + 3, w_stride = in + 1, y_stride = out + 2;
        std::vector<float> x(rows * x_stride), w(out * w_stride), bias(out), y(rows * y_stride, -7.0f);
        std::vector<uint16_t> x_bf16(x.size()), w_bf16(w.size());
        for (size_t i = 0; i < x.size(); ++i) {
          x_bf16[i] = bfloat16_of(std::sin(0.37 * i));
          x[i] = fsd_cpu_linear::bits_to_float((uint32_t)x_bf16[i] << 16);
        }
        for (size_t i = 0; i < w.size(); ++i) {
          w_bf16[i] = bfloat16_of(std::cos(0.11 * i + 0.5));
          w[i] = fsd_cpu_linear::bits_to_float((uint32_t)w_bf16[i] << 16);  // the same value in float32
        }
        for (int64_t o = 0; o < out; ++o) bias[o] = 0.25f * o;
        fsd_cpu_linear::SkinnyGemm g;
        g.x = x.data(), g.x_stride = x_stride, g.w_stride = w_stride;
        if (mode == Mode::BFloat16Dot) {
          g.x_bf16 = reinterpret_cast<const uint16_t*>(x_bf16.data());
          if (fsd_cpu_linear::bf16_dot_available()) g.x = nullptr;  // that path reads x_bf16 alone
        }
        const bool bf16 = mode != Mode::Float32 && mode != Mode::Float32Portable;
        g.w = bf16 ? static_cast<const void*>(w_bf16.data()) : w.data();
        g.w_dtype = bf16 ? fsd_cpu_linear::WeightDType::BFloat16 : fsd_cpu_linear::WeightDType::Float32;
        g.bias = (rows % 2) ? bias.data() : nullptr, g.y = y.data(), g.y_stride = y_stride;
        g.rows = rows, g.in = in, g.out = out;
        g.portable = mode == Mode::Float32Portable || mode == Mode::BFloat16Portable;
        fsd_cpu_linear::skinny_gemm(g, chunks_of_3);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t o = 0; o < out; ++o) {
            double expected = g.bias ? bias[o] : 0.0;
            for (int64_t i = 0; i < in; ++i) expected += (double)x[r * x_stride + i] * w[o * w_stride + i];
            EXPECT_NEAR(y[r * y_stride + o], expected, 1e-4 * (1.0 + std::fabs(expected)));
          }
          for (int64_t o = out; o < y_stride; ++o) EXPECT(y[r * y_stride + o] == -7.0f);  // padding untouched
        }
      }
    }
  }
  }
}

}  // namespace

int main() {
  test_skinny_gemm();
  return fsd_test::verdict("test_skinny_gemm");
}
