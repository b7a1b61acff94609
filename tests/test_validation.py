"""Issue 58 part 2: every bad argument is refused with a clear ValueError/TypeError before any
expensive work (model loading, prefill, a whole calibration), the same way in the ops, the fake
(meta) kernels, fsd_ext.generate, fsd_ext.hf.generate and the `fsd-ext` command line."""

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fsd_ext
from fsd_ext import ops

if ops._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext._C is not built", allow_module_level=True)


def logits(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


# ----------------------------------------------------------------------------------------------
# The ops.

def test_offset_tensor_below_zero_is_refused_like_the_int():
    target, draft, tokens = logits(2, 3, 10), logits(2, 2, 10), torch.zeros(2, 2, dtype=torch.int64)
    for offset in (-1, torch.tensor(-1), torch.tensor([-1])):
        with pytest.raises(ValueError, match="offset must be >= 0"):
            fsd_ext.accept(target, draft, tokens, seed=0, offset=offset)
        with pytest.raises(ValueError, match="offset must be >= 0"):
            fsd_ext.sample(target[:, 0], seed=0, offset=offset)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        fsd_ext.philox_uniforms(0, torch.tensor(-1), 2, 2)


@pytest.mark.parametrize("top_k", [2**63, 2**70, True, 1.5, -1, 0])
def test_top_k_outside_int64_or_not_a_count_is_refused(top_k):
    target, draft, tokens = logits(2, 3, 10), logits(2, 2, 10), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="top_k"):
        fsd_ext.accept(target, draft, tokens, seed=0, top_k=top_k)
    with pytest.raises(ValueError, match="top_k"):
        fsd_ext.sample(target[:, 0], seed=0, top_k=top_k)
    with pytest.raises(ValueError, match="top_k"):
        fsd_ext.divergence(target, target, top_k=top_k)


def test_largest_top_k_is_off():
    target = logits(2, 10)
    assert torch.equal(fsd_ext.sample(target, seed=3, top_k=2**63 - 1), fsd_ext.sample(target, seed=3))


def test_bool_is_not_an_offset_or_a_count():
    target, draft, tokens = logits(2, 3, 10), logits(2, 2, 10), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="offset"):
        fsd_ext.accept(target, draft, tokens, seed=0, offset=True)
    with pytest.raises(ValueError, match="rows"):
        fsd_ext.philox_uniforms(0, 0, True, 2)
    with pytest.raises(ValueError, match="positions"):
        fsd_ext.philox_uniforms(0, 0, 2, True)


# The fake kernel must refuse what the real one refuses (torch.compile traces with it): each case
# is (description, args builder); the builder takes a tensor factory so the same inputs are made
# real (CPU) and fake.
def bad_accept_inputs():
    long = torch.int64
    yield "int logits", lambda t: (t(2, 3, 10, dtype=long), t(2, 2, 10, dtype=long), t(2, 2, dtype=long)), TypeError
    yield "dtypes differ", lambda t: (t(2, 3, 10), t(2, 2, 10, dtype=torch.float16), t(2, 2, dtype=long)), TypeError
    yield "float draft tokens", lambda t: (t(2, 3, 10), t(2, 2, 10), t(2, 2)), TypeError
    yield "draft batch differs", lambda t: (t(2, 3, 10), t(1, 2, 10), t(2, 2, dtype=long)), ValueError
    yield "draft K differs", lambda t: (t(2, 3, 10), t(2, 1, 10), t(2, 2, dtype=long)), ValueError
    yield "draft vocab larger", lambda t: (t(2, 3, 10), t(2, 2, 11), t(2, 2, dtype=long)), ValueError
    yield "tokens shape", lambda t: (t(2, 3, 10), t(2, 2, 10), t(2, 3, dtype=long)), ValueError
    yield "2-D logits", lambda t: (t(2, 10), t(2, 10), t(2, 2, dtype=long)), ValueError
    yield "no positions", lambda t: (t(2, 0, 10), t(2, 0, 10), t(2, 0, dtype=long)), ValueError
    yield "empty vocab", lambda t: (t(2, 3, 0), t(2, 2, 0), t(2, 2, dtype=long)), ValueError


@pytest.mark.parametrize("name,build,error", list(bad_accept_inputs()), ids=lambda x: x if isinstance(x, str) else "")
def test_fake_accept_refuses_what_the_cpu_kernel_refuses(name, build, error):
    def real(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype)

    with pytest.raises(error):
        fsd_ext.accept(*build(real), seed=0)
    with FakeTensorMode() as mode:
        fake_inputs = build(lambda *shape, dtype=torch.float32: mode.from_tensor(real(*shape, dtype=dtype)))
        with pytest.raises(error):
            fsd_ext.accept(*fake_inputs, seed=0)
    meta_inputs = build(lambda *shape, dtype=torch.float32: real(*shape, dtype=dtype).to("meta"))
    with pytest.raises(error):
        torch.ops.fsd_ext.accept(*meta_inputs, None, None, 0.0, None, 1.0, None, 1.0, False, None, 0,
                                 False, None, 0, 2, 2, 0, 1.0, 0.0, 0, False)


def test_fake_accept_shapes_for_good_inputs():
    with FakeTensorMode() as mode:
        target, draft = mode.from_tensor(logits(3, 3, 10)), mode.from_tensor(logits(3, 2, 8))
        tokens = mode.from_tensor(torch.zeros(3, 2, dtype=torch.int32))
        out = fsd_ext.accept(target, draft, tokens, seed=0, return_divergence=True)
    assert [tuple(t.shape) for t in out] == [(3, 3), (3,), (3,), (3, 2)]


def _threshold_entry_points():
    """Every Python place that takes a threshold from a caller, each given `value`."""
    from fsd_ext.bench.grid import parse_thresholds
    from fsd_ext.decoding.calibrate import check_calibrate_options
    from fsd_ext.decoding.checks import check_options
    from fsd_ext.engines import vllm as plugin

    calibrate = dict(rule="fsd", divergence="js", max_deviation=0.02, temperature=0.0, refine_steps=0, seed=0)
    return {
        "generate": lambda value: check_options(threshold=value),
        "vllm request": lambda value: plugin.check_threshold(value, "fsd_threshold"),
        "vllm engine": lambda value: plugin.FsdConfig.from_additional_config({"fsd": {"threshold": value}}),
        "calibrate": lambda value: check_calibrate_options(thresholds=[0.1, value], **calibrate),
        "bench": lambda value: parse_thresholds(f"js=0.1,{value}"),
    }


@pytest.mark.parametrize("entry", ["generate", "vllm request", "vllm engine", "calibrate", "bench"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, -float("inf")])
def test_every_threshold_entry_point_refuses_the_same_values(entry, bad):
    """One check (fsd_ext.types.check_threshold) behind every entry point: NaN, negative."""
    with pytest.raises(ValueError, match="threshold"):
        _threshold_entry_points()[entry](bad)


@pytest.mark.parametrize("entry", ["generate", "vllm request", "vllm engine", "calibrate", "bench"])
def test_every_threshold_entry_point_takes_the_same_values(entry):
    for good in (0.0, 0.3, 7):
        _threshold_entry_points()[entry](good)


def _option_entry_points():
    """Every Python place that takes (rule, divergence, threshold, div_temperature), as a dict."""
    from fsd_ext.bench.grid import Config
    from fsd_ext.decoding.calibrate import check_calibrate_options
    from fsd_ext.decoding.checks import check_options
    from fsd_ext.engines import vllm as plugin

    calibrate = dict(max_deviation=0.02, thresholds=None, temperature=0.0, refine_steps=0, seed=0)
    return {
        "generate": lambda o: check_options(**o),
        "vllm engine": lambda o: plugin.FsdConfig.from_additional_config({"fsd": o}),
        "calibrate": lambda o: check_calibrate_options(rule=o["rule"], divergence=o["divergence"], **calibrate),
        "bench": lambda o: Config(**o),
    }


@pytest.mark.parametrize("entry,field,bad", [
    (entry, field, bad)
    for field, bad in [("rule", "typical?"), ("divergence", "l2"), ("div_temperature", 0.0),
                       ("div_temperature", float("inf"))]
    for entry in ["generate", "vllm engine", "calibrate", "bench"]
    if not (entry == "calibrate" and field == "div_temperature")])  # (calibrate passes the loop's)
def test_every_entry_point_checks_the_verify_options_alike(entry, field, bad):
    """types.VerifyOptions.check() is the one check of a rule and its test, wherever they come in."""
    options = dict(rule="fsd", divergence="js", threshold=0.1, div_temperature=1.0)
    _option_entry_points()[entry](options)
    with pytest.raises(ValueError, match=field):
        _option_entry_points()[entry]({**options, field: bad})


def test_verify_options_name_the_field_as_the_caller_knows_it():
    from fsd_ext.types import VerifyOptions

    with pytest.raises(ValueError, match="fsd_threshold must be a float >= 0"):
        VerifyOptions(threshold=-1.0).check(name=lambda field: f"fsd_{field}")
    with pytest.raises(ValueError, match="threshold must be a float >= 0 .inf allowed., got"):
        VerifyOptions(threshold=torch.tensor([0.1])).check(per_row=False)
    assert VerifyOptions(rule="ar").check().rule == "ar"
    with pytest.raises(ValueError, match="rule must be one of"):
        VerifyOptions(rule="ar").check(rules=fsd_ext.RULES)


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_bad_threshold_tensor_raises_value_error_like_the_float(bad):
    """A NaN (or negative) value in a [B] threshold tensor raised RuntimeError from the CPU op where
    the float form raises ValueError (issue 59, item 7)."""
    target, draft, tokens = torch.randn(2, 3, 8), torch.randn(2, 2, 8), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="threshold"):
        fsd_ext.accept(target, draft, tokens, threshold=bad, seed=0)
    with pytest.raises(ValueError, match=r"threshold\[1\]"):
        fsd_ext.accept(target, draft, tokens, threshold=torch.tensor([0.1, bad]), seed=0)


# ----------------------------------------------------------------------------------------------
# fsd_ext.generate and fsd_ext.hf.generate: refused before the prompts' forwards.

import helpers  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(0, 1, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft():
    return helpers.tiny_llama(1, 1, vocab=VOCAB)


@pytest.fixture
def no_forward(monkeypatch):
    """Any model forward fails the test: a refusal must come before the prompts' forwards."""
    generate_module = importlib.import_module("fsd_ext.decoding.model")

    def forward(*args, **kwargs):
        raise AssertionError("a model ran before the arguments were checked")

    monkeypatch.setattr(generate_module.CachedModel, "_forward", forward)


@pytest.mark.parametrize("kwargs,match", [
    (dict(pad_token_id=-1), "pad_token_id"),
    (dict(pad_token_id=VOCAB), "pad_token_id"),
    (dict(pad_token_id=True), "pad_token_id"),
    (dict(num_draft_tokens=True), "num_draft_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(temperature=True), "temperature"),
    (dict(threshold=True), "threshold"),
    (dict(top_k=2**63), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=True), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(div_temperature=0.0), "div_temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(threshold=torch.tensor([0.1, 0.2, 0.3])), "threshold"),
    (dict(threshold=torch.tensor([0.1, float("nan")])), "threshold"),
])
def test_bad_options_are_refused_before_any_forward(target, draft, no_forward, kwargs, match):
    ids, mask = helpers.left_padded_prompts([3, 4], VOCAB, seed=1)
    with pytest.raises((ValueError, TypeError), match=match):
        fsd_ext.generate(target, draft, ids, mask, **dict(dict(max_new_tokens=4), **kwargs))


def test_model_default_pad_outside_the_vocabulary_is_refused(target, draft, no_forward, monkeypatch):
    monkeypatch.setattr(target.generation_config, "pad_token_id", None)
    monkeypatch.setattr(target.generation_config, "eos_token_id", 50256)  # GPT-2's, past this vocab
    ids, mask = helpers.left_padded_prompts([3, 4], VOCAB, seed=1)
    with pytest.raises(ValueError, match=r"pad_token_id .*\[0, 128\), got 50256"):
        fsd_ext.generate(target, draft, ids, mask, max_new_tokens=4)


def test_batch_of_zero_rows_is_refused(target, draft, no_forward):
    ids, mask = helpers.left_padded_prompts([3, 4], VOCAB, seed=1)
    with pytest.raises(ValueError, match="at least one row"):
        fsd_ext.generate(target, draft, ids[:0], mask[:0], max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one row"):
        fsd_ext.generate(target, draft, ids[:0], max_new_tokens=4)


def test_hf_generate_refuses_a_pad_outside_the_vocabulary(target, draft, no_forward):
    from fsd_ext import hf

    ids, mask = helpers.left_padded_prompts([3, 4], VOCAB, seed=1)
    for pad in (-1, VOCAB):
        with pytest.raises(ValueError, match="pad_token_id"):
            target.generate(ids, attention_mask=mask, custom_generate=hf.generate, draft_model=draft,
                            do_sample=False, max_new_tokens=4, pad_token_id=pad)


def tiny_gpt2(seed, n_positions=16):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=32, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("rule", ["ar", "sd"])
def test_learned_positions_cap_prompt_plus_max_new_tokens(rule):
    model = tiny_gpt2(0)
    ids, mask = helpers.left_padded_prompts([3, 4], VOCAB, seed=1)  # longest prompt: 4 tokens
    out = fsd_ext.generate(model, model, ids, mask, rule=rule, max_new_tokens=12, eos_token_id=[])
    assert out.sequences.shape == (2, 16)
    with pytest.raises(ValueError, match=r"16 positions .* at most 12"):
        fsd_ext.generate(model, model, ids, mask, rule=rule, max_new_tokens=13, eos_token_id=[])


def test_rotary_models_may_run_past_max_position_embeddings():
    model = helpers.tiny_llama(0, 1, vocab=VOCAB, max_positions=8)
    ids, mask = helpers.left_padded_prompts([3, 4], VOCAB, seed=1)
    out = fsd_ext.generate(model, None, ids, mask, rule="ar", max_new_tokens=12, eos_token_id=[])
    assert out.sequences.shape == (2, 16)


# ----------------------------------------------------------------------------------------------
# The command line: every argument checked before anything is installed, converted or loaded.

@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """Installing, assembling, converting or loading a model fails the test."""
    from fsd_ext import models

    monkeypatch.setenv("FSD_EXT_CACHE", str(tmp_path / "cache"))

    def fail(*args, **kwargs):
        raise AssertionError("a model was installed, converted or loaded before the check")

    for name in ("load", "resolve", "ensure_installed", "assemble_gguf", "_convert"):
        monkeypatch.setattr(models, name, fail)


def cli_error(argv, capsys):
    from fsd_ext import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsd-ext: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,match", [
    (["demo", "--num-draft-tokens", "0"], "num_draft_tokens"),
    (["demo", "--max-new-tokens", "0"], "max_new_tokens"),
    (["demo", "--top-k", "0"], "top_k"),
    (["demo", "--top-p", "1.5"], "top_p"),
    (["demo", "--min-p", "2"], "min_p"),
    (["demo", "--temperature", "-1"], "temperature"),
    (["demo", "--div-temperature", "0"], "div_temperature"),
    (["demo", "--draft-confidence", "2"], "draft_confidence"),
    (["demo", "--rules", "ar,fast"], "rule"),
    (["demo", "--threads", "-1"], "--threads"),
    (["demo", "--threads", "0"], "--threads"),
    (["demo", "--device", "tpu"], "--device"),
    (["generate", "--target", "t", "--draft", "d", "--prompt", "hi", "--threshold", "-1"], "threshold"),
    (["calibrate", "--thresholds", "-1"], "thresholds"),
    (["calibrate", "--refine-steps", "-1"], "refine_steps"),
])
def test_cli_refuses_a_bad_argument_before_loading(argv, match, no_loading, capsys):
    assert match in cli_error(argv, capsys)


def test_cli_refuses_cuda_without_a_gpu(no_loading, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "--device cuda" in cli_error(["demo", "--device", "cuda"], capsys)


def test_cli_calibrate_refuses_a_json_path_in_a_missing_folder(no_loading, capsys, tmp_path):
    err = cli_error(["calibrate", "--json", str(tmp_path / "missing" / "out.json")], capsys)
    assert "does not exist" in err


def test_cli_refuses_a_model_that_is_nowhere(no_loading, capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in cli_error(["demo", "--target", str(empty)], capsys)
    for missing in (tmp_path / "nothere", "./nothere", "model.gguf"):
        assert "no such .gguf file or model folder" in cli_error(["demo", "--draft", str(missing)], capsys)


def test_models_load_refuses_a_model_that_is_nowhere(tmp_path):
    from fsd_ext import models

    with pytest.raises(ValueError, match="no config.json"):
        models.load(str(tmp_path))
    with pytest.raises(ValueError, match="no such .gguf file"):
        models.load(str(tmp_path / "nothere"))


def test_cli_checks_pass_for_good_arguments(no_loading, tmp_path):
    from fsd_ext import cli

    for argv in (["demo"], ["demo", "--rules", "ar", "--draft", str(tmp_path / "unused")],
                 ["generate", "--target", "org/name", "--draft", "name", "--prompt", "hi", "--top-k", "5"],
                 ["calibrate", "--json", str(tmp_path / "out.json"), "--max-deviation", "0.01,0.05"]):
        cli.check_args(cli.build_parser().parse_args(argv))


def test_cli_a_user_error_found_after_loading_is_one_line(monkeypatch, capsys):
    from fsd_ext import cli

    def mismatch(args, need_draft):
        raise ValueError("the draft's tokenizer differs from the target's")

    monkeypatch.setattr(cli, "_load_pair", mismatch)
    assert "tokenizer differs" in cli_error(["generate", "--target", "t", "--draft", "d", "--prompt", "hi"], capsys)


def test_vllm_plugin_refuses_a_draft_of_another_vocabulary():
    """fsd_ext.vllm's check on stand-ins for vLLM's configs (vLLM itself is not needed)."""
    from types import SimpleNamespace as NS

    from fsd_ext.engines import vllm as plugin

    def engine(draft_vocab, draft_bos=1, heterogeneous=False):
        spec = NS(draft_model_config=NS(hf_text_config=NS(vocab_size=draft_vocab, bos_token_id=draft_bos)),
                  use_heterogeneous_vocab=heterogeneous)
        return NS(model_config=NS(hf_text_config=NS(vocab_size=VOCAB, bos_token_id=1)), speculative_config=spec)

    plugin.check_draft(engine(VOCAB))
    with pytest.raises(ValueError, match="vocab_size 128 vs 96"):
        plugin.check_draft(engine(96))
    with pytest.raises(ValueError, match="bos_token_id 1 vs 2"):
        plugin.check_draft(engine(VOCAB, draft_bos=2))
    plugin.check_draft(engine(96, heterogeneous=True))  # vLLM maps the ids; FSD keeps vLLM's rule
