"""End-to-end decoding benchmark: AR, our SD and FSD (fsd_ext.generate) against Hugging Face's own
greedy generate and assisted generation (generate(assistant_model=...)) on the same model pair.

All rows decode greedily (temperature 0) at batch 1 with the same K, so SD and HF assisted
generation produce the target's greedy text and differ only in speed; FSD trades some of it for
more accepted drafts. Each configuration runs `--repeats` times per prompt; the table reports the
median tokens/s (total new tokens / total seconds over the prompts) and the tokens gained per target
call (for HF: new tokens / target forwards, counted with a hook). transformers reads the number of
assistant tokens from the assistant's generation_config, so that is where K is set (hf_assisted);
hf_assisted_default keeps HF's own choice (K=20 with a confidence-based early stop in 5.x).
On the CPU our configs compute the models' few-row linears with fsd_ext's kernel where that pays
off (as models.load does by default: fsd_ext.cpu_linear.skinny_pays_off, not for float32 where
torch's BLAS is MKL on an Intel CPU); hf_assisted+skinny runs HF's assisted generation on models patched with the same
kernel, so there hf_assisted -> hf_assisted+skinny is what the kernel gains and
hf_assisted+skinny -> sd what the loop gains (float32 on an Intel CPU with MKL: hf_assisted -> sd).
Float32 models on the CPU store their linear weights in bfloat16 by default (--linear-weights auto:
fsd_ext.models.default_linear_weights); those layers run on our kernel in every config, HF's too.

    python benchmarks/bench_decode.py --quick                   # offline Qwen2.5-Coder 1.5B / 0.5B
    python benchmarks/bench_decode.py --target T --draft D --max-new-tokens 64 --repeats 5

Writes benchmarks/results/bench_decode.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsd_ext  # noqa: E402
from fsd_ext import models  # noqa: E402
from fsd_ext.cli import DEMO_PROMPTS, _encode  # noqa: E402
from fsd_ext.cpu_linear import skinny_cpu_linears, skinny_pays_off  # noqa: E402
from fsd_ext.generate import check_tokenizers  # noqa: E402


class ForwardCounter:
    """Counts forward calls of a module (a forward pre-hook)."""

    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


def run_hf(target, draft, input_ids, k, max_new_tokens, counter):
    """HF greedy generate; with a draft, assisted generation with K drafts per target call
    (k=None: HF's defaults, read from the assistant's generation_config: K=20 with a dynamic
    confidence stop in transformers 5.x)."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                  pad_token_id=target.generation_config.pad_token_id or 0)
    saved = {}
    if draft is not None:
        kwargs.update(assistant_model=draft)
        if k is not None:  # transformers reads these from the *assistant's* generation config
            fixed_k = dict(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                           assistant_confidence_threshold=0.0)
            saved = {name: getattr(draft.generation_config, name, None) for name in fixed_k}
            for name, value in fixed_k.items():
                setattr(draft.generation_config, name, value)
    counter.count = 0
    start = time.perf_counter()
    try:
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    finally:
        for name, value in saved.items():
            setattr(draft.generation_config, name, value)
    seconds = time.perf_counter() - start
    new = out.shape[1] - input_ids.shape[1]
    return new, seconds, counter.count, 0.0


def run_ours(target, draft, input_ids, rule, args):
    out = fsd_ext.generate(target, draft, input_ids, rule=rule, temperature=0.0,
                           threshold=args.threshold, divergence=args.divergence,
                           num_draft_tokens=args.num_draft_tokens,
                           max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=0)
    stats = out.stats
    return stats.new_tokens, stats.seconds, stats.verifications, stats.capture_seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT)
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts x 32 tokens x 3 repeats (a few minutes on 2 CPU cores)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=0.3)
    parser.add_argument("--divergence", default="js")
    parser.add_argument("--configs", default="ar,hf_ar,sd,hf_assisted,hf_assisted+skinny,fsd",
                        help="of ar, sd, fsd, greedy, fsd_strict (ours), hf_ar, hf_assisted (same K), "
                             "hf_assisted_default (HF's own K schedule); a '+skinny' suffix on an hf_ "
                             "config runs HF on models patched with our CPU linear kernel")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="model dtype (default: fsd_ext.models.default_dtype: bfloat16 on a GPU "
                             "or a CPU with AVX512-BF16, else float32)")
    parser.add_argument("--linear-weights", choices=["auto", "same", "bfloat16", "gguf"], default="auto",
                        help="the linear layers' weights (as fsd-ext's option; auto: the GGUF file's "
                             "codes or bfloat16 for float32 CPU models where they pay off, and these "
                             "linears run on our kernels in the hf_ configs too)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 can win on a busy machine)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "bench_decode.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.repeats = 2, 32, 3

    dtype, linear_weights = models.resolve_load_options(args.target, args.device, args.dtype or "auto",
                                                        args.linear_weights)
    args.dtype = str(dtype).removeprefix("torch.")
    args.linear_weights = str(linear_weights or dtype).removeprefix("torch.")
    # (the few-row kernel goes in per config below)
    target, tokenizer = models.load(args.target, dtype=dtype, device=args.device,
                                    linear_weights=linear_weights, cpu_linears=False)
    draft, draft_tokenizer = models.load(args.draft, dtype=dtype, device=args.device,
                                         linear_weights=linear_weights, cpu_linears=False)
    ours_skinny = args.device == "cpu" and skinny_pays_off(dtype)
    check_tokenizers(tokenizer, draft_tokenizer)
    prompts = [_encode(tokenizer, p, True, args.device) for p in DEMO_PROMPTS[:args.num_prompts]]
    counter = ForwardCounter(target)
    configs = args.configs.split(",")

    def one_pass(config):
        tokens = seconds = calls = captures = 0
        for input_ids in prompts:
            if config.startswith("hf_"):
                base = config.removesuffix("+skinny")
                # "+skinny": HF's loop on models patched with our few-row CPU linear kernel, to
                # separate what the kernel gains from what the loop gains.
                with skinny_cpu_linears(target, draft, enabled=config.endswith("+skinny")):
                    n, s, c, g = run_hf(target, None if base == "hf_ar" else draft, input_ids,
                                     None if base == "hf_assisted_default" else args.num_draft_tokens,
                                     args.max_new_tokens, counter)
            else:
                with skinny_cpu_linears(target, draft, enabled=ours_skinny):
                    n, s, c, g = run_ours(target, draft, input_ids, config, args)
            tokens, seconds, calls, captures = tokens + n, seconds + s, calls + c, captures + g
        # CUDA graphs are captured per generate call (inside its seconds): their share is reported.
        return tokens / seconds, tokens / calls, captures / seconds

    for config in configs:  # warm-up (first-call allocations, lazy inits)
        if config.startswith("hf_"):
            run_hf(target, None if config.startswith("hf_ar") else draft, prompts[0],
                   args.num_draft_tokens, 4, counter)
        else:
            fsd_ext.generate(target, draft, prompts[0], rule=config, temperature=0.0,
                             max_new_tokens=4, num_draft_tokens=args.num_draft_tokens)
    samples = {config: [] for config in configs}
    for repeat in range(args.repeats):  # interleaved, so load changes hit every config alike
        for config in configs:
            samples[config].append(one_pass(config))
            print(f"repeat {repeat} {config}: {samples[config][-1][0]:.2f} tokens/s", file=sys.stderr,
                  flush=True)

    results = {}
    for config in configs:
        tps = statistics.median(s[0] for s in samples[config])
        per_call = statistics.median(s[1] for s in samples[config])
        capture_share = statistics.median(s[2] for s in samples[config])
        results[config] = dict(tokens_per_s=tps, tokens_per_target_call=per_call,
                               capture_share=capture_share,
                               all_tokens_per_s=[s[0] for s in samples[config]])
    hf_assisted = results.get("hf_assisted", {}).get("tokens_per_s")
    ar = results.get("ar", {}).get("tokens_per_s")
    print(f"\n{args.target} <- {args.draft}, batch 1, greedy, K={args.num_draft_tokens}, "
          f"FSD T={args.threshold} ({args.divergence}); {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, median of {args.repeats}; {args.device} {args.dtype} "
          f"(linear weights {args.linear_weights}), "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print(f"{'config':<12} {'tokens/s':>9} {'tokens/call':>12} {'vs AR':>7} {'vs HF assisted':>15} "
          f"{'graph captures':>15}")
    for config, r in results.items():
        vs_ar = f"{r['tokens_per_s'] / ar:.2f}x" if ar else "-"
        vs_hf = f"{r['tokens_per_s'] / hf_assisted:.2f}x" if hf_assisted else "-"
        captures = f"{100 * r['capture_share']:.0f}% of time" if r["capture_share"] else "-"
        print(f"{config:<12} {r['tokens_per_s']:>9.2f} {r['tokens_per_target_call']:>12.2f} "
              f"{vs_ar:>7} {vs_hf:>15} {captures:>15}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), machine=platform.machine(), cpu_count=os.cpu_count(),
                threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=__import__("transformers").__version__)
    Path(args.output).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
