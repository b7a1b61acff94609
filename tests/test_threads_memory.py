"""Thread safety and memory stability of the CPU ops (issue 6).

- Concurrent calls from several Python threads on shared inputs give the results of serial calls.
- 10,000 repeated calls (including calls that raise) do not grow resident memory nor the bytes
  malloc has handed out, measured in a fresh process, with a leaking negative control.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import fsd_ext
from fsd_ext import ops as fsd_ops

if fsd_ops._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext._C is not built", allow_module_level=True)

THREADS = 4
REPEATS = int(os.environ.get("FSD_MEMORY_REPEATS", "10000"))


def _inputs():
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 8, 4, 300
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2  # [B, K+1, V]
    draft = target[:, :k] + 0.5 * torch.randn(batch, k, vocab, generator=gen)  # [B, K, V]
    drafts = draft.argmax(-1)  # [B, K]
    return target, draft, drafts


TARGET, DRAFT, DRAFTS = _inputs()
TARGET_BF16, DRAFT_BF16, DRAFTS_INT32 = TARGET.bfloat16(), DRAFT.bfloat16(), DRAFTS.int()
NUM_DRAFT = torch.tensor([0, 1, 2, 3, 4, 4, 2, 1])
TEMPERATURES = torch.linspace(0, 2, 8)

# Each call covers a different kernel path (filters, per-row values, bucketed divergence, ragged K).
CALLS = {
    "accept_fsd": lambda seed: fsd_ext.accept(TARGET, DRAFT, DRAFTS, threshold=0.3, seed=seed,
                                              return_divergence=True),
    "accept_filtered": lambda seed: fsd_ext.accept(
        TARGET_BF16, DRAFT_BF16, DRAFTS_INT32, rule="sd", top_k=20, top_p=0.9, min_p=0.01,
        div_top_k=5, num_draft=NUM_DRAFT, seed=torch.arange(8) + seed, temperature=TEMPERATURES,
        return_divergence=True),
    "accept_strict_greedy": lambda seed: fsd_ext.accept(TARGET, DRAFT, DRAFTS, rule="fsd_strict",
                                                        divergence="tv", threshold=0.2, temperature=0.0,
                                                        seed=seed),
    "divergence": lambda seed: fsd_ext.divergence(TARGET[:2, :4], DRAFT[:2], kind=("kl", "js", "mkl")[seed % 3],
                                                  top_k=(None, 7)[seed % 2]),
    "sample": lambda seed: fsd_ext.sample(TARGET[:2], temperature=0.8, top_p=0.95, seed=seed),
    "philox_uniforms": lambda seed: fsd_ext.philox_uniforms(seed, 1, 8, 5),
}


def _as_tensors(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if t is not None]


def _same(a, b):
    return all(torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0)) if x.is_floating_point() else torch.equal(x, y)
               for x, y in zip(_as_tensors(a), _as_tensors(b)))


def test_concurrent_calls_match_serial():
    seeds = list(range(12))
    serial = {(name, s): call(s) for name, call in CALLS.items() for s in seeds}
    failures, errors = [], []
    start = threading.Barrier(THREADS)

    def worker(index):
        try:
            start.wait()
            for round_ in range(3):
                for name, call in CALLS.items():
                    for s in seeds[index::2] if round_ % 2 else seeds:
                        if not _same(call(s), serial[(name, s)]):
                            failures.append((index, name, s))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert not failures, failures[:10]


def test_concurrent_calls_with_intra_op_threads():
    """Python threads on top of at::parallel_for's own pool (large batch so it splits)."""
    target = TARGET.repeat(16, 1, 1)
    draft, drafts = DRAFT.repeat(16, 1, 1), DRAFTS.repeat(16, 1)
    want = fsd_ext.accept(target, draft, drafts, threshold=0.3, seed=1, return_divergence=True)
    got = [None] * THREADS

    def worker(i):
        got[i] = fsd_ext.accept(target, draft, drafts, threshold=0.3, seed=1, return_divergence=True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(_same(g, want) for g in got)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes() -> int:
    """Bytes malloc has handed out and not got back (all arenas, mmapped chunks included): a leak
    shows here even where freed-but-resident memory hides it from the RSS."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:  # not glibc >= 2.33
        return 0
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _raising_call(seed):
    try:  # draft id out of range: the TORCH_CHECK path
        fsd_ext.accept(TARGET, DRAFT, DRAFTS + 1000, seed=seed)
    except RuntimeError:
        return
    raise AssertionError("did not raise")


_KEPT = []
MEMORY_CALLS = dict(CALLS, raising=_raising_call,
                    # negative control: keeps 1 KiB per call, which the check must see
                    leak_control=lambda s: _KEPT.append(torch.empty(256).fill_(s)))


def measure_growth(repeats: int = REPEATS) -> dict:
    """{call name: (RSS growth, heap growth)} in bytes over `repeats` calls after a warm-up. Run in
    a fresh process (see memory_report): in a long test session freed heap memory absorbs a leak."""
    report = {}
    for name, call in MEMORY_CALLS.items():
        for s in range(300):  # warm up allocator caches and lazy initialisation
            call(s)
        gc.collect()
        rss, heap = _rss_bytes(), _heap_bytes()
        for s in range(repeats):
            call(s)
        gc.collect()
        report[name] = (_rss_bytes() - rss, _heap_bytes() - heap)
    return report


RSS_LIMIT = 4 * 2**20   # 420 bytes per call over 10,000 calls
HEAP_LIMIT = 1 * 2**20  # 105 bytes per call


@pytest.fixture(scope="module")
def memory_report():
    if not os.path.exists("/proc/self/statm") or REPEATS < 1000:
        pytest.skip("needs /proc and FSD_MEMORY_REPEATS >= 1000")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = "import json, tests.test_threads_memory as m; print(json.dumps(m.measure_growth()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CALLS) + ["raising"])
def test_repeated_calls_do_not_grow_memory(name, memory_report):
    rss, heap = memory_report[name]
    assert rss < RSS_LIMIT, f"{name}: resident memory grew by {rss / 2**20:.2f} MiB over {REPEATS} calls"
    assert heap < HEAP_LIMIT, f"{name}: malloc'd memory grew by {heap / 2**20:.2f} MiB over {REPEATS} calls"


def test_memory_check_sees_a_leak(memory_report):
    """The harness itself: the negative control's 1 KiB per call must exceed the limits."""
    rss, heap = memory_report["leak_control"]
    assert heap > HEAP_LIMIT and heap > REPEATS * 1024, (rss, heap)
