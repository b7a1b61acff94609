"""What a generate() call returns: the sequences and the counts and times of its work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch


def seconds_per_decode_forward(seconds: float, prompt_seconds: float, forwards: int,
                               prompts: int = 1) -> float:
    """A model's mean seconds per forward after its prompt forwards: `forwards` calls took `seconds`,
    `prompts` of them the prompt forwards' `prompt_seconds` (0.0 when no other forward ran). Shared
    by GenerateStats and the bench summary, which pools it over decodes."""
    decode_forwards = forwards - prompts
    return (seconds - prompt_seconds) / decode_forwards if decode_forwards > 0 else 0.0


@dataclass
class RowCounts:
    """One batch row's share of GenerateStats' counts (they sum to the totals)."""

    new_tokens: int = 0
    verifications: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    sd_rejected_accepted: Optional[int] = None


@dataclass
class GenerateStats:
    """What a generate() call did. Counts are of model calls (one call = one forward of the batch)."""

    rule: str
    num_draft_tokens: int
    new_tokens: int = 0  # generated tokens, all rows together
    seconds: float = 0.0  # wall time of the whole call, less diagnostics_seconds
    diagnostics_seconds: float = 0.0  # counting sampled SD rejections (output_divergences=True)
    prefill_seconds: float = 0.0  # the prompt forwards of both models (inside seconds)
    target_prefill_seconds: float = 0.0  # the target's part of prefill_seconds
    prefill_reused: bool = False  # a prompt forward was loaded from a PromptCache, not run
    capture_seconds: float = 0.0  # CUDA graph warm-ups and captures, both models (inside seconds)
    target_forwards: int = 0  # prefill included
    target_seconds: float = 0.0  # in the target's forwards (on CUDA GPU time; captures not included)
    draft_forwards: int = 0
    draft_seconds: float = 0.0  # in the draft's forwards (on CUDA GPU time; captures not included)
    verifications: int = 0  # target verification calls x rows verified (row-steps)
    drafted_tokens: int = 0  # drafts the rows proposed for verification, all row-steps together
    accepted_drafts: int = 0  # accepted drafts kept in the output (none past a row's end)
    # Kept accepted drafts that plain SD would have rejected (0 for sd by definition; None for ar):
    # greedy decoding, drafts that are not the target's argmax; sampling (only with
    # output_divergences=True, else None), drafts whose step coin fails SD's test u q(d) <= p(d),
    # the same Philox coin the accept call drew.
    sd_rejected_accepted: Optional[int] = None
    accepted_histogram: List[int] = field(default_factory=list)  # [K+1]: row-steps accepting n
    divergences: Optional[List[torch.Tensor]] = None  # per step, [B_active, K] float32
    rows: List[RowCounts] = field(default_factory=list)  # [B]: the counts above, per input row

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens/s without the prompt forwards (which dominate short outputs on a CPU) and the
        CUDA graph captures (a one-time cost per call and shape)."""
        seconds = self.seconds - self.prefill_seconds - self.capture_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean drafts accepted per row and target call (0..K; the correction/bonus not counted)."""
        return self.accepted_drafts / self.verifications if self.verifications else 0.0

    @property
    def mean_drafted(self) -> float:
        """Mean drafts a row proposed per target call (K under draft_length="fixed", until rows
        near max_new_tokens draft fewer)."""
        return self.drafted_tokens / self.verifications if self.verifications else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """A draft forward's time over a target verification's, prompt forwards left out: the
        `draft_cost` that draft_length="acceptance" assumes, as measured (0 without drafts)."""
        per_draft = seconds_per_decode_forward(
            self.draft_seconds, self.prefill_seconds - self.target_prefill_seconds, self.draft_forwards)
        per_target = seconds_per_decode_forward(
            self.target_seconds, self.target_prefill_seconds, self.target_forwards)
        return per_draft / per_target if per_target > 0 else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Mean tokens a row gains per target call (mean_accepted + 1 until rows stop early)."""
        return self.new_tokens / self.verifications if self.verifications else 0.0

    def summary(self) -> str:
        return (f"{self.rule}: {self.new_tokens} tokens in {self.seconds:.2f} s = "
                f"{self.tokens_per_second:.2f} tokens/s, {self.tokens_per_target_call:.2f} tokens and "
                f"{self.mean_accepted:.2f} accepted of {self.mean_drafted:.2f} drafted per target call "
                f"(target {self.target_forwards} calls {self.target_seconds:.2f} s, "
                f"draft {self.draft_forwards} calls {self.draft_seconds:.2f} s"
                + (f", graph captures {self.capture_seconds:.2f} s)" if self.capture_seconds else ")"))


@dataclass
class GenerateOutput:
    """sequences: [B, P + N] int64, the (left-padded) prompts then the generated tokens, padded with
    the pad id after a row's EOS or last token. stats: GenerateStats."""

    sequences: torch.Tensor
    stats: GenerateStats
