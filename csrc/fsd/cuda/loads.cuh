// Device building blocks of the CUDA kernels (framework-free: CUDA runtime, CUB and fsd headers),
// first piece: the block size, and the logit loads: float / bfloat16 / float16 to float (fsd/
// numerics.h), +inf clamped to FLT_MAX, 16-byte vectors with scalar head and tail so any row
// alignment and any vocabulary size works, one row or a target and a draft row at once.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "fsd/common.h"
#include "fsd/cuda/streaming.cuh"
#include "fsd/rules.h"

// Thread-block clusters (accept.cuh's cluster kernels): device code for sm_90 and newer, and the
// CPU simulation of the kernels (csrc/fsd/tests/cuda_sim), which runs a cluster's blocks at once.
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || defined(FSD_CUDA_SIM)
#define FSD_CLUSTER_KERNELS 1
#else
#define FSD_CLUSTER_KERNELS 0
#endif

namespace fsd {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of every kernel
// Register budgets (__launch_bounds__ minimum blocks per SM): ptxas otherwise sometimes settles on
// 64 registers and spills. Streaming statistics: 4 blocks (<= 64 registers); the decision kernel
// (pass 2 + the row finish): 2 blocks (<= 128); the filter path: 1 block; sample_rows_kernel: 2
// (its histograms' warp reductions spilled at 64).
constexpr int kScanItems = 8;  // contiguous ids per thread in the sampling / tie scans

// The CUDA simulation (csrc/fsd/tests/cuda_sim) counts the bytes these load helpers read from the
// buffers a test watches, to measure how many times a launch path reads the logits.
#ifdef FSD_CUDA_SIM
#define FSD_SIM_READ(p, bytes) ::sim::global_read((p), (bytes))
#else
#define FSD_SIM_READ(p, bytes) ((void)0)
#endif

// One logit, unclamped (the bad-row check needs to see +inf as non-finite).
template <typename T>
__device__ __forceinline__ float load_raw(const T* p) {
  FSD_SIM_READ(p, sizeof(T));
  return to_float(*p);
}

template <typename T>
__device__ __forceinline__ float load_logit(const T* p) {
  return clamp_logit(load_raw(p));
}

template <typename T>
struct VecWidth {
  static constexpr int value = 16 / sizeof(T);
};

// The N = 16 / sizeof(T) raw values packed in one 16-byte word.
template <typename T>
__device__ __forceinline__ void decode_vec(const uint4 word, float (&out)[VecWidth<T>::value]) {
  const uint32_t w[4] = {word.x, word.y, word.z, word.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      T lo, hi;
      lo.bits = (uint16_t)(w[i] & 0xFFFFu);
      hi.bits = (uint16_t)(w[i] >> 16);
      out[2 * i] = to_float(lo);
      out[2 * i + 1] = to_float(hi);
    }
  }
}

// The 16-byte word at a 16-byte aligned address of global memory, through the read-only path.
template <typename T>
__device__ __forceinline__ uint4 load_word(const T* p) {
  FSD_SIM_READ(p, 16);
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <int N>
using Width = std::integral_constant<int, N>;

// End of the scalar head of ids [begin, end) of `row`: the first id at a 16-byte boundary (or end).
template <typename T>
__device__ __forceinline__ int64_t vector_head_end(const T* row, int64_t begin, int64_t end) {
  constexpr int64_t N = VecWidth<T>::value;
  const int64_t misalign = (int64_t)((reinterpret_cast<uintptr_t>(row + begin) % 16) / sizeof(T));
  return misalign ? min(end, begin + (N - misalign)) : begin;
}

// The block's threads visit ids [begin, end) of `row`: f(id, values, Width<n>) with n raw values at
// ids id..id+n-1 (n = the vector width in the aligned body, 1 in the head and tail).
template <typename T, typename F>
__device__ __forceinline__ void block_for_each(const T* __restrict__ row, int64_t begin, int64_t end, F&& f) {
  constexpr int N = VecWidth<T>::value;
  if (end <= begin) return;
  const int64_t head_end = vector_head_end(row, begin, end);
  for (int64_t j = begin + threadIdx.x; j < head_end; j += blockDim.x) {
    float v[N];
    v[0] = load_raw(row + j);
    f(j, v, Width<1>{});
  }
  const int64_t vectors = (end - head_end) / N;
  // kAhead 16-byte loads in flight per thread before the first is used (the compiler does not
  // hoist a load above the previous iteration's work); each thread still visits its vectors in
  // the same order.
  constexpr int kAhead = 2;
  for (int64_t first = threadIdx.x; first < vectors; first += (int64_t)kAhead * blockDim.x) {
    uint4 words[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = first + (int64_t)u * blockDim.x;
      if (t < vectors) words[u] = load_word(row + head_end + t * N);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = first + (int64_t)u * blockDim.x;
      if (t < vectors) {
        float v[N];
        decode_vec<T>(words[u], v);
        f(head_end + t * N, v, Width<N>{});
      }
    }
  }
  for (int64_t j = head_end + vectors * N + threadIdx.x; j < end; j += blockDim.x) {
    float v[N];
    v[0] = load_raw(row + j);
    f(j, v, Width<1>{});
  }
}

// The block visits ids [begin, end) of a target row and a draft row at once:
// f(id, target_values, draft_values, Width<n>). Ids >= draft_end get draft value -inf (the draft
// vocabulary is smaller). Vector loads for the target; for the draft too when both rows share the
// same 16-byte phase.
// With `reverse` the aligned body is walked from its end (pass 2 right after pass 1: the ids read
// last are the likeliest still in L2).
template <typename T, typename F>
__device__ __forceinline__ void block_for_each_pair(const T* __restrict__ target, const T* __restrict__ draft,
                                                    int64_t begin, int64_t end, int64_t draft_end, bool reverse,
                                                    F&& f) {
  constexpr int N = VecWidth<T>::value;
  const int64_t both_end = max(begin, min(end, draft_end));
  if (both_end > begin) {
    const bool same_phase =
        reinterpret_cast<uintptr_t>(target + begin) % 16 == reinterpret_cast<uintptr_t>(draft + begin) % 16;
    const int64_t head_end = vector_head_end(target, begin, both_end);
    for (int64_t j = begin + threadIdx.x; j < head_end; j += blockDim.x) {
      float a[N], b[N];
      a[0] = load_raw(target + j);
      b[0] = load_raw(draft + j);
      f(j, a, b, Width<1>{});
    }
    const int64_t vectors = (both_end - head_end) / N;
    // As in block_for_each: kAhead vectors of each row in flight per thread.
    constexpr int kAhead = 2;
    for (int64_t first = threadIdx.x; first < vectors; first += (int64_t)kAhead * blockDim.x) {
      uint4 target_words[kAhead], draft_words[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int64_t t = first + (int64_t)u * blockDim.x;
        const int64_t j = head_end + (reverse ? vectors - 1 - t : t) * N;
        if (t < vectors) {
          target_words[u] = load_word(target + j);
          if (same_phase) draft_words[u] = load_word(draft + j);
        }
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int64_t t = first + (int64_t)u * blockDim.x;
        const int64_t j = head_end + (reverse ? vectors - 1 - t : t) * N;
        if (t < vectors) {
          float a[N], b[N];
          decode_vec<T>(target_words[u], a);
          if (same_phase) {
            decode_vec<T>(draft_words[u], b);
          } else {
#pragma unroll
            for (int i = 0; i < N; ++i) b[i] = load_raw(draft + j + i);
          }
          f(j, a, b, Width<N>{});
        }
      }
    }
    for (int64_t j = head_end + vectors * N + threadIdx.x; j < both_end; j += blockDim.x) {
      float a[N], b[N];
      a[0] = load_raw(target + j);
      b[0] = load_raw(draft + j);
      f(j, a, b, Width<1>{});
    }
  }
  if (end > both_end) {
    block_for_each<T>(target, both_end, end, [&](int64_t j, const float* a, auto width) {
      float b[N];
#pragma unroll
      for (int i = 0; i < N; ++i) b[i] = -kInf;
      f(j, a, b, width);
    });
  }
}

}  // namespace cuda
}  // namespace fsd
