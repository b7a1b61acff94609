// One-vocabulary-row primitives of the CPU kernels: statistics, filter cutoffs, divergence sums and
// inverse-CDF sampling, each a single pass (or less) over the logits with no probability array
// materialised. Scratch: candidate values of the filter cutoffs and of div_top_k's k-th value (the
// block maxima, the largest few values or one bucket of them, never a copy of the row), and the
// exp(s_j) a sum pass stores for the divergence pass that follows it. One piece per file, each
// needing only the ones above it.
#pragma once

#include "fsd/cpu/row_scan.h"
#include "fsd/cpu/row_sums.h"
#include "fsd/cpu/filter_cutoffs.h"
#include "fsd/cpu/divergences.h"
#include "fsd/cpu/inverse_cdf.h"
