// One pass over a vocabulary row of logits: its maximum, lowest argmax and whether it is bad (NaN,
// or no finite logit). The first pass of every CPU kernel over a row.
#pragma once

#include <cfloat>
#include <cstdint>

#include "fsd/cpu/vec.h"

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

}  // namespace cpu
}  // namespace fsd
