"""The decoding loop: autoregressive (AR), speculative (SD) and fuzzy speculative (FSD) decoding with
any pair of Hugging Face causal LMs that share a tokenizer.

One step of speculative decoding, per batch row (docs/design.md sections 2 and 8):

    1. draft:  up to K one-token forwards of the draft model, each drawing d_i ~ q_i with
               fsd_ext.sample (argmax under greedy); after a step where a row accepted all its
               drafts, the first forward also re-reads the last committed token (see below). Each
               row proposes its own number of drafts (draft_length=, at most K, and no more than it
               can keep before max_new_tokens); a row that has stopped rides along in the batch's
               forwards, whose shapes stay fixed, and the step stops drafting once every row has.
    2. verify: one forward of the target over [pending, d_0 .. d_{k-1}] -> logits for k+1 positions,
               k being the step's draft forwards.
    3. accept: one fsd_ext.accept call (each row's own draft count as num_draft) -> n accepted
               drafts plus one correction/bonus token.
    4. commit: each row keeps pending + its n accepted drafts in the target cache by setting its
               length; the rejected positions are simply past that length (no prefix is re-run).
               The emitted token becomes the row's new `pending` token, which no model has seen yet.

rule="ar" runs the target alone through the same loop: one one-token forward and one fsd_ext.sample
per step. Rows keep their own lengths in a static KV cache (fsd_ext.kv_cache); a row that emits EOS
or reaches max_new_tokens leaves the batch. On CUDA, each fixed-shape forward (the draft's one- and
two-token steps, the target's (K+1)-token verification) is captured in a CUDA graph once per batch
size and replayed; there the batch shrinks to powers of two only (stopped rows wait, parked, see
_Decoder), so a batch of B rows is captured for at most ceil(log2 B) + 1 sizes, and the graphs (with
the static cache they read) are kept for the next call (fsd_ext.cuda_graphs).

Why the draft may re-read one token: after a step that accepted all K drafts, d_{K-1} was never fed
to the draft. Instead of a ragged catch-up call, the next step then rolls every row of the draft's
cache back by one and feeds [last committed token, pending] as one two-token forward (rows that were
not behind just rewrite an entry with the same token). Otherwise the first forward is [pending].

Randomness: row b draws from Philox with its own seed (`seed + b` for an int seed, or the given [B]
tensor), keyed by the step counter, so the output is a function of the seed alone and a row's
tokens do not depend on the other rows in the batch (up to float rounding where the models' own
kernels compute differently at different batch sizes, as GPU matmuls may).
"""

from __future__ import annotations

import inspect
import numbers
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from . import cuda_graphs, ops, reference
from .kv_cache import StaticKVCache, capacity_for
from .decoding.draft_length import POLICIES
from .types import DIVERGENCES, PURPOSE_ACCEPT, RULES

# The two ops the loop uses: the compiled kernels, or the pure-torch reference with the same contract
# when the extension is not built. Switching is this one line.
_accept, _sample = (ops.accept, ops.sample) if ops._IMPORT_ERROR is None else (reference.accept,
                                                                               reference.sample)
_dry_run_accept = _accept  # check_options' one-row call: apart from the loop's, which tests spy on

GENERATE_RULES = ("ar",) + RULES

def seconds_per_decode_forward(seconds: float, prompt_seconds: float, forwards: int,
                               prompts: int = 1) -> float:
    """A model's mean seconds per forward after its prompt forwards: `forwards` calls took `seconds`,
    `prompts` of them the prompt forwards' `prompt_seconds` (0.0 when no other forward ran). Shared
    by GenerateStats and the bench summary, which pools it over decodes."""
    decode_forwards = forwards - prompts
    return (seconds - prompt_seconds) / decode_forwards if decode_forwards > 0 else 0.0


@dataclass
class GenerateStats:
    """What a generate() call did. Counts are of model calls (one call = one forward of the batch)."""

    rule: str
    num_draft_tokens: int
    new_tokens: int = 0  # generated tokens, all rows together
    seconds: float = 0.0  # wall time of the whole call, less diagnostics_seconds
    diagnostics_seconds: float = 0.0  # counting sampled SD rejections (output_divergences=True)
    prefill_seconds: float = 0.0  # the prompt forwards of both models (inside seconds)
    target_prefill_seconds: float = 0.0  # the target's part of prefill_seconds
    capture_seconds: float = 0.0  # CUDA graph warm-ups and captures, both models (inside seconds)
    target_forwards: int = 0  # prefill included
    target_seconds: float = 0.0  # in the target's forwards (on CUDA GPU time; captures not included)
    draft_forwards: int = 0
    draft_seconds: float = 0.0  # in the draft's forwards (on CUDA GPU time; captures not included)
    verifications: int = 0  # target verification calls x rows verified (row-steps)
    drafted_tokens: int = 0  # drafts the rows proposed for verification, all row-steps together
    accepted_drafts: int = 0  # accepted drafts kept in the output (none past a row's end)
    # Kept accepted drafts that plain SD would have rejected (0 for sd by definition; None for ar):
    # greedy decoding, drafts that are not the target's argmax; sampling (only with
    # output_divergences=True, else None), drafts whose step coin fails SD's test u q(d) <= p(d),
    # the same Philox coin the accept call drew.
    sd_rejected_accepted: Optional[int] = None
    accepted_histogram: List[int] = field(default_factory=list)  # [K+1]: row-steps accepting n
    divergences: Optional[List[torch.Tensor]] = None  # per step, [B_active, K] float32

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens/s without the prompt forwards (which dominate short outputs on a CPU) and the
        CUDA graph captures (a one-time cost per call and shape)."""
        seconds = self.seconds - self.prefill_seconds - self.capture_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean drafts accepted per row and target call (0..K; the correction/bonus not counted)."""
        return self.accepted_drafts / self.verifications if self.verifications else 0.0

    @property
    def mean_drafted(self) -> float:
        """Mean drafts a row proposed per target call (K under draft_length="fixed", until rows
        near max_new_tokens draft fewer)."""
        return self.drafted_tokens / self.verifications if self.verifications else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """A draft forward's time over a target verification's, prompt forwards left out: the
        `draft_cost` that draft_length="acceptance" assumes, as measured (0 without drafts)."""
        per_draft = seconds_per_decode_forward(
            self.draft_seconds, self.prefill_seconds - self.target_prefill_seconds, self.draft_forwards)
        per_target = seconds_per_decode_forward(
            self.target_seconds, self.target_prefill_seconds, self.target_forwards)
        return per_draft / per_target if per_target > 0 else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Mean tokens a row gains per target call (mean_accepted + 1 until rows stop early)."""
        return self.new_tokens / self.verifications if self.verifications else 0.0

    def summary(self) -> str:
        return (f"{self.rule}: {self.new_tokens} tokens in {self.seconds:.2f} s = "
                f"{self.tokens_per_second:.2f} tokens/s, {self.tokens_per_target_call:.2f} tokens and "
                f"{self.mean_accepted:.2f} accepted of {self.mean_drafted:.2f} drafted per target call "
                f"(target {self.target_forwards} calls {self.target_seconds:.2f} s, "
                f"draft {self.draft_forwards} calls {self.draft_seconds:.2f} s"
                + (f", graph captures {self.capture_seconds:.2f} s)" if self.capture_seconds else ")"))


@dataclass
class GenerateOutput:
    """sequences: [B, P + N] int64, the (left-padded) prompts then the generated tokens, padded with
    the pad id after a row's EOS or last token. stats: GenerateStats."""

    sequences: torch.Tensor
    stats: GenerateStats


# ----------------------------------------------------------------------------------------------
# One model with its static cache.

class _ForwardClock:
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


def _wait_for_gpu(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class _CachedModel:
    """A Hugging Face causal LM in one generate call: its StaticKVCache, its captured graphs (with
    graphs on, both kept from call to call: fsd_ext.cuda_graphs) and its call counters."""

    def __init__(self, model, pad: torch.Tensor, capacity: int, use_graphs: bool, role: str = "target",
                 slots: Optional[int] = None):
        """capacity: the most slots per row the call can need; slots: what its first forwards need
        (None: capacity). The cache starts at capacity_for(slots, capacity) and grows with reserve()."""
        self.model = model
        self.most_slots = capacity
        self.use_graphs = use_graphs
        self.calls, self.capture_seconds = 0, 0.0  # warm-ups and captures are not in seconds
        self.clock = _ForwardClock(next(model.parameters()).is_cuda)
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
            _wait_for_gpu(input_ids)  # (not to count the forwards queued before it)
            capture_start = time.perf_counter()
            self.graph_state.capture(key, self._forward, input_ids, keep)
            _wait_for_gpu(input_ids)
            self.capture_seconds += time.perf_counter() - capture_start
        started = self.clock.start()
        logits = self.graph_state.graphs[key](input_ids) if graphed else self._forward(input_ids, keep)
        self.clock.stop(started)
        self.calls += 1
        return logits

    @property
    def seconds(self) -> float:
        """Time in this call's forwards (see _ForwardClock)."""
        return self.clock.total()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (moved in place to the cache's first rows, which is what the
        graphs captured for that batch size read)."""
        self.cache.select(rows)

    def release(self) -> None:
        """The call is over: its graph state may serve the next one."""
        if self.graph_state is not None:
            cuda_graphs.release(self.graph_state)


# ----------------------------------------------------------------------------------------------
# Argument checks.

def _vocab_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


def check_tokenizers(target_tokenizer, draft_tokenizer) -> None:
    """Raise ValueError unless every token of the draft tokenizer has the same id in the target's."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    for token, index in draft_vocab.items():
        if target_vocab.get(token) != index:
            raise ValueError(
                f"target and draft tokenizers differ: draft token {token!r} has id {index}, the "
                f"target's id is {target_vocab.get(token)}. FSD needs one shared tokenizer.")


def check_pair(target_config, draft_config, target_tokenizer=None, draft_tokenizer=None,
               hint: str = "") -> None:
    """Raise ValueError unless the draft can share the target's token ids, as far as can be told.
    With both tokenizers: check_tokenizers. Without: the (text) configs' vocab_size and bos_token_id
    must agree, as Hugging Face's assisted generation asks for tokenizers when the vocab sizes
    differ. Not checked without tokenizers: which tokens a same-size vocabulary holds, and eos/pad
    ids (a base and a chat model of one tokenizer end differently). `hint` says how to pass them."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        return check_tokenizers(target_tokenizer, draft_tokenizer)
    configs = [c.get_text_config() if hasattr(c, "get_text_config") else c
               for c in (target_config, draft_config)]
    for name in ("vocab_size", "bos_token_id"):
        target_value, draft_value = (getattr(c, name, None) for c in configs)
        if target_value is not None and draft_value is not None and target_value != draft_value:
            raise ValueError(f"target and draft models differ: {name} {target_value} vs {draft_value}. "
                             f"FSD needs one shared tokenizer{hint}")


def _as_ids(value, name: str) -> List[int]:
    if value is None:
        return []
    values = value.tolist() if isinstance(value, torch.Tensor) else value
    values = [values] if isinstance(values, numbers.Integral) else list(values)
    if not all(isinstance(v, numbers.Integral) for v in values):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    return [int(v) for v in values]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True is no count


def check_options(*, rule: str = "fsd", divergence: str = "js", threshold=0.3,
                  num_draft_tokens: int = 5, temperature: float = 1.0, top_k=None, top_p=None,
                  min_p=None, div_temperature=1.0, max_new_tokens: int = 256,
                  use_cuda_graphs="auto", draft_length: str = "fixed", draft_confidence: float = 0.4,
                  draft_cost: float = 0.25, pad_token_id=None) -> None:
    """Raise ValueError / TypeError for a generate() option that no model and no input is needed to
    refuse. generate() calls it first; the command line calls it before it loads any model."""
    if rule not in GENERATE_RULES:
        raise ValueError(f"rule must be one of {GENERATE_RULES}, got {rule!r}")
    if draft_length not in POLICIES:
        raise ValueError(f"draft_length must be one of {tuple(POLICIES)}, got {draft_length!r}")
    if isinstance(draft_confidence, bool) or not isinstance(draft_confidence, numbers.Real) \
            or not 0.0 <= draft_confidence <= 1.0:
        raise ValueError(f"draft_confidence must be a float in [0, 1], got {draft_confidence!r}")
    if isinstance(draft_cost, bool) or not isinstance(draft_cost, numbers.Real) \
            or not draft_cost > 0.0 or draft_cost == float("inf"):
        raise ValueError(f"draft_cost must be a finite float > 0, got {draft_cost!r}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not _is_int(num_draft_tokens) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature >= 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    if isinstance(threshold, torch.Tensor):
        # (>= 0).all() rather than (< 0).any(): NaN must fail too, as the float form's check does
        if threshold.dim() != 1 or not threshold.is_floating_point() or not (threshold >= 0).all():
            raise ValueError("threshold must be a float >= 0 or a [B] float tensor >= 0")
    elif isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold >= 0:
        raise ValueError(f"threshold must be a float >= 0, got {threshold!r}")
    if use_cuda_graphs not in ("auto", True, False):
        raise ValueError(f"use_cuda_graphs must be 'auto', True or False, got {use_cuda_graphs!r}")
    if pad_token_id is not None and not _is_int(pad_token_id):
        raise ValueError(f"pad_token_id must be None or an int, got {pad_token_id!r}")
    # The sampling and FSD options meet the ops' own checks (csrc/torch/problem.h, the one place) on
    # a one-row, one-id problem here, rather than at the first step after the prompts' forwards.
    _dry_run_accept(torch.zeros(1, 2, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1, dtype=torch.int64),
            rule=rule if rule in RULES else "fsd", divergence=divergence,
            threshold=0.0 if isinstance(threshold, torch.Tensor) else threshold,
            temperature=0.0 if rule == "greedy" else temperature, div_temperature=div_temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, seed=0)


def _check_in_vocab(name: str, ids: torch.Tensor, model) -> None:
    """Ids the model's embedding will read must lie in its vocabulary (on CUDA the embedding would
    kill the process)."""
    low, high, vocab = int(ids.min()), int(ids.max()), _vocab_size(model)
    if low < 0 or high >= vocab:
        shown = f"{low}" if ids.numel() == 1 else f"ids from {low} to {high}"
        raise ValueError(f"{name} must hold ids in the target vocabulary [0, {vocab}), got {shown}")


def _position_limit(model) -> Optional[int]:
    """The most positions a model with learned absolute position embeddings (GPT-2's wpe, OPT's
    embed_positions) can embed: a position table, an nn.Embedding besides the token embeddings,
    sized by config.n_positions / max_position_embeddings. None for rotary models (Llama, Qwen2),
    which compute positions and can run past max_position_embeddings, and for ALiBi ones."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not limit:
        return None
    tokens = model.get_input_embeddings()
    for module in model.modules():
        # (OPT's table keeps 2 rows more than the positions it serves)
        if isinstance(module, torch.nn.Embedding) and module is not tokens \
                and 0 <= module.num_embeddings - limit <= 2:
            return int(limit)
    return None


def _check_args(target, draft, input_ids, attention_mask, rule, threshold, streamer, max_new_tokens):
    """The checks that need the models and the inputs (check_options has the rest)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1 \
            or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("input_ids must be an int tensor [B, P] with P >= 1")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be a tensor shaped like input_ids "
                             f"{tuple(input_ids.shape)}")
        mask = attention_mask.to(torch.int64).cpu()
        if ((mask != 0) & (mask != 1)).any() or (mask[:, 1:] < mask[:, :-1]).any() \
                or (mask[:, -1] != 1).any():
            raise ValueError("attention_mask must be 0/1 with the prompts left-padded "
                             "(tokenizer.padding_side = 'left') and no empty prompt")
    if input_ids.shape[0] < 1:
        raise ValueError("input_ids must hold at least one row, got shape "
                         f"{tuple(input_ids.shape)}")
    _check_in_vocab("input_ids", input_ids, target)
    longest = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(1).max())
    if isinstance(threshold, torch.Tensor) and threshold.shape != (input_ids.shape[0],):
        raise ValueError(f"a threshold tensor must be [B={input_ids.shape[0]}], got shape "
                         f"{tuple(threshold.shape)}")
    for model in (target,) if rule == "ar" else (target, draft):
        limit = _position_limit(model) if model is not None else None
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) "
                f"exceeds the {limit} positions of {type(model).__name__}'s learned position "
                f"embeddings: lower max_new_tokens to at most {limit - longest}")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("a streamer needs batch size 1 (as in Hugging Face generate)")
    if rule != "ar":
        if draft is None:
            raise ValueError(f"rule={rule!r} needs a draft model (only rule='ar' runs without one)")
        if _vocab_size(draft) > _vocab_size(target):
            raise ValueError(f"draft vocabulary ({_vocab_size(draft)}) must not be larger than the "
                             f"target's ({_vocab_size(target)}): the models must share a tokenizer")
        device = next(target.parameters()).device
        if next(draft.parameters()).device != device:
            raise ValueError(f"target and draft must be on the same device "
                             f"({device} vs {next(draft.parameters()).device})")


def _sd_rejects(target_logits: torch.Tensor, draft_logits: torch.Tensor, drafts: torch.Tensor,
                temperature: float, filters: dict, seeds: torch.Tensor, step: int) -> torch.Tensor:
    """[B, K] bool: where plain SD would reject draft d_i of this step. Greedy: d_i is not the
    target's argmax. Sampling: the step's coin u_i (replayed from the same Philox stream accept used)
    fails u_i q_i(d_i) <= p_i(d_i), p and q being the (filtered) sampling distributions of the
    reference (the spec the kernels are tested against). A fidelity statistic beside the fused call:
    a log-softmax per drafted row, a sort of the vocabulary under top-p."""
    if temperature == 0.0:
        return target_logits.argmax(-1) != drafts
    batch, k = drafts.shape
    coins = reference.philox_uniforms(seeds, step, batch, k, PURPOSE_ACCEPT).to(drafts.device)
    tau = torch.full((batch,), float(temperature), device=drafts.device)
    p_draft, q_draft = (reference.sampling_logprobs(logits.float(), tau, **filters)
                        .gather(-1, drafts[..., None])[..., 0].double().exp()
                        for logits in (target_logits, draft_logits))
    return coins * q_draft > p_draft


def _row_seeds(seed, batch: int) -> torch.Tensor:
    """-> [B] int64 per-row seeds: seed + b for an int seed, a fresh one from torch's default
    generator for None (so torch.manual_seed makes runs reproducible)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return torch.tensor([ops.wrap_int64(int(seed) + b) for b in range(batch)])  # [B]
    try:
        seeds = torch.as_tensor(seed)
    except (TypeError, ValueError, RuntimeError):
        seeds = torch.zeros(0)
    if seeds.dtype not in (torch.int32, torch.int64) or seeds.shape != (batch,):
        raise ValueError(f"seed must be an int or [{batch}] ints (one per row), got {seed!r}")
    return seeds.to("cpu", torch.int64)


# ----------------------------------------------------------------------------------------------
# The loop.

@dataclass
class _Settings:
    """generate()'s arguments, resolved once (defaults filled in, rule="greedy" as temperature 0)."""

    rule: str
    k: int  # drafts per step (0 for ar)
    temperature: float
    sample_args: dict  # top_k, top_p, min_p
    accept_args: dict  # everything fsd_ext.accept takes besides the tensors, seed and offset
    max_new_tokens: int
    eos_ids: List[int]
    output_divergences: bool
    draft_vocab: int  # ids >= this are replaced by 0 before the draft reads them (0: no draft)
    draft_length: str = "fixed"  # a name in POLICIES
    draft_confidence: float = 0.4  # "confidence": a row stops below this draft probability
    draft_cost: float = 0.25  # "acceptance": a draft forward's time over a verification's

    @property
    def speculative(self) -> bool:
        return self.rule != "ar"

    @property
    def sampling(self) -> bool:
        return self.temperature > 0.0

    @property
    def count_sd_rejections(self) -> bool:
        """Greedy: always (cheap). Sampling: only with output_divergences (replays coins, softmaxes)."""
        return self.speculative and (not self.sampling or (self.output_divergences and self.rule != "sd"))

    def for_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """A smaller draft vocabulary can't read the target-only ids the target may emit: the draft
        sees id 0 instead (this only changes what it proposes; the target verifies every token)."""
        return ids.masked_fill(ids >= self.draft_vocab, 0) if self.draft_vocab else ids


@dataclass
class _StepOutput:
    """What one step emitted for each active row."""

    tokens: torch.Tensor  # [B, k_step + 1] accepted drafts, then the correction/bonus token, then -1
    num_accepted: torch.Tensor  # [B]
    k_step: int = 0  # draft forwards this step (0 for ar)
    num_drafted: Optional[List[int]] = None  # [B]: drafts each slot proposed (<= k_step)
    sd_rejects: Optional[List[List[bool]]] = None  # [B][k_step]: drafts plain SD would reject


class _Decoder:
    """The loop's state between steps: the batch slots with their pending token, seed and threshold,
    the two cached models, and what every row has generated so far.

    A row that stops (EOS, max_new_tokens) leaves the batch and the caches after its step. With
    CUDA graphs, which are captured per batch size, the batch shrinks only to powers of two: until
    then a stopped row stays as a *parked* slot, whose outputs are discarded and whose cache length
    is frozen (it rewrites the slots past its end), so B rows capture each forward shape for at
    most ceil(log2 B) + 1 batch sizes instead of once per stopping row."""

    def __init__(self, settings: _Settings, target_model: _CachedModel,
                 draft_model: Optional[_CachedModel], ids: torch.Tensor, seeds: torch.Tensor,
                 threshold, stats: GenerateStats, streamer):
        self.settings, self.stats, self.streamer = settings, stats, streamer
        self.target_model, self.draft_model = target_model, draft_model
        self.models = [m for m in (target_model, draft_model) if m is not None]
        self.device = ids.device
        self.pending = ids[:, -1].clone()  # [B] the last token, not yet seen by any model
        self.last_committed = ids[:, -2].clone()  # [B] the token before it (re-read by the draft)
        self.seeds, self.threshold = seeds, threshold  # [B]; float or [B]
        self.rows = list(range(ids.shape[0]))  # original row index of each batch slot
        self.live = [True] * len(self.rows)  # False: a parked slot (its row has stopped)
        self.live_mask = torch.ones(len(self.rows), dtype=torch.int64, device=self.device)  # [B]
        self.shrink_to_powers_of_two = target_model.use_graphs
        self.generated: List[List[int]] = [[] for _ in self.rows]
        self.step = 0
        self.draft_behind = False  # some row accepted all its drafts last step (see module doc)
        self.policy = POLICIES[settings.draft_length](settings.k, len(self.rows), confidence=settings.draft_confidence,
                                                      cost=settings.draft_cost)  # per original row

    def run(self) -> List[List[int]]:
        """Step until every row has stopped -> each row's generated tokens."""
        while any(self.live):
            self._reserve()
            out = self._speculative_step() if self.settings.speculative else self._ar_step()
            pending = out.tokens[torch.arange(len(self.rows), device=self.device),
                                 out.num_accepted]  # [B]
            if ((pending < 0) & (self.live_mask > 0)).any():
                raise RuntimeError(f"the logits hold NaN or no finite value at step {self.step}")
            self.pending = pending.clamp_min(0)  # (a parked slot's token is never used)
            self.step += 1
            self._record(out)
            self._shrink()
        return self.generated

    def _reserve(self) -> None:
        """Grow the caches to hold this step's writes: at most k + 1 slots from the longest row's
        length (a parked row's included: it rewrites past its end). One host sync per step."""
        slots = int(self.target_model.cache.lengths.max()) + self.settings.k + 1
        for cached in self.models:
            cached.reserve(slots)

    def _ar_step(self) -> _StepOutput:
        """The target alone: one one-token forward and one sample per row."""
        s = self.settings
        logits = self.target_model(self.pending[:, None], keep=1)[:, 0]  # [B, V_t]
        emitted = _sample(logits.float(), s.temperature, **s.sample_args, seed=self.seeds,
                          offset=self.step).to(self.device)  # [B]
        self.target_model.cache.lengths += self.live_mask
        return _StepOutput(emitted[:, None], torch.zeros_like(emitted))  # [B, 1], [B]

    def _speculative_step(self) -> _StepOutput:
        """Draft, verify, accept (module doc, steps 1-3); commits the accepted prefix to the target's
        cache."""
        s = self.settings
        # Each row's most drafts: its policy's K, and near max_new_tokens only what it can still
        # keep (>= 1). Row b uses num_draft[b] of the step's drafts, so its tokens do not depend on
        # the other rows; the batch drafts until every live row has stopped.
        row_caps = [max(1, min(self.policy.cap(row), s.max_new_tokens - len(self.generated[row]) - 1))
                    for row in self.rows]
        draft_logits, drafts, row_drafted = self._draft(row_caps)  # [B, k_step, V_d], [B, k_step]
        k_step = drafts.shape[1]
        row_drafted = [n if live else k_step for n, live in zip(row_drafted, self.live)]  # parked: any
        num_draft = (torch.tensor(row_drafted, dtype=torch.int64, device=self.device)
                     if min(row_drafted) < k_step else None)  # [B] or None (all k_step)

        # Verify: the target reads pending and the drafts in one forward; accept: one fused call.
        verify_input = torch.cat([self.pending[:, None], drafts], 1)  # [B, k_step+1]
        target_logits = self.target_model(verify_input, keep=k_step + 1).float()  # [B, k_step+1, V_t]
        result = _accept(target_logits, draft_logits, drafts, threshold=self.threshold,
                         num_draft=num_draft, **s.accept_args, seed=self.seeds, offset=self.step)
        bad = [row for row, ok, live in zip(self.rows, result.valid.tolist(), self.live)
               if live and not ok]
        if bad:
            raise RuntimeError(f"the target or draft logits of row(s) {bad} hold NaN or no finite "
                               f"value at step {self.step}")
        out = _StepOutput(result.tokens.to(self.device), result.num_accepted.to(self.device), k_step,
                          num_drafted=row_drafted)
        if s.output_divergences:
            live_slots = [j for j, live in enumerate(self.live) if live]
            self.stats.divergences.append(result.divergence.cpu()[live_slots])  # [B_live, K]
        if s.count_sd_rejections:  # a fidelity diagnostic; sampled, it is timed apart
            start = time.perf_counter()
            out.sd_rejects = _sd_rejects(target_logits[:, :k_step], draft_logits, drafts,
                                         s.temperature, s.sample_args, self.seeds, self.step).tolist()
            if s.sampling:
                self.stats.diagnostics_seconds += time.perf_counter() - start

        # Commit pending + the accepted drafts (rejected entries lie past the new length).
        self.target_model.cache.lengths += (out.num_accepted + 1) * self.live_mask
        last_accepted = drafts[torch.arange(len(self.rows), device=self.device),
                               (out.num_accepted - 1).clamp_min(0)]  # [B]
        self.last_committed = torch.where(out.num_accepted > 0, last_accepted, self.pending)
        return out

    def _draft(self, row_caps: List[int]):
        """One-token draft forwards until every live row has drafted its cap or its draft-length
        policy stopped it (draft_length="confidence": a draft below the threshold) -> (logits [B, k_step, V_d] float32,
        drafts [B, k_step], drafts per slot [B] ints). A row that has stopped still rides along in
        the batch's forwards (its later drafts go unused), so every forward has the same shape.
        The first forward also re-reads the last committed token when the draft is one behind."""
        s, draft_model = self.settings, self.draft_model
        if self.draft_behind:
            draft_model.cache.lengths.copy_(self.target_model.cache.lengths - 1)
            draft_input = torch.stack([self.last_committed, self.pending], 1)  # [B, 2]
        else:
            draft_model.cache.lengths.copy_(self.target_model.cache.lengths)
            draft_input = self.pending[:, None]  # [B, 1]
        k_max = max(cap for cap, live in zip(row_caps, self.live) if live)
        drafted = [None if live else 0 for live in self.live]  # None: still drafting
        draft_logits, drafts = [], []
        for i in range(k_max):
            logits = draft_model(s.for_draft(draft_input), keep=1)[:, 0].float()  # [B, V_d]
            draft_model.cache.lengths += draft_input.shape[1]
            token = _sample(logits, s.temperature, **s.sample_args, seed=self.seeds,
                            offset=self.step * s.k + i).to(self.device)  # [B]
            # -1 marks NaN draft logits: feeding it to the embedding would fail (a device-side
            # assert on CUDA); 0 goes on instead and the accept call flags the row invalid.
            token = token.clamp_min(0)
            draft_logits.append(logits)
            drafts.append(token)
            draft_input = token[:, None]  # [B, 1]
            stops = self.policy.stops(self._draft_confidence(logits, token)) if self.policy.stops_early \
                else [False] * len(self.rows)  # [B]
            for j, cap in enumerate(row_caps):
                if drafted[j] is None and (i + 1 >= cap or stops[j]):
                    drafted[j] = i + 1  # the low-confidence draft itself is still verified
            if all(n is not None for n in drafted):
                break
        return torch.stack(draft_logits, 1), torch.stack(drafts, 1), drafted

    def _draft_confidence(self, logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """[B] the draft's probability of its own token: softmax(logits / temperature) when sampling
        (before top-k/top-p/min-p, which can only raise it), softmax(logits) under greedy (the
        one-hot argmax distribution would always give 1)."""
        temperature = self.settings.temperature
        scaled = logits / temperature if temperature > 0 else logits  # [B, V_d]
        return torch.softmax(scaled, -1).gather(-1, token[:, None])[:, 0]

    def _record(self, out: _StepOutput) -> None:
        """Host bookkeeping: append each live row's new tokens (cut at EOS and max_new_tokens),
        count, stream; a row that stops becomes a parked slot."""
        s, stats = self.settings, self.stats
        counts = out.num_accepted.tolist()
        for j, (row_tokens, n) in enumerate(zip(out.tokens.tolist(), counts)):
            if not self.live[j]:
                continue
            generated = self.generated[self.rows[j]]
            new = row_tokens[:n + 1][:s.max_new_tokens - len(generated)]
            stop = next((i for i, t in enumerate(new) if t in s.eos_ids), None)
            if stop is not None:
                new = new[:stop + 1]
            generated.extend(new)
            stats.new_tokens += len(new)
            stats.verifications += 1
            if out.num_drafted is not None:  # (None for ar)
                stats.drafted_tokens += out.num_drafted[j]
                self.policy.record(self.rows[j], n, out.num_drafted[j])
            kept_drafts = min(n, len(new))  # accepted drafts past EOS / max_new_tokens are cut
            stats.accepted_drafts += kept_drafts
            if out.sd_rejects is not None:
                stats.sd_rejected_accepted += sum(out.sd_rejects[j][:kept_drafts])
            stats.accepted_histogram[n] += 1
            if self.streamer is not None and new:
                self.streamer.put(torch.tensor(new))
            if stop is not None or len(generated) >= s.max_new_tokens:
                self.live[j] = False
                self.live_mask[j] = 0
        # Only a row that used and accepted all k_step drafts left d_{k_step-1} unread.
        self.draft_behind = s.speculative and any(
            live and n == out.k_step for live, n in zip(self.live, counts))

    def _shrink(self) -> None:
        """Stopped rows leave the batch, the caches and every per-slot tensor; with CUDA graphs
        only as many as keep the batch a power of two (the rest stay parked)."""
        live_slots = [j for j, live in enumerate(self.live) if live]
        size = len(live_slots)
        if self.shrink_to_powers_of_two and size > 0:
            size = 1 << (size - 1).bit_length()  # the next power of two >= the live rows
        if size >= len(self.rows):
            return
        parked = [j for j, live in enumerate(self.live) if not live]
        slots = sorted(live_slots + parked[:size - len(live_slots)])
        keep = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [B']
        self.rows = [self.rows[j] for j in slots]
        self.live = [self.live[j] for j in slots]
        for cached in self.models:
            cached.select(keep)
        self.pending, self.last_committed = self.pending[keep], self.last_committed[keep]
        self.seeds, self.live_mask = self.seeds[keep], self.live_mask[keep]
        if isinstance(self.threshold, torch.Tensor):
            self.threshold = self.threshold[keep]


@torch.no_grad()
def generate(target, draft, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             *, rule: str = "fsd", divergence: str = "js",
             threshold: Union[float, torch.Tensor] = 0.3, num_draft_tokens: int = 5,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             min_p: Optional[float] = None, div_temperature: Optional[float] = 1.0,
             max_new_tokens: int = 256, eos_token_id: Union[int, Sequence[int], None] = None,
             pad_token_id: Optional[int] = None, seed=None, use_cuda_graphs="auto", streamer=None,
             output_divergences: bool = False, draft_length: str = "fixed",
             draft_confidence: float = 0.4, draft_cost: float = 0.25) -> GenerateOutput:
    """Generate with the target model, drafting with the draft model (docs/design.md section 8).

    Args:
        target, draft: Hugging Face causal LMs on the same device with one tokenizer (draft
            vocabulary <= target vocabulary). `draft` may be None for rule="ar".
        input_ids: [B, P] int prompts, left-padded; attention_mask: [B, P] 0/1 (None = no padding).
        rule: "ar" (target alone), "greedy", "sd", "fsd" (default) or "fsd_strict".
        divergence, threshold, div_temperature: the FSD test D_i < T (fsd, fsd_strict).
        num_draft_tokens: K, the most drafts per verification (all of them under "fixed").
        draft_length: how many of the K drafts each row proposes per step (docs/generate.md, "Draft
            length"): "fixed" (K); "confidence" (a row stops after a draft whose draft
            probability is below draft_confidence, Hugging Face's assistant_confidence_threshold);
            "heuristic" (Hugging Face's schedule: a row's K grows by 2 after a fully accepted step,
            shrinks by 1 otherwise); "acceptance" (a row's K maximises its expected tokens per unit
            of time from its running acceptance rate and draft_cost, the time of a draft forward
            over that of a target verification). Under greedy decoding with rule "greedy" or "sd"
            every policy gives the same tokens; only the work differs.
        temperature, top_k, top_p, min_p: sampling of both models (temperature 0 = greedy; rule
            "greedy" forces it).
        max_new_tokens: per row; eos_token_id: int or ints (default: the target's generation
            config); pad_token_id: fills rows after their end (default: pad, else EOS, else 0).
        seed: int (row b uses seed + b), [B] ints, or None (drawn from torch's generator).
        use_cuda_graphs: "auto" (on for CUDA), True or False.
        streamer: a Hugging Face streamer (put/end), batch size 1 only.
        output_divergences: keep each step's divergences in stats.divergences and, when sampling,
            count the accepted drafts SD would have rejected (stats.sd_rejected_accepted: replays
            each step's coins and needs p(d), q(d), a log-softmax per drafted row and a sort under
            top-p; timed apart in stats.diagnostics_seconds, not in stats.seconds).

    Returns:
        GenerateOutput(sequences [B, P + N] int64, stats GenerateStats).

    Example:
        >>> out = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=0.3, seed=0)
        >>> print(tokenizer.batch_decode(out.sequences), out.stats.summary())
    """
    check_options(rule=rule, divergence=divergence, threshold=threshold,
                  num_draft_tokens=num_draft_tokens, temperature=temperature, top_k=top_k,
                  top_p=top_p, min_p=min_p, div_temperature=div_temperature,
                  max_new_tokens=max_new_tokens, use_cuda_graphs=use_cuda_graphs,
                  draft_length=draft_length, draft_confidence=draft_confidence,
                  draft_cost=draft_cost, pad_token_id=pad_token_id)
    _check_args(target, draft, input_ids, attention_mask, rule, threshold, streamer, max_new_tokens)
    start = time.perf_counter()
    device = next(target.parameters()).device
    use_graphs = device.type == "cuda" if use_cuda_graphs == "auto" else bool(use_cuda_graphs)
    if use_graphs and device.type != "cuda":
        raise ValueError("use_cuda_graphs=True needs the models on a CUDA device")
    settings = _settings(target, draft, rule, divergence, num_draft_tokens, temperature, top_k,
                         top_p, min_p, div_temperature, max_new_tokens, eos_token_id,
                         output_divergences, draft_length, draft_confidence, draft_cost)
    if pad_token_id is None:
        pad_token_id = getattr(target.generation_config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (
            settings.eos_ids[0] if settings.eos_ids else 0)
    _check_in_vocab("pad_token_id", torch.tensor(pad_token_id), target)
    batch, prompt_len = input_ids.shape
    seeds = _row_seeds(seed, batch).to(device)  # [B]
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.to(device, torch.float32)  # [B] per-row thresholds

    # One extra padding slot in front of every row (never attended to), so that the prefill of
    # all but the last prompt token is never empty and `last_committed` always exists.
    input_ids = input_ids.to(device, torch.int64)
    prompt_mask = (torch.ones_like(input_ids) if attention_mask is None
                   else attention_mask.to(device, torch.int64))  # [B, P]
    pad = 1 + (prompt_mask == 0).sum(1)  # [B] leading padding slots per row
    ids = torch.cat([torch.full_like(input_ids[:, :1], pad_token_id), input_ids], 1)  # [B, P+1]
    capacity = prompt_len + 1 + max_new_tokens + settings.k + 1
    stats = GenerateStats(rule=rule, num_draft_tokens=settings.k,
                          accepted_histogram=[0] * (settings.k + 1),
                          divergences=[] if output_divergences else None)
    if settings.count_sd_rejections or rule == "sd":
        stats.sd_rejected_accepted = 0  # sd: by definition
    cached_models = []  # their graph states (CUDA) go back when the call ends, however it ends
    try:
        # The caches start with what the prompt and the first step write and grow with the tokens.
        first_slots = prompt_len + settings.k + 1
        target_model = _CachedModel(target, pad, capacity, use_graphs, slots=first_slots)
        cached_models.append(target_model)
        draft_model = (_CachedModel(draft, pad, capacity, use_graphs, role="draft", slots=first_slots)
                       if settings.speculative else None)
        cached_models += [draft_model] if draft_model is not None else []
        prefill_start = time.perf_counter()
        for cached, prompt in ((target_model, ids), (draft_model, settings.for_draft(ids))):
            if cached is not None:  # prefill all but the last token
                cached(prompt[:, :-1], keep=1, prefill=True)
                cached.cache.lengths.fill_(prompt_len)
        _wait_for_gpu(ids)  # the forwards do not wait for the GPU: the prefill's end does
        stats.prefill_seconds = time.perf_counter() - prefill_start
        stats.target_prefill_seconds = target_model.seconds

        if streamer is not None:
            streamer.put(input_ids.cpu())
        generated = _Decoder(settings, target_model, draft_model, ids, seeds, threshold, stats,
                             streamer).run()
        if streamer is not None:
            streamer.end()
    finally:
        for cached in cached_models:
            cached.release()

    width = max(len(g) for g in generated)
    new_part = torch.full((batch, width), pad_token_id, dtype=torch.int64)  # [B, N]
    for row, tokens_of_row in enumerate(generated):
        new_part[row, :len(tokens_of_row)] = torch.tensor(tokens_of_row, dtype=torch.int64)
    sequences = torch.cat([input_ids.cpu(), new_part], 1).to(device)  # [B, P + N]
    stats.target_forwards, stats.target_seconds = target_model.calls, target_model.seconds
    stats.capture_seconds = target_model.capture_seconds
    if draft_model is not None:
        stats.draft_forwards, stats.draft_seconds = draft_model.calls, draft_model.seconds
        stats.capture_seconds += draft_model.capture_seconds
    stats.seconds = time.perf_counter() - start - stats.diagnostics_seconds
    return GenerateOutput(sequences, stats)


def _settings(target, draft, rule, divergence, num_draft_tokens, temperature, top_k, top_p, min_p,
              div_temperature, max_new_tokens, eos_token_id, output_divergences,
              draft_length="fixed", draft_confidence=0.4, draft_cost=0.25) -> _Settings:
    speculative = rule != "ar"
    temperature = 0.0 if rule == "greedy" else float(temperature)
    sample_args = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    eos_ids = _as_ids(eos_token_id if eos_token_id is not None
                      else getattr(target.generation_config, "eos_token_id", None), "eos_token_id")
    draft_vocab = _vocab_size(draft) if speculative else 0
    return _Settings(
        rule=rule, k=int(num_draft_tokens) if speculative else 0, temperature=temperature,
        sample_args=sample_args,
        accept_args=dict(rule=rule, divergence=divergence, temperature=temperature,
                         div_temperature=div_temperature, **sample_args,
                         return_divergence=output_divergences),
        max_new_tokens=int(max_new_tokens), eos_ids=eos_ids, output_divergences=output_divergences,
        draft_vocab=draft_vocab if draft_vocab < _vocab_size(target) else 0,
        draft_length=draft_length, draft_confidence=float(draft_confidence),
        draft_cost=float(draft_cost))
