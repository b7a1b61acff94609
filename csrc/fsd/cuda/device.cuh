// Device building blocks of the CUDA kernels (framework-free: CUDA runtime, CUB and fsd headers),
// one piece per file:
//   - loads.cuh: the block size, logit loads (16-byte vectors, scalar head and tail);
//   - block_stats.cuh: block-wide online-softmax statistics of a range; a Dist's probabilities;
//   - radix_select.cuh: block-wide radix select (top-k / top-p / min-p cutoffs, div_top_k);
//   - block_scan.cuh: block scans, inverse-CDF sampling over a range;
//   - pass_two.cuh: pass 2 (divergence terms, residual mass);
//   - split_merge.cuh: the split paths' merge of chunk records.
#pragma once

#include "fsd/cuda/loads.cuh"
#include "fsd/cuda/block_stats.cuh"
#include "fsd/cuda/radix_select.cuh"
#include "fsd/cuda/block_scan.cuh"
#include "fsd/cuda/pass_two.cuh"
#include "fsd/cuda/split_merge.cuh"
