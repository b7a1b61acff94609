"""The library's import surface (the evaluation harness, fsd_ext.bench, stays out of it) and the
examples the docs print in full."""

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


def test_the_vllm_example_in_the_docs_is_the_file():
    """docs/engines.md prints examples/vllm_fsd.py (from `import os` on): they must not drift."""
    with open(os.path.join(ROOT, "examples", "vllm_fsd.py")) as handle:
        example = handle.read()
    with open(os.path.join(ROOT, "docs", "engines.md")) as handle:
        docs = handle.read()
    code = example[example.index("import os"):]
    assert f"```python\n{code}```" in docs
