"""A static KV cache with one length per batch row, for Hugging Face causal LMs.

transformers' own `StaticCache` writes every row at the same `cache_position`, so rows cannot hold
different lengths; speculative decoding needs exactly that (each row keeps what it accepted). This
cache is the minimum that allows it:

- K/V of every layer live in preallocated buffers [B, H_kv, capacity, D] (allocated at the first
  write, so no model config has to be read);
- the capacity grows with what is written, not with what a call might write: before a forward that
  would pass it, the caller calls `grow` (to `capacity_for(...)`: doubling, so the copies cost O(1)
  per slot over a call), which moves the buffers to new, larger ones (new addresses: CUDA graphs
  captured over the old ones must go);
- row b's committed tokens occupy slots [0, lengths[b]); slots [0, pad[b]) hold left padding and
  are never attended to;
- a forward of S new tokens writes row b's tokens to slots lengths[b] + 0..S-1 (`write_slots`),
  whatever was there before;
- rolling back = setting `lengths` smaller. The stale entries past a row's length stay in memory,
  excluded by the attention mask (`attention_inputs`) and overwritten by the next write;
- the buffers hold `max_batch` rows; the live batch is their first `batch` rows (views), and
  dropping rows moves the kept ones to the front in place, so every tensor keeps its address (a
  captured CUDA graph reads them there) and a later call may reuse the cache with fewer rows.

The model sees it through the two calls that its attention layers make: `update` (transformers 4.5x
passes `cache_kwargs` positionally, 5.x as `kwargs=`) and, only when no position_ids are given,
`get_seq_length`. Everything the loop changes between forwards (`lengths`, `pad`) is updated in
place, so a captured CUDA graph keeps reading the live values.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

CAPACITY_STEP = 256  # capacities are CAPACITY_STEP x 2^i slots, or a multiple of it (capacity_for)


def capacity_for(slots: int, most: int) -> int:
    """The capacity a cache grows to when it must hold `slots` slots per row and its call never
    needs more than `most`: the smallest CAPACITY_STEP x 2^i >= slots, but no more than `most`
    rounded up to CAPACITY_STEP (so calls of similar lengths get the same capacities)."""
    capacity = CAPACITY_STEP
    while capacity < slots:
        capacity *= 2
    return min(capacity, -(-max(slots, most) // CAPACITY_STEP) * CAPACITY_STEP)


class StaticKVCache:
    """Per-row-length static KV cache (see the module docstring).

    Args:
        pad: [B] int64, the number of leading padding slots of each row (B = max_batch).
        capacity: slots per row to start with; a row must never be written past it (grow first).
    """

    def __init__(self, pad: torch.Tensor, capacity: int):
        self.capacity = int(capacity)
        self.max_batch = len(pad)
        self.write_slots = None  # [B, S] slots the next forward writes, set by attention_inputs
        self.kv_len = self.capacity  # slots the attention reads (a prefix of the buffers)
        # The buffers ([max_batch, ...]); pad, lengths, keys and values below are views of their
        # first `batch` rows.
        self._pad = pad.to(torch.int64).clone()
        self._lengths = torch.zeros_like(self._pad)
        self._keys: List[torch.Tensor] = []  # per layer [max_batch, H_kv, capacity, D]
        self._values: List[torch.Tensor] = []
        self._use_rows(self.max_batch)

    def _use_rows(self, batch: int) -> None:
        self.batch = batch
        self.pad = self._pad[:batch]  # [B]
        self.lengths = self._lengths[:batch]  # [B] committed slots per row
        self.keys = [k[:batch] for k in self._keys]  # per layer [B, H_kv, capacity, D]
        self.values = [v[:batch] for v in self._values]

    # ------------------------------------------------------------------------------------------
    # What the loop calls.

    def attention_inputs(self, num_tokens: int, dtype: torch.dtype, kv_len: int):
        """Prepare a forward of `num_tokens` new tokens per row, appended at each row's length.

        Sets `write_slots` and `kv_len`; returns (position_ids [B, S] int64, attention_mask
        [B, 1, S, kv_len] additive float of `dtype`). Pure tensor ops on `lengths` and `pad`, so it
        may run inside CUDA graph capture.
        """
        device = self.lengths.device
        steps = torch.arange(num_tokens, device=device)  # [S]
        slots = self.lengths[:, None] + steps[None, :]  # [B, S]
        self.write_slots = slots
        self.kv_len = kv_len
        position_ids = (slots - self.pad[:, None]).clamp_min(0)  # [B, S]
        kv = torch.arange(kv_len, device=device)[None, None, :]  # [1, 1, L]
        visible = (kv >= self.pad[:, None, None]) & (kv <= slots[:, :, None])  # [B, S, L]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)  # [B, S, L]
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]  # [B, 1, S, L]
        return position_ids, mask

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` ([B'] int64), in that order, moved in place to the first
        B' rows of the buffers."""
        kept = len(rows)
        for buffer in [self._pad, self._lengths] + self._keys + self._values:
            buffer[:kept] = buffer[rows]  # (the right side is a copy: any order of rows is safe)
        self._use_rows(kept)

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` (> capacity) slots per row: each layer's K/V move to new buffers,
        zeroed past the old slots. Every buffer gets a new address (and the views in keys / values
        with it). At most the old buffers and one new one are held at once."""
        if capacity <= self.capacity:
            raise ValueError(f"the cache holds {self.capacity} slots per row, cannot grow to {capacity}")
        for buffers, views in ((self._keys, self.keys), (self._values, self.values)):
            for layer, old in enumerate(buffers):
                new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])  # [max_batch, H_kv, capacity, D]
                new[:, :, :self.capacity] = old
                buffers[layer], views[layer] = new, new[:self.batch]  # (the old buffer goes now)
        self.capacity = capacity

    def prefix(self, slots: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Copies of every layer's keys and values over the first `slots` slots of each row ->
        (keys, values), each per layer [B, H_kv, slots, D]."""
        return ([k[:, :, :slots].clone() for k in self.keys],
                [v[:, :, :slots].clone() for v in self.values])

    def load_prefix(self, keys: List[torch.Tensor], values: List[torch.Tensor]) -> None:
        """Write what prefix() returned into the first slots of each row (allocating a layer's
        buffers at the first write, as update does; existing buffers keep their addresses)."""
        for layer, (k, v) in enumerate(zip(keys, values)):
            if layer == len(self._keys):
                shape = (self.max_batch, k.shape[1], self.capacity, k.shape[3])
                self._keys.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
                self._values.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
            self._keys[layer][:self.batch, :, :k.shape[2]].copy_(k)
            self._values[layer][:self.batch, :, :v.shape[2]].copy_(v)
        self._use_rows(self.batch)

    def reset(self, pad: torch.Tensor) -> None:
        """Start over with len(pad) <= max_batch rows of `pad` leading padding slots and nothing
        committed. The old entries, past every length, are masked, and zeroed too: a mask cannot
        hide NaN (an additive -max plus NaN is NaN), which a failed call may have left."""
        if len(pad) > self.max_batch:
            raise ValueError(f"the cache holds {self.max_batch} rows, got {len(pad)}")
        self._pad[:len(pad)].copy_(pad)
        self._lengths.zero_()
        for buffer in self._keys + self._values:
            buffer[:len(pad)].zero_()
        self._use_rows(len(pad))

    # ------------------------------------------------------------------------------------------
    # What the model calls.

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs=None, **unused) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write [B, H_kv, S, D] new keys/values at `write_slots`; return the layer's K/V over the
        first `kv_len` slots, [B, H_kv, kv_len, D]."""
        if layer_idx == len(self._keys):  # the first forward allocates the layer's buffers
            _, heads, _, head_dim = key_states.shape
            shape = (self.max_batch, heads, self.capacity, head_dim)
            self._keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
            self._values.append(torch.zeros(shape, dtype=value_states.dtype, device=value_states.device))
            self.keys.append(self._keys[-1][:self.batch])
            self.values.append(self._values[-1][:self.batch])
        index = self.write_slots[:, None, :, None].expand_as(key_states)  # [B, H_kv, S, D]
        self.keys[layer_idx].scatter_(2, index, key_states)
        self.values[layer_idx].scatter_(2, index, value_states)
        return self.keys[layer_idx][:, :, :self.kv_len], self.values[layer_idx][:, :, :self.kv_len]

    def layer_buffers(self, layer_idx: int):
        """(keys, values, write_slots) of layer `layer_idx` ([B, H_kv, capacity, D] twice, [B, S]) for a
        fused layer that writes its new entries itself (fsd_ext.cpu_linear.fused), or None until the
        layer's first update allocated them."""
        if layer_idx >= len(self.keys) or self.write_slots is None:
            return None
        return self.keys[layer_idx], self.values[layer_idx], self.write_slots

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def __len__(self) -> int:
        return len(self.keys)
