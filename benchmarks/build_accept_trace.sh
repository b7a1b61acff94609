#!/usr/bin/env bash
# Builds the torch-free step timer and phase tracer of fsd_ext.accept's kernels
# (benchmarks/accept_trace.cu) with nvcc alone: $OUT_DIR/accept_timing (the kernels as the extension
# compiles them) and $OUT_DIR/accept_trace (the same with -DFSD_CUDA_TRACE). No GPU needed to build.
#
#   benchmarks/build_accept_trace.sh     # NVCC, FSD_CUDA_ARCHS ("90"), OUT_DIR (build/accept_trace),
#                                        # MODES ("timing trace": which of the two to build),
#                                        # FSD_CUDA_PTX_ONLY=1 (PTX, no ptxas: a compile check)
#
# CI builds both (scripts/check_cuda_compile.sh); benchmarks/gpu_check.sh builds and runs them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
ARCHS="${FSD_CUDA_ARCHS:-90}"
MODES="${MODES:-timing trace}"
OUT="${OUT_DIR:-$ROOT/build/accept_trace}"
mkdir -p "$OUT/obj"
GENCODE=()
# PTX only (CI's check that the tracing build compiles): ptxas takes half of nvcc's time here, and
# the binary it would make is not the one a GPU run times. The GPU run builds SASS.
code=sm
[[ ${FSD_CUDA_PTX_ONLY:-0} == 1 ]] && code=compute
for arch in $ARCHS; do GENCODE+=(-gencode "arch=compute_${arch},code=${code}_${arch}"); done
SOURCES=("$ROOT/benchmarks/accept_trace.cu" "$ROOT"/csrc/fsd/cuda/accept.cu "$ROOT"/csrc/fsd/cuda/accept_*.cu)

# Every object of both builds in parallel, then one link per build.
pids=()
for mode in $MODES; do
  flags=()
  [[ $mode == trace ]] && flags=(-DFSD_CUDA_TRACE)
  for src in "${SOURCES[@]}"; do
    obj="$OUT/obj/$mode-$(basename "$src" .cu).o"
    "$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr -lineinfo -I"$ROOT/csrc" "${GENCODE[@]}" "${flags[@]}" \
      -Werror all-warnings -c "$src" -o "$obj" >"$obj.log" 2>&1 &
    pids+=("$!:$obj")
  done
done
status=0
for entry in "${pids[@]}"; do
  if ! wait "${entry%%:*}"; then
    echo "== COMPILE ERROR: ${entry#*:}" >&2
    cat "${entry#*:}.log" >&2
    status=1
  fi
done
(( status == 0 )) || exit 1
for mode in $MODES; do
  "$NVCC" "${GENCODE[@]}" "$OUT"/obj/$mode-*.o -o "$OUT/accept_$mode"
  echo "built $OUT/accept_$mode for ${code}_${ARCHS// /, ${code}_}"
done
