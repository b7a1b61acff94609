"""The resumable result store (results.jsonl) and the run log (runs.jsonl) of a sweep's folder.

Both files are read line by line as bytes: a line that is not UTF-8, not a JSON object or lacks a
field the harness reads is skipped, counted, and reported in one warning per file (stderr)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Tuple

_NUMBER = (int, float)
# What resume, --summarize-only and the summary read from each record, and its type.
RECORD_FIELDS = {"setup_id": str, "key": str, "task_id": str, "group": str, "time": str,
                 "setup": dict, "config": dict, "passed": bool, "new_tokens": _NUMBER,
                 "seconds": _NUMBER, "wall_s": _NUMBER, "target_calls": _NUMBER,
                 "draft_calls": _NUMBER, "accepted_drafts": _NUMBER, "verify_steps": _NUMBER}
RUN_FIELDS = {"setup_id": str, "start": str}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def setup_id(setup: Dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:12]


def _ranges(numbers: List[int], limit: int = 10) -> str:
    """'line 3' or 'lines 2, 7-9' (the first `limit` runs, then how many lines more)."""
    runs: List[List[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return ("line " if len(numbers) == 1 else "lines ") + text + (f" and {rest} more" if rest else "")


def read_jsonl(path: str, fields: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], int]:
    """The JSON objects of `path` that hold `fields` (name: type), and how many lines were skipped.
    One warning names the file and the skipped lines by reason; a missing file is empty."""
    records: List[Dict[str, Any]] = []
    bad: Dict[str, List[int]] = {}
    if not os.path.exists(path):
        return records, 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                reason = "not UTF-8"
            except json.JSONDecodeError:
                reason = "not JSON"
            else:
                if not isinstance(record, dict):
                    reason = "not a JSON object"
                else:
                    wrong = [name for name, kind in fields.items()
                             if not isinstance(record.get(name), kind)]
                    if not wrong:
                        records.append(record)
                        continue
                    reason = "missing or mistyped " + ", ".join(wrong)
            bad.setdefault(reason, []).append(number)
    skipped = sum(len(v) for v in bad.values())
    if skipped:
        print(f"warning: {path}: skipped {skipped} bad line{'s' if skipped > 1 else ''}: "
              + "; ".join(f"{reason} ({_ranges(numbers)})" for reason, numbers in bad.items()),
              file=sys.stderr, flush=True)
    return records, skipped


class ResultStore:
    """Append-only JSONL; one record per (setup, configuration key, task). Bad lines (read_jsonl),
    such as one cut short by an interruption, are skipped; resume decodes them again. Later
    records win on duplicate keys."""

    def __init__(self, path: str):
        self.path = path
        records, self.skipped_lines = read_jsonl(path, RECORD_FIELDS)
        self.records: Dict[tuple, Dict[str, Any]] = {
            (r["setup_id"], r["key"], r["task_id"]): r for r in records}

    def has(self, setup: str, key: str, task_id: str) -> bool:
        return (setup, key, task_id) in self.records

    def append(self, record: Dict[str, Any]):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        line = json.dumps(record, sort_keys=True).encode("utf-8")
        # Bytes: the last write may have been cut short inside a UTF-8 character.
        with open(self.path, "ab+") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:  # start on a fresh line if the last write was cut short
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    handle.write(b"\n")
            handle.write(line + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records[(record["setup_id"], record["key"], record["task_id"])] = record

    def for_setup(self, setup: str) -> List[Dict[str, Any]]:
        return [r for (s, _, _), r in self.records.items() if s == setup]


def _run_log(out_dir: str) -> str:
    return os.path.join(out_dir, "runs.jsonl")


def read_runs(out_dir: str) -> List[Dict[str, Any]]:
    """Every invocation that decoded into `out_dir`, in the order they started: command, setup,
    machine, versions, start, status, end, records written. A run logs a line when it starts and
    again when it ends (logged_run); each run's last line holds it."""
    runs: Dict[Any, Dict[str, Any]] = {}
    for number, entry in enumerate(read_jsonl(_run_log(out_dir), RUN_FIELDS)[0]):
        runs[entry.get("run_id", number)] = entry  # lines before run ids: one run each
    return list(runs.values())


def _log_run(out_dir: str, entry: Dict[str, Any]):
    os.makedirs(out_dir, exist_ok=True)
    with open(_run_log(out_dir), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, sort_keys=True, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def logged_run(out_dir: str, run: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """Log an invocation in runs.jsonl before it decodes, with status "running", and again when it
    ends: "finished", or "interrupted" (an exception or Ctrl-C, named in "error") with the
    records written so far. The start line is the one a SIGKILL or SIGTERM cannot prevent: such a
    run stays "running", without an end. Yields the run; the caller counts run["records_written"]."""
    run = dict(run, run_id=uuid.uuid4().hex[:12], pid=os.getpid(), status="running")
    _log_run(out_dir, run)
    run["records_written"] = 0  # not in the start line: a killed run's count is unknown
    try:
        yield run
        run["status"] = "finished"
    except BaseException as error:
        run.update(status="interrupted", error=repr(error))
        raise
    finally:
        run.update(end=_now(), load_average_end=[round(x, 2) for x in os.getloadavg()])
        _log_run(out_dir, run)


class FolderLocked(RuntimeError):
    """Another process holds the sweep's output folder (lock_folder)."""


@contextlib.contextmanager
def lock_folder(out_dir: str) -> Iterator[None]:
    """Hold `out_dir` for one sweep: an exclusive flock on out_dir/.lock, which names the holder's
    pid. Two sweeps into one folder would each decode every missing record; the second raises
    FolderLocked at once. The lock ends with the process, however it ends."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, ".lock")
    with open(path, "a+", encoding="utf-8", errors="replace") as handle:  # "a+": keeps the pid
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            pid = handle.read().strip() or "unknown"
            raise FolderLocked(f"{out_dir} is in use by another sweep (pid {pid}, lock {path}): "
                               f"wait for it to end or choose another --out") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def latest_setup(store: ResultStore, target: str, draft: str, max_new_tokens: int):
    """The setup of the newest record for this model pair and token budget (for --summarize-only)."""
    matching = [r for r in store.records.values()
                if r["setup"].get("target") == target and r["setup"].get("draft") == draft
                and r["setup"].get("max_new_tokens") == max_new_tokens]
    return max(matching, key=lambda r: r["time"])["setup"] if matching else None
