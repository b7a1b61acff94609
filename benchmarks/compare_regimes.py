"""The lenient rules' gain over SD in two regimes (greedy and sampled frontier runs), paired.

For each rule at a budget: tokens per target call over SD's in each regime, the sampled gain minus
the greedy one, and pass@1 minus SD's, each with a 95% percentile bootstrap over the problems both
runs decoded (a problem's seeds stay together; the same resampled problems for every quantity of a
row, so the regimes are paired too). Per budget it also compares the rule with the most tokens per
target call with the runner-up, and with --versus RULE every other rule with RULE. Example (the
lenient-rules results folders):

    python benchmarks/compare_regimes.py --ids 0-44 \\
        --greedy benchmarks/results/lenient-rules-humaneval-greedy-zen4 \\
        --sampled benchmarks/results/lenient-rules-humaneval-sampled-zen4 \\
        --pair "fsd 2%" fsd/js/T=0.1/K=5/greedy "fsd/js/T=0.06/K=5/t=0.6,top_p=0.9" ...
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from typing import Dict, Sequence, Tuple

from fsd_ext.bench.humaneval import parse_ids
from fsd_ext.bench.summary import bootstrap

Counts = Dict[str, Tuple[int, int, float]]  # task -> (new tokens, target calls, pass rate)


def load(folder: str, tasks: set) -> Dict[str, Counts]:
    """group -> task -> (tokens, target calls, pass rate), seeds pooled per task."""
    acc = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0]))
    with open(os.path.join(folder, "results.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            r = json.loads(line)
            if r["task_id"] not in tasks:
                continue
            cell = acc[r["group"]][r["task_id"]]
            cell[0] += r["new_tokens"]
            cell[1] += r["target_calls"]
            cell[2] += bool(r["passed"])
            cell[3] += 1
    return {g: {t: (c[0], c[1], c[2] / c[3]) for t, c in by.items()} for g, by in acc.items()}


def gain(rule: Counts, sd: Counts, tasks: Sequence[str]) -> float:
    """Pooled tokens per target call of `rule` over SD's on `tasks` (repeats count again)."""
    mine = sum(rule[t][0] for t in tasks) / sum(rule[t][1] for t in tasks)
    ref = sum(sd[t][0] for t in tasks) / sum(sd[t][1] for t in tasks)
    return mine / ref


def pass_delta(rule: Counts, sd: Counts, tasks: Sequence[str]) -> float:
    return sum(rule[t][2] - sd[t][2] for t in tasks) / len(tasks)


def fmt(value: Tuple[float, float, float], scale: float = 1.0, sign: bool = False) -> str:
    form = "{:+.1f}" if sign else "{:.3f}"
    return " ".join([form.format(value[0] * scale),
                     "[" + ", ".join(form.format(v * scale) for v in value[1:]) + "]"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--greedy", required=True, help="a frontier run's folder (results.jsonl)")
    parser.add_argument("--sampled", required=True)
    parser.add_argument("--ids", required=True, help="HumanEval problem numbers, e.g. 0-44")
    parser.add_argument("--greedy-sd", default="sd/K=5/greedy")
    parser.add_argument("--sampled-sd", default="sd/K=5/t=0.6,top_p=0.9")
    parser.add_argument("--pair", nargs=3, action="append", required=True,
                        metavar=("'RULE BUDGET'", "GREEDY_GROUP", "SAMPLED_GROUP"),
                        help="a rule at a budget and its group in each run ('-': not run there)")
    parser.add_argument("--versus", default=None, metavar="RULE",
                        help="also each rule minus RULE (as named in --pair) at each budget and regime: "
                             "tokens per target call and pass@1")
    args = parser.parse_args(argv)
    wanted = {f"HumanEval/{i}" for i in parse_ids(args.ids)}
    runs = {"greedy": load(args.greedy, wanted), "sampled": load(args.sampled, wanted)}
    sds = {"greedy": runs["greedy"][args.greedy_sd], "sampled": runs["sampled"][args.sampled_sd]}
    for p in args.pair:
        for name, group in (("greedy", p[1]), ("sampled", p[2])):
            if group != "-" and group not in runs[name]:
                raise SystemExit(f"{p[0]}: no group {group!r} in the {name} run; it has "
                                 f"{', '.join(sorted(runs[name]))}")
    named = [(name, runs[name][group]) for p in args.pair
             for name, group in (("greedy", p[1]), ("sampled", p[2])) if group != "-"]
    used = [sds[name] for name in {name for name, _ in named}]  # (not the SD of a regime no pair uses)
    # (sorted as the summary sorts them: the same bootstrap draws give the same pass@1 intervals)
    tasks = sorted(set.intersection(wanted, *(set(g) for g in [*used, *(g for _, g in named)])))
    if not tasks:
        raise SystemExit("no problem was decoded by every configuration named")
    print(f"{len(tasks)} problems decoded by every configuration named; 95% paired bootstrap intervals\n")
    print("| rule, budget | greedy: tokens/call vs SD | sampled: vs SD | sampled minus greedy | "
          "greedy: pass@1 minus SD (points) | sampled: pass@1 minus SD |")
    print("|---|---|---|---|---|---|")
    per_budget = defaultdict(list)
    for label, g_group, s_group in args.pair:
        cells = []
        for name, group in (("greedy", g_group), ("sampled", s_group)):
            cells.append("-" if group == "-" else fmt(bootstrap(
                lambda ts, r=runs[name][group], sd=sds[name]: gain(r, sd, ts), tasks)))
        if "-" in (g_group, s_group):
            cells.append("-")
        else:
            cells.append(fmt(bootstrap(lambda ts: gain(runs["sampled"][s_group], sds["sampled"], ts)
                                       - gain(runs["greedy"][g_group], sds["greedy"], ts), tasks)))
        for name, group in (("greedy", g_group), ("sampled", s_group)):
            cells.append("-" if group == "-" else fmt(bootstrap(
                lambda ts, r=runs[name][group], sd=sds[name]: pass_delta(r, sd, ts), tasks), 100, True))
        print(f"| {label} | " + " | ".join(cells) + " |")
        per_budget[label.split()[-1]].append((label, g_group, s_group))
    print()
    for budget, rows in per_budget.items():
        for name, column in (("greedy", 1), ("sampled", 2)):
            ranked = sorted((gain(runs[name][r[column]], sds[name], tasks), r[0], r[column])
                            for r in rows if r[column] != "-")
            if len(ranked) < 2:
                continue
            (_, second, g2), (_, best, g1) = ranked[-2], ranked[-1]
            diff = bootstrap(lambda ts: gain(runs[name][g1], sds[name], ts)
                             - gain(runs[name][g2], sds[name], ts), tasks)
            print(f"{budget}, {name}: most tokens per target call {best}, minus the runner-up "
                  f"{second}: {fmt(diff)} (in units of SD's tokens per target call)")
            base = next((r[column] for r in rows if r[0] == f"{args.versus} {budget}"), "-")
            for label, *groups in rows:
                if base != "-" and groups[column - 1] not in ("-", base):
                    mine, theirs = runs[name][groups[column - 1]], runs[name][base]
                    diff = bootstrap(lambda ts: gain(mine, sds[name], ts) - gain(theirs, sds[name], ts), tasks)
                    passed = bootstrap(lambda ts: pass_delta(mine, theirs, ts), tasks)
                    print(f"    {label} minus {args.versus} {budget}, {name}: {fmt(diff)}; "
                          f"pass@1 {fmt(passed, 100, True)} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
