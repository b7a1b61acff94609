"""fsd_ext.generate, the import path of the decoding loop, which lives in fsd_ext/decoding/ (loop.py
the loop, checks.py its argument checks, stats.py what it returns)."""

from .decoding.checks import check_options, check_pair, check_tokenizers  # noqa: F401
from .types import GENERATE_RULES  # noqa: F401
from .decoding.loop import generate  # noqa: F401
from .decoding.stats import GenerateOutput, GenerateStats, seconds_per_decode_forward  # noqa: F401
