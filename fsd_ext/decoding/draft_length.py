"""Draft-length policies: how many drafts each row proposes in its next step (fsd_ext.generate's
draft_length=; docs/generate.md, "Draft length"). One object per generate() call keeps every
original row's state; the loop asks it for a row's cap before drafting, whether a row stops while
drafting, and tells it what each step accepted.

A new policy is a subclass registered in POLICIES: generate(), the command line and Hugging Face's
`num_assistant_tokens_schedule` mapping read its name from there."""

from __future__ import annotations

from typing import Dict, List, Type

import torch


class DraftLength:
    """"fixed": every row proposes K drafts per step (fewer only near max_new_tokens)."""

    name = "fixed"
    stops_early = False  # whether stops() is asked (it costs a softmax of the draft's logits a step)

    def __init__(self, k: int, rows: int, *, confidence: float = 0.4, cost: float = 0.25):
        self.k = k

    def cap(self, row: int) -> int:
        """The most drafts original row `row` proposes this step."""
        return self.k

    def stops(self, probability: torch.Tensor) -> List[bool]:
        """Where stops_early: given [B] the draft's probability of the token it just drafted, per
        slot whether the row stops drafting after it (the token is still verified)."""
        raise NotImplementedError

    def record(self, row: int, num_accepted: int, num_drafted: int) -> None:
        """What original row `row`'s step kept: num_accepted of its num_drafted drafts."""


class Confidence(DraftLength):
    """"confidence" (Hugging Face's assistant_confidence_threshold): a row stops drafting after a
    draft whose draft probability is below the threshold."""

    name = "confidence"
    stops_early = True

    def __init__(self, k: int, rows: int, *, confidence: float = 0.4, cost: float = 0.25):
        super().__init__(k, rows)
        self.threshold = confidence

    def stops(self, probability: torch.Tensor) -> List[bool]:
        return (probability < self.threshold).tolist()  # (a host sync)


def heuristic_draft_length(k: int, num_accepted: int, num_drafted: int, max_k: int) -> int:
    """draft_length="heuristic" (Hugging Face's assisted-generation schedule): a row's K grows by 2
    after a step that accepted every draft it proposed and shrinks by 1 otherwise, within [1, max_k]."""
    return min(max_k, k + 2) if num_accepted >= num_drafted else max(1, k - 1)


class Heuristic(DraftLength):
    """"heuristic": heuristic_draft_length, per row (Hugging Face keeps one K per call)."""

    name = "heuristic"

    def __init__(self, k: int, rows: int, *, confidence: float = 0.4, cost: float = 0.25):
        super().__init__(k, rows)
        self.row_k = [k] * rows

    def cap(self, row: int) -> int:
        return self.row_k[row]

    def record(self, row: int, num_accepted: int, num_drafted: int) -> None:
        self.row_k[row] = heuristic_draft_length(self.row_k[row], num_accepted, num_drafted, self.k)


def acceptance_draft_length(rate: float, max_k: int, draft_cost: float) -> int:
    """draft_length="acceptance": the K in [1, max_k] that maximises a row's expected tokens per
    unit of time when each draft is accepted with probability `rate` until the first rejection:
    (1 + rate + ... + rate^K) tokens for (1 + draft_cost * K) target-verification times. The
    smallest such K on ties."""
    best_k, best_value, expected_tokens, power = 1, -1.0, 1.0, 1.0
    for k in range(1, max_k + 1):
        power *= rate
        expected_tokens += power
        value = expected_tokens / (1.0 + draft_cost * k)
        if value > best_value + 1e-12:
            best_k, best_value = k, value
    return best_k


# A row's running estimate of its per-draft acceptance rate: decayed counts of (accepted, tested)
# drafts, starting from a prior worth a few steps at 0.75.
ACCEPTANCE_PRIOR = (3.0, 4.0)
ACCEPTANCE_DECAY = 0.8  # per step: the estimate follows the last ~5 steps


def update_acceptance(counts, num_accepted: int, num_drafted: int):
    """A row's decayed (accepted, tested) draft counts after a step. A rejection tests one draft
    more than were accepted; drafts after it are never tested, so they do not count."""
    accepted, tested = counts
    tested_now = num_accepted + (1 if num_accepted < num_drafted else 0)
    return (ACCEPTANCE_DECAY * accepted + num_accepted, ACCEPTANCE_DECAY * tested + tested_now)


class Acceptance(DraftLength):
    """"acceptance": acceptance_draft_length from the row's running acceptance rate and `cost`,
    a draft forward's time over a verification's."""

    name = "acceptance"

    def __init__(self, k: int, rows: int, *, confidence: float = 0.4, cost: float = 0.25):
        super().__init__(k, rows)
        self.cost = cost
        self.counts = [ACCEPTANCE_PRIOR] * rows

    def cap(self, row: int) -> int:
        accepted, tested = self.counts[row]
        return acceptance_draft_length(accepted / tested, self.k, self.cost)

    def record(self, row: int, num_accepted: int, num_drafted: int) -> None:
        self.counts[row] = update_acceptance(self.counts[row], num_accepted, num_drafted)


POLICIES: Dict[str, Type[DraftLength]] = {p.name: p for p in (DraftLength, Confidence, Heuristic, Acceptance)}
