"""llama.cpp's side of bench_vs_llamacpp.py, in a process of its own: llama.cpp and torch each bring
an OpenMP runtime whose idle threads spin for a while after a parallel region, so in one process
each engine's forwards ran beside the other's spinning threads (llama.cpp's prefill 1.7x slower).
Imports llama_cpp and numpy only, so it may run in a venv without torch.

Protocol: one JSON command per line on stdin, one JSON reply per line on stdout.
    {"op": "load", "path": ..., "threads": n, "context": n}             -> {"ok": true}
    {"op": "forwards", "path": ..., "ids": [...], "repeats": n}          -> {"prefill_s", "forward_1_s", "forward_6_s"}
    {"op": "greedy", "path": ..., "ids": [...], "new_tokens": n}         -> {"tokens", "seconds", "prefill_s"}
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def forwards(llm, tokens, repeats):
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    prefill = time.perf_counter() - start
    times = {}
    for steps in (1, 6):
        runs = []
        for _ in range(repeats):
            llm.n_tokens = len(tokens)  # the same positions again (eval drops the cache past n_tokens)
            start = time.perf_counter()
            llm.eval(tokens[-steps:])
            runs.append(time.perf_counter() - start)
        times[steps] = statistics.median(runs)
    return {"prefill_s": prefill, "forward_1_s": times[1], "forward_6_s": times[6]}


def greedy(llm, tokens, new_tokens):
    """Argmax of each step's logits (llama.cpp's own sampler is not used)."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    prefill = time.perf_counter() - start
    out = []
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        if len(out) < new_tokens:
            llm.eval([token])
    return {"tokens": out, "seconds": time.perf_counter() - start, "prefill_s": prefill}


def main() -> int:
    from llama_cpp import Llama, __version__

    models = {}
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "load":
            models[command["path"]] = Llama(model_path=command["path"], n_threads=command["threads"],
                                            n_threads_batch=command["threads"], n_ctx=command["context"],
                                            n_batch=512, logits_all=True, verbose=False)
            reply = {"ok": True, "version": __version__}
        elif op == "forwards":
            reply = forwards(models[command["path"]], command["ids"], command["repeats"])
        elif op == "greedy":
            reply = greedy(models[command["path"]], command["ids"], command["new_tokens"])
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
