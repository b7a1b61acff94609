// Inverse-CDF sampling over a row's non-negative weights (block sums first, then one block id by id).
#pragma once

#include <cstdint>

#include "fsd/cpu/row_sums.h"
#include "fsd/cpu/vec.h"

namespace fsd {
namespace cpu {

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
