"""The sweep's plots (matplotlib, Agg backend): frontier.png, pass_vs_accepted.png,
threshold_vs_acceptance.png, and rules_frontier.png (pass@1 against tokens per target call, one line
per lenient rule)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Dict, List, Sequence

from ..types import DIVERGENCE_RULES, DIVERGENCES, LENIENT_RULES, rule_spec
from .summary import _reference_row, pareto_front

_DIV_COLORS = {"js": "tab:blue", "rkl": "tab:orange", "kl": "tab:green", "tv": "tab:purple",
               "mkl": "tab:brown"}
_RULE_COLORS = {"typical": "tab:olive", "typical_strict": "tab:olive", "lenient_sd": "tab:cyan",
                "prob_floor": "tab:pink", "rank": "tab:gray", "rank_strict": "tab:gray", "cascade": "tab:red"}


def _style(rule: str, divergence: str):
    """(name, color, marker) of a lenient rule's points: fsd colored by divergence, the others by
    rule; strict forms as triangles."""
    marker = "^" if rule_spec(rule).strict else "o"
    if rule in DIVERGENCE_RULES:
        name = "FSD" if rule == "fsd" else "FSD-strict"
        return f"{name} {divergence}", _DIV_COLORS.get(divergence, "gray"), marker
    return rule, _RULE_COLORS.get(rule, "gray"), marker


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _percent_ylim(ax, rows):
    """A pass@1 axis that shows every row, readable even when all have the same pass@1."""
    passes = [100 * r["pass_at_1"] for r in rows]
    if passes:
        ax.set_ylim(max(-1.0, min(passes) - 5), min(101.0, max(passes) + 5))


def _scatter_rows(ax, rows, xkey, annotate=True):
    for r in rows:
        x, y = r[xkey], 100 * r["pass_at_1"]
        if r["rule"] == "ar":
            ax.scatter(x, y, marker="*", s=220, color="black", zorder=5, label="AR")
        elif r["rule"] == "sd":
            ax.scatter(x, y, marker="s", s=110, color="red", zorder=5, label="SD")
        else:
            name, color, marker = _style(r["rule"], r["divergence"])
            ax.scatter(x, y, marker=marker, s=50, zorder=4, color=color, label=name)
            if annotate:
                ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color="dimgray")
    _percent_ylim(ax, rows)
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
    _scatter_rows(ax, [r for r in rows if r["tokens_per_s"] is not None], "tokens_per_s")
    front = pareto_front(rows)
    if front:
        xs = [r["tokens_per_s"] for r in front]
        ys = [100 * r["pass_at_1"] for r in front]
        ax.step(xs, ys, where="pre", color="gray", linestyle="--", linewidth=1, zorder=3)
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("pass@1 (%)")
    ax.set_title("Accuracy vs speed (labels: threshold; dashed: Pareto frontier)" + suffix, fontsize=10)
    paths.append(_save(fig, plt, out_dir, "frontier.png"))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    _scatter_rows(ax, rows, "mean_accepted")
    ax.set_xlabel("mean accepted drafts per target call (verification step)")
    ax.set_ylabel("pass@1 (%)")
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

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r["rule"] in ("ar", "sd"):
            _scatter_rows(ax, [r], "tokens_per_target_call", annotate=False)
    lines = defaultdict(list)  # (rule, divergence) -> its rows
    for r in rows:
        if r["rule"] in LENIENT_RULES:
            lines[r["rule"], r["divergence"]].append(r)
    for (rule, divergence), line in sorted(lines.items()):
        name, color, marker = _style(rule, divergence)
        pts = sorted((r["tokens_per_target_call"], 100 * r["pass_at_1"], r["threshold"]) for r in line)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=name,
                linestyle="--" if marker == "^" else "-")
        for x, y, knob in pts:
            ax.annotate(f"{knob:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color="dimgray")
    # Every row, not only the AR / SD ones _scatter_rows saw (a lenient row fell off the axis).
    _percent_ylim(ax, [r for r in rows if r["rule"] in ("ar", "sd") or r["rule"] in LENIENT_RULES])
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    ax.set_xlabel("tokens per target call")
    ax.set_ylabel("pass@1 (%)")
    ax.set_title("Accuracy vs tokens per target call, one line per rule" + suffix, fontsize=10)
    paths.append(_save(fig, plt, out_dir, "rules_frontier.png"))
    return paths


def _save(fig, plt, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
