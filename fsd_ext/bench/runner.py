"""Decoding one HumanEval prompt under one configuration, and the sweep that scores them all.

The decoding itself is behind a small interface (`Backend.complete(config, prompt) -> Generation`);
`HFBackend` drives fsd_ext.generate on a Hugging Face target/draft pair, tests use fakes.
`run_sweep` decodes and scores every (configuration, problem) not yet in the result store.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import humaneval
from ..types import LENIENT_RULES
from .grid import Config
from .humaneval import PROMPT_VERSION
from .store import ResultStore, setup_id
from .tasks import TASKS, Task


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
    prompt_shared: bool = False        # decoded with prompt forwards shared across configurations
    extra: Dict[str, Any] = field(default_factory=dict)


class Backend:
    """Turns a prompt into a Generation under a configuration."""

    chat: bool = False  # whether prompts use the chat template (decides how completions are cut)
    task: Task = TASKS["humaneval"]  # what is decoded and how it is scored

    def prompt(self, problem: Dict[str, str]) -> str:
        return problem["prompt"]

    def complete(self, config: Config, prompt: str) -> Generation:  # pragma: no cover - interface
        raise NotImplementedError

    def complete_batch(self, config: Config, prompts: Sequence[str]) -> List[Generation]:
        """The prompts decoded together (default: one by one). A batched Generation holds its own
        row's counts; its seconds are the batch's shared out by new tokens (not a batch-1 time)."""
        return [self.complete(config, prompt) for prompt in prompts]

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
    # decoding, and under sampling with output_divergences=True).
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


class HFBackend(Backend):
    """Decodes with fsd_ext.generate (or any function with its signature) on a HF model pair."""

    def __init__(self, target, draft, tokenizer, *, max_new_tokens: int = 512,
                 generate_fn: Optional[Callable] = None, use_chat: Optional[bool] = None,
                 check_sd: bool = True, eos_token_id=None, use_cuda_graphs="auto",
                 names: Optional[Dict[str, str]] = None, task: str = "humaneval",
                 share_prompts: bool = False):
        """share_prompts: a prompt's forwards run once and their cache entries serve every
        configuration decoded on it next (decoding.PromptCache: the same tokens; best with
        order="problem"). Its records' times then lack the prompt forwards, so the summary gives
        no end-to-end tokens/s for them."""
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.task = TASKS[task]
        self.max_new_tokens = max_new_tokens
        if generate_fn is None:
            from ..decoding.loop import generate as generate_fn
        self.generate_fn = generate_fn
        self.chat = humaneval.has_chat_template(tokenizer) if use_chat is None else use_chat
        self.check_sd = check_sd
        self.eos_token_id = (default_eos_ids(target, tokenizer) or None) if eos_token_id is None else eos_token_id
        self.use_cuda_graphs = use_cuda_graphs
        self.names = names or {}
        self.device = next(target.parameters()).device
        from ..decoding import PromptCache
        self.prompt_cache = PromptCache() if share_prompts else None

    def setup(self) -> Dict[str, Any]:
        setup = {"target": self.names.get("target", type(self.target).__name__),
                 "draft": self.names.get("draft", type(self.draft).__name__),
                 "dtype": str(next(self.target.parameters()).dtype).replace("torch.", ""),
                 "max_new_tokens": self.max_new_tokens, "chat": self.chat,
                 "prompt_version": PROMPT_VERSION}
        # Only where set, so that the setups (resume keys) of sweeps without it keep their ids.
        from ..cpu_linear import linear_weights_kind
        kinds = sorted({k for k in map(linear_weights_kind, (self.target, self.draft)) if k})
        if kinds:
            setup["linear_weights"] = ",".join(kinds)
        if self.task.name != "humaneval":  # (HumanEval sweeps keep their ids: PROMPT_VERSION above)
            setup["task"] = f"{self.task.name}/{self.task.prompt_version}"
        return setup

    def prompt(self, problem: Dict[str, str]) -> str:
        return self.task.format_prompt(problem, self.tokenizer, self.chat)

    def prompt_ids(self, problem: Dict[str, str]):
        """[1, P] the token ids complete() decodes for `problem` (`fsd-ext calibrate` reuses them)."""
        return self._encode(self.prompt(problem))

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

    def _generate(self, config: Config, input_ids, mask, max_new_tokens: Optional[int] = None,
                  check_sd: Optional[bool] = None, **extra):
        """generate_fn under `config`, timed -> (output, seconds without generate's diagnostics)."""
        import torch
        kwargs = config.generate_kwargs()
        kwargs.update(max_new_tokens=max_new_tokens or self.max_new_tokens,
                      eos_token_id=self.eos_token_id, use_cuda_graphs=self.use_cuda_graphs, **extra)
        if self.prompt_cache is not None:
            kwargs["prompt_cache"] = self.prompt_cache
        check_sd = self.check_sd if check_sd is None else check_sd
        if check_sd and config.temperature > 0 and config.rule in LENIENT_RULES:
            kwargs["output_divergences"] = True  # generate counts sampled SD rejections (timed apart)
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.generate_fn(self.target, self.draft, input_ids, mask, **kwargs)
        self._sync()
        return out, time.perf_counter() - start - (_stat(out.stats, "diagnostics_seconds") or 0.0)

    def complete(self, config: Config, prompt: str, max_new_tokens: Optional[int] = None,
                 check_sd: Optional[bool] = None) -> Generation:
        import torch
        input_ids = self._encode(prompt)  # [1, P]
        prompt_len = input_ids.shape[1]
        out, seconds = self._generate(config, input_ids, torch.ones_like(input_ids), max_new_tokens, check_sd)
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
        gen.prompt_shared = self.prompt_cache is not None
        return gen

    def complete_batch(self, config: Config, prompts: Sequence[str]) -> List[Generation]:
        """One generate call over the left-padded prompts. Every row gets the configuration's seed
        (per-row seeds: a row's draws are those of its decode alone), so a batch changes the tokens
        only where the models' batched forwards round differently from single-row ones."""
        import torch
        if len(prompts) == 1:
            return [self.complete(config, prompts[0])]
        encoded = [self._encode(p)[0] for p in prompts]
        width = max(len(e) for e in encoded)
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]
        pad = next((t for t in (self.tokenizer.pad_token_id, *eos) if t is not None), 0)
        input_ids = torch.full((len(encoded), width), int(pad), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(input_ids)
        for b, e in enumerate(encoded):  # left padding
            input_ids[b, width - len(e):], mask[b, width - len(e):] = e, 1
        out, seconds = self._generate(config, input_ids, mask, pad_token_id=int(pad),
                                      seed=torch.full((len(encoded),), config.seed, dtype=torch.int64))
        gens = []
        for b, row in enumerate(out.stats.rows):
            new_ids = out.sequences[b, width:].tolist()[:row.new_tokens]
            text = self.tokenizer.decode([t for t in new_ids if t not in eos], skip_special_tokens=True)
            steps = 0 if config.rule == "ar" else row.verifications
            gens.append(Generation(
                text=text, new_tokens=row.new_tokens,
                seconds=seconds * row.new_tokens / max(out.stats.new_tokens, 1),
                target_calls=row.verifications + 1,  # its prompt forward and its verifications
                draft_calls=0 if config.rule == "ar" else row.drafted_tokens + 1,
                accepted_drafts=float(row.accepted_drafts) if steps else 0.0, verify_steps=steps,
                sd_rejected=0 if config.rule in ("ar", "sd") else row.sd_rejected_accepted,
                prompt_shared=self.prompt_cache is not None,
                extra={"stats": {"drafted_tokens": row.drafted_tokens}, "batch": len(prompts)}))
        return gens


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
              order: str = "config", max_contention: Optional[float] = 0.25, batch_size: int = 1) -> int:
    """Decode and score every (configuration, problem) not yet in the store. Returns how many new
    records were written.

    order="config": one configuration after the other, a progress bar each. order="problem": all
    configurations on problem 1 (on the first batch_size problems), then on the next, ...: a change
    in machine load during the run then hits every configuration alike, which keeps their tokens/s
    comparable on a shared machine, and a backend sharing prompt forwards reuses them.
    max_contention: decode again what ran while other processes used more than this many cores
    (contended_complete; None: never).
    batch_size > 1: problems decoded batch_size at a time (backend.complete_batch), an accuracy run;
    their records carry "batch", and the summary gives tokens/s only from batch-1 records (time a
    batch-1 run on a subset for that).
    """
    if order not in ("config", "problem"):
        raise ValueError(f"order must be 'config' or 'problem', got {order!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
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
            pending = todo[config.key]
            for first in range(0, len(pending), batch_size):
                records = _run_batch(config, pending[first:first + batch_size], backend, sid, limits,
                                     store, on_record, max_contention)
                written += len(records)
                passed += sum(r["passed"] for r in records)
                bar.update(len(records))
                tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["seconds"] for r in records)
                bar.set_postfix_str(f"pass {passed}/{len(pending)} new, {tokens / max(seconds, 1e-9):.1f} tok/s")
            bar.close()
        return written
    for config in configs:
        warmup(config)
    pending = sum(len(v) for v in todo.values())
    total = len(configs) * len(problems)
    bar = _progress(total, total - pending, "all configurations", progress)
    for first in range(0, len(problems), batch_size):
        for config in configs:
            batch = [p for p in problems[first:first + batch_size] if p in todo[config.key]]
            if batch:
                records = _run_batch(config, batch, backend, sid, limits, store, on_record,
                                     max_contention)
                written += len(records)
                bar.update(len(records))
                bar.set_postfix_str(f"{batch[0]['task_id']} {config.label}: "
                                    f"{sum(r['passed'] for r in records)}/{len(records)} pass")
    bar.close()
    return written


def _machine_busy_seconds() -> Optional[float]:
    """CPU seconds the whole machine has spent busy (Linux /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = handle.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _wait_until_quiet(max_contention: float, timeout_s: float, probe_s: float = 1.0):
    """Sleep until, over one probe, the machine (this process idles meanwhile) uses at most
    max_contention cores, or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy0 = _machine_busy_seconds()
        time.sleep(probe_s)
        if _machine_busy_seconds() - busy0 <= max_contention * probe_s:
            return


def contended_complete(backend: Backend, config: Config, prompts: Sequence[str],
                       max_contention: Optional[float] = 0.25, retries: int = 3,
                       quiet_timeout_s: float = 600.0):
    """backend.complete_batch, timed while no other process uses the CPU: beside a busy process a
    multi-threaded decode runs several times slower, so a decode during which the rest of the
    machine used more than `max_contention` cores on average is decoded again, after waiting (at
    most quiet_timeout_s) for the machine to go quiet, up to `retries` times. Returns (Generations,
    the other processes' mean cores during the kept decode; None where /proc/stat is missing or
    max_contention is None)."""
    for attempt in range(retries + 1):
        busy0, own0, wall0 = _machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter()
        gens = (backend.complete_batch(config, prompts) if len(prompts) > 1
                else [backend.complete(config, prompts[0])])
        wall = time.perf_counter() - wall0
        if busy0 is None or max_contention is None:
            return gens, None
        contention = max(0.0, (_machine_busy_seconds() - busy0) - (_own_cpu_seconds() - own0)) / wall
        if contention <= max_contention or attempt == retries:
            return gens, contention
        _wait_until_quiet(max_contention, quiet_timeout_s)


def _run_batch(config: Config, problems: Sequence[Dict[str, str]], backend: Backend, sid: str,
               limits: humaneval.SandboxLimits, store: ResultStore,
               on_record: Optional[Callable[[Dict[str, Any]], None]],
               max_contention: Optional[float] = 0.25) -> List[Dict[str, Any]]:
    """Decode problems with one configuration (together when several), score each, append their
    records to the store."""
    start = time.perf_counter()
    gens, contention = contended_complete(backend, config, [backend.prompt(p) for p in problems], max_contention)
    wall = (time.perf_counter() - start) / len(problems)
    records = []
    for problem, gen in zip(problems, gens):
        records.append(_record(config, problem, gen, backend, sid, limits, contention, wall))
        store.append(records[-1])
        if on_record is not None:
            on_record(records[-1])
    return records


def _record(config: Config, problem: Dict[str, str], gen: Generation, backend: Backend, sid: str,
            limits: humaneval.SandboxLimits, contention: Optional[float], wall: float) -> Dict[str, Any]:
    """One scored record (a problem under a configuration)."""
    start = time.perf_counter()
    passed, result, completion = backend.task.score(problem, gen.text, backend.chat, limits)
    record = {
        "setup_id": sid, "setup": backend.setup(), "key": config.key, "group": config.group,
        "config": asdict(config), "task_id": problem["task_id"],
        "passed": passed, "result": result, "completion": completion,
        "generated_text": gen.text, "new_tokens": gen.new_tokens, "seconds": gen.seconds,
        "wall_s": wall + time.perf_counter() - start, "target_calls": gen.target_calls,
        "draft_calls": gen.draft_calls, "target_seconds": gen.target_seconds,
        "draft_seconds": gen.draft_seconds, "prefill_seconds": gen.prefill_seconds,
        "capture_seconds": gen.capture_seconds,
        "accepted_hist": gen.accepted_hist,
        "accepted_drafts": gen.accepted_drafts, "verify_steps": gen.verify_steps,
        "sd_rejected": gen.sd_rejected, "stats": gen.extra.get("stats"),
        "contention": contention, "batch": gen.extra.get("batch", 1),
        "prompt_shared": gen.prompt_shared,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return record


def load_model(spec: str, dtype: str = "float32", device: str = "cpu", linear_weights: str = "same",
               activations: str = "auto"):
    """(model, tokenizer) for a built-in name of fsd_ext.models (the offline Qwen2.5-Coder pair,
    SmolLM2: assembled, checked and converted once into a cache), a folder, a .gguf file, or a hub
    id (which needs a network or a local cache). linear_weights: "same" (the model's dtype),
    "bfloat16", "gguf", or "auto" (models.resolve_load_options), as in `fsd-ext generate`;
    activations: "auto", "float32" or "int8" (models.load)."""
    from .. import models
    dtype, linear_weights = models.resolve_load_options(spec, device, dtype, linear_weights)
    return models.load(spec, dtype=dtype, device=device, linear_weights=linear_weights, activations=activations)
