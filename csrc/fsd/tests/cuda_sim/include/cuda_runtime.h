// CPU simulation of the CUDA runtime and device builtins that fsd-ext's kernels use, so that the
// kernels themselves (csrc/fsd/cuda/*.cu, unchanged) compile with g++ and run on a machine without a
// GPU (csrc/fsd/tests/cuda_sim/test_cuda_sim.cpp checks them against the CPU kernel).
//
// What it models: a launch runs its blocks one after another, in an order sim::order picks; a
// block's threads are fibers (ucontext) on the calling thread that switch only at __syncthreads and
// the warp primitives, so a block's barriers, shared memory (`__shared__` becomes a static: one copy,
// reused block after block), warp shuffles / ballots and atomics behave as the CUDA programming
// model says, and the order the threads run between two barriers is a choice too: a missing barrier
// shows up as a wrong result under some order. Blocks that talk through global memory (atomic row
// counters, the last block finishes the row) work because each block runs to its end before the
// next starts.
//
// What it does not model: timing, occupancy, the memory model's weak orderings, thread-block
// clusters (the cluster kernels compile to nothing here: their body needs __CUDA_ARCH__ >= 900, and
// cudaOccupancyMaxActiveClusters answers 0, so the planner never picks them), or the SFU's
// approximations (streaming.cuh's host fallbacks use libm).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef FSD_CUDA_SIM
#define FSD_CUDA_SIM 1
#endif

// ---------------------------------------------------------------------------------------------
// Qualifiers.
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static

// ---------------------------------------------------------------------------------------------
// Vector types and the launch geometry.
struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

// ---------------------------------------------------------------------------------------------
// Runtime API (the subset the launchers call).
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNotSupported = 801,
};
using cudaStream_t = struct SimStream*;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrComputeCapabilityMajor = 75 };
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributeNonPortableClusterSizeAllowed = 11,
};
struct cudaFuncAttributes { int ptxVersion = 0, binaryVersion = 0; };
enum cudaLaunchAttributeID {
  cudaLaunchAttributeClusterDimension = 4,
  cudaLaunchAttributeProgrammaticStreamSerialization = 6,
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  union {
    struct { unsigned x, y, z; } clusterDim;
    int programmaticStreamSerializationAllowed;
  } val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};

namespace sim {

// The device the simulation pretends to be: the SM count steers the accept planner (many SMs and a
// small batch: the split-vocabulary path; few: whole rows). FSD_SIM_SMS overrides it.
inline int multiprocessors() {
  const char* env = std::getenv("FSD_SIM_SMS");
  const int n = env ? std::atoi(env) : 0;
  return n > 0 ? n : 132;
}

// The order in which a launch runs its blocks, and a block its threads between two
// synchronisation points.
enum class Order { Forward, Reverse, Shuffled };
inline Order order = Order::Forward;
inline uint64_t shuffle_seed = 1;

// ---------------------------------------------------------------------------------------------
// Fibers: one per thread of the running block.
constexpr size_t kStackBytes = 256 * 1024;

struct Warp {
  uint64_t slots[2][32];  // values of a shuffle / ballot, double-buffered by generation parity
  int arrived = 0;
  uint64_t generation = 0;
};

struct Block {
  std::vector<ucontext_t> contexts;
  std::vector<std::vector<char>> stacks;
  std::vector<char> done;
  std::vector<Warp> warps;
  ucontext_t scheduler;
  int threads = 0, alive = 0, current = 0;
  int arrived = 0;                  // at the block barrier
  uint64_t generation = 0;          // block barrier releases so far
  int and_all = 1, and_result = 1;  // __syncthreads_and
  uint64_t progress = 0;            // releases + exits (deadlock detection)
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
};
inline Block block;

inline void set_thread(int t) {
  block.current = t;
  threadIdx.x = (unsigned)t % blockDim.x;
  threadIdx.y = (unsigned)t / blockDim.x % blockDim.y;
  threadIdx.z = (unsigned)t / (blockDim.x * blockDim.y);
}

// Back to the scheduler until it resumes this fiber.
inline void yield() { swapcontext(&block.contexts[block.current], &block.scheduler); }

inline void release_barrier() {
  block.and_result = block.and_all;
  block.and_all = 1;
  block.arrived = 0;
  ++block.generation;
  ++block.progress;
}

inline void fiber_entry() {
  block.body(block.body_arg);
  block.done[block.current] = 1;
  --block.alive;
  ++block.progress;
  // Exited threads no longer count at the barrier (as on the GPU).
  if (block.arrived > 0 && block.arrived == block.alive) release_barrier();
  setcontext(&block.scheduler);
}

// Block barrier: every live thread of the block arrives before any leaves.
inline int barrier(int predicate) {
  block.and_all &= predicate != 0;
  const uint64_t generation = block.generation;
  if (++block.arrived == block.alive) release_barrier();
  while (block.generation == generation) yield();
  return block.and_result;
}

// Warp exchange: each calling lane of `mask` publishes `value`; returns once every lane of the mask
// has, with the published values of this round.
inline const uint64_t* warp_exchange(unsigned mask, uint64_t value) {
  const int lane = block.current % 32;
  Warp& w = block.warps[block.current / 32];
  if (!(mask & (1u << lane))) {
    std::fprintf(stderr, "cuda_sim: lane %d calls a warp primitive outside its mask %08x\n", lane, mask);
    std::abort();
  }
  const uint64_t generation = w.generation;
  uint64_t* slots = w.slots[generation & 1];
  slots[lane] = value;
  if (++w.arrived == __builtin_popcount(mask)) {
    w.arrived = 0;
    ++w.generation;
    ++block.progress;
  }
  while (w.generation == generation) yield();
  return slots;
}

// Runs `body(arg)` as every thread of one block.
inline void run_block(void (*body)(void*), void* arg, int threads) {
  block.threads = block.alive = threads;
  block.arrived = 0;
  block.and_all = block.and_result = 1;
  block.body = body;
  block.body_arg = arg;
  block.contexts.resize(threads);
  block.stacks.resize(threads);
  block.done.assign(threads, 0);
  block.warps.assign((threads + 31) / 32, Warp{});
  for (int t = 0; t < threads; ++t) {
    block.stacks[t].resize(kStackBytes);
    getcontext(&block.contexts[t]);
    block.contexts[t].uc_stack.ss_sp = block.stacks[t].data();
    block.contexts[t].uc_stack.ss_size = kStackBytes;
    block.contexts[t].uc_link = nullptr;
    makecontext(&block.contexts[t], fiber_entry, 0);
  }
  std::vector<int> sweep(threads);
  for (int t = 0; t < threads; ++t) sweep[t] = order == Order::Reverse ? threads - 1 - t : t;
  std::mt19937_64 rng(shuffle_seed++);
  while (block.alive > 0) {
    if (order == Order::Shuffled) std::shuffle(sweep.begin(), sweep.end(), rng);
    const uint64_t before = block.progress;
    for (const int t : sweep) {
      if (block.done[t]) continue;
      set_thread(t);
      swapcontext(&block.scheduler, &block.contexts[t]);
    }
    if (block.progress == before) {
      std::fprintf(stderr, "cuda_sim: deadlock in block (%u, %u): %d threads wait at barriers that never fill\n",
                   blockIdx.x, blockIdx.y, block.alive);
      std::abort();
    }
  }
}

// A launch: the blocks of `grid` one after another, in order.
template <typename... Params, typename... Args>
cudaError_t launch(const cudaLaunchConfig_t& config, void (*kernel)(Params...), Args&&... args) {
  for (unsigned a = 0; a < config.numAttrs; ++a)
    if (config.attrs[a].id == cudaLaunchAttributeClusterDimension) return cudaErrorNotSupported;
  const unsigned threads = config.blockDim.x * config.blockDim.y * config.blockDim.z;
  if (threads == 0 || threads > 1024 || config.gridDim.x == 0 || config.gridDim.y == 0 || config.gridDim.z == 0)
    return cudaErrorInvalidConfiguration;
  // The parameters as the kernel takes them (by value, converted once, as a launch copies them).
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...>* params;
  } call{kernel, &params};
  auto body = [](void* p) {
    Call* c = static_cast<Call*>(p);
    std::apply(c->kernel, *c->params);
  };
  gridDim = config.gridDim;
  blockDim = config.blockDim;
  // The blocks in the order `order` says: a grid's blocks may run in any order on a GPU, so which
  // block of a row comes last (and finishes it) varies too.
  std::vector<uint3> blocks;
  for (unsigned z = 0; z < gridDim.z; ++z)
    for (unsigned y = 0; y < gridDim.y; ++y)
      for (unsigned x = 0; x < gridDim.x; ++x) blocks.push_back(uint3{x, y, z});
  if (order == Order::Reverse) std::reverse(blocks.begin(), blocks.end());
  if (order == Order::Shuffled) std::shuffle(blocks.begin(), blocks.end(), std::mt19937_64(shuffle_seed++));
  for (const uint3& block_index : blocks) {
    blockIdx = block_index;
    run_block(body, &call, (int)threads);
  }
  return cudaSuccess;
}

}  // namespace sim

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* device) { *device = 0; return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  // sm_90: the planner may then take programmatic dependent launch (a plain launch here).
  *value = attribute == cudaDevAttrMultiProcessorCount ? sim::multiprocessors() : 9;
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, F) {
  attributes->ptxVersion = attributes->binaryVersion = 90;
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
template <typename F>
cudaError_t cudaOccupancyMaxActiveClusters(int* clusters, F, const cudaLaunchConfig_t*) {
  *clusters = 0;  // no thread-block clusters in the simulation
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args&&... args) {
  return sim::launch(*config, kernel, std::forward<Args>(args)...);
}

// ---------------------------------------------------------------------------------------------
// Device builtins.
inline void __syncthreads() { sim::barrier(1); }
inline int __syncthreads_and(int predicate) { return sim::barrier(predicate); }
inline void __threadfence() {}
[[noreturn]] inline void __trap() { std::abort(); }

template <typename T>
T sim_shuffle(unsigned mask, T value, int source_lane) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a word");
  uint64_t word = 0;
  std::memcpy(&word, &value, sizeof(T));
  const uint64_t* slots = sim::warp_exchange(mask, word);
  T out;
  std::memcpy(&out, &slots[source_lane & 31], sizeof(T));
  return out;
}
template <typename T>
T __shfl_sync(unsigned mask, T value, int lane) { return sim_shuffle(mask, value, lane); }
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  return sim_shuffle(mask, value, (int)(threadIdx.x % 32) ^ lane_mask);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta) {
  const int lane = (int)(threadIdx.x % 32);
  const T other = sim_shuffle(mask, value, lane >= (int)delta ? lane - (int)delta : lane);
  return lane >= (int)delta ? other : value;
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const uint64_t* slots = sim::warp_exchange(mask, predicate != 0);
  unsigned out = 0;
  for (int lane = 0; lane < 32; ++lane)
    if ((mask >> lane & 1u) && slots[lane]) out |= 1u << lane;
  return out;
}

template <typename T>
T __ldg(const T* p) { return *p; }
template <typename T>
T __ldcg(const T* p) { return *p; }

// Atomics: the fibers of a block never run at once and blocks run one after another.
template <typename T>
T atomicAdd(T* p, T value) {
  const T old = *p;
  *p = old + value;
  return old;
}

inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline float __log2f(float x) { return std::log2(x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

// CUDA's global min / max overloads (device code calls them unqualified on mixed integer types).
template <typename A, typename B>
constexpr std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <typename A, typename B>
constexpr std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
