"""CUDA kernels of fsd_ext against the CPU kernel and the pure-torch reference (docs/design.md 2-3).

Everything here needs a GPU and the extension built with CUDA; without a GPU every test is skipped.
Run: pytest -m cuda tests/test_cuda.py

- parity: same seed -> same tokens on CUDA, on the CPU kernel and in the reference (>= 99.9% of
  rows over large random batches, all rows on well-separated logits, and at large vocabularies all
  rows up to rounding ties, helpers.agreement_up_to_ties); divergences within 1e-5
  relative of the float64 reference; every dtype, rule, divergence, filter, ragged K, V_d < V_t,
  odd vocabularies;
- invalid rows: NaN / all -inf logits, draft ids outside the draft vocabulary, num_draft > K,
  per-row threshold / temperature values out of range;
- statistics on the GPU: under sd the emitted token follows p (chi-square over 1e5+ rows);
- CUDA graphs: accept captured once, replayed with a device offset bumped between replays draws
  fresh tokens and matches eager calls; no host synchronisation inside the ops;
- generate with CUDA graphs: the same tokens as eager, stopped rows parked, the graphs reused by
  the next call.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from fsd_ext import reference
from helpers import (FILTER_ROW_SHAPES, agreement_up_to_ties, assert_same_result, astronomical_gap_cases,
                     below_float_range_cases, filter_rows, float_weight_draws, rows_agree, tiny_rest_cases)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RULES = ("greedy", "sd", "fsd", "fsd_strict")
DIVERGENCES = ("kl", "rkl", "js", "tv", "mkl")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def fops():
    from fsd_ext import ops

    ops._ops()  # raises ImportError with a clear message when the extension is not built
    return ops


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


def agreement(a, b):
    """Fraction of rows whose tokens, num_accepted and valid all agree."""
    return rows_agree(a, b).float().mean().item()


# ----------------------------------------------------------------------------------------------
# Randomness.

@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("purpose", ["accept", "sample", "draft"])
def test_uniforms_match_reference(fops, per_row, purpose):
    rows, positions = 37, 9
    seed = torch.arange(rows, dtype=torch.int64) * 7919 - 5 if per_row else 1234
    offset = torch.tensor([2**33 + 5], dtype=torch.int64)
    got = fops.philox_uniforms(to(seed, "cuda") if per_row else torch.tensor(seed, device="cuda"),
                               offset.cuda(), rows, positions, purpose)
    purpose_id = {"accept": 1, "sample": 2, "draft": 3}[purpose]
    want = reference.philox_uniforms(seed, int(offset), rows, positions, purpose_id)
    assert torch.equal(got.cpu(), want)


# ----------------------------------------------------------------------------------------------
# Parity with the CPU kernel and the reference.

@pytest.mark.parametrize("rule", RULES)
def test_accept_large_random_batch_agrees_with_cpu(fops, rule):
    target, draft, tokens, nd = make_case(4096, 4, 1000, num_draft=True, seed=1)
    kw = dict(rule=rule, divergence="js", threshold=0.3, temperature=0.9, seed=42, offset=3, num_draft=nd)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    cpu = run_accept(fops, "cpu", target, draft, tokens, **kw)
    assert agreement(cuda, cpu) >= 0.999
    assert bool(cuda.valid.all())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_accept_agrees_with_reference(fops, rule, divergence):
    target, draft, tokens, nd = make_case(256, 3, 512, seed=2, num_draft=True)
    kw = dict(rule=rule, divergence=divergence, threshold=0.2, temperature=1.0, seed=7, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement(cuda, ref) >= 0.99
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("rule", RULES)
def test_accept_well_separated_all_rows_agree(fops, rule):
    target, draft, tokens, _ = make_case(512, 3, 257, separated=True, seed=3)
    kw = dict(rule=rule, divergence="tv", threshold=0.1, temperature=1.0, seed=11)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) == 1.0
    assert agreement(cuda, reference.accept(target, draft, tokens, **kw)) == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,draft_vocab", [(1000, 1000), (32001, 32000), (4099, 3001)])
def test_accept_dtypes_and_vocabs(fops, dtype, vocab, draft_vocab):
    target, draft, tokens, nd = make_case(64, 4, vocab, draft_vocab, dtype=dtype, seed=4, num_draft=True)
    kw = dict(rule="fsd", divergence="kl", threshold=0.5, temperature=0.8, seed=5, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    cpu = run_accept(fops, "cpu", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement(cuda, cpu) >= 0.98 and agreement(cuda, ref) >= 0.98
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert int(cuda.tokens.max()) < vocab


@pytest.mark.parametrize("vocab", [151936, 152064, 262144])
def test_accept_big_vocab_split_path(fops, vocab):
    # B=1: the vocabulary is split over many blocks per position.
    target, draft, tokens, _ = make_case(2, 5, vocab, dtype=torch.bfloat16, seed=6)
    for rule in RULES:
        kw = dict(rule=rule, divergence="js", threshold=0.4, temperature=1.0, seed=9, return_divergence=True)
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        ref = reference.accept(target, draft, tokens, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0, rule
        torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("rule", ["sd", "fsd_strict"])
def test_accept_bonus_draws_at_a_large_vocabulary_follow_the_float_weights(fops, capfd, rule):
    """K = 0 rows (only the bonus token, from p) of 151936 N(0, 1) logits on the split path:
    every id has weight, so a draw moves when the kernel's sums
    are off by 1/V of a weight anywhere. The chunk totals and the scan add the float weights in
    double, so the draws are those of the exact sum of the float32 weights
    (helpers.float_weight_draws; the kernel and torch.exp both use CUDA's expf), up to 2 rows for
    rounding. Chunk totals from the statistics pass's online sums moved ~0.5% (~10 rows). (The CPU
    kernel makes these draws too: test_accept.py.)"""
    rows, vocab, seed = 2000, 151936, 12
    target = torch.randn(rows, 1, vocab, generator=torch.Generator().manual_seed(41))
    draft, tokens = torch.zeros(rows, 0, vocab), torch.zeros(rows, 0, dtype=torch.int64)
    kw = dict(rule=rule, divergence="js", threshold=0.1, temperature=1.0, seed=seed, offset=2)
    assert accept_path(fops, capfd, target.cuda(), draft.cuda(), tokens.cuda(), **kw) == "split"
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    want = float_weight_draws(target[:, 0].cuda(), seed, offset=2)
    assert int((cuda.tokens[:, 0] != want).sum()) <= 2
    assert int((cuda.tokens[:, 0] != float_weight_draws(target[:, 0].cuda(), seed + 1, offset=2)).sum()) > rows * 0.99


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_vocab_path_matches_reference(fops, rule, dtype):
    # Few rows and a big vocabulary: each position's vocabulary is split over many blocks (two
    # launches), with ragged K, V_d < V_t, odd sizes and a NaN row.
    target, draft, tokens, nd = make_case(6, 3, 50001, 49999, dtype=dtype, seed=15, num_draft=True)
    target[5, 0, 123] = float("nan")
    nd[5] = 2
    kw = dict(rule=rule, divergence="rkl", threshold=0.2, temperature=0.9, seed=21, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0
    assert not bool(cuda.valid[5])
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    if rule in ("sd", "fsd"):  # without divergences: coin-accepted positions skip pass 2
        kw.pop("return_divergence")
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0


@pytest.mark.parametrize("splits,path", [(1, "fused"), (3, "split"), (64, "split")])
def test_requested_splits_agree_with_reference(fops, monkeypatch, capfd, splits, path):
    # The launch option splits (benchmarks) overrides the planner: a fused launch for few rows, or
    # many chunks for many rows (64 requested: as many 4096-id chunks as the vocabulary holds, 13).
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"splits={splits}")
    target, draft, tokens, nd = make_case(24, 4, 50001, 49999, dtype=torch.bfloat16, seed=17, num_draft=True)
    assert accept_path(fops, capfd, target.cuda(), draft.cuda(), tokens.cuda(), rule="fsd", seed=1) == path
    for rule in RULES:
        kw = dict(rule=rule, divergence="js", threshold=0.3, seed=4, num_draft=nd, return_divergence=True)
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        ref = reference.accept(target, draft, tokens, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0, rule
        torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)


def raw_accept_divergence(target, draft, tokens, nd, rule, threshold, temperature, seed, return_divergence):
    """The op's divergence output as the kernel left it (fsd_ext.accept hides it unless
    return_divergence), with js and every filter off."""
    out = torch.ops.fsd_ext.accept.default(
        target, draft, tokens, nd, None, threshold, None, temperature, None, 1.0, False, None, seed, False,
        None, 0, RULES.index(rule), DIVERGENCES.index("js"), 0, 1.0, 0.0, 0, return_divergence)
    return out[3].cpu()


@pytest.mark.parametrize("splits,path", [(1, "fused"), (4, "split")])
def test_fsd_coin_accepted_positions_skip_pass_two(fops, monkeypatch, capfd, splits, path):
    # fsd without return_divergence: a position whose coin accepts (u q(d) <= p(d)) is accepted
    # whatever D is, so the kernel skips its pass 2 and leaves D NaN; every other used position's D
    # is computed. The tokens equal the reference's, and asking for the divergences computes all.
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"splits={splits}")
    batch, k, vocab, tau, seed = 48, 4, 20001, 0.9, 13
    target, draft, tokens, nd = make_case(batch, k, vocab, 19999, dtype=torch.bfloat16, seed=23, num_draft=True)
    args = (target.cuda(), draft.cuda(), tokens.cuda(), nd.cuda())
    assert accept_path(fops, capfd, *args[:3], rule="fsd", seed=1) == path
    skipped = raw_accept_divergence(*args, "fsd", 0.2, tau, seed, False)
    full = raw_accept_divergence(*args, "fsd", 0.2, tau, seed, True)
    ref = reference.accept(target, draft, tokens, rule="fsd", divergence="js", threshold=0.2, temperature=tau,
                           seed=seed, num_draft=nd, return_divergence=True)
    torch.testing.assert_close(full, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    # The coins the kernel flips (float64, as in the kernel's decision).
    logp = (target[:, :k].double() / tau).log_softmax(-1)
    logq = torch.nn.functional.pad(draft.double() / tau, (0, vocab - 19999), value=-math.inf).log_softmax(-1)
    d = tokens[..., None]
    coins = reference.philox_uniforms(seed, 0, batch, k, 1)
    coin_accepts = coins * logq.gather(-1, d)[..., 0].exp() <= logp.gather(-1, d)[..., 0].exp()
    used = torch.arange(k)[None, :] < nd[:, None]
    assert bool((skipped.isnan() == (coin_accepts | ~used)).all())
    assert 0 < int((coin_accepts & used).sum()) < int(used.sum())  # both kinds of position occur
    kept = used & ~coin_accepts
    torch.testing.assert_close(skipped[kept], full[kept])
    kw = dict(rule="fsd", threshold=0.2, temperature=tau, seed=seed, num_draft=nd)
    for return_divergence in (False, True):
        cuda = run_accept(fops, "cuda", target, draft, tokens, return_divergence=return_divergence, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0


@pytest.mark.parametrize("filters", [dict(top_k=20), dict(top_p=0.8), dict(min_p=0.05),
                                     dict(top_k=50, top_p=0.9, min_p=0.01)])
@pytest.mark.parametrize("rule", ["sd", "fsd", "fsd_strict"])
def test_accept_filters(fops, filters, rule):
    target, draft, tokens, nd = make_case(256, 3, 1000, seed=7, num_draft=True)
    kw = dict(rule=rule, divergence="js", threshold=0.3, temperature=0.7, seed=13, num_draft=nd, **filters)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) >= 0.99
    assert agreement(cuda, reference.accept(target, draft, tokens, **kw)) >= 0.99


@pytest.mark.parametrize("div_temperature", [1.0, None, 2.0])
@pytest.mark.parametrize("div_top_k", [None, 1, 10])
def test_divergence_options(fops, div_temperature, div_top_k):
    target, draft, tokens, _ = make_case(128, 2, 700, 600, seed=8)
    kw = dict(rule="fsd", divergence="mkl", threshold=0.4, temperature=0.5, seed=3,
              div_temperature=div_temperature, div_top_k=div_top_k, return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert agreement(cuda, ref) >= 0.99


def test_greedy_rows_and_per_row_arguments(fops):
    target, draft, tokens, nd = make_case(300, 4, 333, seed=9, num_draft=True)
    tau = torch.rand(300) * (torch.rand(300) > 0.3)  # a third of the rows greedy
    thr = torch.rand(300)
    seeds = torch.randint(-2**62, 2**62, (300,), dtype=torch.int64)
    kw = dict(rule="fsd", temperature=tau, threshold=thr, seed=seeds, num_draft=nd, div_temperature=None)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) >= 0.99
    assert agreement(cuda, reference.accept(target, draft, tokens, **kw)) >= 0.99


def test_divergence_op(fops):
    target, draft, _, _ = make_case(64, 1, 5000, 4000, seed=10)
    for kind in DIVERGENCES:
        for top_k in (None, 5):
            got = fops.divergence(target[:, 0].cuda(), draft[:, 0].cuda(), kind, 0.8, top_k).cpu()
            want = reference.divergence(target[:, 0], draft[:, 0], kind, 0.8, top_k)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_probabilities_below_float_range_against_zero(fops, dtype):
    """helpers.below_float_range_cases on the GPU (the plain, general and div_top_k paths of pass 2):
    +inf where the reference has it, by divergence and by accept (found by the CUDA simulation)."""
    for name, target, draft, infinite in below_float_range_cases(dtype):
        tokens = torch.zeros(2, 1, dtype=torch.long)
        for kind in DIVERGENCES:
            for top_k in (None, 3):
                got = fops.divergence(target[:, 0].cuda(), draft[:, 0].cuda(), kind, 1.0, top_k).cpu()
                want = reference.divergence(target[:, 0], draft[:, 0], kind, 1.0, top_k)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} {kind} {top_k}")
                assert got.isinf().all() == (kind in infinite[top_k]), (name, kind, top_k, got)
                kw = dict(rule="fsd", divergence=kind, threshold=0.4, div_top_k=top_k, temperature=0.0, seed=5,
                          return_divergence=True)
                assert_same_result(run_accept(fops, "cuda", target, draft, tokens, **kw),
                                   reference.accept(target, draft, tokens, **kw))

@pytest.mark.parametrize("dtype", DTYPES)
def test_log_below_bound_is_zero_by_construction(fops, dtype):
    """helpers.astronomical_gap_cases on the GPU: a log-probability below about -1.02e20 is 0 by construction
    (log2 units on the plain path, nats on the general one), by divergence and by accept."""
    for name, target, draft, temperatures, infinite in astronomical_gap_cases(dtype):
        tokens = torch.zeros(target.shape[0], 1, dtype=torch.long)
        for kind in DIVERGENCES:
            for temperature in temperatures:
                label = f"{name} {kind} temperature {temperature}"
                got = fops.divergence(target[:, 0].cuda(), draft[:, 0].cuda(), kind, temperature, None).cpu()
                want = reference.divergence(target[:, 0], draft[:, 0], kind, temperature, None)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=label)
                assert bool(got.isinf().all()) == (kind in infinite) and not got.isnan().any(), (label, got)
                for sampling_temperature in (temperature, 0.0):  # the plain path, then the general one
                    kw = dict(rule="fsd", divergence=kind, threshold=0.4, div_temperature=temperature,
                              temperature=sampling_temperature, seed=5, return_divergence=True)
                    assert_same_result(run_accept(fops, "cuda", target, draft, tokens, **kw),
                                       reference.accept(target, draft, tokens, **kw))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_rest_bucket_below_float_range_keeps_its_log(fops, dtype):
    """helpers.tiny_rest_cases on the GPU: div_top_k's rest bucket below float's range under p is
    redone as a log-sum-exp (exact_tiny_rests), by divergence and by accept."""
    for name, target, draft, top_k, temperature in tiny_rest_cases(dtype):
        tokens = torch.zeros(target.shape[0], 1, dtype=torch.long)
        for kind in DIVERGENCES:
            got = fops.divergence(target[:, 0].cuda(), draft[:, 0].cuda(), kind, temperature, top_k).cpu()
            want = reference.divergence(target[:, 0], draft[:, 0], kind, temperature, top_k)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} {kind}")
            kw = dict(rule="fsd", divergence=kind, threshold=10.0, div_top_k=top_k, div_temperature=temperature,
                      temperature=0.0, seed=5, return_divergence=True)
            assert_same_result(run_accept(fops, "cuda", target, draft, tokens, **kw),
                               reference.accept(target, draft, tokens, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("filters", [dict(), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.1)])
def test_sample_op(fops, dtype, filters):
    logits = (torch.randn(64, 3, 32001, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    got = fops.sample(logits.cuda(), temperature=0.8, seed=17, offset=2, **filters).cpu()
    want = reference.sample(logits, temperature=0.8, seed=17, offset=2, **filters)
    assert (got == want).float().mean().item() >= 0.99
    assert (got == fops.sample(logits, temperature=0.8, seed=17, offset=2, **filters)).float().mean() >= 0.99


def live_id_rows(rows, vocab, live=24, seed=0):
    """[rows, vocab] float32 logits with each row's mass on `live` random ids (N(0, 1.5^2)), the rest
    40 below: no id lies within rounding of a sampling boundary, so every kernel draws the same."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) - 40.0
    ids = torch.randint(0, vocab, (rows, live), generator=g)
    return logits.scatter(1, ids, 1.5 * torch.randn(rows, live, generator=g))


def logged_call(capfd, op: str, call):
    """(call()'s result, the one line the CUDA launcher of fsd_ext.<op> logs for it with the launch
    option log=1 added to FSD_EXT_CUDA_LAUNCH: the path it took, its chunks)."""
    options = os.environ.get("FSD_EXT_CUDA_LAUNCH")
    os.environ["FSD_EXT_CUDA_LAUNCH"] = f"{options},log=1" if options else "log=1"
    try:
        capfd.readouterr()
        result = call()
        torch.cuda.synchronize()
        err = capfd.readouterr().err
    finally:
        if options is None:
            del os.environ["FSD_EXT_CUDA_LAUNCH"]
        else:
            os.environ["FSD_EXT_CUDA_LAUNCH"] = options
    lines = [line for line in err.splitlines() if f"fsd_ext.{op} cuda:" in line]
    assert len(lines) == 1, err
    return result, lines[0]


def sample_path(fops, capfd, logits, **kwargs):
    """(tokens, the path the CUDA launcher took) of one sample call."""
    tokens, line = logged_call(capfd, "sample", lambda: fops.sample(logits, **kwargs))
    return tokens.cpu(), line.split("path=")[1].split()[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_split_path_matches_cpu(fops, capfd, monkeypatch, dtype):
    """Few rows without a filter (or with min-p alone) take the split path (a row's chunks on many
    SMs, then the draw); on well-separated rows it gives the CPU kernel's tokens on every row, as
    the one-block path (forced with FSD_EXT_CUDA_LAUNCH=splits=1) does. Temperature 0 rows give the argmax."""
    logits = live_id_rows(2 * 3, 151936, seed=21).reshape(2, 3, 151936).to(dtype)
    temperature = torch.tensor([0.8, 0.0])
    want = fops.sample(logits, temperature=temperature, seed=5, offset=1)
    got, path = sample_path(fops, capfd, logits.cuda(), temperature=temperature.cuda(), seed=5, offset=1)
    assert path == "split" and torch.equal(got, want)
    assert torch.equal(got[1], logits[1].float().argmax(-1))
    assert not torch.equal(fops.sample(logits.cuda(), temperature=temperature.cuda(), seed=6, offset=1).cpu()[0],
                           want[0])  # another seed draws other tokens: the comparison can fail
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", "splits=1")
    got, path = sample_path(fops, capfd, logits.cuda(), temperature=temperature.cuda(), seed=5, offset=1)
    assert path == "rows" and torch.equal(got, want)
    monkeypatch.delenv("FSD_EXT_CUDA_LAUNCH")
    _, path = sample_path(fops, capfd, logits.cuda(), temperature=0.8, top_p=0.9, seed=5)
    assert path == "rows"  # a top-p (or top-k) cutoff needs the whole row in one block
    # min-p needs only the row's maximum: the split path, and the CPU kernel's tokens (which the
    # filter changes here, so a kernel ignoring it would fail)
    want_min_p = fops.sample(logits, temperature=temperature, min_p=0.3, seed=5, offset=1)
    assert not torch.equal(want_min_p, want)
    got, path = sample_path(fops, capfd, logits.cuda(), temperature=temperature.cuda(), min_p=0.3, seed=5, offset=1)
    assert path == "split" and torch.equal(got, want_min_p)


def test_sample_split_path_distribution(fops, monkeypatch):
    """The split path's tokens follow softmax(logits / T) (chi-square over 2e5 rows whose 24 live
    ids lie in all four chunks), and the same test rejects a distribution with two ids swapped."""
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", "splits=4")
    rows, vocab, live = 200_000, 16384, 24
    ids = torch.arange(live) * (vocab // live) + 7  # spread over the four 4096-id chunks
    values = torch.randn(live, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    row = torch.full((vocab,), -60.0, dtype=torch.float64).index_put_((ids,), values)
    tokens = fops.sample(row.float().cuda().expand(rows, vocab), temperature=0.9, seed=31).cpu()
    assert bool(torch.isin(tokens, ids).all())
    counts = torch.bincount(tokens, minlength=vocab)[ids].double()
    p = (values / 0.9).softmax(-1)
    assert chi_square_pvalue(counts, p) > 1e-4
    swapped = p.clone()
    most, least = int(p.argmax()), int(p.argmin())
    swapped[[most, least]] = p[[least, most]]
    assert chi_square_pvalue(counts, swapped) < 1e-6


# ----------------------------------------------------------------------------------------------
# Filter and div_top_k edge cases: ties, signed zeros, -inf masks, k at the edges, a top_p that
# rounds to 0. The random-logit tests above almost never produce them.

def edge_rows(vocab, copies, seed=0):
    """[7 * copies, vocab]: `copies` rows of every shape of helpers.filter_rows."""
    return torch.cat([filter_rows(shape, copies, vocab, seed=seed + i)
                      for i, shape in enumerate(FILTER_ROW_SHAPES)])


@pytest.mark.parametrize("filters", [
    dict(top_k=1), dict(top_k=7), dict(top_k=4998), dict(top_k=20000), dict(top_p=1e-46),
    dict(top_p=0.3), dict(top_p=0.95), dict(top_p=0.999999), dict(top_k=50, top_p=0.6),
    dict(top_k=3000, top_p=0.9, min_p=0.2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_op_filter_edges(fops, filters, dtype):
    """On tie-heavy and masked rows the CUDA cutoffs keep the same ids as the CPU walk (ties at a
    cutoff kept, top_p=1e-46 keeps only the max, k beyond the finite values keeps them all)."""
    logits = edge_rows(4999, 32).to(dtype)
    seeds = torch.arange(logits.shape[0]) * 7 + 1
    got = fops.sample(logits.cuda(), temperature=0.7, seed=seeds.cuda(), **filters).cpu()
    want = fops.sample(logits, temperature=0.7, seed=seeds, **filters)
    assert (got == want).float().mean().item() >= 0.99
    if filters == dict(top_p=1e-46):  # only the max (and its ties) may be drawn
        values = logits.float()
        assert torch.equal(values.gather(1, got[:, None])[:, 0], values.max(-1).values)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_div_top_k_ties_and_signed_zeros(fops, kind):
    """div_top_k ranks equal values (+0.0 and -0.0 included) by lowest id, as the CPU does."""
    target = edge_rows(777, 4, seed=1)
    draft = torch.randn(target.shape, generator=torch.Generator().manual_seed(2))
    tiny = torch.tensor([[-0.0, -1, -1, -1, 0.0, -1, -1, -1]])
    for k in (1, 2, 5, 100, 700):
        got = fops.divergence(target.cuda(), draft.cuda(), kind, 1.0, k).cpu()
        torch.testing.assert_close(got, fops.divergence(target, draft, kind, 1.0, k), rtol=1e-5, atol=1e-6)
    tiny_draft = torch.arange(8.0)[None] * -0.3
    torch.testing.assert_close(fops.divergence(tiny.cuda(), tiny_draft.cuda(), kind, 1.0, 1).cpu(),
                               reference.divergence(tiny, tiny_draft, kind, 1.0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["sd", "fsd"])
def test_accept_filters_on_tied_logits(fops, rule):
    target = (torch.randint(0, 12, (96, 4, 3001), generator=torch.Generator().manual_seed(3)) * 0.25)
    draft = target[:, :3] + torch.randint(-1, 2, (96, 3, 3001), generator=torch.Generator().manual_seed(4)) * 0.25
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    tokens = torch.multinomial(draft.reshape(-1, 3001).float().softmax(-1), 1).reshape(96, 3)
    for filters in (dict(top_k=40), dict(top_p=0.5), dict(top_k=400, top_p=0.9, min_p=0.3)):
        kw = dict(rule=rule, divergence="js", threshold=0.05, temperature=0.9, seed=5,
                  div_top_k=10, **filters)
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) >= 0.99


# ----------------------------------------------------------------------------------------------
# Invalid rows.

def test_nan_and_all_neg_inf_rows(fops):
    target, draft, tokens, _ = make_case(8, 3, 300, seed=11)
    target[1, 2, 5] = float("nan")
    draft[2, 0, :] = float("-inf")
    target[3, 3, :] = float("-inf")  # bonus position: used
    target[4, 1, 7] = float("inf")   # +inf is the largest finite value, not an error
    nd = torch.tensor([3, 3, 3, 3, 3, 3, 3, 0])
    target[7, 2, 0] = float("nan")   # unused position (num_draft = 0): ignored
    for rule in RULES:
        # The same seed on both sides (accept draws a random one when seed is None).
        res = run_accept(fops, "cuda", target, draft, tokens, rule=rule, num_draft=nd, return_divergence=True, seed=5)
        ref = reference.accept(target, draft, tokens, rule=rule, num_draft=nd, return_divergence=True, seed=5)
        assert res.valid.tolist() == [True, False, False, False, True, True, True, True]
        assert agreement(res, ref) == 1.0
        assert (res.tokens[~res.valid] == -1).all() and (res.num_accepted[~res.valid] == 0).all()
        assert res.divergence[~res.valid].isnan().all()
        assert res.tokens[4, res.num_accepted[4]] >= 0


def test_out_of_range_draft_ids_mark_row_invalid(fops):
    target, draft, tokens, _ = make_case(6, 3, 100, 80, seed=12)
    tokens[1, 0] = 80   # outside the draft vocabulary (inside the target's)
    tokens[2, 2] = -1
    tokens[3, 2] = 10**6
    nd = torch.tensor([3, 3, 3, 2, 3, 3])  # row 3: the bad id is past num_draft, ignored
    res = run_accept(fops, "cuda", target, draft, tokens, num_draft=nd)
    assert res.valid.tolist() == [True, False, False, True, True, True]
    nd_bad = torch.tensor([3, 3, 3, 2, 4, -1])  # num_draft outside [0, K]
    res = run_accept(fops, "cuda", target, draft, tokens, num_draft=nd_bad)
    assert res.valid.tolist() == [True, False, False, True, False, False]
    assert (res.tokens[4:] == -1).all()


@pytest.mark.parametrize("name,bad", [
    ("temperature", [-1.0, float("nan"), float("inf")]), ("threshold", [-0.5, float("nan")]),
    ("div_temperature", [0.0, -1.0, float("nan"), float("inf")])])
def test_out_of_range_row_values_mark_row_invalid(fops, name, bad):
    """Per-row values out of range (the CPU raises) cannot raise on CUDA without a host sync: those
    rows come back invalid, the other rows as with in-range values. sample emits -1 for them."""
    batch = 8
    target, draft, tokens, _ = make_case(batch, 3, 500, seed=13)
    good = torch.full((batch,), 0.7)
    values = good.clone()
    rows = list(range(1, 2 * len(bad), 2))  # rows 1, 3, ...
    values[rows] = torch.tensor(bad)
    kw = dict(rule="fsd", seed=5, return_divergence=True, temperature=good, threshold=good,
              div_temperature=good)
    res = run_accept(fops, "cuda", target, draft, tokens, **dict(kw, **{name: values}))
    want = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert res.valid.tolist() == [b not in rows for b in range(batch)]
    assert (res.tokens[rows] == -1).all() and (res.num_accepted[rows] == 0).all()
    assert res.divergence[rows].isnan().all()
    keep = res.valid
    assert torch.equal(res.tokens[keep], want.tokens[keep])
    assert torch.equal(res.num_accepted[keep], want.num_accepted[keep])
    torch.testing.assert_close(res.divergence[keep], want.divergence[keep], equal_nan=True)
    if name == "temperature":
        logits = target[:, 0].cuda()[:, None]  # [B, 1, V]
        got = fops.sample(logits, temperature=values.cuda(), seed=3)[:, 0].cpu()
        expected = fops.sample(logits, temperature=good.cuda(), seed=3)[:, 0].cpu()
        assert (got[rows] == -1).all() and torch.equal(got[keep], expected[keep])


# ----------------------------------------------------------------------------------------------
# Statistics on the GPU.

def chi_square_pvalue(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 5
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.mark.parametrize("rule", ["sd", "fsd"])
def test_sd_emits_target_distribution(fops, rule):
    rows, vocab = 200_000, 24
    g = torch.Generator(device="cuda").manual_seed(0)
    target_row = torch.randn(vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5
    draft_row = target_row + torch.randn(vocab, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p, q = target_row.softmax(-1), draft_row.softmax(-1)
    target = target_row.float().cuda().expand(rows, 2, vocab).contiguous()
    draft = draft_row.float().cuda().expand(rows, 1, vocab).contiguous()
    tokens = torch.multinomial(q.float().cuda(), rows, replacement=True, generator=g)[:, None]  # [rows, 1]
    # fsd with threshold 0 is exactly sd.
    res = fops.accept(target, draft, tokens, rule=rule, threshold=0.0, seed=123)
    counts = torch.bincount(res.tokens[:, 0], minlength=vocab).double().cpu()
    assert chi_square_pvalue(counts, p) > 1e-4
    # Acceptance rate of sd is sum(min(p, q)).
    rate = (res.num_accepted == 1).double().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 5 * math.sqrt(0.25 / rows)


def test_fsd_under_threshold_emits_draft_distribution(fops):
    rows, vocab = 100_000, 16
    target_row = torch.randn(vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    draft_row = target_row + 0.3 * torch.randn(vocab, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    q = draft_row.softmax(-1)
    target = target_row.float().cuda().expand(rows, 2, vocab).contiguous()
    draft = draft_row.float().cuda().expand(rows, 1, vocab).contiguous()
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens = torch.multinomial(q.float().cuda(), rows, replacement=True, generator=g)[:, None]
    res = fops.accept(target, draft, tokens, rule="fsd_strict", threshold=10.0, seed=9)
    assert bool((res.num_accepted == 1).all())
    counts = torch.bincount(res.tokens[:, 0], minlength=vocab).double().cpu()
    assert chi_square_pvalue(counts, q) > 1e-4


# ----------------------------------------------------------------------------------------------
# CUDA graphs and host synchronisation.

def test_graph_capture_and_replay_fresh_randomness(fops):
    check_graph_replay(fops, batch=32, vocab=4096)


def check_graph_replay(fops, batch, vocab):
    """accept captured once in a CUDA graph: replays with a device offset bumped in between draw
    fresh tokens and match eager calls."""
    target, draft, tokens, _ = make_case(batch, 4, vocab, dtype=torch.bfloat16, seed=13, noise=2.0)
    target, draft, tokens = target.cuda(), draft.cuda(), tokens.cuda()
    seed = torch.tensor(77, dtype=torch.int64, device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    kw = dict(rule="fsd", threshold=0.1, temperature=1.0, return_divergence=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        fops.accept(target, draft, tokens, seed=seed, offset=offset, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fops.accept(target, draft, tokens, seed=seed, offset=offset, **kw)
    seen = []
    for step in range(4):
        offset.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        eager = fops.accept(target, draft, tokens, seed=77, offset=step, **kw)
        assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.num_accepted, eager.num_accepted)
        seen.append(static.tokens.clone())
    assert any(not torch.equal(seen[0], other) for other in seen[1:]), "replays drew the same numbers"


def test_no_host_sync(fops):
    target, draft, tokens, nd = make_case(16, 3, 2048, dtype=torch.float16, seed=14, num_draft=True)
    target, draft, tokens, nd = target.cuda(), draft.cuda(), tokens.cuda(), nd.cuda()
    seed = torch.tensor(5, dtype=torch.int64, device="cuda")
    offset = torch.tensor([1], dtype=torch.int64, device="cuda")
    thr = torch.full((16,), 0.2, device="cuda")
    fops.accept(target, draft, tokens, seed=seed, offset=offset, num_draft=nd)  # warm-up (allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fops.accept(target, draft, tokens, seed=seed, offset=offset, num_draft=nd, threshold=thr,
                    top_p=0.9, return_divergence=True)
        fops.sample(target[:, 0], temperature=0.7, seed=seed, offset=offset)
        fops.divergence(target[:, 0], draft[:, 0], "js")
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ----------------------------------------------------------------------------------------------
# The launch options (FSD_EXT_CUDA_LAUNCH, docs/cuda.md): the launcher's log, the opt-in paths.
# (The staged cluster path is gone: slower than the split path on the H200.)

@pytest.mark.parametrize("text,message", [
    ("splits=x", "splits wants a non-negative integer"), ("pdl=2", "pdl wants 0 or 1"),
    ("staged=1", "unknown option 'staged'"), ("cluster", "cluster wants 0 or 1"),
])
def test_launch_switch_rejects_bad_values(fops, monkeypatch, text, message):
    target, draft, tokens, _ = make_case(2, 3, 1000, seed=2)
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", text)
    with pytest.raises(RuntimeError, match=f"FSD_EXT_CUDA_LAUNCH='{text}': {message}"):
        fops.accept(target.cuda(), draft.cuda(), tokens.cuda(), seed=1)
    with pytest.raises(RuntimeError, match="FSD_EXT_CUDA_LAUNCH"):
        fops.sample(target[:, 0].cuda(), seed=1)


def launch_log(fops, capfd, *args, **kwargs):
    """The CUDA launcher's log line (launch option log=1) of one accept call."""
    return logged_call(capfd, "accept", lambda: fops.accept(*args, **kwargs))[1]


def accept_path(fops, capfd, *args, **kwargs):
    """The path the CUDA launcher took for one accept call."""
    return launch_log(fops, capfd, *args, **kwargs).split("path=")[1].split()[0]


def check_opt_in_path(fops, monkeypatch, capfd, switch, opt_in_path, dtype, vocab, batch, path):
    """With the launch option `switch` on, a call of this shape takes `path`; never `opt_in_path`
    with a filter (it needs whole-row selections) or with the option off."""
    target, draft, tokens, _ = make_case(batch, 5, vocab, dtype=dtype, seed=30)
    target, draft, tokens = target.cuda(), draft.cuda(), tokens.cuda()
    assert accept_path(fops, capfd, target, draft, tokens, rule="fsd", seed=1) == path
    assert accept_path(fops, capfd, target, draft, tokens, rule="fsd", seed=1, top_p=0.9) != opt_in_path
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"{switch}=0")
    assert accept_path(fops, capfd, target, draft, tokens, rule="fsd", seed=1) != opt_in_path


# Cases of the cluster path: clusters of 8 (as at B=64), of up to 16 (B=1), ragged K with V_d < V_t
# and a NaN row, a small vocabulary (clusters of 2).
CLUSTER_CASES = {
    "b16_v128256_bf16": (16, 128256, 128256, torch.bfloat16),
    "b1_v151936_bf16": (1, 151936, 151936, torch.bfloat16),
    "ragged_v32001_f32": (12, 32001, 32000, torch.float32),
    "small_v4099_f16": (40, 4099, 3001, torch.float16),
}


def check_cluster_case(fops, rule, case):
    """accept on one of CLUSTER_CASES against the reference (tokens, divergences, NaN row)."""
    batch, vocab, draft_vocab, dtype = CLUSTER_CASES[case]
    target, draft, tokens, nd = make_case(batch, 5, vocab, draft_vocab, dtype=dtype, seed=31, num_draft=batch > 1)
    if batch > 4:
        target[3, 1, 77] = float("nan")  # a NaN row
        nd[3] = 5
    kw = dict(rule=rule, divergence="js", threshold=0.3, temperature=0.9, seed=17, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement(cuda, ref) >= (0.97 if batch >= 40 else 1.0)
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    if batch > 4:
        assert not bool(cuda.valid[3])
    assert int(cuda.tokens.max()) < vocab
    if rule in ("sd", "fsd"):  # without divergences: coin-accepted positions skip pass 2
        kw.pop("return_divergence")
        cuda, ref = run_accept(fops, "cuda", target, draft, tokens, **kw), reference.accept(target, draft, tokens, **kw)
        assert agreement(cuda, ref) >= (0.97 if batch >= 40 else 1.0)


# ----------------------------------------------------------------------------------------------
# The cluster path (FSD_EXT_CUDA_LAUNCH=cluster=1, sm_90+): the split path's chunks in one launch
# of thread-block clusters, a cluster barrier between the phases instead of a second launch, pass 2
# re-reading its chunk from L2.

def sm90_switch(monkeypatch, switch, what):
    """Turns the opt-in launch option `switch` on (FSD_EXT_CUDA_LAUNCH) on sm_90+; skips `what`
    elsewhere."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(f"{what} needs sm_90+")
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"{switch}=1")
    return monkeypatch


@pytest.fixture
def clustered(monkeypatch):
    return sm90_switch(monkeypatch, "cluster", "the cluster path (thread-block clusters)")


@pytest.mark.parametrize("dtype,vocab,batch,path", [
    (torch.bfloat16, 151936, 1, "cluster"), (torch.bfloat16, 128256, 64, "cluster"),
    (torch.float32, 32001, 8, "cluster"), (torch.float16, 1000, 3, "fused"),  # one chunk: nothing to cluster
])
def test_cluster_path_is_taken(fops, clustered, capfd, dtype, vocab, batch, path):
    check_opt_in_path(fops, clustered, capfd, "cluster", "cluster", dtype, vocab, batch, path)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", list(CLUSTER_CASES))
def test_cluster_path_agrees_with_reference(fops, clustered, rule, case):
    check_cluster_case(fops, rule, case)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cluster_split_vocab_case_matches_reference(fops, clustered, rule, dtype):
    test_split_vocab_path_matches_reference(fops, rule, dtype)


def test_cluster_graph_capture_and_replay(fops, clustered):
    check_graph_replay(fops, batch=3, vocab=50001)


# ----------------------------------------------------------------------------------------------
# Programmatic dependent launch (FSD_EXT_CUDA_LAUNCH=pdl=1, sm_90+): the split path's second kernel is
# launched while the first still runs and waits for it on the GPU. It changes when blocks start,
# never what they compute: the same tokens as the reference, in and out of a CUDA graph.

def split_and_fused_launch_logs(fops, capfd):
    """The launcher's log lines of a call that takes the split path (B=2, K=5, V=151936) and of one
    with a single chunk per position (one fused launch), for the split path's options."""
    def log(case):
        target, draft, tokens, _ = case
        return launch_log(fops, capfd, target.cuda(), draft.cuda(), tokens.cuda(), seed=1)
    return log(make_case(2, 5, 151936, dtype=torch.bfloat16, seed=6)), log(make_case(4, 3, 1000, seed=2))


@pytest.fixture
def pdl(monkeypatch):
    return sm90_switch(monkeypatch, "pdl", "programmatic dependent launch")


def test_pdl_only_on_the_split_path(fops, pdl, capfd):
    split, fused = split_and_fused_launch_logs(fops, capfd)
    assert "path=split" in split and "pdl=1" in split and "pdl=0" in fused
    pdl.setenv("FSD_EXT_CUDA_LAUNCH", "pdl=0")
    assert "pdl=0" in split_and_fused_launch_logs(fops, capfd)[0]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pdl_split_path_matches_reference(fops, pdl, rule, dtype):
    test_split_vocab_path_matches_reference(fops, rule, dtype)


def test_pdl_big_vocab_and_many_chunks(fops, pdl):
    test_accept_big_vocab_split_path(fops, 151936)
    pdl.setenv("FSD_EXT_CUDA_LAUNCH", "pdl=1,splits=64")  # many blocks per row: kernel 2 launches during kernel 1
    test_accept_big_vocab_split_path(fops, 262144)


def test_pdl_graph_capture_and_replay(fops, pdl):
    check_graph_replay(fops, batch=3, vocab=50001)  # the split path


# ----------------------------------------------------------------------------------------------
# FSD_EXT_CUDA_LAUNCH=reverse=1: the split path's second kernel takes its (row, position, chunk)
# items in reverse order (for L2 hits on its re-reads). It changes which block does which item,
# never what an item computes: the same tokens as the reference, in and out of a CUDA graph.

@pytest.fixture
def reverse_decide(monkeypatch):
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", "reverse=1")
    return monkeypatch


def test_reverse_decide_only_on_the_split_path(fops, reverse_decide, capfd):
    split, fused = split_and_fused_launch_logs(fops, capfd)
    assert "path=split" in split and "reverse=1" in split and "reverse=0" in fused


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_decide_matches_reference(fops, reverse_decide, rule, dtype):
    test_split_vocab_path_matches_reference(fops, rule, dtype)


def test_reverse_decide_big_vocab_and_graph_replay(fops, reverse_decide):
    test_accept_big_vocab_split_path(fops, 151936)
    check_graph_replay(fops, batch=3, vocab=50001)


# ----------------------------------------------------------------------------------------------
# The decoding loop on CUDA: captured graphs give the same tokens as eager forwards.

def tiny_cuda_llama(seed, layers):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    model.lm_head.weight.data *= 8.0  # peaky next-token distributions, as real models have
    return model.cuda()


def left_padded_prompts(lengths, seed=3):
    """CUDA (input_ids, attention_mask) [B, max(lengths)] of random left-padded prompts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length:] = torch.randint(3, 256, (length,), generator=gen)
        mask[row, ids.shape[1] - length:] = 1
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("rule,temperature", [("ar", 0.0), ("greedy", 0.0), ("sd", 0.0), ("sd", 1.0),
                                              ("fsd", 0.8)])
def test_generate_cuda_graphs_match_eager(fops, rule, temperature):
    import fsd_ext

    target, draft = tiny_cuda_llama(0, 2), tiny_cuda_llama(1, 1)
    ids, mask = left_padded_prompts([4, 11, 1])
    kwargs = dict(rule=rule, temperature=temperature, threshold=0.3, num_draft_tokens=4, max_new_tokens=20,
                  seed=torch.tensor([5, 6, 7]))
    eager = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=False, **kwargs)
    graphed = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    if temperature == 0.0:
        expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
        assert graphed.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("rule", ["ar", "greedy", "fsd"])
def test_generate_cuda_graphs_park_stopped_rows(fops, monkeypatch, rule):
    """Rows stopping at different steps (many EOS ids): real captures happen only for the first
    batch size and powers of two (stopped rows wait parked, outputs discarded, lengths frozen), and
    tokens and counts equal the eager run, which drops stopped rows at once. Greedy decoding
    (fsd: the divergence test, with drafts accepted, so the draft re-reads tokens too): the eager
    and graphed batches differ in size, and sampled tokens could differ by float rounding."""
    import importlib

    import fsd_ext

    generate_module = importlib.import_module("fsd_ext.generate")
    eager_sizes, captured = [], []  # batch size of every eager forward / of every capture
    from fsd_ext import cuda_graphs

    real_forward, real_init = generate_module._CachedModel._forward, cuda_graphs.CapturedForward.__init__

    def counting_forward(self, input_ids, keep):
        if not self.use_graphs:
            eager_sizes.append(input_ids.shape[0])
        return real_forward(self, input_ids, keep)

    def counting_init(self, forward, input_ids, keep, pool=None):
        captured.append(input_ids.shape[0])
        real_init(self, forward, input_ids, keep, pool)

    monkeypatch.setattr(generate_module._CachedModel, "_forward", counting_forward)
    monkeypatch.setattr(cuda_graphs.CapturedForward, "__init__", counting_init)
    target, draft = tiny_cuda_llama(0, 2), tiny_cuda_llama(1, 1)
    ids, mask = left_padded_prompts([4, 11, 1, 7, 9, 3], seed=4)
    kwargs = dict(rule=rule, temperature=0.0, threshold=0.3, num_draft_tokens=4, max_new_tokens=30,
                  seed=torch.arange(6), eos_token_id=list(range(3, 256, 9)))
    eager = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=False, **kwargs)
    allowed = {6, 4, 2, 1}
    assert set(eager_sizes) - allowed, f"no row stopped at a size a graph run parks: {set(eager_sizes)}"
    graphed = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    for name in ("new_tokens", "verifications", "accepted_drafts", "accepted_histogram",
                 "target_forwards", "draft_forwards"):
        assert getattr(graphed.stats, name) == getattr(eager.stats, name), name
    assert set(captured) <= allowed and len(set(captured)) > 1, captured


def test_generate_cuda_graphs_reused_by_the_next_call(fops, monkeypatch):
    """A second call that fits replays the first call's graphs (real ones): no capture, the same
    tokens as eager; fewer rows replay the graphs captured for the smaller sizes."""
    import fsd_ext
    from fsd_ext import cuda_graphs

    captured = []
    real_init = cuda_graphs.CapturedForward.__init__

    def counting_init(self, forward, input_ids, keep, pool=None):
        captured.append(tuple(input_ids.shape))
        real_init(self, forward, input_ids, keep, pool)

    monkeypatch.setattr(cuda_graphs.CapturedForward, "__init__", counting_init)
    target, draft = tiny_cuda_llama(0, 2), tiny_cuda_llama(1, 1)
    ids, mask = left_padded_prompts([4, 11, 1, 7], seed=5)
    kwargs = dict(rule="fsd", temperature=0.0, threshold=0.3, num_draft_tokens=4, max_new_tokens=24,
                  seed=0, eos_token_id=list(range(3, 256, 9)))
    eager = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=False, **kwargs)
    first = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert first.sequences.tolist() == eager.sequences.tolist() and captured
    captured.clear()
    second = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert second.sequences.tolist() == eager.sequences.tolist()
    assert captured == [] and second.stats.capture_seconds == 0.0
    fewer = fsd_ext.generate(target, draft, ids[2:], mask[2:], use_cuda_graphs=True, **kwargs)
    eager_fewer = fsd_ext.generate(target, draft, ids[2:], mask[2:], use_cuda_graphs=False, **kwargs)
    assert fewer.sequences.tolist() == eager_fewer.sequences.tolist()
    cuda_graphs.release_cuda_graphs()
