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
per step. Rows keep their own lengths in a static KV cache (decoding/kv_cache.py); a row that emits EOS
or reaches max_new_tokens leaves the batch. On CUDA, each fixed-shape forward (the draft's one- and
two-token steps, the target's (K+1)-token verification) is captured in a CUDA graph once per batch
size and replayed; there the batch shrinks to powers of two only (stopped rows wait, parked, see
_Decoder), so a batch of B rows is captured for at most ceil(log2 B) + 1 sizes, and the graphs (with
the static cache they read) are kept for the next call (decoding/cuda_graphs.py).

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

import numbers
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from .. import ops, reference
from ..types import PURPOSE_ACCEPT
from .checks import OPS, as_ids, check_in_vocab, check_inputs, check_options, vocab_size
from .draft_length import POLICIES
from .model import CachedModel, wait_for_gpu
from .prompt_cache import PromptCache
from .stats import GenerateOutput, GenerateStats, RowCounts

_accept, _sample = OPS


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

    def __init__(self, settings: _Settings, target_model: CachedModel,
                 draft_model: Optional[CachedModel], ids: torch.Tensor, seeds: torch.Tensor,
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
            row = stats.rows[self.rows[j]]
            kept_drafts = min(n, len(new))  # accepted drafts past EOS / max_new_tokens are cut
            for tally in (stats, row):
                tally.new_tokens += len(new)
                tally.verifications += 1
                tally.accepted_drafts += kept_drafts
                if out.num_drafted is not None:  # (None for ar)
                    tally.drafted_tokens += out.num_drafted[j]
                if out.sd_rejects is not None:
                    tally.sd_rejected_accepted += sum(out.sd_rejects[j][:kept_drafts])
            if out.num_drafted is not None:
                self.policy.record(self.rows[j], n, out.num_drafted[j])
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
             draft_confidence: float = 0.4, draft_cost: float = 0.25,
             prompt_cache: Optional[PromptCache] = None) -> GenerateOutput:
    """Generate with the target model, drafting with the draft model (docs/design.md section 8).

    Args:
        target, draft: Hugging Face causal LMs on the same device with one tokenizer (draft
            vocabulary <= target vocabulary). `draft` may be None for rule="ar".
        input_ids: [B, P] int prompts, left-padded; attention_mask: [B, P] 0/1 (None = no padding).
        rule: "ar" (target alone), "greedy", "sd", "fsd" (default), "fsd_strict" or another
            lenient rule of fsd_ext.LENIENT_RULES (docs/design.md 2.5).
        divergence, threshold, div_temperature: the FSD test D_i < T (fsd, fsd_strict); the other
            lenient rules take their knob as threshold and read div_temperature's distributions.
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
        prompt_cache: a decoding.PromptCache: a prompt it holds for the same model object (the
            last max_prompts run with it) is not run again; its saved cache entries are loaded
            instead (same tokens; the forward still counts in target_forwards/draft_forwards, its
            time does not: stats.prefill_reused). For decoding one prompt under many settings.

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
    check_inputs(target, draft, input_ids, attention_mask, rule, threshold, streamer, max_new_tokens)
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
    check_in_vocab("pad_token_id", torch.tensor(pad_token_id), target)
    if prompt_cache is not None and not isinstance(prompt_cache, PromptCache):
        raise TypeError(f"prompt_cache must be a fsd_ext.decoding.PromptCache or None, "
                        f"got {type(prompt_cache).__name__}")
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
    stats.rows = [RowCounts(sd_rejected_accepted=stats.sd_rejected_accepted) for _ in range(batch)]
    cached_models = []  # their graph states (CUDA) go back when the call ends, however it ends
    try:
        # The caches start with what the prompt and the first step write and grow with the tokens.
        first_slots = prompt_len + settings.k + 1
        target_model = CachedModel(target, pad, capacity, use_graphs, slots=first_slots)
        cached_models.append(target_model)
        draft_model = (CachedModel(draft, pad, capacity, use_graphs, role="draft", slots=first_slots)
                       if settings.speculative else None)
        cached_models += [draft_model] if draft_model is not None else []
        prefill_start = time.perf_counter()
        for role, cached, prompt in (("target", target_model, ids),
                                     ("draft", draft_model, settings.for_draft(ids))):
            if cached is None:
                continue
            prompt = prompt[:, :-1]  # prefill all but the last token
            if prompt_cache is not None and prompt_cache.restore(role, cached, prompt):
                stats.prefill_reused = True
            else:
                cached(prompt, keep=1, prefill=True)
                if prompt_cache is not None:
                    prompt_cache.store(role, cached, prompt)
            cached.cache.lengths.fill_(prompt_len)
        wait_for_gpu(ids)  # the forwards do not wait for the GPU: the prefill's end does
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
    eos_ids = as_ids(eos_token_id if eos_token_id is not None
                      else getattr(target.generation_config, "eos_token_id", None), "eos_token_id")
    draft_vocab = vocab_size(draft) if speculative else 0
    return _Settings(
        rule=rule, k=int(num_draft_tokens) if speculative else 0, temperature=temperature,
        sample_args=sample_args,
        accept_args=dict(rule=rule, divergence=divergence, temperature=temperature,
                         div_temperature=div_temperature, **sample_args,
                         return_divergence=output_divergences),
        max_new_tokens=int(max_new_tokens), eos_ids=eos_ids, output_divergences=output_divergences,
        draft_vocab=draft_vocab if draft_vocab < vocab_size(target) else 0,
        draft_length=draft_length, draft_confidence=float(draft_confidence),
        draft_cost=float(draft_cost))
