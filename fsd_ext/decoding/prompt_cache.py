"""Reusing the prompt forwards of one generate() call in the next call on the same prompt.

A benchmark that decodes one prompt under many configurations (rules, thresholds, seeds) runs the
same prompt forwards every time: the same model over the same ids writes the same keys and values,
whatever the configuration. A PromptCache passed to generate(prompt_cache=...) keeps, per model
role, a copy of the last prompt's cache entries; a later call with the same model object, prompt
ids and padding loads them instead of running the forward, so its tokens are unchanged.

It trusts the model object not to change between calls (weights, dtype, device): a model changed in
place needs a fresh PromptCache (or clear()).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch


class PromptCache:
    """The last prompt's keys and values of each model role ("target", "draft")."""

    def __init__(self):
        self._entries: Dict[str, Tuple[object, torch.Tensor, torch.Tensor, list, list]] = {}
        self.hits = self.misses = 0

    def clear(self) -> None:
        self._entries.clear()

    def restore(self, role: str, cached, ids: torch.Tensor) -> bool:
        """Load the entry for `ids` ([B, S], the prompt forward's input) into `cached`'s cache (a
        decoding.model.CachedModel, counted as one forward) -> whether there was one."""
        entry = self._entries.get(role)
        if entry is None or not self._matches(entry, cached, ids):
            self.misses += 1
            return False
        cached.load_prefix(entry[3], entry[4])
        self.hits += 1
        return True

    def store(self, role: str, cached, ids: torch.Tensor) -> None:
        """Keep `cached`'s entries over the prompt `ids` (the role's previous entry goes)."""
        keys, values = cached.cache.prefix(ids.shape[1])
        self._entries[role] = (cached.model, ids.clone(), cached.cache.pad.clone(), keys, values)

    @staticmethod
    def _matches(entry, cached, ids: torch.Tensor) -> bool:
        model, old_ids, old_pad, _, _ = entry
        pad = cached.cache.pad
        return (model is cached.model and old_ids.shape == ids.shape and old_ids.device == ids.device
                and torch.equal(old_ids, ids) and torch.equal(old_pad, pad))
