"""One summary row per configuration (seeds pooled): pass@1, tokens/s, acceptance, speedups against
AR and SD, the Pareto flag; the table, summary.csv and summary.json."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..decoding.stats import seconds_per_decode_forward
from ..types import LENIENT_RULES
from .grid import Config

SUMMARY_FIELDS = (
    "label", "group", "rule", "divergence", "threshold", "sampling", "num_draft_tokens",
    "draft_length", "seeds",
    "problems", "samples", "pass_at_1", "pass_at_1_seed_min", "pass_at_1_seed_max",
    "timed_problems", "tokens_per_s", "decode_tokens_per_s", "speedup_vs_ar", "speedup_vs_sd",
    "pass_delta_vs_sd", "mean_accepted", "mean_drafted", "tokens_per_target_call",
    "draft_cost_ratio", "ceiling_tokens_per_s", "target_calls", "draft_calls",
    "target_s", "draft_s", "new_tokens", "generate_s", "wall_s", "accepted_drafts",
    "sd_rejected_share", "same_as_sd", "pareto", "pass_delta_ci_low", "pass_delta_ci_high",
) + tuple(f"projected_vs_sd_{name}" for name in ("d05_v1", "d05_v2.3", "d20_v1", "d20_v2.3"))

# Cost models of the projected speed-up over SD (docs/generate.md): a draft forward at 5% or 20% of
# a one-token target forward, a K+1-token verification at 1.0x or 2.3x one (2.3x: this project's
# CPUs in float32; about 1x where a target call is bound by reading the weights, as on a GPU).
COST_MODELS = {"d05_v1": (0.05, 1.0), "d05_v2.3": (0.05, 2.3), "d20_v1": (0.20, 1.0), "d20_v2.3": (0.20, 2.3)}


def _sum_optional(values: Iterable[Optional[float]]) -> Optional[float]:
    values = list(values)
    return None if not values or any(v is None for v in values) else float(sum(values))


def _stats_sum(records, name: str) -> Optional[float]:
    """The sum of a GenerateStats field over the records (None if a record lacks it)."""
    return _sum_optional((r.get("stats") or {}).get(name) for r in records)


def _forward_times(records) -> Optional[Dict[str, float]]:
    """Pooled over the records, prompt forwards left out: seconds per target forward (a verification
    for SD/FSD, one token for AR), per draft forward, and the rest of the decode (the loop, accept)
    per verification step; plus the prompt forwards' seconds. None without the timings."""
    prefill, target_prefill = _stats_sum(records, "prefill_seconds"), _stats_sum(records, "target_prefill_seconds")
    target_s = _sum_optional(r.get("target_seconds") for r in records)
    draft_s = _sum_optional(r.get("draft_seconds") or 0.0 for r in records)
    steps = sum(r["target_calls"] - 1 for r in records)
    if None in (prefill, target_prefill, target_s) or steps <= 0 or target_s <= target_prefill:
        return None
    drafting = [r for r in records if r["draft_calls"]]
    # What neither model's forwards took: the loop, accept, sampling.
    rest = sum(r["seconds"] for r in records) - target_s - draft_s
    return {"prefill": prefill,
            "target": seconds_per_decode_forward(target_s, target_prefill,
                                                 sum(r["target_calls"] for r in records), len(records)),
            "draft": seconds_per_decode_forward(draft_s, prefill - target_prefill,
                                                sum(r["draft_calls"] for r in drafting), len(drafting)),
            "rest_per_step": rest / steps}


def _ceiling(times: Optional[Dict[str, float]], new_tokens: int, drafted: Optional[float]) -> Optional[float]:
    """The tokens/s of the same decodes had every step accepted all its drafts: the same prompt
    forwards and per-forward times, new_tokens / (drafted + 1) steps of one verification and
    `drafted` draft forwards each."""
    if times is None or drafted is None:
        return None
    steps = new_tokens / (drafted + 1)
    seconds = times["prefill"] + steps * (times["target"] + drafted * times["draft"] + times["rest_per_step"])
    return new_tokens / seconds if seconds > 0 else None


def summarize(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per configuration group (seeds pooled), in first-seen order, plus speedups against
    the AR and SD rows and the Pareto flag on (tokens/s, pass@1)."""
    groups: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[record["group"]].append(record)
    rows = []
    pass_rates: Dict[str, Dict[str, float]] = {}  # group -> task -> passing samples / samples
    for group, recs in groups.items():
        config = Config(**recs[0]["config"])
        # Per problem (pass rates over seeds) and per seed (the spread: each seed's pass@1).
        by_task: Dict[str, List[bool]] = defaultdict(list)
        by_seed: Dict[int, List[bool]] = defaultdict(list)
        for r in recs:
            by_task[r["task_id"]].append(bool(r["passed"]))
            by_seed[r["config"]["seed"]].append(bool(r["passed"]))
        pass_rates[group] = {t: sum(v) / len(v) for t, v in by_task.items()}
        pass_at_1 = sum(pass_rates[group].values()) / len(by_task)
        seed_pass = [sum(v) / len(v) for v in by_seed.values()]
        new_tokens = sum(r["new_tokens"] for r in recs)
        generate_s = sum(r["seconds"] for r in recs)
        # tokens/s from the batch-1 decodes that ran their own prompt forwards (accuracy runs,
        # batched or sharing prompts, time no end-to-end decode): the timed subset.
        timed = [r for r in recs if r.get("batch", 1) == 1 and not r.get("prompt_shared")]
        timed_tokens, timed_s = sum(r["new_tokens"] for r in timed), sum(r["seconds"] for r in timed)
        prefill_s = _sum_optional(r.get("prefill_seconds") for r in timed)
        setup_s = None if prefill_s is None else prefill_s + sum(r.get("capture_seconds") or 0.0 for r in timed)
        target_calls = sum(r["target_calls"] for r in recs)
        accepted = float(sum(r["accepted_drafts"] for r in recs))
        steps = sum(r["verify_steps"] for r in recs)
        sd_rejected = [r.get("sd_rejected") for r in recs]
        times = _forward_times(recs)
        drafted = (0.0 if config.rule == "ar" else None if _stats_sum(recs, "drafted_tokens") is None
                   else _stats_sum(recs, "drafted_tokens") / steps if steps else 0.0)
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
            "pass_at_1_seed_min": min(seed_pass), "pass_at_1_seed_max": max(seed_pass),
            "timed_problems": len({r["task_id"] for r in timed}),
            "tokens_per_s": (None if not timed else timed_tokens / timed_s if timed_s > 0 else float("nan")),
            "decode_tokens_per_s": (timed_tokens / (timed_s - setup_s)
                                    if timed and setup_s is not None and timed_s > setup_s else None),
            "draft_length": config.draft_length,
            "mean_accepted": accepted / steps if steps else 0.0,
            "mean_drafted": drafted,
            "draft_cost_ratio": (times["draft"] / times["target"]
                                 if times and config.rule != "ar" else None),
            "ceiling_tokens_per_s": _ceiling(times, new_tokens, 0.0 if config.rule == "ar" else drafted),
            "tokens_per_target_call": new_tokens / target_calls if target_calls else float("nan"),
            "target_calls": target_calls, "draft_calls": sum(r["draft_calls"] for r in recs),
            "target_s": _sum_optional(r.get("target_seconds") for r in recs),
            "draft_s": _sum_optional(r.get("draft_seconds") for r in recs),
            "new_tokens": new_tokens, "generate_s": generate_s,
            "wall_s": sum(r["wall_s"] for r in recs), "accepted_drafts": accepted,
            "sd_rejected_share": share,
        })
    _add_relative_columns(rows)
    _add_same_as_sd(rows, groups)
    _add_paired_intervals(rows, pass_rates)
    _add_projections(rows)
    return rows


def projected_rate(row: Dict[str, Any], draft_cost: float, verify_cost: float) -> Optional[float]:
    """Tokens per one-token target forward under a cost model: tokens per verification over its
    cost, verify_cost plus the step's draft forwards at draft_cost each (AR: 1 token per forward)."""
    if row["rule"] == "ar":
        return 1.0
    drafted = row.get("mean_drafted")
    if drafted is None:
        return None
    return (row["mean_accepted"] + 1.0) / (verify_cost + drafted * draft_cost)


def _add_projections(rows: List[Dict[str, Any]]):
    sd = _reference_row(rows, "sd")
    for row in rows:
        for name, (draft_cost, verify_cost) in COST_MODELS.items():
            mine = projected_rate(row, draft_cost, verify_cost)
            ref = projected_rate(sd, draft_cost, verify_cost) if sd else None
            row[f"projected_vs_sd_{name}"] = mine / ref if mine is not None and ref else None


def bootstrap(stat: Callable[[Sequence[Any]], float], items: Sequence[Any], resamples: int = 4000,
              seed: int = 0, level: float = 0.95) -> tuple:
    """(stat(items), low, high): a percentile bootstrap of `stat` over `items` (problems) drawn with
    replacement, so that whatever a problem holds (its seeds, its value in two runs) stays paired."""
    import random
    rng = random.Random(seed)
    n = len(items)
    draws = sorted(stat([items[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return stat(items), draws[int(tail * resamples)], draws[min(resamples - 1, int((1 - tail) * resamples))]


def paired_bootstrap(a: Dict[str, float], b: Dict[str, float], resamples: int = 4000,
                     seed: int = 0, level: float = 0.95) -> tuple:
    """(mean of b - a, low, high) over the problems both hold (each value a problem's pass rate over
    its seeds; see bootstrap)."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two configurations share no problem")
    diffs = [b[t] - a[t] for t in shared]
    return bootstrap(lambda sample: sum(sample) / len(sample), diffs, resamples, seed, level)


def _add_paired_intervals(rows: List[Dict[str, Any]], pass_rates: Dict[str, Dict[str, float]]):
    """pass_delta_ci_low / _high: the paired 95% bootstrap interval of pass@1 minus SD's, on the
    problems both decoded (seeds of a problem averaged first; the same sampling regime only)."""
    for row in rows:
        sds = [r for r in rows if r["rule"] == "sd" and r.get("draft_length", "fixed") == "fixed"
               and r["sampling"] == row["sampling"] and r["num_draft_tokens"] == row["num_draft_tokens"]]
        row["pass_delta_ci_low"] = row["pass_delta_ci_high"] = None
        if sds and sds[0] is not row:
            mine, ref = pass_rates[row["group"]], pass_rates[sds[0]["group"]]
            if set(mine) & set(ref):
                _, row["pass_delta_ci_low"], row["pass_delta_ci_high"] = paired_bootstrap(ref, mine)


def _add_same_as_sd(rows: List[Dict[str, Any]], groups: Dict[str, List[Dict[str, Any]]]):
    """same_as_sd: the share of a greedy row's problems whose generated text equals the fixed-K SD
    row's (1.0 where a rule changes only the work, as adaptive draft lengths should); None where a
    text is missing or the rows sample."""
    sd = _reference_row(rows, "sd")
    sd_text = {r["task_id"]: r.get("generated_text") for r in groups[sd["group"]]} if sd else {}
    for row in rows:
        recs = [r for r in groups[row["group"]] if r["task_id"] in sd_text]
        texts = [(r.get("generated_text"), sd_text[r["task_id"]]) for r in recs]
        row["same_as_sd"] = (None if row["sampling"] != "greedy" or not texts
                             or any(a is None or b is None for a, b in texts)
                             else sum(a == b for a, b in texts) / len(texts))


def _reference_row(rows, rule):
    """The first row of `rule` with a fixed draft length (the reference the speedups divide by)."""
    matches = [r for r in rows if r["rule"] == rule and r.get("draft_length", "fixed") == "fixed"]
    return matches[0] if matches else None


def _add_relative_columns(rows: List[Dict[str, Any]]):
    ar, sd = _reference_row(rows, "ar"), _reference_row(rows, "sd")
    def ratio(row, ref):
        return row["tokens_per_s"] / ref["tokens_per_s"] if ref and row["tokens_per_s"] and ref["tokens_per_s"] else None
    for row in rows:
        row["speedup_vs_ar"] = ratio(row, ar)
        row["speedup_vs_sd"] = ratio(row, sd)
        row["pass_delta_vs_sd"] = row["pass_at_1"] - sd["pass_at_1"] if sd else None
    timed = [r for r in rows if r["tokens_per_s"] is not None]  # (batched accuracy rows are not)
    for row in rows:
        row["pareto"] = row["tokens_per_s"] is not None and not any(
            o["pass_at_1"] >= row["pass_at_1"] and o["tokens_per_s"] >= row["tokens_per_s"]
            and (o["pass_at_1"] > row["pass_at_1"] or o["tokens_per_s"] > row["tokens_per_s"])
            for o in timed)


def pareto_front(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The non-dominated rows, by increasing tokens/s."""
    return sorted((r for r in rows if r["pareto"]), key=lambda r: r["tokens_per_s"])


def target_check(rows: Sequence[Dict[str, Any]], max_pass_drop: float = 0.02,
                 min_speedup: float = 1.3, min_adaptive_speedup: float = 1.15) -> Dict[str, Any]:
    """The frontier's targets against fixed-K SD (the reference row):
    - adaptive SD: the fastest SD row with an adaptive draft length, at >= `min_adaptive_speedup`x
      SD's tokens/s with the same outputs (greedy: every completion equal to SD's);
    - FSD ("met", "row"): the fastest FSD/FSD-strict row with pass@1 within `max_pass_drop` of
      SD's, at >= `min_speedup`x SD's tokens/s and >= `min_adaptive_speedup`x the best adaptive
      SD's (where there is one).
    Returns both with the reason where one is missed. Rows without a batch-1 speed (batched
    accuracy runs) take no part."""
    rows = [r for r in rows if r["tokens_per_s"] is not None]
    sd = _reference_row(rows, "sd")
    if sd is None:
        return {"met": False, "reason": "no SD row with a batch-1 tokens/s", "row": None}
    adaptive = [r for r in rows if r["rule"] == "sd" and r.get("draft_length", "fixed") != "fixed"]
    best_sd = max(adaptive, key=lambda r: r["tokens_per_s"]) if adaptive else None
    adaptive_met = bool(best_sd and best_sd["tokens_per_s"] >= min_adaptive_speedup * sd["tokens_per_s"]
                        and best_sd.get("same_as_sd") in (None, 1.0))
    floor = max(min_speedup * sd["tokens_per_s"],
                min_adaptive_speedup * best_sd["tokens_per_s"] if best_sd else 0.0)
    hits = [r for r in rows if r["rule"] in LENIENT_RULES
            and r["pass_at_1"] >= sd["pass_at_1"] - max_pass_drop - 1e-12
            and r["tokens_per_s"] >= floor]
    best = max(hits, key=lambda r: r["tokens_per_s"]) if hits else None
    return {"met": best is not None, "row": best["group"] if best else None,
            "reason": "" if best else (f"no FSD row within {100 * max_pass_drop:g} points of SD's "
                                       f"pass@1 reaches {floor:.2f} tokens/s"),
            "adaptive_sd_met": adaptive_met, "adaptive_sd_row": best_sd["group"] if best_sd else None,
            "adaptive_sd_speedup": best_sd["tokens_per_s"] / sd["tokens_per_s"] if best_sd else None}


def paired_pass_difference(a: Dict[str, bool], b: Dict[str, bool], z: float = 1.96) -> Dict[str, Any]:
    """pass@1 of `b` minus `a` on the problems both decoded ({task_id: passed} each), with its paired
    (Wald) interval, the discordant counts and McNemar's exact two-sided p-value: what a claim that
    one configuration is more or less accurate than another must rest on."""
    shared = sorted(set(a) & set(b))
    n = len(shared)
    if not n:
        raise ValueError("the two configurations share no problem")
    only_b = sum(b[t] and not a[t] for t in shared)
    only_a = sum(a[t] and not b[t] for t in shared)
    diff = (only_b - only_a) / n
    half = z * math.sqrt(max(only_a + only_b - (only_b - only_a) ** 2 / n, 0.0)) / n
    discordant = only_a + only_b
    tail = sum(math.comb(discordant, k) for k in range(min(only_a, only_b) + 1)) / 2 ** discordant if discordant else 1.0
    return {"problems": n, "pass_a": sum(a[t] for t in shared), "pass_b": sum(b[t] for t in shared),
            "only_a": only_a, "only_b": only_b, "difference": diff, "ci": (diff - half, diff + half),
            "mcnemar_p": min(1.0, 2 * tail)}


def _fmt(value, spec="{:.3f}"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value) if isinstance(value, float) else str(value)


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    header = ("config", "n", "pass@1", "tok/s", "xAR", "xSD", "acc/step", "drafted", "tok/tcall",
              "cost", "ceiling", "tcalls", "dcalls", "SD-rej%", "=SD", "pareto")
    lines = [header]
    for r in rows:
        share = r["sd_rejected_share"]
        lines.append((r["label"], str(r["samples"]), f"{100 * r['pass_at_1']:.1f}",
                      _fmt(r["tokens_per_s"], "{:.2f}"), _fmt(r["speedup_vs_ar"], "{:.2f}"),
                      _fmt(r["speedup_vs_sd"], "{:.2f}"), _fmt(r["mean_accepted"], "{:.2f}"),
                      _fmt(r.get("mean_drafted"), "{:.2f}"),
                      _fmt(r["tokens_per_target_call"], "{:.2f}"),
                      _fmt(r.get("draft_cost_ratio"), "{:.2f}"),
                      _fmt(r.get("ceiling_tokens_per_s"), "{:.2f}"), str(r["target_calls"]),
                      str(r["draft_calls"]), "-" if share is None else f"{100 * share:.1f}",
                      _fmt(r.get("same_as_sd"), "{:.0%}"), "*" if r["pareto"] else ""))
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
