"""Prompt rows through a GGUF checkpoint's quantised linear layers (cpu_linear.QuantWeightLinear,
more than 16 rows, bfloat16 products): the AMX tiles of quant_linear_prompt (csrc/fsd/cpu/quant_amx.cpp)
against the path without them (quant_dequantize's bfloat16 rows of W, then torch.mm), both in the
same run, interleaved, on random codes of the Qwen2.5-Coder shapes. Also each path's largest error
against the float64 product of the bfloat16-rounded operands (the tiles sum in float32 and do not
round y; the mm path's y is bfloat16).

    python benchmarks/bench_prompt_linear.py --threads 2 --rows 64,200,600 --repeats 7 --out prompt.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from fsd_ext import cpu_linear

SHAPES = {  # name: (out, in, format)
    "1.5b/q_proj": (1536, 1536, "q4"), "1.5b/k_proj": (256, 1536, "q4"), "1.5b/gate_proj": (8960, 1536, "q4"),
    "1.5b/down_proj": (1536, 8960, "q4"), "0.5b/q_proj": (896, 896, "q8"), "0.5b/gate_proj": (4864, 896, "q8"),
}


def random_layer(out: int, inp: int, fmt: str) -> cpu_linear.QuantWeightLinear:
    group, params = (32, 8) if fmt == "q4" else (16, 4)
    blocks = -(-out // 4)
    codes = torch.randint(0, 256, (blocks, inp // group, 64), dtype=torch.uint8)
    layer = cpu_linear.QuantWeightLinear(codes, torch.rand(blocks, inp // group, params) * 0.02, fmt, inp, out)
    layer.prompt_dtype = torch.bfloat16
    return layer


def seconds(layer, x, tiles: bool) -> float:
    with cpu_linear.use_quant_amx(tiles):
        start = time.perf_counter()
        layer(x)
        return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,200,600")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_linear.quant_linear_amx():
        raise SystemExit("this CPU (or build) has no AMX-BF16 tiles: nothing to compare")
    results = []
    torch.manual_seed(0)
    print(f"{'shape':<16} {'rows':>5} {'tiles ms':>9} {'GFLOP/s':>8} {'mm ms':>8} {'mm/tiles':>8} "
          f"{'err tiles':>9} {'err mm':>9}")
    for name, (out, inp, fmt) in SHAPES.items():
        layer = random_layer(out, inp, fmt)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inp)
            times = {True: [], False: []}
            with torch.inference_mode():
                for tiles in (True, False):  # warm-up
                    seconds(layer, x, tiles)
                for _ in range(args.repeats):
                    for tiles in (True, False):
                        times[tiles].append(seconds(layer, x, tiles))
                exact = F.linear(x.bfloat16().double(), layer.dequantized_weight().bfloat16().double())
                errors = {}
                for tiles in (True, False):
                    with cpu_linear.use_quant_amx(tiles):
                        errors[tiles] = (layer(x).double() - exact).abs().max().item()
            tiles_ms, mm_ms = (statistics.median(times[t]) * 1e3 for t in (True, False))
            row = dict(shape=name, out=out, inp=inp, format=fmt, rows=rows, tiles_ms=tiles_ms, mm_ms=mm_ms,
                       speedup=mm_ms / tiles_ms, gflops=2 * rows * out * inp / tiles_ms / 1e6,
                       max_error_tiles=errors[True], max_error_mm=errors[False])
            results.append(row)
            print(f"{name:<16} {rows:>5} {tiles_ms:>9.3f} {row['gflops']:>8.0f} {mm_ms:>8.3f} {row['speedup']:>8.2f} "
                  f"{errors[True]:>9.1e} {errors[False]:>9.1e}", flush=True)
    if args.out:
        meta = dict(machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                    torch=torch.__version__, repeats=args.repeats, command="python benchmarks/bench_prompt_linear.py "
                    + " ".join(argv if argv is not None else __import__("sys").argv[1:]))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
