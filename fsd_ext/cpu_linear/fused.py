"""Fewer, larger ops per decoder layer for CPU decoding with int8-activation linear layers.

A decoding step of the 1.5B model ran ~40 torch ops per layer besides its products: about 10 ms of
a 37 ms forward went to dispatch and small ops. For the decoder layers of Qwen2 / Llama-style
models whose linear layers are all QuantInt8Linear (transformers 5), `fuse_decoder_layers(model)`
replaces, on each module instance:

- the attention's forward: q, k and v in one int8_linear_cat call (x quantised once, one parallel
  region), rotary embedding in place by one op (rotate_half_: transformers' arithmetic, same bits),
  the cache update as before, grouped_sdpa, o_proj;
- the MLP's forward: gate and up in one int8_linear_cat call, silu(gate) * up, down;
- RMSNorm's forward: F.rms_norm (one op; the same bits as the module's seven).

- the decoder layer's forward, where all of the above are patched and the cache hands out its
  buffers (fsd_ext.decoding.kv_cache.StaticKVCache.layer_buffers: the decoding loop's steps): the
  whole layer in one op, decoder_layer (csrc/cpu_linear/torch_int8.cpp), with no Python between its
  steps and its own RMSNorm and attention loops (csrc/cpu_linear/decode_ops.h: a token's result is
  the same among a verification's tokens as alone, which exact greedy SD relies on). Other caches
  (transformers' own) and prompts take the modules' path.

Everything else (embedding, the cache, masks, the output layer) is the model's own. The patched
modules give the unfused modules' results bit for bit; decoder_layer differs from them by float
rounding in its norms and attention (tests compare both).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from . import QuantInt8Linear
from .attention import grouped_sdpa

# RMSNorm classes that compute weight * (x / rms(x)) (Gemma's adds 1 to its weight: not here).
RMS_NORMS = {"Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"}


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32:
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _cat_args(layers):
    """(weights, formats, out_features, bias) of int8_linear_cat for QuantInt8Linear layers side by side."""
    biases = [layer.bias for layer in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(layer.out_features)
                          for b, layer in zip(biases, layers)]).detach()
    return ([layer.packed for layer in layers], [layer.format_id for layer in layers],
            [layer.out_features for layer in layers], bias)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    weights, formats, outs, bias = self._fsd_gate_up
    gate_up = torch.ops.fsd_cpu_linear.int8_linear_cat(x, weights, formats, outs, bias)
    gate, up = gate_up.split(outs, dim=-1)
    return self.down_proj(F.silu(gate) * up)


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    batch, steps, _ = hidden_states.shape
    heads, kv_heads, dim = self._fsd_heads
    weights, formats, outs, bias = self._fsd_qkv
    qkv = torch.ops.fsd_cpu_linear.int8_linear_cat(hidden_states, weights, formats, outs, bias)
    cos, sin = position_embeddings
    torch.ops.fsd_cpu_linear.rotate_half_(qkv, cos, sin, heads + kv_heads)
    query, key, value = (part.view(batch, steps, -1, dim).transpose(1, 2) for part in qkv.split(outs, dim=-1))
    cache = kwargs.pop("cache", None)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    out, _ = grouped_sdpa(self, query, key, value, attention_mask, scaling=self.scaling)
    return self.o_proj(out.reshape(batch, steps, heads * dim)), None


def _decoder_layer_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                           position_embeddings=None, **kwargs):
    attention = self.self_attn
    buffers = cache.layer_buffers(attention.layer_idx) if hasattr(cache, "layer_buffers") else None
    if (buffers is None or attention_mask is None or attention_mask.dtype != torch.float32
            or attention_mask.shape[-1] > buffers[0].shape[2] or hidden_states.dtype != torch.float32):
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, position_embeddings=position_embeddings, **kwargs)
    keys, values, slots = buffers
    heads, kv_heads, _ = attention._fsd_heads
    cos, sin = position_embeddings
    return torch.ops.fsd_cpu_linear.decoder_layer(
        hidden_states, self.input_layernorm.weight, self.post_attention_layernorm.weight,
        self.input_layernorm.variance_epsilon, *attention._fsd_qkv, attention.o_proj.packed,
        attention.o_proj.format_id, attention.o_proj.bias, *self.mlp._fsd_gate_up[:3], self.mlp.down_proj.packed,
        self.mlp.down_proj.format_id, self.mlp.down_proj.bias, cos, sin, keys, values, slots, attention_mask,
        heads, kv_heads, attention.scaling)


def _fusable_layer(layer) -> bool:
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    return ("forward" in getattr(layer, "self_attn", torch.nn.Module()).__dict__
            and "forward" in getattr(layer, "mlp", torch.nn.Module()).__dict__
            and getattr(layer.mlp, "_fsd_gate_up", (None,) * 4)[3] is None  # (no gate / up bias)
            and all(type(n).__name__ in RMS_NORMS and n.weight.dtype == torch.float32 for n in norms)
            and norms[0].variance_epsilon == norms[1].variance_epsilon)


def _fusable_attention(attention) -> bool:
    projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return (all(isinstance(p, QuantInt8Linear) for p in projections)
            and all(hasattr(attention, name) for name in ("head_dim", "scaling", "layer_idx", "config"))
            and len({p.in_features for p in projections[:3]}) == 1)


def _fusable_mlp(mlp) -> bool:
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, QuantInt8Linear) for p in projections)
            and getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu")


def fuse_decoder_layers(model: torch.nn.Module) -> int:
    """Patch the attention, MLP and RMSNorm modules of `model` (see the module docstring) in place;
    returns the number of modules patched (0 under transformers 4.x, whose attention modules call
    their cache another way)."""
    try:
        import transformers
    except ImportError:  # pragma: no cover
        return 0
    if int(transformers.__version__.split(".")[0]) < 5:
        return 0
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
            patched += 1
        elif name.endswith("Attention") and _fusable_attention(module):
            config = module.config
            heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
            module._fsd_heads = (heads, kv_heads or heads, module.head_dim)
            module._fsd_qkv = _cat_args([module.q_proj, module.k_proj, module.v_proj])
            module.forward = types.MethodType(_attention_forward, module)
            patched += 1
        elif name.endswith("MLP") and _fusable_mlp(module):
            module._fsd_gate_up = _cat_args([module.gate_proj, module.up_proj])
            module.forward = types.MethodType(_mlp_forward, module)
            patched += 1
    for module in model.modules():  # (after their attention and MLP modules)
        if type(module).__name__.endswith("DecoderLayer") and _fusable_layer(module):
            module.forward = types.MethodType(_decoder_layer_forward, module)
            patched += 1
    return patched
