// CPU kernels of fsd-ext (framework-free). Each walks the rows of a problem in parallel through the
// caller's ParallelFor (the torch binding passes at::parallel_for; tests pass a serial loop).
#pragma once

#include <cstdint>
#include <functional>

#include "fsd/common.h"

namespace fsd {
namespace cpu {

using RangeFn = std::function<void(int64_t begin, int64_t end)>;
using ParallelFor = std::function<void(int64_t count, int64_t grain, const RangeFn& body)>;

// Runs body(0, count) on the calling thread.
void serial_for(int64_t count, int64_t grain, const RangeFn& body);

// fsd_ext.accept. Expects draft tokens already checked to lie in [0, V_d) for positions < num_draft
// and num_draft in [0, K] (the binding checks; out-of-range values are treated as an invalid row).
void accept(const AcceptProblem& problem, const ParallelFor& parallel_for = serial_for);

// fsd_ext.divergence.
void divergence(const DivergenceProblem& problem, const ParallelFor& parallel_for = serial_for);

// fsd_ext.sample.
void sample(const SampleProblem& problem, const ParallelFor& parallel_for = serial_for);

// fsd_ext.philox_uniforms: out [rows, positions] float64.
void philox_uniforms(const RandomKey& key, int64_t rows, int64_t positions, Purpose purpose, double* out);

}  // namespace cpu
}  // namespace fsd
