"""Kernel microbenchmark of one verification step (fsd_ext.accept).

Compares the fused op with the pure-torch reference run eagerly in float32 and with
torch.compile of that reference, over (B, K, V) shapes, dtypes and rules. Reports the median of
repeated runs, the achieved bandwidth of the logits read (B * (2K + 1) * V elements) and, beside it,
a memory-copy bandwidth measured in the same run. Prints a table and writes JSON.

    python benchmarks/bench_accept.py                 # CPU, the issue's shapes
    python benchmarks/bench_accept.py --device cuda   # on a GPU (CUDA events, graph-free timing)
    python benchmarks/bench_accept.py --shapes 8x5x151936 --rules sd fsd --filters top_k=50 top_p=0.95
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import fsd_ext
from fsd_ext import reference

SHAPES = [(1, 5, 32000), (8, 5, 151936), (32, 4, 128256)]
RULES = ["greedy", "sd", "fsd", "fsd_strict"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device, megabytes=512, repeats=5):
    """Bytes read plus written per second by a large tensor copy."""
    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / seconds


def make_inputs(batch, k, vocab, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2  # [B, K+1, V]
    draft = 0.8 * target[:, :k] + 0.6 * torch.randn(batch, k, vocab, generator=gen) * 2  # [B, K, V]
    tokens = torch.randint(0, vocab, (batch, k), generator=gen)  # [B, K]
    return target.to(device, dtype), draft.to(device, dtype), tokens.to(device)


def reference_step(target, draft, tokens, coins, samples, rule, filters):
    """The reference in float32 with its uniforms drawn beforehand (the baselines are not charged
    for Philox in tensor arithmetic; the fused op draws its own)."""
    return reference.accept(target, draft, tokens, rule=rule, divergence="js", threshold=0.3,
                            coin_uniforms=coins, sample_uniforms=samples, compute_dtype=torch.float32,
                            **filters)


def parse_filters(spec: str) -> dict:
    """'none', or comma-separated sampling filters: 'top_k=50,top_p=0.95' -> {top_k: 50, top_p: 0.95}."""
    if spec == "none":
        return {}
    filters = {}
    for item in spec.split(","):
        name, value = item.split("=")
        if name not in ("top_k", "top_p", "min_p"):
            raise ValueError(f"--filters: unknown filter {name!r} (top_k, top_p, min_p)")
        filters[name] = int(value) if name == "top_k" else float(value)
    return filters


def parse_shape(spec: str) -> tuple:
    batch, k, vocab = (int(part) for part in spec.split("x"))
    return batch, k, vocab


def merge_rows(old, new):
    """`old` rows updated with `new` ones (same shape, dtype and rule), in a stable order."""
    def key(row):
        return row["batch"], row["k"], row["vocab"], row["dtype"], row["rule"], row.get("filters", "none")
    merged = {key(row): row for row in old}
    merged.update({key(row): row for row in new})
    return sorted(merged.values(), key=lambda row: (row["vocab"], row["batch"], row["dtype"], row.get("filters", "none"),
                                                    RULES.index(row["rule"])))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES, metavar="BxKxV")
    parser.add_argument("--filters", nargs="+", default=["none"], metavar="SPEC",
                        help="sampling filters per run: none, or e.g. top_k=50 top_p=0.95 top_k=50,top_p=0.95")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--quick", action="store_true", help="first shape only, 3 repeats")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of an existing --json file that this run does not re-measure")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "bench_accept_cpu.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = args.shapes[:1] if args.quick else args.shapes
    repeats = 3 if args.quick else args.repeats
    # One compiled graph per (shape, dtype, rule): lift dynamo's recompile limit so none falls
    # back to eager.
    torch._dynamo.config.recompile_limit = 64
    compiled_reference = None if args.no_compile else torch.compile(reference_step)

    copy_bytes_per_s = copy_bandwidth(device)
    machine = (torch.cuda.get_device_name() if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                    f"{torch.get_num_threads()} torch threads")
    print(f"machine: {machine}; torch {torch.__version__}; copy bandwidth {copy_bytes_per_s / 1e9:.1f} GB/s")
    header = (f"{'B':>3} {'K':>2} {'V':>7} {'dtype':>8} {'filters':>16} {'rule':>10} | {'fused ms':>9} {'GB/s':>6} "
              f"{'%copy':>6} | {'eager ms':>9} {'x eager':>8} | {'compile ms':>10} {'x compile':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for batch, k, vocab in shapes:
        for dtype_name in args.dtypes:
            target, draft, tokens = make_inputs(batch, k, vocab, DTYPES[dtype_name], device)
            coins = fsd_ext.philox_uniforms(0, 0, batch, k, "accept")  # [B, K]
            samples = fsd_ext.philox_uniforms(0, 0, batch, k + 1, "sample")  # [B, K+1]
            logit_bytes = (target.numel() - batch * vocab + draft.numel() + batch * vocab) * target.element_size()
            for spec, rule in [(spec, rule) for spec in args.filters for rule in args.rules]:
                filters = parse_filters(spec)
                if filters and rule == "greedy":
                    continue  # the greedy rule ignores sampling filters
                fused = median_seconds(lambda: fsd_ext.accept(target, draft, tokens, rule=rule, divergence="js",
                                                              threshold=0.3, seed=0, **filters), device, repeats)
                eager = median_seconds(lambda: reference_step(target, draft, tokens, coins, samples, rule, filters),
                                       device, max(1, repeats // 2 + 1))
                compiled = (median_seconds(lambda: compiled_reference(target, draft, tokens, coins, samples, rule,
                                                                      filters),
                                           device, max(1, repeats // 2 + 1), warmup=2)
                            if compiled_reference else float("nan"))
                row = dict(batch=batch, k=k, vocab=vocab, dtype=dtype_name, rule=rule, filters=spec, fused_ms=fused * 1e3,
                           eager_ms=eager * 1e3, compiled_ms=compiled * 1e3,
                           gb_per_s=logit_bytes / fused / 1e9, copy_gb_per_s=copy_bytes_per_s / 1e9,
                           pct_copy=100 * logit_bytes / fused / copy_bytes_per_s,
                           speedup_eager=eager / fused, speedup_compiled=compiled / fused)
                rows.append(row)
                print(f"{batch:>3} {k:>2} {vocab:>7} {dtype_name:>8} {spec:>16} {rule:>10} | {row['fused_ms']:>9.2f} "
                      f"{row['gb_per_s']:>6.1f} {row['pct_copy']:>5.0f}% | {row['eager_ms']:>9.1f} "
                      f"{row['speedup_eager']:>7.1f}x | {row['compiled_ms']:>10.1f} {row['speedup_compiled']:>8.1f}x",
                      flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    if args.merge and os.path.exists(args.json):
        rows = merge_rows(json.load(open(args.json))["rows"], rows)
    with open(args.json, "w") as f:  # each row carries the copy bandwidth of the run that measured it
        json.dump(dict(machine=machine, torch=torch.__version__, repeats=repeats, rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
