#!/usr/bin/env bash
# Compiles every csrc/fsd/cuda/*.cu with nvcc alone (no torch, no GPU needed) for sm_80 and sm_90
# with -Xptxas -v, prints the resource report (registers, shared memory, stack, spills per kernel
# and architecture) and fails on any compile error or on register spills in the main kernels.
# Then builds and runs the host tests of the kernels' arithmetic (csrc/fsd/tests/*.cu), and links
# the torch-free step timer (benchmarks/accept_trace.cu) against these objects and, for sm_90, its
# phase-tracing build (every kernel again with -DFSD_CUDA_TRACE), so neither can rot unnoticed.
#
#   scripts/check_cuda_compile.sh [--no-tools]  # NVCC, FSD_CUDA_ARCHS ("80 90"), FSD_CUDA_CHECK_DIR,
#                                               # FSD_CUDA_JOBS (parallel nvcc, default nproc)
#   --no-tools: the kernels and host tests only, not the step timer and phase tracer (.ci/run;
#               scripts/full_check.sh builds them).
#
# Exit status: 0 ok, 1 compile error, spills or a failed host test, 2 no nvcc.
set -euo pipefail
TOOLS=1
for arg in "$@"; do
  case "$arg" in
    --no-tools) TOOLS=0 ;;
    *) echo "check_cuda_compile: unknown argument $arg (usage: check_cuda_compile.sh [--no-tools])" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$NVCC" ]]; then
  echo "check_cuda_compile: nvcc not found (set NVCC=...)" >&2
  exit 2
fi
ARCHS="${FSD_CUDA_ARCHS:-80 90}"
OUT="${FSD_CUDA_CHECK_DIR:-$ROOT/build/cuda-check}"
mkdir -p "$OUT"

GENCODE=()
for arch in $ARCHS; do GENCODE+=(-gencode "arch=compute_${arch},code=sm_${arch}"); done

echo "== nvcc: $("$NVCC" --version | tail -n 2 | head -n 1)"
echo "== archs: $ARCHS"
shopt -s nullglob
SOURCES=("$ROOT"/csrc/fsd/cuda/*.cu)
if (( ${#SOURCES[@]} == 0 )); then echo "no CUDA sources" >&2; exit 1; fi

# One nvcc per source (all architectures in one call), FSD_CUDA_JOBS sources at a time, the three
# dtype instantiations (minutes each) first.
JOBS="${FSD_CUDA_JOBS:-$(nproc)}"
export NVCC ROOT OUT GENCODE_ARGS="${GENCODE[*]}"
compile_one() {
  local src="$1" name
  name="$(basename "$src" .cu)"
  # shellcheck disable=SC2086  # (GENCODE_ARGS: a word list; xargs' shells cannot inherit arrays)
  if ! "$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr -lineinfo -I"$ROOT/csrc" $GENCODE_ARGS \
      -Xptxas -v -Werror all-warnings -c "$src" -o "$OUT/$name.o" >"$OUT/$name.log" 2>&1; then
    echo "== COMPILE ERROR: $src" >&2
    cat "$OUT/$name.log" >&2
    return 1
  fi
}
export -f compile_one
ORDERED=()
for src in "${SOURCES[@]}"; do [[ "$src" == *accept_* ]] && ORDERED+=("$src"); done
for src in "${SOURCES[@]}"; do [[ "$src" != *accept_* ]] && ORDERED+=("$src"); done
printf '%s\0' "${ORDERED[@]}" | xargs -0 -n 1 -P "$JOBS" bash -c 'compile_one "$0"' || exit 1

# Resource report. Main kernels (no spill allowed): everything except the uniforms helper, which
# is reported too. Any kernel with spill stores fails.
python3 - "$OUT" "${SOURCES[@]}" <<'PY'
import os, re, subprocess, sys
out_dir, sources = sys.argv[1], sys.argv[2:]
rows, current = [], {}
for src in sources:
    log = os.path.join(out_dir, os.path.basename(src)[:-3] + ".log")
    for line in open(log):
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            current = {"mangled": m.group(1), "arch": m.group(2), "stack": 0, "spill_st": 0, "spill_ld": 0,
                       "regs": 0, "smem": 0, "file": os.path.basename(src)}
            rows.append(current)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            current["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
names = [r["mangled"] for r in rows]
try:
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                               check=True).stdout.splitlines()
except Exception:
    demangled = names
def short(name):
    name = re.sub(r"\(.*\)$", "", name)  # drop the parameter list
    return name.replace("fsd::cuda::", "").replace("fsd::", "")
print(f"{'kernel':<55} {'arch':<6} {'regs':>4} {'smem':>6} {'stack':>5} {'spill st/ld':>12}")
bad = []
for r, d in sorted(zip(rows, demangled), key=lambda x: (short(x[1]), x[0]["arch"])):
    n = short(d)
    print(f"{n:<55} {r['arch']:<6} {r['regs']:>4} {r['smem']:>6} {r['stack']:>5} {r['spill_st']:>5}/{r['spill_ld']:<6}")
    if r["spill_st"] > 0 or r["spill_ld"] > 0:
        bad.append(f"{n} ({r['arch']}): {r['spill_st']} bytes spill stores, {r['spill_ld']} bytes spill loads")
if not rows:
    print("no kernels found in the ptxas output", file=sys.stderr)
    sys.exit(1)
if bad:
    print("== FAIL: register spills:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"== OK: {len(rows)} kernel builds, no spills")
PY

# Host checks of the kernels' per-thread streaming arithmetic (csrc/fsd/tests/*.cu: programs nvcc
# compiles for the host, run here; they need no GPU).
for test_source in "$ROOT"/csrc/fsd/tests/*.cu; do
  name="$(basename "$test_source" .cu)"
  echo "== host test: $name"
  "$NVCC" -std=c++17 -O2 --expt-relaxed-constexpr -I"$ROOT/csrc" -Werror all-warnings "$test_source" -o "$OUT/$name"
  "$OUT/$name"
done

(( TOOLS )) || exit 0

# The torch-free step timer links against the objects above (all architectures); the phase tracer
# recompiles the kernels with -DFSD_CUDA_TRACE (compute_90 PTX only: the tracing points are the same
# code on every architecture, and cicc is what checks them; skipping ptxas halves the ~8 minutes
# this build took on CI's 2 cores).
echo "== step timer and phase tracer (benchmarks/accept_trace.cu)"
"$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr -lineinfo -I"$ROOT/csrc" "${GENCODE[@]}" -Werror all-warnings \
  -c "$ROOT/benchmarks/accept_trace.cu" -o "$OUT/accept_trace_main.o"
KERNEL_OBJECTS=()
for src in "${SOURCES[@]}"; do KERNEL_OBJECTS+=("$OUT/$(basename "$src" .cu).o"); done
"$NVCC" "${GENCODE[@]}" "$OUT/accept_trace_main.o" "${KERNEL_OBJECTS[@]}" -o "$OUT/accept_timing"
echo "linked $OUT/accept_timing"
NVCC="$NVCC" FSD_CUDA_ARCHS=90 FSD_CUDA_PTX_ONLY=1 MODES=trace OUT_DIR="$OUT/accept_trace" bash "$ROOT/benchmarks/build_accept_trace.sh"
