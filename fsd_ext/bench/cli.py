"""The accuracy/speed frontier of FSD on a real model pair: HumanEval pass@1 against tokens/s.

The command line of the sweep (`fsd-ext bench frontier`, benchmarks/frontier.py): arguments, the
run (decode what is missing, log the invocation) and its summary, table and plots. What is measured:
fsd_ext/bench/__init__.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence

from ..decoding.draft_length import POLICIES
from ..types import DIVERGENCES
from . import humaneval
from .env import environment
from .grid import BENCH_RULES, DEFAULT_THRESHOLDS, Config, build_grid, parse_config, parse_thresholds
from .plots import plot_all
from .tasks import TASKS
from .runner import Backend, HFBackend, load_model, run_sweep
from .store import ResultStore, _now, latest_setup, lock_folder, logged_run, read_runs, setup_id
from .summary import format_table, summarize, target_check, write_summary


def _csv_list(text: str, cast=str) -> List:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser):
    from ..models import DEFAULT_DRAFT, DEFAULT_TARGET, names
    model = parser.add_argument_group("models")
    model.add_argument("--target", default=DEFAULT_TARGET,
                       help=f"target model: one of {', '.join(names())}, a folder, a .gguf file or a hub id")
    model.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model")
    model.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (None: fsd_ext.models.default_dtype)")
    model.add_argument("--linear-weights", default="auto", choices=["auto", "same", "bfloat16", "gguf"],
                       help="the linear layers' weights, as in `fsd-ext generate` (auto: the GGUF "
                            "file's codes or bfloat16 for float32 CPU models where they pay off)")
    model.add_argument("--activations", default="auto", choices=["auto", "float32", "int8"],
                       help="with gguf linear weights, as in `fsd-ext generate` (auto: int8 with AVX512-VNNI)")
    model.add_argument("--device", default=None, help="cpu | cuda (None: cuda if available)")
    model.add_argument("--no-cuda-graphs", action="store_true", help="pass use_cuda_graphs=False")

    task = parser.add_argument_group("task")
    task.add_argument("--task", choices=sorted(TASKS), default="humaneval",
                      help="humaneval (code, run against its tests) or gsm8k (math word problems, the "
                           "final number; its test split is downloaded once, fsd_ext.bench.gsm8k)")
    which = task.add_mutually_exclusive_group()
    which.add_argument("--problems", type=int, default=20, help="the task's first N problems")
    which.add_argument("--ids", default=None, help="problem numbers, e.g. 0-9,12,HumanEval/20")
    which.add_argument("--all", action="store_true", help="all the task's problems (HumanEval 164, GSM8K 1319)")
    task.add_argument("--no-chat", action="store_true", help="raw prompts even if the tokenizer has a chat template")
    task.add_argument("--max-new-tokens", type=int, default=512)
    task.add_argument("--timeout", type=float, default=10.0, help="seconds per test run")

    grid = parser.add_argument_group("configurations")
    grid.add_argument("--rules", default=",".join(BENCH_RULES), help="subset of " + ",".join(BENCH_RULES))
    grid.add_argument("--divergences", default=",".join(DIVERGENCES), help="subset of js,rkl,kl,tv,mkl")
    grid.add_argument("--thresholds", default=None,
                      help="override grids, e.g. 'js=0.1,0.2,0.3;rkl=0.5,1;typical=4,11.1' (defaults: "
                           + "; ".join(f"{k}={','.join(map(str, v))}" for k, v in DEFAULT_THRESHOLDS.items())
                           + ")")
    grid.add_argument("--draft-lengths", default="fixed",
                      help=f"draft-length policies of the SD/FSD rows, a subset of {','.join(POLICIES)}")
    grid.add_argument("--config", action="append", default=None, metavar="SPEC",
                      help="an explicit configuration instead of the grid, repeatable: "
                           "rule[:divergence]:threshold[:draft_length][:K=n], e.g. ar, sd:heuristic, "
                           "fsd:js:0.2:acceptance:K=8, typical:11.1 (sampling, seeds and K unless given from the "
                           "options below)")
    grid.add_argument("--num-draft-tokens", type=int, default=5, help="K (the most, when adaptive)")
    grid.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    grid.add_argument("--top-p", type=float, default=None)
    grid.add_argument("--seeds", default="0", help="comma-separated seeds (sampling only)")
    grid.add_argument("--div-temperature", type=float, default=1.0)

    run = parser.add_argument_group("run")
    run.add_argument("--out", default=os.path.join("benchmarks", "results", "frontier"),
                     help="output folder (results.jsonl, summary.*, *.png)")
    run.add_argument("--warmup-tokens", type=int, default=16,
                     help="an untimed decode of this many tokens before each configuration (0: none)")
    run.add_argument("--no-sd-check", action="store_true",
                     help="do not count accepted drafts SD would reject under sampling (generate's "
                          "coin replay)")
    run.add_argument("--order", choices=("config", "problem"), default="config",
                     help="config: one configuration after the other (a progress bar each); problem: "
                          "every configuration on each problem in turn, so load changes on a shared "
                          "machine hit all configurations alike")
    run.add_argument("--max-contention", type=float, default=0.25,
                     help="decode a problem again (up to 3 times) when other processes used more "
                          "than this many cores meanwhile (a shared machine; negative: never)")
    run.add_argument("--batch-size", type=int, default=1,
                     help="decode this many problems at a time: an accuracy run, whose summary gives "
                          "tokens/s only from batch-1 records (time batch 1 on a subset)")
    run.add_argument("--share-prompts", action="store_true",
                     help="run each prompt's forwards once for all its configurations (same tokens; "
                          "with --order problem): an accuracy run, whose summary gives no tokens/s")
    run.add_argument("--summarize-only", action="store_true", help="only rebuild summary and plots")
    run.add_argument("--summary-dir", default=None,
                     help="where the summary and plots go (default: --out), e.g. a table of the "
                          "problems a threshold was not calibrated on: --summarize-only --ids 10-163")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def add_frontier_parser(subparsers) -> argparse.ArgumentParser:
    """Hook for the CLI: `fsd-ext bench frontier ...` (pass the `bench` command's subparsers)."""
    parser = subparsers.add_parser("frontier", help="HumanEval pass@1 vs tokens/s sweep over AR/SD/FSD",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=cli_main)
    return parser


def cli_main(args) -> int:
    """The `func` that add_frontier_parser registers: run, print, return the exit status."""
    run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/frontier.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return parser


def configs_from_args(args) -> List[Config]:
    seeds = _csv_list(args.seeds, int)
    if args.config:
        seeds = seeds[:1] if args.temperature == 0 else seeds
        return [parse_config(spec, temperature=args.temperature, top_p=args.top_p, seed=seed,
                             num_draft_tokens=args.num_draft_tokens,
                             div_temperature=args.div_temperature)
                for seed in seeds for spec in args.config]
    return build_grid(rules=_csv_list(args.rules), divergences=_csv_list(args.divergences),
                      thresholds=parse_thresholds(args.thresholds), temperature=args.temperature,
                      top_p=args.top_p, seeds=seeds, num_draft_tokens=args.num_draft_tokens,
                      div_temperature=args.div_temperature,
                      draft_lengths=_csv_list(args.draft_lengths))


def problems_from_args(args) -> List[Dict[str, str]]:
    task = TASKS[getattr(args, "task", "humaneval")]
    problems = task.load_problems()
    if args.all:
        return problems
    ids = humaneval.parse_ids(args.ids, task.num_problems, task.id_prefix) if args.ids else None
    return humaneval.select_problems(problems, num=None if args.ids else args.problems, ids=ids,
                                     prefix=task.id_prefix)


def finish(store: ResultStore, setup: Dict[str, Any], out_dir: str, meta: Dict[str, Any],
           configs: Optional[Sequence[Config]] = None,
           task_ids: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """Summary table, CSV/JSON and plots for the records of `setup` (restricted to `configs` and
    `task_ids` where given)."""
    records = store.for_setup(setup_id(setup))
    if configs is not None:
        keys = {c.key for c in configs}
        records = [r for r in records if r["key"] in keys]
    if task_ids is not None:
        task_ids = set(task_ids)
        records = [r for r in records if r["task_id"] in task_ids]
    rows = summarize(records)
    if not rows:
        print("no results yet for this setup")
        return rows
    write_summary(rows, out_dir, meta)
    title = f"{setup.get('target', '')} / {setup.get('draft', '')}, {rows[0]['problems']} problems"
    plot_all(rows, out_dir, title)
    print(format_table(rows))
    check = target_check(rows)
    if check.get("adaptive_sd_row"):
        print(f"target (adaptive SD >= 1.15x fixed-K SD, same outputs): "
              f"{'met' if check['adaptive_sd_met'] else 'not met'} by {check['adaptive_sd_row']} "
              f"({check['adaptive_sd_speedup']:.2f}x)")
    print(f"target (FSD within 2 points of SD at >= 1.3x SD's and >= 1.15x adaptive SD's tokens/s): "
          f"{'met by ' + check['row'] if check['met'] else 'not met: ' + check['reason']}")
    return rows


def run_from_args(args, backend: Optional[Backend] = None) -> List[Dict[str, Any]]:
    """Decode what is missing (unless --summarize-only), then write the summary and plots. The
    summary's meta lists every invocation that decoded into --out (a resumed sweep has several).
    A sweep holds --out (store.lock_folder): a second one into the same folder refuses before any
    work (store.FolderLocked)."""
    if args.summarize_only:
        return _run(args, backend)
    with lock_folder(args.out):
        return _run(args, backend)


def _run(args, backend: Optional[Backend]) -> List[Dict[str, Any]]:
    import torch
    if args.share_prompts and args.order != "problem":
        raise ValueError("--share-prompts needs --order problem (a problem's configurations must "
                         "decode one after the other to share its prompt forwards)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.dtype:
        from ..models import default_dtype
        dtype = str(default_dtype(device, args.target)).removeprefix("torch.")
    else:
        dtype = args.dtype
    configs = configs_from_args(args)
    problems = problems_from_args(args)
    task_ids = [p["task_id"] for p in problems]
    store = ResultStore(os.path.join(args.out, "results.jsonl"))
    command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv)
    if args.summarize_only and backend is None:
        setup = latest_setup(store, args.target, args.draft, args.max_new_tokens)
        if setup is None:
            print(f"no results for {args.target} / {args.draft} in {store.path}")
            return []
    else:
        if backend is None:
            target, tokenizer = load_model(args.target, dtype, device, args.linear_weights, args.activations)
            # The same spec twice (a pipeline check: SD then accepts everything) shares one model.
            draft = (target if args.draft == args.target
                     else load_model(args.draft, dtype, device, args.linear_weights, args.activations)[0])
            backend = HFBackend(target, draft, tokenizer, max_new_tokens=args.max_new_tokens,
                                use_chat=False if args.no_chat else None,
                                check_sd=not args.no_sd_check,
                                use_cuda_graphs=False if args.no_cuda_graphs else "auto",
                                names={"target": args.target, "draft": args.draft}, task=args.task,
                                share_prompts=args.share_prompts)
        setup = backend.setup()
    sid = setup_id(setup)
    print(f"{len(configs)} configurations x {len(problems)} problems -> {args.out} "
          f"(setup {sid}, {len(store.for_setup(sid))} records already there)")
    if not args.summarize_only:
        env = environment()
        if not env.get("fsd_ext_compiled"):
            print("warning: fsd_ext's compiled ops are not built; generate falls back to the "
                  "pure-torch reference and tokens/s understate the library "
                  "(python setup.py build_ext --inplace)")
        run = {"command": command, "setup": setup, "setup_id": sid, "device": device,
               "problems": task_ids, "configs": [c.key for c in configs], "environment": env,
               "start": _now()}
        with logged_run(args.out, run) as run:
            def count(_record):
                run["records_written"] += 1

            run_sweep(configs, problems, backend, store,
                      humaneval.SandboxLimits(timeout_s=args.timeout),
                      progress=not args.no_progress, warmup_tokens=args.warmup_tokens,
                      order=args.order, on_record=count, batch_size=args.batch_size,
                      max_contention=None if args.max_contention < 0 else args.max_contention)
    meta = {"summary_command": command, "setup": setup, "setup_id": sid, "problems": task_ids,
            "runs": [r for r in read_runs(args.out) if r.get("setup_id") == sid], "time": _now()}
    return finish(store, setup, args.summary_dir or args.out, meta, configs, task_ids)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_main(build_parser().parse_args(argv))
