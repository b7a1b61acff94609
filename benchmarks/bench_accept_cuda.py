"""Kernel benchmark of fsd_ext.accept on CUDA (called by benchmarks/gpu_check.sh).

Per shape it times one verification step of the fused kernels (eager call, replay of a CUDA graph
holding the call, and per step of a graph holding GRAPH_STEPS calls back to back: no host replay
cost between steps, as inside a decoding loop's graph) on the planner's path, then the same with
each launch-option variant (FSD_EXT_CUDA_LAUNCH, e.g. splits=8, pdl=1, cluster=1, reverse=1: the
opt-in paths not yet measured on a GPU) in a second table next to the planner's times, and
compares with:
  - the bandwidth of a device-to-device copy measured in the same run (the roof: the kernels must
    read both logits tensors at least once; GB/s counts those bytes only);
  - an eager PyTorch implementation of the same step on the GPU (the shape's rule, divergence and
    top-p filter: softmax, divergence, decision, residual inverse-CDF sample; float32,
    probabilities materialised), and torch.compile of it.

Prints one table; with --out DIR also writes bench_accept_cuda.json and bench_accept_cuda.md.
Times are medians of CUDA-event measurements; never run it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from fsd_ext import ops

# (name, batch, K, V_t, dtype, extra accept kwargs)
SHAPES = [
    ("B64 K5 V128256 bf16 fsd/js", 64, 5, 128256, torch.bfloat16, {}),
    ("B64 K5 V128256 bf16 sd", 64, 5, 128256, torch.bfloat16, {"rule": "sd"}),
    ("B1 K5 V151936 bf16 fsd/js", 1, 5, 151936, torch.bfloat16, {}),
    ("B8 K4 V152064 f16 fsd/kl", 8, 4, 152064, torch.float16, {"divergence": "kl"}),
    ("B32 K4 V32001 f32 fsd/js", 32, 4, 32001, torch.float32, {}),
    # fsd when the caller also reads the divergences: every used position runs the second pass (without
    # them, a position whose coin accepts skips it; the "coin-accepted" column says how many do).
    ("B64 K5 V128256 bf16 fsd/js +divergences", 64, 5, 128256, torch.bfloat16, {"return_divergence": True}),
    ("B16 K5 V128256 bf16 top_p=0.9", 16, 5, 128256, torch.bfloat16, {"top_p": 0.9}),
    # Diagnostics (no eager baseline, not in the targets): greedy needs only the statistics pass and
    # the argmax, so against fsd / sd above it shows what the second pass and the sampling cost.
    ("B64 K5 V128256 bf16 greedy [diagnostic]", 64, 5, 128256, torch.bfloat16, {"rule": "greedy"}),
    ("B1 K5 V151936 bf16 greedy [diagnostic]", 1, 5, 151936, torch.bfloat16, {"rule": "greedy"}),
    # fsd_strict draws its corrections from p, so on a split row its pass 2 also sums p's weights
    # per chunk (a second read of the target chunk, see accept.cuh); against fsd/js above.
    ("B64 K5 V128256 bf16 fsd_strict/js [diagnostic]", 64, 5, 128256, torch.bfloat16, {"rule": "fsd_strict"}),
]


GRAPH_STEPS = 10  # accept calls per replay of the multi-step graph
# The launch-option variants timed against the planner's choice by default (FSD_EXT_CUDA_LAUNCH
# values): other vocabulary splits, and every opt-in path of the launcher.
DEFAULT_VARIANTS = ["splits=1", "splits=8", "splits=32", "pdl=1", "cluster=1", "reverse=1"]
LAUNCH_OPTION_NAMES = ("splits", "pdl", "cluster", "reverse")


def cuda_time_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, in microseconds."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), 1 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def torch_step(target, draft, tokens, coins, uniforms, threshold: float, rule: str = "fsd", divergence: str = "js",
               top_p=None):
    """The shape's step in plain PyTorch, as one would write it: float32, probabilities materialised,
    temperature and div_temperature 1 (the divergence on the unfiltered distributions, acceptance
    and sampling on the top-p-filtered ones), rule fsd or sd, divergence js or kl. Returns
    (num_accepted [B], correction / bonus token [B], divergences [B, K] or None); checked against
    fsd_ext.reference on the CPU (benchmarks/tests/test_bench_scripts.py)."""
    k = draft.shape[1]
    zt, zd = target.float(), draft.float()
    logp, logq = zt.log_softmax(-1), zd.log_softmax(-1)  # [B, K+1, V], [B, K, V]
    div = None
    if rule == "fsd":
        if divergence == "kl":
            div = torch.where(logp[:, :k] > -float("inf"), logp[:, :k].exp() * (logp[:, :k] - logq), 0.0).sum(-1)
        else:  # js
            p_k, q = logp[:, :k].exp(), logq.exp()
            log_m = (0.5 * (p_k + q)).clamp_min(1e-38).log()
            div = 0.5 * (torch.where(p_k > 0, p_k * (logp[:, :k] - log_m), 0.0)
                         + torch.where(q > 0, q * (logq - log_m), 0.0)).sum(-1)  # [B, K]
    if top_p is not None and top_p < 1.0:
        logp, logq = top_p_filter(zt, top_p).log_softmax(-1), top_p_filter(zd, top_p).log_softmax(-1)
    p, q = logp.exp(), logq.exp()
    p_tok = p[:, :k].gather(-1, tokens[..., None])[..., 0]
    q_tok = q.gather(-1, tokens[..., None])[..., 0]
    accepted = coins * q_tok <= p_tok
    if div is not None:
        accepted = accepted | (div < threshold)
    n_acc = accepted.long().cumprod(1).sum(1)  # [B]
    rows = torch.arange(target.shape[0], device=target.device)
    p_at = p[rows, n_acc]
    q_at = q[rows, n_acc.clamp(max=k - 1)] * (n_acc < k)[:, None]
    resid = (p_at - q_at).clamp_min(0)
    weights = torch.where(resid.sum(-1, keepdim=True) > 1e-6, resid, p_at)
    cdf = weights.cumsum(-1)
    pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    last_positive = torch.where(weights > 0, torch.arange(weights.shape[-1], device=weights.device), -1).amax(-1)
    pick = torch.where(pick < weights.shape[-1], pick, last_positive)  # u * total rounded past the end
    return n_acc, pick, div


def top_p_filter(logits, top_p: float):
    """Logits outside the smallest most-probable set of mass >= top_p set to -inf (ties kept)."""
    ordered = logits.sort(dim=-1, descending=True).values
    kept = (ordered.softmax(-1).cumsum(-1) < top_p).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    return logits.masked_fill(logits < ordered.gather(-1, kept), float("-inf"))


def step_options(extra: dict) -> dict:
    """torch_step's options for a shape's extra accept kwargs."""
    return {"rule": extra.get("rule", "fsd"), "divergence": extra.get("divergence", "js"), "top_p": extra.get("top_p")}


def launcher_path(call, op: str = "fsd_ext.accept cuda:") -> str:
    """The path the CUDA launcher took for call() (it logs it on stderr with the launch option
    log=1 added to FSD_EXT_CUDA_LAUNCH, lines starting with `op`)."""
    options = os.environ.get("FSD_EXT_CUDA_LAUNCH")
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.environ["FSD_EXT_CUDA_LAUNCH"] = f"{options},log=1" if options else "log=1"
        os.dup2(log.fileno(), 2)
        try:
            call()
            torch.cuda.synchronize()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            set_launch_options(options)
        log.seek(0)
        lines = [line for line in log.read().decode().splitlines() if op in line]
    return lines[-1].split("path=")[1].split()[0] if lines else "?"


def set_launch_options(options):
    """FSD_EXT_CUDA_LAUNCH = `options` (None: unset, the planner's defaults)."""
    if options is None:
        os.environ.pop("FSD_EXT_CUDA_LAUNCH", None)
    else:
        os.environ["FSD_EXT_CUDA_LAUNCH"] = options


def time_accept(target, draft, tokens, kw, launch: str = ""):
    """(eager us, CUDA-graph replay us, per step of a GRAPH_STEPS-step graph us, launcher path) of
    one accept call with the launch options `launch` (FSD_EXT_CUDA_LAUNCH, read on every call; ""
    for the planner's defaults)."""
    previous = os.environ.get("FSD_EXT_CUDA_LAUNCH")
    set_launch_options(launch)
    try:
        path = launcher_path(lambda: ops.accept(target, draft, tokens, **kw))
        eager_us = cuda_time_us(lambda: ops.accept(target, draft, tokens, **kw), iters=20)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ops.accept(target, draft, tokens, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph_us, steps_us = (cuda_time_us(capture(lambda: ops.accept(target, draft, tokens, **kw), n).replay,
                                           iters=100 // n) / n for n in (1, GRAPH_STEPS))
    finally:
        set_launch_options(previous)
    return eager_us, graph_us, steps_us, path


def capture(call, steps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding `steps` calls of call() back to back."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            call()
    return graph


def compiled_step(args, options: dict):
    """(torch.compile of torch_step(*args, **options) compiled by one call, note). Inductor's split
    scan (the cumsum over a long row) fails to generate code in some torch versions: then it is
    compiled again without split reductions, and the note says so."""
    def step(*a):
        return torch_step(*a, **options)

    try:
        fn = torch.compile(step, dynamic=False)
        fn(*args)
        return fn, ""
    except Exception as error:  # noqa: BLE001 - the fallback below, reported if it fails too
        print(f"  torch.compile: {type(error).__name__}; compiling again with split_reductions=False")
    torch._dynamo.reset()
    fn = torch.compile(step, dynamic=False, options={"split_reductions": False})
    fn(*args)
    return fn, "split_reductions=False"


def make_inputs(batch, k, vocab, dtype):
    """Logits, draft tokens, coins and uniforms of one shape (the same on every call)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    target = (torch.randn(batch, k + 1, vocab, device="cuda", generator=g) * 3).to(dtype)
    draft = (target[:, :k].float() + torch.randn(batch, k, vocab, device="cuda", generator=g)).to(dtype)
    tokens = torch.randint(0, vocab, (batch, k), device="cuda", generator=g)
    coins = torch.rand(batch, k, device="cuda", generator=g)
    uniforms = torch.rand(batch, device="cuda", generator=g)
    return target, draft, tokens, coins, uniforms


def coin_accepted_pct(target, draft, tokens, seed, extra):
    """Percentage of draft positions whose coin accepts (u q(d) <= p(d), temperature 1): under sd,
    and fsd without returned divergences, these skip the kernels' second pass, so a shape's time
    depends on it. None for a filtered shape (not computed here)."""
    if any(extra.get(name) is not None for name in ("top_k", "top_p", "min_p")):
        return None
    k = draft.shape[1]
    def at_drafts(logits):  # [B, K]: the probability of each draft token, temperature 1
        return logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0].double().exp()

    p, q = at_drafts(target[:, :k]), at_drafts(draft)
    coins = ops.philox_uniforms(seed, 0, draft.shape[0], k, "accept")
    return 100.0 * (coins * q <= p).double().mean().item()


def bench_shape(name, batch, k, vocab, dtype, extra, copy_gbs, variants):
    """The kernels' times on one shape (the planner's path, then each launch-option variant, e.g.
    ["splits=8", "pdl=1"]) and the eager step's."""
    target, draft, tokens, coins, uniforms = make_inputs(batch, k, vocab, dtype)
    seed = torch.tensor(1, dtype=torch.int64, device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    kw = dict(rule="fsd", divergence="js", threshold=0.3, seed=seed, offset=offset)
    kw.update(extra)
    logits_bytes = (target.numel() + draft.numel()) * target.element_size()

    eager_us, graph_us, steps_us, path = time_accept(target, draft, tokens, kw)
    # Launch options against the planner's choice (filters need whole-row selections: one chunk).
    switch_variants = {}
    if "top_p" not in extra:
        for variant in variants:
            e, gr, st, p = time_accept(target, draft, tokens, kw, variant)
            switch_variants[variant] = {"eager_us": e, "graph_us": gr, "graph_steps_us": st, "path": p}

    args = (target, draft, tokens, coins, uniforms, 0.3)
    diagnostic = "[diagnostic]" in name
    ref_us = None if diagnostic else cuda_time_us(lambda: torch_step(*args, **step_options(extra)), iters=5, repeats=3)
    best_us = min(eager_us, graph_us, steps_us)
    gbs = logits_bytes / (best_us * 1e-6) / 1e9
    return {
        "shape": name, "batch": batch, "k": k, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
        "logits_bytes": logits_bytes, "path": path, "eager_us": eager_us, "graph_us": graph_us,
        "graph_steps_us": steps_us, "graph_steps": GRAPH_STEPS,
        "switch_variants": switch_variants,
        "best_us": best_us, "gbs": gbs,
        "pct_copy_bw": 100.0 * gbs / copy_gbs, "torch_eager_us": ref_us, "torch_compile_us": None,
        "torch_compile_note": "not run",
        "speedup_vs_eager": ref_us / best_us if ref_us else None,
        "speedup_vs_compile": None,
        "coin_accepted_pct": coin_accepted_pct(target, draft, tokens, seed, extra),
    }


def add_compile_time(result, shape, compile_budget_s):
    """torch.compile of the eager step on `shape`, into `result` (after every kernel time: compiling
    takes seconds per shape and a time limit may cut it)."""
    name, batch, k, vocab, dtype, extra = shape
    args = make_inputs(batch, k, vocab, dtype) + (0.3,)
    try:
        t0 = time.monotonic()
        compiled, note = compiled_step(args, step_options(extra))
        torch.cuda.synchronize()
        result["torch_compile_note"] = note
        if time.monotonic() - t0 < compile_budget_s:
            result["torch_compile_us"] = cuda_time_us(lambda: compiled(*args), iters=5, repeats=3)
            result["speedup_vs_compile"] = result["torch_compile_us"] / result["best_us"]
        else:
            result["torch_compile_note"] = f"compile took over {compile_budget_s:.0f} s"
    except Exception as error:  # noqa: BLE001 - report and carry on
        result["torch_compile_note"] = f"failed: {type(error).__name__}"
        print(f"  torch.compile failed for {name}: {type(error).__name__}: {str(error)[:300]}")


def summarize(results):
    """(markdown table, {target: met}) of bench_shape results (SHAPES order; {} before the third)."""
    def fmt(x, spec=".1f"):  # None (not measured) -> "n/a"; spec ".0f%" appends a percent sign
        if x is None:
            return "n/a"
        return format(x, spec[:-1]) + "%" if spec.endswith("%") else format(x, spec)

    # "graph us": one call per replay; "/ N": per step of a graph holding N calls.
    header = (f"| shape | path | eager us | graph us / {GRAPH_STEPS} | GB/s (best) | % copy BW | torch eager us | "
              "torch.compile us | x eager | x compile | coin-accepted |")
    lines = [header, "|" + "---|" * 11]
    for r in results:
        lines.append(f"| {r['shape']} | {r['path']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} / {r['graph_steps_us']:.1f} | "
                     f"{r['gbs']:.0f} | {r['pct_copy_bw']:.0f}% | "
                     f"{fmt(r['torch_eager_us'])} | {fmt(r['torch_compile_us'])} | {fmt(r['speedup_vs_eager'])} | "
                     f"{fmt(r['speedup_vs_compile'])} | {fmt(r.get('coin_accepted_pct'), '.0f%')} |")
    variants = list(dict.fromkeys(n for r in results for n in r.get("switch_variants", {})))
    def times(r):  # "eager / graph / graph of GRAPH_STEPS steps" us
        return f"{r['eager_us']:.1f} / {r['graph_us']:.1f} / {r['graph_steps_us']:.1f}"

    if variants:  # the planner's choice against launch options (the path taken and its times)
        lines += ["", f"| shape | planner: path, eager / graph / graph of {GRAPH_STEPS} us | "
                  + " | ".join(f"FSD_EXT_CUDA_LAUNCH={n}" for n in variants) + " |",
                  "|" + "---|" * (2 + len(variants))]
        for r in results:
            cells = [f"{v['path']} {times(v)}" if (v := r.get("switch_variants", {}).get(n)) else "n/a" for n in variants]
            lines.append(f"| {r['shape']} | {r['path']} {times(r)} | " + " | ".join(cells) + " |")
    if len(results) < 3:  # a run cut short: the targets need the first three shapes
        return "\n".join(lines), {}
    b1 = results[2]
    graph_us = [b1["graph_us"], b1["graph_steps_us"]]
    targets = {
        "B64 bf16 >= 80% copy BW": results[0]["pct_copy_bw"] >= 80.0,
        f"B1 V151936 graph <= 10 us per step (1 or {GRAPH_STEPS} steps per replay)": min(graph_us) <= 10.0,
        ">= 5x eager everywhere": all(r["speedup_vs_eager"] >= 5.0 for r in results if r["speedup_vs_eager"]),
    }
    return "\n".join(lines), targets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for JSON / markdown")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no torch.compile after this many seconds (compiles run after every kernel time)")
    parser.add_argument("--compile-budget-s", type=float, default=60.0, help="skip compile results slower than this")
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                        help="also time with each of these launch options (FSD_EXT_CUDA_LAUNCH values, e.g. "
                             "splits=8 or pdl=1,splits=32); none given: no variants")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    deadline = time.monotonic() + args.budget_s
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"D2D copy bandwidth: {copy_gbs:.0f} GB/s")
    variants = [v.strip() for v in args.variants if v.strip()]
    for v in variants:
        if any("=" not in entry or entry.split("=")[0] not in LAUNCH_OPTION_NAMES for entry in v.split(",")):
            parser.error(f"--variants: {v!r} is not NAME=VALUE[,NAME=VALUE] with names among {LAUNCH_OPTION_NAMES}")
    results = []
    for shape in SHAPES:
        results.append(bench_shape(*shape, copy_gbs, variants))
        r = results[-1]
        speedup = f"{r['speedup_vs_eager']:.1f}x eager" if r["speedup_vs_eager"] else "no eager baseline"
        print(f"  done {r['shape']}: best {r['best_us']:.1f} us ({r['pct_copy_bw']:.0f}% of copy BW, {speedup})",
              flush=True)
        write(args.out, copy_gbs, results)  # after every shape: a time limit may cut the run
    for shape, result in zip(SHAPES, results):  # torch.compile last, while the budget lasts
        if args.compile_budget_s <= 0 or time.monotonic() > deadline or result["torch_eager_us"] is None:
            continue
        add_compile_time(result, shape, args.compile_budget_s)
        write(args.out, copy_gbs, results)
    table, targets = write(args.out, copy_gbs, results)
    print()
    print(f"D2D copy bandwidth (read + write): {copy_gbs:.0f} GB/s; GB/s = logits bytes / best time "
          "(the planner's path, eager or graph)")
    print(table)
    for name, ok in targets.items():
        print(f"target {name}: {'MET' if ok else 'NOT MET'}")


def write(out, copy_gbs, results):
    """Summarize the results so far and, with `out`, write them as JSON and markdown."""
    table, targets = summarize(results)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_accept_cuda.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_gbs": copy_gbs, "results": results, "targets": targets}, f, indent=2)
        with open(os.path.join(out, "bench_accept_cuda.md"), "w") as f:
            f.write(f"Device: {torch.cuda.get_device_name()}, D2D copy {copy_gbs:.0f} GB/s\n\n{table}\n")
    return table, targets


if __name__ == "__main__":
    main()
