"""The decoding loop: autoregressive (AR), speculative (SD) and fuzzy speculative (FSD) decoding with
any pair of Hugging Face causal LMs that share a tokenizer.

One step of speculative decoding, per batch row (DESIGN.md section 2):

    1. draft:  K one-token forwards of the draft model, each drawing d_i ~ q_i with fsd_ext.sample
               (argmax under greedy); after a step where a row accepted all its drafts, the first
               forward also re-reads the last committed token (see below). When fewer than K+1
               tokens remain to max_new_tokens for every row, the step drafts only what can be kept.
    2. verify: one forward of the target over [pending, d_0 .. d_{K-1}] -> logits for K+1 positions.
    3. accept: one fsd_ext.accept call -> n accepted drafts plus one correction/bonus token.
    4. commit: each row keeps pending + its n accepted drafts in the target cache by setting its
               length; the rejected positions are simply past that length (no prefix is re-run).
               The emitted token becomes the row's new `pending` token, which no model has seen yet.

rule="ar" runs the target alone through the same loop: one one-token forward and one fsd_ext.sample
per step. Rows keep their own lengths in a static KV cache (fsd_ext.kv_cache); a row that emits EOS
or reaches max_new_tokens leaves the batch. On CUDA, each fixed-shape forward (the draft's one- and
two-token steps, the target's (K+1)-token verification) is captured once in a CUDA graph and
replayed.

Why the draft may re-read one token: after a step that accepted all K drafts, d_{K-1} was never fed
to the draft. Instead of a ragged catch-up call, the next step then rolls every row of the draft's
cache back by one and feeds [last committed token, pending] as one two-token forward (rows that were
not behind just rewrite an entry with the same token). Otherwise the first forward is [pending].

Randomness: row b draws from Philox with its own seed (`seed + b` for an int seed, or the given [B]
tensor), keyed by the step counter, so the output is a function of the seed alone and a row's
tokens do not depend on the other rows in the batch.
"""

from __future__ import annotations

import inspect
import numbers
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from . import ops, reference
from .cpu_linear import skinny_cpu_linears as skinny_linears_during
from .kv_cache import StaticKVCache
from .types import DIVERGENCES, PURPOSE_ACCEPT, RULES

# The two ops the loop uses: the compiled kernels, or the pure-torch reference with the same contract
# when the extension is not built. Switching is this one line.
_accept, _sample = (ops.accept, ops.sample) if ops._IMPORT_ERROR is None else (reference.accept,
                                                                               reference.sample)

GENERATE_RULES = ("ar",) + RULES


@dataclass
class GenerateStats:
    """What a generate() call did. Counts are of model calls (one call = one forward of the batch)."""

    rule: str
    num_draft_tokens: int
    new_tokens: int = 0  # generated tokens, all rows together
    seconds: float = 0.0  # wall time of the whole call, less diagnostics_seconds
    diagnostics_seconds: float = 0.0  # counting sampled SD rejections (output_divergences=True)
    prefill_seconds: float = 0.0  # the prompt forwards of both models (inside seconds)
    target_forwards: int = 0  # prefill included
    target_seconds: float = 0.0
    draft_forwards: int = 0
    draft_seconds: float = 0.0
    verifications: int = 0  # target verification calls x rows verified (row-steps)
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
        """Tokens/s without the prompt forwards (which dominate short outputs on a CPU)."""
        seconds = self.seconds - self.prefill_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean drafts accepted per row and target call (0..K; the correction/bonus not counted)."""
        return self.accepted_drafts / self.verifications if self.verifications else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Mean tokens a row gains per target call (mean_accepted + 1 until rows stop early)."""
        return self.new_tokens / self.verifications if self.verifications else 0.0

    def summary(self) -> str:
        return (f"{self.rule}: {self.new_tokens} tokens in {self.seconds:.2f} s = "
                f"{self.tokens_per_second:.2f} tokens/s, {self.tokens_per_target_call:.2f} tokens and "
                f"{self.mean_accepted:.2f} accepted drafts per target call "
                f"(target {self.target_forwards} calls {self.target_seconds:.2f} s, "
                f"draft {self.draft_forwards} calls {self.draft_seconds:.2f} s)")


@dataclass
class GenerateOutput:
    """sequences: [B, P + N] int64, the (left-padded) prompts then the generated tokens, padded with
    the pad id after a row's EOS or last token. stats: GenerateStats."""

    sequences: torch.Tensor
    stats: GenerateStats


# ----------------------------------------------------------------------------------------------
# One model with its static cache.

class _CudaGraphForward:
    """One captured forward of S tokens per row; replay reads the cache's live lengths."""

    def __init__(self, forward, input_ids: torch.Tensor, keep: int):
        self.input_ids = input_ids.clone()  # [B, S] static input buffer
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (lazy allocations, kernel selection)
            for _ in range(2):
                forward(self.input_ids, keep)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = forward(self.input_ids, keep)  # [B, keep, V] static output buffer

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return self.logits.clone()


class _CachedModel:
    """A Hugging Face causal LM, its StaticKVCache, its captured graphs and its call counters."""

    def __init__(self, model, pad: torch.Tensor, capacity: int, use_graphs: bool):
        self.model = model
        self.cache = StaticKVCache(pad, capacity)
        self.use_graphs = use_graphs
        self.graphs = {}  # (num_tokens, keep) -> _CudaGraphForward
        self.calls, self.seconds = 0, 0.0
        self.dtype = next(model.parameters()).dtype
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # 5.x : 4.5x
        self.pass_cache_position = "cache_position" in params  # 4.5x: else it asks the cache
        self.keep_arg = next((name for name in ("logits_to_keep", "num_logits_to_keep")
                              if name in params), None)

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
        start = time.perf_counter()
        if self.use_graphs and not prefill:
            key = (input_ids.shape[1], keep)
            if key not in self.graphs:
                self.graphs[key] = _CudaGraphForward(self._forward, input_ids, keep)
            logits = self.graphs[key](input_ids)
        else:
            logits = self._forward(input_ids, keep)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows`; the captured graphs (fixed batch size) are dropped."""
        self.cache.select(rows)
        self.graphs.clear()


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


def _as_ids(value, name: str) -> List[int]:
    if value is None:
        return []
    values = value.tolist() if isinstance(value, torch.Tensor) else value
    values = [values] if isinstance(values, numbers.Integral) else list(values)
    if not all(isinstance(v, numbers.Integral) for v in values):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    return [int(v) for v in values]


def _check_args(target, draft, input_ids, attention_mask, rule, divergence, threshold,
                num_draft_tokens, temperature, max_new_tokens, use_cuda_graphs, streamer,
                skinny_cpu_linears):
    if rule not in GENERATE_RULES:
        raise ValueError(f"rule must be one of {GENERATE_RULES}, got {rule!r}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
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
    if not isinstance(num_draft_tokens, numbers.Integral) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, numbers.Real) or not temperature >= 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    if isinstance(threshold, torch.Tensor):
        if threshold.shape != (input_ids.shape[0],) or not threshold.is_floating_point() \
                or (threshold < 0).any():
            raise ValueError(f"threshold must be a float >= 0 or a [B] float tensor >= 0")
    elif not isinstance(threshold, numbers.Real) or not threshold >= 0:
        raise ValueError(f"threshold must be a float >= 0, got {threshold!r}")
    if use_cuda_graphs not in ("auto", True, False):
        raise ValueError(f"use_cuda_graphs must be 'auto', True or False, got {use_cuda_graphs!r}")
    if skinny_cpu_linears not in ("auto", True, False):
        raise ValueError(f"skinny_cpu_linears must be 'auto', True or False, "
                         f"got {skinny_cpu_linears!r}")
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

@torch.no_grad()
def generate(target, draft, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             *, rule: str = "fsd", divergence: str = "js",
             threshold: Union[float, torch.Tensor] = 0.3, num_draft_tokens: int = 5,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             min_p: Optional[float] = None, div_temperature: Optional[float] = 1.0,
             max_new_tokens: int = 256, eos_token_id: Union[int, Sequence[int], None] = None,
             pad_token_id: Optional[int] = None, seed=None, use_cuda_graphs="auto", streamer=None,
             output_divergences: bool = False, skinny_cpu_linears="auto") -> GenerateOutput:
    """Generate with the target model, drafting with the draft model (DESIGN.md section 2).

    Args:
        target, draft: Hugging Face causal LMs on the same device with one tokenizer (draft
            vocabulary <= target vocabulary). `draft` may be None for rule="ar".
        input_ids: [B, P] int prompts, left-padded; attention_mask: [B, P] 0/1 (None = no padding).
        rule: "ar" (target alone), "greedy", "sd", "fsd" (default) or "fsd_strict".
        divergence, threshold, div_temperature: the FSD test D_i < T (fsd, fsd_strict).
        num_draft_tokens: K drafts per verification.
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
        skinny_cpu_linears: "auto" (on for CPU), True or False: compute the models' few-row float32 and bfloat16
            linears the faster way during this call (fsd_ext.cpu_linear; same math, other float
            rounding than stock F.linear); the models are restored on return.

    Returns:
        GenerateOutput(sequences [B, P + N] int64, stats GenerateStats).

    Example:
        >>> out = fsd_ext.generate(target, draft, ids, mask, rule="fsd", threshold=0.3, seed=0)
        >>> print(tokenizer.batch_decode(out.sequences), out.stats.summary())
    """
    _check_args(target, draft, input_ids, attention_mask, rule, divergence, threshold,
                num_draft_tokens, temperature, max_new_tokens, use_cuda_graphs, streamer,
                skinny_cpu_linears)
    start = time.perf_counter()
    device = next(target.parameters()).device
    fast_linears = device.type == "cpu" if skinny_cpu_linears == "auto" else bool(skinny_cpu_linears)
    with skinny_linears_during(target, draft if rule != "ar" else None, enabled=fast_linears):
        batch, prompt_len = input_ids.shape
        speculative = rule != "ar"
        k = int(num_draft_tokens) if speculative else 0
        temperature = 0.0 if rule == "greedy" else float(temperature)
        use_graphs = device.type == "cuda" if use_cuda_graphs == "auto" else bool(use_cuda_graphs)
        if use_graphs and device.type != "cuda":
            raise ValueError("use_cuda_graphs=True needs the models on a CUDA device")
        eos_ids = _as_ids(eos_token_id if eos_token_id is not None
                          else getattr(target.generation_config, "eos_token_id", None), "eos_token_id")
        if pad_token_id is None:
            pad_token_id = getattr(target.generation_config, "pad_token_id", None)
            pad_token_id = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
        seeds = _row_seeds(seed, batch).to(device)  # [B]
        sample_args = dict(top_k=top_k, top_p=top_p, min_p=min_p)
        accept_args = dict(rule=rule, divergence=divergence, temperature=temperature,
                           div_temperature=div_temperature, **sample_args,
                           return_divergence=output_divergences)
        if isinstance(threshold, torch.Tensor):
            threshold = threshold.to(device, torch.float32)  # [B] per-row thresholds

        # One extra padding slot in front of every row (never attended to), so that the prefill of all
        # but the last prompt token is never empty and `last_committed` always exists.
        input_ids = input_ids.to(device, torch.int64)
        prompt_mask = (torch.ones_like(input_ids) if attention_mask is None
                       else attention_mask.to(device, torch.int64))  # [B, P]
        pad = 1 + (prompt_mask == 0).sum(1)  # [B] leading padding slots per row
        ids = torch.cat([torch.full_like(input_ids[:, :1], pad_token_id), input_ids], 1)  # [B, P+1]
        capacity = prompt_len + 1 + max_new_tokens + k + 1

        stats = GenerateStats(rule=rule, num_draft_tokens=k, accepted_histogram=[0] * (k + 1),
                              divergences=[] if output_divergences else None)
        models = [_CachedModel(target, pad, capacity, use_graphs)]
        if speculative:
            models.append(_CachedModel(draft, pad, capacity, use_graphs))
        target_model = models[0]
        draft_model = models[1] if speculative else None
        # A smaller draft vocabulary can't read the target-only ids the target may emit: the draft sees
        # id 0 instead (this only changes what it proposes; the target still verifies every token).
        draft_vocab = _vocab_size(draft) if speculative else 0
        for_draft = (lambda t: t.masked_fill(t >= draft_vocab, 0)) if speculative and \
            draft_vocab < _vocab_size(target) else (lambda t: t)
        prefill_start = time.perf_counter()
        for cached, prompt in zip(models, (ids, for_draft(ids))):  # prefill all but the last token
            cached(prompt[:, :-1], keep=1, prefill=True)
            cached.cache.lengths.fill_(prompt_len)
        stats.prefill_seconds = time.perf_counter() - prefill_start
        sampling = temperature > 0.0 and rule != "greedy"
        count_sd_rejections = speculative and (not sampling or (output_divergences and rule != "sd"))
        if count_sd_rejections or rule == "sd":
            stats.sd_rejected_accepted = 0  # sd: by definition

        pending = ids[:, -1].clone()  # [B] the last token, not yet seen by any model
        last_committed = ids[:, -2].clone()  # [B] the token before it (re-read by the draft)
        rows = list(range(batch))  # original row index of each active batch row
        generated: List[List[int]] = [[] for _ in range(batch)]
        if streamer is not None:
            streamer.put(input_ids.cpu())

        step, draft_behind = 0, False
        while rows:
            num_rows = len(rows)
            sd_reject_rows = None
            if not speculative:
                logits = target_model(pending[:, None], keep=1)[:, 0]  # [B, V_t]
                emitted = _sample(logits.float(), temperature, **sample_args, seed=seeds,
                                  offset=step).to(device)  # [B]
                tokens, num_accepted = emitted[:, None], torch.zeros_like(emitted)  # [B, 1], [B]
                target_model.cache.lengths += 1
            else:
                # 1. Draft K tokens, one forward each; the first also re-reads the last committed token
                #    when the draft is one behind (some row accepted all its drafts last step). Near
                #    max_new_tokens, draft only what the neediest row can still keep (>= 1 draft).
                #    Row b uses num_draft[b] of them (its own cap), so its tokens do not depend on
                #    the other rows of the batch.
                row_caps = [max(1, min(k, max_new_tokens - len(generated[row]) - 1)) for row in rows]
                k_step = max(row_caps)
                num_draft = (torch.tensor(row_caps, dtype=torch.int64, device=device)
                             if min(row_caps) < k_step else None)  # [B] or None (all k_step)
                if draft_behind:
                    draft_model.cache.lengths.copy_(target_model.cache.lengths - 1)
                    draft_input = torch.stack([last_committed, pending], 1)  # [B, 2]
                else:
                    draft_model.cache.lengths.copy_(target_model.cache.lengths)
                    draft_input = pending[:, None]  # [B, 1]
                draft_logits, drafts = [], []
                for i in range(k_step):
                    logits = draft_model(for_draft(draft_input), keep=1)[:, 0].float()  # [B, V_d]
                    draft_model.cache.lengths += draft_input.shape[1]
                    token = _sample(logits, temperature, **sample_args, seed=seeds,
                                    offset=step * k + i).to(device)  # [B]
                    draft_logits.append(logits)
                    drafts.append(token)
                    draft_input = token[:, None]  # [B, 1]
                draft_logits = torch.stack(draft_logits, 1)  # [B, k_step, V_d]
                drafts = torch.stack(drafts, 1)  # [B, k_step]

                # 2. Verify: the target reads pending and the K drafts in one forward.
                verify_input = torch.cat([pending[:, None], drafts], 1)  # [B, K+1]
                target_logits = target_model(verify_input, keep=k_step + 1).float()  # [B, k_step+1, V_t]

                # 3. Accept: one fused call.
                result = _accept(target_logits, draft_logits, drafts, threshold=threshold,
                                 num_draft=num_draft, **accept_args, seed=seeds, offset=step)
                tokens = result.tokens.to(device)  # [B, k_step+1]
                num_accepted = result.num_accepted.to(device)  # [B]
                if not bool(result.valid.all()):
                    bad = [rows[j] for j in (~result.valid).nonzero()[:, 0].tolist()]
                    raise RuntimeError(f"the target or draft logits of row(s) {bad} hold NaN or no "
                                       f"finite value at step {step}")
                if output_divergences:
                    stats.divergences.append(result.divergence.cpu())
                # Which drafts SD would have rejected ([B][K] bools, read only where accepted);
                # the sampled count is a diagnostic, timed apart.
                diagnostics_start = time.perf_counter()
                sd_reject_rows = _sd_rejects(target_logits[:, :k_step], draft_logits, drafts,
                                             temperature if sampling else 0.0, sample_args, seeds,
                                             step).tolist() if count_sd_rejections else None
                if sampling and count_sd_rejections:
                    stats.diagnostics_seconds += time.perf_counter() - diagnostics_start

                # 4. Commit pending + the accepted drafts; the emitted token is the new pending one.
                target_model.cache.lengths += num_accepted + 1
                arange = torch.arange(num_rows, device=device)
                last_committed = torch.where(num_accepted > 0,
                                             drafts[arange, (num_accepted - 1).clamp_min(0)], pending)
            pending = tokens[torch.arange(num_rows, device=device), num_accepted]  # [B]
            if (pending < 0).any():
                raise RuntimeError(f"the logits hold NaN or no finite value at step {step}")
            step += 1

            # Host bookkeeping: append each row's new tokens, stop rows at EOS or max_new_tokens.
            keep_rows = []
            counts = num_accepted.tolist()
            for j, (row_tokens, n) in enumerate(zip(tokens.tolist(), counts)):
                row = rows[j]
                new = row_tokens[:n + 1][:max_new_tokens - len(generated[row])]
                stop = next((i for i, t in enumerate(new) if t in eos_ids), None)
                if stop is not None:
                    new = new[:stop + 1]
                generated[row].extend(new)
                stats.new_tokens += len(new)
                stats.verifications += 1
                kept_drafts = min(n, len(new))  # accepted drafts past EOS / max_new_tokens are cut
                stats.accepted_drafts += kept_drafts
                if sd_reject_rows is not None:
                    stats.sd_rejected_accepted += sum(sd_reject_rows[j][:kept_drafts])
                stats.accepted_histogram[n] += 1
                if streamer is not None and new:
                    streamer.put(torch.tensor(new))
                if stop is None and len(generated[row]) < max_new_tokens:
                    keep_rows.append(j)
            # Only a row that used and accepted all k_step drafts left d_{k_step-1} unread.
            draft_behind = speculative and any(counts[j] == k_step for j in keep_rows)
            if len(keep_rows) < num_rows:  # finished rows leave the batch (and the caches)
                keep = torch.tensor(keep_rows, dtype=torch.int64, device=device)  # [B']
                rows = [rows[j] for j in keep_rows]
                for cached in models:
                    cached.select(keep)
                pending, last_committed, seeds = pending[keep], last_committed[keep], seeds[keep]
                if isinstance(threshold, torch.Tensor):
                    threshold = threshold[keep]

        if streamer is not None:
            streamer.end()
        width = max(len(g) for g in generated)
        new_part = torch.full((batch, width), pad_token_id, dtype=torch.int64)  # [B, N]
        for row, tokens_of_row in enumerate(generated):
            new_part[row, :len(tokens_of_row)] = torch.tensor(tokens_of_row, dtype=torch.int64)
        sequences = torch.cat([input_ids.cpu(), new_part], 1).to(device)  # [B, P + N]

        stats.target_forwards, stats.target_seconds = target_model.calls, target_model.seconds
        if draft_model is not None:
            stats.draft_forwards, stats.draft_seconds = draft_model.calls, draft_model.seconds
        stats.seconds = time.perf_counter() - start - stats.diagnostics_seconds
        return GenerateOutput(sequences, stats)
