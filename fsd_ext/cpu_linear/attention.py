"""Grouped-query attention for few-token decoding steps, as a Hugging Face attention function.

transformers' "sdpa" attention repeats every key/value head for each query head it serves
(`repeat_kv`: a copy of the whole cache, per layer and forward) whenever more than one token is
fed, as a verification of K+1 tokens is. Here the query heads that share a key/value head are
stacked into one taller query instead (`query[b, g * groups + r, s]` becomes row r * S + s of kv
head g, the mask repeated per row), so SDPA reads each cached key and value once: a 6-token
verification of the 1.5B model spent more time copying its cache than in its linear layers.
Prompts (more than MAX_STACKED_STEPS tokens) use SDPA's own grouped-query path (enable_gqa),
which needs no copy of the mask. Both give SDPA's own results bit for bit (tests).

`use_grouped_attention(model)` switches a model's attention to it (models.load does on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "fsd_ext_grouped_sdpa"
MAX_STACKED_STEPS = 16  # query tokens up to which heads are stacked; beyond, enable_gqa


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                 dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query [B, H, S, D], key / value [B, H_kv, L, D],
    attention_mask [B, 1, S, L] (additive or boolean) or None -> ([B, S, H, D], None)."""
    batch, heads, steps, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if (groups == 1 or dropout or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or kwargs.get("output_attentions")):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[..., :length]  # [B, 1, S, L]
    if steps > MAX_STACKED_STEPS:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    else:
        stacked = query.reshape(batch, kv_heads, groups * steps, dim)  # [B, H_kv, groups x S, D]
        stacked_mask = mask.expand(batch, groups, steps, length).reshape(batch, 1, groups * steps, length)
        out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=stacked_mask, scale=scaling)
        out = out.view(batch, heads, steps, dim)
    return out.transpose(1, 2), None


def use_grouped_attention(model: torch.nn.Module) -> bool:
    """Make `model` (a transformers model with grouped-query attention) attend with grouped_sdpa;
    returns whether it did (False for a transformers without attention-function registration)."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers < 4.48
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:  # pragma: no cover - transformers 4.5x
        model.config._attn_implementation = NAME
    return True
