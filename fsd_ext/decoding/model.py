"""One Hugging Face causal LM inside a generate() call: its static KV cache, its CUDA graphs and the
time of its forwards."""

from __future__ import annotations

import inspect
import time
from typing import Optional

import torch

from . import cuda_graphs
from .kv_cache import StaticKVCache, capacity_for


class ForwardClock:
    """Time in a model's forwards: on the CPU the wall clock around each one; on CUDA the GPU time
    between events recorded around each one, read once at the end, so no forward waits for the GPU
    (the host queues the next draft step while the GPU still runs this one)."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds = cuda, 0.0
        self.pending = []  # CUDA: (start, end) event pairs not read yet

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        return started

    def stop(self, started) -> None:
        if not self.cuda:
            self.seconds += time.perf_counter() - started
            return
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        self.pending.append((started, ended))

    def total(self) -> float:
        if self.pending:
            self.pending[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.pending) / 1e3  # ms -> s
            self.pending.clear()
        return self.seconds


def wait_for_gpu(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class CachedModel:
    """A Hugging Face causal LM in one generate call: its StaticKVCache, its captured graphs (with
    graphs on, both kept from call to call: cuda_graphs.py) and its call counters."""

    def __init__(self, model, pad: torch.Tensor, capacity: int, use_graphs: bool, role: str = "target",
                 slots: Optional[int] = None):
        """capacity: the most slots per row the call can need; slots: what its first forwards need
        (None: capacity). The cache starts at capacity_for(slots, capacity) and grows with reserve()."""
        self.model = model
        self.most_slots = capacity
        self.use_graphs = use_graphs
        self.calls, self.capture_seconds = 0, 0.0  # warm-ups and captures are not in seconds
        self.clock = ForwardClock(next(model.parameters()).is_cuda)
        self.dtype = next(model.parameters()).dtype
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # 5.x : 4.5x
        self.pass_cache_position = "cache_position" in params  # 4.5x: else it asks the cache
        self.keep_arg = next((name for name in ("logits_to_keep", "num_logits_to_keep")
                              if name in params), None)
        # Last: a graph state is given back by release(), which a failed __init__ never reaches.
        start = capacity_for(capacity if slots is None else slots, capacity)
        self.graph_state = cuda_graphs.acquire(model, role, pad, start) if use_graphs else None
        self.cache = self.graph_state.cache if use_graphs else StaticKVCache(pad, start)

    def reserve(self, slots: int) -> None:
        """Make the cache hold `slots` slots per row before forwards that write up to there: grown to
        capacity_for(slots, ...) when smaller (with graphs, dropping those captured over the old
        buffers: the next forward of each shape captures again)."""
        if slots <= self.cache.capacity:
            return
        capacity = capacity_for(slots, self.most_slots)
        if self.graph_state is not None:
            self.graph_state.grow(capacity)
        else:
            self.cache.grow(capacity)

    def _forward(self, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """[B, S] token ids appended at each row's length -> logits [B, keep, V] of the last keep."""
        num_tokens = input_ids.shape[1]
        kv_len = self.cache.capacity
        if not self.use_graphs:  # attend only to the slots in use (a host sync; fine off-graph)
            kv_len = min(kv_len, int(self.cache.lengths.max()) + num_tokens)
        position_ids, mask = self.cache.attention_inputs(num_tokens, self.dtype, kv_len)
        kwargs = {self.cache_arg: self.cache, "use_cache": True}
        if self.pass_cache_position:
            kwargs["cache_position"] = position_ids[0]  # only read by the cache, which ignores it
        if self.keep_arg is not None:
            kwargs[self.keep_arg] = keep
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                            **kwargs).logits
        return logits[:, -keep:]

    def __call__(self, input_ids: torch.Tensor, keep: int, prefill: bool = False) -> torch.Tensor:
        graphed, key = self.use_graphs and not prefill, (*input_ids.shape, keep)
        if graphed and key not in self.graph_state.graphs:  # timed apart: a one-time cost
            wait_for_gpu(input_ids)  # (not to count the forwards queued before it)
            capture_start = time.perf_counter()
            self.graph_state.capture(key, self._forward, input_ids, keep)
            wait_for_gpu(input_ids)
            self.capture_seconds += time.perf_counter() - capture_start
        started = self.clock.start()
        logits = self.graph_state.graphs[key](input_ids) if graphed else self._forward(input_ids, keep)
        self.clock.stop(started)
        self.calls += 1
        return logits

    def load_prefix(self, keys, values) -> None:
        """Load saved prompt entries (decoding.prompt_cache) in place of the prompt forward, which
        it counts as one call (so call counts do not depend on whether a prompt was reused)."""
        self.cache.load_prefix(keys, values)
        self.calls += 1

    @property
    def seconds(self) -> float:
        """Time in this call's forwards (see ForwardClock)."""
        return self.clock.total()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (moved in place to the cache's first rows, which is what the
        graphs captured for that batch size read)."""
        self.cache.select(rows)

    def release(self) -> None:
        """The call is over: its graph state may serve the next one."""
        if self.graph_state is not None:
            cuda_graphs.release(self.graph_state)
