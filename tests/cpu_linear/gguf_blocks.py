"""Random GGUF blocks for the CPU linear tests: valid raw data of any supported type, of about a
model's size or of any size."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
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
