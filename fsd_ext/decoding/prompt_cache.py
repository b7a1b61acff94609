"""Reusing the prompt forwards of one generate() call in later calls on the same prompt.

A benchmark or a calibration that decodes one prompt under many settings (rules, thresholds, seeds)
runs the same prompt forwards every time: the same model over the same ids writes the same keys and
values, whatever the setting. A PromptCache passed to generate(prompt_cache=...) keeps, per model
role, copies of the cache entries of the last `max_prompts` prompts; a later call with the same
model object, prompt ids and padding loads them instead of running the forward, so its tokens are
unchanged. Memory: each kept prompt holds its keys and values, for both models.

It trusts the model object not to change between calls (weights, dtype, device): a model changed in
place needs a fresh PromptCache (or clear()).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple

import torch


class _Entry(NamedTuple):
    model: object
    ids: torch.Tensor  # [B, S] the prompt forward's input
    pad: torch.Tensor  # [B] leading padding slots
    keys: List[torch.Tensor]  # per layer [B, H_kv, S, D]
    values: List[torch.Tensor]


class PromptCache:
    """The cache entries of the last `max_prompts` prompts of each model role ("target", "draft")."""

    def __init__(self, max_prompts: int = 1):
        if isinstance(max_prompts, bool) or not isinstance(max_prompts, int) or max_prompts < 1:
            raise ValueError(f"max_prompts must be an int >= 1, got {max_prompts!r}")
        self.max_prompts = max_prompts
        self._entries: Dict[str, List[_Entry]] = {}  # role -> entries, the most recent last
        self.hits = self.misses = 0

    def clear(self) -> None:
        self._entries.clear()

    def restore(self, role: str, cached, ids: torch.Tensor) -> bool:
        """Load the entry for `ids` ([B, S], the prompt forward's input) into `cached` (a
        decoding.model.CachedModel, which counts it as one forward) -> whether there was one."""
        entries = self._entries.get(role, [])
        for i, entry in enumerate(entries):
            if self._matches(entry, cached, ids):
                cached.load_prefix(entry.keys, entry.values)
                entries.append(entries.pop(i))
                self.hits += 1
                return True
        self.misses += 1
        return False

    def store(self, role: str, cached, ids: torch.Tensor) -> None:
        """Keep `cached`'s entries over the prompt `ids` (the role's oldest goes past max_prompts)."""
        keys, values = cached.cache.prefix(ids.shape[1])
        entries = self._entries.setdefault(role, [])
        entries.append(_Entry(cached.model, ids.clone(), cached.cache.pad.clone(), keys, values))
        del entries[:-self.max_prompts]

    @staticmethod
    def _matches(entry: _Entry, cached, ids: torch.Tensor) -> bool:
        pad = cached.cache.pad
        return (entry.model is cached.model and entry.ids.shape == ids.shape
                and entry.ids.device == ids.device and torch.equal(entry.ids, ids)
                and torch.equal(entry.pad, pad))
