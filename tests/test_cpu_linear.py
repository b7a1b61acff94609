"""fsd_ext.cpu_linear: the few-row CPU linear is F.linear up to float rounding, and patching a
model is reversible and changes nothing else."""

import pytest
import torch
import torch.nn.functional as F

from fsd_ext.cpu_linear import MAX_ROWS, skinny_linear, use_skinny_cpu_linears


@pytest.mark.parametrize("shape", [(1, 64), (6, 64), (1, 6, 64), (2, 3, 64), (MAX_ROWS, 64),
                                   (MAX_ROWS + 1, 64), (0, 64), (2, 0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(*shape, generator=gen)
    out = skinny_linear(x, weight, b)
    expected = F.linear(x, weight, b)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_non_contiguous_input_and_other_dtypes_fall_through():
    weight = torch.randn(32, 48)
    x = torch.randn(48, 3).t()  # [3, 48], not contiguous
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    x64, w64 = x.double(), weight.double()
    assert torch.equal(skinny_linear(x64, w64), F.linear(x64, w64))  # not float32: stock path


def test_gradients_use_the_stock_path():
    weight = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(2, 4)
    skinny_linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 4))


def test_fast_path_is_taken_without_grad(monkeypatch):
    """Parameters require grad; under no_grad/inference_mode the fast path must still run."""
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(1) or real_linear(*a))
    weight = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        skinny_linear(x, weight)
    with torch.inference_mode():
        skinny_linear(x, weight)
    assert calls == []
    skinny_linear(x, weight)  # grad enabled: the stock path (autograd needs it)
    assert calls == [1]


def test_patch_model_is_reversible():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(3, 16)
    before = model(x)
    assert use_skinny_cpu_linears(model) == 2
    assert use_skinny_cpu_linears(model) == 0  # idempotent
    assert all("forward" in m.__dict__ for m in model if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    assert use_skinny_cpu_linears(model, enable=False) == 2
    assert all("forward" not in m.__dict__ for m in model if isinstance(m, torch.nn.Linear))
    assert torch.equal(model(x), before)
