#!/usr/bin/env bash
# Compiles the torch binding of the CUDA kernels (csrc/torch/ops_cuda.cpp: input checks, workspace,
# launches) against the headers of a CUDA build of torch, with no GPU and without installing that
# torch: the wheel is downloaded (pip download, no install) and only its include/ folder unpacked;
# the host compiler checks the file (C++20, as torch's headers require; the CUDA runtime headers
# from the toolkit that nvcc belongs to). CI's CPU build never compiles this file, and
# scripts/check_cuda_compile.sh compiles the kernels without torch: this covers the code between.
#
#   scripts/check_cuda_binding.sh     # TORCH_CUDA_WHEEL (default 2.14.1), PYTHON, CXX, NVCC override
#
# Exit status: 0 ok, 1 compile error, 2 a tool or the wheel missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
CXX_BIN="${CXX:-c++}"
VERSION="${TORCH_CUDA_WHEEL:-2.14.1}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [[ ! -x "$NVCC" ]]; then echo "check_cuda_binding: nvcc not found (set NVCC=...)" >&2; exit 2; fi
# The toolkit's headers, where nvcc itself finds them (nvcc may be a wrapper script elsewhere).
CUDA_INCLUDE="$("$NVCC" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^" ]*\).*/\1/p' | head -n 1)"
if [[ ! -f "$CUDA_INCLUDE/cuda_runtime_api.h" ]]; then
  echo "check_cuda_binding: no cuda_runtime_api.h where nvcc looks ($CUDA_INCLUDE)" >&2
  exit 2
fi
OUT="$ROOT/build/cuda-binding"
mkdir -p "$OUT"

headers="$OUT/torch-$VERSION"
if [[ ! -f "$headers/torch/include/c10/cuda/CUDAGuard.h" ]]; then
  rm -rf "$OUT/wheel" "$headers"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "torch==$VERSION" -d "$OUT/wheel" ||
    { echo "check_cuda_binding: could not download torch==$VERSION" >&2; exit 2; }
  wheel=$(ls "$OUT"/wheel/torch-*.whl)
  "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('torch/include/')])" \
    "$wheel" "$headers"
  rm -rf "$OUT/wheel"
fi
if [[ ! -f "$headers/torch/include/c10/cuda/CUDAGuard.h" ]]; then
  echo "check_cuda_binding: torch==$VERSION has no CUDA headers (a CPU build?)" >&2
  exit 2
fi

python_include="$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
echo "== $("$CXX_BIN" --version | head -n 1); torch $VERSION headers; CUDA headers $CUDA_INCLUDE"
for src in "$ROOT"/csrc/torch/ops_cuda.cpp; do
  "$CXX_BIN" -std=c++20 -fsyntax-only -Wall -Werror -Wno-unused-parameter \
    -isystem "$headers/torch/include" -isystem "$headers/torch/include/torch/csrc/api/include" \
    -isystem "$CUDA_INCLUDE" -isystem "$python_include" -I"$ROOT/csrc" "$src"
  echo "ok: ${src#"$ROOT"/}"
done
