// Phase trace of the accept kernels, for finding where a verification step's time goes on a GPU
// (benchmarks/accept_trace.cu). Off unless the kernels are compiled with -DFSD_CUDA_TRACE: then
// AcceptProblem carries a `trace` pointer and, at each FSD_TRACE(pb, tag) point, thread 0 of the
// block appends {global time, SM clock, block, SM, tag} to a device buffer. Without the macro
// every point compiles to nothing, so the extension's kernels are untouched (the CPU simulation
// of the kernels counts the points instead).
//
// A point marks the end of a phase that ends with a block barrier (or the start of a kernel), so
// thread 0's clock stands for the block's.
#pragma once

#include <cstdint>

namespace fsd {
namespace cuda {

// The points, in the order a block passes them (the numbers are the trace file's; never renumber).
enum TraceTag : uint32_t {
  kTraceStatsBegin = 0,   // statistics kernel (or fused / cluster kernel) entered
  kTraceStatsTarget = 1,  // the target chunk's statistics reduced
  kTraceStatsEnd = 2,     // the draft chunk's statistics reduced (and, with filters, the cutoffs)
  kTraceDecideBegin = 3,  // decision phase entered (split path: the second kernel)
  kTraceDists = 4,        // the position's distributions built from its chunk records
  kTracePassTwo = 5,      // pass 2 reduced (blocks that run it)
  kTraceCounted = 6,      // the block counted itself done (the last one goes on to the finish)
  kTraceFinishValid = 7,  // finish: validity
  kTraceFinishDiv = 8,    // finish: divergences summed over chunks
  kTraceFinishScan = 9,   // finish: acceptance scan
  kTraceFinishChunk = 10, // finish: the chunk holding the sample
  kTraceFinishEnd = 11,   // finish: the row's tokens written
  kTraceTags = 12
};

struct TraceRecord {
  uint64_t ns;      // %globaltimer (nanoseconds; its resolution depends on the device)
  uint64_t cycles;  // clock64() of the block's SM
  uint32_t block, tag, sm, pad;
};

// Device memory: `records` holds `capacity` entries; `count` (zeroed by the host before a call)
// counts every point reached, also those past the capacity.
struct TraceSink {
  TraceRecord* records;
  uint32_t* count;
  uint32_t capacity;
};

#if defined(FSD_CUDA_TRACE) && defined(__CUDACC__)
__device__ __forceinline__ void trace_point(const void* sink_ptr, uint32_t tag) {
  if (sink_ptr == nullptr || threadIdx.x != 0) return;
  const TraceSink* sink = static_cast<const TraceSink*>(sink_ptr);
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  const uint64_t cycles = (uint64_t)clock64();
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const uint32_t at = atomicAdd(sink->count, 1u);
  if (at < sink->capacity) sink->records[at] = TraceRecord{ns, cycles, blockIdx.x, tag, sm, 0u};
}
#define FSD_TRACE(pb, tag) ::fsd::cuda::trace_point((pb).trace, (tag))
#elif defined(FSD_CUDA_SIM)
// The CPU simulation of the kernels (csrc/fsd/tests/cuda_sim) counts the points blocks reach.
#define FSD_TRACE(pb, tag) ::sim::trace_point(tag)
#else
#define FSD_TRACE(pb, tag) ((void)0)
#endif

}  // namespace cuda
}  // namespace fsd
