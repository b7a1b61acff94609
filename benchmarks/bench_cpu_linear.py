"""Microbenchmark of the few-row CPU linear of decoding: fsd_ext's kernel (fsd_ext.cpu_linear,
csrc/fsd/cpu/skinny_gemm.cpp) against torch's F.linear, at the row counts speculative decoding
multiplies (1: a draft or AR step, 2: the draft's catch-up, K + 1: the target's verification).
With --dtype q4 / q8 / q8g32 the kernel is the one for a GGUF file's quantised weights
(cpu_linear.QuantWeightLinear, csrc/fsd/cpu/quant_gemm.cpp; random codes), against the bfloat16
kernel above (what a bfloat16 model runs) and F.linear in float32 (q8g32, GGUF's Q8_0 and Q5_0:
also against q8, how those were repacked before), and where the CPU has AMX-BF16,
against itself with its AMX path off (the AVX-512 loops; csrc/fsd/cpu/quant_amx.cpp).

Decoding reads each weight matrix once per forward from memory, not from cache, so each shape runs
on a set of distinct copies larger than the CPU's last-level cache (--set-mb), cycled through; the
table reports milliseconds per product, the weight bytes read per second, that as a share of the
read bandwidth measured in the same run (a float32 sum over --set-mb, with the same threads), and
F.linear's time over the kernel's. Every (shape, rows, path) runs --repeats times, interleaved, so
that a change of the machine's load hits them alike; the median is reported.

    python benchmarks/bench_cpu_linear.py                  # both models' shapes, bfloat16
    python benchmarks/bench_cpu_linear.py --shapes 0.5b --dtype float32 --rows 1,2 --threads 2
    python benchmarks/bench_cpu_linear.py --dtype q4 --rows 1,2,6 --threads 2
    python benchmarks/bench_cpu_linear.py --shapes 0.5b --dtype q8g32 --rows 1,2,6 --threads 2

Writes benchmarks/results/bench_cpu_linear.json.
"""

from __future__ import annotations

import argparse
import contextlib
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


QUANT_BYTES = {"q4": 0.75, "q8": 1.25, "q8g32": 1.125}  # per weight


def weight_set(out: int, inp: int, dtype, set_mb: int) -> list:
    """Distinct copies of an [out, in] matrix, together at least set_mb (one copy if larger):
    tensors of `dtype`, or for "q4" / "q8" / "q8g32" QuantWeightLinear layers with random codes."""
    bytes_per_weight = QUANT_BYTES.get(dtype) or torch.finfo(dtype).bits / 8
    copies = max(1, -(-set_mb * 2**20 // int(out * inp * bytes_per_weight)))
    if dtype in QUANT_BYTES:
        group, params, code_bytes = {"q4": (32, 8, 64), "q8": (16, 4, 64), "q8g32": (32, 4, 128)}[dtype]
        blocks = -(-out // 4)
        return [cpu_linear.QuantWeightLinear(torch.randint(0, 256, (blocks, inp // group, code_bytes), dtype=torch.uint8),
                                             torch.rand(blocks, inp // group, params) * 0.01, dtype, inp, out)
                for _ in range(copies)]
    return [torch.randn(out, inp).to(dtype) for _ in range(copies)]


def weight_bytes(weight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.codes.numel() + 4 * weight.params.numel()


NO_AMX = "kernel, no AMX"
Q8_BEFORE = "q8 kernel"


def time_per_product(fn, x, weights, path: str = "") -> float:
    with cpu_linear.use_quant_amx(False) if path == NO_AMX else contextlib.nullcontext():
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
    parser.add_argument("--dtype", choices=["float32", "bfloat16", *QUANT_BYTES], default="bfloat16",
                        help="the weights' dtype; q4 / q8 / q8g32: the quantised-weight kernel")
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
    quant = args.dtype in QUANT_BYTES
    rows_list = [int(r) for r in args.rows.split(",")]
    # path -> (function of x and one weight, the weights' dtype, the inputs' dtype)
    if quant:
        paths = {"kernel": (lambda x, layer: layer(x), args.dtype, torch.float32),
                 "bf16 kernel": (lambda x, w: native(x, w, None), torch.bfloat16, torch.bfloat16),
                 "F.linear": (lambda x, w: F.linear(x, w), torch.float32, torch.float32)}
        if args.dtype == "q8g32":  # GGUF's Q8_0 / Q5_0 as they were repacked before q8g32 existed
            paths[Q8_BEFORE] = paths["kernel"][0], "q8", torch.float32
        if cpu_linear.quant_linear_amx():  # the same kernel with its AMX path off: the vector loops
            paths[NO_AMX] = paths["kernel"]
    else:
        dtype = getattr(torch, args.dtype)
        paths = {"kernel": (lambda x, w: native(x, w, None), dtype, dtype),
                 "F.linear": (lambda x, w: F.linear(x, w), dtype, dtype)}

    bandwidth = read_bandwidth(args.set_mb, args.repeats)
    results = []
    torch.manual_seed(0)
    for name in names:
        out, inp = SHAPES[name]
        weights = {path: weight_set(out, inp, w_dtype, args.set_mb) for path, (_, w_dtype, _) in paths.items()}
        xs = {(rows, path): torch.randn(rows, inp).to(x_dtype)
              for rows in rows_list for path, (_, _, x_dtype) in paths.items()}
        times = {(rows, path): [] for rows in rows_list for path in paths}
        with torch.no_grad():
            for rows in rows_list:  # warm-up: first-call allocations, page faults
                for path, (fn, _, _) in paths.items():
                    time_per_product(fn, xs[(rows, path)], weights[path], path)
            for _ in range(args.repeats):
                for rows in rows_list:
                    for path, (fn, _, _) in paths.items():
                        times[(rows, path)].append(time_per_product(fn, xs[(rows, path)], weights[path], path))
        kernel_bytes = weight_bytes(weights["kernel"][0])
        for rows in rows_list:
            kernel = statistics.median(times[(rows, "kernel")])
            linear = statistics.median(times[(rows, "F.linear")])
            row = dict(shape=name, out=out, inp=inp, rows=rows, kernel_ms=kernel * 1e3,
                       f_linear_ms=linear * 1e3, kernel_gb_s=kernel_bytes / kernel / 1e9,
                       kernel_share_of_read_bw=kernel_bytes / kernel / bandwidth,
                       f_linear_over_kernel=linear / kernel)
            if quant:
                bf16 = statistics.median(times[(rows, "bf16 kernel")])
                row.update(bf16_kernel_ms=bf16 * 1e3, bf16_kernel_over_kernel=bf16 / kernel)
            if Q8_BEFORE in paths:
                q8 = statistics.median(times[(rows, Q8_BEFORE)])
                row.update(q8_kernel_ms=q8 * 1e3, q8_kernel_over_kernel=q8 / kernel)
            if NO_AMX in paths:
                vector = statistics.median(times[(rows, NO_AMX)])
                row.update(no_amx_kernel_ms=vector * 1e3, no_amx_over_kernel=vector / kernel)
            results.append(row)
        del weights

    print(f"{args.dtype}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"AVX512-BF16 path: {cpu_linear.bf16_dot_available()}; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; median of {args.repeats}")
    bf16_header = f" {'bf16 kernel ms':>15} {'bf16/kernel':>12}" if quant else ""
    if Q8_BEFORE in paths:
        bf16_header += f" {'q8 kernel ms':>12} {'q8/kernel':>10}"
    if NO_AMX in paths:
        bf16_header += f" {'no-AMX ms':>10} {'no-AMX/kernel':>14}"
    print(f"{'shape':<15} {'out x in':>12} {'rows':>4} {'kernel ms':>10} {'GB/s':>6} {'% read bw':>9} "
          f"{'F.linear ms':>12} {'F.linear/kernel':>16}{bf16_header}")
    for r in results:
        bf16_cells = f" {r['bf16_kernel_ms']:>15.3f} {r['bf16_kernel_over_kernel']:>11.2f}x" if quant else ""
        if "q8_kernel_ms" in r:
            bf16_cells += f" {r['q8_kernel_ms']:>12.3f} {r['q8_kernel_over_kernel']:>9.2f}x"
        if "no_amx_kernel_ms" in r:
            bf16_cells += f" {r['no_amx_kernel_ms']:>10.3f} {r['no_amx_over_kernel']:>13.2f}x"
        print(f"{r['shape']:<15} {r['out']:>6}x{r['inp']:<5} {r['rows']:>4} {r['kernel_ms']:>10.3f} "
              f"{r['kernel_gb_s']:>6.1f} {100 * r['kernel_share_of_read_bw']:>8.0f}% "
              f"{r['f_linear_ms']:>12.3f} {r['f_linear_over_kernel']:>15.2f}x{bf16_cells}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), read_bandwidth_gb_s=bandwidth / 1e9, machine=platform.machine(),
                cpu_vendor=cpu_linear.cpu_vendor(), cpu_count=os.cpu_count(),
                threads=torch.get_num_threads(), torch=torch.__version__,
                bf16_dot=cpu_linear.bf16_dot_available(), quant_path=cpu_linear.quant_linear_path(),
                quant_amx=cpu_linear.quant_linear_amx())
    Path(args.output).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.output}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
