"""Result types, the tables of rules and divergences that the public ops accept, and the one
check of a threshold (shared by the kernels' front end, the pure-torch reference, the decoding
loop, calibration, the engines and the command line, so all speak the same vocabulary)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch


class RuleSpec(NamedTuple):
    name: str
    # None (greedy, sd); "divergence" (fsd: D(p, q) < T); else the test of the other lenient rules
    # (docs/design.md 2.5; csrc/fsd/rules.h: Criterion). Lenient rules take a threshold T >= 0.
    criterion: Optional[str]
    strict: bool  # the test alone decides and the correction is a sample of p (else: test OR SD's coin)
    summary: str
    # The source's knob as a function of T, and the default grids of T (calibrate, bench frontier)
    # for rules whose criterion is not a divergence (those come from DIVERGENCE_TABLE).
    knob: str = ""
    calibration_grid: tuple = ()
    sweep_grid: tuple = ()


class DivergenceSpec(NamedTuple):
    name: str
    summary: str
    calibration_grid: tuple  # fsd_ext.calibrate's default candidates: doubling inside the range
    sweep_grid: tuple  # `fsd-ext bench frontier`'s default thresholds


_UNBOUNDED_GRID = (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)  # up to 6.4 nats
_TYPICAL_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
_TOP_K_GRID = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
_CASCADE_GRID = (0.125, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
# Index = the integer the C++ core uses (csrc/fsd/common.h). Never reorder. docs/design.md section 2.
RULE_TABLE = (
    RuleSpec("greedy", None, False, "keep d while it is the target's argmax"),
    RuleSpec("sd", None, False, "exact speculative sampling: keep d with probability min(1, p(d)/q(d))"),
    RuleSpec("fsd", "divergence", False, "keep d if SD would or D(p, q) < T; SD's residual at the first rejection"),
    RuleSpec("fsd_strict", "divergence", True, "keep d iff D(p, q) <= T; resample from p at the first rejection"),
    RuleSpec("typical", "typical", False, "keep d if SD would or p(d) > min(eps, sqrt(eps) exp(-H(p))) (Medusa)",
             "eps = 1 / T (Medusa's default eps 0.09: T = 11.1)", _TYPICAL_GRID, (1.0, 2.0, 4.0, 11.1, 32.0, 128.0)),
    RuleSpec("typical_strict", "typical", True, "keep d iff p(d) > min(eps, sqrt(eps) exp(-H(p))) (Medusa)",
             "eps = 1 / T", _TYPICAL_GRID, (1.0, 2.0, 4.0, 11.1, 32.0, 128.0)),
    RuleSpec("lenient_sd", "lenience", False, "keep d with probability min(1, p(d) / (l q(d))) (Leviathan et al.)",
             "l = exp(-T)", _UNBOUNDED_GRID, (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)),
    RuleSpec("prob_floor", "prob_floor", False, "keep d if SD would or p(d) > t (SGLang's threshold_single)",
             "t = exp(-T)", _UNBOUNDED_GRID, (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)),
    RuleSpec("rank", "rank", False, "keep d if SD would or d is among the k most likely ids of p (top-k lenience)",
             "k = T (d's rank < T)", _TOP_K_GRID, (1.0, 2.0, 3.0, 5.0, 10.0)),
    RuleSpec("rank_strict", "rank", True, "keep d iff it is among the k most likely ids of p (TensorRT-LLM)",
             "k = T", _TOP_K_GRID, (1.0, 2.0, 3.0, 5.0, 10.0)),
    RuleSpec("cascade", "cascade", False, "keep d if SD would or max q >= max p - alpha TV(p, q) (speculative cascades)",
             "alpha = T - 1", _CASCADE_GRID, (0.5, 1.0, 1.25, 1.5, 1.75, 2.0)),
)
DIVERGENCE_TABLE = (
    DivergenceSpec("kl", "KL(p || q)", _UNBOUNDED_GRID, (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)),
    DivergenceSpec("rkl", "KL(q || p)", _UNBOUNDED_GRID, (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)),
    DivergenceSpec("js", "Jensen-Shannon, nats, in [0, ln 2]", (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64),
                   (0.05, 0.1, 0.2, 0.3, 0.4, 0.5)),
    DivergenceSpec("tv", "total variation, in [0, 1]", (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0),
                   (0.1, 0.2, 0.3, 0.4, 0.5, 0.7)),
    DivergenceSpec("mkl", "(KL(m || p) + KL(m || q)) / 2, m = (p + q) / 2: the FSD paper's released \"js_div\"",
                   _UNBOUNDED_GRID, (0.1, 0.2, 0.4, 0.6, 0.8, 1.2)),
)
RULES = tuple(rule.name for rule in RULE_TABLE)
LENIENT_RULES = tuple(rule.name for rule in RULE_TABLE if rule.criterion)
DIVERGENCE_RULES = tuple(rule.name for rule in RULE_TABLE if rule.criterion == "divergence")
GENERATE_RULES = ("ar",) + RULES  # the decoding loop's: "ar" decodes with the target alone
DIVERGENCES = tuple(divergence.name for divergence in DIVERGENCE_TABLE)


def rule_spec(rule: str) -> RuleSpec:
    return RULE_TABLE[RULES.index(rule)]


def threshold_grids(rule: str, divergence: str) -> tuple:
    """(calibration grid, sweep grid) of T for a lenient rule: its divergence's under fsd and
    fsd_strict, the rule's own under the others."""
    spec = rule_spec(rule)
    if spec.criterion == "divergence":
        div = DIVERGENCE_TABLE[DIVERGENCES.index(divergence)]
        return div.calibration_grid, div.sweep_grid
    return spec.calibration_grid, spec.sweep_grid


def check_threshold(value, name: str = "threshold", per_row: bool = True) -> None:
    """Raise ValueError unless `value` is a threshold T: a real >= 0 (inf allowed; NaN and bools
    refused) or, with per_row, a [B] float tensor of them (read on the host)."""
    if per_row and isinstance(value, torch.Tensor):
        # (>= 0).all() rather than (< 0).any(): NaN must fail too
        if value.dim() != 1 or not value.is_floating_point() or not bool((value >= 0).all()):
            raise ValueError(f"{name} must be a float >= 0 or a [B] float tensor >= 0 (no NaN)")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        tensor = " or a [B] float tensor" if per_row else ""
        raise ValueError(f"{name} must be a float >= 0 (inf allowed){tensor}, got {value!r}")


@dataclass(frozen=True)
class VerifyOptions:
    """How a step verifies drafts (docs/design.md sections 2.4-2.5): the rule, the divergence and
    threshold of its test, and the temperature of the distributions it compares (None: the sampling
    ones). generate(), calibrate, fsd_ext.hf, the vLLM plug-in, the command line and the harness
    each build one from what their caller gave, and check() is the one check of it."""

    rule: str = "fsd"
    divergence: str = "js"
    threshold: Union[float, torch.Tensor] = 0.3
    div_temperature: Optional[float] = 1.0

    def check(self, rules: Sequence[str] = GENERATE_RULES, per_row: bool = True,
              name: Callable[[str], str] = str) -> "VerifyOptions":
        """-> self, or ValueError naming the field as the caller knows it (`name(field)`, e.g.
        fsd_ext.hf's "fsd_threshold"). rules: the names this caller takes; per_row: whether a [B]
        threshold tensor is allowed."""
        if self.rule not in rules:
            raise ValueError(f"{name('rule')} must be one of {tuple(rules)}, got {self.rule!r}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"{name('divergence')} must be one of {DIVERGENCES}, got {self.divergence!r}")
        check_threshold(self.threshold, name("threshold"), per_row)
        t = self.div_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t < math.inf):
            raise ValueError(f"{name('div_temperature')} must be a finite float > 0 (or None: the sampling "
                             f"distributions), got {t!r}")
        return self

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
