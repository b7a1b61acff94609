"""FSD behind Hugging Face `model.generate`: a function-style `custom_generate` for transformers 5.x.

    out = target.generate(input_ids, attention_mask=mask, custom_generate=fsd_ext.hf.generate,
                          draft_model=draft, fsd_rule="fsd", fsd_threshold=0.3, max_new_tokens=64)

transformers prepares the call as for its own decoding methods (the generation config merged from
the model's and the keyword arguments, the logits processors and stopping criteria it implies, the
attention mask) and then calls `generate` below with the target model and the prompts. `generate`
maps what it received onto `fsd_ext.generate` and runs that loop; whatever it cannot honour raises
ValueError instead of being dropped. docs/engines.md lists both.

Two things transformers 5.25 does not pass to a callable `custom_generate`, and how to get them in:
the `assistant_model` (give the draft as `draft_model=`) and the `streamer` (give it as
`fsd_streamer=`). The folder form (`CUSTOM_GENERATE_DIR`, loaded with `custom_generate=<folder>,
trust_remote_code=True`) receives generate's raw arguments, so there `assistant_model=` and
`streamer=` work as usual.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig
from transformers.generation import logits_process, stopping_criteria as criteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..decoding.draft_length import POLICIES
from ..decoding.checks import check_pair
from ..decoding.loop import generate as fsd_generate
from ..types import VerifyOptions

# Only 5.x was tested (5.25): 4.x is refused rather than run untested.
if Version(transformers.__version__) < Version("5"):
    raise ImportError(f"fsd_ext.hf needs transformers 5.x (tested with 5.25), found "
                      f"{transformers.__version__}; call fsd_ext.generate directly instead")

# The folder with custom_generate/generate.py (the trust_remote_code form).
CUSTOM_GENERATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_custom_generate")

# The sampling steps fsd_ext applies itself, in the order it applies them (docs/design.md 2.2-2.3),
# which is also the order transformers builds them in: temperature, top-k, top-p, min-p.
_WARPERS = (
    (logits_process.TemperatureLogitsWarper, "temperature"),
    (logits_process.TopKLogitsWarper, "top_k"),
    (logits_process.TopPLogitsWarper, "top_p"),
    (logits_process.MinPLogitsWarper, "min_p"),
)
_STOPPING = (criteria.MaxLengthCriteria, criteria.EosTokenCriteria)  # honoured via max/eos below
# Model kwargs transformers itself adds, or that change only how the target runs, not what it computes.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values",
                       "use_cache", "cache_position", "inputs_embeds"}
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _sampling_args(logits_processor, do_sample: bool) -> dict:
    """The logits processors transformers built -> fsd_ext's temperature/top_k/top_p/min_p. Any other
    processor (repetition penalty, bad words, a user's own, ...) changes the distributions in a way
    the fused kernels cannot reproduce, so it raises."""
    args = dict(temperature=1.0 if do_sample else 0.0, top_k=None, top_p=None, min_p=None)
    last = -1
    for processor in logits_processor or ():
        kind = next((i for i, (cls, _) in enumerate(_WARPERS) if type(processor) is cls), None)
        if kind is None:
            raise ValueError(
                f"fsd_ext.hf.generate cannot apply the logits processor {type(processor).__name__} "
                f"(set by a generate option such as repetition_penalty, no_repeat_ngram_size, "
                f"bad_words_ids, min_new_tokens, suppress_tokens, or passed in logits_processor): "
                f"only temperature, top_k, top_p and min_p are supported")
        name = _WARPERS[kind][1]
        if kind <= last:
            raise ValueError(f"logits_processor: {name} must come after the sampling steps "
                             f"before it; fsd_ext applies temperature, top_k, top_p, min_p in "
                             f"that order")
        if getattr(processor, "min_tokens_to_keep", 1) != 1:
            raise ValueError(f"{name}: min_tokens_to_keep must be 1, got "
                             f"{processor.min_tokens_to_keep}")
        last = kind
        if do_sample:  # under greedy, the argmax is all that counts and these do not move it
            args[name] = getattr(processor, name)
    return args


def _num_draft_tokens(fsd_num_draft_tokens, generation_config: GenerationConfig) -> int:
    """K: fsd_num_draft_tokens, else num_assistant_tokens when set to something other than the value
    transformers fills in when nobody set it (20, which would be far too many drafts), else 5."""
    if fsd_num_draft_tokens is not None:
        return fsd_num_draft_tokens
    default = GenerationConfig._get_default_generation_params().get("num_assistant_tokens")
    k = generation_config.num_assistant_tokens
    return k if k is not None and k != default else 5


# transformers' num_assistant_tokens_schedule -> draft_length. "heuristic_transient" restarts K at each
# generate call, which fsd_ext's per-row K does anyway.
_SCHEDULES = {None: "fixed", "constant": "fixed", "heuristic": "heuristic",
              "heuristic_transient": "heuristic"}


def _draft_length(fsd_draft_length, generation_config: GenerationConfig) -> str:
    """fsd_draft_length, else the one num_assistant_tokens_schedule names."""
    if fsd_draft_length is not None:
        if fsd_draft_length not in POLICIES:
            raise ValueError(f"fsd_draft_length must be one of {tuple(POLICIES)}, got {fsd_draft_length!r}")
        return fsd_draft_length
    schedule = getattr(generation_config, "num_assistant_tokens_schedule", None)
    if schedule not in _SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r} is not supported: "
                         f"'constant' or 'heuristic' (or fsd_draft_length=)")
    return _SCHEDULES[schedule]


def _check_request(model, input_ids, generation_config, stopping_criteria, model_kwargs,
                   draft_model, options: VerifyOptions, tokenizers):
    """Raise ValueError for any part of the request fsd_ext.generate would not honour."""
    options.check(name=lambda field: f"fsd_{field}")
    fsd_rule = options.rule
    if draft_model is None and fsd_rule != "ar":
        raise ValueError(f"fsd_rule={fsd_rule!r} needs a draft model: pass draft_model=<a causal LM "
                         f"sharing the target's tokenizer> (transformers does not hand "
                         f"assistant_model to a callable custom_generate)")
    if draft_model is not None:
        check_pair(model.config, draft_model.config, *tokenizers,
                   hint="; pass fsd_tokenizer= and fsd_draft_tokenizer= to compare the vocabularies")
    if model.config.is_encoder_decoder:
        raise ValueError("fsd_ext.hf.generate supports decoder-only models, not encoder-decoder ones")
    for option in _UNSUPPORTED_OUTPUTS:
        if getattr(generation_config, option, False):
            raise ValueError(f"{option}=True is not supported: fsd_ext.generate keeps no per-token "
                             f"scores, logits, attentions or hidden states to return")
    unknown = sorted(set(model_kwargs) - _KNOWN_MODEL_KWARGS)
    if unknown:  # fsd_ext.generate feeds its models ids, masks and positions only
        raise ValueError(f"fsd_ext.hf.generate cannot pass the model kwargs {unknown} to the models")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported: pass input_ids")
    for cache_name in ("cache", "past_key_values"):
        cache = model_kwargs.get(cache_name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise ValueError(f"{cache_name}: a pre-filled cache is not supported (fsd_ext.generate "
                             f"keeps its own static caches); pass the full prompt instead")
    for option, value in (("num_beams", generation_config.num_beams),
                          ("num_return_sequences", generation_config.num_return_sequences)):
        if value is not None and value > 1:
            raise ValueError(f"{option}={value} is not supported by fsd_ext.hf.generate (1 only)")
    for criterion in stopping_criteria or ():
        if not isinstance(criterion, _STOPPING):
            raise ValueError(
                f"fsd_ext.hf.generate cannot apply the stopping criterion "
                f"{type(criterion).__name__} (set by max_time, stop_strings or passed in "
                f"stopping_criteria): only max_length/max_new_tokens and eos_token_id stop a row")
    if generation_config.max_length is None or generation_config.max_length <= input_ids.shape[1]:
        raise ValueError(f"max_length ({generation_config.max_length}) must exceed the prompt "
                         f"length ({input_ids.shape[1]}): set max_new_tokens")


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
             generation_config: Optional[GenerationConfig] = None, synced_gpus: bool = False,
             streamer=None, *, draft_model=None, fsd_rule: str = "fsd", fsd_divergence: str = "js",
             fsd_threshold=0.3, fsd_num_draft_tokens: Optional[int] = None,
             fsd_div_temperature: Optional[float] = 1.0, fsd_seed=None, fsd_streamer=None,
             fsd_draft_length: Optional[str] = None, fsd_draft_cost: float = 0.25,
             fsd_tokenizer=None, fsd_draft_tokenizer=None, **model_kwargs):
    """The loop transformers runs for `model.generate(..., custom_generate=fsd_ext.hf.generate)`.

    Not meant to be called directly: transformers passes `model` (the target), `input_ids` [B, P]
    (left-padded), the logits processors, stopping criteria and generation config it prepared, and
    the model kwargs (attention_mask [B, P] among them). The fsd-specific keywords, given to
    model.generate:

        draft_model: the draft causal LM (same tokenizer; required unless fsd_rule="ar").
        fsd_rule: "fsd" (default), any rule of fsd_ext.RULES (docs/design.md 2.5), or "ar".
        fsd_divergence, fsd_threshold, fsd_div_temperature: the FSD test (fsd_ext.generate's
            divergence, threshold, div_temperature).
        fsd_num_draft_tokens: K, the most drafts per step (default: num_assistant_tokens if set,
            else 5).
        fsd_draft_length: fsd_ext.generate's draft_length, "fixed", "confidence", "heuristic" or
            "acceptance" (default: num_assistant_tokens_schedule, "constant" -> "fixed",
            "heuristic" -> "heuristic"); "confidence" stops a row's drafting below
            assistant_confidence_threshold. fsd_draft_cost: draft_cost of "acceptance".
        fsd_seed: int or [B] ints for fsd_ext's Philox streams (default: drawn from torch's
            generator, so torch.manual_seed makes a run reproducible).
        fsd_streamer: a streamer (put/end; batch 1), since transformers keeps `streamer` from a
            callable custom_generate.
        fsd_tokenizer, fsd_draft_tokenizer: the two tokenizers (transformers keeps `tokenizer` and
            `assistant_tokenizer` from a callable). Given both, every draft token must have the
            same id in the target's (fsd_ext.decoding.checks.check_tokenizers); otherwise the models'
            configs must agree on vocab_size and bos_token_id, which cannot tell a same-size
            vocabulary of other tokens apart. Either way a mismatch raises ValueError.

    From the generation config: max_length / max_new_tokens, eos_token_id, pad_token_id, and
    do_sample with temperature, top_k, top_p, min_p (do_sample=False is greedy). Everything else
    that would change the output raises ValueError (docs/engines.md).

    Returns:
        [B, P + N] LongTensor of the prompts and generated tokens (padded with pad_token_id after a
        row's end), or GenerateDecoderOnlyOutput(sequences=...) with return_dict_in_generate=True.

    Example:
        >>> enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        >>> out = target.generate(**enc, custom_generate=fsd_ext.hf.generate, draft_model=draft,
        ...                       fsd_threshold=0.3, do_sample=False, max_new_tokens=64)
        >>> tokenizer.batch_decode(out, skip_special_tokens=True)
    """
    if streamer is not None and fsd_streamer is not None:
        raise ValueError("pass the streamer once, as fsd_streamer")
    streamer = streamer if streamer is not None else fsd_streamer
    if generation_config is None:
        raise ValueError("generation_config is missing: call this through model.generate("
                         "..., custom_generate=fsd_ext.hf.generate)")
    options = VerifyOptions(fsd_rule, fsd_divergence, fsd_threshold, fsd_div_temperature)
    _check_request(model, input_ids, generation_config, stopping_criteria, model_kwargs,
                   draft_model, options, (fsd_tokenizer, fsd_draft_tokenizer))
    sampling = _sampling_args(logits_processor, bool(generation_config.do_sample))
    draft_length = _draft_length(fsd_draft_length, generation_config)
    confidence = getattr(generation_config, "assistant_confidence_threshold", None)
    eos = generation_config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else None)  # as transformers does
    out = fsd_generate(
        model, draft_model, input_ids, model_kwargs.get("attention_mask"), rule=fsd_rule,
        divergence=fsd_divergence, threshold=fsd_threshold,
        num_draft_tokens=_num_draft_tokens(fsd_num_draft_tokens, generation_config),
        div_temperature=fsd_div_temperature, **sampling, draft_length=draft_length,
        draft_confidence=0.4 if confidence is None else confidence, draft_cost=fsd_draft_cost,
        max_new_tokens=generation_config.max_length - input_ids.shape[1], eos_token_id=eos_ids,
        pad_token_id=pad, seed=fsd_seed, streamer=streamer)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=out.sequences)
    return out.sequences


def generate_from_raw_arguments(model, inputs=None, *, assistant_model=None, draft_model=None,
                                streamer=None, fsd_streamer=None, tokenizer=None,
                                assistant_tokenizer=None, **kwargs):
    """What the folder form (custom_generate/generate.py) runs. transformers hands a folder's
    function generate's own arguments unprepared, assistant_model, streamer, tokenizer and
    assistant_tokenizer included; this puts them where `generate` above reads them and runs
    model.generate with it."""
    if assistant_model is not None and draft_model is not None and assistant_model is not draft_model:
        raise ValueError("pass the draft once, as assistant_model or as draft_model")
    if streamer is not None and fsd_streamer is not None:
        raise ValueError("pass the streamer once, as streamer or as fsd_streamer")
    draft = draft_model if draft_model is not None else assistant_model
    # The class's generate: a model loaded with trust_remote_code may have its instance attribute
    # replaced by the folder's function, which would call back here.
    return type(model).generate(model, inputs, custom_generate=generate, draft_model=draft,
                                fsd_streamer=streamer if streamer is not None else fsd_streamer,
                                fsd_tokenizer=tokenizer, fsd_draft_tokenizer=assistant_tokenizer,
                                **kwargs)
