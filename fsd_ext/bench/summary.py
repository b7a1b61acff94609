"""One summary row per configuration (seeds pooled): pass@1, tokens/s, acceptance, speedups against
AR and SD, the Pareto flag; the table, summary.csv and summary.json."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .grid import Config

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
