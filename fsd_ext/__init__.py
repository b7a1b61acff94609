"""fsd-ext: Fuzzy Speculative Decoding for PyTorch.

Fused CPU/CUDA kernels for the verification step (`accept`), the divergences (`divergence`), sampling
(`sample`) and their Philox random streams (`philox_uniforms`), plus a pure-torch reference
(`fsd_ext.reference`) that is the executable spec of all of them, and `generate`, the AR/SD/FSD
decoding loop over a pair of Hugging Face causal LMs, and `calibrate`, which picks its threshold.
"""

from importlib import metadata as _metadata

from . import reference
from .calibrate import Calibration, calibrate
from .decoding.cuda_graphs import release_cuda_graphs
from .generate import GenerateOutput, GenerateStats, generate
from .ops import accept, divergence, philox_uniforms, sample
from .types import DIVERGENCES, LENIENT_RULES, RULES, AcceptResult

try:  # one source of the version: pyproject.toml, through the installed metadata
    __version__ = _metadata.version("fsd-ext")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "unknown"


def __getattr__(name):
    # fsd_ext.hf imports transformers, which `import fsd_ext` should not pay for: loaded on first use.
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["accept", "divergence", "sample", "philox_uniforms", "reference", "AcceptResult",
           "RULES", "LENIENT_RULES", "DIVERGENCES", "generate", "GenerateOutput", "GenerateStats", "release_cuda_graphs",
           "calibrate", "Calibration"]
