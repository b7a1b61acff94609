"""The fused CPU kernel against the pure-torch reference: same tokens and counts from the same seed
(so the same Philox uniforms), divergences within 1e-5 relative, across shapes, dtypes, rules,
divergences, temperatures, filters, ragged K and smaller draft vocabularies.

The tests parametrized over `device` hold the CUDA kernels to the same exact checks (the Philox
streams, the divergence op, probabilities below float's range, astronomical gaps, tiny rest
buckets); on CUDA they carry the `cuda` marker and skip without a GPU. The CUDA kernels' other
tests: test_cuda.py and test_cuda_launch.py."""

import pytest
import torch

import fsd_ext
from fsd_ext import reference
from helpers import (DEVICES, DIVERGENCES, DTYPES, FILTER_ROW_SHAPES, RULES, agreement_up_to_ties,
                     assert_same_result, astronomical_gap_cases, below_float_range_cases, both, filter_rows,
                     float_weight_draws, make_case, make_problem, rows_agree, tiny_rest_cases)



@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_rules_and_divergences(rule, divergence):
    target, draft, tokens = make_problem(48, 4, 1000, seed=1)
    kernel, ref = both(target, draft, tokens, rule=rule, divergence=divergence, threshold=0.25,
                       seed=7, return_divergence=True)
    assert_same_result(kernel, ref)
    if rule in ("sd", "fsd"):  # the problem is built so that both outcomes occur
        assert 0 < kernel.num_accepted.sum() < 48 * 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,k,vocab", [(1, 0, 1), (3, 2, 1), (5, 3, 2), (9, 8, 7), (4, 5, 8193),
                                           (2, 4, 32000), (2, 3, 151936), (64, 1, 33)])
def test_shapes_and_dtypes(dtype, batch, k, vocab):
    target, draft, tokens = make_problem(batch, k, vocab, dtype=dtype, seed=vocab + k)
    for rule in ("sd", "fsd"):
        kernel, ref = both(target, draft, tokens, rule=rule, divergence="js", threshold=0.1, seed=3,
                           return_divergence=True)
        assert_same_result(kernel, ref)


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("rule", RULES)
def test_temperatures(temperature, rule):
    target, draft, tokens = make_problem(32, 3, 500, seed=11)
    kernel, ref = both(target, draft, tokens, rule=rule, divergence="kl", threshold=0.3,
                       temperature=temperature, seed=5, return_divergence=True)
    assert_same_result(kernel, ref)


def test_greedy_temperature_zero_emits_target_argmax():
    target, draft, tokens = make_problem(16, 3, 200, seed=2)
    tokens = draft.argmax(-1)  # greedy drafting
    res = fsd_ext.accept(target, draft, tokens, rule="sd", temperature=0.0, seed=0)
    argmax = target.argmax(-1)
    for b in range(16):
        n = int(res.num_accepted[b])
        assert torch.equal(res.tokens[b, :n], argmax[b, :n])
        assert res.tokens[b, n] == argmax[b, n]


@pytest.mark.parametrize("filters", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.05),
                                     dict(top_k=50, top_p=0.9, min_p=0.01), dict(top_k=1)])
@pytest.mark.parametrize("rule", ["sd", "fsd", "fsd_strict"])
def test_filters(filters, rule):
    target, draft, tokens = make_problem(32, 3, 300, seed=4, scale=3.0)
    kernel, ref = both(target, draft, tokens, rule=rule, divergence="js", threshold=0.2, seed=9,
                       return_divergence=True, **filters)
    assert_same_result(kernel, ref)


def test_filtered_tokens_are_never_emitted():
    target, draft, tokens = make_problem(64, 2, 100, seed=5, scale=3.0)
    res = fsd_ext.accept(target, draft, tokens, rule="sd", top_k=3, seed=1)
    top3 = target.topk(3, dim=-1).indices  # [B, K+1, 3]
    for b in range(64):
        n = int(res.num_accepted[b])
        assert res.tokens[b, n] in top3[b, n]


@pytest.mark.parametrize("rule", RULES)
def test_ragged_num_draft(rule):
    target, draft, tokens = make_problem(24, 5, 400, seed=6)
    num_draft = torch.arange(24) % 6  # 0..5
    target[num_draft == 2, 4] = float("nan")  # positions past num_draft are never read
    kernel, ref = both(target, draft, tokens, rule=rule, threshold=0.3, num_draft=num_draft, seed=2,
                       return_divergence=True)
    assert_same_result(kernel, ref)
    assert (kernel.num_accepted <= num_draft).all()
    assert kernel.valid.all()
    assert kernel.divergence[num_draft == 0].isnan().all()


@pytest.mark.parametrize("rule", RULES)
def test_draft_vocab_smaller_than_target(rule):
    target, draft, tokens = make_problem(32, 3, 520, draft_vocab=500, seed=8)
    target[..., 500:] += 4.0  # ids the draft cannot propose carry real target mass
    kernel, ref = both(target, draft, tokens, rule=rule, divergence="js", threshold=0.4, seed=4,
                       return_divergence=True)
    assert_same_result(kernel, ref)
    assert (kernel.tokens >= 500).any()  # corrections reach the target-only ids


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kl_family_infinite_when_draft_lacks_ids(divergence):
    target, draft, _ = make_problem(4, 1, 50, draft_vocab=40, seed=3)
    d = fsd_ext.divergence(target[:, 0], draft[:, 0], kind=divergence)
    r = reference.divergence(target[:, 0], draft[:, 0], kind=divergence)
    torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6)
    assert d.isinf().all() == (divergence in ("kl", "mkl"))


@pytest.mark.parametrize("masked", ["draft", "target"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_minus_inf_logits_inside_the_vocabulary(divergence, masked):
    """Ids masked to -inf inside a row (padding ids, constrained decoding) have probability 0 there,
    and the other side's mass at them still counts: JS adds p ln 2 / 2 per such id. Found by the
    CUDA simulation (csrc/fsd/tests/cuda_sim): the stored-exponential pass made p_j NaN at a -inf
    logit, which zeroed the JS / MKL term (JS 0.033 instead of 0.188 here)."""
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(3, 2, 29, generator=gen) * 1e-3
    draft = torch.randn(3, 1, 29, generator=gen) * 1e-3
    if masked == "draft":
        draft[..., 16:] = float("-inf")
    else:
        target[..., :13] = float("-inf")
    tokens = torch.tensor([[3], [5], [7]])
    for temperature in (0.3, 1.0):
        kernel, ref = both(target, draft, tokens, rule="fsd", divergence=divergence, threshold=0.3,
                           temperature=temperature, div_temperature=1.0, seed=2, return_divergence=True)
        assert_same_result(kernel, ref)
    d = fsd_ext.divergence(target[:, 0], draft[:, 0], kind=divergence)
    torch.testing.assert_close(d, reference.divergence(target[:, 0], draft[:, 0], kind=divergence),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("div_top_k", [None, 3])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_probabilities_below_float_range_against_zero(divergence, div_top_k, dtype, device):
    """A probability 0 by construction against one below float's range but > 0 in float64 makes
    KL / RKL / MKL +inf, as the reference has it, by fsd_ext.divergence and by accept (on CUDA the
    plain, general and div_top_k paths of pass 2; found by the CUDA simulation)."""
    for name, target, draft, infinite in below_float_range_cases(dtype):
        d = fsd_ext.divergence(target[:, 0].to(device), draft[:, 0].to(device), kind=divergence,
                               top_k=div_top_k).cpu()
        r = reference.divergence(target[:, 0], draft[:, 0], kind=divergence, top_k=div_top_k)
        torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6, msg=name)
        assert d.isinf().all() == (divergence in infinite[div_top_k]), (name, d)
        kernel, ref = both(target, draft, torch.zeros(2, 1, dtype=torch.long), device=device, rule="fsd",
                           divergence=divergence, threshold=0.4, div_top_k=div_top_k, temperature=0.0, seed=5,
                           return_divergence=True)
        assert_same_result(kernel, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_log_below_bound_is_zero_by_construction(divergence, dtype, device):
    """A log-probability below about -1.02e20 (a +inf logit's neighbours, or a gap as wide) is 0 by
    construction in both kernels and the reference, at every temperature that puts it there; a
    gap of 1e19 at temperature 1 stays finite. By fsd_ext.divergence and by accept, sampling at
    temperature 1, at the divergence's temperature and greedy (on CUDA: log2 units on the plain
    path, nats on the general one)."""
    for name, target, draft, temperatures, infinite in astronomical_gap_cases(dtype):
        tokens = torch.zeros(target.shape[0], 1, dtype=torch.long)
        for temperature in temperatures:
            label = f"{name}, temperature {temperature}"
            d = fsd_ext.divergence(target[:, 0].to(device), draft[:, 0].to(device), kind=divergence,
                                   temperature=temperature).cpu()
            r = reference.divergence(target[:, 0], draft[:, 0], kind=divergence, temperature=temperature)
            torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6, msg=label)
            assert bool(d.isinf().all()) == (divergence in infinite) and not d.isnan().any(), (label, d)
            for sampling_temperature in dict.fromkeys((1.0, temperature, 0.0)):
                kernel, ref = both(target, draft, tokens, device=device, rule="fsd", divergence=divergence,
                                   threshold=0.4, div_temperature=temperature, temperature=sampling_temperature,
                                   seed=5, return_divergence=True)
                assert_same_result(kernel, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_rest_bucket_below_float_range_keeps_its_log(divergence, dtype, device):
    """div_top_k's rest bucket with a mass below float's range under p: the divergence as the
    reference has it (RKL / MKL depend on the rest's log; CUDA redoes it as a log-sum-exp,
    exact_tiny_rests), by fsd_ext.divergence and by accept."""
    for name, target, draft, top_k, temperature in tiny_rest_cases(dtype):
        d = fsd_ext.divergence(target[:, 0].to(device), draft[:, 0].to(device), kind=divergence,
                               temperature=temperature, top_k=top_k).cpu()
        r = reference.divergence(target[:, 0], draft[:, 0], kind=divergence, temperature=temperature, top_k=top_k)
        torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6, msg=name)
        tokens = torch.zeros(target.shape[0], 1, dtype=torch.long)
        kernel, ref = both(target, draft, tokens, device=device, rule="fsd", divergence=divergence,
                           threshold=10.0, div_top_k=top_k, div_temperature=temperature, temperature=0.0,
                           seed=5, return_divergence=True)
        assert_same_result(kernel, ref)


def test_per_row_threshold_temperature_and_div_options():
    target, draft, tokens = make_problem(16, 4, 700, seed=12)
    threshold = torch.linspace(0.0, 0.6, 16)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5] * 4)
    for div_temperature in (None, 1.0, torch.full((16,), 0.7)):
        for div_top_k in (None, 10):
            kernel, ref = both(target, draft, tokens, rule="fsd", divergence="js", threshold=threshold,
                               temperature=temperature, div_temperature=div_temperature,
                               div_top_k=div_top_k, seed=torch.arange(16), return_divergence=True)
            assert_same_result(kernel, ref)


def test_div_top_k_buckets():
    target, draft, _ = make_problem(8, 1, 1000, seed=13)
    for k in (1, 5, 999, 5000):
        for kind in DIVERGENCES:
            d = fsd_ext.divergence(target[:, 0], draft[:, 0], kind=kind, top_k=k)
            r = reference.divergence(target[:, 0], draft[:, 0], kind=kind, top_k=k)
            torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6)


def test_div_top_k_ties_filters_and_a_smaller_draft_vocab():
    """The k bucket ids: lowest ids on ties at the k-th value; a filtered p with fewer than k kept
    ids (the rest of the k are -inf ids, lowest first); top ids the draft cannot propose."""
    gen = torch.Generator().manual_seed(14)
    tied = torch.randint(0, 5, (8, 1, 3001), generator=gen).float()  # ~600 ids at each value
    draft = torch.randn(8, 1, 3001, generator=gen)
    for k in (1, 3, 50, 700, 2000):
        for kind in DIVERGENCES:
            d = fsd_ext.divergence(tied[:, 0], draft[:, 0], kind=kind, top_k=k)
            r = reference.divergence(tied[:, 0], draft[:, 0], kind=kind, top_k=k)
            torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6)
    target, draft, tokens = make_problem(16, 3, 900, draft_vocab=870, seed=15)
    target[..., 870:] += 3.0  # the most probable target ids lie beyond the draft vocabulary
    for temperature in (0.0, 0.8):
        kernel, ref = both(target, draft, tokens, rule="fsd", divergence="js", threshold=0.3, top_k=5,
                           temperature=temperature, div_temperature=None, div_top_k=20, seed=3,
                           return_divergence=True)
        assert_same_result(kernel, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_divergence_op(dtype, kind, device):
    gen = torch.Generator().manual_seed(0)
    target = (torch.randn(3, 5, 4099, generator=gen) * 2).to(dtype)
    draft = (torch.randn(3, 5, 4099, generator=gen) * 2).to(dtype)
    for temperature in (0.5, 1.0, 3.0):
        d = fsd_ext.divergence(target.to(device), draft.to(device), kind=kind, temperature=temperature)
        assert d.shape == (3, 5) and d.dtype == torch.float32 and d.device.type == device
        torch.testing.assert_close(d.cpu(), reference.divergence(target, draft, kind=kind, temperature=temperature),
                                   rtol=1e-5, atol=1e-6)
    # A smaller draft vocabulary, with and without div_top_k.
    target, draft, _, _ = make_case(64, 1, 5000, 4000, dtype=dtype, seed=10)
    for top_k in (None, 5):
        got = fsd_ext.divergence(target[:, 0].to(device), draft[:, 0].to(device), kind, 0.8, top_k).cpu()
        want = reference.divergence(target[:, 0], draft[:, 0], kind, 0.8, top_k)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_divergence_accuracy_at_a_real_vocabulary():
    """Against a float64 reference at V = 151936: the float kernel's error must stay at the level of
    its accumulation (a few 1e-8 for the mixture divergences), which is what the stored-exponential
    pass must keep (p_j consistent with the rounded log p_j; without that JS is off by ~1.5e-7)."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(16, 151936, generator=gen) * 3
    draft = target + torch.randn(16, 151936, generator=gen)
    atol = {"js": 1e-7, "mkl": 1e-7, "tv": 1e-7, "kl": 1.5e-6, "rkl": 1.5e-6}
    for kind, tol in atol.items():
        ours = fsd_ext.divergence(target, draft, kind=kind).double()
        exact = reference.divergence(target.double(), draft.double(), kind=kind)
        assert (ours - exact).abs().max().item() < tol, kind


def test_divergence_of_identical_distributions_is_zero():
    logits = torch.randn(4, 32000)
    for kind in DIVERGENCES:
        assert fsd_ext.divergence(logits, logits.clone(), kind=kind).abs().max() < 1e-6


def test_divergence_values_by_hand():
    # p = (1/2, 1/2), q = (1/4, 3/4): closed forms.
    import math
    target = torch.log(torch.tensor([[0.5, 0.5]]))
    draft = torch.log(torch.tensor([[0.25, 0.75]]))
    m = [0.375, 0.625]
    expected = {
        "kl": 0.5 * math.log(2) + 0.5 * math.log(2 / 3),
        "rkl": 0.25 * math.log(0.5) + 0.75 * math.log(1.5),
        "tv": 0.25,
        "js": 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
        + 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])),
        "mkl": 0.5 * (m[0] * math.log(m[0] / 0.5) + m[1] * math.log(m[1] / 0.5))
        + 0.5 * (m[0] * math.log(m[0] / 0.25) + m[1] * math.log(m[1] / 0.75)),
    }
    for kind, value in expected.items():
        assert fsd_ext.divergence(target, draft, kind=kind).item() == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize("filters", [dict(), dict(top_k=4), dict(top_p=0.7), dict(min_p=0.1)])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sample_op_matches_reference(filters, temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 3, 1001, generator=gen) * 2
    for seed in (0, torch.arange(16)):
        tokens = fsd_ext.sample(logits, temperature=temperature, seed=seed, offset=3, **filters)
        expected = reference.sample(logits, temperature=temperature, seed=seed, offset=3, **filters)
        assert torch.equal(tokens, expected)
    assert fsd_ext.sample(logits[0, 0], seed=0).shape == ()
    assert fsd_ext.sample(logits[:, 0], seed=0).shape == (16,)


@pytest.mark.parametrize("shape", FILTER_ROW_SHAPES)
@pytest.mark.parametrize("filters", [dict(top_k=50), dict(top_k=1500), dict(top_p=0.5), dict(top_p=0.95),
                                     dict(top_k=1500, top_p=0.9), dict(top_k=200, top_p=0.99, min_p=0.001)])
def test_filter_cutoffs_of_short_and_long_walks(shape, filters):
    """Filters whose cutoff lies among the largest few values (one selection pass) or deep in the
    row (the bucket walk) sample as the reference does (bfloat16: ties everywhere); the C++ test
    checks the cutoffs themselves."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = filter_rows(shape, 16, 6007).to(dtype)
        for seed in range(3):
            seeds = torch.arange(16) + 100 * seed
            tokens = fsd_ext.sample(logits, temperature=0.8, seed=seeds, **filters)
            assert torch.equal(tokens, reference.sample(logits, temperature=0.8, seed=seeds, **filters))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("purpose", ["accept", "sample", "draft"])
def test_uniforms_match_reference(purpose, per_row, device):
    """fsd_ext.philox_uniforms is the reference's Philox stream for each purpose: one seed or one
    per row, as Python ints or device tensors, offsets past 2**32."""
    code = {"accept": 1, "sample": 2, "draft": 3}[purpose]
    rows, positions = 37, 9
    seed = torch.arange(rows, dtype=torch.int64) * 7919 - 5 if per_row else 1234
    offset = torch.tensor([2**33 + 5], dtype=torch.int64)
    got = fsd_ext.philox_uniforms(seed.to(device) if per_row else torch.tensor(seed, device=device),
                                  offset.to(device), rows, positions, purpose)
    assert torch.equal(got.cpu(), reference.philox_uniforms(seed, int(offset), rows, positions, code))
    if per_row:
        seeds = torch.tensor([3, 1, 4], dtype=torch.int64)
        assert torch.equal(fsd_ext.philox_uniforms(seeds.to(device), 0, 3, 2, purpose).cpu(),
                           reference.philox_uniforms(seeds, 0, 3, 2, code))
        return
    for seed in (0, 1, -5, 2**62 + 3):
        u = fsd_ext.philox_uniforms(seed, 11, rows=5, positions=7, purpose=purpose, device=device).cpu()
        assert torch.equal(u, reference.philox_uniforms(seed, 11, 5, 7, code))
        assert (u >= 0).all() and (u < 1).all()


def test_fed_uniforms_reproduce_kernel_tokens():
    """The reference fed the kernel's uniforms (via the exposed generator op) agrees exactly."""
    target, draft, tokens = make_problem(20, 4, 600, seed=21)
    res = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=0.2, seed=99, offset=5)
    coins = fsd_ext.philox_uniforms(99, 5, 20, 4, "accept")
    samples = fsd_ext.philox_uniforms(99, 5, 20, 5, "sample")
    ref = reference.accept(target, draft, tokens, rule="fsd", threshold=0.2, coin_uniforms=coins,
                           sample_uniforms=samples)
    assert torch.equal(res.tokens, ref.tokens)


def test_agreement_up_to_ties_counts_rounding_ties_only():
    """The GPU tests' tie-aware comparison (helpers.agreement_up_to_ties). Bonus-only rows (K = 0)
    of two ids, p_0 just above the row's sampling uniform u (1e-6 relative) in rows 0-2: the
    reference emits id 0, and a kernel whose sums round the other way would emit id 1 (a tie).
    In rows 3-5 p_0 is far from u: id 1 there is a wrong answer."""
    batch, seed = 6, 7
    u = reference.philox_uniforms(seed, 0, batch, 1, 2)[:, 0]
    near = torch.arange(batch) < 3
    p0 = torch.where(near, u * (1 + 1e-6), torch.where(u < 0.5, u + 0.4, u - 0.4))
    target = torch.stack([p0, 1 - p0], -1).log().float()[:, None, :]  # [B, 1, 2]
    draft, tokens = torch.zeros(batch, 0, 2), torch.zeros(batch, 0, dtype=torch.int64)
    kw = dict(rule="sd", temperature=1.0, seed=seed)
    ref = reference.accept(target, draft, tokens, **kw)
    assert ref.tokens[:, 0].tolist() == (p0 <= u).long().tolist()  # id 0 where p_0 > u
    assert agreement_up_to_ties(ref, target, draft, tokens, **kw) == 1.0
    assert agreement_up_to_ties(fsd_ext.accept(target, draft, tokens, **kw), target, draft, tokens, **kw) == 1.0
    flipped = ref._replace(tokens=1 - ref.tokens)
    assert not bool(rows_agree(flipped, ref).any())
    assert agreement_up_to_ties(flipped, target, draft, tokens, **kw) == 0.5  # rows 0-2 only


def test_bonus_draws_at_a_large_vocabulary_follow_the_float_weights():
    """helpers.float_weight_draws, which the GPU tests hold the CUDA bonus draws to: K = 0 rows of
    151936 N(0, 1) logits (every id has weight), where a sum 1e-9 relative off moves about 1 draw
    in 1000. The CPU kernel sums its float weights in double (it added float lanes once, and was
    off in 1 of 1500 such rows in the simulation), so it makes these draws but where its
    exponential rounds a weight differently from torch's, far rarer (0 of 4 x 400 rows here, 0 of
    4500 in the simulation); another seed gives others."""
    rows, vocab, seed = 400, 151936, 12
    target = torch.randn(rows, 1, vocab, generator=torch.Generator().manual_seed(41))
    draft, tokens = torch.zeros(rows, 0, vocab), torch.zeros(rows, 0, dtype=torch.int64)
    got = fsd_ext.accept(target, draft, tokens, rule="sd", temperature=1.0, seed=seed, offset=2).tokens[:, 0]
    assert int((got != float_weight_draws(target[:, 0], seed, offset=2)).sum()) <= 1
    assert int((got != float_weight_draws(target[:, 0], seed + 1, offset=2)).sum()) > rows * 0.99


def test_strided_logits_are_read_in_place():
    target, draft, tokens = make_problem(6, 3, 257, seed=14)
    wide = torch.randn(6, 9, 257)
    wide[:, 2:6] = target  # a slice of a longer sequence of logits, as a model returns them
    kernel = fsd_ext.accept(wide[:, 2:6], draft, tokens, seed=1, return_divergence=True)
    ref = reference.accept(target, draft, tokens, seed=1, return_divergence=True)
    assert_same_result(kernel, ref)


def test_fsd_with_zero_threshold_is_sd_and_huge_threshold_accepts_all():
    target, draft, tokens = make_problem(40, 4, 300, seed=15)
    sd = fsd_ext.accept(target, draft, tokens, rule="sd", seed=3)
    fsd0 = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=0.0, seed=3)
    assert torch.equal(sd.tokens, fsd0.tokens)
    all_in = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=1e9, seed=3)
    assert (all_in.num_accepted == 4).all()
    assert torch.equal(all_in.tokens[:, :4], tokens)
    assert (fsd0.num_accepted <= all_in.num_accepted).all()


@pytest.mark.parametrize("div_temperature", [None, 1.0, 0.5])
def test_greedy_rule_divergences_without_sampling_stats(div_temperature):
    """The greedy rule skips the sampling sums; the divergences it returns must not use them."""
    target, draft, tokens = make_problem(6, 3, 2000, seed=16)
    kernel, ref = both(target, draft, tokens, rule="greedy", divergence="js", seed=1,
                       div_temperature=div_temperature, temperature=0.8, return_divergence=True)
    assert_same_result(kernel, ref)


def test_js_stays_finite_when_the_mixture_underflows():
    """Regression (found by the fuzzer): near-one-hot distributions at div_temperature 1e-6 made
    m = (p + q) / 2 underflow to 0 where p was subnormal, and log(0) turned JS into +inf."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(9, 8, 7, generator=gen) * 1e-3
    draft = torch.randn(9, 7, 7, generator=gen) * 1e-3
    tokens = torch.randint(0, 7, (9, 7), generator=gen)
    for div_top_k in (None, 3):
        kernel, ref = both(target, draft, tokens, rule="greedy", divergence="js", temperature=0.0,
                           div_temperature=1e-6, div_top_k=div_top_k, seed=0, return_divergence=True)
        assert_same_result(kernel, ref)
        assert (kernel.divergence <= 0.6931472).all()
    p = torch.tensor([[0.0, -744.5, -1e4]], dtype=torch.float64)  # exp(-744.5) is subnormal
    q = torch.tensor([[-1e4, 0.0, -744.5]], dtype=torch.float64)
    assert reference.divergence_from_logprobs(p.log_softmax(-1), q.log_softmax(-1), "js").isfinite().all()
