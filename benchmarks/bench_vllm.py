"""AR vs SD vs FSD through vLLM with the fsd_ext plug-in (docs/engines.md), on `fsd-ext demo`'s
prompts, one request at a time, greedy. Prints a table and writes JSON.

    python benchmarks/bench_vllm.py --target /path/qwen2.5-coder-1.5b --draft /path/qwen2.5-coder-0.5b \\
        --json benchmarks/results/<run>/vllm.json

Configurations: `ar` (the target alone), `sd-vllm` (vLLM's own rule), `sd` and `fsd` (the plug-in:
fsd_ext.accept with rule sd, and fsd at --threshold). Each builds its own engine in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), runs an untimed 4-token warm-up, then the prompts one by one.
tokens/s = generated tokens / wall seconds of the generate calls, summed over the prompts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsd_ext.cli import DEMO_PROMPTS  # noqa: E402


def metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def run_config(args, config: str, prompts):
    from vllm import LLM, SamplingParams

    kwargs = dict(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
                  max_num_seqs=1, seed=0, disable_log_stats=False)
    if config != "ar":
        kwargs["speculative_config"] = {"method": "draft_model", "model": args.draft,
                                        "num_speculative_tokens": args.k,
                                        "draft_sample_method": "probabilistic"}
    if config == "sd":
        kwargs["additional_config"] = {"fsd": {"rule": "sd"}}
    elif config == "fsd":
        kwargs["additional_config"] = {"fsd": {"rule": "fsd", "divergence": args.divergence,
                                               "threshold": args.threshold}}
    load_t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_seconds = time.perf_counter() - load_t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    drafts0 = metric(llm, "vllm:spec_decode_num_drafts")
    accepted0 = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    tokens, seconds, texts = 0, 0.0, []
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        texts.append(out.text)
    steps = metric(llm, "vllm:spec_decode_num_drafts") - drafts0
    accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    del llm
    gc.collect()
    return dict(config=config, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                verifications=steps, accepted_per_verification=accepted / steps if steps else None,
                load_seconds=load_seconds, texts=texts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--configs", default="ar,sd-vllm,sd,fsd")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=0.3)
    parser.add_argument("--divergence", default="js")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    import vllm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    # the demo's prompts with the chat template, as `fsd-ext demo` encodes them
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
               if getattr(tokenizer, "chat_template", None) else p
               for p in DEMO_PROMPTS[:args.num_prompts]]
    rows = [run_config(args, config, prompts) for config in args.configs.split(",")]
    base = next((r["tokens_per_s"] for r in rows if r["config"] == "ar"), None)
    print(f"\nvLLM {vllm.__version__}, {args.target} <- {args.draft}, K={args.k}, T={args.threshold} "
          f"({args.divergence}), greedy, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'config':<8} {'tokens/s':>9} {'accepted/call':>14} {'speed-up':>9}")
    for row in rows:
        acc = row["accepted_per_verification"]
        speedup = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{row['config']:<8} {row['tokens_per_s']:>9.2f} {acc if acc is None else round(acc, 2)!s:>14} "
              f"{speedup:>9}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), vllm=vllm.__version__, torch=torch.__version__,
                           machine=platform.processor() or platform.machine(),
                           threads=torch.get_num_threads(), args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
