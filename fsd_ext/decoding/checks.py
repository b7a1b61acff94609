"""generate()'s argument checks: those no model is needed for (check_options, which the command
line runs before it loads anything), those of the models and inputs (check_inputs), and whether a
draft shares the target's tokenizer (check_pair, used by fsd_ext.hf and fsd_ext.vllm too)."""

from __future__ import annotations

import numbers
from typing import List, Optional

import torch

from .. import ops, reference
from ..types import RULES, VerifyOptions
from .draft_length import POLICIES

# The ops the loop uses: the compiled kernels, or the pure-torch reference with the same contract
# when the extension is not built.
OPS = (ops.accept, ops.sample) if ops._IMPORT_ERROR is None else (reference.accept, reference.sample)
_dry_run_accept = OPS[0]  # check_options' one-row call: apart from the loop's, which tests spy on


def vocab_size(model) -> int:
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


def as_ids(value, name: str) -> List[int]:
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
    VerifyOptions(rule, divergence, threshold, div_temperature).check()
    if draft_length not in POLICIES:
        raise ValueError(f"draft_length must be one of {tuple(POLICIES)}, got {draft_length!r}")
    if isinstance(draft_confidence, bool) or not isinstance(draft_confidence, numbers.Real) \
            or not 0.0 <= draft_confidence <= 1.0:
        raise ValueError(f"draft_confidence must be a float in [0, 1], got {draft_confidence!r}")
    if isinstance(draft_cost, bool) or not isinstance(draft_cost, numbers.Real) \
            or not draft_cost > 0.0 or draft_cost == float("inf"):
        raise ValueError(f"draft_cost must be a finite float > 0, got {draft_cost!r}")
    if not _is_int(num_draft_tokens) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature >= 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
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


def check_in_vocab(name: str, ids: torch.Tensor, model) -> None:
    """Ids the model's embedding will read must lie in its vocabulary (on CUDA the embedding would
    kill the process)."""
    low, high, vocab = int(ids.min()), int(ids.max()), vocab_size(model)
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


def check_inputs(target, draft, input_ids, attention_mask, rule, threshold, streamer, max_new_tokens):
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
    check_in_vocab("input_ids", input_ids, target)
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
        if vocab_size(draft) > vocab_size(target):
            raise ValueError(f"draft vocabulary ({vocab_size(draft)}) must not be larger than the "
                             f"target's ({vocab_size(target)}): the models must share a tokenizer")
        device = next(target.parameters()).device
        if next(draft.parameters()).device != device:
            raise ValueError(f"target and draft must be on the same device "
                             f"({device} vs {next(draft.parameters()).device})")
