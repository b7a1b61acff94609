"""Where a decoding forward's time goes, for one model and setup: the wall time of a 1- and a 6-token
forward after a HumanEval prompt, the linear products alone (the same ops on the same weights, one
after another without the rest of the model), the bytes they read, and torch.profiler's self time
per op group.

    python benchmarks/cpu_linear/profile_forward.py --setup before   # float32 activations, transformers' modules and sdpa
    python benchmarks/cpu_linear/profile_forward.py --setup after    # the defaults (int8 activations, fused layers)

"before" is the setup this project decoded with until 2026-12-07 (issue 57's starting point). The
setups alternate round by round when both are given (--setup before,after); medians of rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import FsdEngine  # noqa: E402
from fsd_ext import cpu_linear, models  # noqa: E402
from fsd_ext.bench import humaneval  # noqa: E402

GROUPS = {  # torch.profiler op name -> group
    "fsd_cpu_linear::quant_linear": "linear products", "fsd_cpu_linear::int8_linear": "linear products",
    "fsd_cpu_linear::int8_linear_cat": "linear products", "fsd_cpu_linear::skinny_linear": "linear products",
    "fsd_cpu_linear::decoder_layer": "decoder_layer (whole layers)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::copy_": "copies (repeat_kv, casts)",
    "aten::scatter_": "cache writes",
}


def load(name: str, setup: str):
    if setup == "before":
        model, tokenizer = models.load(name, activations="float32")
        model.set_attn_implementation("sdpa")
    else:
        model, tokenizer = models.load(name)
    return model, tokenizer


def linear_bytes(model) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, cpu_linear.QuantInt8Linear):
            total += module.packed.numel()
        elif isinstance(module, cpu_linear.QuantWeightLinear):
            total += module.codes.numel() + 4 * module.params.numel()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def products_alone(model, steps: int, repeats: int) -> float:
    """Median seconds of every linear layer's product on a random x of `steps` rows, in model order."""
    layers = [m for m in model.modules() if isinstance(m, (cpu_linear.QuantInt8Linear, cpu_linear.QuantWeightLinear))]
    xs = [torch.randn(1, steps, layer.in_features) for layer in layers]
    runs = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer, x in zip(layers, xs):
                type(layer).forward(layer, x)
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def forwards(model, ids, repeats: int, profile: bool = False):
    """Median seconds of 1- and 6-token forwards after the prompt (bench_vs_llamacpp's timing), and
    with `profile` torch.profiler's self seconds per op group of each."""
    engine = FsdEngine(model)
    times, groups = {}, {}
    with torch.inference_mode():
        cached, _ = engine.prefilled(ids)
        for steps in (1, 6):
            times[steps] = engine.forward_seconds(cached, ids, steps, repeats)
            if profile:
                with torch.profiler.profile() as prof:
                    engine.forward_seconds(cached, ids, steps, repeats)
                totals = {}
                for event in prof.key_averages():
                    group = GROUPS.get(event.key, "other ops")
                    totals[group] = totals.get(group, 0.0) + event.self_cpu_time_total / 1e6 / repeats
                groups[steps] = totals
    return times, groups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_TARGET)
    parser.add_argument("--setup", default="before,after")
    parser.add_argument("--problem", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    setups = args.setup.split(",")
    loaded = {setup: load(args.model, setup) for setup in setups}
    tokenizer = loaded[setups[0]][1]
    ids = tokenizer(humaneval.format_prompt(humaneval.load_problems()[args.problem], tokenizer),
                    return_tensors="pt").input_ids
    rounds = {setup: [] for setup in setups}
    for round_index in range(args.rounds):
        for setup in (setups if round_index % 2 == 0 else setups[::-1]):
            model = loaded[setup][0]
            times, groups = forwards(model, ids, args.repeats, profile=round_index == 0)
            rounds[setup].append({"forward": times, "products": {s: products_alone(model, s, args.repeats) for s in (1, 6)},
                                  "groups": groups})
    report = {"model": args.model, "prompt_tokens": int(ids.shape[1]), "threads": args.threads, "setups": {}}
    for setup, runs in rounds.items():
        entry = {"linear_bytes": linear_bytes(loaded[setup][0]), "profile_self_seconds": runs[0]["groups"]}
        for steps in (1, 6):
            entry[f"forward_{steps}_s"] = statistics.median(r["forward"][steps] for r in runs)
            entry[f"products_{steps}_s"] = statistics.median(r["products"][steps] for r in runs)
        report["setups"][setup] = entry
        print(f"{setup}: linear weights {entry['linear_bytes'] / 1e9:.2f} GB; forward 1 / 6 tokens "
              f"{1e3 * entry['forward_1_s']:.1f} / {1e3 * entry['forward_6_s']:.1f} ms, of which the products alone "
              f"{1e3 * entry['products_1_s']:.1f} / {1e3 * entry['products_6_s']:.1f} ms")
        for steps, totals in entry["profile_self_seconds"].items():
            cells = ", ".join(f"{group} {1e3 * sec:.1f}" for group, sec in sorted(totals.items(), key=lambda kv: -kv[1]))
            print(f"  profiler, {steps} token(s), ms per forward: {cells}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
