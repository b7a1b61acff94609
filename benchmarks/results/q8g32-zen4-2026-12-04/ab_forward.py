"""Draft 1-token forward, q8 against q8g32 in one process: the same Q5_0 / Q8_0 layers repacked both
ways, alternating 15 times (first 3 dropped). Run from the repo root:
PYTHONPATH=. python benchmarks/results/q8g32-zen4-2026-12-04/ab_forward.py qwen2.5-coder-0.5b"""
import sys
import time

import torch
from fsd_ext import models
from fsd_ext.cpu_linear import QuantWeightLinear
from fsd_ext.generate import _CachedModel
torch.set_num_threads(2)
name = sys.argv[1]
model, tok = models.load(name)
layers = [m for m in model.modules() if isinstance(m, QuantWeightLinear) and m.format == "q8g32"]
print(len(layers), "q8g32 layers")
def as_q8(m):
    b, g, _ = m.codes.shape
    return (m.codes.reshape(b, g, 4, 2, 16).permute(0, 1, 3, 2, 4).reshape(b, 2 * g, 64).contiguous(),
            m.params.repeat_interleave(2, dim=1).contiguous())
new = {m: (m.codes, m.params, "q8g32") for m in layers}
old = {m: (*as_q8(m), "q8") for m in layers}
def use(table):
    for m, (c, p, f) in table.items():
        m.codes, m.params, m.format = c, p, f
ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt").input_ids
cm = _CachedModel(model, torch.zeros(1, dtype=torch.int64), 512, False)
res = {"q8": [], "q8g32": []}
with torch.inference_mode():
    cm(ids, 1, prefill=True); cm.cache.lengths += ids.shape[1]
    use(old); a = cm(ids[:, -1:], 1); use(new); b = cm(ids[:, -1:], 1)
    print("max |logit diff| q8 vs q8g32:", (a - b).abs().max().item())
    for it in range(15):
        for label, table in (("q8", old), ("q8g32", new)):
            use(table)
            t = time.perf_counter(); cm(ids[:, -1:], 1); res[label].append(time.perf_counter() - t)
for k, v in res.items():
    v = sorted(v[3:]); print(name, k, "1-token forward median ms %.1f (min %.1f, max %.1f)" % (1e3 * v[len(v)//2], 1e3 * v[0], 1e3 * v[-1]))
