// Vectorised sums over a vocabulary row (sum_range and the weights it sums: sampling weights kept by
// a Dist, stored exponentials), and the picked-id loop the filter walks use.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fsd/cpu/vec.h"

namespace fsd {
namespace cpu {

// sum of w(j) over [begin, end), kLanes at a time; `w` must be branch-free to vectorise. kSum says
// what is summed, which sets the lane sums' type:
//   Weights (double lanes): sampling weights and masses. An inverse CDF draws the token where the
//     cumulative sums pass u * total, so the boundaries move wherever those sums disagree with
//     the total, and with V = 151936 ids a boundary sits every ~1/V of the mass: float lane sums
//     (~4e-10 relative off for an N(0, 1) row, more where few ids hold the mass) moved about 1
//     draw in 1000 off the draw an exact sum of the same float weights makes, which the CUDA
//     kernel (double sums) makes. Double lanes are exact to ~1e-13 (test_core).
//   Terms (float lanes, flushed to double every kFlushEvery ids, ~1e-7): divergence terms.
// The widening costs an AVX2 loop a few instructions per 8 ids beside an exponential's ~20.
enum class SumOf { Weights, Terms };

template <SumOf kSum, typename WeightFn>
FSD_CPU_CLONES double sum_range(int64_t begin, int64_t end, const WeightFn& w) {
  using Lane = std::conditional_t<kSum == SumOf::Weights, double, float>;
  double total = 0.0;
  Lane lane[kLanes] = {};
  int64_t j = begin, since_flush = 0;
  for (; j + kLanes <= end; j += kLanes) {
    FSD_SIMD
    for (int l = 0; l < kLanes; ++l) lane[l] += (Lane)w(j + l);
    if (kSum == SumOf::Terms && (since_flush += kLanes) >= kFlushEvery) {
      for (int l = 0; l < kLanes; ++l) total += lane[l], lane[l] = 0.0f;
      since_flush = 0;
    }
  }
  for (int l = 0; l < kLanes; ++l) total += lane[l];
  for (; j < end; ++j) total += w(j);
  return total;
}

// Weights over ids [0, n) given by `below(j)` for j < split and `above(j)` for j >= split, so that
// each side is branch-free (e.g. the residual max(0, p - q) needs draft logits only below V_d).
template <typename Below, typename Above>
struct SplitWeight {
  int64_t split;
  Below below;
  Above above;
  float operator()(int64_t j) const { return j < split ? below(j) : above(j); }
  template <SumOf kSum = SumOf::Weights>
  double sum(int64_t begin, int64_t end) const {
    const int64_t mid = std::max(begin, std::min(end, split));
    return sum_range<kSum>(begin, mid, below) + sum_range<kSum>(mid, end, above);
  }
};

template <typename Below, typename Above>
SplitWeight<Below, Above> split_weight(int64_t split, Below below, Above above) {
  return {split, below, above};
}

// exp(s_j) over kept ids, unnormalised: the weights of a sample of p (total = d.sum).
template <typename T>
auto kept_exp(const T* row, const Dist& d) {
  return [row, d](int64_t j) FSD_INLINE_LAMBDA {  // d by value: loop-invariant fields, so the loop vectorises
    const float s = d.scaled(load_logit(row, j));
    const float e = exp_nonpositive(s);
    return s >= d.cut ? e : 0.0f;
  };
}

// exp(s_j - s_top) over kept ids, for s_top >= every kept s_j: kept_exp relative to a smaller
// maximum, so a range whose exp(s_j) are all below float's range still sums (exact_log_rest).
template <typename T>
auto kept_exp_below(const T* row, const Dist& d, float s_top) {
  return [row, d, s_top](int64_t j) FSD_INLINE_LAMBDA {
    const float s = d.scaled(load_logit(row, j));
    const float e = exp_nonpositive(s - s_top);
    return s >= d.cut ? e : 0.0f;
  };
}

// sum over j with s_j >= cut of exp(s_j). With `exps`, also stores each exp(s_j) (0 below the
// cut) in exps[0, n): the divergence pass that follows then takes p_j from exps[j] instead of
// recomputing two exponentials per id, most of its arithmetic.
template <typename T>
double sum_exp(const T* row, int64_t n, const Dist& d, float* exps = nullptr) {
  if (exps == nullptr) return sum_range<SumOf::Weights>(0, n, kept_exp(row, d));
  return sum_range<SumOf::Weights>(0, n, [kept = kept_exp(row, d), exps](int64_t j) FSD_INLINE_LAMBDA {
    const float e = kept(j);
    exps[j] = e;
    return e;
  });
}

// Weights a sum pass stored (sum_exp's `exps`), for an inverse CDF over the same row. A functor,
// not a lambda: see Dist::log_prob_float (fsd/numerics.h) for the GCC versions that crash on some
// lambdas here.
struct StoredWeights {
  const float* exps;
  FSD_ALWAYS_INLINE float operator()(int64_t j) const { return exps[j]; }
};

// take(j) for each id j in [0, n) with pick(j), in ascending order. `pick` (branch-free) runs over
// blocks of ids first as one vectorised count, so a block without a pick costs one pass of it.
template <typename Pick, typename Take>
FSD_ALWAYS_INLINE void for_each_picked(int64_t n, const Pick& pick, const Take& take) {
  constexpr int64_t kBlock = 4 * kLanes;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    int32_t hits = 0;
    for (int64_t j = start; j < end; ++j) hits += pick(j) ? 1 : 0;
    for (int64_t j = start; hits > 0 && j < end; ++j)
      if (pick(j)) take(j);
  }
}

}  // namespace cpu
}  // namespace fsd
