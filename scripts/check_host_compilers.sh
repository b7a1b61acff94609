#!/usr/bin/env bash
# Builds the kernels with the GCC releases after CI's own GCC 12: 13 (Ubuntu 24.04's default, and
# the GPU machine image's) and 14 (Debian 13's). GCC 13.2-14.2 crash (an internal compiler error in
# the target_clones pass) on some code that GCC 12 compiles, which once cost a GPU session its build
# (benchmarks/results/gpu-h200-2026-11-30) and would fail `pip install` on those systems; the
# workaround is in csrc/fsd/numerics.h (Dist::log_prob_float), and this check keeps it honest.
# Per GCC release: the CPU kernels, test_core, test_quant_gemm and test_skinny_gemm with setup.py's cxx_flags, both run; then
# every CUDA kernel through nvcc with GCC 13 as the host compiler (PTX for sm_90 only, no ptxas:
# the host code is what GCC compiles, and it does not depend on the architecture).
#
# The compilers live in a Debian 13 (trixie) root made once with debootstrap from Debian's
# package registry; it needs root (chroot, a read-only bind mount of the CUDA toolkit, CUDA_HOME or /usr/local/cuda).
#
#   scripts/check_host_compilers.sh   # FSD_GCC_ROOT (/var/tmp/fsd-ext-gcc-root), FSD_GCC_VERSIONS ("13 14")
#
# Exit status: 0 ok, 1 a compile error or a failed test, 2 cannot run here (not root, no debootstrap).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GCC_ROOT="${FSD_GCC_ROOT:-/var/tmp/fsd-ext-gcc-root}"
VERSIONS="${FSD_GCC_VERSIONS:-13 14}"
NVCC_HOST_GCC="${VERSIONS%% *}"
LOG="$ROOT/build/host-compilers"
mkdir -p "$LOG"

if [[ "$(id -u)" != 0 ]]; then echo "check_host_compilers: needs root (debootstrap, chroot)" >&2; exit 2; fi
if ! command -v debootstrap >/dev/null; then  # with the package lists the machine has, else fresh ones
  { apt-get install -y -q debootstrap || { apt-get update -q && apt-get install -y -q debootstrap; }; } >"$LOG/apt.log" 2>&1 \
    || { tail -n 20 "$LOG/apt.log"; exit 2; }
fi

in_root() { chroot "$GCC_ROOT" /usr/bin/env -i PATH=/usr/bin:/bin bash -c "$1"; }

# The Debian 13 root and its compilers (kept between runs; rebuilt if a compiler is missing).
missing=""
for v in $VERSIONS; do [[ -x "$GCC_ROOT/usr/bin/g++-$v" ]] || missing="$missing g++-$v"; done
if [[ -n "$missing" ]]; then
  echo "== making a Debian 13 root in $GCC_ROOT for:$missing"
  if [[ ! -x "$GCC_ROOT/usr/bin/apt-get" ]]; then
    rm -rf "$GCC_ROOT"
    debootstrap --variant=minbase trixie "$GCC_ROOT" http://deb.debian.org/debian >"$LOG/debootstrap.log" 2>&1 \
      || { tail -n 20 "$LOG/debootstrap.log"; exit 1; }
  fi
  in_root "apt-get update -q && apt-get install -y -q --no-install-recommends$missing" >"$LOG/apt-root.log" 2>&1 \
    || { tail -n 20 "$LOG/apt-root.log"; exit 1; }
fi

# The sources, copied in (the root sees nothing of the host's files).
rm -rf "$GCC_ROOT/src" && mkdir -p "$GCC_ROOT/src" && cp -r "$ROOT/csrc" "$GCC_ROOT/src/csrc"
FLAGS="$(cd "$ROOT" && python3 -c 'import sys; sys.path.insert(0, "scripts"); from check_cpu_vectorization import setup_cxx_flags; print(" ".join(setup_cxx_flags()))') -fopenmp"  # setup.py adds -fopenmp on Linux
echo "== cxx_flags (setup.py): $FLAGS"

status=0
for v in $VERSIONS; do
  echo "== $(in_root "g++-$v --version | head -n 1")"
  objs=""
  for src in csrc/fsd/cpu/*.cpp csrc/cpu_linear/skinny_gemm.cpp csrc/cpu_linear/quant_gemm.cpp; do
    obj="/tmp/$(basename "$src" .cpp).gcc$v.o"
    if ! in_root "cd /src && g++-$v $FLAGS -fPIC -Icsrc -c $src -o $obj" >"$LOG/gcc$v-$(basename "$src").log" 2>&1; then
      echo "FAILED: g++-$v on $src"; head -n 30 "$LOG/gcc$v-$(basename "$src").log"; status=1
    fi
    objs="$objs $obj"
  done
  for test in fsd/tests/test_core cpu_linear/tests/test_quant_gemm cpu_linear/tests/test_skinny_gemm; do
    if (( status == 0 )) && ! in_root "cd /src && g++-$v $FLAGS -Icsrc -Icsrc/fsd/tests csrc/$test.cpp $objs -o /tmp/${test##*/}.gcc$v && /tmp/${test##*/}.gcc$v" \
        >"$LOG/gcc$v-${test##*/}.log" 2>&1; then
      echo "FAILED: $test built by g++-$v"; tail -n 30 "$LOG/gcc$v-${test##*/}.log"; status=1
    fi
    (( status == 0 )) && echo "   CPU kernels compile; $(tail -n 1 "$LOG/gcc$v-${test##*/}.log")"
  done
done

# The CUDA kernels with GCC $NVCC_HOST_GCC as nvcc's host compiler: the toolkit bind-mounted
# read-only into the root, at its own path, for the duration (and unmounted on any exit).
CUDA_DIR="$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")"
if [[ -x "$CUDA_DIR/bin/nvcc" ]]; then
  NVCC="$CUDA_DIR/bin/nvcc"
  mkdir -p "$GCC_ROOT$CUDA_DIR"
  mount --bind "$CUDA_DIR" "$GCC_ROOT$CUDA_DIR"
  trap 'umount "$GCC_ROOT$CUDA_DIR"' EXIT
  mount -o remount,bind,ro "$GCC_ROOT$CUDA_DIR"
  echo "== nvcc $("$NVCC" --version | tail -n 2 | head -n 1), host compiler g++-$NVCC_HOST_GCC"
  pids=() names=()
  for src in "$ROOT"/csrc/fsd/cuda/*.cu; do
    name="$(basename "$src" .cu)"
    ( in_root "cd /src && $NVCC -ccbin g++-$NVCC_HOST_GCC -std=c++17 -O3 --expt-relaxed-constexpr \
        -Icsrc -gencode arch=compute_90,code=compute_90 -c csrc/fsd/cuda/$name.cu -o /tmp/$name.o" \
        >"$LOG/nvcc-gcc$NVCC_HOST_GCC-$name.log" 2>&1 ) &
    pids+=("$!") names+=("$name")
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      echo "FAILED: nvcc (g++-$NVCC_HOST_GCC) on ${names[$i]}.cu"; head -n 30 "$LOG/nvcc-gcc$NVCC_HOST_GCC-${names[$i]}.log"; status=1
    fi
  done
  (( status == 0 )) && echo "   CUDA kernels compile: ${names[*]}"
else
  echo "== no CUDA toolkit at $CUDA_DIR: CUDA kernels not compiled with g++-$NVCC_HOST_GCC"
fi
exit "$status"
