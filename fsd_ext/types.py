"""Result types and the names that the public ops accept (shared by the kernels' front end and the
pure-torch reference, so both speak the same vocabulary)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# Index = the integer the C++ core uses (csrc/fsd/common.h). Never reorder.
RULES = ("greedy", "sd", "fsd", "fsd_strict")
DIVERGENCES = ("kl", "rkl", "js", "tv", "mkl")

# Random streams (csrc/fsd/common.h: Purpose).
PURPOSE_ACCEPT = 1
PURPOSE_SAMPLE = 2
PURPOSE_DRAFT = 3


class AcceptResult(NamedTuple):
    """What one verification step returns, per batch row b.

    tokens:       [B, K+1] int64. The accepted drafts, then the correction or bonus token, then -1.
    num_accepted: [B] int64 in [0, num_draft[b]]; the correction/bonus token is not counted.
    valid:        [B] bool. False when the row's logits hold NaN or a vocabulary row has no finite
                  logit; such a row emits nothing (tokens all -1, num_accepted 0).
    divergence:   [B, K] float32 D_i (NaN past num_draft[b] and on invalid rows), or None.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    valid: torch.Tensor
    divergence: Optional[torch.Tensor]
