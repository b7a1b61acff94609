"""fsd_ext.cpu_linear.gguf_weights and cpu_linear.QuantWeightLinear: a GGUF file's quantised linear weights,
repacked, are exactly the float32 weights gguf-py's dequantisation gives (bit for bit, every
supported type), the layers compute F.linear of them up to float rounding on every path, and a
model's linear layers are swapped only where the file holds exactly their weights."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from fsd_ext import cpu_linear, models  # noqa: E402
from fsd_ext.cpu_linear import gguf_weights  # noqa: E402
from fsd_ext.cpu_linear import MAX_ROWS, QuantWeightLinear, dequantize_torch  # noqa: E402
from gguf_blocks import (CODE_BYTE, bits, random_blocks, tiny_model, write_checkpoint_gguf,  # noqa: E402
                         write_gguf)

needs_ext = pytest.mark.skipif(cpu_linear._IMPORT_ERROR is not None, reason="extension not built")
QT = gguf.GGMLQuantizationType

@pytest.mark.parametrize("type_name", gguf_weights.SUPPORTED_TYPES)
def test_unpack_is_gguf_dequantize_to_the_bit(type_name):
    in_features = 512
    raw = random_blocks(type_name, 6, in_features)
    expected = gguf.quants.dequantize(raw, QT[type_name])  # [6, 512] float32
    unpacked = gguf_weights.unpack(raw, type_name, in_features)
    assert unpacked.codes.shape == (6, in_features)
    assert np.array_equal(bits(unpacked.dequantize()), bits(expected))
    # The comparison sees a single changed code (one weight moves, by one scale step).
    tampered = raw.copy()
    tampered[0, CODE_BYTE[type_name]] ^= 0x01
    changed = bits(gguf_weights.unpack(tampered, type_name, in_features).dequantize()) != bits(expected)
    assert changed.sum() == 1


def test_unpack_checks_the_row_size():
    with pytest.raises(ValueError, match="takes 36 bytes"):
        gguf_weights.unpack(np.zeros((2, 30), np.uint8), "Q4_0", 64)
    with pytest.raises(ValueError, match="not one of"):
        gguf_weights.unpack(np.zeros((2, 30), np.uint8), "Q2_K", 256)


def quant_layer(type_name: str, out: int, in_features: int, bias: bool = False, seed: int = 0):
    """(QuantWeightLinear, its float32 weight from gguf-py, bias or None) for random blocks."""
    raw = random_blocks(type_name, out, in_features, seed)
    unpacked = gguf_weights.unpack(raw, type_name, in_features)
    codes, params = gguf_weights.pack(unpacked)
    b = torch.randn(out, generator=torch.Generator().manual_seed(seed)) if bias else None
    layer = QuantWeightLinear(codes, params, unpacked.format, in_features, out, bias=b, source=type_name)
    return layer, torch.from_numpy(gguf.quants.dequantize(raw, QT[type_name])), b


@pytest.mark.parametrize("type_name,fmt,bytes_per_weight", [
    ("Q4_0", "q4", 0.75), ("Q4_1", "q4", 0.75), ("Q4_K", "q4", 0.75), ("Q5_0", "q8g32", 1.125),
    ("Q8_0", "q8g32", 1.125), ("Q6_K", "q8", 1.25)])
def test_each_type_takes_its_smallest_format(type_name, fmt, bytes_per_weight):
    layer, _, _ = quant_layer(type_name, 8, 256)
    assert layer.format == fmt
    assert (layer.codes.numel() + 4 * layer.params.numel()) / (8 * 256) == bytes_per_weight


@pytest.mark.parametrize("type_name", gguf_weights.SUPPORTED_TYPES)
@pytest.mark.parametrize("out", [1, 6, 67])
def test_packed_weights_are_exact_on_every_path(monkeypatch, type_name, out):
    layer, weight, _ = quant_layer(type_name, out, 256)
    assert torch.equal(dequantize_torch(layer.codes, layer.params, layer.format, out), weight)
    assert torch.equal(layer.dequantized_weight(), weight)  # the kernel where built
    monkeypatch.setattr(cpu_linear, "_native_op", lambda: None)
    assert torch.equal(layer.dequantized_weight(), weight)


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """QuantWeightLinear through the compiled kernel, and through its torch-ops fallback."""
    if request.param == "kernel" and cpu_linear._IMPORT_ERROR is not None:
        pytest.skip("extension not built")
    if request.param == "torch":
        monkeypatch.setattr(cpu_linear, "_native_op", lambda: None)
    return request.param


def assert_float32_product(y, x, weight, bias=None):
    """y is x W^T + bias up to float32 rounding: within 1e-5 of the sum of |terms| of the float64
    product (the random blocks' weights reach the hundreds, so outputs cancel)."""
    exact = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    assert ((y.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("shape", [(1, 256), (6, 256), (2, 3, 256), (MAX_ROWS, 256), (MAX_ROWS + 1, 256),
                                   (1, 45, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_matches_f_linear(path, type_name, shape, bias):
    """Decoding rows (the kernel), prompt rows (blockwise dequantise + mm), both against F.linear."""
    layer, weight, b = quant_layer(type_name, 131, 256, bias=bias)
    layer.prompt_dtype = torch.float32
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (*shape[:-1], 131) and y.dtype == torch.float32
    assert_float32_product(y, x, weight, b)


@needs_ext
def test_prompt_rows_in_bfloat16():
    """prompt_dtype bfloat16 (auto on CPUs with AVX512-BF16): more than MAX_ROWS rows multiply the
    weights and inputs rounded to bfloat16, as a bfloat16 model's prompt does; fewer stay exact."""
    layer, weight, b = quant_layer("Q4_K", 131, 256, bias=True)
    assert layer.prompt_matmul_dtype() == (torch.bfloat16 if cpu_linear.bf16_dot_available() else torch.float32)
    assert cpu_linear.set_prompt_dtype(torch.nn.Sequential(layer), torch.bfloat16) == 1
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x)
        expected = F.linear(x.bfloat16(), weight.bfloat16()).float() + b
        torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)
        assert not torch.allclose(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)  # not float32
        assert_float32_product(layer(x[:MAX_ROWS]), x[:MAX_ROWS], weight, b)
    with pytest.raises(ValueError, match="dtype must be"):
        cpu_linear.set_prompt_dtype(layer, torch.float16)


def test_forward_casts_other_dtypes_and_backpropagates():
    layer, weight, b = quant_layer("Q4_K", 20, 256, bias=True)
    x = torch.randn(3, 256)
    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, layer(x.bfloat16().float()).bfloat16())
    x.requires_grad_(True)
    layer(x).sum().backward()  # autograd: through the dequantised weight (the codes get no gradient)
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


@needs_ext
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_kernel_matches_float64_on_model_sizes(type_name):
    """Every row count 1..16 on the 1.5B model's down projection shape, against float64."""
    layer, weight, _ = quant_layer(type_name, 96, 8960)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, 8960, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            assert_float32_product(layer(x), x, weight)


def test_constructor_checks_shapes():
    layer, _, _ = quant_layer("Q4_K", 8, 256)
    with pytest.raises(ValueError, match="codes must be uint8"):
        QuantWeightLinear(layer.codes[:1], layer.params, "q4", 256, 8)
    with pytest.raises(ValueError, match="params must be float32"):
        QuantWeightLinear(layer.codes, layer.params.double(), "q4", 256, 8)
    with pytest.raises(ValueError, match="format must be"):
        QuantWeightLinear(layer.codes, layer.params, "q5", 256, 8)
    q8, _, _ = quant_layer("Q8_0", 8, 256)
    with pytest.raises(ValueError, match=r"codes must be uint8 \[2, 8, 128\]"):
        QuantWeightLinear(q8.codes[..., :64].contiguous(), q8.params, "q8g32", 256, 8)


@needs_ext
@pytest.mark.parametrize("call,match", [
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x, c.int(), p, 0, 8, None), "codes must be a contiguous uint8"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x, c, p[..., :4].contiguous(), 0, 8, None), "params must be"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x, c, p, 3, 8, None), "format must be 0"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x, c, p, 2, 8, None), r"codes must be a contiguous uint8 \[blocks, groups, 128\]"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x, c, p, 0, 9, None), r"out_features must be in \(4, 8\]"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x[:, :32], c, p, 0, 8, None), r"x must be \[..., 256\]"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x.double(), c, p, 0, 8, None), "x must be float32"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x.expand(17, 256), c, p, 0, 8, None), "1 to 16 rows"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x, c, p, 0, 8, torch.zeros(7)), r"bias must be a float32 \[8\]"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_dequantize(c, p, 1, 8), "params must be"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x[:, :0], c, p, 0, 8, None), r"x must be \[..., 256\]"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x[:0], c, p, 0, 8, None), "1 to 16 rows"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_linear(x.half(), c, p, 0, 8, None), "x must be float32"),
    (lambda c, p, x: torch.ops.fsd_cpu_linear.quant_dequantize(c, p, 0, 9), r"out_features must be in \(4, 8\]"),
])
def test_ops_reject_bad_arguments(call, match):
    layer, _, _ = quant_layer("Q4_K", 8, 256)
    with pytest.raises(RuntimeError, match=match):
        call(layer.codes, layer.params, torch.randn(1, 256))


# ----------------------------------------------------------------------------------------------
# Models (gguf_blocks.tiny_model, write_gguf).

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_layers_swapped_where_the_file_holds_their_weights(tmp_path, arch):
    model = tiny_model(arch)
    write_gguf(model, arch, tmp_path / "tiny.gguf")
    model.model.layers[0].mlp.down_proj.weight.data[3, 5] += 1e-3  # no longer the file's weights
    reference = tiny_model(arch)
    reference.load_state_dict(model.state_dict())
    report = gguf_weights.load_gguf_linear_weights(model, tmp_path / "tiny.gguf", log=False)
    cpu_linear.set_prompt_dtype(model, torch.float32)  # the 18-row prompt below: exact too
    assert report.kept == {"model.layers.1.mlp.up_proj": "GGUF type F16",
                           "model.layers.0.mlp.down_proj": "weights differ from the file's"}
    assert len(report.replaced) == 2 * 7 + 1 - 2
    expected_lm_head = "Q4_K" if arch == "llama" else "Q6_K"  # llama here: tied, token_embd
    assert report.replaced["lm_head"] == expected_lm_head
    assert report.replaced["model.layers.0.self_attn.q_proj"] == "Q4_K"
    assert isinstance(model.model.layers[1].self_attn.k_proj, QuantWeightLinear)
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear
    assert cpu_linear.linear_weights_kind(model) == "gguf"
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for tokens in (ids, ids[:1, :1], ids[:, :6]):  # a prompt, a decoding step, a verification
            torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("verify", ["model", "file"])
def test_llama_rows_are_reordered_back(tmp_path, verify):
    """Negative control: a llama file whose q / k rows are in HF's order does not hold the model's
    weights under llama.cpp's convention, so those layers are kept."""
    model = tiny_model("llama")
    write_gguf(model, "llama", tmp_path / "tiny.gguf", permute=False)
    report = gguf_weights.load_gguf_linear_weights(model, tmp_path / "tiny.gguf", log=False, verify=verify)
    kept = {name for name, reason in report.kept.items() if reason == "weights differ from the file's"}
    assert kept == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj")}


def test_file_verification_reads_the_file_and_the_modules_end_rows(tmp_path, monkeypatch):
    """verify="file" (models.load's, for a model dequantised from the very file): the repacked
    codes against gguf-py's dequantisation of the file in full, the module's weight at its first
    and last rows only (a lazily mapped checkpoint's weights stay unread)."""
    model = tiny_model("llama")  # (q / k: the file's row order too)
    write_gguf(model, "llama", tmp_path / "tiny.gguf")
    model.model.layers[0].mlp.down_proj.weight.data[0, 5] += 1e-3    # a first row: read, differs
    model.model.layers[1].mlp.down_proj.weight.data[-1, 5] += 1e-3   # a last row: read, differs
    model.model.layers[0].mlp.gate_proj.weight.data[100, 5] += 1e-3  # a middle row: not read
    report = gguf_weights.load_gguf_linear_weights(model, tmp_path / "tiny.gguf", log=False, verify="file")
    assert report.kept == {"model.layers.1.mlp.up_proj": "GGUF type F16",
                           "model.layers.0.mlp.down_proj": "weights differ from the file's",
                           "model.layers.1.mlp.down_proj": "weights differ from the file's"}
    assert "model.layers.0.mlp.gate_proj" in report.replaced and "model.layers.0.self_attn.q_proj" in report.replaced
    # Negative control: codes unpacked wrong in a middle row differ from the file's, so are kept.
    unpack = gguf_weights.unpack

    def wrong_unpack(raw, type_name, in_features):
        unpacked = unpack(raw, type_name, in_features)
        unpacked.scales[unpacked.scales.shape[0] // 2, 0] *= 2
        return unpacked

    monkeypatch.setattr(gguf_weights, "unpack", wrong_unpack)
    fresh = tiny_model("llama")
    write_gguf(fresh, "llama", tmp_path / "again.gguf")
    report = gguf_weights.load_gguf_linear_weights(fresh, tmp_path / "again.gguf", log=False, verify="file")
    assert not report.replaced
    with pytest.raises(ValueError, match="verify must be"):
        gguf_weights.load_gguf_linear_weights(fresh, tmp_path / "again.gguf", log=False, verify="rows")


@pytest.mark.parametrize("verify", ["model", "file"])
def test_repacking_in_chunks_of_rows_gives_the_whole_matrix(tmp_path, verify):
    """_repack_checked a few rows at a time (large matrices) gives what one chunk gives, in the
    model's row order (llama's q / k), and checks every chunk."""
    model = tiny_model("llama")
    write_gguf(model, "llama", tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    for module, gguf_name in [("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
                              ("model.layers.1.mlp.down_proj", "blk.1.ffn_down.weight")]:
        weight = model.get_submodule(module).weight
        order = gguf_weights._llama_row_order(module, weight.shape[0], model.config)
        tensor = tensors[gguf_name]
        whole = gguf_weights._repack_checked(tensor, tensor.tensor_type.name, weight, order, verify)
        chunks = gguf_weights._repack_checked(tensor, tensor.tensor_type.name, weight, order, verify, rows_per_chunk=8)
        assert whole is not None and chunks is not None and whole[2] == chunks[2]
        assert torch.equal(whole[0], chunks[0]) and torch.equal(whole[1], chunks[1])
        changed = weight.detach().clone()
        changed[-1, 0] += 1e-3  # the last chunk's last row: read in either mode
        assert gguf_weights._repack_checked(tensor, tensor.tensor_type.name, changed, order, verify,
                                            rows_per_chunk=8) is None


def test_cache_is_reused_and_checked(tmp_path):
    model = tiny_model("qwen2")
    write_gguf(model, "qwen2", tmp_path / "tiny.gguf")
    state = model.state_dict()
    cache = tmp_path / "cache" / "tiny.safetensors"
    first = gguf_weights.load_gguf_linear_weights(model, tmp_path / "tiny.gguf", cache_path=cache, log=False)
    assert not first.cached and cache.exists()
    again = tiny_model("qwen2")
    again.load_state_dict(state)
    second = gguf_weights.load_gguf_linear_weights(again, tmp_path / "tiny.gguf", cache_path=cache, log=False)
    assert second.cached and second.replaced == first.replaced and second.kept == first.kept
    for name in first.replaced:
        assert torch.equal(again.get_submodule(name).codes, model.get_submodule(name).codes)
    # Another model (other weights) does not take the cache: its layers are checked and kept.
    other = tiny_model("qwen2", seed=1)
    third = gguf_weights.load_gguf_linear_weights(other, tmp_path / "tiny.gguf", cache_path=cache, log=False)
    assert not third.cached and not third.replaced
    # A rewritten file (another modification time) makes the cache stale.
    os.utime(tmp_path / "tiny.gguf", ns=(1, 1))
    fresh = tiny_model("qwen2")
    fresh.load_state_dict(state)
    assert not gguf_weights.load_gguf_linear_weights(fresh, tmp_path / "tiny.gguf", cache_path=cache, log=False).cached


def test_generate_gives_the_float_models_tokens(tmp_path):
    from fsd_ext import generate

    target, draft = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    write_gguf(target, "qwen2", tmp_path / "t.gguf")
    write_gguf(draft, "qwen2", tmp_path / "d.gguf")
    ids = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(4))
    expected = {rule: generate(target, draft, ids, rule=rule, temperature=0.0, max_new_tokens=12, seed=0).sequences
                for rule in ("ar", "fsd")}
    gguf_weights.load_gguf_linear_weights(target, tmp_path / "t.gguf", log=False)
    gguf_weights.load_gguf_linear_weights(draft, tmp_path / "d.gguf", log=False)
    cpu_linear.set_prompt_dtype(target, torch.float32)
    cpu_linear.set_prompt_dtype(draft, torch.float32)
    for rule in ("ar", "fsd"):
        out = generate(target, draft, ids, rule=rule, temperature=0.0, max_new_tokens=12, seed=0)
        assert torch.equal(out.sequences, expected[rule])


def test_int8_activations_swap_the_types_with_an_int8_layout(tmp_path):
    """activations="int8": Q4_K / Q6_K / Q5_0 / Q8_0 layers become QuantInt8Linear, the other types
    QuantWeightLinear; the logits stay close to the float model's, the cache keeps the layout, and
    greedy decoding runs (its tokens may differ from float32's: other arithmetic)."""
    from fsd_ext import generate
    from fsd_ext.cpu_linear import QuantInt8Linear

    model = tiny_model("qwen2")
    write_gguf(model, "qwen2", tmp_path / "tiny.gguf")
    reference = tiny_model("qwen2")
    reference.load_state_dict(model.state_dict())
    cache = tmp_path / "int8.safetensors"
    report = gguf_weights.load_gguf_linear_weights(model, tmp_path / "tiny.gguf", cache_path=cache, log=False,
                                                   activations="int8")
    kinds = {name: type(model.get_submodule(name)).__name__ for name in report.replaced}
    assert kinds["model.layers.0.self_attn.q_proj"] == kinds["lm_head"] == "QuantInt8Linear"  # Q4_K, Q6_K
    assert kinds["model.layers.0.self_attn.v_proj"] == kinds["model.layers.0.mlp.up_proj"] == "QuantInt8Linear"
    assert kinds["model.layers.0.self_attn.o_proj"] == kinds["model.layers.0.mlp.gate_proj"] == "QuantWeightLinear"
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    again = tiny_model("qwen2")
    again.load_state_dict(reference.state_dict())
    second = gguf_weights.load_gguf_linear_weights(again, tmp_path / "tiny.gguf", cache_path=cache, log=False,
                                                   activations="int8")
    assert second.cached and second.replaced == report.replaced
    for name in report.replaced:
        layer = again.get_submodule(name)
        if isinstance(layer, QuantInt8Linear):
            assert torch.equal(layer.packed, model.get_submodule(name).packed)
    out = generate(model, model, ids, rule="sd", temperature=0.0, max_new_tokens=8, seed=0)
    assert torch.equal(out.sequences, generate(model, None, ids, rule="ar", temperature=0.0, max_new_tokens=8).sequences)
    with pytest.raises(ValueError, match="activations must be"):
        gguf_weights.load_gguf_linear_weights(again, tmp_path / "tiny.gguf", log=False, activations="int4")


# ----------------------------------------------------------------------------------------------
# models.load options.

def test_load_rejects_gguf_weights_without_a_gguf_checkpoint():
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        models.load("some/hf-folder", dtype=torch.float32, linear_weights="gguf")
    with pytest.raises(ValueError, match="linear_weights must be"):
        models.load("qwen2.5-coder-0.5b", dtype=torch.bfloat16, linear_weights="gguf")


def test_load_defaults_are_the_command_lines(monkeypatch):
    """models.load() without dtype / linear_weights resolves them as `fsd-ext` does ("auto"), so the
    Python API gets the same fast setup as the demo; explicit values pass through."""
    seen = []

    def resolve(name, device, dtype, linear_weights):
        seen.append((name, device, dtype, linear_weights))
        raise LookupError("stop before loading")

    monkeypatch.setattr(models, "resolve_load_options", resolve)
    for kwargs, expected in [({}, ("auto", "auto")), ({"dtype": torch.float32, "linear_weights": None},
                                                      (torch.float32, None))]:
        with pytest.raises(LookupError):
            models.load("qwen2.5-coder-1.5b", **kwargs)
        assert seen.pop() == ("qwen2.5-coder-1.5b", "cpu") + expected


@pytest.mark.parametrize("path_name,built,device,expected", [
    ("avx512", True, "cpu", ("float32", "gguf")),
    ("avx2", True, "cpu", (None, None)),
    ("avx512", False, "cpu", (None, None)),
    ("avx512", True, "cuda", ("bfloat16", None)),
])
def test_resolve_load_options(monkeypatch, path_name, built, device, expected):
    monkeypatch.setattr(cpu_linear, "quant_linear_path", lambda: path_name)
    monkeypatch.setattr(cpu_linear, "_native_op", lambda: (lambda *a: None) if built else None)
    dtype, weights = models.resolve_load_options("qwen2.5-coder-1.5b", device)
    if expected[0] is not None:
        assert (str(dtype).removeprefix("torch."), weights) == expected
    else:  # the earlier rules: bfloat16 models with AVX512-BF16, bfloat16 linear weights elsewhere
        assert weights != "gguf"
    assert models.resolve_load_options("some/hf-folder", device)[1] != "gguf"
    assert models.resolve_load_options("qwen2.5-coder-1.5b", device, "float32", "same") == (torch.float32, None)


@pytest.mark.slow
def test_smollm2_real_file(tmp_path, monkeypatch):
    """A real llama-architecture GGUF file (SmolLM2-135M, Q4_1 mostly): every linear layer swapped
    (q / k reordered back), and the logits those of the float32 model."""
    monkeypatch.setenv("FSD_EXT_CACHE", str(tmp_path))
    reference, tokenizer = models.load("smollm2-135m", dtype=torch.float32, linear_weights=None)
    model, _ = models.load("smollm2-135m", dtype=torch.float32, linear_weights="gguf")
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    cpu_linear.set_prompt_dtype(model, torch.float32)
    ids = tokenizer(["def fibonacci(n):"], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Converting a GGUF checkpoint (models._convert): tensor by tensor, as transformers loads it.

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_tensors_streamed_as_transformers_loads_them(tmp_path, arch):
    """models._gguf_tensors_as_hf yields, one at a time, exactly the tensors transformers' own
    GGUF loader builds all at once (names, row order, values)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    write_checkpoint_gguf(tiny_model(arch), arch, tmp_path / "m.gguf")
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = load_gguf_checkpoint(str(tmp_path / "m.gguf"), return_tensors=True, model_to_load=skeleton)["tensors"]
    streamed = dict(models._gguf_tensors_as_hf(tmp_path / "m.gguf", config))
    assert streamed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert streamed[name].dtype == torch.float32 and torch.equal(streamed[name], tensor.float()), name


def test_convert_writes_shards_that_load_as_the_model(tmp_path, monkeypatch):
    """_convert writes the float32 weights in several shards with an index (small shards here),
    and the folder loads as the model the GGUF holds; a file missing a tensor is an error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_model("qwen2")
    write_checkpoint_gguf(model, "qwen2", tmp_path / "m.gguf")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: _NoTokenizer())
    models._convert(tmp_path / "m.gguf", tmp_path / "converted", shard_bytes=300_000)
    shards = sorted(p.name for p in (tmp_path / "converted").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "converted" / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "converted"), dtype=torch.float32)
    ids = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the file's Q8_0 weights, not the model's: close, not equal
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0.05, atol=0.05)
        direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
        assert torch.equal(loaded(ids).logits, direct(ids).logits)
    deeper = type(loaded.config)(**{**loaded.config.to_dict(), "num_hidden_layers": 3,  # one more than the file
                                    "layer_types": None})
    with pytest.raises(RuntimeError, match="no tensor in the file for 12 parameters"):
        list(models._gguf_tensors_as_hf(tmp_path / "m.gguf", deeper))


class _NoTokenizer:
    """(the test files hold no vocabulary: _convert's tokenizer step saves nothing)"""

    def save_pretrained(self, folder):
        pass


@pytest.mark.parametrize("path_name,device,expected", [
    ("avx512-vnni", "cpu", "int8"), ("portable", "cpu", "float32"), ("", "cpu", "float32"),
    ("avx512-vnni", "cuda", "float32"),
])
def test_default_activations_follow_the_cpu(monkeypatch, path_name, device, expected):
    """int8 activations by default only where the int8 kernel has its vector path (AVX512-VNNI);
    elsewhere the float32-activation kernels (a portable int8 loop would be slower than them)."""
    monkeypatch.setattr(cpu_linear, "int8_linear_path", lambda: path_name)
    assert models.default_activations(device) == expected
    with pytest.raises(ValueError, match="activations must be"):
        models.load("qwen2.5-coder-1.5b", activations="int4")
