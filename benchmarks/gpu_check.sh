#!/usr/bin/env bash
# One GPU check of the CUDA kernels on one H200 with no internet: about 4 minutes with a prebuilt
# extension on 2026-11-30, before the opt-in paths' tests, the step timer and the sampling
# benchmark were added (estimate now: 6-7 minutes with GPU_CHECK_SKIP="decode ncu sanitizer",
# including the extension build); every step's limit is its own cap or what is left of GPU_CHECK_DEADLINE, 570 s
# by default, so the whole stays under the device's 10-minute command limit:
#   1. builds the extension in place (CUDA on, sm_90 only unless TORCH_CUDA_ARCH_LIST is set: the
#      H200 image sets 9.0a) unless a prebuilt one is carried (below), and calls accept once on the
#      GPU; meanwhile, in the background, the CPU kernels' sources are compiled with this machine's
#      C++ compiler (the image's GCC 13 once failed on them while CI's GCC 12 did not);
#   2. pytest -m cuda $CUDA_TESTS -k "not (pdl or cluster)" (parity CUDA / CPU
#      kernel / reference, statistics, CUDA graphs, NaN rows, no host sync, generate with graphs);
#   3. the opt-in paths, after step 2 so that a fault there cannot spoil step 2's results: the
#      tests of the cluster path (FSD_EXT_CUDA_LAUNCH=cluster=1, thread-block clusters, sm_90)
#      and of programmatic dependent launch (pdl=1), whose fixtures set the launch options;
#   4. the kernel benchmark (benchmarks/bench_accept_cuda.py): one table per shape with us, GB/s,
#      % of the D2D copy bandwidth and the speed-ups over eager PyTorch and torch.compile, and one
#      of the launch-option variants (forced splits and every opt-in path: pdl, cluster, reverse)
#      against the planner's path; then the torch-free step timer and phase tracer (benchmarks/
#      accept_trace.cu, built by benchmarks/build_accept_trace.sh in the background during steps
#      2-4 unless carried): per shape a step's time eager, in a one-step graph and per step of a
#      multi-step graph, and where inside the kernels a step's time goes; then the sampling
#      benchmark (benchmarks/bench_sample_cuda.py: fsd_ext.sample eager and in a graph, % of copy
#      bandwidth, against eager PyTorch and torch.multinomial);
#   5. decoding with CUDA graphs (benchmarks/bench_decode_graphs.py): tokens/s eager vs graphs on a
#      first call (captures) and on later calls (graphs reused), random-weight models of the
#      Qwen2.5-Coder 1.5B / 0.5B shapes, batch 1 and 8, AR and SD, and against HF at batch 1;
#   6. kernel profile: one accept call per configuration (benchmarks/profile_accept_cuda.py)
#      under Nsight Compute (ncu: speed of light, occupancy, launch and warp-state statistics);
#   7. while time is left, a few CUDA tests under compute-sanitizer memcheck and racecheck (best
#      effort: some GPU sandboxes refuse the sanitizer).
# GPU_CHECK_SKIP="decode ncu sanitizer" skips steps 5, 6, 7 (any of them).
#
#   bash benchmarks/gpu_check.sh               # through the device tool, which sets $OUT
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh  # elsewhere
#   PYTHON=/venv/bin/python bash benchmarks/gpu_check.sh --prebuild
#       # builds here with the GPU machine's torch and Python (no GPU needed) and writes a stamp;
#       # carry fsd_ext/_C.cpython-*.so and build/gpu_prebuilt.stamp and step 1 skips the build
#       # (a build for sm_90 runs on the H200 whatever TORCH_CUDA_ARCH_LIST says there);
#       # it also builds build/accept_trace/accept_{timing,trace} and their stamp: carry
#       # build/accept_trace/accept_timing, build/accept_trace/accept_trace, build/accept_trace/stamp
#
# What comes back from $OUT is limited (the device tool returns at most 8 files), so $OUT holds
# gpu_check.tgz (every log, junit XML and benchmark JSON, re-packed after each step, so a kill
# still leaves the steps before it), summary.txt and the benchmark tables (.md).
# Exit status: non-zero if any step failed (later steps still run when the build succeeded).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# Build outputs (GPU_CHECK_BUILD: another folder, e.g. for benchmarks/tests/test_gpu_check_script.py's dry run).
BUILD="${GPU_CHECK_BUILD:-$ROOT/build}"
OUT="${OUT:-$BUILD/gpu_check}"
WORK="$BUILD/gpu_check_work"  # everything; $OUT gets the archive and the summaries
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export FSD_EXT_CUDA=1
export PYTHONUNBUFFERED=1  # a killed step still leaves what it printed
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# python3: the GPU image names its torch interpreter python3 (there may be no `python`).
PY="${PYTHON:-$(command -v python3 || command -v python)}"
start=$SECONDS
status=0
# The files holding CUDA tests (test_accept.py: its device-parametrized tests' cuda cases).
CUDA_TESTS="tests/test_cuda.py tests/test_cuda_launch.py tests/test_accept.py"
step() { echo; echo "=== [$((SECONDS - start))s] $*" | tee -a "$WORK/summary.txt"; }
note() { echo "=== $*" | tee -a "$WORK/summary.txt"; }
pack() {  # the archive and the summaries into $OUT (after every step)
  tar czf "$OUT/gpu_check.tgz" -C "$WORK" . 2>/dev/null || true
  cp "$WORK/summary.txt" "$OUT/summary.txt" 2>/dev/null || true
  cp "$WORK"/bench_accept_cuda.md "$WORK"/bench_sample_cuda.md "$WORK"/bench_decode_graphs.md "$WORK"/ncu_summary.txt \
    "$WORK"/accept_timing.md "$WORK"/accept_trace.md "$OUT/" 2>/dev/null || true
}
# Every step's time limit is its own cap or what is left of DEADLINE seconds, whichever is less, so
# the whole script stays under the device's 10-minute command limit. SIGINT first: pytest then
# still prints its summary and writes its XML; SIGKILL 10 s later if a CUDA call hangs.
DEADLINE=${GPU_CHECK_DEADLINE:-570}
BUILD_CAP=230
if [[ "${1:-}" == "--prebuild" ]]; then DEADLINE=3600 BUILD_CAP=3000; fi  # 2 CPU cores: minutes
left() { echo $((DEADLINE - (SECONDS - start))); }
limited() {  # limited CAP CMD...: at most min(CAP, what is left) seconds; 124 at once when nothing is
  local cap=$1 t; shift
  t=$(( $(left) - 10 ))
  if (( t < 5 )); then echo "=== no time left for: $*"; return 124; fi
  timeout -s INT -k 10 "$(( cap < t ? cap : t ))" "$@"
}
timed_out() { (( $1 == 124 || $1 == 130 || $1 == 137 )); }  # rc of a step stopped by `limited`
# check NAME RC LOG: record a step's outcome in the summary.
check() {
  local name=$1 rc=$2 log=$3
  if (( rc == 0 )); then note "$name: ok"; pack; return 0; fi
  status=1
  if timed_out "$rc"; then note "$name: CUT BY ITS TIME LIMIT (rc $rc)"
  else note "$name: FAILED (rc $rc)"; fi
  grep -E "^(FAILED|ERROR) " "$log" | head -n 20 | tee -a "$WORK/summary.txt" || true
  pack
  return 1
}
# A build made elsewhere (same torch build, Python and sources: `--prebuild` below writes the stamp)
# is used as it is, which saves the GPU machine the compile; carry it with the stamp.
STAMP="$BUILD/gpu_prebuilt.stamp"
source_stamp() {
  { "$PY" -c "import sys, torch; print(sys.version_info[:2], torch.__version__, torch.version.git_version)"
    cat setup.py; find csrc -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1
}
skipped() { [[ " ${GPU_CHECK_SKIP:-} " == *" $1 "* ]]; }
# The torch-free harness (benchmarks/accept_trace.cu) has its own stamp: the kernels and the harness.
HARNESS="$BUILD/accept_trace"
harness_stamp() { { cat benchmarks/accept_trace.cu benchmarks/build_accept_trace.sh; find csrc/fsd -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1; }
harness_ready() { [[ -x "$HARNESS/accept_timing" && -x "$HARNESS/accept_trace" && -f "$HARNESS/stamp" && "$(cat "$HARNESS/stamp")" == "$(harness_stamp)" ]]; }
build_harness() {  # (its log: $1)
  if FSD_CUDA_ARCHS=90 OUT_DIR="$HARNESS" bash benchmarks/build_accept_trace.sh >"$1" 2>&1; then harness_stamp >"$HARNESS/stamp"; fi
}
PYTEST_OPTS=(-q -p no:cacheprovider -rfE --durations=10)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST_OPTS+=(--timeout=60); fi  # names a hung test

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available(), 'transformers', transformers.__version__)" || true
  nvcc --version | tail -n 2 | head -n 1 || true
} 2>&1 | tee -a "$WORK/summary.txt"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(source_stamp)" ]] && "$PY" -c "import fsd_ext.ops as o; o._ops()" 2>/dev/null; then
  step "build skipped: a prebuilt extension of these sources for this torch and Python ($STAMP)"
else
  step "build (python setup.py build_ext --inplace, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  rc=0
  limited "$BUILD_CAP" "$PY" setup.py build_ext --inplace >"$WORK/build.log" 2>&1 || rc=$?
  if ! check build "$rc" "$WORK/build.log"; then
    tail -n 60 "$WORK/build.log"
    exit 1
  fi
fi
if [[ "${1:-}" == "--prebuild" ]]; then
  source_stamp >"$STAMP"
  note "stamp written: $STAMP (built for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  if harness_ready; then note "step timer and phase tracer: up to date ($HARNESS)"; exit 0; fi
  step "step timer and phase tracer (benchmarks/build_accept_trace.sh, sm_90)"
  build_harness "$WORK/build_harness.log"
  if harness_ready; then note "built: $HARNESS/accept_timing, $HARNESS/accept_trace, stamp"; exit 0; fi
  tail -n 40 "$WORK/build_harness.log"
  exit 1
fi
# In the background unless carried: the torch-free step timer and phase tracer (step 4 runs them).
harness_pid=""
if ! harness_ready; then (build_harness "$WORK/build_harness.log"; touch "$WORK/harness.done") & harness_pid=$!; fi
# In the background: the CPU kernels' sources with this machine's C++ compiler (framework-free, so
# no torch headers; the flags of setup.py that matter to code generation).
CXX_BIN="${CXX:-$(command -v c++ || command -v g++ || echo c++)}"
( "$CXX_BIN" --version | head -n 1
  for src in csrc/fsd/cpu/*.cpp; do
    "$CXX_BIN" -O3 -std=c++20 -fno-math-errno -fno-trapping-math -fopenmp-simd -fopenmp -fPIC -Wall \
      -Wno-unknown-pragmas -Icsrc -c "$src" -o "$WORK/$(basename "$src").o" && echo "$src: ok" || echo "$src: FAILED"
  done ) >"$WORK/cxx.log" 2>&1 &
cxx_pid=$!
rc=0
limited 60 "$PY" - <<'PY' 2>&1 | tee "$WORK/smoke.log" || rc=$?
import torch, fsd_ext.ops as ops
ops._ops()
x = torch.zeros(1, 2, 8, device="cuda")
print("extension loaded; CUDA accept:", ops.accept(x, x[:, :1], torch.zeros(1, 1, dtype=torch.long, device="cuda"), seed=0).tokens.tolist())
PY
check "one accept call on the GPU" "$rc" "$WORK/smoke.log" || true

step "tests (pytest -m cuda $CUDA_TESTS -k 'not (pdl or cluster)')"
rc=0
limited 150 "$PY" -m pytest -m cuda $CUDA_TESTS -k "not (pdl or cluster)" "${PYTEST_OPTS[@]}" \
  --junitxml="$WORK/test_cuda.xml" >"$WORK/test_cuda.log" 2>&1 || rc=$?
tail -n 25 "$WORK/test_cuda.log"
check "CUDA tests" "$rc" "$WORK/test_cuda.log" || true

step "tests, opt-in paths (pytest -m cuda $CUDA_TESTS -k 'pdl or cluster')"
rc=0
limited 150 "$PY" -m pytest -m cuda $CUDA_TESTS -k "pdl or cluster" "${PYTEST_OPTS[@]}" \
  --junitxml="$WORK/test_cuda_opt_in.xml" >"$WORK/test_cuda_opt_in.log" 2>&1 || rc=$?
tail -n 25 "$WORK/test_cuda_opt_in.log"
# An opt-in path that failed its tests (all of them when the run was cut) is not benchmarked; the
# reversed decisions' tests ran in step 2.
variants=(splits=1 splits=8 splits=32 reverse=1)
if check "CUDA tests, opt-in paths (cluster, PDL)" "$rc" "$WORK/test_cuda_opt_in.log"; then
  variants+=(pdl=1 cluster=1)
else
  failed=$(grep -E "^(FAILED|ERROR) " "$WORK/test_cuda_opt_in.log" || true)
  for path in pdl cluster; do
    if [[ -n "$failed" ]] && ! grep -qi "$path" <<<"$failed"; then variants+=("$path=1")
    else note "$path=1 failed its tests (or the run was cut): benchmarked without it"; fi
  done
fi
bench_flags=(--variants "${variants[@]}")

step "benchmark (benchmarks/bench_accept_cuda.py)"
rc=0
limited 140 "$PY" benchmarks/bench_accept_cuda.py --out "$WORK" --budget-s 80 ${bench_flags[@]+"${bench_flags[@]}"} \
  2>&1 | tee "$WORK/bench.log" || rc=$?
grep -E "^target " "$WORK/bench.log" >>"$WORK/summary.txt" || true
check "kernel benchmark" "$rc" "$WORK/bench.log" || true

step "step times and phase trace (build/accept_trace/accept_timing, accept_trace: no torch)"
if [[ -n "$harness_pid" ]]; then  # still building: wait up to 2 minutes
  for ((i = 0; i < 120 && $(left) > 60; i++)); do [[ -f "$WORK/harness.done" ]] && break; sleep 1; done
fi
if harness_ready; then
  rc=0
  { limited 60 "$HARNESS/accept_timing" --steps 10 --launch splits=8 --launch splits=32 \
      --launch pdl=1 --launch cluster=1 --launch reverse=1 >"$WORK/accept_timing.md" &&
    limited 60 "$HARNESS/accept_trace" --launch pdl=1 --launch cluster=1 \
      >"$WORK/accept_trace.md"; } 2>"$WORK/accept_harness.log" || rc=$?
  head -n 20 "$WORK/accept_timing.md"
  check "step timer and phase tracer" "$rc" "$WORK/accept_harness.log" || true
else
  note "step timer and phase tracer: not built (build_harness.log)"
  tail -n 20 "$WORK/build_harness.log" 2>/dev/null || true
  status=1
  pack
fi

step "sampling benchmark (benchmarks/bench_sample_cuda.py)"
rc=0
limited 45 "$PY" benchmarks/bench_sample_cuda.py --out "$WORK" 2>&1 | tee "$WORK/bench_sample.log" || rc=$?
check "sampling benchmark" "$rc" "$WORK/bench_sample.log" || true

step "the CPU kernels' sources with this machine's C++ compiler ($CXX_BIN)"
wait "$cxx_pid" || true
grep -E "^(csrc|g\+\+|c\+\+|gcc|clang)|error" "$WORK/cxx.log" | head -n 20
if grep -q "FAILED" "$WORK/cxx.log"; then note "C++ compile of csrc/fsd/cpu: FAILED (cxx.log)"; status=1
else note "C++ compile of csrc/fsd/cpu: ok ($(head -n 1 "$WORK/cxx.log"))"; fi
pack

if skipped decode; then note "decode benchmark skipped (GPU_CHECK_SKIP)"; else
step "decoding with CUDA graphs (benchmarks/bench_decode_graphs.py; random-weight Qwen2.5 1.5B / 0.5B shapes)"
rc=0
limited 120 "$PY" benchmarks/bench_decode_graphs.py --out "$WORK" --budget-s 60 --max-new-tokens 32 --repeats 2 \
  2>&1 | tee "$WORK/bench_decode_graphs.log" || rc=$?
check "decode benchmark" "$rc" "$WORK/bench_decode_graphs.log" || true
fi

if skipped ncu || ! command -v ncu >/dev/null; then note "ncu profile skipped (GPU_CHECK_SKIP or no ncu)"; else
step "kernel profile (ncu on benchmarks/profile_accept_cuda.py)"
rc=0
limited 120 ncu --clock-control none --target-processes all -k regex:accept_ --csv --page details \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    "$PY" benchmarks/profile_accept_cuda.py >"$WORK/ncu.csv" 2>"$WORK/ncu.log" || rc=$?
grep -E "^=== config|path=" "$WORK/ncu.log" "$WORK/ncu.csv" | head -n 20 || true
# Per kernel launch: name, duration, DRAM throughput, achieved occupancy (the CSV has every metric).
"$PY" - "$WORK/ncu.csv" <<'PY' 2>&1 | tee "$WORK/ncu_summary.txt" || true
import csv, sys
want = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
        "Registers Per Thread", "Theoretical Occupancy", "Waves Per SM", "Grid Size")
rows = {}
with open(sys.argv[1]) as f:
    lines = [line for line in f if line.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") in want:
        key = (int(r["ID"]), r["Kernel Name"].split("(")[0].replace("void ", "").replace("fsd::cuda::", ""))
        rows.setdefault(key, {})[r["Metric Name"]] = f'{r["Metric Value"]} {r["Metric Unit"]}'.strip()
for (i, name), m in sorted(rows.items()):
    print(i, name, "|", "; ".join(f"{k}: {m[k]}" for k in want if k in m))
PY
check "ncu profile" "$rc" "$WORK/ncu.log" || true
fi

# 7. Best effort, while time is left: a few CUDA tests under compute-sanitizer (memcheck: out of
# bounds and misaligned accesses, e.g. bf16 rows of V=50001 on the split path; racecheck: shared
# memory races). Without the caching allocator every tensor is its own allocation, so an access
# past one is caught. Some GPU sandboxes refuse the sanitizer ("Device not supported"), and a run
# cut short by the time limit proves nothing: both are reported, not failed.
declare -A SANITIZED=(
  [memcheck]="nan_and_all or out_of_range or split_vocab_path_matches or filters_on_tied"
  [racecheck]="nan_and_all or (split_vocab_path_matches and dtype1)")
for tool in memcheck racecheck; do
  if skipped sanitizer; then note "compute-sanitizer $tool skipped (GPU_CHECK_SKIP)"; continue; fi
  if ! command -v compute-sanitizer >/dev/null || (( $(left) < 70 )); then
    note "compute-sanitizer $tool skipped (not installed, or only $(left)s left)"; continue
  fi
  step "compute-sanitizer --tool $tool (up to $(left)s): pytest -k '${SANITIZED[$tool]}'"
  log="$WORK/sanitizer_$tool.log"
  rc=0
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 limited 600 compute-sanitizer --tool "$tool" --target-processes all \
      "$PY" -m pytest -m cuda $CUDA_TESTS -k "${SANITIZED[$tool]}" -x -q -p no:cacheprovider \
      >"$log" 2>&1 || rc=$?
  tail -n 5 "$log"
  if grep -q "Device not supported" "$log"; then
    note "compute-sanitizer $tool: not supported on this machine"
  elif grep -qE "ERROR SUMMARY: [1-9]" "$log"; then
    note "compute-sanitizer $tool: ERRORS (see sanitizer_$tool.log)"
    status=1
  elif timed_out "$rc"; then
    note "compute-sanitizer $tool: cut short by the time limit, no error until then"
  elif (( rc != 0 )); then
    note "compute-sanitizer $tool: the tests failed under it (rc $rc, see sanitizer_$tool.log)"
    status=1
  else
    note "compute-sanitizer $tool: clean"
  fi
  pack
done

step "done in $((SECONDS - start))s, status $status (outputs in $OUT: gpu_check.tgz, summary.txt, tables)"
pack
exit "$status"
