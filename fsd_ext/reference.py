"""Pure-torch reference of fsd-ext: docs/design.md sections 2 and 3 as executable code.

This module is the spec every kernel is tested against: short, vectorised over the batch and the
draft positions, float64 by default. It is also a working fallback (`fsd_ext.reference.accept`)
wherever the compiled extension is unavailable, and it is what the kernel benchmark compares with.

One verification step, per batch row with K drafted tokens d_0..d_{K-1}:

    p_i = softmax(filter(z^t_i) / tau)      q_i = softmax(filter(z^d_i) / tau)   (one-hot if tau == 0)
    D_i = D(softmax(z^t_i / tau_div), softmax(z^d_i / tau_div))    (or D(p_i, q_i) if tau_div is None)

scan i = 0, 1, ... accepting d_i by the rule, stop at the first rejection and emit a correction
(argmax p_i, a residual sample of max(0, p_i - q_i), or a sample of p_i); if all K are accepted
emit a bonus token from p_K. The random numbers come from Philox4x32-10 keyed as in
csrc/fsd/philox.h, implemented here too so the reference needs no compiled code.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .types import (DIVERGENCES, PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_SAMPLE, RULE_TABLE, RULES,
                    AcceptResult)

RESIDUAL_MASS_EPS = 1e-6  # csrc/fsd/common.h: kResidualMassEps
FLOAT32_MAX = torch.finfo(torch.float32).max  # +inf logits count as the largest finite float
# csrc/fsd/rules.h: kZeroByConstructionBelow. A log-probability below it is 0 by construction
# (-inf), like a filtered token's: the limit a +inf logit stands for, whose row's other ids sit
# near -3.4e38, and the same in float and float64.
ZERO_BY_CONSTRUCTION_BELOW = -(2.0 ** 67) * math.log(2.0)  # about -1.02e20

RowArg = Union[float, torch.Tensor]

# ----------------------------------------------------------------------------------------------
# Philox4x32-10 in int64 tensor arithmetic (every intermediate stays below 2^49).
_MASK32 = 0xFFFFFFFF
_MUL0, _MUL1 = 0xD2511F53, 0xCD9E8D57
_WEYL0, _WEYL1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(constant: int, word: torch.Tensor):
    low_half, high_half = word & 0xFFFF, word >> 16
    p_low, p_high = constant * low_half, constant * high_half  # each < 2^48
    lo = (p_low + ((p_high & 0xFFFF) << 16)) & _MASK32
    hi = ((p_low >> 16) + p_high) >> 16
    return hi, lo


def _philox4x32_10(c0, c1, c2, c3, key0, key1):
    for _ in range(10):
        hi0, lo0 = _mulhilo(_MUL0, c0)
        hi1, lo1 = _mulhilo(_MUL1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0
        key0, key1 = (key0 + _WEYL0) & _MASK32, (key1 + _WEYL1) & _MASK32
    return c0, c1


def philox_uniforms(seed: Union[int, torch.Tensor], offset: Union[int, torch.Tensor], rows: int,
                    positions: int, purpose: int) -> torch.Tensor:
    """The uniforms in [0, 1) that the kernels draw: float64 [rows, positions].

    `seed` is an int (rows then get streams 0..rows-1) or an int64 tensor [rows] of per-row seeds.
    """
    per_row = isinstance(seed, torch.Tensor) and seed.dim() == 1
    seeds = (seed.to("cpu", torch.int64) if per_row
             else torch.full((rows,), int(seed), dtype=torch.int64))  # [rows]
    streams = (torch.zeros(rows, dtype=torch.int64) if per_row
               else torch.arange(rows, dtype=torch.int64))  # [rows]
    offset = int(offset)
    pos = torch.arange(positions, dtype=torch.int64)  # [positions]
    c0 = ((pos & 0xFFFFFF) | (purpose << 24))[None, :].expand(rows, positions)
    c1 = streams[:, None].expand(rows, positions)
    c2 = torch.full_like(c0, offset & _MASK32)
    c3 = torch.full_like(c0, (offset >> 32) & _MASK32)
    key0, key1 = (seeds & _MASK32)[:, None], ((seeds >> 32) & _MASK32)[:, None]
    x0, x1 = _philox4x32_10(c0, c1, c2, c3, key0, key1)
    bits53 = ((x0 >> 5) << 26) | (x1 >> 6)
    return bits53.to(torch.float64) * 2.0 ** -53


# ----------------------------------------------------------------------------------------------
# Distributions.

def _per_row(value: RowArg, rows: int, dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to("cpu", dtype).reshape(-1).expand(rows)
    return torch.full((rows,), float(value), dtype=dtype)


def _filter_scaled(scaled: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """top-k, then top-p on the renormalised result, then min-p; each a cutoff on `scaled` logits
    (ties at a cutoff are kept)."""
    vocab = scaled.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered = scaled.sort(dim=-1, descending=True).values
        cumulative = ordered.softmax(-1).cumsum(-1)
        last_kept = (cumulative < top_p).sum(-1, keepdim=True).clamp(max=vocab - 1)
        cutoff = ordered.gather(-1, last_kept)
        scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    if min_p is not None and min_p > 0.0:
        cutoff = scaled.amax(-1, keepdim=True) + torch.log(torch.tensor(float(min_p), dtype=scaled.dtype))
        scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    return scaled


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k=None, top_p=None,
                      min_p=None) -> torch.Tensor:
    """log p for logits [B, P, V] at per-row temperature [B]: filtered softmax, one-hot at the
    argmax (lowest id on ties) where the temperature is 0. -inf marks probability 0."""
    tau = temperature[:, None, None]  # [B, 1, 1]
    scaled = (logits - logits.amax(-1, keepdim=True)) / torch.where(tau > 0, tau, torch.ones_like(tau))
    logp = _filter_scaled(scaled, top_k, top_p, min_p).log_softmax(-1)
    one_hot = torch.full_like(logits, float("-inf")).scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    return torch.where(tau > 0, logp, one_hot)


def divergence_from_logprobs(logp: torch.Tensor, logq: torch.Tensor, kind: str) -> torch.Tensor:
    """D(p || q) over the last dim from exact log-probabilities (-inf, or below
    ZERO_BY_CONSTRUCTION_BELOW, = probability 0 by construction)."""
    logp = logp.masked_fill(logp < ZERO_BY_CONSTRUCTION_BELOW, float("-inf"))
    logq = logq.masked_fill(logq < ZERO_BY_CONSTRUCTION_BELOW, float("-inf"))
    p, q = logp.exp(), logq.exp()
    zero = torch.zeros((), dtype=p.dtype)

    def kl_terms(a, log_a, log_b):  # a log(a / b) with 0 log 0 = 0
        return torch.where(a > 0, a * (log_a - log_b), zero)

    if kind == "kl":
        terms = kl_terms(p, logp, logq)
    elif kind == "rkl":
        terms = kl_terms(q, logq, logp)
    elif kind == "tv":
        terms = 0.5 * (p - q).abs()
    else:
        m = 0.5 * (p + q)
        log_m = m.log()
        if kind == "js":
            terms = 0.5 * (kl_terms(p, logp, log_m) + kl_terms(q, logq, log_m))
        elif kind == "mkl":
            terms = 0.5 * (kl_terms(m, log_m, logp) + kl_terms(m, log_m, logq))
        else:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {kind!r}")
        # m underflows to 0 only where p and q are subnormal: those terms are 0, not inf.
        terms = torch.where(m > 0, terms, zero)
    return terms.sum(-1).clamp_min(0.0)


def _criterion_statistic(criterion: str, logp: torch.Tensor, logq: torch.Tensor, target_logits: torch.Tensor,
                         drafts: torch.Tensor, coin: torch.Tensor, p_draft: torch.Tensor,
                         q_draft: torch.Tensor) -> torch.Tensor:
    """s_i of a lenient rule other than fsd (docs/design.md 2.5; csrc/fsd/rules.h: rule_statistic), [B, K].
    logp, logq: log p~, log q~ [B, K, V] (the divergence's distributions); target_logits [B, K, V]
    clamped; drafts, coin, p_draft, q_draft [B, K] (the last three of the sampling distributions)."""
    log_p_token = logp.gather(-1, drafts[..., None])[..., 0]
    if criterion == "typical":  # 1 / max(p~(d), p~(d)^2 e^{2 H(p~)}), eps = 1 / T
        logp = logp.masked_fill(logp < ZERO_BY_CONSTRUCTION_BELOW, float("-inf"))
        entropy = torch.where(logp > -math.inf, -logp.exp() * logp, 0.0).sum(-1)
        return torch.exp(-torch.maximum(log_p_token, 2.0 * (log_p_token + entropy)))
    if criterion == "lenience":  # log(u q(d) / p(d)), l = e^{-T}
        return torch.where(p_draft > 0, torch.log(coin * q_draft) - torch.log(p_draft), math.inf)
    if criterion == "prob_floor":  # -log p~(d), t = e^{-T}
        return -log_p_token
    if criterion == "rank":  # target logits above d's, k = T
        pivot = target_logits.gather(-1, drafts[..., None])
        return (target_logits > pivot).sum(-1).to(logp.dtype)
    if criterion == "cascade":  # (max p~ - max q~) / TV + 1 in [0, 2], alpha = T - 1
        tv = divergence_from_logprobs(logp, logq, "tv")
        ratio = (logp.amax(-1).exp() - logq.amax(-1).exp()) / tv + 1.0
        return torch.where(tv > 0, ratio.clamp(0.0, 2.0), 0.0)
    raise ValueError(f"unknown criterion {criterion!r}")


def bucket_top_k(logp: torch.Tensor, logq: torch.Tensor, k: int):
    """div_top_k: k+1 buckets, the k most probable ids under p (lowest id on ties) and the rest."""
    if k >= logp.shape[-1]:
        return logp, logq
    top = logp.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    in_top = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, top, True)

    def buckets(logx):
        rest = logx.exp().masked_fill(in_top, 0.0).sum(-1, keepdim=True)
        return torch.cat([logx.gather(-1, top), rest.log()], dim=-1)

    return buckets(logp), buckets(logq)


def _pad_draft_vocab(draft: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """The draft can never propose ids >= V_d: give them logit -inf."""
    extra = target_vocab - draft.shape[-1]
    return torch.nn.functional.pad(draft, (0, extra), value=float("-inf")) if extra else draft


def _bad_vocab_rows(logits: torch.Tensor) -> torch.Tensor:
    """Vocabulary rows holding a NaN or no finite logit."""
    return logits.isnan().any(-1) | ~logits.isfinite().any(-1)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First id whose cumulative weight exceeds u * total; [N, V] weights (>= 0), [N] u -> [N]."""
    cumulative = weights.cumsum(-1)
    target = (uniforms * cumulative[:, -1])[:, None]
    ids = torch.searchsorted(cumulative, target, right=True)[:, 0]
    arange = torch.arange(weights.shape[-1])
    last_positive = torch.where(weights > 0, arange, -1).amax(-1)
    return torch.where(ids < weights.shape[-1], ids, last_positive)  # u * total rounded past the end


# ----------------------------------------------------------------------------------------------
# Public reference ops.

def divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor, kind: str = "js",
               temperature: float = 1.0, top_k: Optional[int] = None,
               compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """D(softmax(target / T) || softmax(draft / T)) over the last dim: [..., V] -> [...] float32."""
    vocab = target_logits.shape[-1]
    zt = target_logits.to(compute_dtype).clamp(max=FLOAT32_MAX)
    zd = _pad_draft_vocab(draft_logits.to(compute_dtype).clamp(max=FLOAT32_MAX), vocab)
    logp = ((zt - zt.amax(-1, keepdim=True)) / temperature).log_softmax(-1)
    logq = ((zd - zd.amax(-1, keepdim=True)) / temperature).log_softmax(-1)
    if top_k:
        logp, logq = bucket_top_k(logp, logq, top_k)
    out = divergence_from_logprobs(logp, logq, kind)
    bad = _bad_vocab_rows(target_logits) | _bad_vocab_rows(draft_logits)
    return out.masked_fill(bad, float("nan")).float()


def sample(logits: torch.Tensor, temperature: RowArg = 1.0, top_k=None, top_p=None, min_p=None,
           seed: Union[int, torch.Tensor] = 0, offset: int = 0,
           uniforms: Optional[torch.Tensor] = None,
           compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A token from softmax(filter(logits) / T) per row: [V] -> [], [B, V] -> [B], [B, S, V] -> [B, S].
    -1 where the row holds NaN or no finite logit."""
    shape = logits.shape[:-1]
    rows = 1 if logits.dim() == 1 else shape[0]
    positions = 1 if logits.dim() < 3 else shape[1]
    z = logits.reshape(rows, positions, logits.shape[-1])  # [B, S, V]
    rows, positions, vocab = z.shape
    if uniforms is None:
        uniforms = philox_uniforms(seed, offset, rows, positions, PURPOSE_DRAFT)  # [B, S]
    bad = _bad_vocab_rows(z)
    z = torch.where(bad[..., None], 0.0, z.to(compute_dtype).clamp(max=FLOAT32_MAX))
    logp = sampling_logprobs(z, _per_row(temperature, rows, compute_dtype), top_k, top_p, min_p)
    tokens = inverse_cdf(logp.exp().reshape(-1, vocab), uniforms.reshape(-1)).reshape(rows, positions)
    return tokens.masked_fill(bad, -1).reshape(shape)


def accept(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor, *,
           rule: str = "fsd", divergence: str = "js", threshold: RowArg = 0.0,
           temperature: RowArg = 1.0, div_temperature: Optional[RowArg] = 1.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None,
           min_p: Optional[float] = None, div_top_k: Optional[int] = None,
           num_draft: Optional[torch.Tensor] = None, seed: Union[int, torch.Tensor] = 0,
           offset: int = 0, coin_uniforms: Optional[torch.Tensor] = None,
           sample_uniforms: Optional[torch.Tensor] = None, return_divergence: bool = False,
           compute_dtype: torch.dtype = torch.float64) -> AcceptResult:
    """One verification step; the same contract as fsd_ext.accept (CPU tensors in and out).

    coin_uniforms [B, K] and sample_uniforms [B, K+1] override the Philox draws of `seed`/`offset`.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    arange_b = torch.arange(batch)
    num_draft = (torch.full((batch,), k, dtype=torch.int64) if num_draft is None
                 else num_draft.to("cpu", torch.int64))  # [B]
    pos = torch.arange(k_plus_1)
    used_t = pos[None, :] <= num_draft[:, None]  # [B, K+1]
    used_d = pos[None, :k] < num_draft[:, None]  # [B, K]

    valid = ~((_bad_vocab_rows(target_logits) & used_t).any(1)
              | (_bad_vocab_rows(draft_logits) & used_d).any(1))  # [B]
    zt = torch.where((used_t & valid[:, None])[..., None],
                     target_logits.to(compute_dtype).clamp(max=FLOAT32_MAX), 0.0)  # [B, K+1, V_t]
    zd = torch.where((used_d & valid[:, None])[..., None],
                     draft_logits.to(compute_dtype).clamp(max=FLOAT32_MAX), 0.0)
    zd = _pad_draft_vocab(zd, vocab)  # [B, K, V_t]

    tau = _per_row(temperature, batch, compute_dtype)  # [B]
    logp = sampling_logprobs(zt, tau, top_k, top_p, min_p)  # [B, K+1, V_t]
    logq = sampling_logprobs(zd, tau, top_k, top_p, min_p)  # [B, K, V_t]

    if coin_uniforms is None:
        coin_uniforms = philox_uniforms(seed, offset, batch, k, PURPOSE_ACCEPT)  # [B, K]
    if sample_uniforms is None:
        sample_uniforms = philox_uniforms(seed, offset, batch, k_plus_1, PURPOSE_SAMPLE)  # [B, K+1]
    drafts = torch.where(used_d, draft_tokens.to("cpu", torch.int64), 0)  # [B, K]
    p_draft = logp[:, :k].gather(-1, drafts[..., None])[..., 0].exp()  # [B, K]
    q_draft = logq.gather(-1, drafts[..., None])[..., 0].exp()
    coin = coin_uniforms.to(compute_dtype)
    coin_accepts = coin * q_draft <= p_draft

    criterion = RULE_TABLE[RULES.index(rule)].criterion
    stat = None
    if return_divergence or criterion:
        if div_temperature is None:
            div_p, div_q = logp[:, :k], logq
        else:
            tau_div = _per_row(div_temperature, batch, compute_dtype)[:, None, None]
            div_p = ((zt[:, :k] - zt[:, :k].amax(-1, keepdim=True)) / tau_div).log_softmax(-1)
            div_q = ((zd - zd.amax(-1, keepdim=True)) / tau_div).log_softmax(-1)
        if criterion in (None, "divergence"):
            if div_top_k:
                div_p, div_q = bucket_top_k(div_p, div_q, div_top_k)
            stat = divergence_from_logprobs(div_p, div_q, divergence)  # [B, K]
        else:
            if div_top_k:
                raise ValueError(f"div_top_k applies to the divergence rules (fsd, fsd_strict) only, got rule {rule!r}")
            stat = _criterion_statistic(criterion, div_p, div_q, zt[:, :k], drafts, coin, p_draft, q_draft)
        stat = stat.masked_fill(~(used_d & valid[:, None]), float("nan"))

    target_argmax = zt.argmax(-1)  # [B, K+1]
    thr = _per_row(threshold, batch, torch.float32)[:, None]  # [B, 1]
    stat32 = stat.float() if stat is not None else None  # the kernels compare s_i in float32
    if rule == "greedy":
        accepted = drafts == target_argmax[:, :k]
    elif criterion is None:
        accepted = coin_accepts
    elif rule == "fsd_strict":
        accepted = (stat32 <= thr) & stat32.isfinite()
    else:
        test = stat32 < thr
        accepted = test if RULE_TABLE[RULES.index(rule)].strict else test | coin_accepts
    accepted &= used_d
    num_accepted = accepted.long().cumprod(1).sum(1)  # [B]

    # The correction (first rejection) or bonus token, at position num_accepted.
    at = num_accepted
    p_at = logp[arange_b, at].exp()  # [B, V_t]
    q_at = logq[arange_b, at.clamp(max=max(k - 1, 0))].exp() if k else torch.zeros_like(p_at)
    rejected = at < num_draft
    residual = (p_at - q_at).clamp_min(0.0)
    no_mass = residual.sum(-1, keepdim=True) <= RESIDUAL_MASS_EPS
    residual = torch.where(no_mass, p_at, residual)
    u_at = sample_uniforms.to(compute_dtype)[arange_b, at]
    argmax_at = target_argmax[arange_b, at]
    use_residual = rejected & (rule != "greedy" and not RULE_TABLE[RULES.index(rule)].strict)
    emitted = inverse_cdf(torch.where(use_residual[:, None], residual, p_at), u_at)
    emitted = argmax_at if rule == "greedy" else emitted

    tokens = torch.full((batch, k_plus_1), -1, dtype=torch.int64)
    keep = pos[None, :k] < num_accepted[:, None]
    tokens[:, :k] = torch.where(keep, drafts, -1)
    tokens[arange_b, at] = emitted
    tokens[~valid] = -1
    num_accepted = num_accepted.masked_fill(~valid, 0)
    return AcceptResult(tokens, num_accepted, valid, stat.float() if return_divergence else None)
