"""Kernel benchmark of fsd_ext.sample on CUDA (called by benchmarks/gpu_check.sh after accept's).

Per shape it times one sample call (eager, and per replay of a CUDA graph holding it; seed and
offset are device tensors, as in a decoding loop's graph) on the path the launcher picks (few
unfiltered rows: the split path, a row's vocabulary cut into chunks on many SMs) and, where that is
the split path, eagerly on the one-block-per-row path too (FSD_EXT_CUDA_LAUNCH=splits=1), and compares with:
  - the bandwidth of a device-to-device copy measured in the same run (GB/s counts the logits
    bytes: the kernel must read them at least once);
  - the same sampler in eager PyTorch (float32 tempered logits, the shape's filter, softmax,
    cumulative sum, inverse CDF of the given uniform: torch_sample below, checked against
    fsd_ext.reference.sample in benchmarks/tests/test_bench_scripts.py), and torch.multinomial on the
    softmax (what serving code often calls: no filter, its own randomness).

Prints one table; with --out DIR also writes bench_sample_cuda.json and bench_sample_cuda.md.
Times are medians of CUDA-event measurements; never run it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from bench_accept_cuda import capture, copy_bandwidth_gbs, cuda_time_us, launcher_path, top_p_filter
from fsd_ext import ops

TEMPERATURE = 0.8
# (name, batch, V, dtype, filter kwargs of fsd_ext.sample)
SHAPES = [
    ("B64 V128256 bf16", 64, 128256, torch.bfloat16, {}),
    ("B64 V128256 bf16 top_k=50", 64, 128256, torch.bfloat16, {"top_k": 50}),
    ("B64 V128256 bf16 top_p=0.9", 64, 128256, torch.bfloat16, {"top_p": 0.9}),
    ("B1 V151936 bf16", 1, 151936, torch.bfloat16, {}),
    ("B1 V151936 bf16 top_p=0.9", 1, 151936, torch.bfloat16, {"top_p": 0.9}),
    ("B1 V151936 bf16 min_p=0.05", 1, 151936, torch.bfloat16, {"min_p": 0.05}),  # split path too
]


def torch_sample(logits, uniforms, temperature: float, top_k=None, top_p=None, min_p=None):
    """[B] tokens: fsd_ext.sample's draw in plain PyTorch for [B, V] logits and [B] uniforms."""
    z = logits.float()
    z = (z - z.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p is not None:
        z = top_p_filter(z, top_p)
    if min_p is not None:  # p >= min_p * p_max, i.e. z >= log(min_p) (z's maximum is 0)
        z = z.masked_fill(z < math.log(min_p), float("-inf"))
    cdf = z.softmax(-1).cumsum(-1)
    pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    return pick.clamp(max=z.shape[-1] - 1)  # u * total rounded past the end (flat rows: the last id)


def torch_multinomial(logits, temperature: float):
    """[B] tokens by torch.multinomial on the tempered softmax (unfiltered)."""
    return torch.multinomial((logits.float() / temperature).softmax(-1), 1)[:, 0]


def bench_shape(name, batch, vocab, dtype, filters, copy_gbs):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(batch, vocab, device="cuda", generator=g) * 3).to(dtype)
    uniforms = torch.rand(batch, device="cuda", generator=g)
    seed = torch.tensor(1, dtype=torch.int64, device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")

    def call():
        return ops.sample(logits, TEMPERATURE, seed=seed, offset=offset, **filters)

    path = launcher_path(call, "fsd_ext.sample cuda:")
    eager_us = cuda_time_us(call, iters=20)
    one_block_us = None
    if path == "split":
        os.environ["FSD_EXT_CUDA_LAUNCH"] = "splits=1"
        try:
            one_block_us = cuda_time_us(call, iters=20)
        finally:
            del os.environ["FSD_EXT_CUDA_LAUNCH"]
    stream = torch.cuda.Stream()  # warm-up off the default stream before capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph_us = cuda_time_us(capture(call, 1).replay, iters=50)
    torch_us = cuda_time_us(lambda: torch_sample(logits, uniforms, TEMPERATURE, **filters), iters=5, repeats=3)
    multinomial_us = cuda_time_us(lambda: torch_multinomial(logits, TEMPERATURE), iters=5, repeats=3)
    best_us = min(eager_us, graph_us)
    logits_bytes = logits.numel() * logits.element_size()
    gbs = logits_bytes / (best_us * 1e-6) / 1e9
    return {"shape": name, "batch": batch, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
            "filters": filters, "logits_bytes": logits_bytes, "path": path, "eager_us": eager_us,
            "one_block_eager_us": one_block_us, "graph_us": graph_us,
            "best_us": best_us, "gbs": gbs, "pct_copy_bw": 100.0 * gbs / copy_gbs,
            "torch_eager_us": torch_us, "speedup_vs_eager": torch_us / best_us,
            "torch_multinomial_us": multinomial_us, "speedup_vs_multinomial": multinomial_us / best_us}


def summarize(results) -> str:
    """The markdown table of bench_shape results."""
    lines = ["| shape | path | eager us | one block per row, eager us | graph us | GB/s (best) | % copy BW | "
             "torch eager us | x eager | torch.multinomial us | x multinomial |", "|" + "---|" * 11]
    for r in results:
        one_block = "n/a" if r["one_block_eager_us"] is None else f"{r['one_block_eager_us']:.1f}"
        lines.append(f"| {r['shape']} | {r['path']} | {r['eager_us']:.1f} | {one_block} | {r['graph_us']:.1f} | {r['gbs']:.0f} | "
                     f"{r['pct_copy_bw']:.0f}% | {r['torch_eager_us']:.1f} | {r['speedup_vs_eager']:.1f} | "
                     f"{r['torch_multinomial_us']:.1f} | {r['speedup_vs_multinomial']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for JSON / markdown")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    copy_gbs = copy_bandwidth_gbs()
    device = torch.cuda.get_device_name()
    print(f"device: {device}  torch {torch.__version__}  D2D copy bandwidth: {copy_gbs:.0f} GB/s "
          f"(temperature {TEMPERATURE})")
    results = []
    for shape in SHAPES:
        results.append(bench_shape(*shape, copy_gbs))
        print(f"  done {shape[0]}: best {results[-1]['best_us']:.1f} us", flush=True)
        table = summarize(results)
        if args.out:  # after every shape: a time limit may cut the run
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_sample_cuda.json"), "w") as f:
                json.dump({"device": device, "torch": torch.__version__, "copy_gbs": copy_gbs,
                           "temperature": TEMPERATURE, "results": results}, f, indent=2)
            with open(os.path.join(args.out, "bench_sample_cuda.md"), "w") as f:
                f.write(f"Device: {device}, D2D copy {copy_gbs:.0f} GB/s, temperature {TEMPERATURE}\n\n{table}\n")
    print()
    print(summarize(results))


if __name__ == "__main__":
    main()
