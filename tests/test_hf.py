"""fsd_ext.hf: FSD behind Hugging Face `model.generate(custom_generate=...)`, on tiny randomly
initialised Llama models (CPU)."""

import subprocess
import sys

import pytest
import torch

import fsd_ext

transformers = pytest.importorskip("transformers", minversion="5")  # fsd_ext.hf needs 5.x
from transformers.generation.utils import GenerateDecoderOnlyOutput  # noqa: E402

import fsd_ext.engines.hf  # noqa: E402
import fsd_ext.hf  # noqa: E402
import helpers  # noqa: E402
from helpers import EOS, PAD, left_padded_prompts  # noqa: E402

VOCAB = 96


def tiny_llama(seed, layers):
    """A random Llama whose scaled-up head makes next-token choices clear-cut (few argmax ties)."""
    return helpers.tiny_llama(seed, layers, vocab=VOCAB, hidden=32, heads=2, kv_heads=1, max_positions=256,
                              logit_scale=8.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=2)


@pytest.fixture(scope="module")
def draft(target):
    # The target's embeddings, first layer and head: the two agree often but not always.
    model = tiny_llama(1, layers=1)
    model.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    model.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    model.lm_head.load_state_dict(target.lm_head.state_dict())
    return model


def prompts(lengths, seed=0):
    return left_padded_prompts(lengths, VOCAB, seed)


def fsd_hf(target, draft, ids, mask=None, **kwargs):
    return target.generate(ids, attention_mask=mask, custom_generate=fsd_ext.hf.generate,
                           draft_model=draft, **kwargs)


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


# ----------------------------------------------------------------------------------------------
# Greedy SD is the target's own greedy decoding.

@pytest.mark.parametrize("k", [1, 4])
def test_greedy_sd_matches_model_generate_batch1(target, draft, k):
    ids, mask = prompts([7], seed=1)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    out = fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=24, fsd_rule="sd",
                 fsd_threshold=0.0, fsd_num_draft_tokens=k)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    assert out.tolist() == expected.tolist()


def test_greedy_sd_matches_model_generate_batch4_left_padded(target, draft):
    ids, mask = prompts([3, 9, 1, 6], seed=2)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=20, fsd_rule="sd",
                 fsd_threshold=0.0, fsd_num_draft_tokens=3)
    assert out.tolist() == expected.tolist()


def test_greedy_sd_stops_rows_at_eos_like_model_generate(target, draft):
    ids, mask = prompts([4, 8, 2], seed=3)
    # An EOS the target actually emits early in some row, so rows end at different lengths.
    free_run = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    eos = int(free_run[0, ids.shape[1] + 3])
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                               eos_token_id=eos)
    out = fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=16, eos_token_id=eos,
                 fsd_rule="sd", fsd_num_draft_tokens=4)
    assert out.tolist() == expected.tolist()
    assert (out[0, ids.shape[1] + 4:] == PAD).all()  # row 0 did stop at its EOS


# ----------------------------------------------------------------------------------------------
# The FSD knob and the mapping of generate's options.

def test_huge_threshold_returns_the_draft_greedy_continuation(target, draft):
    k = 4
    ids, mask = prompts([6, 3], seed=5)
    # One step: K drafts, all accepted, then the target's bonus token.
    out = fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=k + 1, fsd_rule="fsd",
                 fsd_threshold=1e9, fsd_num_draft_tokens=k, eos_token_id=None)
    draft_greedy = draft.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                                  eos_token_id=None)
    target_greedy = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                                    eos_token_id=None)
    assert not torch.equal(draft_greedy, target_greedy)  # else this test could not tell them apart
    assert out[:, :-1].tolist() == draft_greedy.tolist()


def test_options_reach_fsd_ext_generate(target, draft, monkeypatch):
    seen = {}

    def fake_generate(target_model, draft_model, input_ids, attention_mask, **kwargs):
        seen.update(kwargs, attention_mask=attention_mask, draft=draft_model)
        return fsd_ext.GenerateOutput(input_ids, None)

    monkeypatch.setattr(fsd_ext.engines.hf, "fsd_generate", fake_generate)
    ids, mask = prompts([5, 2], seed=6)
    fsd_hf(target, draft, ids, mask, do_sample=True, temperature=0.7, top_k=10, top_p=0.9,
           min_p=0.05, max_length=ids.shape[1] + 9, eos_token_id=[2, 5], pad_token_id=7,
           num_assistant_tokens=3, fsd_rule="fsd_strict", fsd_divergence="tv", fsd_threshold=0.2,
           fsd_div_temperature=None, fsd_seed=11)
    assert seen["draft"] is draft and torch.equal(seen["attention_mask"], mask)
    assert seen["temperature"] == 0.7 and seen["top_k"] == 10 and seen["top_p"] == 0.9
    assert seen["min_p"] == 0.05 and seen["max_new_tokens"] == 9
    assert seen["eos_token_id"] == [2, 5] and seen["pad_token_id"] == 7
    assert seen["num_draft_tokens"] == 3 and seen["rule"] == "fsd_strict"
    assert seen["divergence"] == "tv" and seen["threshold"] == 0.2
    assert seen["div_temperature"] is None and seen["seed"] == 11

    seen.clear()
    fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=4, fsd_num_draft_tokens=6)
    assert seen["temperature"] == 0.0 and seen["max_new_tokens"] == 4
    assert seen["num_draft_tokens"] == 6 and seen["eos_token_id"] == [EOS]
    seen.clear()
    fsd_hf(target, draft, ids, mask, max_new_tokens=4)  # transformers' own default of 20: not K
    assert seen["num_draft_tokens"] == 5
    assert (seen["draft_length"], seen["draft_confidence"]) == ("fixed", 0.4)


def test_assistant_schedule_and_confidence_map_to_draft_length(target, draft, monkeypatch):
    seen = {}

    def fake_generate(target_model, draft_model, input_ids, attention_mask, **kwargs):
        seen.update(kwargs)
        return fsd_ext.GenerateOutput(input_ids, None)

    monkeypatch.setattr(fsd_ext.engines.hf, "fsd_generate", fake_generate)
    ids, mask = prompts([4], seed=8)
    fsd_hf(target, draft, ids, mask, max_new_tokens=4, num_assistant_tokens_schedule="heuristic")
    assert seen["draft_length"] == "heuristic"
    fsd_hf(target, draft, ids, mask, max_new_tokens=4, num_assistant_tokens_schedule="constant")
    assert seen["draft_length"] == "fixed"
    fsd_hf(target, draft, ids, mask, max_new_tokens=4, fsd_draft_length="confidence",
           assistant_confidence_threshold=0.7, fsd_draft_cost=0.5)
    assert (seen["draft_length"], seen["draft_confidence"], seen["draft_cost"]) == \
        ("confidence", 0.7, 0.5)
    with pytest.raises(ValueError, match="fsd_draft_length"):
        fsd_hf(target, draft, ids, mask, max_new_tokens=4, fsd_draft_length="adaptive")


def test_heuristic_schedule_keeps_the_greedy_output(target, draft):
    ids, mask = prompts([5, 9], seed=9)
    kwargs = dict(do_sample=False, max_new_tokens=12, fsd_rule="sd", fsd_num_draft_tokens=4)
    fixed = fsd_hf(target, draft, ids, mask, **kwargs)
    heuristic = fsd_hf(target, draft, ids, mask, num_assistant_tokens_schedule="heuristic", **kwargs)
    assert heuristic.tolist() == fixed.tolist()


def test_sampling_with_a_seed_is_reproducible_and_is_fsd_ext_generate(target, draft):
    ids, mask = prompts([5, 8], seed=7)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=16,
                  fsd_threshold=0.3, fsd_num_draft_tokens=3)
    a = fsd_hf(target, draft, ids, mask, fsd_seed=5, **kwargs)
    b = fsd_hf(target, draft, ids, mask, fsd_seed=5, **kwargs)
    c = fsd_hf(target, draft, ids, mask, fsd_seed=6, **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)
    direct = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=0.3,
                              num_draft_tokens=3, temperature=0.8, top_k=40, top_p=0.95,
                              max_new_tokens=16, seed=5)
    assert torch.equal(a, direct.sequences)
    torch.manual_seed(0)  # without fsd_seed, torch's generator draws the seed
    d = fsd_hf(target, draft, ids, mask, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(d, fsd_hf(target, draft, ids, mask, **kwargs))


@pytest.mark.parametrize("rule,threshold", [("typical", 11.1), ("rank_strict", 3.0), ("prob_floor", 1.0)])
def test_other_lenient_rules_are_fsd_ext_generate(target, draft, rule, threshold):
    ids, mask = prompts([5, 8], seed=7)
    out = fsd_hf(target, draft, ids, mask, do_sample=True, temperature=0.8, top_k=40, top_p=0.95,
                 max_new_tokens=12, fsd_rule=rule, fsd_threshold=threshold, fsd_num_draft_tokens=3, fsd_seed=5)
    direct = fsd_ext.generate(target, draft, ids, mask, rule=rule, threshold=threshold, num_draft_tokens=3,
                              temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=12, seed=5)
    assert torch.equal(out, direct.sequences)


def test_return_dict_in_generate_gives_generate_decoder_only_output(target, draft):
    ids, mask = prompts([4, 6], seed=8)
    kwargs = dict(do_sample=False, max_new_tokens=10, fsd_num_draft_tokens=3)
    out = fsd_hf(target, draft, ids, mask, return_dict_in_generate=True, **kwargs)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert out.scores is None and out.logits is None
    assert torch.equal(out.sequences, fsd_hf(target, draft, ids, mask, **kwargs))


def test_fsd_streamer_receives_the_prompt_then_the_tokens(target, draft):
    ids, _ = prompts([5], seed=9)
    streamer = Recorder()
    out = fsd_hf(target, draft, ids, do_sample=True, max_new_tokens=15, fsd_num_draft_tokens=3,
                 fsd_seed=1, fsd_streamer=streamer)
    assert streamer.ended and streamer.puts[0] == ids[0].tolist()
    assert sum(streamer.puts[1:], []) == out[0, 5:].tolist()


# ----------------------------------------------------------------------------------------------
# The folder form (custom_generate="<folder>", trust_remote_code=True).

def test_folder_form_takes_assistant_model_and_streamer(target, draft):
    ids, mask = prompts([6], seed=10)
    kwargs = dict(do_sample=True, max_new_tokens=12, fsd_num_draft_tokens=3, fsd_seed=4)
    streamer = Recorder()
    out = target.generate(ids, attention_mask=mask, custom_generate=fsd_ext.hf.CUSTOM_GENERATE_DIR,
                          trust_remote_code=True, assistant_model=draft, streamer=streamer, **kwargs)
    assert torch.equal(out, fsd_hf(target, draft, ids, mask, **kwargs))
    assert streamer.ended and streamer.puts[0] == ids[0].tolist()
    assert sum(streamer.puts[1:], []) == out[0, 6:].tolist()


def test_folder_form_needs_trust_remote_code(target, draft):
    ids, mask = prompts([3], seed=11)
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(ids, attention_mask=mask, custom_generate=fsd_ext.hf.CUSTOM_GENERATE_DIR,
                        assistant_model=draft, max_new_tokens=4)


# ----------------------------------------------------------------------------------------------
# What it cannot honour raises.

@pytest.mark.parametrize("kwargs,message", [
    (dict(draft_model=None), "draft_model"),
    (dict(num_beams=2), "num_beams"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(fsd_rule="fuzzy"), "fsd_rule"),
    (dict(fsd_divergence="hellinger"), "fsd_divergence"),
    (dict(fsd_threshold=-0.1), "fsd_threshold"),
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(do_sample=True, typical_p=0.5), "TypicalLogitsWarper"),
    (dict(max_time=5.0), "MaxTimeCriteria"),
    (dict(labels=torch.zeros(2, 4, dtype=torch.int64)), "labels"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(output_logits=True, return_dict_in_generate=True), "output_logits"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states=True"),
])
def test_bad_arguments_raise(target, draft, kwargs, message):
    ids, mask = prompts([4, 2], seed=12)
    call = dict(draft_model=draft, max_new_tokens=4)
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        target.generate(ids, attention_mask=mask, custom_generate=fsd_ext.hf.generate, **call)


def test_a_misspelt_fsd_option_is_not_silently_ignored(target, draft):
    ids, mask = prompts([4], seed=13)
    with pytest.raises(ValueError, match="fsd_treshold"):
        fsd_hf(target, draft, ids, mask, max_new_tokens=4, fsd_treshold=0.5)


def test_import_fsd_ext_loads_transformers_only_for_fsd_ext_hf():
    code = ("import sys, fsd_ext; assert 'transformers' not in sys.modules; "
            "fsd_ext.hf.generate; assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


class VocabTokenizer:
    """A stand-in tokenizer: check_tokenizers reads get_vocab() only."""

    def __init__(self, vocab_size, swap=False):
        self.vocab = {f"t{i}": i for i in range(vocab_size)}
        if swap:
            self.vocab["t2"], self.vocab["t3"] = 3, 2

    def get_vocab(self):
        return dict(self.vocab)


def test_draft_with_a_smaller_vocabulary_is_refused(target):
    """A draft with a smaller vocabulary (another tokenizer) ran and gave garbage at large
    thresholds (issue 59, item 6); Hugging Face's assisted generation refuses it without tokenizers."""
    small = helpers.tiny_llama(1, 1, vocab=VOCAB - 32, hidden=32, heads=2, kv_heads=1, max_positions=256)
    ids, mask = prompts([3, 4])
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB} vs {VOCAB - 32}"):
        fsd_hf(target, small, ids, mask, do_sample=False, max_new_tokens=4, fsd_threshold=100.0)
    # Folder form: transformers' own tokenizer= / assistant_tokenizer= names reach the same check.
    with pytest.raises(ValueError, match="tokenizers differ"):
        fsd_ext.hf.generate_from_raw_arguments(
            target, ids, attention_mask=mask, assistant_model=small, tokenizer=VocabTokenizer(VOCAB),
            assistant_tokenizer=VocabTokenizer(VOCAB - 32, swap=True), do_sample=False, max_new_tokens=4)


def test_tokenizers_given_are_compared(target, draft):
    ids, mask = prompts([3, 4])
    with pytest.raises(ValueError, match="tokenizers differ"):
        fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=4,
               fsd_tokenizer=VocabTokenizer(VOCAB), fsd_draft_tokenizer=VocabTokenizer(VOCAB, swap=True))
    out = fsd_hf(target, draft, ids, mask, do_sample=False, max_new_tokens=4,
                 fsd_tokenizer=VocabTokenizer(VOCAB), fsd_draft_tokenizer=VocabTokenizer(VOCAB))
    assert out.shape == (2, ids.shape[1] + 4)
