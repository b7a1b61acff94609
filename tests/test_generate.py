"""The decoding loop (fsd_ext.generate) on tiny randomly initialised Llama models (CPU, fast), and on
real weights when run with --runslow."""

import functools
import importlib
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsd_ext
from fsd_ext.decoding import cuda_graphs
from fsd_ext.decoding.draft_length import acceptance_draft_length, heuristic_draft_length
from fsd_ext.decoding.draft_length import update_acceptance as _update_acceptance
from fsd_ext.generate import check_tokenizers
import helpers
from helpers import PAD, chi_square_pvalue, left_padded_prompts

transformers = pytest.importorskip("transformers")

VOCAB = 128


def tiny_llama(seed, layers=2, vocab=VOCAB, logit_scale=1.0, dtype=torch.float32):
    return helpers.tiny_llama(seed, layers, vocab=vocab, logit_scale=logit_scale, dtype=dtype)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=2, logit_scale=8.0)


@pytest.fixture(scope="module")
def draft():
    # Shares the target's lower layer and embeddings, so the two models agree often but not always.
    model = tiny_llama(1, layers=1, logit_scale=8.0)
    t = tiny_llama(0, layers=2, logit_scale=8.0)
    model.model.embed_tokens.load_state_dict(t.model.embed_tokens.state_dict())
    model.model.layers[0].load_state_dict(t.model.layers[0].state_dict())
    model.lm_head.load_state_dict(t.lm_head.state_dict())
    return model


def random_prompts(lengths, seed=0):
    return left_padded_prompts(lengths, VOCAB, seed)


def new_tokens(out, prompt_width):
    """Per row, the generated tokens up to the padding after the end."""
    rows = []
    for row in out.sequences[:, prompt_width:].tolist():
        while row and row[-1] == PAD:
            row.pop()
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Greedy equals the target's own greedy decoding.

@pytest.mark.parametrize("rule", ["ar", "greedy", "sd", "fsd"])
def test_greedy_matches_hf_generate_batch1(target, draft, rule):
    ids, mask = random_prompts([9], seed=1)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                               pad_token_id=PAD)
    out = fsd_ext.generate(target, draft, ids, mask, rule=rule, temperature=0.0, threshold=0.0,
                           num_draft_tokens=4, max_new_tokens=24, seed=0)
    assert out.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("rule", ["ar", "greedy"])
def test_greedy_matches_hf_generate_batch4_left_padded(target, draft, rule):
    ids, mask = random_prompts([3, 11, 1, 6], seed=2)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                               pad_token_id=PAD)
    out = fsd_ext.generate(target, draft, ids, mask, rule=rule, temperature=0.0,
                           num_draft_tokens=3, max_new_tokens=20)
    assert out.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("rule,temperature,draft_length", [
    ("greedy", 0.0, "fixed"), ("sd", 1.0, "fixed"), ("fsd", 0.8, "fixed"),
    # Rows stop drafting independently: a row's drafts must not depend on when the others stop.
    ("sd", 1.0, "confidence"), ("fsd", 0.8, "confidence"), ("sd", 1.0, "heuristic"),
    ("sd", 1.0, "acceptance")])
def test_batch_equals_single_rows(target, draft, rule, temperature, draft_length):
    lengths = [4, 10, 1, 7]
    ids, mask = random_prompts(lengths, seed=3)
    seeds = torch.tensor([11, 22, 33, 44])
    kwargs = dict(rule=rule, temperature=temperature, threshold=0.2, num_draft_tokens=4,
                  max_new_tokens=16, eos_token_id=[], draft_length=draft_length,
                  draft_confidence=0.05)  # the tiny draft's sampled tokens: most below 0.2
    batched = new_tokens(fsd_ext.generate(target, draft, ids, mask, seed=seeds, **kwargs), ids.shape[1])
    for row, length in enumerate(lengths):
        single = fsd_ext.generate(target, draft, ids[row:row + 1, -length:], seed=seeds[row:row + 1],
                                  **kwargs)
        assert new_tokens(single, length)[0] == batched[row], f"row {row}"


def test_int_seed_gives_row_b_seed_plus_b(target, draft):
    ids, mask = random_prompts([5, 5], seed=4)
    kwargs = dict(rule="fsd", num_draft_tokens=3, max_new_tokens=12, eos_token_id=[])
    both = fsd_ext.generate(target, draft, ids, mask, seed=100, **kwargs).sequences
    second = fsd_ext.generate(target, draft, ids[1:], seed=101, **kwargs).sequences
    assert both[1].tolist() == second[0].tolist()


# ----------------------------------------------------------------------------------------------
# The rules in the loop.

@torch.no_grad()
def test_huge_threshold_returns_the_draft_continuation(target, draft):
    """Every draft is accepted, so every non-bonus token is the draft's own greedy choice."""
    k = 4
    ids, mask = random_prompts([6, 3], seed=5)
    out = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=1e9, temperature=0.0,
                           num_draft_tokens=k, max_new_tokens=3 * (k + 1), eos_token_id=[])
    assert out.stats.mean_accepted == k
    assert out.stats.accepted_histogram == [0] * k + [out.stats.verifications]
    # Teacher-forced draft greedy choices over the whole output.
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], 1)
    positions = (full_mask.cumsum(1) - 1).clamp_min(0)
    logits = draft(out.sequences, attention_mask=full_mask, position_ids=positions).logits
    draft_choice = logits.argmax(-1)[:, ids.shape[1] - 1:-1]  # the draft's pick for each new token
    generated = out.sequences[:, ids.shape[1]:]
    is_draft_position = torch.arange(generated.shape[1]) % (k + 1) != k
    assert torch.equal(generated[:, is_draft_position], draft_choice[:, is_draft_position])
    # One step of K drafts + bonus: the first K tokens are exactly the draft's greedy decoding.
    expected = draft.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                              pad_token_id=PAD, eos_token_id=None)
    out = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=1e9, temperature=0.0,
                           num_draft_tokens=k, max_new_tokens=k + 1, eos_token_id=[])
    assert out.sequences[:, :-1].tolist() == expected.tolist()
    assert out.stats.draft_forwards == k + 1  # prefill + K drafts


def test_fsd_threshold_zero_equals_sd(target, draft):
    ids, mask = random_prompts([5, 8, 2], seed=6)
    kwargs = dict(num_draft_tokens=4, max_new_tokens=20, temperature=1.0, seed=7, eos_token_id=[])
    sd = fsd_ext.generate(target, draft, ids, mask, rule="sd", **kwargs)
    fsd = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=0.0, **kwargs)
    assert torch.equal(sd.sequences, fsd.sequences)
    assert 0 < sd.stats.mean_accepted < 4  # the pair disagrees sometimes: the test means something


@pytest.mark.parametrize("filters", [{}, {"top_k": 20}])
def test_sd_rejected_count_with_sampling_replays_the_kernels_coins(target, draft, monkeypatch, filters):
    """With sampling (and output_divergences=True), a draft counts as one SD would have rejected
    when its step coin fails SD's test. Checked through the kernel itself: position i's coin accepts iff an sd call whose first i
    drafts are forced to accept (draft logits = target logits there, so u q <= p always) accepts
    more than i drafts."""
    import importlib

    generate_module = importlib.import_module("fsd_ext.decoding.loop")
    steps = []  # per verification step: [accept args, accept kwargs, result, sd_rejects]
    real_accept, real_rejects = generate_module._accept, generate_module._sd_rejects

    def accept_spy(*args, **kwargs):
        steps.append([args, kwargs, real_accept(*args, **kwargs)])
        return steps[-1][2]

    def rejects_spy(*args):
        steps[-1].append(real_rejects(*args))
        return steps[-1][3]

    monkeypatch.setattr(generate_module, "_accept", accept_spy)
    monkeypatch.setattr(generate_module, "_sd_rejects", rejects_spy)
    ids, mask = random_prompts([5, 8, 3], seed=6)
    kwargs = dict(num_draft_tokens=4, max_new_tokens=24, temperature=1.0, seed=11, eos_token_id=[],
                  **filters)
    plain = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=1e9, **kwargs)
    assert plain.stats.sd_rejected_accepted is None and plain.stats.diagnostics_seconds == 0.0
    steps.clear()
    out = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=1e9, output_divergences=True,
                           **kwargs)
    assert torch.equal(out.sequences, plain.sequences) and out.stats.diagnostics_seconds > 0
    checked = rejected = 0
    for (zt, zd, drafts), kw, result, sd_rejects in steps:
        sd_kw = {name: kw[name] for name in ("temperature", "top_k", "top_p", "min_p", "seed",
                                             "offset", "num_draft")}
        for b, n in enumerate(result.num_accepted.tolist()):
            for i in range(n):
                forced = zd.clone()
                forced[b, :i] = zt[b, :i]
                sd = fsd_ext.accept(zt, forced, drafts, rule="sd", **sd_kw)
                assert bool(sd_rejects[b, i]) == (int(sd.num_accepted[b]) == i)
                checked += 1
                rejected += int(sd_rejects[b, i])
    assert checked == out.stats.accepted_drafts  # nothing cut: no EOS, max_new_tokens a multiple
    assert out.stats.sd_rejected_accepted == rejected
    assert 0 < rejected < checked  # the huge threshold keeps drafts SD would reject, not all of them

    sd = fsd_ext.generate(target, draft, ids, mask, rule="sd", **kwargs)
    fsd_t0 = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=0.0,
                              output_divergences=True, **kwargs)
    assert sd.stats.sd_rejected_accepted == 0 and fsd_t0.stats.sd_rejected_accepted == 0
    assert fsd_ext.generate(target, None, ids, mask, rule="ar", **kwargs).stats.sd_rejected_accepted is None


def test_per_row_threshold(target, draft):
    ids, mask = random_prompts([5, 5], seed=6)
    kwargs = dict(rule="fsd", num_draft_tokens=4, max_new_tokens=15, seed=[3, 4], eos_token_id=[],
                  output_divergences=True)
    out = fsd_ext.generate(target, draft, ids, mask, threshold=torch.tensor([1e9, 0.0]), **kwargs)
    sd = fsd_ext.generate(target, draft, ids, mask, threshold=0.0, **kwargs)
    huge = fsd_ext.generate(target, draft, ids, mask, threshold=1e9, **kwargs)
    assert out.sequences[0].tolist() == huge.sequences[0].tolist()
    assert out.sequences[1].tolist() == sd.sequences[1].tolist()


def test_fsd_accepts_more_than_sd(target, draft):
    ids, mask = random_prompts([5, 8, 2, 6], seed=6)
    kwargs = dict(num_draft_tokens=4, max_new_tokens=24, temperature=1.0, seed=8, eos_token_id=[])
    sd = fsd_ext.generate(target, draft, ids, mask, rule="sd", **kwargs)
    fsd = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=0.5, **kwargs)
    assert fsd.stats.mean_accepted > sd.stats.mean_accepted


@torch.no_grad()
def test_sd_first_token_follows_the_target_distribution(target, draft):
    """With max_new_tokens=1 the only token is d_0 or its correction: distributed as p_0."""
    rows = 4000
    prompt = random_prompts([6], seed=9)[0]
    ids = prompt.expand(rows, -1).contiguous()
    out = fsd_ext.generate(target, draft, ids, rule="sd", num_draft_tokens=2, max_new_tokens=1,
                           temperature=1.0, seed=12345, eos_token_id=[])
    counts = torch.bincount(out.sequences[:, -1], minlength=VOCAB).double()
    p = target(prompt).logits[0, -1].double().softmax(-1)
    q = draft(prompt).logits[0, -1].double().softmax(-1)
    assert 0.5 * (p - q).abs().sum() > 0.1  # the draft really differs from the target
    assert chi_square_pvalue(counts, p) > 1e-3
    # ... and would reject the draft's distribution.
    assert chi_square_pvalue(counts, q) < 1e-6


# ----------------------------------------------------------------------------------------------
# Ends of rows, streaming, seeds, stats.

def test_eos_stops_each_row_and_pads(target, draft):
    ids, mask = random_prompts([5, 9, 3], seed=10)
    kwargs = dict(rule="greedy", num_draft_tokens=3, max_new_tokens=16)
    free = new_tokens(fsd_ext.generate(target, draft, ids, mask, eos_token_id=[], **kwargs), ids.shape[1])
    eos = free[0][4]  # row 0 ends at its 5th token; the other rows end at this token if they emit it
    out = fsd_ext.generate(target, draft, ids, mask, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    for row, tokens in enumerate(free):
        expected = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        got = out.sequences[row, ids.shape[1]:].tolist()
        assert got[:len(expected)] == expected
        assert all(t == PAD for t in got[len(expected):])
    assert out.sequences.shape[1] == ids.shape[1] + max(
        len(t[:t.index(eos) + 1]) if eos in t else len(t) for t in free)


@pytest.mark.parametrize("rule", ["ar", "fsd"])
def test_max_new_tokens(target, draft, rule):
    ids, mask = random_prompts([4, 7], seed=11)
    out = fsd_ext.generate(target, draft, ids, mask, rule=rule, num_draft_tokens=4,
                           max_new_tokens=7, eos_token_id=[], seed=0)
    assert out.sequences.shape == (2, ids.shape[1] + 7)
    assert out.stats.new_tokens == 14


def test_streamer_sees_prompt_then_tokens_in_order(target, draft):
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            assert not self.ended
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids, _ = random_prompts([5], seed=12)
    streamer = Recorder()
    out = fsd_ext.generate(target, draft, ids, rule="fsd", num_draft_tokens=3, max_new_tokens=15,
                           seed=3, streamer=streamer)
    assert streamer.ended and streamer.puts[0] == ids[0].tolist()
    assert sum(streamer.puts[1:], []) == out.sequences[0, 5:].tolist()
    assert len(streamer.puts) > 2  # tokens came in several chunks


def test_same_seed_same_output(target, draft):
    ids, mask = random_prompts([4, 6], seed=13)
    kwargs = dict(rule="fsd", num_draft_tokens=3, max_new_tokens=16, top_p=0.9, top_k=50,
                  eos_token_id=[])
    a = fsd_ext.generate(target, draft, ids, mask, seed=5, **kwargs).sequences
    b = fsd_ext.generate(target, draft, ids, mask, seed=5, **kwargs).sequences
    c = fsd_ext.generate(target, draft, ids, mask, seed=6, **kwargs).sequences
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(0)
    d = fsd_ext.generate(target, draft, ids, mask, **kwargs).sequences
    torch.manual_seed(0)
    assert torch.equal(d, fsd_ext.generate(target, draft, ids, mask, **kwargs).sequences)


@pytest.mark.parametrize("rule,temperature", [("ar", 0.0), ("fsd", 0.0), ("sd", 0.9)])
def test_per_row_counts_sum_to_the_totals_and_match_single_rows(target, draft, rule, temperature):
    """stats.rows[b] is row b's share of the counts; each equals the counts of the row decoded alone."""
    ids, mask = random_prompts([6, 3, 9], seed=41)
    kwargs = dict(rule=rule, threshold=0.5, temperature=temperature, num_draft_tokens=3,
                  max_new_tokens=14, eos_token_id=[5], seed=torch.tensor([3, 4, 5]))
    out = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    for name in ("new_tokens", "verifications", "drafted_tokens", "accepted_drafts", "sd_rejected_accepted"):
        values = [getattr(r, name) for r in out.stats.rows]
        total = getattr(out.stats, name)
        assert set(values) == {None} if total is None else sum(values) == total, name
    for b in range(3):
        keep = mask[b].bool()
        alone = fsd_ext.generate(target, draft, ids[b:b + 1, keep], **dict(kwargs, seed=kwargs["seed"][b:b + 1]))
        assert out.stats.rows[b] == alone.stats.rows[0]


def test_stats_and_divergences(target, draft):
    ids, mask = random_prompts([4, 6], seed=14)
    out = fsd_ext.generate(target, draft, ids, mask, rule="fsd", num_draft_tokens=3,
                           max_new_tokens=10, seed=0, eos_token_id=[], output_divergences=True)
    stats = out.stats
    assert stats.new_tokens == 20 and stats.tokens_per_second > 0
    assert sum(stats.accepted_histogram) == stats.verifications
    assert stats.draft_forwards == sum(d.shape[1] for d in stats.divergences) + 1  # + prefill
    # fixed: every row-step drafts K = 3, except where max_new_tokens leaves room for fewer
    assert stats.drafted_tokens == sum(d.shape[0] * d.shape[1] for d in stats.divergences)
    assert stats.mean_drafted == stats.drafted_tokens / stats.verifications
    assert "drafted" in stats.summary()
    assert stats.target_forwards == len(stats.divergences) + 1
    assert all(1 <= d.shape[1] <= 3 and (d >= 0).all() and (d <= 0.6932).all()
               for d in stats.divergences)
    assert "tokens/s" in stats.summary()


# Each lenient rule at a knob where, on this pair, it keeps drafts SD rejects.
LENIENT_KNOB = {"fsd": 0.6, "fsd_strict": 0.6, "typical": 128.0, "typical_strict": 128.0, "lenient_sd": 6.4,
                "prob_floor": 6.4, "rank": 32.0, "rank_strict": 1e6, "cascade": 1.99}


@pytest.mark.parametrize("rule", [r for r in fsd_ext.LENIENT_RULES if fsd_ext.types.rule_spec(r).criterion != "divergence"])
def test_lenient_rules_through_generate(target, draft, rule):
    """Each rule decodes batched prompts: at T = 0 a hybrid rule is exactly SD (same seeds, same
    tokens; a strict one accepts nothing), and at a lenient knob it keeps more drafts than SD."""
    ids, mask = random_prompts([5, 8, 2], seed=6)
    kwargs = dict(num_draft_tokens=4, max_new_tokens=20, temperature=0.8, seed=7, eos_token_id=[])
    sd = fsd_ext.generate(target, draft, ids, mask, rule="sd", **kwargs)
    exact = fsd_ext.generate(target, draft, ids, mask, rule=rule, threshold=0.0, **kwargs)
    if fsd_ext.types.rule_spec(rule).strict:
        assert exact.stats.accepted_drafts == 0
    else:
        assert torch.equal(sd.sequences, exact.sequences)
    lenient = fsd_ext.generate(target, draft, ids, mask, rule=rule, threshold=LENIENT_KNOB[rule], **kwargs)
    assert lenient.stats.mean_accepted > sd.stats.mean_accepted


@pytest.mark.parametrize("rule", ["greedy", "sd"] + list(fsd_ext.LENIENT_RULES))
def test_greedy_counts_the_drafts_sd_would_reject(target, draft, rule):
    """Under greedy decoding every emitted correction/bonus is the target's argmax, so the generated
    tokens that differ from a teacher-forced target argmax are exactly the accepted off-target
    drafts; sd and greedy accept none."""
    ids, mask = random_prompts([7], seed=21)
    out = fsd_ext.generate(target, draft, ids, mask, rule=rule, threshold=LENIENT_KNOB.get(rule, 0.0),
                           temperature=0.0, num_draft_tokens=4, max_new_tokens=24, eos_token_id=[])
    logits = target(out.sequences).logits[0]
    predicted = logits[ids.shape[1] - 1:-1].argmax(-1)
    mismatches = int((predicted != out.sequences[0, ids.shape[1]:]).sum())
    assert out.stats.sd_rejected_accepted == mismatches
    # The lenient rules must really exercise the count; lenient SD's coin reads the one-hot greedy
    # p and q, so it has no room under greedy decoding (docs/design.md 2.5).
    assert (mismatches == 0) == (rule in ("greedy", "sd", "lenient_sd"))
    sampled = fsd_ext.generate(target, draft, ids, mask, rule="fsd", temperature=1.0, seed=0,
                               num_draft_tokens=4, max_new_tokens=8, eos_token_id=[])
    assert sampled.stats.sd_rejected_accepted is None  # only defined under greedy


def test_prefill_time_and_kept_accepted_drafts(target, draft):
    """prefill_seconds is part of seconds; near max_new_tokens a step drafts only what can be kept;
    accepted drafts cut off by EOS are not counted."""
    ids, mask = random_prompts([5], seed=22)
    kwargs = dict(rule="fsd", threshold=1e9, temperature=0.0, num_draft_tokens=4)
    out = fsd_ext.generate(target, draft, ids, mask, max_new_tokens=7, eos_token_id=[], **kwargs)
    stats = out.stats
    assert 0 < stats.prefill_seconds < stats.seconds
    assert 0 < stats.target_prefill_seconds < stats.prefill_seconds
    assert stats.decode_tokens_per_second > stats.tokens_per_second
    per_draft = (stats.draft_seconds - (stats.prefill_seconds - stats.target_prefill_seconds)) / 5
    per_target = (stats.target_seconds - stats.target_prefill_seconds) / (stats.target_forwards - 1)
    assert stats.draft_cost_ratio == pytest.approx(per_draft / per_target) and per_draft > 0
    # Everything is accepted: 4 drafts + bonus, then only 1 draft + bonus for the last 2 tokens.
    assert stats.accepted_histogram == [0, 1, 0, 0, 1]
    assert stats.new_tokens == 7 and stats.accepted_drafts == 5
    assert stats.draft_forwards == 1 + 4 + 1
    # EOS at a drafted position i of the first step: i + 1 tokens kept, all of them drafts.
    free = out.sequences[0, ids.shape[1]:].tolist()
    i = next(i for i in range(1, 4) if free[i] not in free[:i])
    out = fsd_ext.generate(target, draft, ids, mask, max_new_tokens=7, eos_token_id=free[i], **kwargs)
    assert out.stats.new_tokens == i + 1 and out.stats.accepted_drafts == i + 1


def test_smaller_draft_vocabulary(target):
    small = tiny_llama(3, layers=1, vocab=VOCAB - 28, logit_scale=8.0)
    ids, mask = random_prompts([4, 6], seed=15)
    ids = ids % (VOCAB - 28)  # the prompts use the shared ids; the target may emit the others
    out = fsd_ext.generate(target, small, ids, mask, rule="sd", max_new_tokens=24, seed=0,
                           eos_token_id=[])
    expected = fsd_ext.generate(target, None, ids, mask, rule="ar", temperature=0.0,
                                max_new_tokens=24, eos_token_id=[])
    greedy = fsd_ext.generate(target, small, ids, mask, rule="greedy", max_new_tokens=24,
                              eos_token_id=[])
    assert torch.equal(greedy.sequences, expected.sequences)
    assert out.sequences.shape == (2, ids.shape[1] + 24)


# ----------------------------------------------------------------------------------------------
# The CUDA-graph path's logic, emulated on the CPU (tests/test_cuda.py captures real graphs).

class ReplayByCall:
    """Stands in for cuda_graphs.CapturedForward: keeps the static input buffer and "replays" by
    calling the forward on it again, as a captured graph would read the buffer and the live cache."""

    made = []

    def __init__(self, forward, input_ids, keep, pool=None):
        self.forward, self.keep, self.pool = forward, keep, pool
        self.input_ids = input_ids.clone()  # [B, S] static input buffer
        self.cache = forward.__self__.cache
        self.captured_storage = self.storage()
        ReplayByCall.made.append((input_ids.shape[0], input_ids.shape[1], keep))

    def storage(self):
        """Where the cache tensors a real graph would have baked in live."""
        cache = self.cache
        return [t.data_ptr() for t in [cache.lengths, cache.pad] + cache.keys + cache.values]

    def __call__(self, input_ids):
        # A real replay reads the tensors at their capture-time addresses: the loop must update
        # the cache in place, never rebind it, while a graph lives.
        assert self.storage() == self.captured_storage, "a cache tensor moved after the capture"
        self.input_ids.copy_(input_ids)
        return self.forward(self.input_ids, self.keep).clone()


def generate_graph_shaped(monkeypatch, target, draft, ids, mask, replay=None, reuse=False, **kwargs):
    """generate() down its CUDA-graph path on the CPU: use_graphs forced on, ReplayByCall (or a
    subclass, `replay`) standing in for the captures (ReplayByCall.made lists them), from no kept
    graph state unless `reuse`."""
    gen = importlib.import_module("fsd_ext.decoding.model")
    if not reuse:
        cuda_graphs.release_cuda_graphs()
    ReplayByCall.made = []
    monkeypatch.setattr(cuda_graphs, "CapturedForward", replay or ReplayByCall)
    init = gen.CachedModel.__init__
    monkeypatch.setattr(gen.CachedModel, "__init__",
                        lambda self, model, pad, capacity, use_graphs, **role: init(self, model, pad, capacity,
                                                                                  True, **role))
    return fsd_ext.generate(target, draft, ids, mask, **kwargs)


@pytest.mark.parametrize("rule,temperature,draft_length", [
    ("ar", 0.0, "fixed"), ("greedy", 0.0, "fixed"), ("sd", 1.0, "fixed"), ("fsd", 0.8, "fixed"),
    ("fsd", 0.8, "confidence"), ("sd", 1.0, "heuristic")])
def test_graph_shaped_path_matches_eager_on_cpu(target, draft, monkeypatch, rule, temperature,
                                                draft_length):
    """With graphs on, every decode forward attends over the whole static cache (fixed shapes) and
    goes through a per-shape replay object; the tokens must not change."""
    ids, mask = random_prompts([5, 12, 2], seed=40)
    seeds = torch.tensor([5, 6, 7])
    kwargs = dict(rule=rule, temperature=temperature, threshold=0.3, num_draft_tokens=3, max_new_tokens=14,
                  seed=seeds, eos_token_id=[], draft_length=draft_length, draft_confidence=0.05)
    eager = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    graphed = generate_graph_shaped(monkeypatch, target, draft, ids, mask, **kwargs)
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    assert ReplayByCall.made, "no forward went through the graph path"
    # One replay object per (batch, tokens, kept logits) shape, not one per step.
    assert len(ReplayByCall.made) == len(set(ReplayByCall.made))
    assert graphed.stats.target_forwards == eager.stats.target_forwards


@pytest.mark.parametrize("graph_shaped", [False, True])
def test_prompt_cache_keeps_every_token_and_count(target, draft, monkeypatch, graph_shaped):
    """A PromptCache across calls on one left-padded batch (rules, temperatures, seeds, K varying):
    the same sequences and forward counts as without it, the prompt forwards run once per model,
    a new prompt or model runs its own; the negative control, saved entries spoiled, changes the
    tokens (so the entries are what the later calls read)."""
    ids, mask = random_prompts([5, 12, 2], seed=44)
    other_ids, other_mask = random_prompts([5, 12, 3], seed=45)
    calls = [dict(rule="sd", temperature=0.0), dict(rule="fsd", temperature=0.8, seed=3),
             dict(rule="typical", threshold=0.5, temperature=0.8, seed=4),
             dict(rule="fsd", temperature=0.0, num_draft_tokens=2), dict(rule="ar", temperature=0.0)]
    run = functools.partial(generate_graph_shaped, monkeypatch, reuse=True) if graph_shaped else fsd_ext.generate
    cache = fsd_ext.decoding.PromptCache()
    for extra in calls:
        kwargs = dict(dict(num_draft_tokens=3, max_new_tokens=12, eos_token_id=[]), **extra)
        plain = fsd_ext.generate(target, draft, ids, mask, **kwargs)
        shared = run(target, draft, ids, mask, prompt_cache=cache, **kwargs)
        monkeypatch.undo()
        assert shared.sequences.tolist() == plain.sequences.tolist(), extra
        assert (shared.stats.target_forwards, shared.stats.draft_forwards) == \
            (plain.stats.target_forwards, plain.stats.draft_forwards)
        assert shared.stats.prefill_reused == (extra is not calls[0]) and not plain.stats.prefill_reused
    assert (cache.misses, cache.hits) == (2, 7)  # target + draft once; then 4 targets, 3 drafts
    fsd_ext.generate(target, draft, other_ids, other_mask, prompt_cache=cache, max_new_tokens=4)
    fsd_ext.generate(draft, draft, other_ids, other_mask, prompt_cache=cache, max_new_tokens=4)
    assert cache.misses == 5  # the new prompt (both models), then the draft as target
    plain = fsd_ext.generate(target, draft, ids, mask, rule="sd", temperature=0.0, max_new_tokens=12)
    fsd_ext.generate(target, draft, ids, mask, rule="sd", prompt_cache=cache, max_new_tokens=1)
    for (entry,) in cache._entries.values():  # the negative control
        for saved in entry.keys + entry.values:
            saved.normal_(0.0, 10.0)
    spoiled = fsd_ext.generate(target, draft, ids, mask, rule="sd", temperature=0.0,
                               prompt_cache=cache, max_new_tokens=12)
    assert spoiled.sequences.tolist() != plain.sequences.tolist()
    with pytest.raises(TypeError, match="prompt_cache"):
        fsd_ext.generate(target, draft, ids, mask, prompt_cache={})


def test_prompt_cache_keeps_the_last_max_prompts(target, draft):
    """Entries per role up to max_prompts, the least recently used going first."""
    prompts = [random_prompts([4 + i], seed=50 + i)[0] for i in range(3)]
    cache = fsd_ext.decoding.PromptCache(max_prompts=2)
    run = functools.partial(fsd_ext.generate, target, draft, rule="sd", max_new_tokens=2, prompt_cache=cache)
    for i in (0, 1, 0, 2, 0, 1):  # 2 evicts 1 (0 was used after it); then 1 comes back
        run(prompts[i])
    assert (cache.misses, cache.hits) == (2 * 4, 2 * 2)
    assert [len(e) for e in cache._entries.values()] == [2, 2]
    with pytest.raises(ValueError, match="max_prompts"):
        fsd_ext.decoding.PromptCache(max_prompts=0)


def test_forward_clock_on_cuda_reads_events_once(monkeypatch):
    """On CUDA a forward records two events and waits for nothing; the total reads them all once
    (after waiting for the last). Here with stand-in events on the host clock."""
    gen = importlib.import_module("fsd_ext.decoding.model")

    class FakeEvent:
        waited = 0

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = time.perf_counter()

        def synchronize(self):
            FakeEvent.waited += 1

        def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = gen.ForwardClock(cuda=True)
    for _ in range(3):
        started = clock.start()
        time.sleep(0.02)
        clock.stop(started)
    assert FakeEvent.waited == 0 and len(clock.pending) == 3
    assert 0.06 <= clock.total() < 0.5 and FakeEvent.waited == 1 and not clock.pending
    assert clock.total() == clock.seconds and FakeEvent.waited == 1  # nothing left to read


def test_graph_captures_are_timed_apart(target, draft, monkeypatch):
    """Warm-ups and captures (here a stand-in that takes 0.1 s each) go to stats.capture_seconds,
    not to the models' forward seconds, and decode tokens/s leaves them out."""
    class SlowCapture(ReplayByCall):
        def __init__(self, *args):
            time.sleep(0.1)
            super().__init__(*args)

    ids, mask = random_prompts([5, 9], seed=42)
    kwargs = dict(rule="sd", num_draft_tokens=3, max_new_tokens=10, seed=0, eos_token_id=[])
    eager = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    assert eager.stats.capture_seconds == 0.0 and "graph captures" not in eager.stats.summary()
    stats = generate_graph_shaped(monkeypatch, target, draft, ids, mask, replay=SlowCapture, **kwargs).stats
    captures = len(ReplayByCall.made)  # draft (1 and 2 tokens), target (4 tokens)
    assert captures >= 2 and 0.1 * captures <= stats.capture_seconds < 0.1 * captures + 0.5
    assert stats.target_seconds + stats.draft_seconds + stats.capture_seconds <= stats.seconds
    decode_seconds = stats.seconds - stats.prefill_seconds - stats.capture_seconds
    assert stats.decode_tokens_per_second == pytest.approx(stats.new_tokens / decode_seconds)
    assert "graph captures" in stats.summary()


@pytest.mark.parametrize("rule,temperature,stop", [
    ("ar", 0.0, "eos"), ("greedy", 0.0, "eos"), ("sd", 1.0, "eos"), ("fsd", 0.8, "eos"),
    ("greedy", 0.0, "max_new_tokens"), ("sd", 1.0, "max_new_tokens")])
def test_graph_path_parks_stopped_rows_until_a_power_of_two(target, draft, monkeypatch, rule,
                                                            temperature, stop):
    """With graphs on, rows that stop at different steps stay in the batch as parked slots (outputs
    discarded, cache lengths frozen) until the live rows fit a power of two, so forwards are
    captured for the first batch size and powers of two only. Tokens and counts must equal the
    eager run (which drops every stopped row at once), and no forward may write past the cache
    (a row parked at max_new_tokens whose length kept growing would)."""
    gen = importlib.import_module("fsd_ext.decoding.model")
    by_eos = stop == "eos"
    lengths = [5, 12, 2, 7, 9, 3] if by_eos else [5, 12, 2, 7, 9, 3, 4, 8]
    ids, mask = random_prompts(lengths, seed=41)
    kwargs = dict(rule=rule, temperature=temperature, threshold=0.3, num_draft_tokens=3,
                  max_new_tokens=30 if by_eos else 13, seed=torch.arange(len(lengths)),
                  eos_token_id=list(range(3, VOCAB, 9)) if by_eos else [],
                  output_divergences=rule != "ar")
    forward = gen.CachedModel._forward
    shapes, overshoot = [], []  # per forward: (batch, tokens); slots past the capacity written

    def spy(self, input_ids, keep):
        shapes.append(tuple(input_ids.shape))
        overshoot.append(int(self.cache.lengths.max()) + input_ids.shape[1] - self.cache.capacity)
        return forward(self, input_ids, keep)

    monkeypatch.setattr(gen.CachedModel, "_forward", spy)
    eager = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    eager_shapes = list(shapes)
    allowed = {len(lengths), 4, 2, 1}
    assert {batch for batch, _ in eager_shapes} - allowed, \
        "no row stopped at a batch size a graph run would park"
    shapes.clear()
    graphed = generate_graph_shaped(monkeypatch, target, draft, ids, mask, **kwargs)
    assert max(overshoot) <= 0, "a forward wrote past the cache capacity"
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    # Parked slots change no step's shape: the same forwards of the same token counts (k_step and
    # the draft's two-token re-read are decided by the live rows alone).
    assert [tokens for _, tokens in shapes] == [tokens for _, tokens in eager_shapes]
    for name in ("new_tokens", "verifications", "accepted_drafts", "accepted_histogram",
                 "sd_rejected_accepted", "target_forwards", "draft_forwards"):
        assert getattr(graphed.stats, name) == getattr(eager.stats, name), name
    if rule != "ar":  # per step, the live rows' divergences only
        assert [d.shape for d in graphed.stats.divergences] == [d.shape for d in eager.stats.divergences]
        for a, b in zip(graphed.stats.divergences, eager.stats.divergences):
            torch.testing.assert_close(a, b, equal_nan=True)
    sizes = {batch for batch, _, _ in ReplayByCall.made}
    assert sizes <= allowed and len(lengths) in sizes and len(sizes) > 1, sizes


def test_graph_state_is_reused_by_later_calls(target, draft, monkeypatch):
    """The cache and graphs of a graph-path call serve later calls that fit (no new capture, the
    same tokens as eager), including smaller batches and a larger max_new_tokens; a larger batch, a
    cache grown past twice what the call starts with or moved weights get a new state; a failing
    call gives its state back."""
    ids, mask = random_prompts([5, 12, 2, 7, 9, 3], seed=43)
    kwargs = dict(rule="fsd", temperature=0.0, threshold=0.3, num_draft_tokens=3, max_new_tokens=20,
                  eos_token_id=list(range(3, VOCAB, 9)))

    def run(ids, mask, reuse=True, **extra):
        args = dict(kwargs, **extra)
        graphed = generate_graph_shaped(monkeypatch, target, draft, ids, mask, reuse=reuse, **args)
        monkeypatch.undo()  # back to the eager path for the comparison
        assert graphed.sequences.tolist() == fsd_ext.generate(target, draft, ids, mask, **args).sequences.tolist()
        return graphed.stats, list(ReplayByCall.made), cuda_graphs._states[target]["target"]

    _, first, state = run(ids, mask, reuse=False)
    assert {batch for batch, _, _ in first} > {6}, "the first call shrank its batch"
    stats, made, again = run(ids, mask)
    assert made == [] and again is state and stats.capture_seconds == 0.0
    _, made, again = run(ids[[1, 4]], mask[[1, 4]])  # two rows: the cache's first two
    assert again is state and all(batch <= 2 for batch, _, _ in made)
    _, made, again = run(torch.cat([ids, ids[:2]]), torch.cat([mask, mask[:2]]))  # 8 rows
    assert again is not state and (8, 1, 1) in made
    state = again
    _, _, again = run(ids, mask, max_new_tokens=600)  # may need more, but its rows end early
    assert again is state and state.cache.capacity == cuda_graphs.CAPACITY_STEP
    state.grow(4 * cuda_graphs.CAPACITY_STEP)  # as a long call leaves it: over twice what a call starts with
    _, made, again = run(ids, mask)
    assert again is not state and made and again.cache.capacity == cuda_graphs.CAPACITY_STEP
    state = again
    weight = target.lm_head.weight
    with torch.no_grad():
        target.lm_head.weight = torch.nn.Parameter(weight.detach().clone())  # same values, moved
    try:
        _, made, again = run(ids, mask)
    finally:
        target.lm_head.weight = weight
    assert again is not state and made
    state = again
    handle = target.model.layers[0].register_forward_hook(lambda *args: None)  # not replayed by a graph
    try:
        _, made, again = run(ids, mask)
    finally:
        handle.remove()
    assert again is not state and made
    gen = importlib.import_module("fsd_ext.decoding.loop")

    def fail(self):
        raise RuntimeError("fails mid-call")

    monkeypatch.setattr(gen._Decoder, "run", fail)
    with pytest.raises(RuntimeError, match="mid-call"):
        generate_graph_shaped(monkeypatch, target, draft, ids, mask, reuse=True, **kwargs)
    assert not cuda_graphs._states[target]["target"].in_use and not cuda_graphs._states[draft]["draft"].in_use
    monkeypatch.undo()
    cuda_graphs.release_cuda_graphs()
    assert not cuda_graphs._states


def test_reused_graph_state_starts_from_a_clear_cache(target, monkeypatch):
    """A call that failed on NaN logits may leave NaN in the cache past the lengths, where the
    attention mask cannot hide it (-max + NaN = NaN): a later call reusing the state must not
    see it."""
    ids, mask = random_prompts([5, 9], seed=45)
    kwargs = dict(rule="ar", temperature=0.0, max_new_tokens=8, eos_token_id=[])
    first = generate_graph_shaped(monkeypatch, target, None, ids, mask, **kwargs)
    cache = cuda_graphs._states[target]["target"].cache
    for buffer in cache._keys + cache._values:
        buffer.fill_(float("nan"))
    again = generate_graph_shaped(monkeypatch, target, None, ids, mask, reuse=True, **kwargs)
    assert cuda_graphs._states[target]["target"].cache is cache and ReplayByCall.made == []
    assert again.sequences.tolist() == first.sequences.tolist()
    cuda_graphs.release_cuda_graphs()


def test_graph_path_with_the_same_model_as_target_and_draft(target, monkeypatch):
    """One model in both roles: a state (cache and graphs) per role, each reused by the next call;
    the tokens equal eager."""
    ids, mask = random_prompts([5, 9], seed=44)
    kwargs = dict(rule="sd", temperature=0.0, num_draft_tokens=3, max_new_tokens=12, eos_token_id=[])
    eager = fsd_ext.generate(target, target, ids, mask, **kwargs)
    for reuse in (False, True):
        graphed = generate_graph_shaped(monkeypatch, target, target, ids, mask, reuse=reuse, **kwargs)
        assert graphed.sequences.tolist() == eager.sequences.tolist()
        assert graphed.stats.accepted_drafts == eager.stats.accepted_drafts
        roles = cuda_graphs._states[target]
        assert set(roles) == {"target", "draft"} and roles["target"].cache is not roles["draft"].cache
        assert not any(state.in_use for state in roles.values())
        assert (ReplayByCall.made == []) == reuse  # the second call captures nothing
    cuda_graphs.release_cuda_graphs()


def forward_under_fake_tensors(model, use_graphs, num_tokens, keep):
    """One decode forward of `model` through CachedModel._forward, after a real prefill, run under
    FakeTensorMode: any data-dependent host operation (.item(), int(tensor), a branch on a tensor:
    a host synchronisation, which CUDA graph capture rejects) raises DataDependentOutputException."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = importlib.import_module("fsd_ext.decoding.model")
    cached = gen.CachedModel(model, pad=torch.tensor([0, 3]), capacity=24, use_graphs=use_graphs)
    with torch.no_grad():
        cached(torch.randint(3, VOCAB, (2, 6)), keep=1, prefill=True)  # allocates the cache
        cached.cache.lengths += 6
        with FakeTensorMode(allow_non_fake_inputs=True):
            return cached._forward(torch.randint(3, VOCAB, (2, num_tokens)), keep)


class ProvenanceLog(TorchDispatchMode):
    """Records the ops (under the mode) that read a tensor neither in `allowed` (storage addresses)
    nor made by an earlier op under the mode, and the host synchronisations."""

    def __init__(self, allowed):
        super().__init__()
        self.allowed, self.foreign, self.syncs = set(allowed), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.numel() and storage_of(t) not in self.allowed:
                self.foreign.append((str(func), tuple(t.shape)))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.append(str(func))
        out = func(*args, **kwargs)
        self.allowed.update(storage_of(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def storage_of(t):
    return t.untyped_storage().data_ptr()


class CaptureWithProvenance(ReplayByCall):
    """A stand-in capture that runs the forward once as a capture would, under ProvenanceLog: a
    graph may read the weights, the cache buffers and its static input, and what it computes
    itself; anything else (e.g. made during the prefill or the warm-ups) the caching allocator may
    hand to another tensor while the graph still reads it."""

    logs = []
    drop_cache_from_allowed = False  # the negative control

    def __init__(self, forward, input_ids, keep, pool=None):
        super().__init__(forward, input_ids, keep, pool)
        owner, cache = forward.__self__, forward.__self__.cache
        allowed = [*owner.model.parameters(), *owner.model.buffers(), cache._pad, cache._lengths,
                   *cache._keys, *cache._values, self.input_ids]
        if CaptureWithProvenance.drop_cache_from_allowed:
            allowed = [t for t in allowed if not any(t is b for b in cache._keys + cache._values)]
        log = ProvenanceLog(storage_of(t) for t in allowed)
        with log:
            forward(self.input_ids, keep)
        CaptureWithProvenance.logs.append(log)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_captured_forwards_read_only_weights_cache_and_their_own_tensors(target, draft, arch, monkeypatch):
    """Every forward generate captures (draft step and re-read, verification) reads only what
    stays put for the graph's life and makes no host synchronisation. Negative control: with the
    cache buffers left out of what may be read, the same check flags the reads."""
    models = (target, draft) if arch == "llama" else (tiny_qwen2(0), tiny_qwen2(1))
    ids, mask = random_prompts([4, 9, 6], seed=46)
    kwargs = dict(rule="fsd", temperature=0.0, num_draft_tokens=3, max_new_tokens=10, eos_token_id=[])
    for negative_control in (False, True):
        CaptureWithProvenance.logs, CaptureWithProvenance.drop_cache_from_allowed = [], negative_control
        generate_graph_shaped(monkeypatch, *models, ids, mask, replay=CaptureWithProvenance, **kwargs)
        shapes = {made[1:] for made in ReplayByCall.made}
        assert {(1, 1), (4, 4)} <= shapes, shapes  # the draft step and the verification, at least
        foreign = [op for log in CaptureWithProvenance.logs for op in log.foreign]
        assert bool(foreign) == negative_control, foreign[:5]
        assert not any(log.syncs for log in CaptureWithProvenance.logs)
    cuda_graphs.release_cuda_graphs()


def tiny_qwen2(seed):
    """A randomly initialised Qwen2 (the default model pair's architecture), sliding window on."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=8, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_tokens,keep", [(1, 1), (2, 1), (4, 4)])  # draft step, re-read, verify
def test_graph_forward_has_no_host_sync(target, arch, num_tokens, keep):
    """The forwards the loop captures in CUDA graphs must not synchronise with the host, or capture
    fails on the GPU: checked here, under this transformers version, by running them on fake
    tensors. Negative control: the eager path's forward (it reads the longest row's length to trim
    the attention) must raise."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    model = target if arch == "llama" else tiny_qwen2(0)
    logits = forward_under_fake_tensors(model, True, num_tokens, keep)
    assert logits.shape == (2, keep, VOCAB)
    with pytest.raises(DataDependentOutputException):
        forward_under_fake_tensors(model, False, num_tokens, keep)


@pytest.mark.parametrize("poisoned_model", ["draft", "target"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_raise_a_clear_error(target, draft, monkeypatch, poisoned_model, temperature):
    """NaN logits in one row mid-decode end the call with a RuntimeError naming the row; a NaN draft
    row must not feed its -1 "no token" to the embedding (an IndexError here, a device-side assert
    that ends the process on CUDA)."""
    model = draft if poisoned_model == "draft" else target
    real_forward, calls = model.forward, []

    @functools.wraps(real_forward)  # keeps the signature generate inspects
    def poisoned(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 4:
            out.logits[1] = float("nan")
        return out

    monkeypatch.setattr(model, "forward", poisoned)
    ids, mask = random_prompts([5, 9, 3], seed=3)
    with pytest.raises(RuntimeError, match=r"row\(s\) \[1\] hold NaN"):
        fsd_ext.generate(target, draft, ids, mask, rule="fsd", temperature=temperature,
                         max_new_tokens=20, seed=0, eos_token_id=[])


# ----------------------------------------------------------------------------------------------
# The static cache's memory: it grows with the tokens produced, not with max_new_tokens.

def cache_bytes(cache) -> int:
    """Bytes of K/V buffers a StaticKVCache holds."""
    return sum(t.numel() * t.element_size() for t in cache._keys + cache._values)


def record_caches(monkeypatch) -> list:
    """Every StaticKVCache that generate() makes off the graph path from now on (a list that fills)."""
    gen = importlib.import_module("fsd_ext.decoding.model")
    made = []

    class Recorded(gen.StaticKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(gen, "StaticKVCache", Recorded)
    return made


@pytest.mark.parametrize("rule", ["ar", "sd"])
def test_cache_memory_follows_the_answer_not_max_new_tokens(monkeypatch, rule):
    """A ~64-token answer (stopped by EOS) under max_new_tokens=4_000_000 holds no more cache than
    under max_new_tokens=64 (before: 4M slots per row, ~3 GB for these tiny models)."""
    target, draft = tiny_llama(0, layers=2), tiny_llama(1, layers=1)  # flat: varied sampled tokens
    ids, mask = random_prompts([9, 4], seed=50)
    kwargs = dict(rule=rule, temperature=1.0, num_draft_tokens=3, seed=0)
    # Sampled tokens depend on the seed alone: the 4M run repeats this one until the EOS chosen here,
    # row 0's first token from the 64th on that it had not emitted before.
    free = new_tokens(fsd_ext.generate(target, draft, ids, mask, max_new_tokens=200, eos_token_id=[],
                                       **kwargs), ids.shape[1])[0]
    stop = next(i for i in range(63, 190) if free[i] not in free[:i])
    caches = record_caches(monkeypatch)
    out = fsd_ext.generate(target, draft, ids, mask, max_new_tokens=4_000_000, eos_token_id=[free[stop]],
                           **kwargs)
    assert new_tokens(out, ids.shape[1])[0] == free[:stop + 1]
    long_bytes = [cache_bytes(cache) for cache in caches]
    caches.clear()
    fsd_ext.generate(target, draft, ids, mask, max_new_tokens=64, eos_token_id=[], **kwargs)
    short_bytes = [cache_bytes(cache) for cache in caches]
    assert len(long_bytes) == len(short_bytes) == (1 if rule == "ar" else 2)
    for long, short in zip(long_bytes, short_bytes):
        assert 0 < long <= short, (long_bytes, short_bytes)


def test_cache_growth_keeps_the_entries_and_moves_every_view():
    """grow() copies each layer's slots into larger zeroed buffers; the live rows' views (keys,
    values, layer_buffers, what update returns) all move with them."""
    from fsd_ext.decoding.kv_cache import StaticKVCache

    cache = StaticKVCache(torch.tensor([0, 2, 1]), capacity=4)
    for layer in range(2):  # a 3-token prefill allocates both layers
        cache.attention_inputs(3, torch.float32, 4)
        cache.update(torch.randn(3, 2, 3, 8), torch.randn(3, 2, 3, 8), layer)
    cache.lengths += 3
    cache.select(torch.tensor([2, 0]))  # two live rows of three
    before = [t.clone() for t in cache._keys + cache._values]
    cache.grow(8)
    assert cache.capacity == 8
    for old, new in zip(before, cache._keys + cache._values):
        assert new.shape == (3, 2, 8, 8) and torch.equal(new[:, :, :4], old) and not new[:, :, 4:].any()
    assert all(view.data_ptr() == buffer.data_ptr() and view.shape == (2, 2, 8, 8)
               for view, buffer in zip(cache.keys + cache.values, cache._keys + cache._values))
    keys, values, _ = cache.layer_buffers(1)
    assert keys is cache.keys[1] and values is cache.values[1]
    new_keys = torch.randn(2, 2, 5, 8)
    cache.attention_inputs(5, torch.float32, 8)  # slots 3..7: past the old capacity
    got_keys, _ = cache.update(new_keys, torch.randn(2, 2, 5, 8), 0)
    assert torch.equal(got_keys[:, :, 3:], new_keys) and torch.equal(got_keys[:, :, :3], before[0][:2, :, :3])
    with pytest.raises(ValueError, match="cannot grow"):
        cache.grow(8)


def test_capacity_doubles_and_stops_at_what_the_call_can_need():
    from fsd_ext.decoding.kv_cache import capacity_for

    assert [capacity_for(slots, 10**6) for slots in (1, 256, 257, 600, 5000)] == [256, 256, 512, 1024, 8192]
    assert capacity_for(600, 700) == 768  # the most a call can need, rounded up to 256
    assert capacity_for(900, 700) == 1024  # never less than asked
    gen = importlib.import_module("fsd_ext.decoding.model")
    ids = torch.tensor([0])
    assert gen.CachedModel(tiny_llama(0, layers=1), ids, 600, use_graphs=False).cache.capacity == 768  # all
    assert gen.CachedModel(tiny_llama(0, layers=1), ids, 600, use_graphs=False, slots=20).cache.capacity == 256


@pytest.mark.parametrize("rule,temperature", [("ar", 0.0), ("greedy", 0.0), ("sd", 1.0), ("fsd", 0.8)])
def test_tokens_do_not_change_when_the_cache_grows(target, draft, monkeypatch, rule, temperature):
    """With 4-slot steps the caches grow several times mid-decode (doubling, at last to what the
    call can need), eager and down the graph path, whose graphs are captured again after each
    growth (ReplayByCall checks that no replay reads a moved tensor): the tokens equal a call whose
    caches never grow."""
    from fsd_ext.decoding import kv_cache

    ids, mask = random_prompts([3, 11, 1, 6], seed=51)
    kwargs = dict(rule=rule, temperature=temperature, threshold=0.3, num_draft_tokens=3,
                  max_new_tokens=40, seed=torch.arange(4), eos_token_id=[])
    expected = fsd_ext.generate(target, draft, ids, mask, **kwargs).sequences.tolist()  # 256 slots: no growth
    grown = []
    grow = kv_cache.StaticKVCache.grow
    monkeypatch.setattr(kv_cache.StaticKVCache, "grow",
                        lambda self, capacity: (grown.append((self.capacity, capacity)), grow(self, capacity)))
    monkeypatch.setattr(kv_cache, "CAPACITY_STEP", 4)
    eager = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    assert eager.sequences.tolist() == expected
    # The first forwards need 11 + k + 1 slots (16); the call at most 11 + 1 + 40 + k + 1 (56).
    models = 1 if rule == "ar" else 2
    assert sorted(grown) == [(16, 32)] * models + [(32, 56)] * models, grown
    graphed = generate_graph_shaped(monkeypatch, target, draft, ids, mask, **kwargs)
    assert graphed.sequences.tolist() == expected
    assert len(ReplayByCall.made) > len(set(ReplayByCall.made)), "no shape was captured again"
    cuda_graphs.release_cuda_graphs()


# ----------------------------------------------------------------------------------------------
# Draft length: how many of the K drafts each row proposes.

@pytest.mark.parametrize("draft_length", ["confidence", "heuristic", "acceptance"])
@pytest.mark.parametrize("rule", ["greedy", "sd"])
@pytest.mark.parametrize("lengths", [[9], [3, 11, 1, 6]])
def test_every_draft_length_keeps_the_greedy_output(target, draft, draft_length, rule, lengths):
    """Under greedy decoding the output is the target's argmax whatever was drafted: a policy may
    change the work, never the tokens."""
    ids, mask = random_prompts(lengths, seed=50)
    kwargs = dict(rule=rule, temperature=0.0, num_draft_tokens=4, max_new_tokens=20, seed=0)
    fixed = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    out = fsd_ext.generate(target, draft, ids, mask, draft_length=draft_length,
                           draft_confidence=0.9, **kwargs)
    assert out.sequences.tolist() == fixed.sequences.tolist()
    assert fixed.stats.mean_drafted > 3.5  # K = 4 but for the last steps
    assert out.stats.mean_drafted < fixed.stats.mean_drafted  # the policy did shorten some steps


def test_confidence_one_drafts_fewer_and_zero_drafts_all(target, draft):
    ids, mask = random_prompts([5, 8, 2], seed=51)
    kwargs = dict(rule="sd", temperature=0.0, num_draft_tokens=4, max_new_tokens=16, seed=0)
    fixed = fsd_ext.generate(target, draft, ids, mask, **kwargs)
    stops = fsd_ext.generate(target, draft, ids, mask, draft_length="confidence",
                             draft_confidence=1.0, **kwargs)  # every draft is below 1: one each
    assert stops.sequences.tolist() == fixed.sequences.tolist()
    assert stops.stats.drafted_tokens == stops.stats.verifications < fixed.stats.drafted_tokens
    # One draft forward per step after the prefill: the step stops as soon as every row has.
    assert stops.stats.draft_forwards == stops.stats.target_forwards < fixed.stats.draft_forwards
    never = fsd_ext.generate(target, draft, ids, mask, draft_length="confidence",
                             draft_confidence=0.0, **kwargs)
    assert never.sequences.tolist() == fixed.sequences.tolist()
    assert (never.stats.drafted_tokens, never.stats.draft_forwards) == \
        (fixed.stats.drafted_tokens, fixed.stats.draft_forwards)


def test_a_registered_policy_drives_the_loop(target, draft, monkeypatch):
    """A draft-length policy is one class in POLICIES: generate() asks it for each row's cap and
    tells it what each step kept, row by row."""
    from fsd_ext.decoding.draft_length import POLICIES, DraftLength

    seen = []

    class Alternate(DraftLength):
        name = "alternate"  # rows alternate between 1 and K drafts per step

        def __init__(self, k, rows, **options):
            super().__init__(k, rows)
            self.steps = [0] * rows

        def cap(self, row):
            return 1 if self.steps[row] % 2 else self.k

        def record(self, row, num_accepted, num_drafted):
            seen.append((row, num_drafted))
            self.steps[row] += 1

    monkeypatch.setitem(POLICIES, "alternate", Alternate)
    ids, mask = random_prompts([4, 7], seed=52)
    kwargs = dict(rule="sd", temperature=0.0, num_draft_tokens=4, max_new_tokens=16, seed=0)
    out = fsd_ext.generate(target, draft, ids, mask, draft_length="alternate", **kwargs)
    assert out.sequences.tolist() == fsd_ext.generate(target, draft, ids, mask, **kwargs).sequences.tolist()
    for row in (0, 1):
        drafted = [n for r, n in seen if r == row]
        assert drafted[1::2] and set(drafted[1::2]) == {1}  # every second step: one draft
        assert max(drafted[0::2]) == 4
    assert out.stats.drafted_tokens == sum(n for _, n in seen)


def test_heuristic_schedule_on_a_fake_sequence():
    """Hugging Face's schedule: +2 after a step that accepted all its drafts, -1 otherwise, kept
    within [1, max_k]."""
    k, ks = 5, []
    for accepted_all in [True, False, False, True, True, True, False, False, False, False, False,
                         False, True]:
        k = heuristic_draft_length(k, num_accepted=k if accepted_all else k - 1, num_drafted=k,
                                   max_k=8)
        ks.append(k)
    assert ks == [7, 6, 5, 7, 8, 8, 7, 6, 5, 4, 3, 2, 4]
    assert heuristic_draft_length(1, 0, 1, max_k=8) == 1
    assert heuristic_draft_length(3, 0, 3, max_k=8) == 2


def test_acceptance_length_follows_the_rate_and_the_cost():
    assert acceptance_draft_length(0.0, 8, 0.25) == 1  # nothing accepted: draft the least
    assert acceptance_draft_length(1.0, 8, 0.01) == 8  # all accepted, drafts cheap: the most
    lengths = [acceptance_draft_length(rate, 8, 0.25) for rate in (0.2, 0.5, 0.7, 0.8, 0.9, 0.95)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    # E[tokens](K) / (1 + cost K) at rate 0.8, cost 0.25, by hand: K=1 1.44, 2 1.627, 3 1.686,
    # 4 1.681 -> 3.
    assert acceptance_draft_length(0.8, 8, 0.25) == 3
    assert acceptance_draft_length(0.8, 8, 1.0) == 1  # a draft as dear as a verification
    # A rejection tests one draft more than were accepted; a fully accepted step tests them all.
    accepted, tested = _update_acceptance((0.0, 0.0), num_accepted=2, num_drafted=4)
    assert (accepted, tested) == (2.0, 3.0)
    accepted, tested = _update_acceptance((accepted, tested), num_accepted=4, num_drafted=4)
    assert (accepted, tested) == pytest.approx((0.8 * 2 + 4, 0.8 * 3 + 4))


# ----------------------------------------------------------------------------------------------
# Bad arguments.

@pytest.mark.parametrize("kwargs,error", [
    (dict(rule="nope"), ValueError),
    (dict(divergence="l2"), ValueError),
    (dict(threshold=-1.0), ValueError),
    (dict(num_draft_tokens=0), ValueError),
    (dict(max_new_tokens=0), ValueError),
    (dict(temperature=-0.5), ValueError),
    (dict(use_cuda_graphs="yes"), ValueError),
    (dict(use_cuda_graphs=True), ValueError),  # no CUDA model here
    (dict(top_p=1.5), ValueError),
    (dict(seed=[1, 2, 3]), ValueError),
    (dict(seed="x"), ValueError),
    (dict(draft_length="dynamic"), ValueError),
    (dict(draft_length="confidence", draft_confidence=1.5), ValueError),
    (dict(draft_confidence=-0.1), ValueError),
    (dict(draft_confidence="high"), ValueError),
    (dict(draft_length="acceptance", draft_cost=0.0), ValueError),
    (dict(draft_cost=float("inf")), ValueError),
])
def test_bad_arguments_raise(target, draft, kwargs, error):
    if kwargs.get("use_cuda_graphs") is True and torch.cuda.is_available():
        pytest.skip("CUDA present")
    ids, mask = random_prompts([3, 4], seed=16)
    with pytest.raises(error):
        fsd_ext.generate(target, draft, ids, mask, max_new_tokens=kwargs.pop("max_new_tokens", 4),
                         **kwargs)


def test_bad_inputs_raise(target, draft):
    ids, mask = random_prompts([3, 4], seed=17)
    with pytest.raises(ValueError, match="left-padded"):
        fsd_ext.generate(target, draft, ids, mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match="input_ids"):
        fsd_ext.generate(target, draft, ids[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="draft model"):
        fsd_ext.generate(target, None, ids, mask, rule="sd", max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        fsd_ext.generate(target, draft, ids, mask, max_new_tokens=4, streamer=object())
    with pytest.raises(ValueError, match="draft vocabulary"):
        fsd_ext.generate(tiny_llama(4, layers=1, vocab=64), draft, ids % 64, mask, max_new_tokens=4)
    for bad_ids in (ids + VOCAB, -ids):  # the embedding would fail (on CUDA: a device-side assert)
        with pytest.raises(ValueError, match="target vocabulary"):
            fsd_ext.generate(target, draft, bad_ids, mask, max_new_tokens=4)
    assert fsd_ext.generate(target, None, ids, mask, rule="ar", max_new_tokens=2).sequences.shape == (2, 6)


def test_tokenizer_mismatch_raises():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    check_tokenizers(Tok({"a": 0, "b": 1, "c": 2}), Tok({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_tokenizers(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}))


# ----------------------------------------------------------------------------------------------
# Real weights (--runslow).

@pytest.mark.slow
def test_real_smollm2_greedy_matches_hf():
    from fsd_ext import models

    model, tokenizer = models.load("smollm2-135m", dtype=torch.float32, linear_weights=None)
    enc = tokenizer(["def fibonacci(n):", "The capital of France is"], return_tensors="pt",
                    padding=True, padding_side="left")
    expected = model.generate(**enc, do_sample=False, max_new_tokens=12,
                              pad_token_id=tokenizer.pad_token_id)
    out = fsd_ext.generate(model, model, enc.input_ids, enc.attention_mask, rule="greedy",
                           max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.mean_accepted == 5  # the model drafting for itself agrees with itself


@pytest.mark.slow
def test_real_qwen_pair_few_tokens():
    from fsd_ext import models

    target, tokenizer = models.load("qwen2.5-coder-1.5b", dtype=torch.float32, linear_weights=None)
    draft, draft_tokenizer = models.load("qwen2.5-coder-0.5b", dtype=torch.float32,
                                                linear_weights=None)
    check_tokenizers(tokenizer, draft_tokenizer)
    enc = tokenizer(["def is_prime(n):"], return_tensors="pt")
    expected = target.generate(**enc, do_sample=False, max_new_tokens=8)
    out = fsd_ext.generate(target, draft, enc.input_ids, rule="greedy", max_new_tokens=8)
    assert out.sequences.tolist() == expected.tolist()
    out = fsd_ext.generate(target, draft, enc.input_ids, rule="fsd", max_new_tokens=8, seed=0)
    assert out.stats.mean_accepted > 1.0


# ----------------------------------------------------------------------------------------------
# Weights and CLI plumbing (no real weights needed).

def test_assemble_gguf_concatenates_in_order_and_checks_sha256(tmp_path, monkeypatch):
    import hashlib

    from fsd_ext import models

    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 100, b"b" * 57, b"c" * 3]):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setenv("FSD_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "ensure_installed", lambda spec: None)
    monkeypatch.setattr(models, "part_files", lambda spec: parts)
    spec = models.WeightSpec("fake", ("p1", "p2", "p3"), "1.0", hashlib.sha256(whole).hexdigest(), "")
    out = models.assemble_gguf(spec)
    assert out.read_bytes() == whole
    assert models.assemble_gguf(spec) == out  # the stamp short-circuits the second call
    bad = models.WeightSpec("bad", spec.packages, "1.0", "0" * 64, "")
    with pytest.raises(RuntimeError, match="sha256"):
        models.assemble_gguf(bad)


def test_converted_tokenizer_config_loads_under_transformers_4_and_5(tmp_path):
    """transformers 5 saves a generic fast tokenizer as class "TokenizersBackend", which 4.5x cannot
    load; the converted folder must name a class both have and keep the ids the same."""
    import json

    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from fsd_ext import models

    vocab = {"<unk>": 0, "<eos>": 1, "def": 2, "f": 3, "(": 4, ")": 5, ":": 6}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(str(tmp_path))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "TokenizersBackend"  # what transformers 5 writes
    config_path.write_text(json.dumps(config))

    models._make_tokenizer_config_portable(tmp_path)
    config = json.loads(config_path.read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_input_names"] == ["input_ids", "attention_mask"]
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    enc = loaded("def f ( ) :")
    assert enc["input_ids"] == [2, 3, 4, 5, 6]
    assert sorted(enc) == ["attention_mask", "input_ids"]
    models._make_tokenizer_config_portable(tmp_path)  # idempotent
    assert json.loads(config_path.read_text()) == config


def test_cli_parser():
    from fsd_ext import cli

    args = cli.build_parser().parse_args(["generate", "--target", "t", "--draft", "d", "--prompt",
                                          "hi", "--rule", "sd", "--threshold", "0.1"])
    assert (args.rule, args.threshold, args.num_draft_tokens, args.chat) == ("sd", 0.1, 5, True)
    assert (args.min_p, args.div_temperature) == (None, 1.0)
    args = cli.build_parser().parse_args(["generate", "--target", "t", "--draft", "d", "--prompt",
                                          "hi", "--min-p", "0.05", "--div-temperature", "none"])
    kwargs = cli._generate_kwargs(args, args.rule)
    assert (kwargs["min_p"], kwargs["div_temperature"]) == (0.05, None)
    assert (kwargs["draft_length"], kwargs["draft_confidence"]) == ("fixed", 0.4)
    for rule in fsd_ext.LENIENT_RULES:  # every lenient rule reaches generate's kwargs
        args = cli.build_parser().parse_args(["generate", "--target", "t", "--draft", "d", "--prompt",
                                              "hi", "--rule", rule, "--threshold", "2.5"])
        kwargs = cli._generate_kwargs(args, args.rule)
        assert (kwargs["rule"], kwargs["threshold"]) == (rule, 2.5)
        assert cli.build_parser().parse_args(["calibrate", "--target", "t", "--draft", "d",
                                              "--rule", rule]).rule == rule
    args = cli.build_parser().parse_args(["demo", "--draft-length", "heuristic"])
    assert cli._generate_kwargs(args, "sd")["draft_length"] == "heuristic"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--draft-length", "longest"])
    args = cli.build_parser().parse_args(["demo"])
    assert (args.target, args.draft, args.max_new_tokens) == ("qwen2.5-coder-1.5b",
                                                              "qwen2.5-coder-0.5b", 48)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", "t", "--prompt", "hi"])  # sd/fsd need --draft


def test_demo_prints_every_rule_with_the_models_dtype(target, draft, monkeypatch, capsys):
    """`fsd-ext demo`'s table (the README's main job), on the tiny models: a row per rule, and the
    dtype the models run in (bfloat16 on some CPUs by default since the AVX512-BF16 kernel)."""
    import re

    from fsd_ext import cli
    monkeypatch.setattr(cli, "_load_pair", lambda args, need_draft: (target, draft, None))
    monkeypatch.setattr(cli, "_encode", lambda tokenizer, prompt, chat, device: random_prompts([5], seed=3)[0])
    assert cli.main(["demo", "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts x 6 tokens, cpu float32, " in out
    for rule in ("ar", "sd", "fsd"):
        assert re.search(rf"^{rule} +\d+\.\d+ +\d+\.\d+ +\d+\.\d+ +\d+\.\d+x$", out, re.M), out


def test_generate_does_not_load_the_cpu_linear_component():
    """The FSD core (ops, reference, generate) runs whatever modules the models have; the CPU linear
    kernels are a component of their own (fsd_ext.cpu_linear) that it never imports."""
    import subprocess
    import sys

    code = ("import sys, fsd_ext; from fsd_ext import generate, ops, reference; "
            "assert not [m for m in sys.modules if m.startswith('fsd_ext.cpu_linear')], sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
