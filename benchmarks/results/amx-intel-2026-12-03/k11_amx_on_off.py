"""FSD with K=11 (12-row verification steps) on the default pair with GGUF linear weights, the
AMX tile path on and off, interleaved; prints each run's tokens/s line.

    python benchmarks/results/amx-intel-2026-12-03/k11_amx_on_off.py [K]
"""
import sys
from fsd_ext import cli, cpu_linear
prompt = "Write a Python function that returns the n-th Fibonacci number."
args = ["generate", "--target", "qwen2.5-coder-1.5b", "--draft", "qwen2.5-coder-0.5b", "--rule", "fsd",
        "--num-draft-tokens", sys.argv[1] if len(sys.argv) > 1 else "11", "--max-new-tokens", "64",
        "--threads", "2", "--prompt", prompt]
print("AMX available:", cpu_linear.quant_linear_amx(), flush=True)
for run in range(3):
    for amx in (True, False):
        print(f"--- run {run} amx={amx}", flush=True)
        with cpu_linear.use_quant_amx(amx):
            cli.main(args)
