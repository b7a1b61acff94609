"""fsd_ext.cpu_linear: the few-row CPU linear is F.linear up to float rounding, and patching a
model is reversible and changes nothing else."""

import os

import pytest
import torch
import torch.nn.functional as F

from fsd_ext import cpu_linear
from fsd_ext.cpu_linear import MAX_ROWS, skinny_linear, use_skinny_cpu_linears

needs_ext = pytest.mark.skipif(cpu_linear._IMPORT_ERROR is not None, reason="extension not built")


@pytest.fixture(params=["kernel", "matmul"])
def path(request, monkeypatch):
    """Run a test through the compiled kernel and through the (W @ x^T)^T fallback."""
    if request.param == "kernel" and cpu_linear._IMPORT_ERROR is not None:
        pytest.skip("extension not built")
    if request.param == "matmul":
        monkeypatch.setattr(cpu_linear, "_native_op", lambda: None)
    return request.param


@pytest.mark.parametrize("shape", [(1, 64), (6, 64), (1, 6, 64), (2, 3, 64), (MAX_ROWS, 64),
                                   (MAX_ROWS + 1, 64), (0, 64), (2, 0, 64), (5, 7), (3, 1)])
@pytest.mark.parametrize("out", [96, 1, 131])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(path, shape, out, bias):
    """Odd sizes hit the kernel's tails: in % 8, a lone last weight row, partial row groups."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out, shape[-1], generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(*shape, generator=gen)
    out = skinny_linear(x, weight, b)
    expected = F.linear(x, weight, b)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_ext
def test_kernel_matches_float64_on_model_sizes():
    """Every row group (1..16 rows) on a real layer shape, against a float64 product."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 1536, generator=gen)
    bias = torch.randn(1000, generator=gen)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, 1536, generator=gen)
        exact = (x.double() @ weight.double().t() + bias.double()).float()
        torch.testing.assert_close(torch.ops.fsd_cpu_linear.skinny_linear(x, weight, bias), exact,
                                   rtol=1e-4, atol=1e-3)


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 6, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_bfloat16_matches_float32_product_rounded(rows, bias):
    """bfloat16 weights and activations: float32 sums of the exact bfloat16 products, rounded to
    bfloat16 once (what F.linear's bfloat16 path computes, up to its own summation order)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(257, 1539, generator=gen).bfloat16()  # odd sizes: the kernel's tails
    b = torch.randn(257, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 1539, generator=gen).bfloat16()
    out = torch.ops.fsd_cpu_linear.skinny_linear(x, weight, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 257)
    exact = x.double() @ weight.double().t() + (b.double() if bias else 0.0)
    # One bfloat16 rounding (relative 2^-8) plus float32 summation error.
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=2 ** -7, atol=2e-2)
    # Through the Python entry point too: the kernel from 2 rows on, and for one row where it has
    # AVX512-BF16 or AVX2 (else one bfloat16 row goes to F.linear).
    kernel_row = cpu_linear.bf16_dot_available() or cpu_linear.avx2_available()
    expected_entry = out if rows > 1 or kernel_row else F.linear(x, weight, b)
    torch.testing.assert_close(skinny_linear(x, weight, b), expected_entry, rtol=0, atol=0)


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())


@needs_ext
@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or os.uname().machine != "x86_64",
                    reason="reads the x86 CPU flags of Linux")
def test_intrinsics_paths_follow_the_cpu_flags():
    """The AVX512-BF16 and AVX2 paths are taken exactly where the CPU has the instructions (the
    extension is built with GCC here; the kernel's own checks of those paths are in test_core)."""
    flags = _cpu_flags()
    assert cpu_linear.bf16_dot_available() == ("avx512_bf16" in flags)
    assert cpu_linear.avx2_available() == ("avx2" in flags and "fma" in flags)


@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_skinny_pays_off_for_bfloat16_with_the_dot_path(monkeypatch, dot, vendor):
    monkeypatch.setattr(cpu_linear, "bf16_dot_available", lambda: dot)
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    cpu_linear.skinny_pays_off.cache_clear()
    try:
        assert cpu_linear.skinny_pays_off(torch.bfloat16) is (dot or vendor != "GenuineIntel")
        assert cpu_linear.skinny_pays_off(torch.float32) is (vendor != "GenuineIntel")
    finally:
        cpu_linear.skinny_pays_off.cache_clear()


@pytest.mark.parametrize("dot", [True, False])
def test_default_dtype(monkeypatch, dot):
    from fsd_ext import models
    monkeypatch.setattr(cpu_linear, "bf16_dot_available", lambda: dot)
    assert models.default_dtype("cuda") == torch.bfloat16
    assert models.default_dtype("cuda:1") == torch.bfloat16
    assert models.default_dtype("cpu") == (torch.bfloat16 if dot else torch.float32)


@needs_ext
@pytest.mark.parametrize("x,weight,bias,match", [
    (torch.randn(2, 8).double(), torch.randn(4, 8), None, "float32"),
    (torch.randn(2, 8).bfloat16(), torch.randn(4, 8), None, "both bfloat16, or float32 and bfloat16"),
    (torch.randn(2, 8).half(), torch.randn(4, 8).half(), None, "both bfloat16, or float32 and bfloat16"),
    (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), torch.randn(4).bfloat16(), "bias must be"),
    (torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(4), "bias must be"),
    (torch.randn(2, 8), torch.randn(8, 4).t(), None, "contiguous rows"),
    (torch.randn(2, 7), torch.randn(4, 8), None, "match weight"),
    (torch.randn(17, 8), torch.randn(4, 8), None, "1 to 16 rows"),
    (torch.randn(0, 8), torch.randn(4, 8), None, "1 to 16 rows"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), "bias must be"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(4).double(), "bias must be"),
])
def test_kernel_rejects_bad_arguments(x, weight, bias, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fsd_cpu_linear.skinny_linear(x, weight, bias)


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


def test_fast_path_is_taken_without_grad(monkeypatch, path):
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


@pytest.mark.parametrize("vendor,mkl,pays_off", [("GenuineIntel", True, False), ("AuthenticAMD", True, True),
                                                 ("GenuineIntel", False, True), ("", True, True)])
def test_skinny_pays_off_except_with_mkl_on_intel(monkeypatch, vendor, mkl, pays_off):
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    cpu_linear.skinny_pays_off.cache_clear()
    try:
        assert cpu_linear.skinny_pays_off() is pays_off
    finally:
        cpu_linear.skinny_pays_off.cache_clear()


def test_cpu_vendor_reads_this_machine():
    vendor = cpu_linear.cpu_vendor()
    assert isinstance(vendor, str)
    if os.path.exists("/proc/cpuinfo") and "vendor_id" in open("/proc/cpuinfo").read():
        assert vendor  # a Linux x86 machine names its vendor


@needs_ext
def test_bench_cpu_linear_runs(tmp_path):
    """benchmarks/cpu_linear/bench_cpu_linear.py on small shapes: a row per (shape, rows) with a time
    for every path asked for (an int8 layout only where its blocks divide the shape), written out; a
    misspelt shape or path is an error."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_linear" / "bench_cpu_linear.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_linear", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    output = tmp_path / "out.json"
    paths = "fsd q4,torch int4,fsd q8g32,torch int8,fsd bf16,F.linear f32,fsd int8 q4k,fsd int8 q5_0,torch dyn int8 (x86)"
    rows = bench.main(["--shapes", "0.5b/k_proj,1.5b/k_proj", "--rows", "1,3", "--repeats", "1",
                       "--set-mb", "1", "--paths", paths, "--output", str(output)])
    assert [(r["shape"], r["rows"]) for r in rows] == [
        ("0.5b/k_proj", 1), ("0.5b/k_proj", 3), ("1.5b/k_proj", 1), ("1.5b/k_proj", 3)]
    for r in rows:  # Q4_K's blocks of 256 do not divide the 0.5B's 896 features
        expected = set(paths.split(",")) - ({"fsd int8 q4k"} if r["shape"].startswith("0.5b") else set())
        assert set(r["ms"]) == expected and min(r["ms"].values()) > 0
    assert json.loads(output.read_text())["results"] == rows
    for bad in (["--shapes", "0.5b/kproj"], ["--paths", "fsd q5"]):
        with pytest.raises(SystemExit):
            bench.main([*bad, "--output", str(output)])


# ----------------------------------------------------------------------------------------------
# bfloat16 weights with float32 activations (Bfloat16WeightLinear).

def _bf16_weight_case(rows, out, inp, seed=3):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=gen).bfloat16()
    bias = torch.randn(out, generator=gen)
    x = torch.randn(rows, inp, generator=gen)
    # float64 products of the stored values: what float32 sums approximate
    exact = (x.double() @ weight.double().t() + bias.double()).float()
    return x, weight, bias, exact


@needs_ext
@pytest.mark.parametrize("rows", [1, 2, 5, 6, MAX_ROWS])
@pytest.mark.parametrize("inp", [1536, 77])
def test_kernel_float32_x_bfloat16_weight(rows, inp):
    """float32 x and bias with a bfloat16 weight: float32 sums of the exact products, float32 out."""
    x, weight, bias, exact = _bf16_weight_case(rows, 131, inp)
    y = torch.ops.fsd_cpu_linear.skinny_linear(x, weight, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 131)
    torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-3)
    # negative control: float32 x rounded to bfloat16 first (what a bfloat16 model computes) is
    # measurably further off, so the check above would catch x being rounded
    rounded = (x.bfloat16().double() @ weight.double().t() + bias.double()).float()
    assert (rounded - exact).abs().max() > 10 * (y - exact).abs().max()


@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 40])
def test_widening_linear_for_prompt_rows(monkeypatch, rows):
    """Prompt-sized inputs: F.linear with the weight widened block by block (blocks of 3 rows
    here, so 131 rows end in a partial block)."""
    monkeypatch.setattr(cpu_linear, "_WIDENED_BLOCK_BYTES", 3 * 4 * 64)
    x, weight, bias, exact = _bf16_weight_case(rows, 131, 64)
    with torch.no_grad():
        y = skinny_linear(x.reshape(2, rows // 2, 64) if rows % 2 == 0 else x, weight, bias)
    torch.testing.assert_close(y.reshape(rows, 131), exact, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert skinny_linear(x, weight).is_contiguous()


def test_bfloat16_weights_without_the_kernel(monkeypatch):
    """No compiled kernel, or autograd: F.linear on the widened weight."""
    monkeypatch.setattr(cpu_linear, "_native_op", lambda: None)
    x, weight, bias, exact = _bf16_weight_case(3, 20, 24)
    with torch.no_grad():
        torch.testing.assert_close(skinny_linear(x, weight, bias), exact, rtol=1e-4, atol=1e-4)
    x.requires_grad_(True)
    skinny_linear(x, weight, bias).sum().backward()
    torch.testing.assert_close(x.grad, weight.float().sum(0).expand(3, 24))


def _model_with_rounded_weights(model):
    """A float32 copy of `model` whose linear weights hold their bfloat16 roundings (each its own
    tensor: a weight tied to the embedding is untied, the embedding keeps its values)."""
    import copy
    rounded = copy.deepcopy(model)
    for module in rounded.modules():
        if type(module) is torch.nn.Linear:
            module.weight = torch.nn.Parameter(module.weight.detach().bfloat16().float())
    return rounded


@pytest.mark.parametrize("tied", [False, True])
def test_store_linear_weights_bfloat16(tied):
    """Every nn.Linear weight becomes bfloat16 and the rest stays float32; the logits are those of
    the float32 model with its linear weights rounded (up to float32 summation order), and a
    weight tied to the embedding is untied, the embedding keeping its float32 values."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    embedding_before = model.model.embed_tokens.weight.detach().clone()
    reference = _model_with_rounded_weights(model)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert cpu_linear.store_linear_weights_bfloat16(model) == linears == 2 * 7 + 1
    assert cpu_linear.store_linear_weights_bfloat16(model) == 0  # nothing float32 left to convert
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert type(module) is cpu_linear.Bfloat16WeightLinear
            assert module.weight.dtype == torch.bfloat16 and not module.weight.requires_grad
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, embedding_before)
    assert model.model.norm.weight.dtype == torch.float32
    ids = torch.randint(0, 96, (2, 21))  # 42 rows: the widening GEMM; then 1-row and 6-row steps
    with torch.no_grad():
        for tokens in (ids, ids[:1, :1], ids[:1, :6]):
            logits = model(tokens).logits
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, reference(tokens).logits, rtol=1e-4, atol=1e-4)
    with cpu_linear.skinny_cpu_linears(model):  # patching and restoring keeps them working
        with torch.no_grad():
            torch.testing.assert_close(model(ids[:1, :3]).logits, reference(ids[:1, :3]).logits,
                                       rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:1, :3]).logits, reference(ids[:1, :3]).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device,dtype,built,pays_off,expected", [
    ("cpu", torch.float32, True, True, torch.bfloat16), ("cpu", torch.float32, False, True, None),
    ("cpu", torch.float32, True, False, None), ("cpu", torch.bfloat16, True, True, None),
    ("cuda", torch.float32, True, True, None)])
def test_default_linear_weights(monkeypatch, device, dtype, built, pays_off, expected):
    from fsd_ext import models
    monkeypatch.setattr(cpu_linear, "_native_op", lambda: (lambda *a: None) if built else None)
    monkeypatch.setattr(cpu_linear, "skinny_pays_off", lambda dtype: pays_off)
    assert models.default_linear_weights(device, dtype) == expected


@pytest.mark.parametrize("dtype,device,weights", [
    (torch.float32, "cuda", torch.bfloat16), (torch.float16, "cpu", torch.bfloat16),
    (torch.bfloat16, "cpu", torch.float32)])
def test_load_rejects_other_linear_weight_combinations(dtype, device, weights):
    from fsd_ext import models
    with pytest.raises(ValueError, match="linear_weights must be"):
        models.load("no-such-model", dtype=dtype, device=device, linear_weights=weights)


@pytest.mark.parametrize("setting,pays_off,patched", [("auto", True, True), ("auto", False, False),
                                                      (True, False, True), (False, True, False)])
def test_load_puts_the_kernel_in_where_it_pays_off(monkeypatch, setting, pays_off, patched):
    """models.load(cpu_linears=...): "auto" routes the model's nn.Linear modules through
    skinny_linear on a CPU where it pays off (cpu_linear.skinny_pays_off), True always, False never."""
    transformers = pytest.importorskip("transformers")
    from fsd_ext import models

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    tiny = transformers.LlamaForCausalLM(config)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: type("Tokenizer", (), {"pad_token_id": 0})())
    monkeypatch.setattr(models, "resolve", lambda name, linears=True: name)
    monkeypatch.setattr(cpu_linear, "skinny_pays_off", lambda dtype: pays_off)
    model, _ = models.load("some/folder", dtype=torch.float32, linear_weights=None, cpu_linears=setting)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(("forward" in m.__dict__) == patched for m in linears)
    with pytest.raises(ValueError, match="cpu_linears must be"):
        models.load("some/folder", dtype=torch.float32, linear_weights=None, cpu_linears="yes")
