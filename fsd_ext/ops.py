"""Front end of the compiled ops: argument checks and normalisation, then one torch custom op call.

The ops themselves (schemas, CPU and CUDA kernels) are registered by the compiled extension
`fsd_ext._C` under the `fsd_ext` namespace; their fake kernels are registered here, so a function
that calls them compiles with `torch.compile(fullgraph=True)`. Everything that can be checked from
shapes and dtypes is checked here with a clear message; what needs the tensor values (token ids in
range, NaN logits) is checked inside the kernels.
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

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TOKEN_DTYPES = (torch.int32, torch.int64)
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

    @torch.library.register_fake("fsd_ext::accept")
    def _accept_fake(target_logits, draft_logits, draft_tokens, *args):
        batch, k_plus_1 = target_logits.shape[:2]
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

def _check_logits(name: str, logits, ndim: int):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a vocabulary of at least 1, got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1 and logits.numel() > 0:
        # (a size-1 or empty vocab dim may have any stride: torch calls such tensors contiguous)
        raise ValueError(f"{name} must be contiguous along the vocabulary (last) dim")


def _check_device(name: str, tensor: Optional[torch.Tensor], device: torch.device):
    if tensor is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like the logits")


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _row_arg(name: str, value, batch: int, device, *, allow_zero: bool = True, finite: bool = False):
    """A float, or a [B] tensor, -> (tensor or None, scalar) for the op. `finite`: the value must
    also be a finite float32 (temperatures: an infinite one makes softmax of -inf logits NaN)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name} must be a float or a [{batch}] tensor, got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} tensor must be floating point, got {value.dtype}")
        _check_device(name, value, device)
        return value.to(torch.float32).contiguous(), 0.0
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a [B] tensor, got {type(value).__name__}")
    value = float(value)
    if not value >= 0.0 or (value == 0.0 and not allow_zero):  # `not >=` also rejects NaN
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    if finite and not value <= _FLOAT32_MAX:
        raise ValueError(f"{name} must be finite (at most {_FLOAT32_MAX:.4g}, float32), got {value}")
    return None, value


def _seed_arg(seed: SeedArg, generator: Optional[torch.Generator], batch: int, device):
    """-> (seed tensor or None, scalar seed, per_row) for the op. An int64 tensor [B] holds per-row
    seeds; a [] tensor (may live on the device, for graph capture) is one seed for the call. Without
    a seed one is drawn from `generator` (or torch's default one), so torch.manual_seed makes calls
    reproducible."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.dim() > 1 or (seed.dim() == 1 and seed.shape[0] != batch):
            raise ValueError(f"seed tensor must be int64 of shape [{batch}] (per row) or [] "
                             f"(one for the call), got {seed.dtype} {tuple(seed.shape)}")
        _check_device("seed", seed, device)
        return seed.reshape(-1).contiguous(), 0, seed.dim() == 1
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int or an int64 tensor, got {type(seed).__name__}")
    return None, wrap_int64(int(seed)), False


def wrap_int64(value: int) -> int:
    """Python ints of any size map onto the 64 seed bits the kernels use."""
    return (value + 2**63) % 2**64 - 2**63


def _offset_arg(offset, device):
    if isinstance(offset, torch.Tensor):
        if offset.dtype != torch.int64 or offset.numel() != 1:
            raise ValueError(f"offset tensor must be a one-element int64 tensor, got {offset.dtype} "
                             f"{tuple(offset.shape)}")
        _check_device("offset", offset, device)
        return offset.reshape(1), 0
    if not isinstance(offset, numbers.Integral) or not 0 <= offset < 2**63:
        raise ValueError(f"offset must be an int in [0, 2^63) or an int64 tensor, got {offset!r}")
    return None, int(offset)


def _filter_args(top_k, top_p, min_p):
    if top_k is not None and (not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, numbers.Real) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, numbers.Real) and 0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be None or a float in [0, 1], got {min_p!r}")
    return (int(top_k or 0), float(1.0 if top_p is None else top_p), float(min_p or 0.0))


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
        rule: "greedy" | "sd" | "fsd" (default) | "fsd_strict".
        divergence: "kl" | "rkl" | "js" (default) | "tv" | "mkl", used by fsd / fsd_strict.
        threshold: T >= 0, a float or a [B] float tensor.
        temperature: sampling temperature >= 0 (0 = greedy), a float or a [B] tensor.
        div_temperature: temperature > 0 of the distributions the divergence compares (float or
            [B]); None compares the sampling distributions themselves.
        top_k, top_p, min_p: optional filters, applied to target and draft alike.
        div_top_k: compute the divergence on the top-k ids of p plus one bucket for the rest.
        num_draft: [B] int tensor of per-row K (ragged), each in [0, K].
        seed: int, or int64 tensor [B] of per-row seeds (batch invariant), or [] (device tensor:
            graph-capturable). None draws one from `generator` / torch's default generator.
        offset: int or one-element int64 tensor added to the Philox counter (e.g. the decoding step).
        return_divergence: also return D_i as [B, K] float32.

    Returns:
        AcceptResult(tokens [B, K+1] int64, num_accepted [B] int64, valid [B] bool,
        divergence [B, K] float32 or None). valid is False for rows with NaN logits or no finite
        logit; on CUDA, where checking device values would need a host sync, also for rows with
        draft ids or num_draft out of range or per-row threshold / temperature values out of range
        (the CPU raises for those).

    Example:
        >>> res = fsd_ext.accept(target_logits, draft_logits, draft_tokens, rule="fsd",
        ...                      divergence="js", threshold=0.3, seed=0)
        >>> res.tokens[0, : res.num_accepted[0] + 1]  # the tokens row 0 appends
    """
    _check_logits("target_logits", target_logits, 3)
    _check_logits("draft_logits", draft_logits, 3)
    batch, k_plus_1, target_vocab = target_logits.shape
    device = target_logits.device
    k = k_plus_1 - 1
    if draft_logits.shape[0] != batch or draft_logits.shape[1] != k:
        raise ValueError(f"draft_logits must be [B={batch}, K={k}, V_d], got {tuple(draft_logits.shape)}"
                         f" (target_logits holds K+1 positions)")
    if draft_logits.shape[2] > target_vocab:
        raise ValueError(f"draft_logits vocabulary V_d={draft_logits.shape[2]} must be <= target vocabulary "
                         f"V_t={target_vocab}")
    if draft_logits.dtype != target_logits.dtype:
        raise TypeError(f"draft_logits dtype {draft_logits.dtype} must match target_logits dtype "
                        f"{target_logits.dtype}")
    _check_device("draft_logits", draft_logits, device)
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype not in _TOKEN_DTYPES:
        raise TypeError("draft_tokens must be an int32 or int64 tensor")
    if tuple(draft_tokens.shape) != (batch, k):
        raise ValueError(f"draft_tokens must be [B={batch}, K={k}], got {tuple(draft_tokens.shape)}")
    _check_device("draft_tokens", draft_tokens, device)
    if num_draft is not None:
        if not isinstance(num_draft, torch.Tensor) or num_draft.dtype not in _TOKEN_DTYPES:
            raise TypeError("num_draft must be None or an int32/int64 tensor [B]")
        if tuple(num_draft.shape) != (batch,):
            raise ValueError(f"num_draft must be [B={batch}], got {tuple(num_draft.shape)}")
        _check_device("num_draft", num_draft, device)
        num_draft = num_draft.to(torch.int64).contiguous()
    rule_id = _name_index("rule", rule, RULES)
    div_id = _name_index("divergence", divergence, DIVERGENCES)
    threshold_t, threshold_s = _row_arg("threshold", threshold, batch, device)
    temperature_t, temperature_s = _row_arg("temperature", temperature, batch, device, finite=True)
    div_uses_sampling = div_temperature is None
    div_temp_t, div_temp_s = (None, 1.0) if div_uses_sampling else _row_arg(
        "div_temperature", div_temperature, batch, device, allow_zero=False, finite=True)
    top_k_i, top_p_f, min_p_f = _filter_args(top_k, top_p, min_p)
    if div_top_k is not None and (not isinstance(div_top_k, numbers.Integral) or div_top_k < 1):
        raise ValueError(f"div_top_k must be None or an int >= 1, got {div_top_k!r}")
    seed_t, seed_s, seed_per_row = _seed_arg(seed, generator, batch, device)
    offset_t, offset_s = _offset_arg(offset, device)
    tokens, num_accepted, valid, div = _ops().accept(
        target_logits, draft_logits, draft_tokens.contiguous(), num_draft,
        threshold_t, threshold_s, temperature_t, temperature_s, div_temp_t, div_temp_s,
        div_uses_sampling, seed_t, seed_s, seed_per_row, offset_t, offset_s, rule_id, div_id,
        top_k_i, top_p_f, min_p_f, int(div_top_k or 0), bool(return_divergence))
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
        if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
            raise ValueError(f"{name} must be a tensor [..., V]")
        _check_logits(name, logits, logits.dim())
    if target_logits.shape[:-1] != draft_logits.shape[:-1]:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} and draft_logits "
                         f"{tuple(draft_logits.shape)} must agree on all but the last dim")
    if draft_logits.shape[-1] > target_logits.shape[-1]:
        raise ValueError("draft_logits vocabulary must be <= the target_logits vocabulary")
    if draft_logits.dtype != target_logits.dtype:
        raise TypeError("draft_logits and target_logits must have the same dtype")
    _check_device("draft_logits", draft_logits, target_logits.device)
    kind_id = _name_index("kind", kind, DIVERGENCES)
    if not isinstance(temperature, numbers.Real) or not 0 < temperature <= _FLOAT32_MAX:
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    lead = target_logits.shape[:-1]
    out = _ops().divergence(target_logits.reshape(-1, target_logits.shape[-1]),
                            draft_logits.reshape(-1, draft_logits.shape[-1]), kind_id,
                            float(temperature), int(top_k or 0))
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
    if not isinstance(logits, torch.Tensor) or not 1 <= logits.dim() <= 3:
        raise ValueError("logits must be a tensor [V], [B, V] or [B, S, V]")
    _check_logits("logits", logits, logits.dim())
    shape = logits.shape[:-1]
    # [B, S, V] views (a reshape with -1 cannot size a batch of 0 rows)
    logits3 = logits[None, None] if logits.dim() == 1 else logits[:, None] if logits.dim() == 2 else logits
    batch = logits3.shape[0]
    device = logits.device
    temperature_t, temperature_s = _row_arg("temperature", temperature, batch, device, finite=True)
    top_k_i, top_p_f, min_p_f = _filter_args(top_k, top_p, min_p)
    seed_t, seed_s, seed_per_row = _seed_arg(seed, generator, batch, device)
    offset_t, offset_s = _offset_arg(offset, device)
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
    if rows < 0 or positions < 0:
        raise ValueError(f"rows and positions must be >= 0, got {rows}, {positions}")
    device = torch.device(device or (seed.device if isinstance(seed, torch.Tensor) else "cpu"))
    seed_t, seed_s, seed_per_row = _seed_arg(seed, None, rows, device)
    offset_t, offset_s = _offset_arg(offset, device)
    if seed_t is None:
        seed_t = torch.tensor([seed_s], dtype=torch.int64, device=device)
    if offset_t is None:
        offset_t = torch.tensor([offset_s], dtype=torch.int64, device=device)
    return _ops().philox_uniforms(seed_t, offset_t, seed_per_row, rows, positions, purposes[purpose])
