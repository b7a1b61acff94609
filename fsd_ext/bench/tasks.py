"""The frontier's tasks: where a sweep's problems come from, how they are prompted and how a
completion is scored. HumanEval (code, run against its tests) and GSM8K (math word problems, the
final number compared) share the rest of the harness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from . import gsm8k, humaneval


@dataclass(frozen=True)
class Task:
    name: str
    id_prefix: str  # task ids are id_prefix + problem number
    num_problems: int
    prompt_version: int  # in the resume key of a sweep (setup)
    load_problems: Callable[[], List[Dict[str, str]]]
    format_prompt: Callable  # (problem, tokenizer, use_chat) -> text
    # (problem, generated text, chat, sandbox limits) -> (passed, result, completion as scored)
    score: Callable[[Dict[str, str], str, bool, humaneval.SandboxLimits], Tuple[bool, str, str]]


def _score_humaneval(problem, text, chat, limits):
    completion = humaneval.extract_completion(text, chat)
    result = humaneval.check_completion(problem, completion, limits)
    return result.passed, result.result, completion


def _score_gsm8k(problem, text, chat, limits):
    answer = gsm8k.extract_answer(text, chat)
    passed = gsm8k.is_correct(problem, answer)
    return passed, "passed" if passed else ("no answer" if not answer else "wrong answer"), answer


TASKS = {
    "humaneval": Task("humaneval", "HumanEval/", humaneval.NUM_PROBLEMS, humaneval.PROMPT_VERSION,
                      humaneval.load_problems, humaneval.format_prompt, _score_humaneval),
    "gsm8k": Task("gsm8k", "GSM8K/", gsm8k.NUM_PROBLEMS, gsm8k.PROMPT_VERSION, gsm8k.load_problems,
                  gsm8k.format_prompt, _score_gsm8k),
}
