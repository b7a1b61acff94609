"""Determinism, batch invariance, edge cases and bad input."""

import pytest
import torch

import fsd_ext
from fsd_ext import reference
from helpers import make_problem


def test_same_seed_same_tokens_different_seed_differs():
    target, draft, tokens = make_problem(64, 4, 500, seed=1)
    a = fsd_ext.accept(target, draft, tokens, rule="sd", seed=5)
    b = fsd_ext.accept(target, draft, tokens, rule="sd", seed=5)
    c = fsd_ext.accept(target, draft, tokens, rule="sd", seed=6)
    d = fsd_ext.accept(target, draft, tokens, rule="sd", seed=5, offset=1)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert not torch.equal(a.tokens, d.tokens)


def test_seed_none_follows_torch_manual_seed_and_generator():
    target, draft, tokens = make_problem(32, 3, 300, seed=2)
    torch.manual_seed(0)
    a = fsd_ext.accept(target, draft, tokens, rule="sd")
    torch.manual_seed(0)
    b = fsd_ext.accept(target, draft, tokens, rule="sd")
    assert torch.equal(a.tokens, b.tokens)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(fsd_ext.accept(target, draft, tokens, rule="sd", generator=g1).tokens,
                       fsd_ext.accept(target, draft, tokens, rule="sd", generator=g2).tokens)


def test_batch_invariance_with_per_row_seeds():
    target, draft, tokens = make_problem(40, 4, 800, seed=3)
    seeds = torch.randint(0, 2**40, (40,), generator=torch.Generator().manual_seed(4))
    full = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=0.2, seed=seeds)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    permuted = fsd_ext.accept(target[order], draft[order], tokens[order], rule="fsd", threshold=0.2,
                              seed=seeds[order])
    assert torch.equal(permuted.tokens, full.tokens[order])
    for rows in (slice(0, 1), slice(7, 19), slice(39, 40)):
        part = fsd_ext.accept(target[rows], draft[rows], tokens[rows], rule="fsd", threshold=0.2,
                              seed=seeds[rows])
        assert torch.equal(part.tokens, full.tokens[rows])


def test_k_zero_samples_the_bonus_token():
    target, draft, tokens = make_problem(8, 0, 100, seed=6)
    res = fsd_ext.accept(target, draft, tokens, rule="sd", seed=1, return_divergence=True)
    assert res.tokens.shape == (8, 1) and res.divergence.shape == (8, 0)
    assert (res.num_accepted == 0).all() and (res.tokens >= 0).all()
    assert torch.equal(res.tokens, reference.accept(target, draft, tokens, rule="sd", seed=1).tokens)


def test_vocab_of_one():
    target, draft, tokens = make_problem(4, 3, 1, seed=7)
    for rule in ("greedy", "sd", "fsd", "fsd_strict"):
        res = fsd_ext.accept(target, draft, tokens, rule=rule, seed=0)
        assert (res.tokens == 0).all() and (res.num_accepted == 3).all()


@pytest.mark.parametrize("where", ["target", "draft", "bonus"])
@pytest.mark.parametrize("poison", ["nan", "all_neg_inf", "all_pos_inf"])
def test_bad_rows_are_invalid_and_emit_nothing(where, poison):
    target, draft, tokens = make_problem(6, 3, 50, seed=8)
    value = {"nan": float("nan"), "all_neg_inf": float("-inf"), "all_pos_inf": float("inf")}[poison]
    if where == "target":
        target[2, 1] = value if poison != "nan" else target[2, 1].index_fill(0, torch.tensor([7]), value)
    elif where == "draft":
        draft[2, 0] = value if poison != "nan" else draft[2, 0].index_fill(0, torch.tensor([0]), value)
    else:
        target[2, 3] = value
    res = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=0.1, seed=3, return_divergence=True)
    assert res.valid.tolist() == [True, True, False, True, True, True]
    assert (res.tokens[2] == -1).all() and res.num_accepted[2] == 0 and res.divergence[2].isnan().all()
    ref = reference.accept(target, draft, tokens, rule="fsd", threshold=0.1, seed=3)
    assert torch.equal(res.tokens, ref.tokens)  # other rows unaffected
    assert ((res.tokens >= -1) & (res.tokens < 50)).all()


def test_positive_infinite_logit_takes_all_the_mass():
    target = torch.zeros(1, 2, 10)
    target[0, :, 4] = float("inf")
    draft = torch.zeros(1, 1, 10)
    res = fsd_ext.accept(target, draft, torch.tensor([[3]]), rule="sd", seed=0)
    assert res.valid.item() and res.tokens.tolist() == [[4, -1]]
    assert fsd_ext.sample(target[0], seed=0).tolist() == [4, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 1000, 32001])
def test_argmax_is_the_lowest_id_of_the_maximum(vocab, dtype):
    """Temperature 0 and the greedy rule emit the lowest id holding the maximum (+inf counting as
    the largest finite float32) wherever the ties fall: across SIMD lanes, blocks and the scalar
    tail. (A row of +inf alone has no finite logit: invalid, so vocab 1 skips the inf patterns.)"""
    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(vocab)
    rows = []
    for _ in range(64):
        row = torch.randint(-3, 3, (vocab,), generator=gen).to(dtype)  # many ties
        ids = torch.randint(vocab, (3,), generator=gen)
        pattern = int(torch.randint(4 if vocab > 1 else 2, (), generator=gen))
        if pattern == 1:
            row[ids] = 7.0
        elif pattern == 2:
            row[ids[0]] = float("inf")
            row[ids[1:]] = big
        elif pattern == 3:
            row[ids] = float("inf")
        rows.append(row)
    logits = torch.stack(rows)
    flt_max = torch.finfo(torch.float32).max
    expected = logits.float().nan_to_num(posinf=flt_max).argmax(-1)  # torch: first occurrence
    assert torch.equal(fsd_ext.sample(logits, temperature=0.0), expected)
    target = logits[:, None, :].expand(-1, 2, -1)
    draft = torch.zeros(64, 1, vocab, dtype=dtype)
    res = fsd_ext.accept(target, draft, torch.full((64, 1), vocab), rule="greedy",
                         num_draft=torch.zeros(64, dtype=torch.int64))
    assert torch.equal(res.tokens[:, 0], expected)


def test_nan_rows_in_sample_and_divergence():
    logits = torch.randn(3, 20)
    logits[1, 5] = float("nan")
    assert fsd_ext.sample(logits, seed=0).tolist()[1] == -1
    d = fsd_ext.divergence(logits, torch.randn(3, 20))
    assert d[1].isnan() and not d[[0, 2]].isnan().any()


def _args():
    target, draft, tokens = make_problem(2, 3, 10, seed=9)
    return target, draft, tokens


@pytest.mark.parametrize("mutate,kwargs,error,match", [
    (lambda t, d, k: (t[0], d, k), {}, ValueError, "target_logits"),
    (lambda t, d, k: (t, d[:1], k), {}, ValueError, "draft_logits"),
    (lambda t, d, k: (t, d[:, :2], k), {}, ValueError, "draft_logits"),
    (lambda t, d, k: (t[..., :5], d, k), {}, ValueError, "vocabulary"),
    (lambda t, d, k: (t.long(), d, k), {}, TypeError, "target_logits"),
    (lambda t, d, k: (t, d.double(), k), {}, TypeError, "draft_logits"),
    (lambda t, d, k: (t, d.half(), k), {}, TypeError, "dtype"),
    (lambda t, d, k: (t.transpose(1, 2).contiguous().transpose(1, 2), d, k), {}, ValueError, "contiguous"),
    (lambda t, d, k: (t, d, k.float()), {}, TypeError, "draft_tokens"),
    (lambda t, d, k: (t, d, k[:, :2]), {}, ValueError, "draft_tokens"),
    (lambda t, d, k: (t, d, k.fill_(10)), {}, RuntimeError, "draft_tokens"),
    (lambda t, d, k: (t, d, k.fill_(-1)), {}, RuntimeError, "draft_tokens"),
    (None, dict(rule="exact"), ValueError, "rule"),
    (None, dict(divergence="hellinger"), ValueError, "divergence"),
    (None, dict(threshold=-0.1), ValueError, "threshold"),
    (None, dict(threshold=float("nan")), ValueError, "threshold"),
    (None, dict(threshold=torch.tensor([0.1, -1.0])), ValueError, "threshold"),
    (None, dict(threshold=torch.tensor([0.1])), ValueError, "threshold"),
    (None, dict(temperature=-1.0), ValueError, "temperature"),
    (None, dict(temperature=torch.tensor([1.0, -1.0])), ValueError, "temperature"),
    (None, dict(div_temperature=0.0), ValueError, "div_temperature"),
    (None, dict(top_k=0), ValueError, "top_k"),
    (None, dict(top_p=0.0), ValueError, "top_p"),
    (None, dict(top_p=1.5), ValueError, "top_p"),
    (None, dict(min_p=2.0), ValueError, "min_p"),
    (None, dict(div_top_k=0), ValueError, "div_top_k"),
    (None, dict(num_draft=torch.tensor([1, 4])), RuntimeError, "num_draft"),
    (None, dict(num_draft=torch.tensor([1, -1])), RuntimeError, "num_draft"),
    (None, dict(num_draft=torch.tensor([1])), ValueError, "num_draft"),
    (None, dict(seed=1.5), TypeError, "seed"),
    (None, dict(seed=torch.tensor([1, 2, 3])), ValueError, "seed"),
    (None, dict(seed=torch.tensor([1.0, 2.0])), TypeError, "seed"),  # a dtype: TypeError, as for the logits
    (None, dict(offset=-1), ValueError, "offset"),
])
def test_bad_arguments_raise_naming_them(mutate, kwargs, error, match):
    target, draft, tokens = _args()
    if mutate is not None:
        target, draft, tokens = mutate(target, draft, tokens)
    with pytest.raises(error, match=match):
        fsd_ext.accept(target, draft, tokens, **{"seed": 0, **kwargs})


def test_bad_arguments_of_divergence_and_sample():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="kind"):
        fsd_ext.divergence(x, x, kind="nope")
    with pytest.raises(ValueError, match="temperature"):
        fsd_ext.divergence(x, x, temperature=0.0)
    with pytest.raises(ValueError, match="agree"):
        fsd_ext.divergence(x, torch.randn(3, 10))
    with pytest.raises(ValueError, match="vocabulary"):
        fsd_ext.divergence(x, torch.randn(2, 11))
    with pytest.raises(ValueError, match="logits"):
        fsd_ext.sample(torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="temperature"):
        fsd_ext.sample(x, temperature=-0.5)
    with pytest.raises(ValueError, match="purpose"):
        fsd_ext.philox_uniforms(0, 0, 1, 1, purpose="coins")


def test_compiles_with_fullgraph():
    target, draft, tokens = make_problem(3, 2, 64, seed=10)

    def step(target, draft, tokens, seed, offset):
        res = fsd_ext.accept(target, draft, tokens, rule="fsd", threshold=0.2, seed=seed, offset=offset,
                             return_divergence=True)
        nxt = fsd_ext.sample(target[:, -1], temperature=0.8, seed=seed, offset=offset)
        return res.tokens, res.num_accepted, res.divergence, nxt, fsd_ext.divergence(target, target)

    seed, offset = torch.tensor(4), torch.tensor([2])
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for got, want in zip(compiled(target, draft, tokens, seed, offset), step(target, draft, tokens, seed, offset)):
        assert torch.equal(got, want)
