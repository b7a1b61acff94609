// Where a verification step's GPU time goes, without torch: fsd_ext.accept's kernels launched
// straight through the framework-free launcher (csrc/fsd/cuda/launch.h) on synthetic logits.
//
// Built twice by benchmarks/build_accept_trace.sh (nvcc only; CI compiles both):
//   accept_timing  per shape, the time of one step: eager launches, a CUDA graph holding one step,
//                  and a graph holding --steps steps back to back (per step: no host launch
//                  overhead between steps, as inside a decoding loop's graph); medians of --repeats
//                  CUDA-event measurements.
//   accept_trace   the same kernels compiled with -DFSD_CUDA_TRACE (csrc/fsd/cuda/trace.cuh): one
//                  warm call per shape, every block's phase points; prints when each point is
//                  reached (first / median / last block, from the global timer) and how long each
//                  phase takes inside a block (SM clock cycles, converted at the measured clock).
//
//   build/accept_timing [--steps 10] [--replays 20] [--repeats 5] [--only SUBSTRING] [--launch splits=8,pdl=1]...
//   build/accept_trace  [--only SUBSTRING] [--launch splits=8,pdl=1]...
//
// Each --launch runs every unfiltered shape once more with those launch options (fsd::cuda::
// LaunchOptions, the syntax of the binding's FSD_EXT_CUDA_LAUNCH: splits=n, pdl=1, cluster=1,
// reverse=1).
// Markdown on stdout. Needs a GPU; without one it says so and exits with status 2.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fsd/common.h"
#include "fsd/cuda/launch.h"
#include "fsd/cuda/trace.cuh"
#include "fsd/rules.h"

namespace {

#define CHECK(expr)                                                                              \
  do {                                                                                           \
    const cudaError_t error_ = (expr);                                                           \
    if (error_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(error_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// The shapes of benchmarks/bench_accept_cuda.py (same names).
struct Shape {
  const char* name;
  int64_t batch, k, vocab;
  fsd::DType dtype;
  fsd::Rule rule;
  fsd::Divergence divergence;
  float top_p;
};
const Shape kShapes[] = {
    {"B1 K5 V151936 bf16 fsd/js", 1, 5, 151936, fsd::DType::BFloat16, fsd::Rule::FSD, fsd::Divergence::JS, 1.0f},
    {"B1 K5 V151936 bf16 greedy", 1, 5, 151936, fsd::DType::BFloat16, fsd::Rule::Greedy, fsd::Divergence::JS, 1.0f},
    {"B64 K5 V128256 bf16 fsd/js", 64, 5, 128256, fsd::DType::BFloat16, fsd::Rule::FSD, fsd::Divergence::JS, 1.0f},
    {"B64 K5 V128256 bf16 sd", 64, 5, 128256, fsd::DType::BFloat16, fsd::Rule::SD, fsd::Divergence::JS, 1.0f},
    {"B8 K4 V152064 f16 fsd/kl", 8, 4, 152064, fsd::DType::Float16, fsd::Rule::FSD, fsd::Divergence::KL, 1.0f},
    {"B32 K4 V32001 f32 fsd/js", 32, 4, 32001, fsd::DType::Float32, fsd::Rule::FSD, fsd::Divergence::JS, 1.0f},
    {"B16 K5 V128256 bf16 top_p=0.9", 16, 5, 128256, fsd::DType::BFloat16, fsd::Rule::FSD, fsd::Divergence::JS, 0.9f},
};

size_t element_bytes(fsd::DType dtype) { return dtype == fsd::DType::Float32 ? 4 : 2; }

__device__ uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ float gaussian(uint64_t key) {  // Box-Muller from two hashed uniforms
  const uint64_t h = mix(key);
  const float u1 = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
  const float u2 = (float)((h >> 16) & 0xFFFFFFu) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__device__ void store(void* base, int64_t at, float x, fsd::DType dtype) {
  if (dtype == fsd::DType::Float32) {
    static_cast<float*>(base)[at] = x;
  } else if (dtype == fsd::DType::BFloat16) {  // round to nearest even
    const uint32_t u = __float_as_uint(x);
    static_cast<uint16_t*>(base)[at] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  } else {
    static_cast<uint16_t*>(base)[at] = __half_as_ushort(__float2half_rn(x));
  }
}

// Target logits 3 N(0, 1) per id, draft logits the target's plus N(0, 1) (as the torch benchmark).
__global__ void fill_logits(void* target, void* draft, int64_t batch, int64_t k, int64_t vocab, fsd::DType dtype) {
  const int64_t target_n = batch * (k + 1) * vocab;
  for (int64_t at = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; at < target_n; at += (int64_t)gridDim.x * blockDim.x) {
    const int64_t v = at % vocab, i = (at / vocab) % (k + 1), b = at / (vocab * (k + 1));
    const float z = 3.0f * gaussian(2 * (uint64_t)at);
    store(target, at, z, dtype);
    if (i < k) store(draft, (b * k + i) * vocab + v, z + gaussian(2 * (uint64_t)at + 1), dtype);
  }
}

__global__ void fill_tokens(int64_t* tokens, int64_t n, int64_t vocab) {
  for (int64_t at = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; at < n; at += (int64_t)gridDim.x * blockDim.x)
    tokens[at] = (int64_t)(mix(0xD1B54A32D192ED03ull ^ (uint64_t)at) % (uint64_t)vocab);
}

// One shape's device buffers and problem.
struct Case {
  fsd::AcceptProblem pb;
  fsd::cuda::LaunchOptions options;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::vector<void*> buffers;

  Case(const Case&) = delete;
  Case& operator=(const Case&) = delete;
  explicit Case(const Shape& s) {
    const size_t eb = element_bytes(s.dtype);
    void *target, *draft;
    int64_t *tokens, *out_tokens, *num_accepted;
    bool* valid;
    float* divergences;
    CHECK(cudaMalloc(&target, (size_t)(s.batch * (s.k + 1) * s.vocab) * eb));
    CHECK(cudaMalloc(&draft, (size_t)(s.batch * s.k * s.vocab) * eb));
    CHECK(cudaMalloc(&tokens, (size_t)(s.batch * s.k) * sizeof(int64_t)));
    CHECK(cudaMalloc(&out_tokens, (size_t)(s.batch * (s.k + 1)) * sizeof(int64_t)));
    CHECK(cudaMalloc(&num_accepted, (size_t)s.batch * sizeof(int64_t)));
    CHECK(cudaMalloc(&valid, (size_t)s.batch));
    CHECK(cudaMalloc(&divergences, (size_t)(s.batch * s.k) * sizeof(float)));
    buffers = {target, draft, tokens, out_tokens, num_accepted, valid, divergences};
    fill_logits<<<1024, 256>>>(target, draft, s.batch, s.k, s.vocab, s.dtype);
    fill_tokens<<<64, 256>>>(tokens, s.batch * s.k, s.vocab);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());  // (the default stream: the timed stream does not wait for it)
    pb.batch = s.batch;
    pb.max_draft = s.k;
    pb.target_vocab = pb.draft_vocab = s.vocab;
    pb.dtype = s.dtype;
    pb.target_logits = target;
    pb.target_stride_k = s.vocab;
    pb.target_stride_b = (s.k + 1) * s.vocab;
    pb.draft_logits = draft;
    pb.draft_stride_k = s.vocab;
    pb.draft_stride_b = s.k * s.vocab;
    pb.draft_tokens = tokens;
    pb.rule = s.rule;
    pb.divergence = s.divergence;
    pb.threshold.scalar = 0.3f;
    pb.temperature.scalar = 1.0f;
    pb.div_temperature.scalar = 1.0f;  // fsd_ext.accept's defaults
    pb.filter.top_p = s.top_p;
    pb.key.seed.scalar = 1;
    pb.tokens = out_tokens;
    pb.num_accepted = num_accepted;
    pb.valid = valid;
    pb.divergences = divergences;
    pb.need_divergence = fsd::rule_needs_divergence(s.rule);
    pb.divergences_wanted = false;  // as fsd_ext.accept without return_divergence
    plan();
  }
  void plan() {  // (again after the options change: the workspace depends on the chunks)
    if (workspace) CHECK(cudaFree(workspace));
    workspace_bytes = fsd::cuda::accept_workspace_bytes(pb, options);
    CHECK(cudaMalloc(&workspace, workspace_bytes));
  }
  void launch(cudaStream_t stream) const {
    CHECK(fsd::cuda::launch_accept(pb, options, workspace, workspace_bytes, stream));
  }
  ~Case() {
    for (void* p : buffers) cudaFree(p);
    if (workspace) cudaFree(workspace);
  }
};

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// A variant: launch options and their text ("splits=8,pdl=1", the label's suffix).
struct Variant {
  fsd::cuda::LaunchOptions options;
  std::string text;
};

struct Options {
  int steps = 10, replays = 20, repeats = 5;
  std::string only;
  std::vector<Variant> variants;
};

#ifndef FSD_CUDA_TRACE
// Microseconds per step of `step` run `calls` times per measurement (median of repeats).
template <typename F>
double time_us(cudaStream_t stream, int calls, int repeats, int steps_per_call, F&& step) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  step();
  CHECK(cudaStreamSynchronize(stream));
  std::vector<double> samples;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(start, stream));
    for (int c = 0; c < calls; ++c) step();
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    samples.push_back(ms * 1000.0 / ((double)calls * steps_per_call));
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  return median(samples);
}

cudaGraphExec_t capture(const Case& c, cudaStream_t stream, int steps) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int s = 0; s < steps; ++s) c.launch(stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphDestroy(graph));
  return exec;
}

void run_timing(const Case& c, const std::string& label, const Options& o, cudaStream_t stream) {
  const double eager = time_us(stream, o.replays, o.repeats, 1, [&] { c.launch(stream); });
  cudaGraphExec_t one = capture(c, stream, 1), many = capture(c, stream, o.steps);
  const double graph_one = time_us(stream, o.replays, o.repeats, 1, [&] { CHECK(cudaGraphLaunch(one, stream)); });
  const double graph_many = time_us(stream, o.replays, o.repeats, o.steps, [&] { CHECK(cudaGraphLaunch(many, stream)); });
  CHECK(cudaGraphExecDestroy(one));
  CHECK(cudaGraphExecDestroy(many));
  const double bytes = (double)c.pb.batch * (2 * c.pb.max_draft + 1) * c.pb.target_vocab * element_bytes(c.pb.dtype);
  std::printf("| %s | %.1f | %.1f | %.1f | %.0f |\n", label.c_str(), eager, graph_one, graph_many,
              bytes / (std::min({eager, graph_one, graph_many}) * 1e-6) / 1e9);
  std::fflush(stdout);
}

#else  // FSD_CUDA_TRACE
const char* const kTagNames[fsd::cuda::kTraceTags] = {
    "stats begin", "stats: target reduced", "stats: draft reduced", "decide begin", "decide: distributions",
    "decide: pass 2 reduced", "decide: counted", "finish: validity", "finish: divergences",
    "finish: acceptance scan", "finish: sample chunk", "finish: tokens written"};

// Phases inside one block: (from, to) points of the same kernel.
const std::pair<int, int> kPhases[] = {{0, 1}, {1, 2}, {0, 2}, {3, 4}, {4, 5}, {5, 6}, {4, 6},
                                       {6, 7}, {7, 8}, {8, 9}, {9, 10}, {10, 11}, {6, 11}};

void run_trace(Case& c, const std::string& label, cudaStream_t stream) {
  constexpr uint32_t kCapacity = 1u << 20;
  fsd::cuda::TraceSink host_sink;
  fsd::cuda::TraceSink* sink;
  CHECK(cudaMalloc(&host_sink.records, kCapacity * sizeof(fsd::cuda::TraceRecord)));
  CHECK(cudaMalloc(&host_sink.count, sizeof(uint32_t)));
  host_sink.capacity = kCapacity;
  CHECK(cudaMalloc(&sink, sizeof(fsd::cuda::TraceSink)));
  CHECK(cudaMemcpy(sink, &host_sink, sizeof(host_sink), cudaMemcpyHostToDevice));
  for (int warm = 0; warm < 3; ++warm) c.launch(stream);  // untraced: caches, clocks, first-call setup
  CHECK(cudaMemsetAsync(host_sink.count, 0, sizeof(uint32_t), stream));
  c.pb.trace = sink;
  c.launch(stream);
  c.pb.trace = nullptr;
  CHECK(cudaStreamSynchronize(stream));
  uint32_t count = 0;
  CHECK(cudaMemcpy(&count, host_sink.count, sizeof(count), cudaMemcpyDeviceToHost));
  std::vector<fsd::cuda::TraceRecord> records(std::min(count, kCapacity));
  CHECK(cudaMemcpy(records.data(), host_sink.records, records.size() * sizeof(records[0]), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(host_sink.records));
  CHECK(cudaFree(host_sink.count));
  CHECK(cudaFree(sink));

  uint64_t t0 = UINT64_MAX, step = UINT64_MAX;
  uint32_t blocks = 0;
  std::map<std::pair<uint32_t, uint32_t>, fsd::cuda::TraceRecord> at;  // (block, tag)
  std::vector<uint64_t> times;
  for (const auto& r : records) {
    t0 = std::min(t0, r.ns);
    blocks = std::max(blocks, r.block + 1);
    at[{r.block, r.tag}] = r;
    times.push_back(r.ns);
  }
  std::sort(times.begin(), times.end());
  for (size_t i = 1; i < times.size(); ++i)
    if (times[i] > times[i - 1]) step = std::min(step, times[i] - times[i - 1]);
  // The SM clock: cycles per nanosecond over phases of one kernel on one SM that span several
  // timer steps (the global timer may tick only every microsecond).
  std::vector<double> ghz;
  const std::pair<uint32_t, uint32_t> spans[] = {{0u, 2u}, {3u, 6u}, {6u, 11u}};
  for (uint32_t b = 0; b < blocks; ++b) {
    for (const auto& [first, last] : spans) {
      auto from = at.find({b, first}), to = at.find({b, last});
      if (from == at.end() || to == at.end() || from->second.sm != to->second.sm ||
          to->second.ns < from->second.ns + 2000)
        continue;
      ghz.push_back((double)(to->second.cycles - from->second.cycles) / (double)(to->second.ns - from->second.ns));
    }
  }
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double clock_ghz = ghz.size() >= 3 ? median(ghz) : clock_khz / 1e6;
  const int64_t positions = c.pb.max_draft + 1;
  std::printf("\n### %s\n\n%u blocks (%lld per (row, position)), %zu points%s; global timer step %.0f ns; SM clock %.2f GHz (%s)\n\n",
              label.c_str(), blocks, (long long)(blocks / (c.pb.batch * positions)), records.size(),
              count > kCapacity ? " (buffer full: later points lost)" : "", step == UINT64_MAX ? NAN : (double)step,
              clock_ghz, ghz.size() >= 3 ? "measured" : "nominal");
  std::printf("| point | blocks | first us | median us | last us |\n|---|---|---|---|---|\n");
  for (uint32_t tag = 0; tag < fsd::cuda::kTraceTags; ++tag) {
    std::vector<double> t;
    for (const auto& r : records)
      if (r.tag == tag) t.push_back((double)(r.ns - t0) * 1e-3);
    if (t.empty()) continue;
    std::printf("| %s | %zu | %.2f | %.2f | %.2f |\n", kTagNames[tag], t.size(), *std::min_element(t.begin(), t.end()),
                median(t), *std::max_element(t.begin(), t.end()));
  }
  std::printf("\n| phase inside a block | blocks | median cycles | median us | max us |\n|---|---|---|---|---|\n");
  for (const auto& [from, to] : kPhases) {
    std::vector<double> cycles;
    for (uint32_t b = 0; b < blocks; ++b) {
      auto x = at.find({b, (uint32_t)from}), y = at.find({b, (uint32_t)to});
      if (x == at.end() || y == at.end() || x->second.sm != y->second.sm) continue;  // (a guard: every phase lies inside one kernel)
      cycles.push_back((double)(y->second.cycles - x->second.cycles));
    }
    if (cycles.empty()) continue;
    const double mid = median(cycles), most = *std::max_element(cycles.begin(), cycles.end());
    std::printf("| %s -> %s | %zu | %.0f | %.2f | %.2f |\n", kTagNames[from], kTagNames[to], cycles.size(), mid,
                mid / clock_ghz * 1e-3, most / clock_ghz * 1e-3);
  }
  std::fflush(stdout);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    const char* value = a + 1 < argc ? argv[a + 1] : nullptr;
    if (value == nullptr) {
      std::fprintf(stderr, "%s needs a value\n", arg.c_str());
      return 1;
    }
    if (arg == "--steps") o.steps = std::max(1, std::atoi(value));
    else if (arg == "--replays") o.replays = std::max(1, std::atoi(value));
    else if (arg == "--repeats") o.repeats = std::max(1, std::atoi(value));
    else if (arg == "--only") o.only = value;
    else if (arg == "--launch") {
      Variant v{{}, value};
      const std::string error = fsd::cuda::parse_launch_options(v.text, v.options);
      if (!error.empty() || v.text.empty()) {
        std::fprintf(stderr, "--launch %s: %s\n", value, error.empty() ? "no option given" : error.c_str());
        return 1;
      }
      o.variants.push_back(v);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 1;
    }
    ++a;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
#ifdef FSD_CUDA_TRACE
  std::printf("## accept kernels' phase trace: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
#else
  std::printf("## accept step times: %s, %d SMs (%d steps per multi-step graph)\n\n", prop.name,
              prop.multiProcessorCount, o.steps);
  std::printf("| shape | eager us | graph (1 step) us | graph (%d steps) us per step | GB/s (best) |\n|---|---|---|---|---|\n",
              o.steps);
#endif
  for (const Shape& s : kShapes) {
    if (!o.only.empty() && std::string(s.name).find(o.only) == std::string::npos) continue;
    Case c(s);
    std::vector<Variant> variants = {{}};  // first the planner's choice, the default options
    if (s.top_p >= 1.0f) variants.insert(variants.end(), o.variants.begin(), o.variants.end());
    for (const Variant& v : variants) {
      const std::string label = v.text.empty() ? std::string(s.name) : s.name + (" " + v.text);
      c.options = v.options;
      c.plan();  // (the workspace depends on the chunks)
#ifdef FSD_CUDA_TRACE
      run_trace(c, label, stream);
#else
      run_timing(c, label, o, stream);
#endif
    }
    CHECK(cudaStreamSynchronize(stream));
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
