"""The sweep's configurations: AR, SD, FSD / FSD-strict per divergence over a threshold grid and
the other lenient rules over their own, greedy or sampled with several seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..decoding.draft_length import POLICIES
from ..types import DIVERGENCE_RULES, DIVERGENCE_TABLE, DIVERGENCES, LENIENT_RULES, VerifyOptions, check_threshold, \
    threshold_grids

# Default threshold grids. Ranges: js in [0, ln 2], tv in [0, 1], kl/rkl/mkl unbounded; mkl is the
# quantity the paper's code calls "js_div", so its grid brackets the paper's 0.4.
DEFAULT_THRESHOLDS: Dict[str, tuple] = {d.name: d.sweep_grid for d in DIVERGENCE_TABLE}
BENCH_RULES = ("ar", "sd") + LENIENT_RULES  # (greedy is SD at temperature 0 here)


@dataclass(frozen=True)
class Config:
    """One point of the sweep. temperature 0 = greedy."""

    rule: str
    divergence: Optional[str] = None
    threshold: Optional[float] = None
    temperature: float = 0.0
    top_p: Optional[float] = None
    seed: int = 0
    num_draft_tokens: int = 5
    div_temperature: Optional[float] = 1.0
    draft_length: str = "fixed"  # generate's draft_length= policy (K is then the most drafts)

    def __post_init__(self):
        if self.rule not in BENCH_RULES:
            raise ValueError(f"rule must be one of {BENCH_RULES}, got {self.rule!r}")
        fuzzy = self.rule in LENIENT_RULES
        if self.rule in DIVERGENCE_RULES and self.divergence is None:
            raise ValueError(f"rule {self.rule!r} needs a divergence in {DIVERGENCES}")
        if fuzzy and self.threshold is None:
            raise ValueError(f"rule {self.rule!r} needs a threshold")
        if fuzzy:
            VerifyOptions(self.rule, self.divergence or "js", self.threshold,
                          self.div_temperature).check(per_row=False)
        if self.rule not in DIVERGENCE_RULES and self.divergence is not None:
            raise ValueError(f"rule {self.rule!r} takes no divergence")
        if not fuzzy and self.threshold is not None:
            raise ValueError(f"rule {self.rule!r} takes no threshold")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.rule != "ar" and not self.num_draft_tokens >= 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_length not in POLICIES:
            raise ValueError(f"draft_length must be one of {tuple(POLICIES)}, got {self.draft_length!r}")
        if self.rule == "ar" and self.draft_length != "fixed":
            raise ValueError("rule 'ar' drafts nothing: draft_length must be 'fixed'")

    @property
    def sampling(self) -> str:
        if self.temperature == 0:
            return "greedy"
        return f"t={self.temperature:g}" + (f",top_p={self.top_p:g}" if self.top_p is not None else "")

    @property
    def group(self) -> str:
        """Identifies the configuration with seeds pooled (one summary row)."""
        parts = [self.rule]
        if self.rule in LENIENT_RULES:
            parts += ([self.divergence] if self.divergence else []) + [f"T={self.threshold:g}"]
            if self.div_temperature != 1.0:
                parts.append(f"div_t={self.div_temperature}")
        if self.rule != "ar":
            parts.append(f"K={self.num_draft_tokens}")
        if self.draft_length != "fixed":  # absent for fixed: the keys of earlier sweeps hold
            parts.append(self.draft_length)
        parts.append(self.sampling)
        return "/".join(parts)

    @property
    def key(self) -> str:
        """Identifies one sample per problem (the resume key, with the setup and the task id)."""
        return self.group if self.temperature == 0 else f"{self.group}/seed={self.seed}"

    @property
    def label(self) -> str:
        if self.rule == "ar":
            return "AR"
        length = "" if self.draft_length == "fixed" else f" ({self.draft_length})"
        if self.num_draft_tokens != 5:  # the sweep's default K goes unsaid
            length += f" K={self.num_draft_tokens}"
        if self.rule == "sd":
            return "SD" + length
        if self.rule in DIVERGENCE_RULES:
            name = "FSD" if self.rule == "fsd" else "FSD-strict"
            return f"{name} {self.divergence} T={self.threshold:g}{length}"
        return f"{self.rule} T={self.threshold:g}{length}"

    def generate_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of fsd_ext.generate for this configuration."""
        kwargs: Dict[str, Any] = dict(rule=self.rule, num_draft_tokens=self.num_draft_tokens,
                                      temperature=self.temperature, seed=self.seed)
        if self.draft_length != "fixed":
            kwargs["draft_length"] = self.draft_length
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.rule in LENIENT_RULES:
            kwargs.update(threshold=self.threshold, div_temperature=self.div_temperature)
        if self.divergence is not None:
            kwargs["divergence"] = self.divergence
        return kwargs


def build_grid(rules: Sequence[str] = BENCH_RULES, divergences: Sequence[str] = DIVERGENCES,
               thresholds: Optional[Dict[str, Sequence[float]]] = None, temperature: float = 0.0,
               top_p: Optional[float] = None, seeds: Sequence[int] = (0,), num_draft_tokens: int = 5,
               div_temperature: Optional[float] = 1.0,
               draft_lengths: Sequence[str] = ("fixed",)) -> List[Config]:
    """AR and SD first (the references), then FSD and FSD-strict per divergence and threshold and
    the other lenient rules per threshold (`thresholds` keys: divergences, and rule names for the
    others), each speculative configuration once per draft-length policy. Greedy decoding uses only
    the first seed (the seed changes nothing)."""
    unknown = set(rules) - set(BENCH_RULES)
    if unknown:
        raise ValueError(f"unknown rules {sorted(unknown)}; choose from {BENCH_RULES}")
    bad_div = set(divergences) - set(DIVERGENCES)
    if bad_div:
        raise ValueError(f"unknown divergences {sorted(bad_div)}; choose from {DIVERGENCES}")
    grid = dict(DEFAULT_THRESHOLDS)
    grid.update({name: tuple(values) for name, values in (thresholds or {}).items()})
    seeds = list(seeds)[:1] if temperature == 0 else list(seeds)
    common = dict(temperature=temperature, top_p=top_p, num_draft_tokens=num_draft_tokens)
    configs = []
    for seed in seeds:
        if "ar" in rules:
            configs.append(Config("ar", seed=seed, **common))
        if "sd" in rules:
            configs += [Config("sd", seed=seed, draft_length=n, **common) for n in draft_lengths]
        for rule in LENIENT_RULES:
            if rule not in rules:
                continue
            for divergence in (divergences if rule in DIVERGENCE_RULES else (None,)):
                ts = grid.get(divergence or rule) or threshold_grids(rule, divergence or "js")[1]
                configs += [Config(rule, divergence, float(t), seed=seed, draft_length=n,
                                   div_temperature=div_temperature, **common)
                            for n in draft_lengths for t in ts]
    return configs


def parse_config(spec: str, **common) -> Config:
    """One configuration from 'ar', 'sd', 'sd:heuristic', 'fsd:js:0.2', 'fsd:rkl:0.5:acceptance:K=8'
    or 'typical:11.1' (rule[:divergence]:threshold[:draft_length][:K=n], the divergence for fsd and
    fsd_strict only); `common` fills the other fields (temperature, num_draft_tokens, ...)."""
    parts = [p.strip() for p in spec.split(":")]
    rule, rest = parts[0], parts[1:]
    fuzzy = rule in LENIENT_RULES
    fields: Dict[str, Any] = dict(common)
    try:
        if rest and rest[-1].startswith("K="):
            fields["num_draft_tokens"] = int(rest.pop()[2:])
        if rule in DIVERGENCE_RULES:
            fields.update(divergence=rest[0], threshold=float(rest[1]))
            rest = rest[2:]
        elif fuzzy:
            fields.update(threshold=float(rest[0]))
            rest = rest[1:]
        if len(rest) > 1:
            raise ValueError("too many fields")
        if rest:
            fields["draft_length"] = rest[0]
        if not fuzzy:
            fields.pop("div_temperature", None)  # as build_grid: only FSD rows take it
        return Config(rule, **fields)
    except (IndexError, ValueError, TypeError) as error:
        raise ValueError(f"--config expects rule[:divergence]:threshold[:draft_length][:K=n], e.g. "
                         f"'sd:heuristic', 'fsd:js:0.2:acceptance:K=8' or 'typical:11.1', got {spec!r} "
                         f"({error})") from None


def parse_thresholds(text: Optional[str]) -> Dict[str, tuple]:
    """'js=0.1,0.2;rank=1,3' -> {'js': (0.1, 0.2), 'rank': (1.0, 3.0)}: a divergence's grid (fsd,
    fsd_strict) or another lenient rule's."""
    out: Dict[str, tuple] = {}
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        name, _, values = part.partition("=")
        name = name.strip()
        names = DIVERGENCES + tuple(r for r in LENIENT_RULES if r not in DIVERGENCE_RULES)
        if name not in names or not values.strip():
            raise ValueError(f"--thresholds expects 'name=t1,t2;name=...' with name in {names}, got {part!r}")
        thresholds = tuple(float(v) for v in values.split(",") if v.strip())
        for t in thresholds:
            check_threshold(t, f"each threshold of {name}", per_row=False)
        out[name] = thresholds
    return out
