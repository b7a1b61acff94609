"""One accept call per configuration, for a profiler (called by benchmarks/gpu_check.sh under ncu).

    ncu --clock-control none --section SpeedOfLight ... python benchmarks/profile_accept_cuda.py

Prints, in launch order, which configuration each group of kernel launches belongs to, so the
profiler's per-kernel rows (also in launch order) can be matched to them. Needs a GPU.
"""

from __future__ import annotations

import os

import torch

from bench_accept_cuda import make_inputs  # benchmarks/ is on sys.path when run as a script
from fsd_ext import ops

# (name, batch, K, V, dtype, launch options (FSD_EXT_CUDA_LAUNCH), extra accept kwargs)
CONFIGS = [
    ("B64 K5 V128256 bf16 fsd/js, planner", 64, 5, 128256, torch.bfloat16, "", {}),
    ("B64 K5 V128256 bf16 fsd/js, cluster", 64, 5, 128256, torch.bfloat16, "cluster=1", {}),
    ("B1 K5 V151936 bf16 fsd/js, planner", 1, 5, 151936, torch.bfloat16, "", {}),
    ("B1 K5 V151936 bf16 fsd/js, cluster", 1, 5, 151936, torch.bfloat16, "cluster=1", {}),
    ("B16 K5 V128256 bf16 top_p=0.9", 16, 5, 128256, torch.bfloat16, "", {"top_p": 0.9}),
]


def main():
    assert torch.cuda.is_available(), "needs a GPU"
    for name, batch, k, vocab, dtype, launch, extra in CONFIGS:
        target, draft, tokens, _, _ = make_inputs(batch, k, vocab, dtype)  # the benchmark's logits
        os.environ["FSD_EXT_CUDA_LAUNCH"] = f"{launch},log=1" if launch else "log=1"
        torch.cuda.synchronize()
        print(f"=== config: {name}", flush=True)  # the launcher's path line follows on stderr
        ops.accept(target, draft, tokens, rule="fsd", divergence="js", threshold=0.3, seed=1, **extra)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
