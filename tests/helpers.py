"""Shared builders for the kernel tests: random verification problems and the reference call."""

from __future__ import annotations

import pytest
import torch

import fsd_ext
from fsd_ext import reference
from fsd_ext.types import DIVERGENCES, RULES  # noqa: F401  (the tests' parameter lists)

# Where a device-parametrized test runs: "cuda" carries the `cuda` marker (pytest -m cuda selects
# it) and skips without a GPU.
CUDA = pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])
DEVICES = ["cpu", CUDA]


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


def make_case(batch, k, vocab, draft_vocab=None, dtype=torch.float32, scale=3.0, noise=1.0, seed=0,
              num_draft=False, separated=False):
    """Random target/draft logits [B, K+1, V_t] / [B, K, V_d], drafts sampled from the draft."""
    g = torch.Generator().manual_seed(seed)
    draft_vocab = draft_vocab or vocab
    if separated:
        # Distinct logits half a unit apart: no ties and no near-ties anywhere.
        target = torch.stack([torch.randperm(vocab, generator=g) for _ in range(batch * (k + 1))]).float()
        target = (target * (8.0 / vocab)).reshape(batch, k + 1, vocab)
        draft = target[:, :k, :draft_vocab].clone()
        swap = torch.randperm(draft_vocab, generator=g)[: max(2, draft_vocab // 4)]
        draft[..., swap] = draft[..., swap.flip(0)]
    else:
        target = torch.randn(batch, k + 1, vocab, generator=g) * scale  # [B, K+1, V_t]
        draft = target[:, :k, :draft_vocab] + noise * torch.randn(batch, k, draft_vocab, generator=g)
    tokens = torch.multinomial(draft.reshape(-1, draft_vocab).float().softmax(-1), 1, generator=g)
    tokens = tokens.reshape(batch, k)  # [B, K]
    nd = torch.randint(0, k + 1, (batch,), generator=g) if num_draft else None
    return target.to(dtype), draft.to(dtype), tokens, nd


def to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def run_accept(fops, device, target, draft, tokens, **kw):
    kw = {name: to(value, device) for name, value in kw.items()}
    out = fops.accept(target.to(device), draft.to(device), tokens.to(device), **kw)
    return type(out)(*(to(x, "cpu") if x is not None else None for x in out))


def both(target, draft, tokens, device="cpu", **kwargs):
    """(kernel result, reference result) for the same call; the kernel runs on `device` (its result
    comes back to the CPU)."""
    kernel = run_accept(fsd_ext, device, target, draft, tokens, **kwargs)
    return kernel, reference.accept(target, draft, tokens, **kwargs)


def assert_same_result(kernel, ref, *, div_rtol=1e-5, div_atol=1e-6):
    assert torch.equal(kernel.valid, ref.valid)
    assert torch.equal(kernel.num_accepted, ref.num_accepted), (kernel.num_accepted, ref.num_accepted)
    assert torch.equal(kernel.tokens, ref.tokens), (kernel.tokens, ref.tokens)
    if ref.divergence is not None:
        torch.testing.assert_close(kernel.divergence, ref.divergence, rtol=div_rtol, atol=div_atol,
                                   equal_nan=True)


def rows_agree(a, b) -> torch.Tensor:
    """[B] bool: the rows of two accept results whose tokens, num_accepted and valid all agree."""
    return (a.tokens == b.tokens).all(1) & (a.num_accepted == b.num_accepted) & (a.valid == b.valid)


def agreement(a, b) -> float:
    """Fraction of rows whose tokens, num_accepted and valid all agree."""
    return rows_agree(a, b).float().mean().item()


def chi_square_pvalue(counts, probs, *, min_expected=5.0) -> float:
    """Pearson chi-square p-value of observed `counts` [V] against `probs` [V] (weights, normalised
    here). Bins expecting fewer than `min_expected` draws are pooled into one, where the chi-square
    approximation would otherwise not hold; a count in a pool expecting none gives 0."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    expected = probs / probs.sum() * counts.sum()  # [V]
    rare = expected < min_expected
    observed = torch.cat([counts[~rare], counts[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    if expected[-1] == 0:  # nothing expected in the pool: any count there is impossible
        if observed[-1] > 0:
            return 0.0
        observed, expected = observed[:-1], expected[:-1]
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def agreement_up_to_ties(result, target, draft, tokens, *, seed, offset=0, nudge=1e-5, **kwargs) -> float:
    """Fraction of rows where `result` (a kernel's accept result, on the CPU) equals the reference's,
    a differing row counting as agreeing when the reference gives it with every uniform scaled by
    1 - nudge or 1 + nudge: a rounding tie, a uniform within ~1e-5 relative of a boundary of an
    inverse CDF or a coin's ratio. (A kernel computes its weights in float, so each of its V
    boundaries may sit a rounding from the float64 reference's; at V = 151936 that moved a few per
    thousand draws while a kernel's totals came from other sums than its scans (CUDA's statistics
    pass, the CPU's float lanes), and none of 2000 CPU bonus draws since.) A wrong token, count or
    validity elsewhere still counts as a disagreement."""
    batch, k = tokens.shape
    same = rows_agree(result, reference.accept(target, draft, tokens, seed=seed, offset=offset, **kwargs))
    coin = reference.philox_uniforms(seed, offset, batch, k, 1)
    sample = reference.philox_uniforms(seed, offset, batch, k + 1, 2)
    below_one = 1.0 - 2.0 ** -53
    for factor in (1.0 - nudge, 1.0 + nudge):
        nudged = reference.accept(target, draft, tokens, coin_uniforms=(coin * factor).clamp(max=below_one),
                                  sample_uniforms=(sample * factor).clamp(max=below_one), **kwargs)
        same |= rows_agree(result, nudged)
    return same.float().mean().item()


def float_weight_draws(logits, seed, offset=0) -> torch.Tensor:
    """[B] the bonus draws of K = 0 accept calls on `logits` [B, V] at temperature 1: the inverse
    CDF of the float32 weights exp(z - max) that the kernels compute, summed exactly (float64, on
    the logits' device), at the rows' sampling uniforms. A kernel whose chunk totals and scan add
    those weights in double lands there; an error of 1e-7 relative in its sums moves about
    V * 1e-7 of the draws when every id has weight."""
    u = reference.philox_uniforms(seed, offset, logits.shape[0], 1, 2)[:, 0].to(logits.device)
    cdf = (logits.float() - logits.float().amax(-1, keepdim=True)).exp().double().cumsum(-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return at.clamp(max=logits.shape[-1] - 1).cpu()


FILTER_ROW_SHAPES = ("flat", "peaked", "ties", "masked", "bf16", "three_finite", "signed_zeros")


def filter_rows(shape: str, rows: int, vocab: int, seed: int = 3) -> torch.Tensor:
    """[rows, vocab] float32 logits of a shape where filter cutoffs are delicate."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    if shape == "flat":  # top-p walks cover most ids
        return x * 0.5
    if shape == "peaked":  # top-p walks end within tens of ids
        return x * 6.0
    if shape == "ties":  # six values: ties at every cutoff
        return torch.randint(0, 6, (rows, vocab), generator=gen).float() * 0.5
    if shape == "bf16":  # rounded to bfloat16: ties at most cutoffs
        return (x * 4).to(torch.bfloat16).float()
    if shape == "three_finite":  # fewer finite values than most k; a tie among them
        out = torch.full((rows, vocab), float("-inf"))
        for row in out:
            row[torch.randperm(vocab, generator=gen)[:3]] = torch.tensor([0.0, -0.5, -0.5])
        return out
    if shape == "signed_zeros":  # the maxima are +0.0 and -0.0, everything else -1
        zeros = torch.where(torch.rand(rows, vocab, generator=gen) < 0.5, -0.0, 0.0)
        return zeros.masked_fill(torch.rand(rows, vocab, generator=gen) < 0.5, -1.0)
    assert shape == "masked", shape
    x = x * 3.0  # a few thousand ids in the walk, -inf and huge negative logits
    x[:, ::3] = float("-inf")
    x[:, 1::7] = -1e9
    return x


def tiny_rest_cases(dtype=torch.float32):
    """(name, target [2, 2, V], draft [2, 1, V], div_top_k, temperature) where div_top_k's rest bucket
    has a mass below float's range under p but not under q: RKL and MKL then hang on the rest's
    log, which a float sum of the rest's probabilities loses (the kernels gave RKL 3.65 for the
    reference's 26.75 in the first case, and before the 1e-37 floor +inf). The second is a batch of
    realistic rows: a confident target (its top 10 ids 40 logits up) against a less sure draft,
    temperature 0.3 (the kernels gave RKL 0.68 for 0.90 on one row, either side of a usual
    threshold, and 85.16 for 115.9 on another)."""
    small = torch.full((2, 2, 8), -600.0)
    small[..., 0] = 0.0
    small_draft = torch.full((2, 1, 8), -5.0)
    small_draft[..., 0] = 0.0
    gen = torch.Generator().manual_seed(11)
    confident = torch.randn(4, 2, 4096, generator=gen) * 2
    confident[..., :10] += 40
    unsure = confident[:, :1] + torch.randn(4, 1, 4096, generator=gen) * 2
    unsure[..., :10] -= 35
    return [("e^-600 outside the top id", small.to(dtype), small_draft.to(dtype), 1, 1.0),
            ("a confident target at temperature 0.3", confident.to(dtype), unsure.to(dtype), 10, 0.3)]


def below_float_range_cases(dtype=torch.float32):
    """(name, target [2, 2, V], draft [2, 1, V_d], {div_top_k: kinds that are +inf}) where one side's probability
    is 0 by construction and the other's is below float's range but > 0 in float64 (e^-200,
    e^-300): KL / RKL / MKL are +inf in the reference, and a float kernel that flushes the small
    side to 0 would give a finite value (CUDA's div_top_k and the CPU kernel gave KL 2.708 here).
    Position 1 of the target is the bonus position, position 0 the divergence's. With div_top_k 3 the
    first case's top ids are 0, 20 and 1 (RKL is +inf too: p's rest bucket is e^-1000 = 0 against q's
    12/15); the second's id 5 falls in the rest bucket, where both sides have mass. In the third the
    rest bucket is the small side: ids 3-7, past the draft vocabulary (3), e^-200 each under p (both
    kernels summed it in float, as 0, and gave KL 0)."""
    past = torch.full((2, 2, 36), -1000.0)  # id 20 is past the draft vocabulary (15): q = 0 there
    past[..., 0] = 0.0
    past[..., 20] = -200.0
    masked = torch.zeros(2, 2, 16)  # id 5: target logit -inf (p = 0), draft logit -300
    masked[..., 5] = float("-inf")
    masked_draft = torch.zeros(2, 1, 16)
    masked_draft[..., 5] = -300.0
    rest = torch.full((2, 2, 8), -200.0)  # div_top_k 3: top ids 0-2, the rest past the draft vocabulary
    rest[..., :3] = 0.0
    return [
        ("past the draft vocabulary", past.to(dtype), torch.zeros(2, 1, 15, dtype=dtype),
         {None: {"kl", "mkl"}, 3: {"kl", "rkl", "mkl"}}),
        ("a -inf target logit", masked.to(dtype), masked_draft.to(dtype), {None: {"rkl", "mkl"}, 3: set()}),
        ("a rest bucket past the draft vocabulary", rest.to(dtype), torch.zeros(2, 1, 3, dtype=dtype),
         {None: {"kl", "mkl"}, 3: {"kl", "mkl"}}),
    ]


def astronomical_gap_cases(dtype=torch.float32):
    """(name, target [B, 2, V], draft [B, 1, V], temperature, kinds that are +inf) where a log-probability
    falls below about -1.02e20, which counts as 0 by construction (rules.h kZeroByConstructionBelow), as a
    filtered token does. Above all a +inf logit (counted as FLT_MAX): the row's other ids sit near
    -3.4e38. Before the rule the kernels and the reference disagreed here: CPU RKL 35.41 and MKL
    3523.4 for the reference's 1.386 and 3506.4 on the first case (float16, seed 113 of
    test_cuda_sim), CUDA +inf (its log2 units overflow); in float64 a finite gap stays finite.
    The last two cases sit either side of the bound: a gap of 1e19 stays a (huge) finite log."""
    inf = float("inf")
    seed_113_target = [inf, -inf, -5.3e-05, -0.00256, -inf, inf, -0.000455, inf, 0.00187, -0.00106, -inf, -inf,
                       -inf, inf, -0.000539, -0.000938]
    seed_113_draft = [-385, -7988, -4372, 21184, -4828, 21472, -26352, 4232, -1342, 2980, 5144, 14112, -20064,
                      4460, 18112]  # draft vocabulary 15
    gen = torch.Generator().manual_seed(17)
    plain = torch.randn(3, 2, 64, generator=gen)
    plus_inf_target = plain.clone()
    plus_inf_target[:, :, 3] = inf  # p one-hot at id 3 in the limit: q > 0 elsewhere makes RKL / MKL +inf
    plus_inf_draft = plain[:, :1].clone()
    plus_inf_draft[:, :, 7] = inf  # q one-hot at id 7: p > 0 elsewhere makes KL / MKL +inf

    def far(gap):  # id 5's target logit `gap` below the others, which are near 0
        row = plain.clone()
        row[:, :, 5] = -gap
        return row

    cases = [("seed 113: +inf target logits against a float16 draft",
              torch.tensor(seed_113_target).expand(2, 2, 16), torch.tensor(seed_113_draft).expand(2, 1, 15).float(),
              (0.5, 1.0, 2.0), {"rkl", "mkl"}),
             ("a +inf target logit", plus_inf_target, plain[:, :1], (0.5, 1.0, 2.0), {"rkl", "mkl"}),
             ("a +inf draft logit", plain, plus_inf_draft, (0.5, 1.0, 2.0), {"kl", "mkl"}),
             ("a target logit 1e21 below", far(1e21), plain[:, :1], (1.0, 2.0), {"rkl", "mkl"})]
    if dtype == torch.float32:  # bfloat16 rounds 1e19 to 9.98e18: still finite at temperature 1
        cases.append(("a target logit 1e19 below, temperature 1: finite", far(1e19), plain[:, :1], (1.0,), set()))
        cases.append(("a target logit 1e19 below, temperature 0.05: 0", far(1e19), plain[:, :1], (0.05,),
                      {"rkl", "mkl"}))
    return [(name, t.to(dtype), d.to(dtype), taus, infinite) for name, t, d, taus, infinite in cases]


DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the logits dtypes the ops take

# ----------------------------------------------------------------------------------------------
# Tiny random models for the decoding loop and the engine adapters.

EOS, PAD = 2, 0


def tiny_llama(seed, layers=2, *, vocab=128, hidden=64, heads=4, kv_heads=2, max_positions=512,
               logit_scale=1.0, dtype=torch.float32):
    """A randomly initialised Llama; logit_scale > 1 makes its next-token distributions peakier
    (fewer argmax ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=EOS,
                         pad_token_id=PAD, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.lm_head.weight.data *= logit_scale
    return model


def left_padded_prompts(lengths, vocab, seed=0):
    """Random prompts of the given lengths, left-padded -> (input_ids [B, P], attention_mask [B, P])."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask
