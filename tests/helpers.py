"""Shared builders for the kernel tests: random verification problems and the reference call."""

from __future__ import annotations

import torch

import fsd_ext
from fsd_ext import reference


def make_problem(batch, k, vocab, *, draft_vocab=None, dtype=torch.float32, scale=2.0, closeness=0.7,
                 seed=0, token_dtype=torch.int64):
    """Target/draft logits where the draft resembles the target (so rules accept some and reject
    some), and drafted tokens sampled from the draft distribution."""
    gen = torch.Generator().manual_seed(seed)
    draft_vocab = vocab if draft_vocab is None else draft_vocab
    target = torch.randn(batch, k + 1, vocab, generator=gen) * scale  # [B, K+1, V_t]
    noise = torch.randn(batch, k, draft_vocab, generator=gen) * scale  # [B, K, V_d]
    draft = closeness * target[:, :k, :draft_vocab] + (1 - closeness ** 2) ** 0.5 * noise
    if k:
        probs = draft.reshape(-1, draft_vocab).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=gen).reshape(batch, k)  # [B, K]
    else:
        tokens = torch.zeros(batch, 0, dtype=torch.int64)
    return target.to(dtype), draft.to(dtype), tokens.to(token_dtype)


def both(target, draft, tokens, **kwargs):
    """(kernel result, reference result) for the same call."""
    return fsd_ext.accept(target, draft, tokens, **kwargs), reference.accept(target, draft, tokens, **kwargs)


def assert_same_result(kernel, ref, *, div_rtol=1e-5, div_atol=1e-6):
    assert torch.equal(kernel.valid, ref.valid)
    assert torch.equal(kernel.num_accepted, ref.num_accepted), (kernel.num_accepted, ref.num_accepted)
    assert torch.equal(kernel.tokens, ref.tokens), (kernel.tokens, ref.tokens)
    if ref.divergence is not None:
        torch.testing.assert_close(kernel.divergence, ref.divergence, rtol=div_rtol, atol=div_atol,
                                   equal_nan=True)
