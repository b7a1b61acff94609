"""CUDA graphs of the decoding loop's fixed-shape forwards, kept from one generate call to the next.

generate() replays each fixed-shape forward (the draft's one- and two-token steps, the target's
(K+1)-token verification) as a CUDA graph, captured the first time its shape comes up. Capturing
costs a few forwards (two warm-ups and the capture itself) per shape and batch size, a large share
of a short call; so each model keeps its static KV cache and the graphs captured over it (a
`GraphState`), and a later call reuses them when it fits:

- the model is as it was (a graph replays the kernels it recorded and bakes in the address of
  everything it reads): the same parameter and buffer tensors (address, dtype, shape), forward
  hooks and attention implementation; a model moved away and back, cast, given a new parameter
  tensor or a hook gets a new state. Other changes to what the forward computes (e.g. switching
  a PEFT adapter) are not seen: call release_cuda_graphs(model) after them;
- the call has at most the cached batch size (fewer rows use the cache's first rows, and the
  graphs captured for those sizes) and starts with at most the cached capacity, but not less than
  half of it (the graphs' attention reads the whole cache).

Otherwise the call builds a new state that replaces the old one. A call's cache starts with what
its prompt and first step need and grows as it produces tokens (kv_cache.capacity_for:
256 x 2^i slots); a growth moves the cache's buffers, so it drops the state's graphs, and each
shape is captured again at the new capacity (log2 of the growth times per call, at most).
A model keeps one state per role (target, draft: one model may serve as both). A state serves one
call at a time: a model in the same role in two threads at once gets a private state for the
second. A reused cache is zeroed first (a failed
call may have left NaN past the lengths, which the attention mask cannot hide). The graphs of a
state share one memory pool: they are replayed one at a time and each output is copied out at
once, so one graph's scratch memory may be another's. The cache stays allocated between calls;
`release_cuda_graphs()` drops the states (of one model, or all), and a model's state goes with it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Dict, Optional, Tuple

import torch

from .kv_cache import CAPACITY_STEP, StaticKVCache


class CapturedForward:
    """One captured forward of S tokens per row; replay reads the cache's live lengths."""

    def __init__(self, forward, input_ids: torch.Tensor, keep: int, pool=None):
        """pool: another graph's pool() to share (None: a new one)."""
        self.input_ids = input_ids.clone()  # [B, S] static input buffer
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (lazy allocations, kernel selection)
            for _ in range(2):
                forward(self.input_ids, keep)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward(self.input_ids, keep)  # [B, keep, V] static output buffer
        self.pool = self.graph.pool()

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return self.logits.clone()


def _fingerprint(model) -> tuple:
    """What a replay silently assumes of the model (see the module docstring)."""
    tensors = tuple((t.data_ptr(), t.dtype, tuple(t.shape))
                    for t in itertools.chain(model.parameters(), model.buffers()))
    hooks = tuple(tuple(hooks) for m in model.modules()
                  for hooks in (m._forward_pre_hooks, m._forward_hooks))
    return tensors, hooks, getattr(getattr(model, "config", None), "_attn_implementation", None)


class GraphState:
    """A model's static KV cache and the graphs captured over it, per (batch, tokens, kept logits)."""

    def __init__(self, model, pad: torch.Tensor, capacity: int):
        self.cache = StaticKVCache(pad, capacity)
        self.graphs: Dict[Tuple[int, int, int], CapturedForward] = {}
        self.fingerprint = _fingerprint(model)
        self.in_use = False

    def capture(self, key: Tuple[int, int, int], forward, input_ids: torch.Tensor, keep: int) -> None:
        """Capture forward(input_ids, keep) as graphs[key], sharing the earlier graphs' pool."""
        pool = next(iter(self.graphs.values())).pool if self.graphs else None
        self.graphs[key] = CapturedForward(forward, input_ids, keep, pool)

    def grow(self, capacity: int) -> None:
        """Grow the cache to `capacity` slots per row. The graphs go first: they read the old buffers
        and attend over the old capacity (and their pool can then be reclaimed)."""
        self.graphs.clear()
        self.cache.grow(capacity)

    def fits(self, model, batch: int, capacity: int) -> bool:
        cached = self.cache.capacity
        return (batch <= self.cache.max_batch and capacity <= cached <= 2 * max(capacity, CAPACITY_STEP)
                and self.fingerprint == _fingerprint(model))


# model -> {role ("target" / "draft"): its state}; one model may serve in both roles.
_states: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, GraphState]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # over _states and every state's in_use


def acquire(model, role: str, pad: torch.Tensor, capacity: int) -> GraphState:
    """The state a call of len(pad) rows (leading padding `pad`) starting with `capacity` slots per
    row (kv_cache.capacity_for) decodes `model` in `role` with: the kept one when it fits, reset to
    these rows; else a new one. Give it back with release() when the call ends."""
    with _lock:
        roles = _states.setdefault(model, {})
        state = roles.get(role)
        if state is not None and state.in_use:  # in use by another thread
            state = GraphState(model, pad, capacity)
        elif state is not None and state.fits(model, len(pad), capacity):
            state.cache.reset(pad)
        else:
            roles.pop(role, None)  # free the old graphs and cache before allocating new ones
            state = GraphState(model, pad, capacity)
            roles[role] = state
        state.in_use = True
        return state


def release(state: GraphState) -> None:
    with _lock:
        state.in_use = False


def release_cuda_graphs(model: Optional[torch.nn.Module] = None) -> None:
    """Drop the CUDA graphs and static KV cache that generate keeps for `model` (every model when
    None), so their GPU memory can be reused; a later call captures again."""
    with _lock:
        if model is None:
            _states.clear()
        else:
            _states.pop(model, None)
