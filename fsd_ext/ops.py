"""Front end of the compiled ops: argument checks and normalisation, then one torch custom op call.

The ops themselves (schemas, CPU and CUDA kernels) are registered by the compiled extension
`fsd_ext._C` under the `fsd_ext` namespace; their fake kernels are registered here, so a function
that calls them compiles with `torch.compile(fullgraph=True)`. The ops check their arguments'
shapes, dtypes, devices and values themselves, with messages that name the argument
(csrc/torch/problem.h: the one place); this front end keeps only what the ops cannot see: Python
types, None for "off", names for the rule / divergence / purpose ids, and the reshapes of
[V] / [B, V] / [..., V] arguments.
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

from .types import DIVERGENCES, PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_SAMPLE, RULES, AcceptResult

try:
    from . import _C  # noqa: F401  (registers torch.ops.fsd_ext.*)
    _IMPORT_ERROR = None
except ImportError as error:  # pragma: no cover - only without a build
    _IMPORT_ERROR = error

RowArg = Union[float, torch.Tensor]
SeedArg = Union[int, torch.Tensor, None]


def _ops():
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "fsd_ext's compiled extension is not built; reinstall with "
            "`pip install --no-build-isolation .` (see README). fsd_ext.reference works without it."
        ) from _IMPORT_ERROR
    return torch.ops.fsd_ext


# ----------------------------------------------------------------------------------------------
# Fake (meta) kernels: output shapes for torch.compile and FakeTensor tracing.

if _IMPORT_ERROR is None:

    def _fake_check(ok: bool, message: str, error=ValueError):
        if not ok:
            raise error(message)

    @torch.library.register_fake("fsd_ext::accept")
    def _accept_fake(target_logits, draft_logits, draft_tokens, *args):
        # The shape and dtype checks of csrc/torch/problem.h (make_accept_problem), so that tracing
        # refuses what the kernels refuse, with the same error types.
        floats = (torch.float32, torch.bfloat16, torch.float16)
        for name, logits in (("target_logits", target_logits), ("draft_logits", draft_logits)):
            _fake_check(logits.dim() == 3, f"{name} must have 3 dims, got shape {tuple(logits.shape)}")
            _fake_check(logits.dtype in floats, f"{name} must be float32, bfloat16 or float16, got "
                        f"{logits.dtype}", TypeError)
            _fake_check(logits.shape[-1] >= 1, f"{name} must have a vocabulary of at least 1")
        batch, k_plus_1 = target_logits.shape[:2]
        _fake_check(k_plus_1 >= 1, "target_logits must hold K+1 >= 1 positions")
        _fake_check(tuple(draft_logits.shape[:2]) == (batch, k_plus_1 - 1),
                    f"draft_logits must be [B={batch}, K={k_plus_1 - 1}, V_d], got shape "
                    f"{tuple(draft_logits.shape)}")
        _fake_check(draft_logits.shape[2] <= target_logits.shape[2],
                    "draft_logits vocabulary must be <= the target's")
        _fake_check(draft_logits.dtype == target_logits.dtype,
                    "draft_logits dtype must match target_logits dtype", TypeError)
        _fake_check(draft_tokens.dtype in (torch.int32, torch.int64),
                    f"draft_tokens must be int32 or int64, got {draft_tokens.dtype}", TypeError)
        _fake_check(tuple(draft_tokens.shape) == (batch, k_plus_1 - 1),
                    f"draft_tokens must be [B={batch}, K={k_plus_1 - 1}], got shape "
                    f"{tuple(draft_tokens.shape)}")
        return (target_logits.new_empty((batch, k_plus_1), dtype=torch.int64),
                target_logits.new_empty((batch,), dtype=torch.int64),
                target_logits.new_empty((batch,), dtype=torch.bool),
                target_logits.new_empty((batch, k_plus_1 - 1), dtype=torch.float32))

    @torch.library.register_fake("fsd_ext::divergence")
    def _divergence_fake(target_logits, draft_logits, kind, temperature, top_k):
        return target_logits.new_empty(target_logits.shape[:1], dtype=torch.float32)

    @torch.library.register_fake("fsd_ext::sample")
    def _sample_fake(logits, *args):
        return logits.new_empty(logits.shape[:2], dtype=torch.int64)

    @torch.library.register_fake("fsd_ext::philox_uniforms")
    def _uniforms_fake(seed, offset, seed_per_row, rows, positions, purpose):
        return seed.new_empty((rows, positions), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# Argument normalisation.

def _check_tensor(name: str, value):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_devices(device: torch.device, **tensors):
    """Every tensor argument on the logits' device. The op cannot check this: the dispatcher picks
    its kernel from the arguments' devices (a meta tensor among CPU ones runs the fake kernel)."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device} like the logits")


def _row_arg(name: str, value):
    """A float, or a [B] tensor, -> (tensor or None, scalar) for the op (which checks the range and
    the shape); a floating tensor goes as float32."""
    if isinstance(value, torch.Tensor):
        return (value.to(torch.float32).contiguous() if value.is_floating_point() else value), 0.0
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a [B] tensor, got {type(value).__name__}")
    return None, float(value)


def _seed_arg(seed: SeedArg, generator: Optional[torch.Generator]):
    """-> (seed tensor or None, scalar seed, per_row) for the op. An int64 tensor [B] holds per-row
    seeds; a [] tensor (may live on the device, for graph capture) is one seed for the call. Without
    a seed one is drawn from `generator` (or torch's default one), so torch.manual_seed makes calls
    reproducible."""
    if isinstance(seed, torch.Tensor):
        return (seed.reshape(1) if seed.dim() == 0 else seed).contiguous(), 0, seed.dim() == 1
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int or an int64 tensor, got {type(seed).__name__}")
    return None, wrap_int64(int(seed)), False


def wrap_int64(value: int) -> int:
    """Python ints of any size map onto the 64 seed bits the kernels use."""
    return (value + 2**63) % 2**64 - 2**63


def _is_int(value) -> bool:
    """An int, not a bool (True is no count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _offset_arg(offset):
    if isinstance(offset, torch.Tensor):  # (the CPU op checks its value >= 0)
        return (offset.reshape(1) if offset.numel() == 1 else offset), 0
    # (an int past int64 cannot reach the op; the op checks >= 0)
    if not _is_int(offset) or not -2**63 <= offset < 2**63:
        raise ValueError(f"offset must be an int in [0, 2^63) or an int64 tensor, got {offset!r}")
    return None, int(offset)


def _top_k_arg(name: str, value) -> int:
    """None (off) -> 0 for the op; an int must be in [1, 2^63) (the op reads 0 as off; any k >= V is
    off too)."""
    if value is not None and (not _is_int(value) or not 1 <= value < 2**63):
        raise ValueError(f"{name} must be None or an int in [1, 2^63), got {value!r}")
    return int(value or 0)


def _float_arg(name: str, value, off: float) -> float:
    """None -> `off` for the op, which checks the range."""
    if value is None:
        return off
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be None or a float, got {value!r}")
    return float(value)


def _filter_args(top_k, top_p, min_p):
    return _top_k_arg("top_k", top_k), _float_arg("top_p", top_p, 1.0), _float_arg("min_p", min_p, 0.0)


def _name_index(name: str, value, choices) -> int:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return choices.index(value)


# ----------------------------------------------------------------------------------------------
# Public ops.

def accept(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor, *,
           rule: str = "fsd", divergence: str = "js", threshold: RowArg = 0.0,
           temperature: RowArg = 1.0, div_temperature: Optional[RowArg] = 1.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None,
           min_p: Optional[float] = None, div_top_k: Optional[int] = None,
           num_draft: Optional[torch.Tensor] = None, seed: SeedArg = None,
           offset: Union[int, torch.Tensor] = 0, generator: Optional[torch.Generator] = None,
           return_divergence: bool = False) -> AcceptResult:
    """Verify K drafted tokens per row against the target in one fused kernel (docs/design.md 2).

    Args:
        target_logits: [B, K+1, V_t] float32 | bfloat16 | float16, target logits at the K drafted
            positions and the bonus position.
        draft_logits: [B, K, V_d] same dtype and device, V_d <= V_t (ids >= V_d get probability 0).
        draft_tokens: [B, K] int32 | int64, the drafted ids (entries past num_draft are ignored).
        rule: "greedy" | "sd" | "fsd" (default) | "fsd_strict", or another lenient rule of
            fsd_ext.LENIENT_RULES (docs/design.md 2.5: each tests a statistic of its own < T).
        divergence: "kl" | "rkl" | "js" (default) | "tv" | "mkl", used by fsd / fsd_strict (and
            returned by sd / greedy with return_divergence).
        threshold: T >= 0 (the lenient rule's knob), a float or a [B] float tensor. NaN or a negative value raises
            ValueError in either form (on CUDA a tensor's values are not read on the host: such
            a row comes back invalid, see Returns).
        temperature: sampling temperature >= 0 (0 = greedy), a float or a [B] tensor.
        div_temperature: temperature > 0 of the distributions the divergence compares (float or
            [B]); None compares the sampling distributions themselves.
        top_k, top_p, min_p: optional filters, applied to target and draft alike.
        div_top_k: compute the divergence on the top-k ids of p plus one bucket for the rest
            (fsd, fsd_strict, sd, greedy only).
        num_draft: [B] int tensor of per-row K (ragged), each in [0, K].
        seed: int, or int64 tensor [B] of per-row seeds (batch invariant), or [] (device tensor:
            graph-capturable). None draws one from `generator` / torch's default generator.
        offset: int >= 0 or one-element int64 tensor added to the Philox counter (e.g. the
            decoding step); the CPU checks a tensor's value, CUDA reads it on the device unchecked.
        return_divergence: also return D_i (the other lenient rules: their statistic s_i) as
            [B, K] float32.

    Returns:
        AcceptResult(tokens [B, K+1] int64, num_accepted [B] int64, valid [B] bool,
        divergence [B, K] float32 or None). valid is False for rows with NaN logits or no finite
        logit; on CUDA, where checking device values would need a host sync, also for rows with
        draft ids or num_draft out of range or per-row threshold / temperature values out of range
        (the CPU raises ValueError for those, as for the float forms).

    Example:
        >>> res = fsd_ext.accept(target_logits, draft_logits, draft_tokens, rule="fsd",
        ...                      divergence="js", threshold=0.3, seed=0)
        >>> res.tokens[0, : res.num_accepted[0] + 1]  # the tokens row 0 appends
    """
    for name, value in (("target_logits", target_logits), ("draft_logits", draft_logits),
                        ("draft_tokens", draft_tokens)):
        _check_tensor(name, value)
    if num_draft is not None:
        _check_tensor("num_draft", num_draft)
        if num_draft.dtype == torch.int32:
            num_draft = num_draft.to(torch.int64)
    rule_id = _name_index("rule", rule, RULES)
    div_id = _name_index("divergence", divergence, DIVERGENCES)
    threshold_t, threshold_s = _row_arg("threshold", threshold)
    temperature_t, temperature_s = _row_arg("temperature", temperature)
    div_uses_sampling = div_temperature is None
    div_temp_t, div_temp_s = (None, 1.0) if div_uses_sampling else _row_arg("div_temperature", div_temperature)
    top_k_i, top_p_f, min_p_f = _filter_args(top_k, top_p, min_p)
    div_top_k_i = _top_k_arg("div_top_k", div_top_k)
    seed_t, seed_s, seed_per_row = _seed_arg(seed, generator)
    offset_t, offset_s = _offset_arg(offset)
    _check_devices(target_logits.device, draft_logits=draft_logits, draft_tokens=draft_tokens,
                   num_draft=num_draft, threshold=threshold_t, temperature=temperature_t,
                   div_temperature=div_temp_t, seed=seed_t, offset=offset_t)
    tokens, num_accepted, valid, div = _ops().accept(
        target_logits, draft_logits, draft_tokens.contiguous(), num_draft,
        threshold_t, threshold_s, temperature_t, temperature_s, div_temp_t, div_temp_s,
        div_uses_sampling, seed_t, seed_s, seed_per_row, offset_t, offset_s, rule_id, div_id,
        top_k_i, top_p_f, min_p_f, div_top_k_i, bool(return_divergence))
    return AcceptResult(tokens, num_accepted, valid, div if return_divergence else None)


def divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor, kind: str = "js",
               temperature: float = 1.0, top_k: Optional[int] = None) -> torch.Tensor:
    """D(softmax(target/T) || softmax(draft/T)) over the last dim: logits [..., V] -> [...] float32.

    The leading dims of both must match; the draft vocabulary may be smaller (V_d <= V_t).
    kind: "kl" | "rkl" | "js" | "tv" | "mkl". top_k: bucket all but the top-k ids of p into one.
    NaN where a row holds NaN or no finite logit.

    Example:
        >>> fsd_ext.divergence(torch.randn(4, 32000), torch.randn(4, 32000), kind="kl")  # [4]
    """
    for name, logits in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        _check_tensor(name, logits)
        if logits.dim() < 1:
            raise ValueError(f"{name} must be a tensor [..., V], got shape {tuple(logits.shape)}")
    # The op sees rows [N, V]: the leading dims it cannot compare.
    if target_logits.shape[:-1] != draft_logits.shape[:-1]:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} and draft_logits "
                         f"{tuple(draft_logits.shape)} must agree on all but the last dim")
    _check_devices(target_logits.device, draft_logits=draft_logits)
    kind_id = _name_index("kind", kind, DIVERGENCES)
    if not isinstance(temperature, numbers.Real):  # (the op checks the range)
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
    lead = target_logits.shape[:-1]
    out = _ops().divergence(target_logits.reshape(-1, target_logits.shape[-1]),
                            draft_logits.reshape(-1, draft_logits.shape[-1]), kind_id,
                            float(temperature), _top_k_arg("top_k", top_k))
    return out.reshape(lead)


def sample(logits: torch.Tensor, temperature: RowArg = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, min_p: Optional[float] = None, seed: SeedArg = None,
           offset: Union[int, torch.Tensor] = 0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row from softmax(filter(logits) / temperature), by inverse CDF on the Philox
    'draft' stream: [V] -> [], [B, V] -> [B], [B, S, V] -> [B, S] int64; -1 for rows holding NaN
    or no finite logit (on CUDA also for a [B] temperature value out of range, which the CPU
    raises for). temperature 0 = argmax (lowest id on ties); float or [B] tensor.

    Example:
        >>> fsd_ext.sample(torch.randn(2, 32000), temperature=0.7, top_p=0.9, seed=0)  # [2]
    """
    _check_tensor("logits", logits)
    if not 1 <= logits.dim() <= 3:
        raise ValueError(f"logits must be a tensor [V], [B, V] or [B, S, V], got shape {tuple(logits.shape)}")
    shape = logits.shape[:-1]
    # [B, S, V] views (a reshape with -1 cannot size a batch of 0 rows)
    logits3 = logits[None, None] if logits.dim() == 1 else logits[:, None] if logits.dim() == 2 else logits
    temperature_t, temperature_s = _row_arg("temperature", temperature)
    top_k_i, top_p_f, min_p_f = _filter_args(top_k, top_p, min_p)
    seed_t, seed_s, seed_per_row = _seed_arg(seed, generator)
    offset_t, offset_s = _offset_arg(offset)
    _check_devices(logits.device, temperature=temperature_t, seed=seed_t, offset=offset_t)
    tokens = _ops().sample(logits3, temperature_t, temperature_s, top_k_i, top_p_f, min_p_f,
                           seed_t, seed_s, seed_per_row, offset_t, offset_s)
    return tokens.reshape(shape)


def philox_uniforms(seed: Union[int, torch.Tensor], offset: int, rows: int, positions: int,
                    purpose: str = "accept", device=None) -> torch.Tensor:
    """The uniforms in [0, 1) the kernels draw for (row, position) on one stream: float64
    [rows, positions]. purpose: "accept" (the sd/fsd coins), "sample" (correction/bonus tokens) or
    "draft" (fsd_ext.sample). Feed them to fsd_ext.reference.accept(coin_uniforms=...,
    sample_uniforms=...) to replay a kernel call exactly."""
    purposes = {"accept": PURPOSE_ACCEPT, "sample": PURPOSE_SAMPLE, "draft": PURPOSE_DRAFT}
    if purpose not in purposes:
        raise ValueError(f"purpose must be one of {tuple(purposes)}, got {purpose!r}")
    for name, count in (("rows", rows), ("positions", positions)):
        if not _is_int(count):
            raise ValueError(f"{name} must be an int >= 0, got {count!r}")
    device = torch.device(device or (seed.device if isinstance(seed, torch.Tensor) else "cpu"))
    seed_t, seed_s, seed_per_row = _seed_arg(seed, None)
    offset_t, offset_s = _offset_arg(offset)
    _check_devices(device, seed=seed_t, offset=offset_t)
    if seed_t is None:
        seed_t = torch.tensor([seed_s], dtype=torch.int64, device=device)
    if offset_t is None:
        offset_t = torch.tensor([offset_s], dtype=torch.int64, device=device)
    return _ops().philox_uniforms(seed_t, offset_t, seed_per_row, rows, positions, purposes[purpose])
