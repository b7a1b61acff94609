// One-vocabulary-row primitives of the CPU kernels: statistics, filter cutoffs, divergence sums and
// inverse-CDF sampling, each a single pass (or less) over the logits with no probability array
// materialised. Scratch: candidate values of the filter cutoffs and of div_top_k's k-th value (the
// block maxima, the largest few values or one bucket of them, never a copy of the row), and the
// exp(s_j) a sum pass stores for the divergence pass that follows it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "fsd/common.h"
#include "fsd/cpu/vec.h"
#include "fsd/rules.h"

namespace fsd {
namespace cpu {

struct RowScan {
  float max = -kInf;    // the largest logit as load_logit sees it (+inf counts as FLT_MAX)
  int64_t argmax = 0;   // the lowest id holding it
  bool bad = false;     // holds NaN, or no finite logit
};

// One pass: max, argmax (lowest id on ties) and the bad-row check. Each lane keeps the block of its
// first maximum (an int32 block index, so the argmax costs two selects per element and rows up to
// 2^35 ids); the lowest id among the lanes holding the row maximum wins.
template <typename T>
FSD_CPU_CLONES RowScan scan_row(const T* row, int64_t n) {
  float lane_max[kLanes], lane_check[kLanes];
  int32_t lane_block[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -kInf, lane_check[l] = 0.0f, lane_block[l] = 0;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const int32_t block = (int32_t)(j / kLanes);
    FSD_SIMD
    for (int l = 0; l < kLanes; ++l) {
      const float raw = to_float(row[j + l]);
      const float x = clamp_logit(raw);  // load_logit
      const bool higher = x > lane_max[l];  // false for NaN
      lane_max[l] = higher ? x : lane_max[l];
      lane_block[l] = higher ? block : lane_block[l];
      lane_check[l] += raw - raw;  // NaN from here on iff some logit is NaN or +-inf
    }
  }
  RowScan scan;
  float check = 0.0f;
  for (int l = 0; l < kLanes; ++l) {
    const int64_t id = (int64_t)lane_block[l] * kLanes + l;
    if (lane_max[l] > scan.max || (lane_max[l] == scan.max && id < scan.argmax))
      scan.max = lane_max[l], scan.argmax = id;
    check += lane_check[l];
  }
  for (; j < n; ++j) {  // the tail's ids are above every lane's: strictly higher wins
    const float raw = to_float(row[j]);
    const float x = load_logit(row, j);
    if (x > scan.max) scan.max = x, scan.argmax = j;
    check += raw - raw;
  }
  if (check != check) {  // rare: some non-finite value, classify it
    bool has_nan = false, has_finite = false;
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_float(row[i]);
      has_nan |= x != x;
      has_finite |= std::isfinite(x);
    }
    scan.bad = has_nan || !has_finite;
  }
  return scan;
}

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

// Cutoff walks. A walk visits the kept values of a row (finite s_j >= floor) in descending order,
// adding each one's weight (1 for top-k, exp(s_j) for top-p), and stops at the value that brings
// the cumulative weight to its target: k for top-k, top_p times the total weight of the visited
// values for top-p. That value is the cutoff (ties at it are kept). A walk that never gets there
// (fewer than k finite values; top-p left short by rounding) keeps every value. Only the end of
// the walk is sorted: see walk_cutoff.
enum class Walk { Count, Mass };

// Whether a walk visits value s: finite and at least `floor`.
FSD_ALWAYS_INLINE bool walk_visits(float s, float floor) { return s >= floor && s > -kInf; }

template <Walk W>
FSD_ALWAYS_INLINE float walk_weight(float s) {
  return W == Walk::Count ? 1.0f : exp_nonpositive(s);
}

// Walks `sorted` (descending) on from `cumulative`; the value that reaches `target`, or NaN.
template <Walk W>
float walk_sorted(const std::vector<float>& sorted, double target, double& cumulative) {
  for (const float s : sorted) {
    cumulative += (double)walk_weight<W>(s);
    if (!(cumulative < target)) return s;
  }
  return std::numeric_limits<float>::quiet_NaN();
}

// The selection passes below work on blocks of kSelectBlock ids; a block whose largest logit
// cannot qualify (s is monotone in the logit) costs one vectorised max.
constexpr int64_t kSelectBlock = 4 * kLanes;

// The largest logit of ids [start, end), as load_logit sees it.
template <typename T>
FSD_ALWAYS_INLINE float block_max_logit(const T* row, int64_t start, int64_t end) {
  float block_max = -kInf;
  if (end - start == kSelectBlock) {
    float lane[kLanes];
    for (int l = 0; l < kLanes; ++l) lane[l] = -kInf;
    for (int64_t j = start; j < end; j += kLanes) {
      FSD_SIMD
      for (int l = 0; l < kLanes; ++l) {
        const float x = load_logit(row, j + l);
        lane[l] = x > lane[l] ? x : lane[l];
      }
    }
    for (int l = 0; l < kLanes; ++l) block_max = std::max(block_max, lane[l]);
  } else {
    for (int64_t j = start; j < end; ++j) block_max = std::max(block_max, load_logit(row, j));
  }
  return block_max;
}

// What block_maxima<true> also gathers about the values a walk visits (finite s_j >= floor): the
// sum of their weights exp(s_j) (top-p's total) and the smallest of them (0 when none), which
// spares walk_buckets its smallest_kept pass.
struct Visited {
  double total = 0.0;
  float smallest = 0.0f;
};

// Each block's largest s_j, for the blocks holding one >= floor (and > -inf), in `maxima`. They are
// values of distinct ids, so the m-th largest of them is at most the row's m-th largest value: a
// starting bar for collect_largest that skips all but about m blocks. With kSum, `visited` from
// the same pass.
template <bool kSum, typename T>
FSD_CPU_CLONES void block_maxima(const T* row, int64_t n, const Dist& d, float floor, std::vector<float>& maxima,
                                 Visited& visited) {
  maxima.clear();
  maxima.reserve((size_t)((n + kSelectBlock - 1) / kSelectBlock));
  // Float lane sums flushed to the total every kFlushEvery ids, not per block: a block's 16-lane
  // reduction is a chain of dependent additions (~8% of this pass, single-thread timing).
  float lane_sum[kLanes] = {}, lane_min[kLanes] = {};
  double total = 0.0;
  float smallest = 0.0f;
  for (int64_t start = 0; start < n; start += kSelectBlock) {
    const int64_t end = std::min(n, start + kSelectBlock);
    float top;
    if (kSum) {  // one loop for all three: the exponentials dominate, the max comes with them
      float lane_max[kLanes];
      for (int l = 0; l < kLanes; ++l) lane_max[l] = -kInf;
      int64_t j = start;
      for (; j + kLanes <= end; j += kLanes) {
        FSD_SIMD
        for (int l = 0; l < kLanes; ++l) {
          const float x = load_logit(row, j + l);
          const float s = d.scaled(x);
          const bool visits = walk_visits(s, floor);
          lane_max[l] = x > lane_max[l] ? x : lane_max[l];
          lane_sum[l] += visits ? exp_nonpositive(s) : 0.0f;
          lane_min[l] = visits && s < lane_min[l] ? s : lane_min[l];
        }
      }
      float block_max = -kInf;
      for (int l = 0; l < kLanes; ++l) block_max = std::max(block_max, lane_max[l]);
      for (; j < end; ++j) {  // the last block's tail
        const float x = load_logit(row, j);
        const float s = d.scaled(x);
        block_max = std::max(block_max, x);
        if (!walk_visits(s, floor)) continue;
        total += (double)exp_nonpositive(s);
        smallest = std::min(smallest, s);
      }
      top = d.scaled(block_max);
      if (end % kFlushEvery == 0)
        for (int l = 0; l < kLanes; ++l) total += lane_sum[l], lane_sum[l] = 0.0f;
    } else {
      top = d.scaled(block_max_logit(row, start, end));
    }
    if (walk_visits(top, floor)) maxima.push_back(top);
  }
  for (int l = 0; l < kLanes; ++l) total += lane_sum[l], smallest = std::min(smallest, lane_min[l]);
  visited = Visited{total, smallest};
}

// The m largest scaled values s_j >= bar (and > -inf) of a row, unordered, in `out`: all of them
// when fewer qualify. One pass and no copy of the row: blocks whose largest value is below the bar
// are skipped; qualifying values go to a buffer that is cut back to its m largest (nth_element)
// whenever it fills, after which only values above the m-th largest so far qualify (an equal one
// cannot change the m largest values).
template <typename T>
FSD_CPU_CLONES void collect_largest(const T* row, int64_t n, const Dist& d, int64_t m, float bar,
                                    std::vector<float>& out) {
  const size_t capacity = (size_t)std::max<int64_t>(2 * m, m + 1024);
  out.clear();
  out.reserve(capacity);
  bar = std::max(bar, -FLT_MAX);  // -inf never qualifies
  bool strict = false;            // s >= bar until the first cut, then s > bar
  for (int64_t start = 0; start < n; start += kSelectBlock) {
    const int64_t end = std::min(n, start + kSelectBlock);
    const float top = d.scaled(block_max_logit(row, start, end));
    if (strict ? !(top > bar) : !(top >= bar)) continue;
    for (int64_t j = start; j < end; ++j) {
      const float s = d.scaled(load_logit(row, j));
      if (strict ? !(s > bar) : !(s >= bar)) continue;
      out.push_back(s);
      if (out.size() < capacity) continue;
      std::nth_element(out.begin(), out.begin() + (m - 1), out.end(), std::greater<float>());
      out.resize(m);
      bar = out[m - 1];  // the m-th largest so far
      strict = true;
    }
  }
  if ((int64_t)out.size() > m) {
    std::nth_element(out.begin(), out.begin() + (m - 1), out.end(), std::greater<float>());
    out.resize(m);
  }
}

// The m largest scaled values s_j >= floor (and > -inf) of a row, unordered, in `out` (all of them
// when fewer qualify), in two cheap passes: the block maxima set the bar (collecting from the floor
// instead visits most blocks of a row with no clear peak before the bar rises), then
// collect_largest.
template <typename T>
void largest_scaled(const T* row, int64_t n, const Dist& d, int64_t m, float floor, std::vector<float>& out) {
  Visited unused;
  block_maxima<false>(row, n, d, floor, out, unused);
  float bar = floor;
  if ((int64_t)out.size() >= m) {
    std::nth_element(out.begin(), out.begin() + (m - 1), out.end(), std::greater<float>());
    bar = out[m - 1];
  }
  collect_largest(row, n, d, m, bar, out);
}

// The smallest kept value (finite s_j >= floor; 0 when none).
template <typename T>
FSD_CPU_CLONES float smallest_kept(const T* row, int64_t n, const Dist& d, float floor) {
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = 0.0f;  // s <= 0: the maximum's s = 0 bounds it
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    FSD_SIMD
    for (int l = 0; l < kLanes; ++l) {
      const float s = d.scaled(load_logit(row, j + l));
      lane[l] = walk_visits(s, floor) && s < lane[l] ? s : lane[l];
    }
  }
  float smallest = 0.0f;
  for (int l = 0; l < kLanes; ++l) smallest = std::min(smallest, lane[l]);
  for (; j < n; ++j) {
    const float s = d.scaled(load_logit(row, j));
    if (walk_visits(s, floor)) smallest = std::min(smallest, s);
  }
  return smallest;
}

// A walk over all kept values in three passes with no sort of the row: the weights in kBuckets
// buckets of s (equal widths from 0 down to the smallest kept value or -88, below which exp is 0
// and everything shares the last bucket), the bucket where the cumulative weight reaches the
// target, then that bucket's values alone sorted and walked. `goal`: k for Walk::Count, top_p for
// Walk::Mass, whose total weight the bucket pass sums on the way (no pass of its own).
// `smallest`: smallest_kept's value when the caller has it (block_maxima<true>), else a pass of
// its own finds it.
template <Walk W, typename T>
FSD_CPU_CLONES float walk_buckets(const T* row, int64_t n, const Dist& d, float floor, double goal,
                                  std::vector<float>& scratch, std::optional<float> smallest = std::nullopt) {
  constexpr int kBuckets = 2048;
  constexpr int64_t kBlock = 4 * kLanes;
  const float lo = std::max(smallest ? *smallest : smallest_kept(row, n, d, floor), -88.0f);
  const float scale = lo < 0.0f ? (float)(kBuckets - 1) / -lo : 0.0f;
  auto bucket_of = [scale](float s) FSD_INLINE_LAMBDA {  // s <= 0; NaN (s = -inf, scale 0) -> last
    const float x = -s * scale;
    return x < (float)(kBuckets - 1) ? (int32_t)x : kBuckets - 1;
  };
  // Zero weights (not visited, or exp underflows) are added to kSpare spare slots in turn rather
  // than to their bucket: a long run of them (a top-k floor, a low temperature) would otherwise
  // chain every addition through one bucket's latency.
  constexpr int kSpare = 8;
  double weights[kBuckets + kSpare] = {};
  int32_t bucket[kBlock];
  float weight[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t count = std::min<int64_t>(kBlock, n - start);
    FSD_SIMD
    for (int64_t l = 0; l < count; ++l) {  // buckets and weights vectorised, then added one by one
      const float s = d.scaled(load_logit(row, start + l));
      weight[l] = walk_visits(s, floor) ? walk_weight<W>(s) : 0.0f;
      bucket[l] = weight[l] > 0.0f ? bucket_of(s) : kBuckets + (int32_t)(l % kSpare);
    }
    for (int64_t l = 0; l < count; ++l) weights[bucket[l]] += (double)weight[l];
  }
  double target = goal;
  if (W == Walk::Mass) {
    double total = 0.0;
    for (int b = 0; b < kBuckets; ++b) total += weights[b];
    target = goal * total;
  }
  double cumulative = 0.0;
  int32_t found = 0;
  for (; found < kBuckets && cumulative + weights[found] < target; ++found) cumulative += weights[found];
  if (found == kBuckets) return -kInf;
  scratch.clear();
  for_each_picked(
      n,
      [&](int64_t j) FSD_INLINE_LAMBDA {
        const float s = d.scaled(load_logit(row, j));
        return walk_visits(s, floor) && bucket_of(s) == found;
      },
      [&](int64_t j) { scratch.push_back(d.scaled(load_logit(row, j))); });
  std::sort(scratch.begin(), scratch.end(), std::greater<float>());
  const float cutoff = walk_sorted<W>(scratch, target, cumulative);
  // NaN: this bucket's weights added in another order fell short by a rounding; it ends here anyway.
  return cutoff == cutoff || scratch.empty() ? cutoff : scratch.back();
}

// Walks whose end is known to lie among the row's largest kFewValues values select those instead
// of taking the bucket walk: cheaper for k well below ~1000 (docs/cpu.md, "The verification
// kernels on the CPU").
constexpr int64_t kFewValues = 256;

// The values of `scratch`, sorted in descending order, walked to `target` (see walk_sorted).
template <Walk W>
float sort_and_walk(std::vector<float>& scratch, double target) {
  std::sort(scratch.begin(), scratch.end(), std::greater<float>());
  double cumulative = 0.0;
  return walk_sorted<W>(scratch, target, cumulative);
}

// Whether a row's kFewValues largest values can weigh `target`, given its `few` largest block
// maxima in descending order: a block holds kSelectBlock values at most its maximum, so those
// values weigh at most kSelectBlock times the weights of the kFewValues / kSelectBlock largest
// block maxima (with a margin for the rounding of the walk's sum). A flat row's fall far short,
// and selecting them would be a wasted pass. (Only a pass: walk_buckets finds the same cutoff.)
inline bool few_values_can_reach(const std::vector<float>& maxima, int64_t few, double target) {
  double most = 0.0;
  for (int64_t i = 0; i < few && i * kSelectBlock < kFewValues; ++i)
    most += (double)kSelectBlock * (double)walk_weight<Walk::Mass>(maxima[i]);
  return most * (1.0 + 1e-6) >= target;
}

// A top-p walk over a row with no small top-k before it. One pass takes the block maxima, the
// total and the smallest value. The j largest block maxima are j distinct values, each at most the
// row's value of the same rank, so once they weigh top_p of the total, the walk ends within the
// row's j largest values; when the largest kFewValues block maxima do not get there (a flat row,
// or the top values crowd into a few blocks, as related tokens' ids often do), the walk may still
// end within the largest kFewValues values. Those values are selected, sorted and walked unless
// even the most they can weigh falls short; if the walk falls short (a flat row), walk_buckets.
template <typename T>
float top_p_cutoff(const T* row, int64_t n, const Dist& d, float floor, double top_p, std::vector<float>& scratch) {
  Visited visited;
  block_maxima<true>(row, n, d, floor, scratch, visited);
  const double target = top_p * visited.total;
  const int64_t few = std::min<int64_t>(kFewValues, (int64_t)scratch.size());
  if (few > 0) {
    std::nth_element(scratch.begin(), scratch.begin() + (few - 1), scratch.end(), std::greater<float>());
    std::sort(scratch.begin(), scratch.begin() + few, std::greater<float>());  // ~2.5x faster than partial_sort
    int64_t m = 1;  // the walk ends within the m largest values if their block maxima weigh target
    for (double cumulative = 0.0; m < few; ++m) {
      cumulative += (double)walk_weight<Walk::Mass>(scratch[m - 1]);
      if (!(cumulative < target)) break;
    }
    if (m < few || few_values_can_reach(scratch, few, target)) {
      collect_largest(row, n, d, m, scratch[m - 1], scratch);
      const float cutoff = sort_and_walk<Walk::Mass>(scratch, target);
      if (cutoff == cutoff) return cutoff;
    }
  }
  return walk_buckets<Walk::Mass>(row, n, d, floor, top_p, scratch, visited.smallest);
}

// The cutoff of a walk (see Walk) over the kept values (finite s_j >= floor), -inf if the walk keeps
// every value; `goal` as in walk_buckets. `few_kept`: the walk ends within the largest kFewValues
// values (top-k with k <= kFewValues), or visits fewer than that (top-p after such a top-k, whose
// floor keeps k values unless more tie at it). Then those values are selected, sorted and walked;
// otherwise (or when too many tie at the floor) top-p takes top_p_cutoff, top-k walk_buckets.
template <Walk W, typename T>
float walk_cutoff(const T* row, int64_t n, const Dist& d, float floor, double goal, bool few_kept,
                  std::vector<float>& scratch) {
  float cutoff = std::numeric_limits<float>::quiet_NaN();
  if (few_kept) {
    const int64_t m = W == Walk::Count ? (int64_t)goal : kFewValues;
    largest_scaled(row, n, d, m, floor, scratch);
    const bool all_kept = (int64_t)scratch.size() < m;  // fewer qualified: these are all of them
    if (W == Walk::Count) {
      cutoff = sort_and_walk<W>(scratch, goal);  // NaN: fewer than k kept values, all of them kept
      return cutoff == cutoff ? cutoff : -kInf;
    }
    if (all_kept) {  // the same weights in the same order as the walk: it gets there
      double total = 0.0;
      for (const float s : scratch) total += (double)walk_weight<W>(s);
      cutoff = sort_and_walk<W>(scratch, goal * total);
    }
  }
  if (cutoff != cutoff)
    cutoff = W == Walk::Mass ? top_p_cutoff(row, n, d, floor, goal, scratch) : walk_buckets<W>(row, n, d, floor, goal, scratch);
  return cutoff == cutoff ? cutoff : -kInf;
}

// The filter cutoff in s-space (see SamplingFilter): top-k, then top-p on the renormalised top-k
// set, then min-p. Ties at a cutoff are kept. `scratch` holds candidate values.
template <typename T>
float filter_cutoff(const T* row, int64_t n, const Dist& d, const SamplingFilter& filter,
                    std::vector<float>& scratch) {
  float cut = -kInf;
  const bool top_k_cuts = filter.top_k > 0 && filter.top_k < n;
  if (top_k_cuts)
    cut = walk_cutoff<Walk::Count>(row, n, d, -kInf, (double)filter.top_k, filter.top_k <= kFewValues, scratch);
  if (filter.top_p < 1.0f) {  // on the renormalised top-k set: the walk visits s >= cut only
    const bool few_kept = top_k_cuts && filter.top_k < kFewValues;
    cut = std::max(cut, walk_cutoff<Walk::Mass>(row, n, d, cut, (double)filter.top_p, few_kept, scratch));
  }
  cut = std::max(cut, filter.min_p_cut());
  return cut;
}

// Fills `d` for sampling at temperature `tau` (0 = one-hot at the argmax) under `filter`; `exps`
// (optional, [n]) receives the exponentials, see sum_exp.
template <typename T>
Dist sampling_dist(const T* row, int64_t n, const RowScan& scan, float tau, const SamplingFilter& filter,
                   std::vector<float>& scratch, float* exps = nullptr) {
  if (tau == 0.0f) return one_hot_dist(scan.max, scan.argmax);
  Dist d = softmax_dist(scan.max, inverse_temperature(tau), -kInf, 1.0);
  if (filter.active()) d.cut = filter_cutoff(row, n, d, filter, scratch);
  d.sum = sum_exp(row, n, d, exps);
  d.log_sum = (float)std::log(d.sum);
  return d;
}

// sum_j divergence_term(p_j, q_j) for target row zt [vt] and draft row zd [vd], vd <= vt; ids >= vd
// have q = 0. Any p and q (cutoffs, one-hot); plain ones with stored exponentials take
// divergence_sum_stored instead.
template <Divergence D, typename T>
double divergence_sum(const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd, const Dist& q) {
  const FastLog log_fn;
  auto both = [=](int64_t j) FSD_INLINE_LAMBDA {
    const float lp = p.log_prob_float(load_logit(zt, j), j), lq = q.log_prob_float(load_logit(zd, j), j);
    return divergence_term<D>(exp_nonpositive(lp), lp, exp_nonpositive(lq), lq, log_fn);
  };
  auto target_only = [=](int64_t j) FSD_INLINE_LAMBDA {  // ids >= vd: q = 0
    const float lp = p.log_prob_float(load_logit(zt, j), j);
    return divergence_term<D>(exp_nonpositive(lp), lp, 0.0f, -kInf, log_fn);
  };
  const auto term = split_weight(vd, both, target_only);
  if (p.one_hot >= 0 && q.one_hot >= 0) {  // temperature 0: every other id has p = q = 0, term 0
    const double at_target = term(p.one_hot);
    return q.one_hot == p.one_hot ? at_target : at_target + term(q.one_hot);
  }
  return term.template sum<SumOf::Terms>(0, vt);
}

// p_j and log p_j of a plain distribution from the stored e_j = exp(s_j) and
// scale = exp(-log_sum). log p_j = s_j - log_sum is rounded to float, and p_j must be exp of that
// rounded value, not e_j * scale: the divergences are stationary under consistent perturbations of
// (p, log p) but not under inconsistent ones (JS would be off by up to ~4e-7 at V = 151936 instead
// of ~4e-8). So the subtraction's rounding error r (exact, Knuth's two-sum) corrects p_j by
// exp(-r) ~ 1 - r. TV uses no logs and skips the correction. An id of logit -inf (s_j = -inf) has
// p_j = 0 exactly: its two-sum would be inf - inf = NaN, and a NaN p_j makes a JS / MKL term 0
// (m = NaN fails m > 0) instead of the p ln 2 / 2 or +inf that the other side's mass gives it.
template <bool kUsesLog>
struct ProbFromStored {
  float log_sum, scale;
  FSD_ALWAYS_INLINE void operator()(float s, float e, float& p, float& lp) const {
    const float minus = -log_sum;
    lp = s + minus;
    if (!kUsesLog) {
      p = e * scale;
      return;
    }
    const float s_part = lp - minus, minus_part = lp - s_part;
    const float r = (s - s_part) + (minus - minus_part);  // (s - log_sum) - lp, exactly
    // scale used unconditionally: under the select GCC made its load a masked one and then
    // vectorised none of these loops (KL, RKL, JS and MKL ran scalar; JS 4x slower than KL).
    p = e * scale * (lp > -kInf ? 1.0f - r : 0.0f);
  }
};

// divergence_sum for plain p and q whose exponentials sum_exp stored in exps_t [vt] and
// exps_d [vd]: no exp is left in this pass (JS and MKL keep one log per id).
template <Divergence D, typename T>
double divergence_sum_stored(const T* zt, const float* exps_t, int64_t vt, const Dist& p, const T* zd,
                             const float* exps_d, int64_t vd, const Dist& q) {
  const FastLog log_fn;
  constexpr bool kUsesLog = D != Divergence::TV;
  const ProbFromStored<kUsesLog> target{p.log_sum, (float)std::exp(-(double)p.log_sum)};
  const ProbFromStored<kUsesLog> draft{q.log_sum, (float)std::exp(-(double)q.log_sum)};
  auto both = [=](int64_t j) FSD_INLINE_LAMBDA {
    float p_j, lp, q_j, lq;
    target(p.scaled(load_logit(zt, j)), exps_t[j], p_j, lp);
    draft(q.scaled(load_logit(zd, j)), exps_d[j], q_j, lq);
    return divergence_term<D>(p_j, lp, q_j, lq, log_fn);
  };
  auto target_only = [=](int64_t j) FSD_INLINE_LAMBDA {  // ids >= vd: q = 0
    float p_j, lp;
    target(p.scaled(load_logit(zt, j)), exps_t[j], p_j, lp);
    return divergence_term<D>(p_j, lp, 0.0f, -kInf, log_fn);
  };
  return split_weight(vd, both, target_only).template sum<SumOf::Terms>(0, vt);
}

// The k ids of div_top_k's buckets, ascending: the k most probable under p, lowest ids on ties.
// Their log p: s_j where kept, -inf elsewhere (one-hot: 0 at one_hot), so the k-th largest value
// is a top-k walk (walk_cutoff); every id above it is in, and the lowest ids at it fill the k.
template <typename T>
std::vector<int64_t> top_ids(const T* zt, int64_t vt, const Dist& p, int64_t k, std::vector<float>& scratch) {
  std::vector<int64_t> top, ties;
  if (p.one_hot >= 0) {
    top.push_back(p.one_hot);
    for (int64_t j = 0; (int64_t)top.size() < k; ++j)
      if (j != p.one_hot) top.push_back(j);
  } else {
    const float kth = walk_cutoff<Walk::Count>(zt, vt, p, p.cut, (double)k, k <= kFewValues, scratch);
    auto key = [p](float logit) FSD_INLINE_LAMBDA {
      const float s = p.scaled(logit);
      return s >= p.cut ? s : -kInf;
    };
    for_each_picked(
        vt, [&](int64_t j) FSD_INLINE_LAMBDA { return key(load_logit(zt, j)) >= kth; },
        [&](int64_t j) {
          if (key(load_logit(zt, j)) > kth) top.push_back(j);  // fewer than k of these
          else if ((int64_t)ties.size() < k) ties.push_back(j);
        });
    ties.resize(std::min<size_t>(ties.size(), (size_t)k - top.size()));
    top.insert(top.end(), ties.begin(), ties.end());
  }
  std::sort(top.begin(), top.end());
  return top;
}

// Calls f(from, to) for each gap of [0, n) between the ids of `top` (sorted): div_top_k's rest.
template <typename F>
void for_each_gap(const std::vector<int64_t>& top, int64_t n, F&& f) {
  int64_t begin = 0;
  for (const int64_t id : top) {
    f(begin, std::min(id, n));
    begin = id + 1;
  }
  f(begin, n);
}

// log of the rest bucket's mass: the ids of [0, n) outside `top` (sorted), for a rest whose float
// sum fell below kExactRestBelow (rules.h). The sum again, relative to the rest's own largest
// kept s_j (vectorised gap sums, as the first), so ids below float's range count and its log is
// right to float rounding; -inf where the rest keeps nothing.
template <typename T>
double exact_log_rest(const T* row, int64_t n, const Dist& d, const std::vector<int64_t>& top) {
  float s_top = -kInf;
  for_each_gap(top, n, [&](int64_t from, int64_t to) {
    for (int64_t j = from; j < to; ++j) {
      const float s = d.scaled(load_logit(row, j));
      s_top = s >= d.cut && s > s_top ? s : s_top;
    }
  });
  if (!(s_top > -kInf)) return -(double)kInf;
  const auto weight = kept_exp_below(row, d, s_top);
  double sum = 0.0;
  for_each_gap(top, n, [&](int64_t from, int64_t to) { sum += sum_range<SumOf::Weights>(from, to, weight); });
  const double log_rest = (double)s_top - std::log(d.sum) + std::log(sum);
  return log_rest > kLogZeroInDouble ? log_rest : -(double)kInf;  // 0 in float64 too
}

// div_top_k: the divergence over k+1 buckets, the k most probable ids under p (top_ids) and one
// bucket with the rest of the mass, for p and q alike; the rest is summed over the gaps between
// the k ids (vectorised). Any p and q (cutoffs, one-hot).
template <Divergence D, typename T>
double divergence_bucketed(const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd, const Dist& q,
                           int64_t k, std::vector<float>& scratch) {
  const std::vector<int64_t> top = top_ids(zt, vt, p, k, scratch);
  const PreciseLog log_fn;
  double total = 0.0;
  for (const int64_t j : top) {
    const double a = p.log_prob_precise(load_logit(zt, j), j);
    const double b = j < vd ? q.log_prob_precise(load_logit(zd, j), j) : -(double)kInf;
    total += divergence_term<D>(std::exp(a), a, std::exp(b), b, log_fn);
  }
  struct Mass {
    double value, log;
  };
  auto rest_of = [&top](const T* row, int64_t n, const Dist& d) -> Mass {
    if (d.one_hot >= 0) {
      const double rest = d.one_hot < n && !std::binary_search(top.begin(), top.end(), d.one_hot) ? 1.0 : 0.0;
      return {rest, std::log(rest)};
    }
    const auto weight = kept_exp(row, d);
    double rest = 0.0;
    for_each_gap(top, n, [&](int64_t from, int64_t to) { rest += sum_range<SumOf::Weights>(from, to, weight); });
    rest /= d.sum;
    if (rest >= kExactRestBelow) return {rest, std::log(rest)};
    const double log_rest = exact_log_rest(row, n, d, top);  // below float's range: its log matters
    return {std::exp(log_rest), log_rest};
  };
  const Mass rest_p = rest_of(zt, vt, p), rest_q = rest_of(zd, vd, q);
  return total + divergence_term<D>(rest_p.value, rest_p.log, rest_q.value, rest_q.log, log_fn);
}

// D(p || q). `exps_t` / `exps_d` (optional): the exponentials sum_exp stored while computing p.sum
// and q.sum, used when both distributions are plain.
template <typename T>
float divergence(Divergence kind, const T* zt, int64_t vt, const Dist& p, const T* zd, int64_t vd,
                 const Dist& q, int64_t bucket_top_k, std::vector<float>& scratch,
                 const float* exps_t = nullptr, const float* exps_d = nullptr) {
  const bool bucketed = bucket_top_k > 0 && bucket_top_k < vt;
  const bool general = !p.plain() || !q.plain();
  const bool stored = exps_t != nullptr && exps_d != nullptr;
  auto run = [&](auto tag) -> double {
    constexpr Divergence kKind = decltype(tag)::value;
    if (bucketed) return divergence_bucketed<kKind>(zt, vt, p, zd, vd, q, bucket_top_k, scratch);
    if (stored && !general) return divergence_sum_stored<kKind>(zt, exps_t, vt, p, zd, exps_d, vd, q);
    return divergence_sum<kKind>(zt, vt, p, zd, vd, q);
  };
  double sum = 0.0;
  switch (kind) {
    case Divergence::KL: sum = run(std::integral_constant<Divergence, Divergence::KL>{}); break;
    case Divergence::RKL: sum = run(std::integral_constant<Divergence, Divergence::RKL>{}); break;
    case Divergence::JS: sum = run(std::integral_constant<Divergence, Divergence::JS>{}); break;
    case Divergence::TV: sum = run(std::integral_constant<Divergence, Divergence::TV>{}); break;
    case Divergence::MKL: sum = run(std::integral_constant<Divergence, Divergence::MKL>{}); break;
  }
  return (float)finish_divergence(sum);
}

// Inverse-CDF sampling over non-negative weights (a SplitWeight) of ids [0, n) with total `total`:
// the first id whose cumulative weight exceeds u * total (the last positive-weight id if rounding
// runs past the end). Vectorised block sums first, then one block element by element. (Weights
// computed on the fly, kept_exp's: the block sums run in a SIMD clone whose FMA-contracted
// exponential differs from this baseline code's in the last bit for about 1% of arguments, a
// rounding-level difference inside the one block scanned; stored weights have none. Cloning this
// function too would risk the GCC 13.2-14.2 crash of Dist::log_prob_float's note.)
template <typename Weights>
int64_t inverse_cdf(int64_t n, const Weights& weight, double total, double u) {
  constexpr int64_t kBlock = 256;
  const double target = u * total;
  double cumulative = 0.0;
  int64_t last_positive_block = -1;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    const double block = weight.sum(start, end);
    if (!(block > 0.0)) continue;
    last_positive_block = start;
    if (cumulative + block * (1.0 + 1e-6) <= target) {  // clearly not in this block
      cumulative += block;
      continue;
    }
    for (int64_t j = start; j < end; ++j) {
      cumulative += (double)weight(j);
      if (cumulative > target) return j;
    }
  }
  if (last_positive_block < 0) return 0;
  for (int64_t j = std::min(n, last_positive_block + kBlock) - 1; j > last_positive_block; --j)
    if (weight(j) > 0.0f) return j;
  return last_positive_block;
}

}  // namespace cpu
}  // namespace fsd
