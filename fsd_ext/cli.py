"""`fsd-ext` command line: `generate` (one prompt, any model pair), `demo` (AR vs SD vs FSD on a
few coding prompts with the offline Qwen2.5-Coder 1.5B/0.5B pair, or any pair you name) and
`calibrate` (the largest threshold within a budget of departures from SD).

    fsd-ext demo                                    # offline Qwen2.5-Coder 1.5B / 0.5B
    fsd-ext generate --target T --draft D --prompt "def quicksort(xs):" --rule fsd --threshold 0.3
    fsd-ext calibrate --divergence js --max-deviation 0.01,0.02 --humaneval 0-9
    fsd-ext bench frontier --problems 20            # HumanEval pass@1 vs tokens/s sweep
    fsd-ext cache list | verify | clear [NAME]      # the converted-weights cache
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import torch

from .decoding.draft_length import POLICIES
from .types import DIVERGENCES, GENERATE_RULES, LENIENT_RULES

DEMO_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file.",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINEAR_WEIGHTS = ["auto", "same", "bfloat16", "gguf"]


def _describe_dtype(model) -> str:
    from .cpu_linear import linear_weights_kind

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    kind = linear_weights_kind(model)
    if kind == "gguf-int8":
        dtype += " (the GGUF file's quantised linear weights, int8 activations)"
    elif kind == "gguf":
        dtype += " (the GGUF file's quantised linear weights)"
    elif kind:
        dtype += f" ({kind} linear weights)"
    return dtype


def _load_pair(args, need_draft: bool):
    from . import models
    from .decoding.checks import check_tokenizers

    names = (args.target, args.draft) if need_draft else (args.target,)
    options = {name: models.resolve_load_options(name, args.device, args.dtype, args.linear_weights)
               for name in names}

    def load(name):
        dtype, linear_weights = options[name]
        return models.load(name, dtype=dtype, device=args.device, linear_weights=linear_weights,
                           activations=args.activations)

    # Built-in checkpoints are converted (once) before either model loads, so that a conversion's
    # memory never adds to a loaded model's.
    for name in names:
        models.resolve(name, linears=options[name][1] != "gguf")
    print(f"loading target {args.target} ...", file=sys.stderr, flush=True)
    target, tokenizer = load(args.target)
    draft = None
    if need_draft:
        print(f"loading draft {args.draft} ...", file=sys.stderr, flush=True)
        draft, draft_tokenizer = load(args.draft)
        check_tokenizers(tokenizer, draft_tokenizer)
    return target, draft, tokenizer


def _encode(tokenizer, prompt: str, chat: bool, device: str):
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt").input_ids.to(device)  # [1, P]


def _float_or_none(text: str):
    return None if text.lower() == "none" else float(text)


def _add_sampling_args(parser, temperature: float, threshold: bool = True):
    parser.add_argument("--divergence", default="js", choices=list(DIVERGENCES))
    if threshold:
        parser.add_argument("--threshold", type=float, default=0.3, help="FSD threshold T")
    parser.add_argument("--num-draft-tokens", type=int, default=5,
                        help="K, the most drafts per target call")
    parser.add_argument("--draft-length", default="fixed", choices=list(POLICIES),
                        help="drafts per row and step: fixed (K), confidence (stop below "
                             "--draft-confidence), heuristic (+2 after a fully accepted step, -1 "
                             "otherwise), acceptance (from the row's running acceptance and "
                             "--draft-cost); docs/generate.md")
    parser.add_argument("--draft-confidence", type=float, default=0.4,
                        help="confidence: a row stops after a draft it gives less probability")
    parser.add_argument("--draft-cost", type=float, default=0.25,
                        help="acceptance: a draft forward's time over a target verification's")
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--div-temperature", type=_float_or_none, default=1.0,
                        help="temperature of the distributions the divergence compares; 'none': "
                             "the sampling distributions themselves")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: bfloat16 on a GPU; on a CPU float32 where the GGUF file's linear "
                             "weights are read (see --linear-weights), else bfloat16 with AVX512-BF16, "
                             "else float32 (models.default_dtype)")
    parser.add_argument("--linear-weights", default="auto", choices=LINEAR_WEIGHTS,
                        help="the linear layers' weights (CPU, --dtype float32): bfloat16, the rest "
                             "float32; gguf, a GGUF checkpoint's own quantised codes (exactly its "
                             "weights, 0.75-1.25 bytes each); same: the model's dtype. auto: gguf for "
                             "GGUF checkpoints where its kernel pays off, else bfloat16 where the CPU "
                             "linear kernel pays off in float32 (models.default_linear_weights)")
    parser.add_argument("--activations", default="auto", choices=["auto", "float32", "int8"],
                        help="with gguf linear weights: int8, activations quantised per 32 features and "
                             "multiplied by int8 dot products (AVX512-VNNI); float32, the exact weights in "
                             "float32 products. auto: int8 where the CPU has AVX512-VNNI "
                             "(models.default_activations; docs/cpu.md has its fidelity)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-chat", dest="chat", action="store_false",
                        help="feed the prompt as is (default: the tokenizer's chat template)")


def _generate_kwargs(args, rule: str) -> dict:
    return dict(rule=rule, divergence=args.divergence, threshold=args.threshold,
                num_draft_tokens=args.num_draft_tokens, temperature=args.temperature,
                max_new_tokens=args.max_new_tokens, seed=args.seed, **_loop_kwargs(args))


def _loop_kwargs(args) -> dict:
    """generate's options besides the rule, divergence, threshold, K, temperature, length and seed."""
    return dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                div_temperature=args.div_temperature, draft_length=args.draft_length,
                draft_confidence=args.draft_confidence, draft_cost=args.draft_cost)


def _check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}") from None
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                         f"GPU(s) that torch can use; use --device cpu")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")


def check_args(args) -> None:
    """Every argument of generate / demo / calibrate, checked before anything is installed,
    converted or loaded (the generation options by generate's own check_options): raises
    ValueError or TypeError."""
    from .decoding.checks import check_options
    from .models import check_name

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    _check_device(args.device)
    rules = args.rules.split(",") if args.command == "demo" else [args.rule]
    for rule in rules:
        check_options(rule=rule, divergence=args.divergence, threshold=getattr(args, "threshold", 0.0),
                      num_draft_tokens=args.num_draft_tokens, temperature=args.temperature,
                      max_new_tokens=args.max_new_tokens, **_loop_kwargs(args))
    check_name(args.target)
    if any(rule != "ar" for rule in rules):
        check_name(args.draft)
    if args.command == "calibrate":
        from .decoding.calibrate import check_calibrate_options

        check_calibrate_options(rule=args.rule, divergence=args.divergence,
                                max_deviation=[b for group in args.max_deviation or [[0.02]] for b in group],
                                thresholds=args.thresholds, temperature=args.temperature,
                                refine_steps=args.refine_steps, seed=args.seed, walk=args.walk)
        folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise ValueError(f"--json {args.json}: the folder {folder} does not exist or is not "
                             f"writable")


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from .decoding.loop import generate

    target, draft, tokenizer = _load_pair(args, need_draft=args.rule != "ar")
    input_ids = _encode(tokenizer, args.prompt, args.chat, args.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) \
        if args.stream else None
    out = generate(target, draft, input_ids, streamer=streamer, **_generate_kwargs(args, args.rule))
    if not args.stream:
        print(tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True))
    print(out.stats.summary(), file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .decoding.loop import generate

    rules = args.rules.split(",")
    target, draft, tokenizer = _load_pair(args, need_draft=any(r != "ar" for r in rules))
    prompts = DEMO_PROMPTS[:args.num_prompts]
    encoded = [_encode(tokenizer, p, args.chat, args.device) for p in prompts]
    generate(target, draft, encoded[0], **dict(_generate_kwargs(args, rules[-1]), max_new_tokens=4))
    rows = []
    for rule in rules:
        tokens = seconds = verifications = accepted = 0.0
        for index, input_ids in enumerate(encoded):
            out = generate(target, draft, input_ids, **_generate_kwargs(args, rule))
            stats = out.stats
            tokens, seconds = tokens + stats.new_tokens, seconds + stats.seconds
            verifications += stats.verifications
            accepted += stats.accepted_drafts
            print(f"{rule} | prompt {index}: {stats.summary()}", file=sys.stderr, flush=True)
            if index == 0 and args.show_text:
                text = tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True)
                print(f"--- {rule}, prompt 0 ---\n{text}\n", flush=True)
        rows.append((rule, tokens / seconds, tokens / verifications, accepted / verifications))
    base = next((r[1] for r in rows if r[0] == "ar"), None)
    dtype = _describe_dtype(target)
    print(f"\n{args.target} <- {args.draft}, K={args.num_draft_tokens} ({args.draft_length}), "
          f"T={args.threshold} "
          f"({args.divergence}), temperature={args.temperature}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, {args.device} {dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'rule':<10} {'tokens/s':>9} {'tokens/call':>12} {'accepted/call':>14} {'speed-up':>9}")
    for rule, tps, per_call, acc in rows:
        speedup = f"{tps / base:.2f}x" if base else "-"
        print(f"{rule:<10} {tps:>9.2f} {per_call:>12.2f} {acc:>14.2f} {speedup:>9}")
    return 0


def _floats(text: str) -> List[float]:
    """'0.01,0.02' -> [0.01, 0.02]"""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _fractions(text: str) -> List[float]:
    """'0.01,0.02' -> [0.01, 0.02], each in [0, 1]"""
    values = _floats(text)
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions in [0, 1], got {text!r}")
    return values


def _task_ids(task: str):
    """The argparse type of a task's problem ids (--humaneval 0-9, --gsm8k 0-99)."""
    def parse(text: str) -> List[int]:
        from .bench.humaneval import parse_ids  # (loads the harness only when asked for it)
        from .bench.tasks import TASKS

        try:
            return parse_ids(text, TASKS[task].num_problems, TASKS[task].id_prefix)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse


def read_prompts_file(path: str) -> List[str]:
    """The prompts of a JSONL file: one JSON object per line with a "prompt" string; blank lines are
    skipped."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" string")
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _calibration_prompts(args, texts: List[str], target, draft, tokenizer):
    """-> (1-D token-id tensors, EOS ids for generate or None, a description). A task's problems
    (--humaneval, --gsm8k) are encoded by the frontier benchmark's own backend (its prompt format and
    EOS ids); `texts` as `fsd-ext generate` encodes a prompt."""
    from .bench.tasks import TASKS  # (each task has its own ids flag)

    task = next((name for name in TASKS if getattr(args, name, None) is not None), None)
    if task is not None:
        from .bench.humaneval import select_problems
        from .bench.runner import HFBackend

        ids = getattr(args, task)
        problems = select_problems(TASKS[task].load_problems(), ids=ids, prefix=TASKS[task].id_prefix)
        backend = HFBackend(target, draft, tokenizer, use_chat=None if args.chat else False, task=task)
        return ([backend.prompt_ids(p)[0] for p in problems], backend.eos_token_id,
                f"{TASKS[task].id_prefix.rstrip('/')} {','.join(str(i) for i in ids)}")
    source = args.prompts_file or "the demo prompts"
    return [_encode(tokenizer, text, args.chat, args.device)[0] for text in texts], None, source


def cmd_calibrate(args) -> int:
    from .decoding.calibrate import calibrate, format_points

    budgets = [b for group in (args.max_deviation or [[0.02]]) for b in group]
    texts = read_prompts_file(args.prompts_file) if args.prompts_file else DEMO_PROMPTS  # (early)
    target, draft, tokenizer = _load_pair(args, need_draft=True)
    prompts, eos_ids, source = _calibration_prompts(args, texts, target, draft, tokenizer)
    print(f"calibrating {args.rule} {args.divergence} on {len(prompts)} prompts ({source}), "
          f"temperature {args.temperature}, K={args.num_draft_tokens}, "
          f"{args.max_new_tokens} new tokens", file=sys.stderr, flush=True)
    results = calibrate(
        target, draft, prompts, divergence=args.divergence, max_deviation=budgets, rule=args.rule,
        thresholds=args.thresholds, temperature=args.temperature,
        num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
        refine_steps=args.refine_steps, seed=args.seed, walk=args.walk, eos_token_id=eos_ids,
        on_point=lambda p: print(f"T={p.threshold:.6g}: {p.share:.2%} of {p.accepted_drafts} "
                                 f"accepted drafts SD would reject ({p.decode_seconds:.1f} s decoding)",
                                 file=sys.stderr, flush=True),
        **_loop_kwargs(args))
    points = {p.threshold: p for r in results for p in r.points}
    print(format_points(list(points.values())))
    for r in results:
        print(f"max deviation {r.max_deviation:.2%}: T = {r.threshold:.6g} (measured {r.deviation:.2%})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"target": args.target, "draft": args.draft, "prompts": source,
                       "calibrations": [r.to_dict() for r in results]}, handle, indent=1)
    return 0


def cmd_cache(args) -> int:
    from . import cache_files, models

    artefacts = models.cached_artefacts()
    if args.name is not None:
        artefacts = [a for a in artefacts if a.name == args.name]
        if not artefacts:
            print(f"nothing cached for {args.name!r} in {models.cache_dir()}", file=sys.stderr)
            return 1 if args.cache_command != "clear" else 0
    if args.cache_command == "list":
        print(f"{models.cache_dir()}:")
        for a in artefacts:
            print(f"{a.name:<28} {a.kind:<13} {cache_files.size_on_disk(a.path) / 1e6:>10.1f} MB  {a.path.name}")
        total = sum(cache_files.size_on_disk(a.path) for a in artefacts)
        print(f"{len(artefacts)} artefacts, {total / 1e6:.1f} MB on disk")
        return 0
    if args.cache_command == "verify":
        bad = 0
        for a in artefacts:
            try:
                models.verify_artefact(a)
                print(f"ok   {a.kind:<13} {a.path}")
            except cache_files.CorruptCache as error:
                bad += 1
                print(f"BAD  {a.kind:<13} {error}")
        if bad:
            print(f"{bad} damaged: `fsd-ext cache clear NAME` deletes a model's artefacts; the next load "
                  f"rebuilds them", file=sys.stderr)
        return 1 if bad else 0
    for a in artefacts:  # clear
        models.remove_artefact(a)
        print(f"deleted {a.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_DRAFT, DEFAULT_TARGET, names

    parser = argparse.ArgumentParser(prog="fsd-ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    models_help = f"HF directory, hub id, .gguf file, or one of {', '.join(names())}"

    gen = sub.add_parser("generate", help="generate from one prompt")
    gen.add_argument("--target", required=True, help=models_help)
    gen.add_argument("--draft", default=None, help=models_help + " (not needed for --rule ar)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--rule", default="fsd", choices=list(GENERATE_RULES))
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    _add_sampling_args(gen, temperature=1.0)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="AR vs SD vs FSD on a few coding prompts")
    demo.add_argument("--target", default=DEFAULT_TARGET, help=models_help)
    demo.add_argument("--draft", default=DEFAULT_DRAFT, help=models_help)
    demo.add_argument("--rules", default="ar,sd,fsd", help="comma-separated rules to compare")
    demo.add_argument("--num-prompts", type=int, default=3, choices=range(1, len(DEMO_PROMPTS) + 1))
    demo.add_argument("--show-text", action="store_true", help="print each rule's first answer")
    _add_sampling_args(demo, temperature=0.0)
    demo.set_defaults(func=cmd_demo, max_new_tokens=48)

    cal = sub.add_parser("calibrate", help="the largest threshold within a budget of departures from SD")
    cal.add_argument("--target", default=DEFAULT_TARGET, help=models_help)
    cal.add_argument("--draft", default=DEFAULT_DRAFT, help=models_help)
    cal.add_argument("--rule", default="fsd", choices=list(LENIENT_RULES))
    cal.add_argument("--max-deviation", type=_fractions, action="append",
                     help="budget: the share of accepted drafts SD would have rejected (default "
                          "0.02); several, repeated or comma-separated, each get a search")
    cal.add_argument("--thresholds", type=_floats, default=None,
                     help="candidate thresholds, comma-separated (default: the rule's grid, the "
                          "divergence's for fsd / fsd_strict: fsd_ext.types.threshold_grids)")
    cal.add_argument("--refine-steps", type=int, default=2,
                     help="bisections between the last candidate within budget and the next")
    cal.add_argument("--walk", choices=["up", "down"], default=None,
                     help="walk the candidates up from the exact end or down from the lenient end "
                          "(default: down for the strict rules, whose share need not grow with T)")
    prompts = cal.add_mutually_exclusive_group()
    prompts.add_argument("--prompts-file", default=None,
                         help='JSONL, one {"prompt": "..."} per line (default: the demo prompts)')
    prompts.add_argument("--humaneval", type=_task_ids("humaneval"), default=None, metavar="IDS",
                         help="HumanEval problems, e.g. 0-9 or 0,3,7, prompted as `fsd-ext bench "
                              "frontier` prompts them")
    prompts.add_argument("--gsm8k", type=_task_ids("gsm8k"), default=None, metavar="IDS",
                         help="GSM8K problems, likewise (`fsd-ext bench frontier --task gsm8k`)")
    cal.add_argument("--json", default=None, metavar="PATH", help="write the calibrations here")
    _add_sampling_args(cal, temperature=0.0, threshold=False)
    cal.set_defaults(func=cmd_calibrate)

    bench = sub.add_parser("bench", help="benchmarks (frontier: HumanEval pass@1 vs tokens/s sweep)")
    from .bench.cli import add_frontier_parser  # the harness loads only when the CLI is built

    add_frontier_parser(bench.add_subparsers(dest="bench_command", required=True))

    cache = sub.add_parser("cache", help="the converted-weights cache ($FSD_EXT_CACHE, else ~/.cache/fsd_ext)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    for command, text in [("list", "each artefact and its size on disk"),
                          ("verify", "check every artefact against its digests in full (exit 1 if any differs)"),
                          ("clear", "delete the cached artefacts (of one model with NAME)")]:
        one = cache_sub.add_parser(command, help=text)
        one.add_argument("name", nargs="?", default=None, metavar="NAME",
                         help=f"one model: {', '.join(names())} or a GGUF file's name without .gguf")
        one.set_defaults(func=cmd_cache)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate" and args.rule != "ar" and args.draft is None:
        build_parser().error("--draft is needed unless --rule ar")
    # A user's mistake (a bad argument, or a model pair that does not fit: what generate and the
    # models' checks raise as ValueError / TypeError) is one line, as argparse's; the arguments
    # are checked before anything is installed, converted or loaded.
    try:
        if args.command in ("generate", "demo", "calibrate"):
            check_args(args)
        if getattr(args, "threads", None):
            torch.set_num_threads(args.threads)
        return args.func(args)
    except (ValueError, TypeError) as error:
        print(f"fsd-ext: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
