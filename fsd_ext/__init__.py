"""fsd-ext: Fuzzy Speculative Decoding kernels and decoding loop for PyTorch."""
from . import reference
from .types import AcceptResult, DIVERGENCES, RULES
from .generate import GenerateOutput, GenerateStats, generate
