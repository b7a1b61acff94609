"""fsd-ext: Fuzzy Speculative Decoding for PyTorch.

Fused CPU/CUDA kernels for the verification step (`accept`), the divergences (`divergence`), sampling
(`sample`) and their Philox random streams (`philox_uniforms`), plus a pure-torch reference
(`fsd_ext.reference`) that is the executable spec of all of them, and `generate`, the AR/SD/FSD
decoding loop over a pair of Hugging Face causal LMs.
"""

from . import reference
from .generate import GenerateOutput, GenerateStats, generate
from .ops import accept, divergence, philox_uniforms, sample
from .types import DIVERGENCES, RULES, AcceptResult

__version__ = "0.1.0"
__all__ = ["accept", "divergence", "sample", "philox_uniforms", "reference", "AcceptResult",
           "RULES", "DIVERGENCES", "generate", "GenerateOutput", "GenerateStats"]
