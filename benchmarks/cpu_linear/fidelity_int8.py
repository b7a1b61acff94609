"""How far int8 activations move a model from its float32-activation self: next-token KL divergence and
top-1 agreement on real text, for each model of the pair.

For each HumanEval prompt (chat-formatted, as the frontier feeds it) the float32-activation model
writes a greedy continuation of --new-tokens tokens; both setups then read prompt + continuation in
one forward, and every position after the prompt's first token is compared:
    KL(p_float32 || p_int8) of the next-token distributions (temperature 1), the share of positions
    whose argmax agrees, and the largest |logit difference|.
Both setups hold the same weights (the GGUF file's codes); only the activations' arithmetic differs.

    python benchmarks/cpu_linear/fidelity_int8.py --problems 0-19 --out benchmarks/results/<run>

--pass-records A.jsonl B.jsonl instead compares the HumanEval pass@1 of one configuration (--key,
default AR) in two frontier runs' results.jsonl, problem by problem (fsd_ext.bench.summary.
paired_pass_difference: the difference, its 95% interval, McNemar's p-value).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_ext import models  # noqa: E402
from fsd_ext.bench import humaneval  # noqa: E402
from fsd_ext.generate import generate  # noqa: E402


def compare(name: str, problems, new_tokens: int) -> dict:
    reference, tokenizer = models.load(name, activations="float32")
    int8, _ = models.load(name, activations="int8")
    kls, agree, max_diff, positions = [], 0, 0.0, 0
    with torch.inference_mode():
        for problem in problems:
            text = humaneval.format_prompt(problem, tokenizer)
            ids = tokenizer(text, return_tensors="pt").input_ids
            sequence = generate(reference, None, ids, rule="ar", temperature=0.0, max_new_tokens=new_tokens).sequences
            p_logits = reference(sequence).logits[0, :-1].float()  # [positions, V]
            q_logits = int8(sequence).logits[0, :-1].float()
            p_log, q_log = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
            kls += (p_log.exp() * (p_log - q_log)).sum(-1).tolist()
            agree += int((p_logits.argmax(-1) == q_logits.argmax(-1)).sum())
            positions += p_logits.shape[0]
            max_diff = max(max_diff, float((p_logits - q_logits).abs().max()))
    kls.sort()
    return {"positions": positions, "kl_mean": statistics.fmean(kls), "kl_median": statistics.median(kls),
            "kl_p95": kls[int(0.95 * (len(kls) - 1))], "kl_max": kls[-1], "top1_agreement": agree / positions,
            "max_logit_diff": max_diff}


def passes(path: Path, key: str) -> dict:
    """{task_id: passed} of the records of configuration `key` in a frontier run's results.jsonl
    (the last record per problem)."""
    from fsd_ext.bench.store import RECORD_FIELDS, read_jsonl

    records, _ = read_jsonl(str(path), RECORD_FIELDS)  # bad lines skipped with a warning
    return {r["task_id"]: r["passed"] for r in records if r["key"] == key}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=f"{models.DEFAULT_TARGET},{models.DEFAULT_DRAFT}")
    parser.add_argument("--problems", default="0-19", help="HumanEval problem ids (ranges as fsd-ext bench)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a folder for fidelity.json")
    parser.add_argument("--pass-records", nargs=2, type=Path, default=None, metavar=("A", "B"))
    parser.add_argument("--key", default="ar/greedy", help="the configuration compared by --pass-records")
    args = parser.parse_args(argv)
    if args.pass_records:
        from fsd_ext.bench.summary import paired_pass_difference

        d = paired_pass_difference(*(passes(path, args.key) for path in args.pass_records))
        print(f"{args.key}: {d['pass_a']}/{d['problems']} (A) -> {d['pass_b']}/{d['problems']} (B): "
              f"{100 * d['difference']:+.1f} points, 95% interval [{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}], "
              f"A alone {d['only_a']}, B alone {d['only_b']}, McNemar p = {d['mcnemar_p']:.2f}")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "pass_at_1_paired.json").write_text(json.dumps(d, indent=1) + "\n")
        return 0
    torch.set_num_threads(args.threads)
    problems = humaneval.load_problems()
    chosen = [problems[i] for i in humaneval.parse_ids(args.problems)]
    results = {}
    for name in args.models.split(","):
        results[name] = compare(name, chosen, args.new_tokens)
        r = results[name]
        print(f"{name}: {r['positions']} positions, KL mean {r['kl_mean']:.2e} median {r['kl_median']:.2e} "
              f"p95 {r['kl_p95']:.2e} max {r['kl_max']:.2e}, top-1 agreement {100 * r['top1_agreement']:.2f}%, "
              f"largest |logit difference| {r['max_logit_diff']:.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
        (args.out / "fidelity.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
