// quant_gemm's AMX path (internal to quant_gemm.cpp and its tests): the products of up to 16 rows of
// x with a repacked quantised W on the CPU's tile unit (Intel AMX-BF16), where the vector paths
// are bound by multiply-adds rather than by reading W. See quant_amx.cpp for how it stays exact.
// Also quant_prompt_gemm's: any number of rows, W and x rounded to bfloat16.
#pragma once

#include "fsd/cpu/quant_gemm.h"

namespace fsd {
namespace cpu {

// Whether this CPU and OS run AMX-BF16 tiles in this process (AMX-TILE, AMX-BF16, AVX512-BF16/BW/VL
// and, on Linux, the kernel's permission for the tile state, asked for once).
bool quant_amx_hardware();

// The product by AMX tiles. Expects quant_amx_hardware() and 1 <= g.rows <= kQuantMaxRows.
void quant_gemm_amx(const QuantGemm& g, const ParallelFor& parallel_for);

// quant_prompt_gemm by AMX tiles. Expects quant_amx_hardware() and g.rows >= 1.
void quant_prompt_gemm_amx(const QuantGemm& g, const ParallelFor& parallel_for);

}  // namespace cpu
}  // namespace fsd
