"""Microbenchmark of the few-row CPU linear of decoding: fsd_ext's kernel (fsd_ext.cpu_linear,
csrc/fsd/cpu/skinny_gemm.cpp) against torch's F.linear, at the row counts speculative decoding
multiplies (1: a draft or AR step, 2: the draft's catch-up, K + 1: the target's verification).

Decoding reads each weight matrix once per forward from memory, not from cache, so each shape runs
on a set of distinct copies larger than the CPU's last-level cache (--set-mb), cycled through; the
table reports milliseconds per product, the weight bytes read per second, that as a share of the
read bandwidth measured in the same run (a float32 sum over --set-mb, with the same threads), and
F.linear's time over the kernel's. Every (shape, rows, path) runs --repeats times, interleaved, so
that a change of the machine's load hits them alike; the median is reported.

    python benchmarks/bench_cpu_linear.py                  # both models' shapes, bfloat16
    python benchmarks/bench_cpu_linear.py --shapes 0.5b --dtype float32 --rows 1,2 --threads 2

Writes benchmarks/results/bench_cpu_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fsd_ext import cpu_linear  # noqa: E402

# (out, in) of the default model pair's linears (Qwen2.5(-Coder) 1.5B target, 0.5B draft; k_proj:
# 2 heads of 128 in both), tied output layers included.
SHAPES = {
    "1.5b/q_proj": (1536, 1536), "1.5b/k_proj": (256, 1536), "1.5b/gate_proj": (8960, 1536),
    "1.5b/down_proj": (1536, 8960), "1.5b/lm_head": (151936, 1536),
    "0.5b/q_proj": (896, 896), "0.5b/k_proj": (128, 896), "0.5b/gate_proj": (4864, 896),
    "0.5b/down_proj": (896, 4864), "0.5b/lm_head": (151936, 896),
}


def read_bandwidth(megabytes: int, repeats: int) -> float:
    """Bytes per second of a float32 sum over `megabytes` (a read-only stream, like the weights')."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times)


def weight_set(out: int, inp: int, dtype: torch.dtype, set_mb: int) -> list:
    """Distinct copies of an [out, in] matrix, together at least set_mb (one copy if larger)."""
    one = out * inp * torch.finfo(dtype).bits // 8
    copies = max(1, -(-set_mb * 2**20 // one))
    return [torch.randn(out, inp).to(dtype) for _ in range(copies)]


def time_per_product(fn, x, weights) -> float:
    start = time.perf_counter()
    for w in weights:
        fn(x, w)
    return (time.perf_counter() - start) / len(weights)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"of {', '.join(SHAPES)}; a prefix (1.5b, 0.5b) takes all of a model's")
    parser.add_argument("--rows", default="1,2,4,6")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--set-mb", type=int, default=512,
                        help="weights cycled through per shape: more than the last-level cache")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "bench_cpu_linear.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu_linear._native_op()
    if native is None:
        sys.exit("the fsd_ext extension is not built: nothing to measure")
    names = [name for wanted in args.shapes.split(",") for name in SHAPES
             if name == wanted or name.startswith(wanted + "/")]
    if not names:
        parser.error(f"--shapes {args.shapes!r} names none of {', '.join(SHAPES)}")
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    paths = {"kernel": lambda x, w: native(x, w, None), "F.linear": lambda x, w: F.linear(x, w)}

    bandwidth = read_bandwidth(args.set_mb, args.repeats)
    results = []
    torch.manual_seed(0)
    for name in names:
        out, inp = SHAPES[name]
        weights = weight_set(out, inp, dtype, args.set_mb)
        xs = {rows: torch.randn(rows, inp).to(dtype) for rows in rows_list}
        times = {(rows, path): [] for rows in rows_list for path in paths}
        with torch.no_grad():
            for rows in rows_list:  # warm-up: first-call allocations, page faults
                for fn in paths.values():
                    time_per_product(fn, xs[rows], weights)
            for _ in range(args.repeats):
                for rows in rows_list:
                    for path, fn in paths.items():
                        times[(rows, path)].append(time_per_product(fn, xs[rows], weights))
        weight_bytes = weights[0].numel() * weights[0].element_size()
        for rows in rows_list:
            kernel = statistics.median(times[(rows, "kernel")])
            linear = statistics.median(times[(rows, "F.linear")])
            results.append(dict(shape=name, out=out, inp=inp, rows=rows, kernel_ms=kernel * 1e3,
                                f_linear_ms=linear * 1e3, kernel_gb_s=weight_bytes / kernel / 1e9,
                                kernel_share_of_read_bw=weight_bytes / kernel / bandwidth,
                                f_linear_over_kernel=linear / kernel))
        del weights

    print(f"{args.dtype}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"AVX512-BF16 path: {cpu_linear.bf16_dot_available()}; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; median of {args.repeats}")
    print(f"{'shape':<15} {'out x in':>12} {'rows':>4} {'kernel ms':>10} {'GB/s':>6} {'% read bw':>9} "
          f"{'F.linear ms':>12} {'F.linear/kernel':>16}")
    for r in results:
        print(f"{r['shape']:<15} {r['out']:>6}x{r['inp']:<5} {r['rows']:>4} {r['kernel_ms']:>10.3f} "
              f"{r['kernel_gb_s']:>6.1f} {100 * r['kernel_share_of_read_bw']:>8.0f}% "
              f"{r['f_linear_ms']:>12.3f} {r['f_linear_over_kernel']:>15.2f}x")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), read_bandwidth_gb_s=bandwidth / 1e9, machine=platform.machine(),
                cpu_vendor=cpu_linear.cpu_vendor(), cpu_count=os.cpu_count(),
                threads=torch.get_num_threads(), torch=torch.__version__,
                bf16_dot=cpu_linear.bf16_dot_available())
    Path(args.output).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.output}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
