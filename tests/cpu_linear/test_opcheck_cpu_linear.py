"""torch.library.opcheck on every op of the CPU linear component (fsd_ext.cpu_linear): schema,
fake kernel, autograd registration and AOT dispatch, once per quantised format. A newly registered
op fails test_every_registered_op_is_checked until it has a case here."""

from __future__ import annotations

import pytest
import torch

from fsd_ext import cpu_linear

if cpu_linear._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext.cpu_linear._C is not built", allow_module_level=True)

# Ops without tensor arguments (what the CPU offers): nothing for opcheck.
TENSORLESS_OPS = {"skinny_linear_bf16_dot", "skinny_linear_avx2", "quant_linear_path", "int8_linear_path"}
QUANT_FORMATS = {"q4": 0, "q8": 1, "q8g32": 2}  # format ids of the quant_* ops


def quant_weight(format_name, out_features, in_features, seed=0):
    """Random codes and params in the quant_* ops' layout (any bytes are valid codes)."""
    fmt = QUANT_FORMATS[format_name]
    group = cpu_linear.QUANT_GROUP_SIZE[fmt]
    code_bytes, params_per_group = (128 if format_name == "q8g32" else 64), (8 if format_name == "q4" else 4)
    blocks, groups = -(-out_features // 4), in_features // group
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (blocks, groups, code_bytes), dtype=torch.uint8, generator=g)
    params = torch.rand(blocks, groups, params_per_group, generator=g) * 0.01
    return codes, params, fmt


def linear_cases():
    """(op, args, opcheck's test_utils or None for all) of the CPU linear ops."""
    skinny_utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    yield "skinny_linear", (torch.ops.fsd_cpu_linear.skinny_linear.default,
                            (torch.randn(3, 24), torch.randn(10, 24), torch.randn(10)), skinny_utils)
    for name in QUANT_FORMATS:
        codes, params, fmt = quant_weight(name, 10, 64)
        bias = torch.randn(10)
        yield f"quant_linear_{name}", (torch.ops.fsd_cpu_linear.quant_linear.default,
                                        (torch.randn(3, 64), codes, params, fmt, 10, bias), None)
        for dtype in (None, torch.bfloat16):
            yield f"quant_dequantize_{name}_{dtype}", (torch.ops.fsd_cpu_linear.quant_dequantize.default,
                                                        (codes, params, fmt, 10, dtype), None)
    for format_id, (type_name, (block_cols, block_bytes)) in enumerate(cpu_linear.INT8_LAYOUT.items()):
        packed = int8_weight(type_name, 20, 256)
        yield f"int8_linear_{type_name}", (torch.ops.fsd_cpu_linear.int8_linear.default,
                                           (torch.randn(3, 256), packed, format_id, 20, torch.randn(20)), None)
        yield f"int8_dequantize_{type_name}", (torch.ops.fsd_cpu_linear.int8_dequantize.default,
                                               (packed, format_id, 20), None)
    q4k, q6k = int8_weight("Q4_K", 20, 256), int8_weight("Q6_K", 12, 256)
    yield "int8_linear_cat", (torch.ops.fsd_cpu_linear.int8_linear_cat.default,
                              (torch.randn(2, 3, 256), [q4k, q6k], [0, 1], [20, 12], torch.randn(32)), None)
    yield "decoder_layer", (torch.ops.fsd_cpu_linear.decoder_layer.default, decoder_layer_args(), None)
    angles = torch.randn(2, 3, 4)
    yield "rotate_half_", (torch.ops.fsd_cpu_linear.rotate_half_.default,
                           (torch.randn(2, 3, 40), torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1),
                            4), None)


def decoder_layer_args(batch=1, steps=2, width=256, heads=4, kv_heads=2, dim=64, capacity=8, length=5):
    """Arguments of decoder_layer for a random layer (Q4_K and Q6_K weights) and cache."""
    g = torch.Generator().manual_seed(0)
    qkv = [int8_weight("Q4_K", out, width) for out in (heads * dim, kv_heads * dim, kv_heads * dim)]
    angles = torch.randn(1, steps, dim // 2, generator=g)
    mask = torch.zeros(batch, 1, steps, length)
    mask[..., -1] = torch.finfo(torch.float32).min
    return (torch.randn(batch, steps, width, generator=g), torch.rand(width) + 0.5, torch.rand(width) + 0.5, 1e-6,
            qkv, [0, 0, 0], [heads * dim, kv_heads * dim, kv_heads * dim], torch.randn((heads + 2 * kv_heads) * dim),
            int8_weight("Q4_K", width, heads * dim), 0, None, [int8_weight("Q4_K", 512, width)] * 2, [0, 0],
            [512, 512], int8_weight("Q6_K", width, 512), 1, None, torch.cat([angles.cos()] * 2, -1),
            torch.cat([angles.sin()] * 2, -1), torch.zeros(batch, kv_heads, capacity, dim),
            torch.zeros(batch, kv_heads, capacity, dim), torch.tensor([[length - 2, length - 1]] * batch), mask,
            heads, kv_heads, dim ** -0.5)


def int8_weight(type_name, out_features, in_features):
    """A packed weight of int8_linear's layout from random GGUF blocks."""
    from gguf_blocks import MODEL_SIZED, random_blocks

    from fsd_ext.cpu_linear import gguf_weights

    raw = random_blocks(type_name, out_features, in_features, field_max=MODEL_SIZED[type_name])
    return gguf_weights.pack_int8(raw, type_name, in_features)


LINEAR_CASES = dict(linear_cases())


@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_opcheck_linear(case):
    op, args, test_utils = LINEAR_CASES[case]
    if test_utils is None:
        torch.library.opcheck(op, args)
    else:
        torch.library.opcheck(op, args, test_utils=test_utils)


@pytest.mark.parametrize("name", sorted(QUANT_FORMATS))
def test_quant_dequantize_fake_shape_matches_the_kernel(name):
    """The fake kernel's output shape is the kernel's for every format (each has its group size)."""
    codes, params, fmt = quant_weight(name, 6, 96)
    real = torch.ops.fsd_cpu_linear.quant_dequantize(codes, params, fmt, 6)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.fsd_cpu_linear.quant_dequantize(mode.from_tensor(codes), mode.from_tensor(params), fmt, 6)
    assert tuple(fake.shape) == tuple(real.shape) == (6, 96)


def test_every_registered_op_is_checked():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("fsd_cpu_linear::")}
    checked = {op._schema.name.split("::")[1] for op, _, _ in LINEAR_CASES.values()}
    unchecked = registered - checked - TENSORLESS_OPS
    assert not unchecked, f"registered ops without an opcheck case in {__file__}: {sorted(unchecked)}"
    assert TENSORLESS_OPS <= registered
