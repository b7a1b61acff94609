// CPU simulation of the CUDA runtime and device builtins that fsd-ext's kernels use, so that the
// kernels themselves (csrc/fsd/cuda/*.cu, unchanged) compile with g++ and run on a machine without a
// GPU (csrc/fsd/tests/cuda_sim/test_cuda_sim.cpp checks them against the CPU kernel).
//
// What it models: a launch runs its blocks one after another, in an order sim::order picks; a
// block's threads are fibers (see Context below) on one OS thread that switch only at __syncthreads and the
// warp primitives, so a block's barriers, shared memory (`__shared__` becomes `thread_local`: one
// copy per OS thread, reused block after block), warp shuffles / ballots and atomics behave as the
// CUDA programming model says, and the order the threads run between two barriers is a choice too:
// a missing barrier shows up as a wrong result under some order. Blocks that talk through global
// memory (atomic row counters, the last block finishes the row) see every earlier block's writes.
// Thread-block clusters: the blocks of one cluster run at once, each on an OS thread of its own (so
// each has its own shared memory), and this_cluster().sync() waits for all of them; clusters run
// one after another. Atomics are real atomics and __threadfence a fence, as those blocks race.
// Devices: cudaSetDevice picks one of sim::kDevices (SM counts 132, 16, 1, all compute capability
// 9.0), which steers the accept planner (many SMs and a small batch: the split path; few: whole
// rows); the launchers cache attributes per device, as on a machine with several GPUs.
//
// What it does not model: timing, occupancy, the memory model's weak orderings (every access is
// sequentially consistent here), distributed shared memory, or the SFU's approximations
// (streaming.cuh's host fallbacks use libm).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
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
// Per OS thread, so that the blocks of a cluster, which run at once on threads of their own, each
// have their own (an `extern __shared__` array must be defined thread_local by the program).
#define __shared__ thread_local

// ---------------------------------------------------------------------------------------------
// Vector types and the launch geometry.
struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

// ---------------------------------------------------------------------------------------------
// Runtime API (the subset the launchers call).
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotSupported = 801,
  cudaErrorClusterOutOfResources = 907,
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

// The simulated devices (cudaSetDevice picks one): their SM counts steer the accept planner.
constexpr int kDevices[] = {132, 16, 1};
constexpr int kDeviceCount = 3;
inline int current_device = 0;

// Limits of the simulated devices (an H100 / H200's).
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // without cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr size_t kMaxDynamicShared = 227 * 1024;
constexpr unsigned kPortableCluster = 8, kMaxCluster = 16;

// The order in which a launch runs its blocks (clusters), and a block its threads between two
// synchronisation points.
enum class Order { Forward, Reverse, Shuffled };
inline Order order = Order::Forward;
inline uint64_t shuffle_seed = 1;

// What the launches so far were (tests check that a call took the path they meant).
struct LaunchCounts {
  int64_t launches = 0, cluster_launches = 0, dependent_launches = 0;
};
inline LaunchCounts counts;
inline LaunchCounts operator-(const LaunchCounts& a, const LaunchCounts& b) {
  return {a.launches - b.launches, a.cluster_launches - b.cluster_launches,
          a.dependent_launches - b.dependent_launches};
}

// How many blocks reached each FSD_TRACE point (csrc/fsd/cuda/trace.cuh, by tag; thread 0 counts
// for its block), so a test can check which phases a call ran, e.g. how many blocks ran pass 2.
constexpr int kTracePoints = 32;
inline std::atomic<int64_t> trace_points[kTracePoints];
inline void trace_point(uint32_t tag) {
  if (threadIdx.x == 0 && tag < (uint32_t)kTracePoints) trace_points[tag].fetch_add(1, std::memory_order_relaxed);
}

// Bytes the kernels read from the buffers a test watches (the logits), through loads.cuh's load
// helpers (FSD_SIM_READ), in all and per launch (reads_per_launch: one entry per launch since the
// last watch_reads), so a test can see how many times a launch path reads the logits. The ranges
// are set between launches and only read during them; the counters are atomics (a cluster's
// blocks run on threads of their own).
inline std::vector<std::pair<const char*, const char*>> watched_ranges;
inline std::atomic<int64_t> watched_bytes_read{0};
inline std::vector<int64_t> reads_per_launch;
inline void watch_reads(std::vector<std::pair<const void*, size_t>> ranges) {
  watched_ranges.clear();
  for (const auto& [begin, bytes] : ranges)
    watched_ranges.emplace_back(static_cast<const char*>(begin), static_cast<const char*>(begin) + bytes);
  watched_bytes_read = 0;
  reads_per_launch.clear();
}
inline void global_read(const void* p, size_t bytes) {
  const char* at = static_cast<const char*>(p);
  for (const auto& [begin, end] : watched_ranges)
    if (at >= begin && at < end) watched_bytes_read.fetch_add((int64_t)bytes, std::memory_order_relaxed);
}

// Per kernel: the dynamic shared memory it may use and whether it may form non-portable clusters
// (cudaFuncSetAttribute), as a launch checks them.
struct KernelAttributes {
  size_t max_dynamic_shared = kDefaultDynamicShared;
  bool non_portable_clusters = false;
};
inline std::mutex attributes_mutex;
inline std::map<const void*, KernelAttributes> kernel_attributes;
inline KernelAttributes attributes_of(const void* kernel) {
  std::lock_guard<std::mutex> lock(attributes_mutex);
  const auto it = kernel_attributes.find(kernel);
  return it == kernel_attributes.end() ? KernelAttributes{} : it->second;
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_sim: %s\n", what);
  std::abort();
}

// ---------------------------------------------------------------------------------------------
// A cluster's barrier (this_cluster().sync()) across the OS threads of its blocks. A block that
// has ended no longer counts, as its exited threads no longer count at a block barrier.
struct Cluster {
  std::mutex mutex;
  std::condition_variable released;
  int live = 0, arrived = 0;
  uint64_t generation = 0;
};
inline thread_local Cluster* cluster = nullptr;  // the running block's (null: not a cluster launch)

inline void release_cluster(Cluster& c) {
  c.arrived = 0;
  ++c.generation;
  c.released.notify_all();
}

// Called once per barrier by the block whose threads have all arrived.
inline void cluster_arrive_and_wait() {
  Cluster& c = *cluster;
  std::unique_lock<std::mutex> lock(c.mutex);
  const uint64_t generation = c.generation;
  if (++c.arrived == c.live) return release_cluster(c);
  // A block of the cluster that never arrives is stuck at a block barrier (run_block reports that)
  // or runs forever: the time limit is a safety net only.
  if (!c.released.wait_for(lock, std::chrono::minutes(10), [&] { return c.generation != generation; }))
    fail("deadlock: a cluster barrier never filled");
}

inline void cluster_block_exit(Cluster& c) {
  std::lock_guard<std::mutex> lock(c.mutex);
  --c.live;
  if (c.arrived > 0 && c.arrived == c.live) release_cluster(c);
}

// ---------------------------------------------------------------------------------------------
// Fibers: one per thread of the running block, each with a stack of its own.
constexpr size_t kStackBytes = 256 * 1024;

// Switching between fibers. On x86-64 a few instructions: save the callee-saved registers and the
// floating-point control words on the running stack, switch stack pointers, restore them from the
// other (swapcontext's signal-mask system call on every switch took three quarters of the
// simulation's time). Under AddressSanitizer every switch is announced to it (its fiber
// interface), so that it knows which stack runs. Elsewhere: ucontext.
#if defined(__SANITIZE_ADDRESS__)
#define FSD_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FSD_SIM_ASAN 1
#endif
#endif
#ifdef FSD_SIM_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && defined(__linux__)
// fsd_sim_switch(save, load): suspends the caller (its stack pointer into *save) and resumes the
// context whose stack pointer is `load`. Weak: every translation unit that includes this emits it.
extern "C" void fsd_sim_switch(void** save, void* load);
asm(R"(
  .text
  .weak fsd_sim_switch
  .type fsd_sim_switch, @function
fsd_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fsd_sim_switch, .-fsd_sim_switch
)");

struct Context {
  void* sp = nullptr;
  const void* stack = nullptr;  // its stack (AddressSanitizer's bookkeeping; the OS thread's: learnt
  size_t stack_bytes = 0;       // when the first fiber starts)
  void* fake_stack = nullptr;   // AddressSanitizer's, while suspended
};

// Under AddressSanitizer: what follows every switch into a context (`resumed`; null: a fiber that
// starts), which also learns the stack of the context it came from (`previous`).
inline void finish_switch(Context* resumed, Context& previous) {
#ifdef FSD_SIM_ASAN
  __sanitizer_finish_switch_fiber(resumed ? resumed->fake_stack : nullptr, &previous.stack, &previous.stack_bytes);
#else
  (void)resumed, (void)previous;
#endif
}

// From the running context to `to`; `exiting`: the running fiber never resumes.
inline void switch_context(Context& from, Context& to, bool exiting = false) {
#ifdef FSD_SIM_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &from.fake_stack, to.stack, to.stack_bytes);
#else
  (void)exiting;
#endif
  fsd_sim_switch(&from.sp, to.sp);
  finish_switch(&from, to);  // (fibers switch to the scheduler only, so `to` is who switched back)
}

// A context that starts `entry` (which never returns) on the stack [stack, stack + bytes): the frame
// fsd_sim_switch pops, as if `entry` had been called (stack pointer 8 past a 16-byte boundary).
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  void** top = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15});
  top[-1] = nullptr;                           // entry's return address: none
  top[-2] = reinterpret_cast<void*>(entry);    // where fsd_sim_switch returns to
  for (int r = 3; r <= 8; ++r) top[-r] = nullptr;  // rbp, rbx, r12 - r15
  uint32_t control[2] = {0, 0};                // the caller's MXCSR and x87 control word
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  std::memcpy(&top[-9], control, sizeof(control));
  c.sp = &top[-9];
  c.stack = stack;
  c.stack_bytes = bytes;
  c.fake_stack = nullptr;
}
#else
struct Context {
  ucontext_t uc;
};
inline void finish_switch(Context*, Context&) {}
inline void switch_context(Context& from, Context& to, bool = false) { swapcontext(&from.uc, &to.uc); }
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Warp {
  uint64_t slots[2][32];  // values of a shuffle / ballot, double-buffered by generation parity
  int arrived = 0;
  uint64_t generation = 0;
};

enum class Barrier { Block, Cluster };

struct Block {
  std::vector<Context> contexts;
  std::vector<std::unique_ptr<char[]>> stacks;  // uninitialised: pages a fiber never uses stay untouched
  std::vector<char> done;
  std::vector<Warp> warps;
  Context scheduler;
  int threads = 0, alive = 0, current = 0;
  int arrived = 0;                  // at the barrier below
  Barrier waiting_at = Barrier::Block;
  uint64_t generation = 0;          // barrier releases so far
  int and_all = 1, and_result = 1;  // __syncthreads_and
  uint64_t progress = 0;            // releases + exits (deadlock detection)
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  ~Block();
};

// Fiber stacks of blocks that have ended with their OS thread, for the next threads to reuse (their
// pages are already mapped).
inline std::mutex spare_stacks_mutex;
inline std::vector<std::unique_ptr<char[]>> spare_stacks;
inline Block::~Block() {
  std::lock_guard<std::mutex> lock(spare_stacks_mutex);
  for (auto& stack : stacks) spare_stacks.push_back(std::move(stack));
}
inline std::unique_ptr<char[]> new_stack() {
  {
    std::lock_guard<std::mutex> lock(spare_stacks_mutex);
    if (!spare_stacks.empty()) {
      std::unique_ptr<char[]> stack = std::move(spare_stacks.back());
      spare_stacks.pop_back();
      return stack;
    }
  }
  return std::unique_ptr<char[]>(new char[kStackBytes]);
}

// The block the calling OS thread runs (a pointer: a thread-local that needs no initialisation
// check on every access, unlike a Block itself).
inline thread_local Block* running = nullptr;

inline void set_thread(int t) {
  running->current = t;
  threadIdx.x = (unsigned)t % blockDim.x;
  threadIdx.y = (unsigned)t / blockDim.x % blockDim.y;
  threadIdx.z = (unsigned)t / (blockDim.x * blockDim.y);
}

// Back to the scheduler until it resumes this fiber.
inline void yield() { switch_context(running->contexts[running->current], running->scheduler); }

// Every live thread of the block has arrived: a cluster barrier waits for the other blocks too.
inline void release_barrier() {
  if (running->waiting_at == Barrier::Cluster && cluster != nullptr) cluster_arrive_and_wait();
  running->and_result = running->and_all;
  running->and_all = 1;
  running->arrived = 0;
  ++running->generation;
  ++running->progress;
}

inline void fiber_entry() {
  finish_switch(nullptr, running->scheduler);
  running->body(running->body_arg);
  running->done[running->current] = 1;
  --running->alive;
  ++running->progress;
  // Exited threads no longer count at the barrier (as on the GPU).
  if (running->arrived > 0 && running->arrived == running->alive) release_barrier();
  switch_context(running->contexts[running->current], running->scheduler, true);  // never resumed
}

// Block (or cluster) barrier: every live thread of the block (cluster) arrives before any leaves.
inline int barrier(int predicate, Barrier kind = Barrier::Block) {
  if (running->arrived > 0 && running->waiting_at != kind)
    fail("threads of one block wait at a block barrier and at a cluster barrier at once");
  running->waiting_at = kind;
  running->and_all &= predicate != 0;
  const uint64_t generation = running->generation;
  if (++running->arrived == running->alive) release_barrier();
  while (running->generation == generation) yield();
  return running->and_result;
}

// Warp exchange: each calling lane of `mask` publishes `value`; returns once every lane of the mask
// has, with the published values of this round.
inline const uint64_t* warp_exchange(unsigned mask, uint64_t value) {
  const int lane = running->current % 32;
  Warp& w = running->warps[running->current / 32];
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
    ++running->progress;
  }
  while (w.generation == generation) yield();
  return slots;
}

// Runs `body(arg)` as every thread of the block blockIdx names, on the calling OS thread; the
// threads' order between barriers from sim::order (shuffled with `seed`).
inline void run_block(void (*body)(void*), void* arg, int threads, uint64_t seed) {
  static thread_local Block storage;  // this OS thread's, reused block after block
  running = &storage;
  Block& b = storage;
  b.threads = b.alive = threads;
  b.arrived = 0;
  b.and_all = b.and_result = 1;
  b.body = body;
  b.body_arg = arg;
  b.contexts.resize(threads);
  b.done.assign(threads, 0);
  b.warps.assign((threads + 31) / 32, Warp{});
  while ((int)b.stacks.size() < threads) b.stacks.push_back(new_stack());
  for (int t = 0; t < threads; ++t) make_context(b.contexts[t], b.stacks[t].get(), kStackBytes, fiber_entry);
  std::vector<int> sweep(threads);
  for (int t = 0; t < threads; ++t) sweep[t] = order == Order::Reverse ? threads - 1 - t : t;
  std::mt19937_64 rng(seed);
  while (b.alive > 0) {
    if (order == Order::Shuffled) std::shuffle(sweep.begin(), sweep.end(), rng);
    const uint64_t before = b.progress;
    for (const int t : sweep) {
      if (b.done[t]) continue;
      set_thread(t);
      switch_context(b.scheduler, b.contexts[t]);
    }
    if (b.progress == before) {
      std::fprintf(stderr, "cuda_sim: deadlock in block (%u, %u): %d threads wait at barriers that never fill\n",
                   blockIdx.x, blockIdx.y, b.alive);
      std::abort();
    }
  }
}

// The blocks of one cluster at once, one OS thread each (clusters along x).
inline void run_cluster(void (*body)(void*), void* arg, dim3 grid, dim3 threads_per_block, uint3 first,
                        unsigned size, uint64_t seed) {
  Cluster c;
  c.live = (int)size;
  std::vector<std::thread> workers;
  for (unsigned r = 0; r < size; ++r)
    workers.emplace_back([=, &c] {
      gridDim = grid;
      blockDim = threads_per_block;
      blockIdx = uint3{first.x + r, first.y, first.z};
      cluster = &c;
      run_block(body, arg, (int)(threads_per_block.x * threads_per_block.y * threads_per_block.z), seed + r);
      cluster_block_exit(c);
    });
  for (std::thread& w : workers) w.join();
}

// The launch attribute `id` of a configuration (null when it has none).
inline const cudaLaunchAttribute* find_attribute(const cudaLaunchConfig_t& config, cudaLaunchAttributeID id) {
  for (unsigned a = 0; a < config.numAttrs; ++a)
    if (config.attrs[a].id == id) return &config.attrs[a];
  return nullptr;
}

// The cluster shape of a launch configuration (1 x 1 x 1 without the attribute).
inline dim3 cluster_dim(const cudaLaunchConfig_t& config) {
  const cudaLaunchAttribute* a = find_attribute(config, cudaLaunchAttributeClusterDimension);
  return a ? dim3(a->val.clusterDim.x, a->val.clusterDim.y, a->val.clusterDim.z) : dim3(1, 1, 1);
}

inline bool dependent_launch(const cudaLaunchConfig_t& config) {
  const cudaLaunchAttribute* a = find_attribute(config, cudaLaunchAttributeProgrammaticStreamSerialization);
  return a && a->val.programmaticStreamSerializationAllowed;
}

// What a GPU would refuse to launch (the checks the launchers rely on).
inline cudaError_t check_launch(const cudaLaunchConfig_t& config, const void* kernel) {
  const unsigned threads = config.blockDim.x * config.blockDim.y * config.blockDim.z;
  if (threads == 0 || threads > 1024 || config.gridDim.x == 0 || config.gridDim.y == 0 || config.gridDim.z == 0)
    return cudaErrorInvalidConfiguration;
  const KernelAttributes attributes = attributes_of(kernel);
  if (config.dynamicSmemBytes > attributes.max_dynamic_shared) return cudaErrorInvalidValue;
  const dim3 c = cluster_dim(config);
  const unsigned size = c.x * c.y * c.z;
  if (size == 0 || c.y != 1 || c.z != 1 || config.gridDim.x % c.x != 0) return cudaErrorInvalidConfiguration;
  if (size > kMaxCluster || (size > kPortableCluster && !attributes.non_portable_clusters))
    return cudaErrorClusterOutOfResources;
  return cudaSuccess;
}

// A launch: the blocks (clusters) of the grid one after another, in the order sim::order says (a
// grid's blocks may run in any order on a GPU, so which block of a row comes last and finishes it
// varies too).
template <typename... Params, typename... Args>
cudaError_t launch(const cudaLaunchConfig_t& config, void (*kernel)(Params...), Args&&... args) {
  if (const cudaError_t error = check_launch(config, reinterpret_cast<const void*>(kernel)); error != cudaSuccess)
    return error;
  const bool clustered = find_attribute(config, cudaLaunchAttributeClusterDimension) != nullptr;
  const unsigned cluster_size = cluster_dim(config).x;
  ++counts.launches;
  counts.cluster_launches += clustered;
  counts.dependent_launches += dependent_launch(config);
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
  const int threads = (int)(blockDim.x * blockDim.y * blockDim.z);
  std::vector<uint3> firsts;  // the first block of each cluster (of each block without clusters)
  for (unsigned z = 0; z < gridDim.z; ++z)
    for (unsigned y = 0; y < gridDim.y; ++y)
      for (unsigned x = 0; x < gridDim.x; x += cluster_size) firsts.push_back(uint3{x, y, z});
  if (order == Order::Reverse) std::reverse(firsts.begin(), firsts.end());
  if (order == Order::Shuffled) std::shuffle(firsts.begin(), firsts.end(), std::mt19937_64(shuffle_seed++));
  const int64_t read_before = watched_bytes_read.load();
  for (const uint3& first : firsts) {
    const uint64_t seed = shuffle_seed;
    shuffle_seed += cluster_size;
    if (clustered) {
      run_cluster(body, &call, gridDim, blockDim, first, cluster_size, seed);
    } else {
      blockIdx = first;
      run_block(body, &call, threads, seed);
    }
  }
  reads_per_launch.push_back(watched_bytes_read.load() - read_before);
  return cudaSuccess;
}

inline void cluster_sync() { barrier(1, Barrier::Cluster); }

}  // namespace sim

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* device) { *device = sim::current_device; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= sim::kDeviceCount) return cudaErrorInvalidDevice;
  sim::current_device = device;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device < 0 || device >= sim::kDeviceCount) return cudaErrorInvalidDevice;
  // sm_90: the planner may take programmatic dependent launch and the cluster paths.
  *value = attribute == cudaDevAttrMultiProcessorCount ? sim::kDevices[device] : 9;
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, F) {
  attributes->ptxVersion = attributes->binaryVersion = 90;
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute attribute, int value) {
  std::lock_guard<std::mutex> lock(sim::attributes_mutex);
  sim::KernelAttributes& a = sim::kernel_attributes[reinterpret_cast<const void*>(kernel)];
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || (size_t)value > sim::kMaxDynamicShared) return cudaErrorInvalidValue;
    a.max_dynamic_shared = (size_t)value;
  } else if (attribute == cudaFuncAttributeNonPortableClusterSizeAllowed) {
    a.non_portable_clusters = value != 0;
  }
  return cudaSuccess;
}
// Two blocks per SM of the device's SMs, shared by the clusters; 0 where a launch would fail.
template <typename F>
cudaError_t cudaOccupancyMaxActiveClusters(int* clusters, F kernel, const cudaLaunchConfig_t* config) {
  const unsigned size = sim::cluster_dim(*config).x;
  const bool launchable = sim::check_launch(*config, reinterpret_cast<const void*>(kernel)) == cudaSuccess;
  *clusters = launchable && size <= (unsigned)(2 * sim::kDevices[sim::current_device])
                  ? 2 * sim::kDevices[sim::current_device] / (int)size
                  : 0;
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
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
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

// Atomics: real ones, as the blocks of a cluster run on OS threads of their own at once.
template <typename T>
T atomicAdd(T* p, T value) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(p, value, __ATOMIC_SEQ_CST);
  } else {
    T old, sum;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    do sum = old + value;
    while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
  }
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
