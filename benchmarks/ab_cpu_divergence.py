"""CPU A/B of fsd_ext.divergence between two checkouts, robust to a machine whose speed drifts.

A small cloud machine's speed drifts by more than a few percent between runs minutes apart, so
two separate benchmark runs cannot show a 5% change. This runs the two builds alternately, each in
a fresh process (the extensions register the same torch ops, so they cannot share one), back to
back for a number of rounds (the order flips every round), and reports per configuration the
median over rounds of that round's B / A time ratio: drift slower than a round cancels.
JS / TV or div_top_k rows whose code did not change make the control (their ratio should be 1).

    python setup.py build_ext --inplace   # in both checkouts
    python benchmarks/ab_cpu_divergence.py /path/to/old-checkout /path/to/new-checkout --rounds 20
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KINDS = ("kl", "rkl", "js", "mkl", "tv")


def measure(batch: int, vocab: int, calls: int, threads: int) -> dict:
    """One process's medians (microseconds) per divergence / dtype / div_top_k."""
    import torch

    import fsd_ext

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    draft_vocab = vocab - 271  # a draft vocabulary a little smaller, as Qwen2.5's pairs have
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = (torch.randn(batch, vocab) * 3).to(dtype)
        draft = (target[:, :draft_vocab].float() + torch.randn(batch, draft_vocab)).to(dtype)
        for kind in KINDS:
            for top_k in (None, 10):
                def step():
                    fsd_ext.divergence(target, draft, kind, top_k=top_k)

                step(), step()
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                out[f"{kind}/{str(dtype)[6:]}/top_k={top_k}"] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="checkout A (the baseline), with its extension built in place")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=9, help="calls per configuration per process (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write every round's medians here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.batch, args.vocab, args.calls, args.threads)))
        return

    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    runs = {"A": [], "B": []}
    worker = [sys.executable, os.path.abspath(__file__), "--worker", args.a, args.b, "--batch", str(args.batch),
              "--vocab", str(args.vocab), "--calls", str(args.calls), "--threads", str(args.threads)]
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            env = dict(os.environ, PYTHONPATH=trees[name])
            done = subprocess.run(worker, env=env, capture_output=True, text=True, cwd=trees[name])
            if done.returncode != 0:
                sys.exit(f"checkout {name} ({trees[name]}) failed:\n{done.stderr[-2000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": trees, "args": vars(args), "runs": runs}, f, indent=1)

    print(f"A = {trees['A']}\nB = {trees['B']}\nB={args.batch} V={args.vocab}, {args.threads} threads, "
          f"{args.rounds} rounds, median of {args.calls} calls per process")
    print(f"| configuration | A us | B us | B / A (median of rounds) | min..max |\n|---|---|---|---|---|")
    for key in runs["A"][0]:
        ratios = [b[key] / a[key] for a, b in zip(runs["A"], runs["B"])]
        a_us = statistics.median(run[key] for run in runs["A"])
        b_us = statistics.median(run[key] for run in runs["B"])
        print(f"| {key} | {a_us:.1f} | {b_us:.1f} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.3f}..{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
