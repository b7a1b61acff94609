"""Checks of the CUDA sources that need no GPU (fast; the full nvcc compile is opt-in).

- csrc/fsd/cuda is framework-free: no torch / ATen / c10 header anywhere in it;
- the host launch header compiles with the host compiler alone (CUDA runtime headers only);
- FSD_CUDA_COMPILE_CHECK=1: scripts/check_cuda_compile.sh (nvcc for sm_80 and sm_90, resource
  report, no spills) passes; it takes a few minutes on two cores, so CI runs the script directly.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "fsd" / "cuda"


def cuda_include_dir():
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if nvcc:
        real = pathlib.Path(nvcc).resolve()
        candidates.append(str(real.parents[1]))
        # /usr/local/bin/nvcc may be a wrapper script: look for the exec line
        try:
            text = real.read_text(errors="ignore")
            candidates += re.findall(r"(/\S+?)/bin/nvcc", text)
        except OSError:
            pass
    for base in candidates:
        if base and (pathlib.Path(base) / "include" / "cuda_runtime.h").exists():
            return pathlib.Path(base) / "include"
    return None


def test_cuda_sources_are_framework_free():
    sources = sorted(CUDA_DIR.glob("*.cu")) + sorted(CUDA_DIR.glob("*.cuh")) + sorted(CUDA_DIR.glob("*.h"))
    assert sources, "no CUDA sources"
    for path in sources:
        for line in path.read_text().splitlines():
            m = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
            if m:
                header = m.group(1)
                assert not header.startswith(("torch/", "ATen/", "c10/", "pybind11/")), f"{path.name}: {header}"
                assert header.startswith(("fsd/", "cub/", "cuda_runtime", "c")) or "/" not in header, \
                    f"{path.name}: unexpected include {header}"


def test_launch_header_compiles_with_host_compiler(tmp_path):
    include = cuda_include_dir()
    cxx = shutil.which("g++") or shutil.which("c++")
    if include is None or cxx is None:
        pytest.skip("no CUDA runtime headers or no host compiler")
    source = tmp_path / "use_launch.cpp"
    source.write_text('#include "fsd/cuda/launch.h"\n'
                      "cudaError_t (*f)(const fsd::AcceptProblem&, const fsd::cuda::LaunchOptions&, void*, size_t, "
                      "cudaStream_t) = fsd::cuda::launch_accept;\nint main() { return f == nullptr; }\n")
    subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{ROOT / 'csrc'}", f"-I{include}", str(source)],
                   check=True)


@pytest.mark.skipif(os.environ.get("FSD_CUDA_COMPILE_CHECK") != "1",
                    reason="set FSD_CUDA_COMPILE_CHECK=1 (minutes: nvcc for sm_80 and sm_90)")
def test_cuda_compile_script(tmp_path):
    if not (shutil.which("nvcc") or os.environ.get("NVCC")):
        pytest.skip("no nvcc")
    env = dict(os.environ, FSD_CUDA_CHECK_DIR=str(tmp_path))
    result = subprocess.run([str(ROOT / "scripts" / "check_cuda_compile.sh")], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no spills" in result.stdout
