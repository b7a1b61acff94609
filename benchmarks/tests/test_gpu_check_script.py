"""A dry run of benchmarks/gpu_check.sh with stand-ins for Python, nvcc and the C++ compiler.

The script only ever runs on a lent GPU machine, whose minutes are few: a shell mistake in it (an
unset variable under `set -u`, a step that stops the rest, a flag not passed on) would cost a whole
GPU session. Here every step runs against stubs that log their arguments, so the orchestration is
checked on any machine: which commands run in which order with which flags, what the summary says,
what lands in $OUT, and that a failing step is reported without stopping the steps after it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Python stand-in: logs its arguments (and the launch options set) and plays each step's part.
# FAIL_CLUSTER=1: the opt-in paths' pytest run fails a cluster test.
PYTHON_STUB = r"""#!/usr/bin/env bash
echo "python $* [LAUNCH=${FSD_EXT_CUDA_LAUNCH:-}]" >>"$STUB_LOG"
case "$*" in
  "-c import fsd_ext.ops as o; o._ops()") exit 1 ;;  # no prebuilt extension
  "-c import pytest_timeout") exit 1 ;;
  "-m pytest"*)
    if [[ "$*" == *"pdl or cluster"* && "${FAIL_CLUSTER:-}" == 1 ]]; then
      echo "FAILED tests/test_cuda_launch.py::test_cluster_path_agrees_with_reference[b1_v151936_bf16-fsd]"; exit 1
    fi
    echo "3 passed" ;;
  "benchmarks/bench_accept_cuda.py"*) echo "target B64 bf16 >= 80% copy BW: NOT MET" ;;
esac
exit 0
"""

# nvcc stand-in: a version line, or an executable at the path after -o (the step timer's binaries).
NVCC_STUB = r"""#!/usr/bin/env bash
echo "nvcc $*" >>"$STUB_LOG"
if [[ "$1" == --version ]]; then printf 'nvcc stub\nCuda compilation tools, release 0.0\nend\n'; exit 0; fi
while (( $# )); do
  if [[ "$1" == -o ]]; then printf '#!/usr/bin/env bash\necho "| harness %s |"\n' "$2" >"$2"; chmod +x "$2"; fi
  shift
done
"""

CXX_STUB = """#!/usr/bin/env bash
echo "cxx $*" >>"$STUB_LOG"
[[ "$1" == --version ]] && echo "c++ stub 1.0"
exit 0
"""


def dry_run(tmp_path, **env):
    """(exit status, summary.txt, the stubs' log, $OUT) of one dry run of gpu_check.sh."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    for name, text in (("python", PYTHON_STUB), ("nvcc", NVCC_STUB), ("cxx", CXX_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "stubs.log"
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python"),
                    NVCC=str(bin_dir / "nvcc"), CXX=str(bin_dir / "cxx"), OUT=str(out),
                    GPU_CHECK_BUILD=str(tmp_path / "build"), GPU_CHECK_SKIP="decode ncu sanitizer",
                    STUB_LOG=str(log), **env)
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=full_env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return result.returncode, summary, log.read_text().splitlines(), out, result.stdout + result.stderr


needs_tools = pytest.mark.skipif(not all(shutil.which(t) for t in ("bash", "timeout", "tar", "sha256sum")),
                                 reason="needs bash, timeout, tar and sha256sum")


@needs_tools
def test_gpu_check_runs_every_step_in_order(tmp_path):
    rc, summary, calls, out, output = dry_run(tmp_path)
    assert rc == 0, output
    for step in ("build: ok", "one accept call on the GPU: ok", "CUDA tests: ok",
                 "CUDA tests, opt-in paths (cluster, PDL): ok", "kernel benchmark: ok",
                 "step timer and phase tracer: ok", "sampling benchmark: ok",
                 "C++ compile of csrc/fsd/cpu: ok (c++ stub 1.0)", "decode benchmark skipped",
                 "ncu profile skipped", "compute-sanitizer memcheck skipped"):
        assert step in summary, (step, summary)
    assert "target B64 bf16 >= 80% copy BW: NOT MET" in summary  # the benchmark's verdicts reach the summary
    python_calls = [c for c in calls if c.startswith("python ")]

    def index(fragment):
        return next(i for i, c in enumerate(python_calls) if fragment in c)

    # Build, tests, then the opt-in paths' tests (their fixtures set the launch options), then both
    # benchmarks, which time every opt-in path against the planner's.
    tests = "-m pytest -m cuda tests/test_cuda.py tests/test_cuda_launch.py tests/test_accept.py -k"
    assert index("setup.py build_ext --inplace") < index(f"{tests} not (pdl or cluster)")
    opt_in = python_calls[index(f"{tests} pdl or cluster")]
    assert opt_in.endswith("[LAUNCH=]") and all(c.endswith("[LAUNCH=]") for c in python_calls)
    bench = python_calls[index("benchmarks/bench_accept_cuda.py")]
    assert "--variants splits=1 splits=8 splits=32 reverse=1 pdl=1 cluster=1 " in bench
    assert index("-k pdl or cluster") < index("bench_accept_cuda.py") < index("bench_sample_cuda.py")
    # The step timer was built with nvcc (the stand-in) for sm_90, and ran with its options.
    assert any(c.startswith("nvcc ") and "arch=compute_90" in c and "accept_trace.cu" in c for c in calls)
    assert (out / "accept_timing.md").read_text().startswith("| harness ")
    with tarfile.open(out / "gpu_check.tgz") as archive:
        names = set(archive.getnames())
    assert {"./summary.txt", "./test_cuda.log", "./bench.log", "./bench_sample.log", "./cxx.log"} <= names
    assert len(list(out.iterdir())) <= 8  # the device tool returns at most 8 files


@needs_tools
def test_gpu_check_reports_a_failed_step_and_goes_on(tmp_path):
    """A cluster test failing: the summary names it, the status is 1, the benchmark still runs, without
    the cluster variant but with the PDL one (its tests passed)."""
    rc, summary, calls, _, output = dry_run(tmp_path, FAIL_CLUSTER="1")
    assert rc == 1, output
    assert "CUDA tests, opt-in paths (cluster, PDL): FAILED (rc 1)" in summary
    assert "FAILED tests/test_cuda_launch.py::test_cluster_path_agrees_with_reference[b1_v151936_bf16-fsd]" in summary
    assert "cluster=1 failed its tests" in summary
    bench = next(c for c in calls if "bench_accept_cuda.py" in c)
    assert "--variants splits=1 splits=8 splits=32 reverse=1 pdl=1 [" in bench
    assert "sampling benchmark: ok" in summary and "step timer and phase tracer: ok" in summary
