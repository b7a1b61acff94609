"""The lenient rules besides fsd (docs/design.md 2.5): each test as its source writes it, the
distribution each emits against its closed form, and its exact end.

The closed form, for one drafted position with d ~ q, a test c(x) that does not depend on the coin,
and the kernel's coin u ~ U[0, 1): a hybrid rule accepts x with probability a(x) = 1 where c(x)
holds, else min(1, p(x) / q(x)), and emits the residual norm(max(0, p - q)) on a rejection, so the
first token follows q a + (1 - sum q a) r; a strict rule accepts x iff c(x) and resamples from p.
Lenient SD's a(x) is min(1, p(x) / (l q(x))). The chi-square checks are those of
test_statistics.py, on N = 100,000 rows sharing one small-vocabulary p and q.
"""

import math

import pytest
import torch

import fsd_ext
from fsd_ext import reference
from fsd_ext.types import RULE_TABLE
from test_statistics import DRAFT, N, TARGET, assert_does_not_follow, assert_follows, p_and_q, problem

OTHER_LENIENT = tuple(r.name for r in RULE_TABLE if r.criterion not in (None, "divergence"))
DETERMINISTIC = tuple(r for r in OTHER_LENIENT if r != "lenient_sd")  # tests that read no coin
# A knob per rule at which the test holds for some drafts and not for others (TARGET / DRAFT).
# (Cascade's test reads the position, not x: at 1.3 it keeps every draft of this pair.)
KNOB = {"typical": 3.0, "typical_strict": 3.0, "lenient_sd": 0.7, "prob_floor": 2.0, "rank": 3.0,
        "rank_strict": 3.0, "cascade": 1.3}


def statistic_per_token(rule, temperature=1.0):
    """s(x) for each id x drafted at the one position of the TARGET / DRAFT pair: [V] float64."""
    vocab = TARGET.numel()
    res = reference.accept(TARGET.expand(vocab, 2, -1), DRAFT.expand(vocab, 1, -1),
                           torch.arange(vocab)[:, None], rule=rule, temperature=temperature,
                           threshold=0.0, return_divergence=True)
    return res.divergence[:, 0].double()


def source_test(rule, threshold):
    """c(x) for each id x as the rule's source states it, from p~ = q~ = softmax at temperature 1
    (the default div_temperature): [V] bool."""
    p, q = TARGET.double().softmax(-1), DRAFT.double().softmax(-1)
    criterion = fsd_ext.types.rule_spec(rule).criterion
    if criterion == "typical":  # Medusa 3.3.1: p(x) > min(eps, delta exp(-H(p))), delta = sqrt(eps)
        eps = 1.0 / threshold if threshold > 0 else math.inf
        entropy = -(p * p.log()).sum()
        return p > torch.clamp(math.sqrt(eps) * torch.exp(-entropy), max=eps)
    if criterion == "prob_floor":  # SGLang threshold_single t: p(x) >= t (strict here)
        return p > math.exp(-threshold)
    if criterion == "rank":  # x among the k most likely ids of p
        return torch.tensor([int((p > p[x]).sum()) < threshold for x in range(p.numel())])
    if criterion == "cascade":  # keep q (no deferral) when max q >= max p - alpha TV (strict here)
        alpha, tv = threshold - 1.0, 0.5 * (p - q).abs().sum()
        return torch.full_like(p, bool(q.max() > p.max() - alpha * tv), dtype=torch.bool)
    raise AssertionError(rule)


def closed_form(rule, threshold, temperature=1.0):
    """The distribution of the first emitted token, and the acceptance rate, under `rule`."""
    p, q = p_and_q(temperature)
    if rule == "lenient_sd":
        accept = (math.exp(threshold) * p / q).clamp(max=1.0)
    else:
        test = (statistic_per_token(rule, temperature) < threshold).double()
        accept = test if fsd_ext.types.rule_spec(rule).strict else torch.maximum(test, (p / q).clamp(max=1.0))
    rate = float((q * accept).sum())
    if fsd_ext.types.rule_spec(rule).strict:
        rejected = p
    else:
        residual = (p - q).clamp_min(0.0)
        rejected = residual / residual.sum() if residual.sum() > 1e-6 else p
    return q * accept + (1.0 - rate) * rejected, rate


@pytest.mark.parametrize("rule", DETERMINISTIC)
def test_statistic_is_the_source_test(rule):
    """s(x) < T is the criterion the rule's source writes, on a grid of knobs (the reparametrisation
    of each knob as T in types.RULE_TABLE, and the kernels' statistic in rules.h, agree with it)."""
    s = statistic_per_token(rule)
    for threshold in (0.0, 0.3, 0.7, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 11.0, 50.0):
        expected = source_test(rule, threshold)
        assert torch.equal(s < threshold, expected), (rule, threshold, s, expected)
    assert not (s < 0.0).any()  # T = 0: the test never holds


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("rule", OTHER_LENIENT)
def test_emits_its_closed_form(rule, temperature):
    threshold = KNOB[rule]
    expected, rate = closed_form(rule, threshold, temperature)
    sd_rate = closed_form("lenient_sd", 0.0, temperature)[1]
    assert abs(rate - sd_rate) > 0.02  # the knob changes something here
    target, draft, tokens = problem(seed=21, temperature=temperature)
    res = fsd_ext.accept(target, draft, tokens, rule=rule, threshold=threshold, temperature=temperature, seed=22)
    assert_follows(res.tokens[:, 0], expected)
    assert abs(res.num_accepted.double().mean() - rate) < 4 * math.sqrt(max(rate * (1 - rate), 0.0) / N) + 1e-6


@pytest.mark.parametrize("rule", OTHER_LENIENT)
def test_negative_control_sd_distribution_is_rejected(rule):
    """The same check, told the rule emits what SD does (p), must fail at the knob of the test above."""
    target, draft, tokens = problem(seed=23)
    res = fsd_ext.accept(target, draft, tokens, rule=rule, threshold=KNOB[rule], seed=24)
    assert_does_not_follow(res.tokens[:, 0], p_and_q()[0])


@pytest.mark.parametrize("rule", OTHER_LENIENT)
def test_exact_end_is_sd(rule):
    """T = 0: a hybrid rule is exact SD (the same tokens as rule sd from the same seed, so p in
    distribution); a strict one accepts nothing and samples p."""
    target, draft, tokens = problem(k=2, seed=25)
    res = fsd_ext.accept(target, draft, tokens, rule=rule, threshold=0.0, seed=26)
    if fsd_ext.types.rule_spec(rule).strict:
        assert (res.num_accepted == 0).all()
    else:
        sd = fsd_ext.accept(target, draft, tokens, rule="sd", seed=26)
        assert torch.equal(res.tokens, sd.tokens) and torch.equal(res.num_accepted, sd.num_accepted)
    assert_follows(res.tokens[:, 0], p_and_q()[0])


@pytest.mark.parametrize("rule", OTHER_LENIENT)
def test_div_top_k_is_refused(rule):
    target, draft, tokens = problem(seed=27)
    with pytest.raises(ValueError, match="div_top_k"):
        fsd_ext.accept(target[:4], draft[:4], tokens[:4], rule=rule, threshold=1.0, div_top_k=2)
