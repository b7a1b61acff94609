"""The resumable result store (results.jsonl) and the run log (runs.jsonl) of a sweep's folder."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List

def setup_id(setup: Dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:12]


class ResultStore:
    """Append-only JSONL; one record per (setup, configuration key, task). A line cut short by an
    interruption is ignored (and rewritten on resume). Later records win on duplicate keys."""

    def __init__(self, path: str):
        self.path = path
        self.records: Dict[tuple, Dict[str, Any]] = {}
        self.skipped_lines = 0
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    try:
                        record = json.loads(line)
                        self.records[(record["setup_id"], record["key"], record["task_id"])] = record
                    except (json.JSONDecodeError, KeyError, TypeError):
                        self.skipped_lines += 1

    def has(self, setup: str, key: str, task_id: str) -> bool:
        return (setup, key, task_id) in self.records

    def append(self, record: Dict[str, Any]):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        line = json.dumps(record, sort_keys=True)
        with open(self.path, "a+", encoding="utf-8") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:  # start on a fresh line if the last write was cut short
                handle.seek(handle.tell() - 1)
                if handle.read(1) != "\n":
                    handle.write("\n")
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records[(record["setup_id"], record["key"], record["task_id"])] = record

    def for_setup(self, setup: str) -> List[Dict[str, Any]]:
        return [r for (s, _, _), r in self.records.items() if s == setup]


def _run_log(out_dir: str) -> str:
    return os.path.join(out_dir, "runs.jsonl")


def read_runs(out_dir: str) -> List[Dict[str, Any]]:
    """Every invocation that decoded into `out_dir`: command, setup, machine, versions, start/end."""
    runs = []
    if os.path.exists(_run_log(out_dir)):
        with open(_run_log(out_dir), encoding="utf-8") as handle:
            for line in handle:
                try:
                    runs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return runs


def _log_run(out_dir: str, entry: Dict[str, Any]):
    os.makedirs(out_dir, exist_ok=True)
    with open(_run_log(out_dir), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, sort_keys=True, default=str) + "\n")


def latest_setup(store: ResultStore, target: str, draft: str, max_new_tokens: int):
    """The setup of the newest record for this model pair and token budget (for --summarize-only)."""
    matching = [r for r in store.records.values()
                if r["setup"].get("target") == target and r["setup"].get("draft") == draft
                and r["setup"].get("max_new_tokens") == max_new_tokens]
    return max(matching, key=lambda r: r["time"])["setup"] if matching else None
