"""The library's import surface: the evaluation harness (fsd_ext.bench) stays out of it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_fsd_ext_does_not_load_the_bench_harness():
    # A fresh interpreter: this test session may have imported fsd_ext.bench already.
    code = ("import sys, fsd_ext, fsd_ext.cli; "
            "loaded = sorted(m for m in sys.modules if m.startswith('fsd_ext.bench')); "
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
