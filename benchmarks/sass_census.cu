// Census kernels for benchmarks/sass_census.py: the per-logit arithmetic of the two streaming passes
// (csrc/fsd/cuda/streaming.cuh), each in a minimal loop over 16-byte words, so that the static SASS
// of each loop body is that arithmetic plus a fixed loop overhead (about six instructions). Compiled
// with nvcc -cubin only, never launched; with -DFSD_CENSUS_COMMON_CASE the rare branches of the
// statistics (FSD_RARE in streaming.cuh: a new maximum, a NaN or an infinity) are compiled away.
#include "fsd/cuda/device.cuh"

namespace {
using namespace fsd;
using namespace fsd::cuda;

// Pass 1: online-softmax statistics of one row (kSame: one temperature, one exponential per id).
template <typename T, bool kSame>
__device__ __forceinline__ void stats_loop(const uint4* row, int64_t words, StatScales scales, RowStat* out) {
  constexpr int N = VecWidth<T>::value;
  RowStat st = out[threadIdx.x];  // (from memory: a known -inf maximum would fold into constants)
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
    float v[N];
    decode_vec<T>(__ldg(row + w), v);
    stat_add<N, kSame>(st, w * N, v, scales);
  }
  out[threadIdx.x] = st;
}

// Pass 2, plain path: divergence term and residual of each id of a target / draft pair.
template <typename T, Divergence D>
__device__ __forceinline__ void pass_two_loop(const uint4* target, const uint4* draft, int64_t words, PlainPair pair,
                                              float* out) {
  constexpr int N = VecWidth<T>::value;
  float div = 0.0f, residual = 0.0f;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
    float a[N], b[N];
    decode_vec<T>(__ldg(target + w), a);
    decode_vec<T>(__ldg(draft + w), b);
#pragma unroll
    for (int i = 0; i < N; ++i) plain_add<D, true, true>(pair, a[i], b[i], div, residual);
  }
  out[threadIdx.x] = div + residual;
}
}  // namespace

#define FSD_CENSUS_STATS(T, tag)                                                                               \
  extern "C" __global__ void census_stats_##tag##_one_temperature(const uint4* r, int64_t n, StatScales s,      \
                                                                  RowStat* o) { stats_loop<T, true>(r, n, s, o); } \
  extern "C" __global__ void census_stats_##tag##_two_temperatures(const uint4* r, int64_t n, StatScales s,     \
                                                                   RowStat* o) { stats_loop<T, false>(r, n, s, o); }
#define FSD_CENSUS_PASS_TWO(T, tag, D, name)                                                                   \
  extern "C" __global__ void census_pass_two_##tag##_##name(const uint4* t, const uint4* d, int64_t n,        \
                                                            PlainPair p, float* o) {                          \
    pass_two_loop<T, Divergence::D>(t, d, n, p, o);                                                            \
  }
#define FSD_CENSUS_DTYPE(T, tag)              \
  FSD_CENSUS_STATS(T, tag)                    \
  FSD_CENSUS_PASS_TWO(T, tag, KL, kl)         \
  FSD_CENSUS_PASS_TWO(T, tag, RKL, rkl)       \
  FSD_CENSUS_PASS_TWO(T, tag, JS, js)         \
  FSD_CENSUS_PASS_TWO(T, tag, TV, tv)         \
  FSD_CENSUS_PASS_TWO(T, tag, MKL, mkl)

FSD_CENSUS_DTYPE(float, f32)
FSD_CENSUS_DTYPE(BFloat16, bf16)
FSD_CENSUS_DTYPE(Float16, f16)
