"""Microbenchmark of the CPU linear component's few-row kernels (fsd_ext.cpu_linear) against what
PyTorch and torchao ship for the same job, at the row counts speculative decoding multiplies (1: a
draft or AR step, 2: the draft's catch-up, K + 1: the target's verification).

For each linear shape of the default pair, every path multiplies x by a weight stored its own way
(x float32 unless said):

    fsd int8 q4k   QuantInt8Linear Q4_K (x quantised to int8 per 32 features, int8 dot products; 0.58 B)
    fsd int8 q6k   QuantInt8Linear Q6_K (0.82 B)
    fsd int8 q5_0  QuantInt8Linear Q5_0 (0.69 B)
    fsd int8 q8_0  QuantInt8Linear Q8_0 (1.06 B)
    torch dyn int8 torch.ao's dynamic quantized Linear (int8 weights with a scale per output row, x
                   quantised per call with one scale; 1 B), each of torch's quantized engines:
                   "(x86)", "(fbgemm)", "(onednn)"
    fsd q4         QuantWeightLinear "q4" (GGUF Q4_K / Q4_0 / Q4_1 codes, 0.75 B a weight)
    torch int4     aten._weight_int4pack_mm_for_cpu, group 32 (0.75 B)
    fsd q8g32      QuantWeightLinear "q8g32" (GGUF Q8_0 / Q5_0 codes, 1.125 B)
    fsd q8         QuantWeightLinear "q8" (GGUF Q6_K codes, a scale per 16, 1.25 B)
    torch int8     aten._weight_int8pack_mm, one scale per output row (1 B; not GGUF's groups)
    torchao int8   torchao's Int8WeightOnlyConfig on an nn.Linear (when torchao imports)
    fsd bf16       skinny_linear, bfloat16 weight (Bfloat16WeightLinear, 2 B)
    fsd bf16 x16   skinny_linear, bfloat16 weight and x (a bfloat16 model; AVX512-BF16 path)
    F.linear bf16  torch's GEMM, bfloat16 weight and x
    fsd f32        skinny_linear, float32 weight (4 B)
    F.linear f32   torch's GEMM, float32 weight

Each path cycles through distinct weight copies larger than the last-level cache (decoding reads
every weight from memory). torch's two weight-only ops take their vectorised paths for bfloat16
inputs only (float32 x: 15-60x slower, torch 2.13 on AVX-512), so they get x, scales and zeros in
bfloat16 (the rounding a bfloat16 model has), the fsd paths float32 x, all paths interleaved per repeat; the median is reported, and each
path's time over the best fsd path of the same weight bytes class.

    python benchmarks/cpu_linear/bench_cpu_linear.py --rows 1,6 --threads 2
    python benchmarks/cpu_linear/bench_cpu_linear.py --shapes 0.5b --paths "fsd q8g32,torch int8"

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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from fsd_ext import cpu_linear  # noqa: E402

SHAPES = {
    "1.5b/q_proj": (1536, 1536), "1.5b/k_proj": (256, 1536), "1.5b/gate_proj": (8960, 1536),
    "1.5b/down_proj": (1536, 8960), "1.5b/lm_head": (151936, 1536),
    "0.5b/q_proj": (896, 896), "0.5b/k_proj": (128, 896), "0.5b/gate_proj": (4864, 896),
    "0.5b/down_proj": (896, 4864), "0.5b/lm_head": (151936, 896),
}
INT8_TYPES = {"fsd int8 q4k": "Q4_K", "fsd int8 q6k": "Q6_K", "fsd int8 q5_0": "Q5_0", "fsd int8 q8_0": "Q8_0"}
BYTES = {"fsd int8 q4k": 0.58, "fsd int8 q6k": 0.82, "fsd int8 q5_0": 0.69, "fsd int8 q8_0": 1.06,
         "torch dyn int8 (x86)": 1.0, "torch dyn int8 (fbgemm)": 1.0, "torch dyn int8 (onednn)": 1.0,
         "fsd q4": 0.75, "torch int4": 0.75, "fsd q8g32": 1.125, "fsd q8": 1.25, "torch int8": 1.0,
         "torchao int8": 1.0, "fsd bf16": 2.0, "fsd bf16 x16": 2.0, "F.linear bf16": 2.0, "fsd f32": 4.0,
         "F.linear f32": 4.0}


def _torchao_int8(out: int, inp: int):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception:  # not installed, or not for this torch
        return None
    layer = torch.nn.Linear(inp, out, bias=False)
    quantize_(layer, Int8WeightOnlyConfig())
    return layer


def _torch_dynamic_int8(engine: str, out: int, inp: int):
    """torch.ao's dynamic quantized Linear packed for `engine` (called under the same engine)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    torch.backends.quantized.engine = engine
    layer = DynamicLinear(inp, out, dtype=torch.qint8)
    w = torch.randn(out, inp) * 0.02
    scales = w.abs().amax(1).double() / 127
    layer.set_weight_bias(torch.quantize_per_channel(w, scales, torch.zeros(out, dtype=torch.long), 0, torch.qint8),
                          None)

    def forward(x):
        torch.backends.quantized.engine = engine
        return layer(x)
    return forward


def _int8_layer(type_name: str, out: int, inp: int):
    """A QuantInt8Linear of random GGUF blocks (random codes, small float16 scales) of `type_name`."""
    import numpy as np

    from fsd_ext.cpu_linear.gguf_weights import pack_int8

    block_weights, block_bytes, halves = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)),
                                          "Q5_0": (32, 22, (0,)), "Q8_0": (32, 34, (0,))}[type_name]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (out * inp // block_weights, block_bytes), dtype=np.uint8)
    for at in halves:
        blocks[:, at:at + 2] = rng.uniform(1e-4, 1e-3, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return cpu_linear.QuantInt8Linear(pack_int8(blocks.reshape(out, -1), type_name, inp), type_name, inp, out)


def make(path: str, out: int, inp: int):
    """One weight of `path` (random values) and the function that multiplies x by it."""
    if path in INT8_TYPES:
        return _int8_layer(INT8_TYPES[path], out, inp)
    if path.startswith("torch dyn int8"):
        return _torch_dynamic_int8(path.split("(")[1].rstrip(")"), out, inp)
    if path in ("fsd q4", "fsd q8g32", "fsd q8"):
        fmt = path.split()[1]
        group, params, code_bytes = {"q4": (32, 8, 64), "q8": (16, 4, 64), "q8g32": (32, 4, 128)}[fmt]
        blocks = -(-out // 4)
        return cpu_linear.QuantWeightLinear(
            torch.randint(0, 256, (blocks, inp // group, code_bytes), dtype=torch.uint8),
            torch.rand(blocks, inp // group, params) * 0.01, fmt, inp, out)
    if path == "torch int4":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (out, inp), dtype=torch.int32), 2)
        scales_zeros = (torch.rand(inp // 32, out, 2) * 0.01).bfloat16()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, scales_zeros).float()
    if path == "torch int8":
        w = torch.randint(-128, 128, (out, inp), dtype=torch.int8)
        scales = (torch.rand(out) * 0.01).bfloat16()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w, scales).float()
    if path == "torchao int8":
        return _torchao_int8(out, inp)
    if path in ("fsd bf16", "fsd f32"):
        w = torch.randn(out, inp).to(torch.bfloat16 if path == "fsd bf16" else torch.float32)
        return lambda x: cpu_linear.skinny_linear(x, w)
    if path == "fsd bf16 x16":
        w = torch.randn(out, inp).bfloat16()
        return lambda x: cpu_linear.skinny_linear(x.bfloat16(), w)
    if path == "F.linear bf16":
        w = torch.randn(out, inp).bfloat16()
        return lambda x: F.linear(x.bfloat16(), w).float()
    if path == "F.linear f32":
        w = torch.randn(out, inp)
        return lambda x: F.linear(x, w)
    raise ValueError(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,6")
    parser.add_argument("--paths", default=",".join(BYTES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--set-mb", type=int, default=400, help="weight bytes cycled through per path")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "bench_cpu_linear.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_linear._native_op() is None:
        sys.exit("the fsd_ext.cpu_linear extension is not built: nothing to measure")
    names = [n for w in args.shapes.split(",") for n in SHAPES if n == w or n.startswith(w + "/")]
    if not names:
        parser.error(f"--shapes {args.shapes!r} names none of {', '.join(SHAPES)}")
    unknown = set(args.paths.split(",")) - set(BYTES)
    if unknown:
        parser.error(f"--paths: unknown {sorted(unknown)}; of {', '.join(BYTES)}")
    rows_list = [int(r) for r in args.rows.split(",")]
    paths = [p for p in args.paths.split(",") if p != "torchao int8" or _torchao_int8(8, 32) is not None]
    results = []
    torch.manual_seed(0)
    for name in names:
        out, inp = SHAPES[name]
        shape_paths = [p for p in paths if p not in INT8_TYPES
                       or inp % cpu_linear.INT8_LAYOUT[INT8_TYPES[p]][0] == 0]
        sets = {}
        for path in shape_paths:
            copies = max(1, -(-args.set_mb * 2**20 // int(out * inp * BYTES[path])))
            sets[path] = [make(path, out, inp) for _ in range(copies)]
        times = {(r, p): [] for r in rows_list for p in shape_paths}
        xs = {r: torch.randn(r, inp) for r in rows_list}
        with torch.no_grad():
            for repeat in range(args.repeats + 1):  # the first round warms up
                for r in rows_list:
                    for p in shape_paths:
                        start = time.perf_counter()
                        for fn in sets[p]:
                            fn(xs[r])
                        if repeat:
                            times[(r, p)].append((time.perf_counter() - start) / len(sets[p]))
        del sets
        for r in rows_list:
            ms = {p: 1e3 * statistics.median(times[(r, p)]) for p in shape_paths}
            results.append(dict(shape=name, out=out, inp=inp, rows=r, ms=ms))
            cells = "  ".join(f"{p} {v:7.3f}" for p, v in ms.items())
            print(f"{name:<15} {r:>2} rows  {cells}", flush=True)
    meta = dict(vars(args), machine=platform.machine(), cpu=cpu_linear.cpu_vendor(), cpu_count=os.cpu_count(),
                threads=torch.get_num_threads(), torch=torch.__version__,
                quant_path=cpu_linear.quant_linear_path(), bf16_dot=cpu_linear.bf16_dot_available())
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    return results


if __name__ == "__main__":
    main()
