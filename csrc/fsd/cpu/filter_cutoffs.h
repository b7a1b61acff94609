// The top-k / top-p / min-p cutoffs of a row in s-space (walks over its largest values, with no
// sort and no copy of the row) and the sampling distribution they cut (sampling_dist).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "fsd/common.h"
#include "fsd/cpu/row_scan.h"
#include "fsd/cpu/row_sums.h"
#include "fsd/cpu/vec.h"

namespace fsd {
namespace cpu {

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

}  // namespace cpu
}  // namespace fsd
