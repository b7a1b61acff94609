"""What CUDA graphs save in fsd_ext.generate, measured on models with random weights (so it needs no
download and runs inside the offline GPU check): the Qwen2.5-Coder 1.5B / 0.5B shapes in bfloat16.

Per configuration (rule, batch size): decode tokens/s (the prompt forwards left out) with eager
forwards, with graphs on a first call, captures included (its capture seconds also apart), and
with graphs on later calls, which replay the kept ones; median of --repeats calls each (the first
call: one). How often drafts are right on random weights says nothing about real models (tied
random embeddings tend to make both models repeat the input): this measures the cost of a
forward and of the loop around it, not speculation.

Then, at batch 1, end-to-end tokens/s (prompt forwards included) of our AR and SD with graphs
reused against Hugging Face's greedy generate and assisted generation (the same K): greedy
decoding of the same models gives the same tokens and the same accepted drafts on both sides, so
random weights still make a fair comparison of the two loops.

    python benchmarks/bench_decode_graphs.py --out /tmp/gpu        # on a GPU (about a minute)
    python benchmarks/bench_decode_graphs.py --tiny --device cpu    # a smoke test of the script

Writes bench_decode_graphs.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fsd_ext  # noqa: E402
from bench_decode import run_hf  # noqa: E402

# The Qwen2.5-Coder-1.5B / 0.5B architectures (their config.json), and tiny ones for a smoke test.
SHAPES = {
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def random_model(shape, dtype, device, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype).eval()


def decode_rate(target, draft, ids, rule, graphs, args, with_captures=False):
    """One generate call -> (decode tokens/s, capture seconds, tokens per target call)."""
    out = fsd_ext.generate(target, draft, ids, rule=rule, temperature=0.0, threshold=0.3,
                           num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                           eos_token_id=[], seed=0, use_cuda_graphs=graphs)
    stats = out.stats
    rate = stats.decode_tokens_per_second
    if with_captures:
        rate = stats.new_tokens / (stats.seconds - stats.prefill_seconds)
    return rate, stats.capture_seconds, stats.tokens_per_target_call


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of the script)")
    parser.add_argument("--rules", default="ar,sd")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop starting configurations after this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    target = random_model(TINY if args.tiny else SHAPES["target"], dtype, args.device, 0)
    draft = random_model(TINY if args.tiny else SHAPES["draft"], dtype, args.device, 1)
    vocab = target.config.vocab_size
    modes = ["eager"] + (["graphs, first call", "graphs, reused"] if args.device.startswith("cuda") else [])
    rows = []
    for rule in args.rules.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            if time.perf_counter() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping before {rule} B={batch}", file=sys.stderr)
                break
            ids = torch.randint(0, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
            ids = ids.to(args.device)
            decode_rate(target, draft, ids, rule, False, args)  # warm-up (lazy inits, kernel choice)
            row = dict(rule=rule, batch=batch)
            for mode in modes:
                if mode == "graphs, first call":  # one per configuration: it captures
                    fsd_ext.release_cuda_graphs()
                    samples = [decode_rate(target, draft, ids, rule, True, args, with_captures=True)]
                else:
                    samples = [decode_rate(target, draft, ids, rule, mode != "eager", args)
                               for _ in range(args.repeats)]
                row[mode] = statistics.median(s[0] for s in samples)
                row[f"{mode} capture s"] = statistics.median(s[1] for s in samples)
                row["tokens per target call"] = samples[-1][2]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            write(args, start, rows, summarize(rows, modes))  # as it goes: a time limit may cut it
    table = summarize(rows, modes)
    if args.device.startswith("cuda") and time.perf_counter() - start < args.budget_s:
        vs_hf = against_hf(target, draft, vocab, args)
        table += "\n\nBatch 1, end to end (prompt forwards included), median of repeats:\n\n" + vs_hf
    print(table)
    write(args, start, rows, table)
    return rows


def write(args, start, rows, table) -> None:
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), torch=torch.__version__, seconds=time.perf_counter() - start,
                gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None)
    (out / "bench_decode_graphs.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    (out / "bench_decode_graphs.md").write_text(table + "\n")


def against_hf(target, draft, vocab, args) -> str:
    """Our AR / SD (graphs reused) vs HF greedy / assisted generation at batch 1: tokens/s."""
    ids = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(args.device)

    class NoCounter:
        count = 0

    def ours(rule):
        stats = fsd_ext.generate(target, draft, ids, rule=rule, temperature=0.0, max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=args.num_draft_tokens, eos_token_id=[], seed=0).stats
        return stats.new_tokens / (stats.seconds - stats.capture_seconds)

    def hf(with_draft):
        new, seconds, _, _ = run_hf(target, draft if with_draft else None, ids, args.num_draft_tokens,
                                    args.max_new_tokens, NoCounter())
        return new / seconds

    runs = {"ours, AR (graphs)": lambda: ours("ar"), "ours, SD (graphs)": lambda: ours("sd"),
            "HF greedy generate": lambda: hf(False), "HF assisted generation": lambda: hf(True)}
    rates = {}
    for name, run in runs.items():
        run()  # warm-up (and, for ours, the captures)
        rates[name] = statistics.median(run() for _ in range(args.repeats))
    lines = ["| config | tokens/s | vs HF assisted |", "|---|---|---|"]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:.1f} | {rate / rates['HF assisted generation']:.2f}x |")
    return "\n".join(lines)


def summarize(rows, modes) -> str:
    """A markdown table: decode tokens/s per mode, graphs' speed-up over eager, capture seconds."""
    header = ["rule", "batch", "tokens / target call"] + [f"{m} (tok/s)" for m in modes]
    graphs = "graphs, reused" in modes
    if graphs:
        header += ["reused vs eager", "first call's captures (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["rule"], str(r["batch"]), f"{r['tokens per target call']:.2f}"]
        cells += [f"{r[m]:.1f}" for m in modes]
        if graphs:
            cells += [f"{r['graphs, reused'] / r['eager']:.2f}x", f"{r['graphs, first call capture s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
