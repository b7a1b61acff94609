"""Threshold calibration: the largest FSD threshold T whose output stays within a budget of exact SD.

FSD departs from SD only where it accepts a draft that SD would have rejected: under greedy decoding
an accepted draft that is not the target's argmax, under sampling one whose step coin fails SD's
test u q(d) <= p(d) (generate's stats.sd_rejected_accepted; docs/generate.md). calibrate() decodes
a set of prompts one by one at rising thresholds and keeps the largest T whose share of such drafts
among all accepted drafts, pooled over the prompts, is at most max_deviation.

The hybrid rules' share tends to grow with T, so their walk goes up: candidates in ascending order,
the first one over budget ends it. A strict rule's share need not (a small T keeps few drafts, and
those may be mostly SD-rejected ones), so its walk comes down from the lenient end and the first
candidate within budget ends it. `refine_steps` bisections then narrow the bracket between that
candidate within budget (for a hybrid rule whose first candidate is over: T = 0, SD itself) and its
neighbour over it. The answer is always a threshold measured within budget (or 0: SD itself for the
hybrid rules), whatever the measurements do.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from .loop import generate
from .prompt_cache import PromptCache
from ..types import (DIVERGENCE_TABLE, LENIENT_RULES, VerifyOptions, check_threshold, rule_spec,
                     threshold_grids)

# Default candidates per divergence (fsd_ext.types.DIVERGENCE_TABLE): doubling grids inside each
# divergence's range (js <= ln 2, tv <= 1; kl, rkl and mkl are unbounded: up to 6.4 nats). The other
# lenient rules have their own (types.RULE_TABLE; types.threshold_grids picks).
CALIBRATION_GRID: Dict[str, tuple] = {d.name: d.calibration_grid for d in DIVERGENCE_TABLE}
CALIBRATE_RULES = LENIENT_RULES
WALKS = ("up", "down")  # from the exact end (T small) or from the lenient end (T large)
# generate() arguments that calibrate sets itself.
_OWN_ARGS = ("threshold", "output_divergences", "input_ids", "attention_mask", "prompt_cache")


@dataclass
class CalibrationPoint:
    """The calibration prompts decoded at one threshold, their statistics pooled."""

    threshold: float
    accepted_drafts: int
    sd_rejected_accepted: int  # accepted drafts SD would have rejected
    share: float  # sd_rejected_accepted / accepted_drafts (0 when nothing was accepted)
    new_tokens: int
    target_calls: int  # target forwards, prefill included
    tokens_per_target_call: float  # new tokens per verification (row-step), as GenerateStats
    decode_seconds: float  # generate's time less the prompt forwards (shared) and the SD-rejection replay
    refined: bool = False  # a bisection point, not a grid candidate


@dataclass
class Calibration:
    """calibrate()'s answer: `threshold` and the share `deviation` measured at it (0 at T = 0,
    unless 0 is a candidate), the search's settings, and every point it measured, in order."""

    threshold: float
    deviation: float
    max_deviation: float
    divergence: str
    rule: str
    temperature: float
    num_prompts: int
    points: List[CalibrationPoint] = field(default_factory=list)

    def summary(self) -> str:
        """The measured points as a table, then the chosen threshold."""
        head = (f"{self.rule} {self.divergence}, "
                f"{'greedy' if self.temperature == 0 else f'temperature {self.temperature:g}'}, "
                f"{self.num_prompts} prompts")
        return (head + "\n" + format_points(self.points, self.max_deviation) + "\n"
                + f"max deviation {self.max_deviation:.2%}: T = {self.threshold:.6g} "
                  f"(measured {self.deviation:.2%})")

    def to_dict(self) -> dict:
        return asdict(self)


def format_points(points: Sequence[CalibrationPoint], max_deviation: Optional[float] = None) -> str:
    """A table of measured points, ascending in T; with max_deviation, whether each is within it."""
    lines = [f"{'T':>9} {'accepted':>9} {'SD-rejected':>12} {'share':>8} {'tokens':>7} "
             f"{'target calls':>13} {'tokens/call':>12} {'decode s':>8}"
             + ("  budget" if max_deviation is not None else "")]
    for p in sorted(points, key=lambda p: p.threshold):
        mark = "" if max_deviation is None else ("  within" if p.share <= max_deviation else "  over")
        lines.append(f"{p.threshold:>9.6g} {p.accepted_drafts:>9} {p.sd_rejected_accepted:>12} "
                     f"{p.share:>8.2%} {p.new_tokens:>7} {p.target_calls:>13} "
                     f"{p.tokens_per_target_call:>12.2f} {p.decode_seconds:>8.2f}"
                     + mark + (" (refined)" if p.refined else ""))
    return "\n".join(lines)


def _measure(target, draft, prompts: List[torch.Tensor], threshold: float, seed: int,
             generate_kwargs: dict) -> CalibrationPoint:
    """Decode every prompt at `threshold` (prompt i with seed + i, the same at every threshold) and
    pool the counts."""
    accepted = rejected = new_tokens = target_calls = verifications = 0
    decode_seconds = 0.0
    for index, input_ids in enumerate(prompts):
        stats = generate(target, draft, input_ids, threshold=threshold, seed=seed + index,
                         **generate_kwargs).stats
        if stats.sd_rejected_accepted is None:  # generate counts them for these settings
            raise RuntimeError("generate did not count the drafts SD would have rejected")
        accepted += stats.accepted_drafts
        rejected += stats.sd_rejected_accepted
        new_tokens += stats.new_tokens
        target_calls += stats.target_forwards
        verifications += stats.verifications
        decode_seconds += stats.seconds - stats.prefill_seconds - stats.capture_seconds
    return CalibrationPoint(threshold=threshold, accepted_drafts=accepted,
                            sd_rejected_accepted=rejected,
                            share=rejected / accepted if accepted else 0.0,
                            new_tokens=new_tokens, target_calls=target_calls,
                            tokens_per_target_call=new_tokens / verifications if verifications else 0.0,
                            decode_seconds=decode_seconds)


def _search(measure: Callable[[float, bool], CalibrationPoint], grid: Sequence[float], budget: float,
            refine_steps: int, walk: str, hybrid: bool) -> tuple:
    """-> (threshold, deviation, points in the order measured) for one budget. walk "up": ascending
    from the exact end, the first candidate over budget ends it; "down": descending from the lenient
    end, the first candidate within budget ends it. Either way the bisections then narrow the bracket
    between the candidate within budget and its neighbour over it; for a hybrid rule T = 0 (SD, share
    0) is within budget without a measurement, so a first candidate over budget is bisected towards 0."""
    points, high = [], None
    low = 0.0 if hybrid and walk == "up" else None
    low_share = 0.0
    for threshold in (grid if walk == "up" else reversed(grid)):
        point = measure(threshold, False)
        points.append(point)
        if point.share > budget:
            high = threshold
            if walk == "up":
                break
        else:
            low, low_share = threshold, point.share
            if walk == "down":
                break
    if low is not None and high is not None and high > low:
        for _ in range(refine_steps):
            point = measure((low + high) / 2, True)
            points.append(point)
            if point.share <= budget:
                low, low_share = point.threshold, point.share
            else:
                high = point.threshold
    return (0.0, 0.0, points) if low is None else (low, low_share, points)


def _prompt_tensor(prompt, index: int, device) -> torch.Tensor:
    """One prompt (a 1-D int tensor or a list of ints) -> [1, P] int64 on `device`."""
    if isinstance(prompt, torch.Tensor):
        ok = prompt.dim() == 1 and not prompt.is_floating_point() and not prompt.is_complex() \
            and prompt.dtype != torch.bool
    else:
        ok = isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
    if not ok or len(prompt) == 0:
        raise ValueError(f"prompts[{index}] must be a non-empty 1-D sequence of token ids (a 1-D int "
                         f"tensor or a list of ints), got {prompt!r:.80}")
    return torch.as_tensor(prompt, dtype=torch.int64).reshape(1, -1).to(device)


def _check_fraction(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a float in [0, 1], got {value!r}")
    return float(value)


def check_calibrate_options(*, rule, divergence, max_deviation, thresholds, temperature,
                            refine_steps, seed, walk=None):
    """calibrate()'s own options (no model needed; the command line checks them before loading)
    -> (budgets, sorted threshold grid, walk); raises ValueError."""
    VerifyOptions(rule, divergence, threshold=0.0).check(rules=CALIBRATE_RULES)
    if walk is None:
        walk = "down" if rule_spec(rule).strict else "up"
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {', '.join(WALKS)} or None, got {walk!r}")
    several = isinstance(max_deviation, Sequence) and not isinstance(max_deviation, str)
    budgets = list(max_deviation) if several else [max_deviation]
    if not budgets:
        raise ValueError("max_deviation must be a float in [0, 1] or a non-empty list of them")
    budgets = [_check_fraction(b, "max_deviation") for b in budgets]
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not 0.0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite float >= 0, got {temperature!r}")
    if isinstance(refine_steps, bool) or not isinstance(refine_steps, numbers.Integral) \
            or refine_steps < 0:
        raise ValueError(f"refine_steps must be an int >= 0, got {refine_steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int, got {seed!r}")
    grid = threshold_grids(rule, divergence)[0] if thresholds is None else list(thresholds)
    if not grid:
        raise ValueError("thresholds must be a non-empty list of finite floats >= 0")
    for t in grid:
        check_threshold(t, "each of thresholds", per_row=False)
        if t == math.inf:
            raise ValueError(f"thresholds must be finite (calibration compares them), got {thresholds!r}")
    grid = sorted({float(t) for t in grid})
    return budgets, grid, walk


def calibrate(target, draft, prompts, *, divergence: str = "js",
              max_deviation: Union[float, Sequence[float]] = 0.02, rule: str = "fsd",
              thresholds: Optional[Sequence[float]] = None, temperature: float = 0.0,
              num_draft_tokens: int = 5, max_new_tokens: int = 128, refine_steps: int = 2,
              seed: int = 0, walk: Optional[str] = None, share_prompts: bool = True,
              on_point: Optional[Callable[[CalibrationPoint], None]] = None,
              **generate_kwargs) -> Union[Calibration, List[Calibration]]:
    """The largest threshold T whose share of accepted drafts that exact SD would have rejected,
    pooled over `prompts`, is at most `max_deviation`.

    Each prompt is decoded alone (batch 1) with fsd_ext.generate at each threshold tried. The
    candidates (`thresholds`, default types.threshold_grids(rule, divergence)) are walked up to the
    first whose share is over budget (walk "up"), or down to the first within it ("down"); then
    `refine_steps` bisections between the candidate within budget and its neighbour over it (for a
    hybrid rule T = 0, exactly SD with share 0, counts as within: a first candidate over budget is
    bisected towards it). The answer is always a threshold measured within budget, or 0.0 when none
    is (for the strict rules T = 0 accepts no draft). Cost:
    up to (candidates tried + refine_steps) x len(prompts) decodes.

    Under greedy decoding (temperature 0) the count is exact and free. Under sampling generate
    replays each step's coins (output_divergences=True, timed apart), and prompt i uses the seed
    seed + i at every threshold (common random numbers), so the candidates differ by T alone.

    Args:
        target, draft: Hugging Face causal LMs sharing a tokenizer, as for fsd_ext.generate.
        prompts: non-empty list of 1-D token-id sequences (int tensors or lists of ints), unpadded.
        divergence: one of fsd_ext.DIVERGENCES (fsd, fsd_strict). rule: one of fsd_ext.LENIENT_RULES
            (default "fsd"; docs/design.md 2.5).
        max_deviation: the budget, a float in [0, 1]; or a list of them, one search each sharing
            the decodes of the thresholds they have in common, which returns a list.
        thresholds: candidates (floats >= 0, finite) instead of the default grid.
        temperature, num_draft_tokens, max_new_tokens, seed: as in fsd_ext.generate.
        refine_steps: bisections after the grid walk (int >= 0).
        walk: "up" (from the exact end) or "down" (from the lenient end); None: "down" for the
            strict rules, whose share need not grow with T, "up" for the others.
        share_prompts: run each prompt's forwards once, at the first threshold, and load their
            keys and values at the others (decoding.PromptCache: the same tokens; holds a copy of
            both models' prompt entries per prompt during the call).
        on_point: called with each CalibrationPoint as it is measured (progress).
        **generate_kwargs: passed on to fsd_ext.generate (eos_token_id, top_p, div_temperature, ...).

    Returns:
        Calibration (threshold, deviation, points, settings; summary(), to_dict()).

    Example:
        >>> cal = fsd_ext.calibrate(target, draft, [tokenizer.encode(p) for p in texts],
        ...                         divergence="js", max_deviation=0.02, eos_token_id=eos)
        >>> print(cal.summary()); cal.threshold
    """
    budgets, grid, walk = check_calibrate_options(
        rule=rule, divergence=divergence, max_deviation=max_deviation, thresholds=thresholds,
        temperature=temperature, refine_steps=refine_steps, seed=seed, walk=walk)
    several = isinstance(max_deviation, Sequence) and not isinstance(max_deviation, str)
    reserved = sorted(set(generate_kwargs) & set(_OWN_ARGS))
    if reserved:
        raise ValueError(f"calibrate sets {', '.join(reserved)} itself: do not pass them")
    if isinstance(prompts, (torch.Tensor, str)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of 1-D token-id sequences")
    device = next(target.parameters()).device
    prompts = [_prompt_tensor(p, i, device) for i, p in enumerate(prompts)]

    generate_kwargs.update(rule=rule, divergence=divergence, temperature=float(temperature),
                           num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens,
                           output_divergences=temperature > 0,  # sampling: count SD's rejections
                           prompt_cache=PromptCache(len(prompts)) if share_prompts else None)
    measured: Dict[float, CalibrationPoint] = {}

    def measure(threshold: float, refined: bool) -> CalibrationPoint:
        if threshold not in measured:
            measured[threshold] = _measure(target, draft, prompts, threshold, int(seed), generate_kwargs)
            measured[threshold].refined = refined
            if on_point is not None:
                on_point(measured[threshold])
        return measured[threshold]

    results = []
    for budget in budgets:
        threshold, deviation, points = _search(measure, grid, budget, refine_steps, walk,
                                               hybrid=not rule_spec(rule).strict)
        results.append(Calibration(threshold=threshold, deviation=deviation, max_deviation=budget,
                                   divergence=divergence, rule=rule, temperature=float(temperature),
                                   num_prompts=len(prompts), points=points))
    return results if several else results[0]
