"""The CUDA launch paths of fsd_ext's kernels and the launch options that choose them (the one
experiment switch FSD_EXT_CUDA_LAUNCH, docs/cuda.md).

Needs a GPU and the extension built with CUDA; without a GPU every test is skipped.
Run: pytest -m cuda tests/test_cuda_launch.py

- the split-vocabulary path (a row's vocabulary over many blocks) against the reference, and the
  paths the option splits=n forces, for accept and sample; what the launcher logs (log=1);
- the checks the opt-in paths rerun: sd's emitted distribution, CUDA graph capture and replay;
- the opt-in paths (sm_90+): the cluster path (cluster=1), programmatic dependent launch (pdl=1),
  and the split path's reversed second pass (reverse=1).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from fsd_ext import reference
from helpers import (DIVERGENCES, DTYPES, RULES, agreement, agreement_up_to_ties, chi_square_pvalue,
                     float_weight_draws, make_case, run_accept)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



# ----------------------------------------------------------------------------------------------
# The split-vocabulary path (a row's vocabulary over many blocks): its parity with the reference,
# the paths the launch option splits=n forces, and what the launcher logs (log=1).


@pytest.mark.parametrize("vocab", [151936, 152064, 262144])
def test_accept_big_vocab_split_path(fops, vocab):
    # B=1: the vocabulary is split over many blocks per position.
    target, draft, tokens, _ = make_case(2, 5, vocab, dtype=torch.bfloat16, seed=6)
    for rule in RULES:
        kw = dict(rule=rule, divergence="js", threshold=0.4, temperature=1.0, seed=9, return_divergence=True)
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        ref = reference.accept(target, draft, tokens, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0, rule
        torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("rule", ["sd", "fsd_strict"])
def test_accept_bonus_draws_at_a_large_vocabulary_follow_the_float_weights(fops, capfd, rule):
    """K = 0 rows (only the bonus token, from p) of 151936 N(0, 1) logits on the split path:
    every id has weight, so a draw moves when the kernel's sums
    are off by 1/V of a weight anywhere. The chunk totals and the scan add the float weights in
    double, so the draws are those of the exact sum of the float32 weights
    (helpers.float_weight_draws; the kernel and torch.exp both use CUDA's expf), up to 2 rows for
    rounding. Chunk totals from the statistics pass's online sums moved ~0.5% (~10 rows). (The CPU
    kernel makes these draws too: test_accept.py.)"""
    rows, vocab, seed = 2000, 151936, 12
    target = torch.randn(rows, 1, vocab, generator=torch.Generator().manual_seed(41))
    draft, tokens = torch.zeros(rows, 0, vocab), torch.zeros(rows, 0, dtype=torch.int64)
    kw = dict(rule=rule, divergence="js", threshold=0.1, temperature=1.0, seed=seed, offset=2)
    assert accept_path(fops, capfd, target.cuda(), draft.cuda(), tokens.cuda(), **kw) == "split"
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    want = float_weight_draws(target[:, 0].cuda(), seed, offset=2)
    assert int((cuda.tokens[:, 0] != want).sum()) <= 2
    assert int((cuda.tokens[:, 0] != float_weight_draws(target[:, 0].cuda(), seed + 1, offset=2)).sum()) > rows * 0.99


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_vocab_path_matches_reference(fops, rule, dtype):
    # Few rows and a big vocabulary: each position's vocabulary is split over many blocks (two
    # launches), with ragged K, V_d < V_t, odd sizes and a NaN row.
    target, draft, tokens, nd = make_case(6, 3, 50001, 49999, dtype=dtype, seed=15, num_draft=True)
    target[5, 0, 123] = float("nan")
    nd[5] = 2
    kw = dict(rule=rule, divergence="rkl", threshold=0.2, temperature=0.9, seed=21, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0
    assert not bool(cuda.valid[5])
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    if rule in ("sd", "fsd"):  # without divergences: coin-accepted positions skip pass 2
        kw.pop("return_divergence")
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0


@pytest.mark.parametrize("splits,path", [(1, "fused"), (3, "split"), (64, "split")])
def test_requested_splits_agree_with_reference(fops, monkeypatch, capfd, splits, path):
    # The launch option splits (benchmarks) overrides the planner: a fused launch for few rows, or
    # many chunks for many rows (64 requested: as many 4096-id chunks as the vocabulary holds, 13).
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"splits={splits}")
    target, draft, tokens, nd = make_case(24, 4, 50001, 49999, dtype=torch.bfloat16, seed=17, num_draft=True)
    assert accept_path(fops, capfd, target.cuda(), draft.cuda(), tokens.cuda(), rule="fsd", seed=1) == path
    for rule in RULES:
        kw = dict(rule=rule, divergence="js", threshold=0.3, seed=4, num_draft=nd, return_divergence=True)
        cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
        ref = reference.accept(target, draft, tokens, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0, rule
        torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)


def raw_accept_divergence(target, draft, tokens, nd, rule, threshold, temperature, seed, return_divergence):
    """The op's divergence output as the kernel left it (fsd_ext.accept hides it unless
    return_divergence), with js and every filter off."""
    out = torch.ops.fsd_ext.accept.default(
        target, draft, tokens, nd, None, threshold, None, temperature, None, 1.0, False, None, seed, False,
        None, 0, RULES.index(rule), DIVERGENCES.index("js"), 0, 1.0, 0.0, 0, return_divergence)
    return out[3].cpu()


@pytest.mark.parametrize("splits,path", [(1, "fused"), (4, "split")])
def test_fsd_coin_accepted_positions_skip_pass_two(fops, monkeypatch, capfd, splits, path):
    # fsd without return_divergence: a position whose coin accepts (u q(d) <= p(d)) is accepted
    # whatever D is, so the kernel skips its pass 2 and leaves D NaN; every other used position's D
    # is computed. The tokens equal the reference's, and asking for the divergences computes all.
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"splits={splits}")
    batch, k, vocab, tau, seed = 48, 4, 20001, 0.9, 13
    target, draft, tokens, nd = make_case(batch, k, vocab, 19999, dtype=torch.bfloat16, seed=23, num_draft=True)
    args = (target.cuda(), draft.cuda(), tokens.cuda(), nd.cuda())
    assert accept_path(fops, capfd, *args[:3], rule="fsd", seed=1) == path
    skipped = raw_accept_divergence(*args, "fsd", 0.2, tau, seed, False)
    full = raw_accept_divergence(*args, "fsd", 0.2, tau, seed, True)
    ref = reference.accept(target, draft, tokens, rule="fsd", divergence="js", threshold=0.2, temperature=tau,
                           seed=seed, num_draft=nd, return_divergence=True)
    torch.testing.assert_close(full, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    # The coins the kernel flips (float64, as in the kernel's decision).
    logp = (target[:, :k].double() / tau).log_softmax(-1)
    logq = torch.nn.functional.pad(draft.double() / tau, (0, vocab - 19999), value=-math.inf).log_softmax(-1)
    d = tokens[..., None]
    coins = reference.philox_uniforms(seed, 0, batch, k, 1)
    coin_accepts = coins * logq.gather(-1, d)[..., 0].exp() <= logp.gather(-1, d)[..., 0].exp()
    used = torch.arange(k)[None, :] < nd[:, None]
    assert bool((skipped.isnan() == (coin_accepts | ~used)).all())
    assert 0 < int((coin_accepts & used).sum()) < int(used.sum())  # both kinds of position occur
    kept = used & ~coin_accepts
    torch.testing.assert_close(skipped[kept], full[kept])
    kw = dict(rule="fsd", threshold=0.2, temperature=tau, seed=seed, num_draft=nd)
    for return_divergence in (False, True):
        cuda = run_accept(fops, "cuda", target, draft, tokens, return_divergence=return_divergence, **kw)
        assert agreement_up_to_ties(cuda, target, draft, tokens, **kw) == 1.0



def live_id_rows(rows, vocab, live=24, seed=0):
    """[rows, vocab] float32 logits with each row's mass on `live` random ids (N(0, 1.5^2)), the rest
    40 below: no id lies within rounding of a sampling boundary, so every kernel draws the same."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) - 40.0
    ids = torch.randint(0, vocab, (rows, live), generator=g)
    return logits.scatter(1, ids, 1.5 * torch.randn(rows, live, generator=g))


def logged_call(capfd, op: str, call):
    """(call()'s result, the one line the CUDA launcher of fsd_ext.<op> logs for it with the launch
    option log=1 added to FSD_EXT_CUDA_LAUNCH: the path it took, its chunks)."""
    options = os.environ.get("FSD_EXT_CUDA_LAUNCH")
    os.environ["FSD_EXT_CUDA_LAUNCH"] = f"{options},log=1" if options else "log=1"
    try:
        capfd.readouterr()
        result = call()
        torch.cuda.synchronize()
        err = capfd.readouterr().err
    finally:
        if options is None:
            del os.environ["FSD_EXT_CUDA_LAUNCH"]
        else:
            os.environ["FSD_EXT_CUDA_LAUNCH"] = options
    lines = [line for line in err.splitlines() if f"fsd_ext.{op} cuda:" in line]
    assert len(lines) == 1, err
    return result, lines[0]


def sample_path(fops, capfd, logits, **kwargs):
    """(tokens, the path the CUDA launcher took) of one sample call."""
    tokens, line = logged_call(capfd, "sample", lambda: fops.sample(logits, **kwargs))
    return tokens.cpu(), line.split("path=")[1].split()[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_split_path_matches_cpu(fops, capfd, monkeypatch, dtype):
    """Few rows without a filter (or with min-p alone) take the split path (a row's chunks on many
    SMs, then the draw); on well-separated rows it gives the CPU kernel's tokens on every row, as
    the one-block path (forced with FSD_EXT_CUDA_LAUNCH=splits=1) does. Temperature 0 rows give the argmax."""
    logits = live_id_rows(2 * 3, 151936, seed=21).reshape(2, 3, 151936).to(dtype)
    temperature = torch.tensor([0.8, 0.0])
    want = fops.sample(logits, temperature=temperature, seed=5, offset=1)
    got, path = sample_path(fops, capfd, logits.cuda(), temperature=temperature.cuda(), seed=5, offset=1)
    assert path == "split" and torch.equal(got, want)
    assert torch.equal(got[1], logits[1].float().argmax(-1))
    assert not torch.equal(fops.sample(logits.cuda(), temperature=temperature.cuda(), seed=6, offset=1).cpu()[0],
                           want[0])  # another seed draws other tokens: the comparison can fail
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", "splits=1")
    got, path = sample_path(fops, capfd, logits.cuda(), temperature=temperature.cuda(), seed=5, offset=1)
    assert path == "rows" and torch.equal(got, want)
    monkeypatch.delenv("FSD_EXT_CUDA_LAUNCH")
    _, path = sample_path(fops, capfd, logits.cuda(), temperature=0.8, top_p=0.9, seed=5)
    assert path == "rows"  # a top-p (or top-k) cutoff needs the whole row in one block
    # min-p needs only the row's maximum: the split path, and the CPU kernel's tokens (which the
    # filter changes here, so a kernel ignoring it would fail)
    want_min_p = fops.sample(logits, temperature=temperature, min_p=0.3, seed=5, offset=1)
    assert not torch.equal(want_min_p, want)
    got, path = sample_path(fops, capfd, logits.cuda(), temperature=temperature.cuda(), min_p=0.3, seed=5, offset=1)
    assert path == "split" and torch.equal(got, want_min_p)


def test_sample_split_path_distribution(fops, monkeypatch):
    """The split path's tokens follow softmax(logits / T) (chi-square over 2e5 rows whose 24 live
    ids lie in all four chunks), and the same test rejects a distribution with two ids swapped."""
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", "splits=4")
    rows, vocab, live = 200_000, 16384, 24
    ids = torch.arange(live) * (vocab // live) + 7  # spread over the four 4096-id chunks
    values = torch.randn(live, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    row = torch.full((vocab,), -60.0, dtype=torch.float64).index_put_((ids,), values)
    tokens = fops.sample(row.float().cuda().expand(rows, vocab), temperature=0.9, seed=31).cpu()
    assert bool(torch.isin(tokens, ids).all())
    counts = torch.bincount(tokens, minlength=vocab)[ids].double()
    p = (values / 0.9).softmax(-1)
    assert chi_square_pvalue(counts, p) > 1e-4
    swapped = p.clone()
    most, least = int(p.argmax()), int(p.argmin())
    swapped[[most, least]] = p[[least, most]]
    assert chi_square_pvalue(counts, swapped) < 1e-6




# ----------------------------------------------------------------------------------------------
# Checks on the default path that the opt-in paths below rerun under their switches.


@pytest.mark.parametrize("rule", ["sd", "fsd"])
def test_sd_emits_target_distribution(fops, rule):
    rows, vocab = 200_000, 24
    g = torch.Generator(device="cuda").manual_seed(0)
    target_row = torch.randn(vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5
    draft_row = target_row + torch.randn(vocab, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p, q = target_row.softmax(-1), draft_row.softmax(-1)
    target = target_row.float().cuda().expand(rows, 2, vocab).contiguous()
    draft = draft_row.float().cuda().expand(rows, 1, vocab).contiguous()
    tokens = torch.multinomial(q.float().cuda(), rows, replacement=True, generator=g)[:, None]  # [rows, 1]
    # fsd with threshold 0 is exactly sd.
    res = fops.accept(target, draft, tokens, rule=rule, threshold=0.0, seed=123)
    counts = torch.bincount(res.tokens[:, 0], minlength=vocab).double().cpu()
    assert chi_square_pvalue(counts, p) > 1e-4
    assert chi_square_pvalue(counts, q) < 1e-6  # negative control: the draft's distribution fails
    # Acceptance rate of sd is sum(min(p, q)).
    rate = (res.num_accepted == 1).double().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 5 * math.sqrt(0.25 / rows)



def test_graph_capture_and_replay_fresh_randomness(fops):
    check_graph_replay(fops, batch=32, vocab=4096)


def check_graph_replay(fops, batch, vocab):
    """accept captured once in a CUDA graph: replays with a device offset bumped in between draw
    fresh tokens and match eager calls."""
    target, draft, tokens, _ = make_case(batch, 4, vocab, dtype=torch.bfloat16, seed=13, noise=2.0)
    target, draft, tokens = target.cuda(), draft.cuda(), tokens.cuda()
    seed = torch.tensor(77, dtype=torch.int64, device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    kw = dict(rule="fsd", threshold=0.1, temperature=1.0, return_divergence=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        fops.accept(target, draft, tokens, seed=seed, offset=offset, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fops.accept(target, draft, tokens, seed=seed, offset=offset, **kw)
    seen = []
    for step in range(4):
        offset.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        eager = fops.accept(target, draft, tokens, seed=77, offset=step, **kw)
        assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.num_accepted, eager.num_accepted)
        seen.append(static.tokens.clone())
    assert any(not torch.equal(seen[0], other) for other in seen[1:]), "replays drew the same numbers"




# ----------------------------------------------------------------------------------------------
# The launch options (FSD_EXT_CUDA_LAUNCH, docs/cuda.md): the launcher's log, the opt-in paths.
# (The staged cluster path is gone: slower than the split path on the H200.)

@pytest.mark.parametrize("text,message", [
    ("splits=x", "splits wants a non-negative integer"), ("pdl=2", "pdl wants 0 or 1"),
    ("staged=1", "unknown option 'staged'"), ("cluster", "cluster wants 0 or 1"),
])
def test_launch_switch_rejects_bad_values(fops, monkeypatch, text, message):
    target, draft, tokens, _ = make_case(2, 3, 1000, seed=2)
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", text)
    with pytest.raises(RuntimeError, match=f"FSD_EXT_CUDA_LAUNCH='{text}': {message}"):
        fops.accept(target.cuda(), draft.cuda(), tokens.cuda(), seed=1)
    with pytest.raises(RuntimeError, match="FSD_EXT_CUDA_LAUNCH"):
        fops.sample(target[:, 0].cuda(), seed=1)


def launch_log(fops, capfd, *args, **kwargs):
    """The CUDA launcher's log line (launch option log=1) of one accept call."""
    return logged_call(capfd, "accept", lambda: fops.accept(*args, **kwargs))[1]


def accept_path(fops, capfd, *args, **kwargs):
    """The path the CUDA launcher took for one accept call."""
    return launch_log(fops, capfd, *args, **kwargs).split("path=")[1].split()[0]


def check_opt_in_path(fops, monkeypatch, capfd, switch, opt_in_path, dtype, vocab, batch, path):
    """With the launch option `switch` on, a call of this shape takes `path`; never `opt_in_path`
    with a filter (it needs whole-row selections) or with the option off."""
    target, draft, tokens, _ = make_case(batch, 5, vocab, dtype=dtype, seed=30)
    target, draft, tokens = target.cuda(), draft.cuda(), tokens.cuda()
    assert accept_path(fops, capfd, target, draft, tokens, rule="fsd", seed=1) == path
    assert accept_path(fops, capfd, target, draft, tokens, rule="fsd", seed=1, top_p=0.9) != opt_in_path
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"{switch}=0")
    assert accept_path(fops, capfd, target, draft, tokens, rule="fsd", seed=1) != opt_in_path


# Cases of the cluster path: clusters of 8 (as at B=64), of up to 16 (B=1), ragged K with V_d < V_t
# and a NaN row, a small vocabulary (clusters of 2).
CLUSTER_CASES = {
    "b16_v128256_bf16": (16, 128256, 128256, torch.bfloat16),
    "b1_v151936_bf16": (1, 151936, 151936, torch.bfloat16),
    "ragged_v32001_f32": (12, 32001, 32000, torch.float32),
    "small_v4099_f16": (40, 4099, 3001, torch.float16),
}


def check_cluster_case(fops, rule, case):
    """accept on one of CLUSTER_CASES against the reference (tokens, divergences, NaN row)."""
    batch, vocab, draft_vocab, dtype = CLUSTER_CASES[case]
    target, draft, tokens, nd = make_case(batch, 5, vocab, draft_vocab, dtype=dtype, seed=31, num_draft=batch > 1)
    if batch > 4:
        target[3, 1, 77] = float("nan")  # a NaN row
        nd[3] = 5
    kw = dict(rule=rule, divergence="js", threshold=0.3, temperature=0.9, seed=17, num_draft=nd,
              return_divergence=True)
    cuda = run_accept(fops, "cuda", target, draft, tokens, **kw)
    ref = reference.accept(target, draft, tokens, **kw)
    assert agreement(cuda, ref) >= (0.97 if batch >= 40 else 1.0)
    torch.testing.assert_close(cuda.divergence, ref.divergence, rtol=1e-5, atol=1e-6, equal_nan=True)
    if batch > 4:
        assert not bool(cuda.valid[3])
    assert int(cuda.tokens.max()) < vocab
    if rule in ("sd", "fsd"):  # without divergences: coin-accepted positions skip pass 2
        kw.pop("return_divergence")
        cuda, ref = run_accept(fops, "cuda", target, draft, tokens, **kw), reference.accept(target, draft, tokens, **kw)
        assert agreement(cuda, ref) >= (0.97 if batch >= 40 else 1.0)


# ----------------------------------------------------------------------------------------------
# The cluster path (FSD_EXT_CUDA_LAUNCH=cluster=1, sm_90+): the split path's chunks in one launch
# of thread-block clusters, a cluster barrier between the phases instead of a second launch, pass 2
# re-reading its chunk from L2.

def sm90_switch(monkeypatch, switch, what):
    """Turns the opt-in launch option `switch` on (FSD_EXT_CUDA_LAUNCH) on sm_90+; skips `what`
    elsewhere."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(f"{what} needs sm_90+")
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", f"{switch}=1")
    return monkeypatch


@pytest.fixture
def clustered(monkeypatch):
    return sm90_switch(monkeypatch, "cluster", "the cluster path (thread-block clusters)")


@pytest.mark.parametrize("dtype,vocab,batch,path", [
    (torch.bfloat16, 151936, 1, "cluster"), (torch.bfloat16, 128256, 64, "cluster"),
    (torch.float32, 32001, 8, "cluster"), (torch.float16, 1000, 3, "fused"),  # one chunk: nothing to cluster
])
def test_cluster_path_is_taken(fops, clustered, capfd, dtype, vocab, batch, path):
    check_opt_in_path(fops, clustered, capfd, "cluster", "cluster", dtype, vocab, batch, path)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", list(CLUSTER_CASES))
def test_cluster_path_agrees_with_reference(fops, clustered, rule, case):
    check_cluster_case(fops, rule, case)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cluster_split_vocab_case_matches_reference(fops, clustered, rule, dtype):
    test_split_vocab_path_matches_reference(fops, rule, dtype)


def test_cluster_graph_capture_and_replay(fops, clustered):
    check_graph_replay(fops, batch=3, vocab=50001)


# ----------------------------------------------------------------------------------------------
# Programmatic dependent launch (FSD_EXT_CUDA_LAUNCH=pdl=1, sm_90+): the split path's second kernel is
# launched while the first still runs and waits for it on the GPU. It changes when blocks start,
# never what they compute: the same tokens as the reference, in and out of a CUDA graph.

def split_and_fused_launch_logs(fops, capfd):
    """The launcher's log lines of a call that takes the split path (B=2, K=5, V=151936) and of one
    with a single chunk per position (one fused launch), for the split path's options."""
    def log(case):
        target, draft, tokens, _ = case
        return launch_log(fops, capfd, target.cuda(), draft.cuda(), tokens.cuda(), seed=1)
    return log(make_case(2, 5, 151936, dtype=torch.bfloat16, seed=6)), log(make_case(4, 3, 1000, seed=2))


@pytest.fixture
def pdl(monkeypatch):
    return sm90_switch(monkeypatch, "pdl", "programmatic dependent launch")


def test_pdl_only_on_the_split_path(fops, pdl, capfd):
    split, fused = split_and_fused_launch_logs(fops, capfd)
    assert "path=split" in split and "pdl=1" in split and "pdl=0" in fused
    pdl.setenv("FSD_EXT_CUDA_LAUNCH", "pdl=0")
    assert "pdl=0" in split_and_fused_launch_logs(fops, capfd)[0]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pdl_split_path_matches_reference(fops, pdl, rule, dtype):
    test_split_vocab_path_matches_reference(fops, rule, dtype)


def test_pdl_big_vocab_and_many_chunks(fops, pdl):
    test_accept_big_vocab_split_path(fops, 151936)
    pdl.setenv("FSD_EXT_CUDA_LAUNCH", "pdl=1,splits=64")  # many blocks per row: kernel 2 launches during kernel 1
    test_accept_big_vocab_split_path(fops, 262144)


def test_pdl_graph_capture_and_replay(fops, pdl):
    check_graph_replay(fops, batch=3, vocab=50001)  # the split path


# ----------------------------------------------------------------------------------------------
# FSD_EXT_CUDA_LAUNCH=reverse=1: the split path's second kernel takes its (row, position, chunk)
# items in reverse order (for L2 hits on its re-reads). It changes which block does which item,
# never what an item computes: the same tokens as the reference, in and out of a CUDA graph.

@pytest.fixture
def reverse_decide(monkeypatch):
    monkeypatch.setenv("FSD_EXT_CUDA_LAUNCH", "reverse=1")
    return monkeypatch


def test_reverse_decide_only_on_the_split_path(fops, reverse_decide, capfd):
    split, fused = split_and_fused_launch_logs(fops, capfd)
    assert "path=split" in split and "reverse=1" in split and "reverse=0" in fused


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_decide_matches_reference(fops, reverse_decide, rule, dtype):
    test_split_vocab_path_matches_reference(fops, rule, dtype)


def test_reverse_decide_big_vocab_and_graph_replay(fops, reverse_decide):
    test_accept_big_vocab_split_path(fops, 151936)
    check_graph_replay(fops, batch=3, vocab=50001)
