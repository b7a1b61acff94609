"""fsd-ext against llama.cpp on the same GGUF files, same prompt, same threads, in one run.

For each model of the pair (the default: Qwen2.5-Coder 1.5B target, 0.5B draft), alternating the two
engines round by round (ABBA), medians over rounds:
    prefill of a HumanEval prompt (its chat-formatted token ids, fed to both engines as ids),
    one-token forward, six-token forward with all logits (a K=5 verification),
    greedy AR decoding (argmax of each step's logits) of --new-tokens tokens: decode tokens/s and
    end to end (prefill included);
and fsd-ext's SD and FSD end to end on the same prompts, against llama.cpp's AR. The machine's read
bandwidth (a 1 GB sum, best of 5) is measured in each round: forwards that read the weights once are
bound by it (table: the one-token forward's effective GB/s of the weights' bytes).

    pip install -e ".[bench-llamacpp]"   # builds llama.cpp: 10-20 minutes on 2 cores
    python benchmarks/cpu_linear/bench_vs_llamacpp.py --rounds 5 --threads 2 --out benchmarks/results/<run>

llama.cpp runs through llama-cpp-python in a process of its own (llamacpp_worker.py; --llama-python
may name a venv that has it without torch): Llama(logits_all=True), eval of token ids, its own
sampler unused. fsd-ext runs fsd_ext.models.load's defaults (--activations picks the linear layers'
arithmetic) and fsd_ext.generate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_ext import models  # noqa: E402
from fsd_ext.bench import humaneval  # noqa: E402
from fsd_ext.decoding.loop import generate  # noqa: E402
from fsd_ext.decoding.model import CachedModel  # noqa: E402


def read_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """GB/s of the best of `repeats` sums of a float32 buffer (torch's sum streams it at about what a
    hand-written AVX-512 read loop reaches)."""
    x = torch.ones(int(gigabytes * 2 ** 30) // 4)
    x.sum()
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


class FsdEngine:
    name = "fsd-ext"

    def __init__(self, model):
        self.model = model
        self.pad = torch.zeros(1, dtype=torch.int64)

    def prefilled(self, ids: torch.Tensor):
        """(the model with `ids` read into a fresh cache, seconds that took)."""
        cached = CachedModel(self.model, self.pad, ids.shape[1] + 64, use_graphs=False)
        start = time.perf_counter()
        cached(ids, 1, prefill=True)
        seconds = time.perf_counter() - start
        cached.cache.lengths += ids.shape[1]
        return cached, seconds

    @staticmethod
    def forward_seconds(cached, ids: torch.Tensor, steps: int, repeats: int) -> float:
        """Median seconds of a forward of the last `steps` prompt tokens again, at the same slots."""
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            cached(ids[:, -steps:], steps)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    def forwards(self, ids: torch.Tensor, repeats: int) -> dict:
        """Seconds of the prompt's forward and median seconds of 1- and 6-token forwards after it."""
        with torch.inference_mode():
            cached, prefill = self.prefilled(ids)
            return {"prefill_s": prefill, "forward_1_s": self.forward_seconds(cached, ids, 1, repeats),
                    "forward_6_s": self.forward_seconds(cached, ids, 6, repeats)}

    def greedy(self, ids: torch.Tensor, new_tokens: int) -> dict:
        out = generate(self.model, None, ids, rule="ar", temperature=0.0, max_new_tokens=new_tokens,
                       eos_token_id=[])
        stats = out.stats
        return {"tokens": out.sequences[0, ids.shape[1]:].tolist(), "seconds": stats.seconds,
                "prefill_s": stats.prefill_seconds}


class LlamaEngine:
    """llama.cpp through llamacpp_worker.py in a process of its own (see there why)."""

    name = "llama.cpp"

    def __init__(self, worker: subprocess.Popen, path: Path, threads: int, context: int):
        self.worker, self.path = worker, str(path)
        self.version = self._call({"op": "load", "path": self.path, "threads": threads, "context": context})["version"]

    def _call(self, command: dict) -> dict:
        self.worker.stdin.write(json.dumps(command) + "\n")
        self.worker.stdin.flush()
        line = self.worker.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker stopped (exit status {self.worker.poll()})")
        return json.loads(line)

    def forwards(self, ids: torch.Tensor, repeats: int) -> dict:
        return self._call({"op": "forwards", "path": self.path, "ids": ids[0].tolist(), "repeats": repeats})

    def greedy(self, ids: torch.Tensor, new_tokens: int) -> dict:
        return self._call({"op": "greedy", "path": self.path, "ids": ids[0].tolist(), "new_tokens": new_tokens})


def machine(llama_version: str) -> dict:
    cpu = ""
    flags = set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    from fsd_ext import cpu_linear
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512_vnni": "avx512_vnni" in flags,
            "avx_vnni": "avx_vnni" in flags, "amx_int8": "amx_int8" in flags, "python": platform.python_version(),
            "torch": torch.__version__, "llama_cpp_python": llama_version,
            "int8_path": cpu_linear.int8_linear_path(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def median(rounds, key):
    return statistics.median(r[key] for r in rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT)
    parser.add_argument("--activations", default="auto", choices=["auto", "float32", "int8"])
    parser.add_argument("--problems", default="2,10,20", help="HumanEval problem indices (the first: forwards)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9, help="timed 1- and 6-token forwards per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--threshold", type=float, default=0.3, help="FSD's (js) threshold")
    parser.add_argument("--out", type=Path, default=None, help="a folder for results.json and table.md")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="the Python that runs llama.cpp (a venv with llama-cpp-python; default: this one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    problems = humaneval.load_problems()
    loaded = {}
    for role, name in (("target", args.target), ("draft", args.draft)):
        model, tokenizer = models.load(name, activations=args.activations)
        gguf = models.assemble_gguf(models.BUILTIN[name]) if name in models.BUILTIN else Path(name)
        loaded[role] = (model, tokenizer, gguf)
    tokenizer = loaded["target"][1]
    prompts = [tokenizer(humaneval.format_prompt(problems[int(i)], tokenizer), return_tensors="pt").input_ids
               for i in args.problems.split(",")]
    context = max(p.shape[1] for p in prompts) + args.new_tokens + 16
    worker = subprocess.Popen([args.llama_python, str(Path(__file__).with_name("llamacpp_worker.py"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    engines = {role: [FsdEngine(model), LlamaEngine(worker, gguf, args.threads, context)]
               for role, (model, _, gguf) in loaded.items()}

    rows = {}  # (role, engine) -> list of per-round dicts
    speculative = {"sd": [], "fsd": []}
    bandwidth = []
    target, draft = loaded["target"][0], loaded["draft"][0]
    for round_index in range(args.rounds):
        bandwidth.append(read_bandwidth())
        for role, pair in engines.items():
            for engine in (pair if round_index % 2 == 0 else pair[::-1]):
                result = engine.forwards(prompts[0], args.repeats)
                if role == "target":
                    runs = [engine.greedy(p, args.new_tokens) for p in prompts]
                    result["ar_decode_tok_s"] = (len(prompts) * args.new_tokens /
                                                 sum(r["seconds"] - r["prefill_s"] for r in runs))
                    result["ar_tok_s"] = len(prompts) * args.new_tokens / sum(r["seconds"] for r in runs)
                    result["ar_tokens"] = [r["tokens"] for r in runs]
                rows.setdefault((role, engine.name), []).append(result)
        for rule in ("sd", "fsd"):
            seconds = tokens = prefill = 0.0
            for p in prompts:
                out = generate(target, draft, p, rule=rule, divergence="js", threshold=args.threshold,
                               temperature=0.0, max_new_tokens=args.new_tokens, eos_token_id=[])
                seconds, tokens, prefill = seconds + out.stats.seconds, tokens + out.stats.new_tokens, \
                    prefill + out.stats.prefill_seconds
            speculative[rule].append({"tok_s": tokens / seconds, "decode_tok_s": tokens / (seconds - prefill)})
        print(f"round {round_index + 1}/{args.rounds} done (read bandwidth {bandwidth[-1]:.1f} GB/s)", file=sys.stderr)

    worker.stdin.close()
    worker.wait()
    summary = {"machine": machine(engines["target"][1].version), "args": {k: str(v) for k, v in vars(args).items()},
               "prompt_tokens": [int(p.shape[1]) for p in prompts], "read_bandwidth_gb_s": statistics.median(bandwidth),
               "engines": {}, "speculative": {}}
    for (role, engine), runs in rows.items():
        entry = {key: median(runs, key) for key in ("prefill_s", "forward_1_s", "forward_6_s")}
        if role == "target":
            entry.update({key: median(runs, key) for key in ("ar_decode_tok_s", "ar_tok_s")})
        summary["engines"][f"{role}/{engine}"] = entry
    for rule, runs in speculative.items():
        summary["speculative"][rule] = {key: median(runs, key) for key in ("tok_s", "decode_tok_s")}
    ours, theirs = rows[("target", "fsd-ext")][0]["ar_tokens"], rows[("target", "llama.cpp")][0]["ar_tokens"]
    summary["greedy_same_tokens"] = [sum(a == b for a, b in zip(x, y)) for x, y in zip(ours, theirs)]

    table = format_table(summary)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "table.md").write_text(table + "\n")
    return 0


def format_table(s: dict) -> str:
    e = s["engines"]
    lines = [f"{s['machine']['cpu']}, {s['args']['threads']} threads, read bandwidth {s['read_bandwidth_gb_s']:.1f} GB/s "
             f"(median of rounds); prompt {s['prompt_tokens'][0]} tokens; medians of {s['args']['rounds']} rounds",
             "", "| measure | llama.cpp 1.5B | fsd-ext 1.5B | fsd-ext / llama.cpp | llama.cpp 0.5B | fsd-ext 0.5B | "
             "fsd-ext / llama.cpp |", "|---|--:|--:|--:|--:|--:|--:|"]

    def row(label, key, unit_scale, unit, higher_is_better):
        cells = []
        for role in ("target", "draft"):
            theirs, ours = e[f"{role}/llama.cpp"].get(key), e[f"{role}/fsd-ext"].get(key)
            if theirs is None or ours is None:
                cells += ["", "", ""]
                continue
            speed = ours / theirs if higher_is_better else theirs / ours
            cells += [f"{theirs * unit_scale:.1f} {unit}", f"{ours * unit_scale:.1f} {unit}", f"{speed:.2f}x"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row(f"prefill, {s['prompt_tokens'][0]} tokens", "prefill_s", 1, "s", False)
    row("1-token forward", "forward_1_s", 1e3, "ms", False)
    row("6-token forward, all logits", "forward_6_s", 1e3, "ms", False)
    row("greedy AR, decode", "ar_decode_tok_s", 1, "tok/s", True)
    row("greedy AR, end to end", "ar_tok_s", 1, "tok/s", True)
    target = e["target/fsd-ext"]
    lines += ["", f"fsd-ext 6-token / 1-token forward (1.5B): {target['forward_6_s'] / target['forward_1_s']:.2f}x", ""]
    lines += ["| fsd-ext, end to end | tokens/s | vs fsd-ext AR | vs llama.cpp AR |", "|---|--:|--:|--:|"]
    ours_ar, llama_ar = target["ar_tok_s"], e["target/llama.cpp"]["ar_tok_s"]
    lines.append(f"| AR | {ours_ar:.2f} | 1.00x | {ours_ar / llama_ar:.2f}x |")
    for rule, r in s["speculative"].items():
        lines.append(f"| {rule.upper()} | {r['tok_s']:.2f} | {r['tok_s'] / ours_ar:.2f}x | {r['tok_s'] / llama_ar:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
