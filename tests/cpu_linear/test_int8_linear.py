"""The int8-activation products (torch.ops.fsd_cpu_linear.int8_linear, cpu_linear.QuantInt8Linear):
the tile layout holds exactly the file's weights (gguf-py's dequantisation, bit for bit), the op
computes the product of those weights with x quantised per 32 features (checked against float64
loops over that definition), a row's result does not depend on the other rows of the call, and bad
arguments get clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsd_ext import cpu_linear
from fsd_ext.cpu_linear import INT8_LAYOUT, QuantInt8Linear

if cpu_linear._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext.cpu_linear._C is not built", allow_module_level=True)

from gguf_blocks import CODE_BYTE, MODEL_SIZED, QT, bits, gguf, random_blocks  # noqa: E402

from fsd_ext.cpu_linear import gguf_weights  # noqa: E402

TYPES = list(INT8_LAYOUT)


def int8_layer(type_name: str, out: int, in_features: int, bias: bool = False, seed: int = 0):
    """(QuantInt8Linear, its float32 weight from gguf-py) for random blocks of model-sized scales."""
    raw = random_blocks(type_name, out, in_features, seed, field_max=MODEL_SIZED[type_name])
    weight = torch.from_numpy(gguf.quants.dequantize(raw, QT[type_name]))
    b = torch.randn(out, generator=torch.Generator().manual_seed(seed)) if bias else None
    return QuantInt8Linear(gguf_weights.pack_int8(raw, type_name, in_features), type_name, in_features, out, b), weight


def quantised_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per group of 32, round(x / dx) * dx with dx = max |x| / 127 (float64)."""
    groups = x.double().reshape(*x.shape[:-1], -1, 32)
    dx = (groups.abs().amax(-1, keepdim=True).float() / 127).double()
    inv = torch.where(dx > 0, 1 / dx.float().double(), torch.zeros_like(dx))
    codes = torch.round((groups.float() * inv.float()).double()).clamp(-127, 127)
    return (codes * dx).reshape(x.shape)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("out", [16, 37])
def test_layout_holds_the_files_weights_to_the_bit(type_name, out):
    in_features = 512
    raw = random_blocks(type_name, out, in_features, seed=out)
    packed = gguf_weights.pack_int8(raw, type_name, in_features)
    assert packed.shape == (-(-out // 16), in_features // INT8_LAYOUT[type_name][0] * INT8_LAYOUT[type_name][1])
    format_id = TYPES.index(type_name)
    expected = bits(gguf.quants.dequantize(raw, QT[type_name]))
    assert np.array_equal(bits(torch.ops.fsd_cpu_linear.int8_dequantize(packed, format_id, out).numpy()), expected)
    # Negative control: one changed code bit moves exactly one weight.
    tampered = raw.copy()
    tampered[0, CODE_BYTE[type_name]] ^= 0x01
    moved = gguf_weights.pack_int8(tampered, type_name, in_features)
    changed = bits(torch.ops.fsd_cpu_linear.int8_dequantize(moved, format_id, out).numpy()) != expected
    assert changed.sum() == 1


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 6, 19])
def test_product_is_the_quantised_x_times_the_weights(type_name, rows):
    layer, weight = int8_layer(type_name, 40, 512, bias=True)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    x[0, :32] *= 50  # one group of another scale
    y = layer(x)
    expected = quantised_x(x) @ weight.double().T + layer.bias.double()
    magnitude = quantised_x(x).abs() @ weight.double().abs().T + layer.bias.double().abs()
    assert ((y.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all()
    # and close to the float product (int8 x keeps ~8 bits per group)
    torch.testing.assert_close(y, F.linear(x, weight, layer.bias), rtol=0, atol=0.02 * magnitude.max().item())


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_alone_equals_the_row_among_others(type_name):
    """Batch invariance (exact greedy speculative decoding relies on it): every row of a 1-, 6-, 13-
    or 40-row call has the bits of that row computed alone."""
    layer, _ = int8_layer(type_name, 48, 256)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([layer(x[r:r + 1]) for r in range(40)])
    for count in (6, 13, 40):
        assert torch.equal(layer(x[:count]), alone[:count])


def test_nan_rows_stay_nan_and_empty_inputs_are_empty():
    layer, _ = int8_layer("Q4_K", 32, 256)
    x = torch.randn(3, 256)
    x[1, 7] = float("nan")
    x[2, 100] = float("inf")
    y = layer(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert layer(torch.randn(0, 256)).shape == (0, 32)
    assert layer(torch.randn(2, 3, 256)).shape == (2, 3, 32)


def test_other_dtypes_autograd_and_the_float_weights():
    layer, weight = int8_layer("Q6_K", 16, 256, bias=True)
    x = torch.randn(2, 256)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(layer.dequantized_weight(), weight)
    x.requires_grad_(True)
    y = layer(x)  # autograd: the float product of the exact weights
    torch.testing.assert_close(y, F.linear(x, weight, layer.bias))
    y.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(2, -1))


@pytest.mark.parametrize("call, match", [
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x, w, 4, 16, None), "format must be"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x, w, 0, 17, None), r"out_features must be in \(0, 16\]"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x[:, :128], w, 0, 16, None), r"x must be \[\.\.\., 256\]"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x.int(), w, 0, 16, None), "x must be a floating"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x, w[:, :100], 0, 16, None), "whole blocks of 2368"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x, w.float(), 0, 16, None), "contiguous uint8"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_linear(x, w, 0, 16, torch.randn(8)), r"bias must be a float32 \[16\]"),
    (lambda w, x: torch.ops.fsd_cpu_linear.int8_dequantize(w, 2, 16), "whole blocks of 352"),
])
def test_ops_reject_bad_arguments(call, match):
    layer, _ = int8_layer("Q4_K", 16, 256)
    with pytest.raises(RuntimeError, match=match):
        call(layer.packed, torch.randn(2, 256))


def test_constructor_and_packer_check_their_inputs():
    layer, _ = int8_layer("Q4_K", 16, 256)
    with pytest.raises(ValueError, match="type_name must be one of"):
        QuantInt8Linear(layer.packed, "Q4_0", 256, 16)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[2, 2368\]"):
        QuantInt8Linear(layer.packed, "Q4_K", 256, 17)
    with pytest.raises(ValueError, match="has no int8 layout"):
        gguf_weights.pack_int8(np.zeros((2, 36), np.uint8), "Q4_0", 64)
    with pytest.raises(ValueError, match="takes 144 bytes"):
        gguf_weights.pack_int8(np.zeros((2, 100), np.uint8), "Q4_K", 256)
