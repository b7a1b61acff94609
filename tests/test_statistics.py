"""Distribution tests of what the kernel emits (docs/design.md section 2.5, "What the rules guarantee").

Each test runs one verification step on N = 100,000 rows that share the same small-vocabulary p
and q (rows differ only in their random streams), drafts d ~ q, and compares the histogram of the
emitted token with the distribution the rule promises, by a chi-square test. Seeds are fixed, so
the tests are deterministic; with 1e5 draws a bias of a fraction of a percent in any token's
probability fails. The negative controls feed the same check a deliberately wrong emission and
must fail, which shows the check has the power to catch a real bug.
"""

import pytest
import torch

import fsd_ext
from helpers import chi_square_pvalue

N = 100_000
P_VALUE_FLOOR = 1e-4  # a correct sampler fails this once in 10,000 seeds; a biased one always

TARGET = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
DRAFT = torch.tensor([0.5, 2.0, 0.3, 1.0, -0.5, 0.0])  # no ties: top-k keeps ties


def p_and_q(temperature=1.0):
    return (TARGET / temperature).softmax(-1).double(), (DRAFT / temperature).softmax(-1).double()


def problem(k=1, seed=0, temperature=1.0):
    """Logits [N, K+1, V] / [N, K, V] equal in every row, and drafts d ~ q per row."""
    target = TARGET.expand(N, k + 1, -1).contiguous()
    draft = DRAFT.expand(N, k, -1).contiguous()
    gen = torch.Generator().manual_seed(seed)
    q = (DRAFT / temperature).softmax(-1)
    tokens = torch.multinomial(q.expand(N * k, -1), 1, replacement=True, generator=gen).reshape(N, k)
    return target, draft, tokens


def chi_square_p(samples, probs):
    return chi_square_pvalue(torch.bincount(samples, minlength=len(probs)), probs)


def assert_follows(samples, probs):
    assert (samples >= 0).all() and (samples < len(probs)).all()
    p_value = chi_square_p(samples, probs)
    assert p_value > P_VALUE_FLOOR, f"emitted tokens do not follow the distribution (p={p_value:.2e})"


def assert_does_not_follow(samples, probs):
    assert chi_square_p(samples, probs) < 1e-12


def divergence_pq(kind):
    return fsd_ext.divergence(TARGET[None], DRAFT[None], kind=kind).item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sd_emits_target_distribution(temperature):
    target, draft, tokens = problem(seed=1, temperature=temperature)
    res = fsd_ext.accept(target, draft, tokens, rule="sd", temperature=temperature, seed=123)
    p, q = p_and_q(temperature)
    assert_follows(res.tokens[:, 0], p)
    assert 0.2 < res.num_accepted.double().mean() < 0.9  # both branches are exercised


def test_sd_negative_control_wrong_residual_is_detected():
    """Replace every correction with a sample of p instead of the residual: the emitted tokens
    then follow min(p, q) + (1 - sum min(p, q)) p, not p, and the same check must fail."""
    target, draft, tokens = problem(seed=2)
    res = fsd_ext.accept(target, draft, tokens, rule="sd", seed=321)
    p, _ = p_and_q()
    gen = torch.Generator().manual_seed(5)
    wrong = torch.multinomial(p.float().expand(N, -1), 1, generator=gen)[:, 0]
    emitted = torch.where(res.num_accepted == 1, res.tokens[:, 0], wrong)
    assert_does_not_follow(emitted, p)


def test_sd_negative_control_drafts_not_from_q_is_detected():
    """SD's guarantee needs d ~ q; uniform drafts break it, and the check sees it."""
    target, draft, _ = problem(seed=3)
    gen = torch.Generator().manual_seed(6)
    uniform_tokens = torch.randint(0, 6, (N, 1), generator=gen)
    res = fsd_ext.accept(target, draft, uniform_tokens, rule="sd", seed=7)
    assert_does_not_follow(res.tokens[:, 0], p_and_q()[0])


def test_sd_with_filters_emits_filtered_target():
    target, draft, tokens = problem(seed=4)
    q_filtered = torch.zeros(6, dtype=torch.float64)
    keep_q = DRAFT.topk(3).indices
    q_filtered[keep_q] = DRAFT[keep_q].softmax(-1).double()
    gen = torch.Generator().manual_seed(8)
    tokens = torch.multinomial(q_filtered.float().expand(N, -1), 1, generator=gen)
    res = fsd_ext.accept(target, draft, tokens, rule="sd", top_k=3, seed=9)
    p_filtered = torch.zeros(6, dtype=torch.float64)
    keep_p = TARGET.topk(3).indices
    p_filtered[keep_p] = TARGET[keep_p].softmax(-1).double()
    emitted = res.tokens[:, 0]
    assert set(emitted.unique().tolist()) <= set(keep_p.tolist())
    assert_follows(emitted, p_filtered.clamp_min(1e-300))


@pytest.mark.parametrize("rule", ["fsd", "fsd_strict"])
@pytest.mark.parametrize("kind", ["js", "rkl", "tv"])
def test_fsd_follows_q_below_threshold_and_p_above(rule, kind):
    target, draft, tokens = problem(seed=10)
    p, q = p_and_q()
    d = divergence_pq(kind)
    below = fsd_ext.accept(target, draft, tokens, rule=rule, divergence=kind, threshold=d * 1.5, seed=11)
    assert_follows(below.tokens[:, 0], q)
    assert (below.num_accepted == 1).all()
    above = fsd_ext.accept(target, draft, tokens, rule=rule, divergence=kind, threshold=d * 0.5, seed=12)
    assert_follows(above.tokens[:, 0], p)
    if rule == "fsd_strict":
        assert (above.num_accepted == 0).all()


def test_bonus_tokens_follow_p_k():
    target, draft, tokens = problem(k=1, seed=13)
    target = target.clone()
    target[:, 1] = torch.tensor([0.0, -2.0, 1.0, 3.0, 0.5, -0.5])  # a different p_K
    res = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=1e9, seed=14)
    assert (res.num_accepted == 1).all()
    assert_follows(res.tokens[:, 1], target[0, 1].softmax(-1).double())
    # Under sd, the rows that accepted everything draw their bonus from p_K as well.
    sd = fsd_ext.accept(target, draft, tokens, rule="sd", seed=15)
    full = sd.num_accepted == 1
    assert_follows(sd.tokens[full, 1], target[0, 1].softmax(-1).double())


@pytest.mark.parametrize("temperature,filters", [(1.0, {}), (0.5, {}), (1.0, dict(top_p=0.75))])
def test_sample_op_follows_softmax(temperature, filters):
    logits = TARGET.expand(N, -1).contiguous()
    tokens = fsd_ext.sample(logits, temperature=temperature, seed=16, **filters)
    probs = (TARGET / temperature).softmax(-1).double()
    if filters:
        order = probs.argsort(descending=True)
        cumulative = probs[order].cumsum(0)
        keep = order[: int((cumulative < filters["top_p"]).sum()) + 1]
        filtered = torch.full_like(probs, 1e-300)
        filtered[keep] = probs[keep] / probs[keep].sum()
        probs = filtered
    assert_follows(tokens, probs)
