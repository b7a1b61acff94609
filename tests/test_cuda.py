"""CUDA kernels of fsd_ext against the CPU kernel and the pure-torch reference (docs/design.md 2-3).

Everything here needs a GPU and the extension built with CUDA; without a GPU every test is skipped.
Run: pytest -m cuda tests/ (the launch paths and their switches: test_cuda_launch.py; the tests
that run on both devices, device-parametrized: test_accept.py)

- parity: same seed -> same tokens on CUDA, on the CPU kernel and in the reference (>= 99.9% of
  rows over large random batches, all rows on well-separated logits, >= 98-99% elsewhere); divergences
  within 1e-5 relative of the float64 reference; every dtype, rule, divergence, filter, ragged K,
  V_d < V_t, odd vocabularies; filter and div_top_k edge cases (ties, signed zeros, masks);
- invalid rows: NaN / all -inf logits, draft ids outside the draft vocabulary, num_draft > K,
  per-row threshold / temperature values out of range;
- statistics on the GPU: under fsd below the threshold the emitted token follows q (chi-square
  over 1e5 rows, with a negative control);
- no host synchronisation inside the ops;
- generate with CUDA graphs: the same tokens as eager, stopped rows parked, the graphs reused by
  the next call.
"""

from __future__ import annotations

import pytest
import torch

from fsd_ext import reference
from helpers import (DIVERGENCES, DTYPES, FILTER_ROW_SHAPES, RULES, agreement, chi_square_pvalue, filter_rows,
                     make_case, run_accept)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



# ----------------------------------------------------------------------------------------------
# Parity with the CPU kernel and the reference.

@pytest.mark.parametrize("rule", RULES)
def test_accept_large_random_batch_agrees_with_cpu(fops, rule):
    target, draft, tokens, nd = make_case(4096, 4, 1000, num_draft=True, seed=1)
    kw = dict(rule=rule, divergence="js", threshold=0.3, temperature=0.9, seed=42, offset=3, num_draft=nd)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    cpu = run_accept(fops, "cpu", target, draft, tokens, **kw)
    assert agreement(cuda, cpu) >= 0.999
    assert bool(cuda.valid.all())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_accept_agrees_with_reference(fops, rule, divergence):
    target, draft, tokens, nd = make_case(256, 3, 512, seed=2, num_draft=True)
    kw = dict(rule=rule, divergence=divergence, threshold=0.2, temperature=1.0, seed=7, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement(cuda, ref) >= 0.99
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("rule", RULES)
def test_accept_well_separated_all_rows_agree(fops, rule):
    target, draft, tokens, _ = make_case(512, 3, 257, separated=True, seed=3)
    kw = dict(rule=rule, divergence="tv", threshold=0.1, temperature=1.0, seed=11)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) == 1.0
    assert agreement(cuda, reference.accept(target, draft, tokens, **kw)) == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,draft_vocab", [(1000, 1000), (32001, 32000), (4099, 3001)])
def test_accept_dtypes_and_vocabs(fops, dtype, vocab, draft_vocab):
    target, draft, tokens, nd = make_case(64, 4, vocab, draft_vocab, dtype=dtype, seed=4, num_draft=True)
    kw = dict(rule="fsd", divergence="kl", threshold=0.5, temperature=0.8, seed=5, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    cpu = run_accept(fops, "cpu", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement(cuda, cpu) >= 0.98 and agreement(cuda, ref) >= 0.98
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert int(cuda.tokens.max()) < vocab


@pytest.mark.parametrize("filters", [dict(top_k=20), dict(top_p=0.8), dict(min_p=0.05),
                                     dict(top_k=50, top_p=0.9, min_p=0.01)])
@pytest.mark.parametrize("rule", ["sd", "fsd", "fsd_strict"])
def test_accept_filters(fops, filters, rule):
    target, draft, tokens, nd = make_case(256, 3, 1000, seed=7, num_draft=True)
    kw = dict(rule=rule, divergence="js", threshold=0.3, temperature=0.7, seed=13, num_draft=nd, **filters)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) >= 0.99
    assert agreement(cuda, reference.accept(target, draft, tokens, **kw)) >= 0.99


@pytest.mark.parametrize("div_temperature", [1.0, None, 2.0])
@pytest.mark.parametrize("div_top_k", [None, 1, 10])
def test_divergence_options(fops, div_temperature, div_top_k):
    target, draft, tokens, _ = make_case(128, 2, 700, 600, seed=8)
    kw = dict(rule="fsd", divergence="mkl", threshold=0.4, temperature=0.5, seed=3,
              div_temperature=div_temperature, div_top_k=div_top_k, return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert agreement(cuda, ref) >= 0.99


def test_greedy_rows_and_per_row_arguments(fops):
    target, draft, tokens, nd = make_case(300, 4, 333, seed=9, num_draft=True)
    tau = torch.rand(300) * (torch.rand(300) > 0.3)  # a third of the rows greedy
    thr = torch.rand(300)
    seeds = torch.randint(-2**62, 2**62, (300,), dtype=torch.int64)
    kw = dict(rule="fsd", temperature=tau, threshold=thr, seed=seeds, num_draft=nd, div_temperature=None)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) >= 0.99
    assert agreement(cuda, reference.accept(target, draft, tokens, **kw)) >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("filters", [dict(), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.1)])
def test_sample_op(fops, dtype, filters):
    logits = (torch.randn(64, 3, 32001, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    got = fops.sample(logits.cuda(), temperature=0.8, seed=17, offset=2, **filters).cpu()
    want = reference.sample(logits, temperature=0.8, seed=17, offset=2, **filters)
    assert (got == want).float().mean().item() >= 0.99
    assert (got == fops.sample(logits, temperature=0.8, seed=17, offset=2, **filters)).float().mean() >= 0.99


# ----------------------------------------------------------------------------------------------
# Filter and div_top_k edge cases: ties, signed zeros, -inf masks, k at the edges, a top_p that
# rounds to 0. The random-logit tests above almost never produce them.

def edge_rows(vocab, copies, seed=0):
    """[7 * copies, vocab]: `copies` rows of every shape of helpers.filter_rows."""
    return torch.cat([filter_rows(shape, copies, vocab, seed=seed + i)
                      for i, shape in enumerate(FILTER_ROW_SHAPES)])


@pytest.mark.parametrize("filters", [
    dict(top_k=1), dict(top_k=7), dict(top_k=4998), dict(top_k=20000), dict(top_p=1e-46),
    dict(top_p=0.3), dict(top_p=0.95), dict(top_p=0.999999), dict(top_k=50, top_p=0.6),
    dict(top_k=3000, top_p=0.9, min_p=0.2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_op_filter_edges(fops, filters, dtype):
    """On tie-heavy and masked rows the CUDA cutoffs keep the same ids as the CPU walk (ties at a
    cutoff kept, top_p=1e-46 keeps only the max, k beyond the finite values keeps them all)."""
    logits = edge_rows(4999, 32).to(dtype)
    seeds = torch.arange(logits.shape[0]) * 7 + 1
    got = fops.sample(logits.cuda(), temperature=0.7, seed=seeds.cuda(), **filters).cpu()
    want = fops.sample(logits, temperature=0.7, seed=seeds, **filters)
    assert (got == want).float().mean().item() >= 0.99
    if filters == dict(top_p=1e-46):  # only the max (and its ties) may be drawn
        values = logits.float()
        assert torch.equal(values.gather(1, got[:, None])[:, 0], values.max(-1).values)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_div_top_k_ties_and_signed_zeros(fops, kind):
    """div_top_k ranks equal values (+0.0 and -0.0 included) by lowest id, as the CPU does."""
    target = edge_rows(777, 4, seed=1)
    draft = torch.randn(target.shape, generator=torch.Generator().manual_seed(2))
    tiny = torch.tensor([[-0.0, -1, -1, -1, 0.0, -1, -1, -1]])
    for k in (1, 2, 5, 100, 700):
        got = fops.divergence(target.cuda(), draft.cuda(), kind, 1.0, k).cpu()
        torch.testing.assert_close(got, fops.divergence(target, draft, kind, 1.0, k), rtol=1e-5, atol=1e-6)
    tiny_draft = torch.arange(8.0)[None] * -0.3
    torch.testing.assert_close(fops.divergence(tiny.cuda(), tiny_draft.cuda(), kind, 1.0, 1).cpu(),
                               reference.divergence(tiny, tiny_draft, kind, 1.0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["sd", "fsd"])
def test_accept_filters_on_tied_logits(fops, rule):
    target = (torch.randint(0, 12, (96, 4, 3001), generator=torch.Generator().manual_seed(3)) * 0.25)
    draft = target[:, :3] + torch.randint(-1, 2, (96, 3, 3001), generator=torch.Generator().manual_seed(4)) * 0.25
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    tokens = torch.multinomial(draft.reshape(-1, 3001).float().softmax(-1), 1).reshape(96, 3)
    for filters in (dict(top_k=40), dict(top_p=0.5), dict(top_k=400, top_p=0.9, min_p=0.3)):
        kw = dict(rule=rule, divergence="js", threshold=0.05, temperature=0.9, seed=5,
                  div_top_k=10, **filters)
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        assert agreement(cuda, run_accept(fops, "cpu", target, draft, tokens, **kw)) >= 0.99


# ----------------------------------------------------------------------------------------------
# Invalid rows.

def test_nan_and_all_neg_inf_rows(fops):
    target, draft, tokens, _ = make_case(8, 3, 300, seed=11)
    target[1, 2, 5] = float("nan")
    draft[2, 0, :] = float("-inf")
    target[3, 3, :] = float("-inf")  # bonus position: used
    target[4, 1, 7] = float("inf")   # +inf is the largest finite value, not an error
    nd = torch.tensor([3, 3, 3, 3, 3, 3, 3, 0])
    target[7, 2, 0] = float("nan")   # unused position (num_draft = 0): ignored
    for rule in RULES:
        # The same seed on both sides (accept draws a random one when seed is None).
        res = run_accept(fops, "cuda", target, draft, tokens, rule=rule, num_draft=nd, return_divergence=True, seed=5)
        ref = reference.accept(target, draft, tokens, rule=rule, num_draft=nd, return_divergence=True, seed=5)
        assert res.valid.tolist() == [True, False, False, False, True, True, True, True]
        assert agreement(res, ref) == 1.0
        assert (res.tokens[~res.valid] == -1).all() and (res.num_accepted[~res.valid] == 0).all()
        assert res.divergence[~res.valid].isnan().all()
        assert res.tokens[4, res.num_accepted[4]] >= 0


def test_out_of_range_draft_ids_mark_row_invalid(fops):
    target, draft, tokens, _ = make_case(6, 3, 100, 80, seed=12)
    tokens[1, 0] = 80   # outside the draft vocabulary (inside the target's)
    tokens[2, 2] = -1
    tokens[3, 2] = 10**6
    nd = torch.tensor([3, 3, 3, 2, 3, 3])  # row 3: the bad id is past num_draft, ignored
    res = run_accept(fops, "cuda", target, draft, tokens, num_draft=nd)
    assert res.valid.tolist() == [True, False, False, True, True, True]
    nd_bad = torch.tensor([3, 3, 3, 2, 4, -1])  # num_draft outside [0, K]
    res = run_accept(fops, "cuda", target, draft, tokens, num_draft=nd_bad)
    assert res.valid.tolist() == [True, False, False, True, False, False]
    assert (res.tokens[4:] == -1).all()


@pytest.mark.parametrize("name,bad", [
    ("temperature", [-1.0, float("nan"), float("inf")]), ("threshold", [-0.5, float("nan")]),
    ("div_temperature", [0.0, -1.0, float("nan"), float("inf")])])
def test_out_of_range_row_values_mark_row_invalid(fops, name, bad):
    """Per-row values out of range (the CPU raises) cannot raise on CUDA without a host sync: those
    rows come back invalid, the other rows as with in-range values. sample emits -1 for them."""
    batch = 8
    target, draft, tokens, _ = make_case(batch, 3, 500, seed=13)
    good = torch.full((batch,), 0.7)
    values = good.clone()
    rows = list(range(1, 2 * len(bad), 2))  # rows 1, 3, ...
    values[rows] = torch.tensor(bad)
    kw = dict(rule="fsd", seed=5, return_divergence=True, temperature=good, threshold=good,
              div_temperature=good)
    res = run_accept(fops, "cuda", target, draft, tokens, **dict(kw, **{name: values}))
    want = run_accept(fops, "cuda", target, draft, tokens, **kw)
    assert res.valid.tolist() == [b not in rows for b in range(batch)]
    assert (res.tokens[rows] == -1).all() and (res.num_accepted[rows] == 0).all()
    assert res.divergence[rows].isnan().all()
    keep = res.valid
    assert torch.equal(res.tokens[keep], want.tokens[keep])
    assert torch.equal(res.num_accepted[keep], want.num_accepted[keep])
    torch.testing.assert_close(res.divergence[keep], want.divergence[keep], equal_nan=True)
    if name == "temperature":
        logits = target[:, 0].cuda()[:, None]  # [B, 1, V]
        got = fops.sample(logits, temperature=values.cuda(), seed=3)[:, 0].cpu()
        expected = fops.sample(logits, temperature=good.cuda(), seed=3)[:, 0].cpu()
        assert (got[rows] == -1).all() and torch.equal(got[keep], expected[keep])


# ----------------------------------------------------------------------------------------------
# Statistics on the GPU (sd's, which the opt-in paths rerun, is in test_cuda_launch.py).

def test_fsd_under_threshold_emits_draft_distribution(fops):
    rows, vocab = 100_000, 16
    target_row = torch.randn(vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    draft_row = target_row + 0.3 * torch.randn(vocab, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    q = draft_row.softmax(-1)
    target = target_row.float().cuda().expand(rows, 2, vocab).contiguous()
    draft = draft_row.float().cuda().expand(rows, 1, vocab).contiguous()
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens = torch.multinomial(q.float().cuda(), rows, replacement=True, generator=g)[:, None]
    res = fops.accept(target, draft, tokens, rule="fsd_strict", threshold=10.0, seed=9)
    assert bool((res.num_accepted == 1).all())
    counts = torch.bincount(res.tokens[:, 0], minlength=vocab).double().cpu()
    assert chi_square_pvalue(counts, q) > 1e-4
    assert chi_square_pvalue(counts, target_row.softmax(-1)) < 1e-6  # negative control: p fails


# ----------------------------------------------------------------------------------------------
# Host synchronisation (CUDA graph replay: test_cuda_launch.py).

def test_no_host_sync(fops):
    target, draft, tokens, nd = make_case(16, 3, 2048, dtype=torch.float16, seed=14, num_draft=True)
    target, draft, tokens, nd = target.cuda(), draft.cuda(), tokens.cuda(), nd.cuda()
    seed = torch.tensor(5, dtype=torch.int64, device="cuda")
    offset = torch.tensor([1], dtype=torch.int64, device="cuda")
    thr = torch.full((16,), 0.2, device="cuda")
    fops.accept(target, draft, tokens, seed=seed, offset=offset, num_draft=nd)  # warm-up (allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fops.accept(target, draft, tokens, seed=seed, offset=offset, num_draft=nd, threshold=thr,
                    top_p=0.9, return_divergence=True)
        fops.sample(target[:, 0], temperature=0.7, seed=seed, offset=offset)
        fops.divergence(target[:, 0], draft[:, 0], "js")
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ----------------------------------------------------------------------------------------------
# The decoding loop on CUDA: captured graphs give the same tokens as eager forwards.

def tiny_cuda_llama(seed, layers):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    model.lm_head.weight.data *= 8.0  # peaky next-token distributions, as real models have
    return model.cuda()


def left_padded_prompts(lengths, seed=3):
    """CUDA (input_ids, attention_mask) [B, max(lengths)] of random left-padded prompts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length:] = torch.randint(3, 256, (length,), generator=gen)
        mask[row, ids.shape[1] - length:] = 1
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("rule,temperature", [("ar", 0.0), ("greedy", 0.0), ("sd", 0.0), ("sd", 1.0),
                                              ("fsd", 0.8)])
def test_generate_cuda_graphs_match_eager(fops, rule, temperature):
    import fsd_ext

    target, draft = tiny_cuda_llama(0, 2), tiny_cuda_llama(1, 1)
    ids, mask = left_padded_prompts([4, 11, 1])
    kwargs = dict(rule=rule, temperature=temperature, threshold=0.3, num_draft_tokens=4, max_new_tokens=20,
                  seed=torch.tensor([5, 6, 7]))
    eager = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=False, **kwargs)
    graphed = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    if temperature == 0.0:
        expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
        assert graphed.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("rule", ["ar", "greedy", "fsd"])
def test_generate_cuda_graphs_park_stopped_rows(fops, monkeypatch, rule):
    """Rows stopping at different steps (many EOS ids): real captures happen only for the first
    batch size and powers of two (stopped rows wait parked, outputs discarded, lengths frozen), and
    tokens and counts equal the eager run, which drops stopped rows at once. Greedy decoding
    (fsd: the divergence test, with drafts accepted, so the draft re-reads tokens too): the eager
    and graphed batches differ in size, and sampled tokens could differ by float rounding."""
    import importlib

    import fsd_ext

    generate_module = importlib.import_module("fsd_ext.decoding.model")
    eager_sizes, captured = [], []  # batch size of every eager forward / of every capture
    from fsd_ext.decoding import cuda_graphs

    real_forward, real_init = generate_module.CachedModel._forward, cuda_graphs.CapturedForward.__init__

    def counting_forward(self, input_ids, keep):
        if not self.use_graphs:
            eager_sizes.append(input_ids.shape[0])
        return real_forward(self, input_ids, keep)

    def counting_init(self, forward, input_ids, keep, pool=None):
        captured.append(input_ids.shape[0])
        real_init(self, forward, input_ids, keep, pool)

    monkeypatch.setattr(generate_module.CachedModel, "_forward", counting_forward)
    monkeypatch.setattr(cuda_graphs.CapturedForward, "__init__", counting_init)
    target, draft = tiny_cuda_llama(0, 2), tiny_cuda_llama(1, 1)
    ids, mask = left_padded_prompts([4, 11, 1, 7, 9, 3], seed=4)
    kwargs = dict(rule=rule, temperature=0.0, threshold=0.3, num_draft_tokens=4, max_new_tokens=30,
                  seed=torch.arange(6), eos_token_id=list(range(3, 256, 9)))
    eager = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=False, **kwargs)
    allowed = {6, 4, 2, 1}
    assert set(eager_sizes) - allowed, f"no row stopped at a size a graph run parks: {set(eager_sizes)}"
    graphed = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    for name in ("new_tokens", "verifications", "accepted_drafts", "accepted_histogram",
                 "target_forwards", "draft_forwards"):
        assert getattr(graphed.stats, name) == getattr(eager.stats, name), name
    assert set(captured) <= allowed and len(set(captured)) > 1, captured


def test_generate_cuda_graphs_reused_by_the_next_call(fops, monkeypatch):
    """A second call that fits replays the first call's graphs (real ones): no capture, the same
    tokens as eager; fewer rows replay the graphs captured for the smaller sizes."""
    import fsd_ext
    from fsd_ext.decoding import cuda_graphs

    captured = []
    real_init = cuda_graphs.CapturedForward.__init__

    def counting_init(self, forward, input_ids, keep, pool=None):
        captured.append(tuple(input_ids.shape))
        real_init(self, forward, input_ids, keep, pool)

    monkeypatch.setattr(cuda_graphs.CapturedForward, "__init__", counting_init)
    target, draft = tiny_cuda_llama(0, 2), tiny_cuda_llama(1, 1)
    ids, mask = left_padded_prompts([4, 11, 1, 7], seed=5)
    kwargs = dict(rule="fsd", temperature=0.0, threshold=0.3, num_draft_tokens=4, max_new_tokens=24,
                  seed=0, eos_token_id=list(range(3, 256, 9)))
    eager = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=False, **kwargs)
    first = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert first.sequences.tolist() == eager.sequences.tolist() and captured
    captured.clear()
    second = fsd_ext.generate(target, draft, ids, mask, use_cuda_graphs=True, **kwargs)
    assert second.sequences.tolist() == eager.sequences.tolist()
    assert captured == [] and second.stats.capture_seconds == 0.0
    fewer = fsd_ext.generate(target, draft, ids[2:], mask[2:], use_cuda_graphs=True, **kwargs)
    eager_fewer = fsd_ext.generate(target, draft, ids[2:], mask[2:], use_cuda_graphs=False, **kwargs)
    assert fewer.sequences.tolist() == eager_fewer.sequences.tolist()
    cuda_graphs.release_cuda_graphs()
