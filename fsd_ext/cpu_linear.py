"""Faster float32 and bfloat16 `nn.Linear` on the CPU for the few-row inputs of decoding.

Speculative decoding on a CPU is bound by its small matrix products: the target's verification step
multiplies K+1 rows by every weight matrix, the draft's catch-up step 2 rows. torch's `F.linear`
goes through a BLAS GEMM path that, for 2..16 rows, costs 2-3x the one-row product although it
reads the same weights. `skinny_linear` calls the extension's `fsd_ext::skinny_linear` CPU kernel
(csrc/fsd/cpu/skinny_gemm.cpp), which streams each weight row from memory once for all rows of x;
without the compiled extension it computes (W @ x^T)^T, which lets the BLAS stream W in its stored
layout. Measured on this project's 2-core CPU (torch 2.13, MKL, float32, 2 threads, median of 10):

    gate_proj 8960x1536    1 row     4 rows    6 rows
    F.linear               2.62 ms   8.16 ms   8.62 ms
    (W @ x^T)^T            2.56 ms   3.39 ms   4.41 ms
    fsd_ext::skinny_linear 1.87 ms   2.45 ms   2.84 ms

bfloat16 weights and activations (float32 sums, rounded once; the kernel widens each weight block
in cache, so it reads half the bytes but does the float32 work; median of 15, 2026-11-30):

    gate_proj 8960x1536    1 row     2 rows    3 rows    4 rows    6 rows
    F.linear (bfloat16)    1.60 ms   2.96 ms   4.55 ms   5.77 ms   8.48 ms
    fsd_ext::skinny_linear 1.90 ms   2.43 ms   2.78 ms   2.87 ms   3.71 ms

so there one bfloat16 row stays with F.linear.

Those are an AMD EPYC's numbers, where torch's BLAS, MKL, takes slow paths for few-row products.
On an Intel CPU MKL takes its fast ones, and there the kernel loses (Intel Xeon with AVX-512, torch
2.13, float32, 2 threads, median of 11, 2026-12-02; F.linear / skinny_linear time):

    shape               1 row    2 rows   6 rows
    1536x1536           1.00x    0.76x    0.85x
    8960x1536           0.96x    0.86x    0.97x
    4864x896            0.94x    0.78x    0.76x
    151936x896          0.79x    0.75x    1.00x

and whole forwards of the Qwen2.5-Coder pair (float32, median of 7, alternating) took, F.linear
against the kernel: target 1 token 276 / 349 ms, 6 tokens 571 / 549 ms; draft 1 token 106 / 115
ms, 2 tokens 115 / 125 ms: 21% faster autoregressive decoding and one SD step (K = 5) about even.
So `skinny_pays_off()` says whether to use it: not where torch's BLAS is MKL on an Intel CPU.

A CPU with AVX512-BF16 (Intel Cooper Lake and later, AMD Zen 4 and later) multiplies bfloat16
weights and activations with its dot-product instruction instead of widening them
(`bf16_dot_available()`), straight from the stored weights, and there the kernel beats F.linear's
bfloat16 and float32 paths at every row count (the same Intel Xeon, torch 2.13 with MKL, 2
threads, median of 9 interleaved, 2026-12-02):

    shape          path                 1 row     2 rows    3 rows    4 rows    6 rows
    8960x1536      F.linear float32     2.51 ms   2.07 ms   2.62 ms   3.72 ms   3.90 ms
                   F.linear bfloat16    1.35 ms   1.73 ms   1.80 ms   2.39 ms   2.98 ms
                   kernel bfloat16      0.71 ms   0.89 ms   1.04 ms   1.30 ms   2.03 ms
    151936x1536    F.linear float32     39.9 ms   40.6 ms   38.0 ms   84.3 ms   95.7 ms
                   F.linear bfloat16    34.9 ms   36.3 ms   36.0 ms   42.3 ms   49.7 ms
                   kernel bfloat16      22.1 ms   23.0 ms   20.8 ms   26.7 ms   40.1 ms

so `skinny_pays_off(torch.bfloat16)` is true there whatever the vendor. Later the same day the
kernel's next-block prefetches were shared over its passes over x and its reductions vectorised:
6 rows now cost about 1.1-1.2x one row (151936x1536: ~22 / ~25 ms), F.linear over the kernel at 6
rows 1.26-1.61x -> 1.57-2.29x over the pair's shapes (`benchmarks/bench_cpu_linear.py`, results in
benchmarks/results/cpu-linear-intel-2026-12-02).

Same products, another summation order: results differ from F.linear by float rounding only
(tests/test_cpu_linear.py). fsd_ext.generate switches it on for its own forwards on the CPU where
it pays off (`skinny_cpu_linears="auto"`) and restores the models' modules when it returns;
`use_skinny_cpu_linears(model)` switches it on for good (e.g. for other decoding loops).
"""

from __future__ import annotations

import contextlib
import functools
import platform

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # the kernel's limit (kSkinnyMaxRows); prefill-sized inputs keep F.linear's GEMM
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_ORIGINAL = "_fsd_original_forward"


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in]. For 1..MAX_ROWS float32 or 2..MAX_ROWS bfloat16 CPU
    rows (1..MAX_ROWS with bf16_dot_available()), and no autograd: the fsd_ext kernel, else for
    float32 (W @ x^T)^T; anything else goes to F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (not 0 < rows <= MAX_ROWS or x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES
            or weight.dtype != x.dtype or needs_grad):
        return F.linear(x, weight, bias)
    native = _native_op()
    # torch's bfloat16 GEMV is faster there, unless the kernel has the CPU's bfloat16 dot product
    one_bf16_row = rows == 1 and x.dtype == torch.bfloat16 and not bf16_dot_available()
    if native is not None and not one_bf16_row and weight.stride(-1) == 1 and (
            bias is None or bias.dtype == x.dtype):
        return native(x, weight, bias)
    if x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    # The BLAS is fast here only with a contiguous x (x^T is then a transposed operand, not a copy).
    x_rows = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
    out = (weight @ x_rows.t()).t().contiguous()  # [rows, out]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def _native_op():
    """torch.ops.fsd_ext.skinny_linear, or None when the extension is not built (looked up once:
    this runs for every linear of every decoding forward)."""
    from . import ops
    return torch.ops.fsd_ext.skinny_linear if ops._IMPORT_ERROR is None else None


@functools.lru_cache(maxsize=None)
def bf16_dot_available() -> bool:
    """Whether the kernel multiplies bfloat16 weights and activations with the CPU's AVX512-BF16
    dot-product instruction (False without the compiled extension)."""
    return _native_op() is not None and bool(torch.ops.fsd_ext.skinny_linear_bf16_dot())


def cpu_vendor() -> str:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD", ...; "" when unknown)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "GenuineIntel" if "GenuineIntel" in platform.processor() else ""


@functools.lru_cache(maxsize=None)
def skinny_pays_off(dtype: torch.dtype = torch.float32) -> bool:
    """Whether skinny_linear beats F.linear for decoding's few-row products of `dtype` here, by a
    fixed rule (a timed choice could differ between two runs, and with it the float rounding of
    their tokens): bfloat16 with bf16_dot_available() always does; otherwise F.linear wins where
    torch's BLAS is MKL on an Intel CPU (the numbers above), the kernel wins on the AMD CPU it was
    measured on, and is kept elsewhere."""
    if dtype == torch.bfloat16 and bf16_dot_available():
        return True
    return not (torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel")


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, self.weight, self.bias)


def use_skinny_cpu_linears(model: torch.nn.Module, enable: bool = True) -> int:
    """Route every nn.Linear of `model` through skinny_linear (enable=False restores them).
    Returns the number of modules changed. Idempotent; other devices and dtypes are unaffected."""
    changed = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        patched = _ORIGINAL in module.__dict__
        if enable and not patched:
            module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
            module.forward = _forward.__get__(module)
            changed += 1
        elif not enable and patched:
            original = module.__dict__.pop(_ORIGINAL)
            if original is None:
                del module.forward
            else:
                module.forward = original
            changed += 1
    return changed


@contextlib.contextmanager
def skinny_cpu_linears(*models, enabled: bool = True):
    """use_skinny_cpu_linears on `models` (None entries skipped) for the duration of the block; the
    modules it changed are restored afterwards (ones already patched are left as they were)."""
    changed = []
    try:
        for model in models:
            if enabled and model is not None and use_skinny_cpu_linears(model):
                changed.append(model)
        yield
    finally:
        for model in changed:
            use_skinny_cpu_linears(model, enable=False)
