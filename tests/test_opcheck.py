"""torch.library.opcheck on every registered op: schema, fake kernel, autograd registration and
AOT dispatch, for representative inputs.

The verification ops' arguments are recorded from the public front end (fsd_ext.accept /
divergence / sample / philox_uniforms), so each check runs the op exactly as the library calls it;
A newly registered op fails test_every_registered_op_is_checked until it has a case here. (The CPU
linear ops of fsd_ext.cpu_linear have their own: tests/cpu_linear/test_opcheck_cpu_linear.py.)
"""

from __future__ import annotations

import pytest
import torch

import fsd_ext
from fsd_ext import ops as fsd_ops

if fsd_ops._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext._C is not built", allow_module_level=True)

OP_NAMES = ("accept", "divergence", "sample", "philox_uniforms")


def recorded_calls(monkeypatch, body):
    """Runs body() and returns [(op, args)] of every fsd_ext op call the front end made."""
    calls = []

    class Recorder:
        def __getattr__(self, name):
            op = getattr(torch.ops.fsd_ext, name)

            def call(*args):
                calls.append((op, args))
                return op(*args)

            return call

    monkeypatch.setattr(fsd_ops, "_ops", lambda: Recorder())
    body()
    return calls


def logits(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def accept_cases():
    batch, k, vt, vd = 3, 2, 37, 33
    t, d = logits(batch, k + 1, vt, seed=1), logits(batch, k, vd, seed=2)
    drafts = torch.randint(0, vd, (batch, k), generator=torch.Generator().manual_seed(3))
    yield "fsd_default", lambda: fsd_ext.accept(t, d, drafts, threshold=0.3, seed=0)
    yield "every_option", lambda: fsd_ext.accept(
        t, d, drafts.int(), rule="fsd_strict", divergence="mkl", threshold=torch.tensor([0.1, 0.5, 2.0]),
        temperature=torch.tensor([0.0, 0.7, 1.3]), div_temperature=torch.tensor([1.0, 2.0, 0.5]),
        top_k=5, top_p=0.9, min_p=0.05, div_top_k=4, num_draft=torch.tensor([0, 1, 2]),
        seed=torch.tensor([5, 6, 7]), offset=torch.tensor([11]), return_divergence=True)
    for rule in [r.name for r in fsd_ext.types.RULE_TABLE if r.criterion not in (None, "divergence")]:
        yield f"{rule}_per_row", lambda rule=rule: fsd_ext.accept(
            t, d, drafts, rule=rule, threshold=torch.tensor([0.5, 1.5, 12.0]), temperature=0.7, top_p=0.9,
            seed=torch.tensor([5, 6, 7]), return_divergence=True)
    yield "greedy_k0_bf16", lambda: fsd_ext.accept(
        logits(2, 1, 16, dtype=torch.bfloat16), logits(2, 0, 16, dtype=torch.bfloat16),
        torch.zeros(2, 0, dtype=torch.long), rule="greedy", temperature=0.0, seed=1)
    yield "sd_half_strided", lambda: fsd_ext.accept(
        logits(3, 4, vt, dtype=torch.float16)[:, ::2], logits(3, 2, vd, dtype=torch.float16)[:, :1],
        drafts[:, :1], rule="sd", div_temperature=None, seed=torch.tensor(9), offset=3,
        return_divergence=True)


def other_cases():
    t, d = logits(4, 5, 40, seed=4), logits(4, 5, 40, seed=5)
    yield "divergence_js", lambda: fsd_ext.divergence(t, d, kind="js")
    yield "divergence_kl_topk_bf16", lambda: fsd_ext.divergence(
        t.bfloat16(), d[..., :30].bfloat16(), kind="kl", temperature=0.5, top_k=3)
    yield "sample_2d", lambda: fsd_ext.sample(t[:, 0], temperature=0.8, top_p=0.9, seed=0)
    yield "sample_3d_per_row", lambda: fsd_ext.sample(
        t.half(), temperature=torch.tensor([0.0, 1.0, 0.5, 2.0]), top_k=3, min_p=0.1,
        seed=torch.tensor([1, 2, 3, 4]), offset=torch.tensor([2]))
    yield "sample_1d", lambda: fsd_ext.sample(t[0, 0], temperature=0.0, seed=3)
    yield "uniforms_scalar", lambda: fsd_ext.philox_uniforms(7, 3, 4, 5, purpose="accept")
    yield "uniforms_per_row", lambda: fsd_ext.philox_uniforms(torch.tensor([1, 2, 3]), 0, 3, 2, purpose="draft")


CASES = dict(list(accept_cases()) + list(other_cases()))


@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck(case, monkeypatch):
    calls = recorded_calls(monkeypatch, CASES[case])
    assert calls, "the front end made no op call"
    for op, args in calls:
        eager = op(*args)
        if any(t.is_floating_point() and t.isnan().any() for t in _tensors(eager)):
            # opcheck compares eager and AOT outputs with assert_close, NaN != NaN (ragged K gives
            # NaN divergences by contract): run the other checks, and compare AOT here with NaNs equal.
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))
            compiled = torch.compile(lambda *a: op(*a), backend="aot_eager", dynamic=True, fullgraph=True)
            for got, want in zip(_tensors(compiled(*args)), _tensors(eager)):
                torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        else:
            torch.library.opcheck(op, args)


def _tensors(out):
    return [out] if isinstance(out, torch.Tensor) else list(out)


def registered_ops():
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("fsd_ext::")}


def test_every_registered_op_is_checked(monkeypatch):
    seen = set()
    for body in CASES.values():
        seen |= {op._qualified_op_name.split("::")[1] for op, _ in recorded_calls(monkeypatch, body)}
    assert seen == set(OP_NAMES)
    unchecked = registered_ops() - seen
    assert not unchecked, f"registered ops without an opcheck case in {__file__}: {sorted(unchecked)}"


@pytest.mark.parametrize("dynamic", [False, True])
def test_accept_compiles_fullgraph(dynamic):
    """The fake kernels let torch.compile trace the front end without graph breaks."""
    t, d = logits(2, 3, 20), logits(2, 2, 20, seed=1)
    drafts = torch.tensor([[1, 2], [3, 4]])

    def step(t, d, drafts, seed):
        res = fsd_ext.accept(t, d, drafts, threshold=0.3, seed=seed, return_divergence=True)
        return res.tokens, res.num_accepted, res.valid, res.divergence

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    seed = torch.tensor(5)
    for got, want in zip(compiled(t, d, drafts, seed), step(t, d, drafts, seed)):
        assert torch.equal(got.nan_to_num(-7), want.nan_to_num(-7))


def test_outputs_do_not_require_grad():
    """The ops are not differentiable: with inputs that require grad (model logits outside
    no_grad) their outputs are plain tensors, with no warning, and opcheck's autograd-registration
    test passes. Before, the autograd-not-implemented fallback gave the divergences a grad_fn that
    warned and backpropagated nothing."""
    import warnings

    t = logits(2, 3, 8).requires_grad_()
    d = logits(2, 2, 8, seed=1).requires_grad_()
    drafts = torch.zeros(2, 2, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = fsd_ext.accept(t, d, drafts, seed=0, return_divergence=True)
        div = fsd_ext.divergence(t[:, :2], d)
        tokens = fsd_ext.sample(t, seed=0)
    assert not any(x.requires_grad for x in (*res[:3], res.divergence, div, tokens))
    torch.library.opcheck(torch.ops.fsd_ext.divergence.default, (t[:, 0], d[:, 0], 2, 1.0, 0))
    args = (t, d, drafts, None, None, 0.0, None, 1.0, None, 1.0, False, None, 0, False, None, 0, 2, 2, 0,
            1.0, 0.0, 0, True)
    torch.library.opcheck(torch.ops.fsd_ext.accept.default, args)
