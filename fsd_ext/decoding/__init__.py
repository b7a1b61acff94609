"""fsd-ext's decoding loop over a pair of Hugging Face causal LMs (docs/generate.md):

    loop.py          generate(): draft, verify with fsd_ext.accept, commit, per step
    draft_length.py  the draft-length policies (POLICIES): how many drafts a row proposes
    checks.py        the argument checks (check_options runs before any model loads)
    model.py         one model in a call: its static KV cache, CUDA graphs and forward times
    kv_cache.py      the static KV cache, rows of their own lengths
    prompt_cache.py  PromptCache: a prompt's cache entries reused by the next call on it
    cuda_graphs.py   the captured forwards, kept from call to call
    stats.py         what a call returns (GenerateOutput, GenerateStats)
    calibrate.py     calibrate(): the largest threshold within a deviation budget

fsd_ext.generate and fsd_ext.calibrate stay the import paths of the two entry points.
"""

from .prompt_cache import PromptCache

__all__ = ["PromptCache"]
