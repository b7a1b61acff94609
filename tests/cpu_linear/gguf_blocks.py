"""Random GGUF data for the CPU linear tests: valid raw blocks of any supported type (of about a
model's size or of any size), and tiny Qwen2 / Llama models with a GGUF file holding exactly their
linear weights."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType

# Byte offsets of each type's float16 fields (set to finite values; every other bit pattern of a
# block is a valid block).
FLOAT16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q6_K": (208,)}


# A byte of the first block holding (the low bits of) one code.
CODE_BYTE = {"Q4_0": 5, "Q4_1": 7, "Q4_K": 20, "Q5_0": 10, "Q8_0": 10, "Q6_K": 3}


# float16 fields of this size give weights of about a model's size (std ~0.01-0.05).
MODEL_SIZED = {"Q4_0": 0.01, "Q4_1": 0.01, "Q4_K": 2e-4, "Q5_0": 5e-3, "Q8_0": 5e-4, "Q6_K": 3e-5}


def random_blocks(type_name: str, rows: int, in_features: int, seed: int = 0, field_max: float = 0.05) -> np.ndarray:
    """Random raw data of a [rows, in_features] matrix of `type_name`, as GGUFReader returns it
    (its float16 fields uniform in +-field_max)."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[QT[type_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * in_features // block_weights, block_bytes), dtype=np.uint8)
    for start in FLOAT16_FIELDS[type_name]:
        values = rng.uniform(-field_max, field_max, size=blocks.shape[0]).astype(np.float16)
        blocks[:, start:start + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, with -0.0 as +0.0 (gguf-py's d * (q - 8) is -0.0 for a negative d where the
    kernel's fma(q, d, -8d) is +0.0: the same value in every sum and product)."""
    return (np.ascontiguousarray(a, dtype=np.float32) + np.float32(0.0)).view(np.uint32)


# ----------------------------------------------------------------------------------------------
# Models: a tiny random model and a GGUF file written to hold exactly its weights.

QWEN_TYPES = {"q_proj": "Q4_K", "k_proj": "Q6_K", "v_proj": "Q8_0", "o_proj": "Q4_0",
              "gate_proj": "Q4_1", "up_proj": "Q5_0", "down_proj": "Q4_K"}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    return model.eval()


def llama_cpp_row_order(out: int, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order of q / k (HF row index of each GGUF row)."""
    return np.arange(out).reshape(heads, 2, out // heads // 2).swapaxes(1, 2).reshape(-1)


def write_gguf(model, arch: str, path, *, permute: bool = True, f16_layer: str = "model.layers.1.mlp.up_proj",
               types=None):
    """Write a GGUF file whose tensors hold model's linear weights in the types of QWEN_TYPES (the
    output layer Q6_K; `f16_layer` as F16), and set the model's weights to the file's values."""
    writer = gguf.GGUFWriter(str(path), arch)
    config = model.config
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name == "lm_head":
            if config.tie_word_embeddings:
                continue  # the file holds token_embd only (written below)
            gguf_name, type_name = "output.weight", "Q6_K"
        else:
            layer, kind = name.split(".")[2], name.split(".")[-1]
            gguf_name, type_name = f"blk.{layer}.{GGUF_NAMES[kind]}.weight", (types or QWEN_TYPES)[kind]
        out, in_features = module.weight.shape
        if name == f16_layer:
            weight = module.weight.detach().numpy().astype(np.float16)
            writer.add_tensor(gguf_name, weight)
            module.weight.data = torch.from_numpy(weight.astype(np.float32))
            continue
        raw = random_blocks(type_name, out, in_features, seed=zlib.crc32(name.encode()),
                            field_max=MODEL_SIZED[type_name])
        weight = gguf.quants.dequantize(raw, QT[type_name])
        if arch == "llama" and permute and name.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
            weight = weight[llama_cpp_row_order(out, heads).argsort()]  # the HF rows of the file's
        writer.add_tensor(gguf_name, raw, raw_dtype=QT[type_name])
        module.weight.data = torch.from_numpy(np.ascontiguousarray(weight))
    if config.tie_word_embeddings:
        raw = random_blocks("Q4_K", config.vocab_size, config.hidden_size, seed=7, field_max=MODEL_SIZED["Q4_K"])
        writer.add_tensor("token_embd.weight", raw, raw_dtype=QT.Q4_K)
        model.get_input_embeddings().weight.data = torch.from_numpy(gguf.quants.dequantize(raw, QT.Q4_K))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_checkpoint_gguf(model, arch: str, path):
    """A GGUF file with model's config and every parameter (2-D weights as Q8_0, the rest F32),
    named by gguf-py's map, as llama.cpp's converter would write it (llama: q / k rows permuted)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module, _, kind = name.rpartition(".")
        weight = tensor.numpy()
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            weight = weight[llama_cpp_row_order(weight.shape[0], heads)]
        gguf_name = f"{name_map.get_name(module)}.{kind}"
        if weight.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
