"""The CPU decoding helpers that cut per-op overhead: grouped_sdpa (attention without copies of the
cache), int8_linear_cat (several products of one x), rotate_half_ (rotary embedding in one op) and
fuse_decoder_layers. Each gives the bits of what it replaces, except decoder_layer, whose norms and
attention round differently (csrc/cpu_linear/tests/test_decode_ops.cpp checks those loops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsd_ext import cpu_linear

if cpu_linear._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext.cpu_linear._C is not built", allow_module_level=True)

from gguf_blocks import MODEL_SIZED, QT, gguf, random_blocks, tiny_model, transformers, write_gguf  # noqa: E402

from fsd_ext.cpu_linear import attention, gguf_weights  # noqa: E402
from fsd_ext.cpu_linear.fused import fuse_decoder_layers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
INT8_TYPES = {"q_proj": "Q4_K", "k_proj": "Q6_K", "v_proj": "Q8_0", "o_proj": "Q5_0",
              "gate_proj": "Q4_K", "up_proj": "Q5_0", "down_proj": "Q6_K"}


class _Module:
    def __init__(self, groups):
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def per_row_mask(batch: int, steps: int, length: int, seed: int = 0) -> torch.Tensor:
    """An additive mask [B, 1, S, L] as fsd_ext's cache makes it: row b sees slots [pad_b, end_b + s]."""
    g = torch.Generator().manual_seed(seed)
    pad = torch.randint(0, 3, (batch, 1, 1), generator=g)
    end = length - steps - torch.randint(0, 3, (batch, 1, 1), generator=g)
    slot = torch.arange(length)[None, None, :]
    visible = (slot >= pad) & (slot <= end + torch.arange(steps)[None, :, None])
    return torch.zeros(batch, steps, length).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("steps", [1, 6, 20])
@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_grouped_sdpa_is_transformers_sdpa(steps, kv_heads):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(steps)
    batch, heads, length, dim = 2, 6, 40, 16
    query = torch.randn(batch, steps, heads, dim, generator=g).transpose(1, 2)  # as the layers make it
    key, value = (torch.randn(batch, kv_heads, 64, dim, generator=g)[:, :, :length] for _ in range(2))
    mask = per_row_mask(batch, steps, length)
    module = _Module(heads // kv_heads)
    ours, _ = attention.grouped_sdpa(module, query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == (batch, steps, heads, dim)
    assert torch.equal(ours, expected)


def test_grouped_sdpa_keeps_each_query_head_on_its_own_kv_head():
    """Negative control: with the kv heads swapped the result changes (heads are not mixed up)."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 8, generator=g)
    key, value = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    mask, module = per_row_mask(1, 3, 10), _Module(2)
    ours, _ = attention.grouped_sdpa(module, query, key, value, mask)
    swapped, _ = attention.grouped_sdpa(module, query, key.flip(1), value.flip(1), mask)
    assert not torch.equal(ours, swapped)
    reference = F.scaled_dot_product_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), mask)
    torch.testing.assert_close(ours, reference.transpose(1, 2))


def test_rotate_half_is_transformers_rotary_embedding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    batch, steps, heads, kv_heads, dim = 2, 5, 4, 2, 16
    qkv = torch.randn(batch, steps, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.randn(batch, steps, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = (part.view(batch, steps, -1, dim).transpose(1, 2) for part in qkv.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], -1))
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = qkv.clone()
    torch.ops.fsd_cpu_linear.rotate_half_(ours, cos, sin, heads + kv_heads)
    q2, k2, v2 = (part.view(batch, steps, -1, dim).transpose(1, 2) for part in ours.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], -1))
    assert torch.equal(q2, expected_q) and torch.equal(k2, expected_k) and torch.equal(v2, v)
    with pytest.raises(RuntimeError, match="heads x D must fit"):
        torch.ops.fsd_cpu_linear.rotate_half_(ours, cos, sin, 9)
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        torch.ops.fsd_cpu_linear.rotate_half_(ours, cos[:, :3], sin[:, :3], 2)


def test_linear_cat_is_the_products_side_by_side():
    layers = []
    for i, (type_name, out) in enumerate([("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 20)]):
        raw = random_blocks(type_name, out, 256, seed=i, field_max=MODEL_SIZED[type_name])
        bias = torch.randn(out) if i != 1 else None
        layers.append(cpu_linear.QuantInt8Linear(gguf_weights.pack_int8(raw, type_name, 256), type_name, 256, out, bias))
    x = torch.randn(2, 3, 256)
    bias = torch.cat([layers[0].bias, torch.zeros(16), layers[2].bias])
    y = torch.ops.fsd_cpu_linear.int8_linear_cat(x, [l.packed for l in layers], [l.format_id for l in layers],
                                                 [l.out_features for l in layers], bias)
    assert torch.equal(y, torch.cat([layer(x) for layer in layers], -1))
    with pytest.raises(RuntimeError, match="same in_features"):
        other = cpu_linear.QuantInt8Linear(gguf_weights.pack_int8(random_blocks("Q4_K", 16, 512), "Q4_K", 512),
                                           "Q4_K", 512, 16)
        torch.ops.fsd_cpu_linear.int8_linear_cat(x, [layers[0].packed, other.packed], [0, 0], [32, 16], None)
    with pytest.raises(RuntimeError, match="same length"):
        torch.ops.fsd_cpu_linear.int8_linear_cat(x, [layers[0].packed], [0, 0], [32], None)


def int8_model(arch: str, tmp_path, seed: int = 0):
    model = tiny_model(arch, seed)
    write_gguf(model, arch, tmp_path / f"{arch}{seed}.gguf", types=INT8_TYPES, f16_layer="")
    gguf_weights.load_gguf_linear_weights(model, tmp_path / f"{arch}{seed}.gguf", log=False, activations="int8")
    attention.use_grouped_attention(model)
    return model


@pytest.mark.skipif(not TRANSFORMERS_5, reason="fuse_decoder_layers patches transformers 5's modules only")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_layers_give_the_models_own_results(tmp_path, arch):
    from fsd_ext import generate

    plain, fused = int8_model(arch, tmp_path), int8_model(arch, tmp_path)
    assert fuse_decoder_layers(fused) == 2 * 5 + 1  # per layer 2 norms, attention, MLP, the layer; the final norm
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, plain(ids).logits)  # the modules (transformers' own cache)
        # decoding steps through decoder_layer, on fsd_ext's cache, against the plain model
        from fsd_ext.decoding.model import CachedModel
        pad = torch.tensor([0, 2])
        logits = {}
        for name, model in (("plain", plain), ("fused", fused)):
            cached = CachedModel(model, pad, 32, use_graphs=False)
            cached(ids, 1, prefill=True)
            cached.cache.lengths += ids.shape[1]
            logits[name] = cached(ids[:, :6], 6)
        # (the two paths' norms and attention round differently, and a last-bit change of x may move
        # an int8 code of it by one: rarely, some logits move by a quantisation step)
        difference = (logits["fused"] - logits["plain"]).abs()
        assert difference.max() < 0.05 and difference.mean() < 1e-3
    draft = int8_model(arch, tmp_path, seed=1)
    for rule in ("ar", "sd"):
        kwargs = dict(rule=rule, temperature=0.0, max_new_tokens=10, num_draft_tokens=5)
        expected = generate(plain, draft, ids, **kwargs).sequences
        with torch.profiler.profile() as profile:
            assert torch.equal(generate(fused, draft, ids, **kwargs).sequences, expected)
        # the decoding steps ran whole layers in one op (the prompt took the modules' path)
        assert any(event.name == "fsd_cpu_linear::decoder_layer" for event in profile.events())


@pytest.mark.skipif(not TRANSFORMERS_5, reason="fuse_decoder_layers patches transformers 5's modules only")
def test_fused_layers_read_the_cache_after_it_grows(tmp_path, monkeypatch):
    """decoder_layer writes and reads the buffers that layer_buffers hands out: after the caches
    grow mid-decode (here from 16 to 28 slots, 4-slot steps) it must use the new ones, giving the
    tokens of a call whose caches never grow."""
    from fsd_ext import generate
    from fsd_ext.decoding import kv_cache

    fused, draft = int8_model("qwen2", tmp_path), int8_model("qwen2", tmp_path, seed=1)
    fuse_decoder_layers(fused)
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(2))
    for rule in ("ar", "sd"):
        kwargs = dict(rule=rule, temperature=0.0, max_new_tokens=10, num_draft_tokens=5, eos_token_id=[])
        expected = generate(fused, draft, ids, **kwargs).sequences  # 256 slots
        grown = []
        grow = kv_cache.StaticKVCache.grow
        monkeypatch.setattr(kv_cache.StaticKVCache, "grow",
                            lambda self, capacity: (grown.append(capacity), grow(self, capacity)))
        monkeypatch.setattr(kv_cache, "CAPACITY_STEP", 4)
        with torch.profiler.profile() as profile:
            assert torch.equal(generate(fused, draft, ids, **kwargs).sequences, expected)
        assert grown and any(event.name == "fsd_cpu_linear::decoder_layer" for event in profile.events())
        monkeypatch.undo()


def test_fusion_leaves_other_linear_layers_alone(tmp_path):
    """Layers with a linear that is not QuantInt8Linear keep their forward (the default types hold
    Q4_0 / Q4_1 / F16 layers)."""
    model = tiny_model("qwen2")
    write_gguf(model, "qwen2", tmp_path / "mixed.gguf")
    gguf_weights.load_gguf_linear_weights(model, tmp_path / "mixed.gguf", log=False, activations="int8")
    patched = fuse_decoder_layers(model)
    assert patched == (5 if TRANSFORMERS_5 else 0)  # the RMSNorms only
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_decoder_layer_checks_its_cache_arguments():
    from test_opcheck_cpu_linear import decoder_layer_args

    args = list(decoder_layer_args())
    torch.ops.fsd_cpu_linear.decoder_layer(*args)
    for index, value, match in [(21, torch.tensor([[0, 5]]), r"slots must be in \[0, 5\)"),
                                (22, torch.zeros(1, 1, 3, 5), r"mask must be float32 \[1, 1, 2, L <= 8\]"),
                                (19, torch.zeros(1, 3, 8, 64), r"keys and values must be float32 \[1, 2, capacity, 64\]"),
                                (23, 3, "heads must be a multiple of kv_heads")]:
        bad = list(args)
        bad[index] = value
        with pytest.raises(RuntimeError, match=match):
            torch.ops.fsd_cpu_linear.decoder_layer(*bad)
