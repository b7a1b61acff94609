"""A GGUF checkpoint's own quantised linear weights for CPU decoding (cpu_linear.QuantWeightLinear).

A GGUF file stores most linear layers as small integer codes with a float16-derived scale (and
offset) per group of 16 or 32 consecutive weights: every weight is `code * scale + offset`, one
rounding from exact. Transformers dequantises them to float32 on load, so a model read from a GGUF
file and decoded in float32 (or rounded to bfloat16) streams 4 (2) bytes per weight from memory for
what the file holds in 4.5-8.5 bits. `load_gguf_linear_weights(model, path)` reads the file's codes
again and swaps each nn.Linear whose weight they give for a QuantWeightLinear holding them repacked
(csrc/cpu_linear/quant_gemm.h): 0.75 bytes per weight for the 4-bit types, 1.125 for Q5_0 and Q8_0,
1.25 for Q6_K, and the very float32 weights the model had (checked to the bit against the module's weight before
the swap; a layer that differs, or whose type is not below, keeps its module).

    GGUF type   per block           weight                          repacked as
    Q4_0        32: d, 4-bit q      d (q - 8)                       Q4 (code q, scale d, offset -8d)
    Q4_1        32: d, m, 4-bit q   d q + m                         Q4
    Q4_K        256: d, dmin, 8 x   (d sc_j) q - (dmin m_j)         Q4 (32-weight groups)
                (6-bit sc_j, m_j)
    Q5_0        32: d, 5-bit q      d (q - 16)                      Q8G32 (code q - 16)
    Q8_0        32: d, int8 q       d q                             Q8G32
    Q6_K        256: d, 16 x int8   (d sc_j) (q - 32)               Q8 (16-weight groups)
                sc_j, 6-bit q

In each case the product of the code and the scale is exact in float32 (d and dmin are float16
values, sc_j and m_j small integers), so `fma(code, scale, offset)`, which the kernel computes,
rounds once, as transformers' numpy dequantisation (gguf.quants) does: the same float32 weight.
tests/cpu_linear/test_gguf_weights.py checks every type against gguf.quants.dequantize bit for bit.

Tensor names follow gguf-py's HF <-> GGUF name map for the file's architecture; for `llama` files
the q/k projections' rows are reordered back as transformers does on load (llama.cpp's converter
permutes them for its rotary layout).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

GROUP = {"q4": 32, "q8": 16, "q8g32": 32}  # weights per scale in the repacked formats (quant_gemm.h)


@dataclass
class Unpacked:
    """One weight matrix [out, in] as codes and per-group scales (and offsets, q4 only)."""

    format: str                      # "q4" (codes 0..15), "q8" / "q8g32" (signed codes)
    codes: np.ndarray                # [out, in] uint8 (q4) / int8 (q8, q8g32)
    scales: np.ndarray               # [out, in // GROUP[format]] float32
    offsets: Optional[np.ndarray]    # [out, in // 32] float32 (q4), None (q8, q8g32)

    def dequantize(self, rows: slice = slice(None)) -> np.ndarray:
        """The float32 weights of `rows`: code * scale (+ offset), with one rounding (exact product)."""
        group = GROUP[self.format]
        codes = self.codes[rows].astype(np.float32)
        weights = codes * np.repeat(self.scales[rows], group, axis=1)
        if self.offsets is not None:
            weights += np.repeat(self.offsets[rows], group, axis=1)
        return weights


# ----------------------------------------------------------------------------------------------
# GGUF blocks -> codes, scales, offsets. `blocks` is [n, block bytes] uint8 (a matrix's blocks
# row after row); each function returns codes [n, block weights] and [n, groups] scales / offsets.

def _float16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte `start` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: the low nibbles, then the high ones (ggml's 32-weight order)."""
    return np.concatenate([packed & 15, packed >> 4], axis=1)


def _q4_0(blocks):
    d = _float16(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, -8.0 * d


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:20]), _float16(blocks, 0), _float16(blocks, 2)


def _k_scales(packed: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> the eight 6-bit scales and mins: entries 0-3 in the low six bits of bytes
    0-3 / 4-7; entries 4-7 in the nibbles of bytes 8-11, their top two bits in the top bits of
    bytes 0-3 / 4-7."""
    first, second, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([first & 63, (rest & 15) | ((first >> 6) << 4)], axis=1)
    minimum = np.concatenate([second & 63, (rest >> 4) | ((second >> 6) << 4)], axis=1)
    return scale.astype(np.float32), minimum.astype(np.float32)


def _q4_k(blocks):
    d, dmin = _float16(blocks, 0), _float16(blocks, 2)
    scale, minimum = _k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # four chunks: low nibbles = group 2c, high = 2c + 1
    codes = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    return codes, d * scale, -(dmin * minimum)


def _q5_0(blocks):
    high = np.ascontiguousarray(blocks[:, 2:6]).view("<u4")  # [n, 1]: bit j = the fifth bit of weight j
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    codes = (_nibbles(blocks[:, 6:22]) | (bits << 4)).astype(np.int8) - np.int8(16)
    return codes, _float16(blocks, 0), None


def _q8_0(blocks):
    codes = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8)
    return codes, _float16(blocks, 0), None


def _q6_k(blocks):
    low, high = blocks[:, 0:128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
    # Per half of 128 weights, four runs of 32: low nibbles of bytes 0-31, of 32-63, high nibbles of
    # 0-31, of 32-63; their top two bits are bit pairs 0, 1, 2, 3 of the half's 32 high bytes.
    lows = np.stack([low[..., :32] & 15, low[..., 32:] & 15, low[..., :32] >> 4, low[..., 32:] >> 4], axis=2)
    highs = np.stack([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)
    codes = ((lows | (highs << 4)).astype(np.int8) - np.int8(32)).reshape(-1, 256)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _float16(blocks, 208) * scales, None


# type name -> (repacked format, weights per block, bytes per block, unpacker)
_TYPES = {
    "Q4_0": ("q4", 32, 18, _q4_0),
    "Q4_1": ("q4", 32, 20, _q4_1),
    "Q4_K": ("q4", 256, 144, _q4_k),
    "Q5_0": ("q8g32", 32, 22, _q5_0),
    "Q8_0": ("q8g32", 32, 34, _q8_0),
    "Q6_K": ("q8", 256, 210, _q6_k),
}
SUPPORTED_TYPES = tuple(_TYPES)


def unpack(raw: np.ndarray, type_name: str, in_features: int) -> Unpacked:
    """A GGUF matrix's raw bytes ([out, bytes per row] uint8, as gguf.GGUFReader gives them) of type
    `type_name` -> Unpacked [out, in_features]."""
    if type_name not in _TYPES:
        raise ValueError(f"GGUF type {type_name} is not one of {', '.join(_TYPES)}")
    fmt, block_weights, block_bytes, unpacker = _TYPES[type_name]
    out = raw.shape[0]
    if in_features % block_weights or raw.shape[1] != in_features // block_weights * block_bytes:
        raise ValueError(f"a {type_name} row of {in_features} weights takes "
                         f"{in_features // block_weights * block_bytes} bytes, got {raw.shape[1]}")
    codes, scales, offsets = unpacker(np.asarray(raw).reshape(-1, block_bytes))
    groups = in_features // GROUP[fmt]
    return Unpacked(fmt, codes.reshape(out, in_features), scales.reshape(out, groups),
                    None if offsets is None else offsets.reshape(out, groups))


def pack(unpacked: Unpacked) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (codes uint8 [blocks, groups, 64 or 128 (q8g32)], params float32 [blocks, groups, 8 or 4]) in
    quant_gemm.h's layout; rows padded with zeros to a multiple of 4."""
    out, in_features = unpacked.codes.shape
    group = GROUP[unpacked.format]
    groups, blocks = in_features // group, -(-out // 4)
    pad = blocks * 4 - out

    def rows_padded(a):
        return np.pad(a, ((0, pad), (0, 0))) if pad else a

    codes = rows_padded(unpacked.codes).reshape(blocks * 4, groups, group)
    if unpacked.format == "q4":  # byte k: column k in the low nibble, column k + 16 in the high
        row_bytes = codes[..., :16] | (codes[..., 16:] << 4)
        params = np.stack([rows_padded(unpacked.scales), rows_padded(unpacked.offsets)], axis=-1)
    else:
        row_bytes = codes.view(np.uint8)
        params = rows_padded(unpacked.scales)[..., None]
    # [blocks, 4 rows, groups, ...] -> [blocks, groups, 4 rows, ...]: a block's group is contiguous
    row_bytes = row_bytes.reshape(blocks, 4, groups, -1).transpose(0, 2, 1, 3).reshape(blocks, groups, -1)
    params = params.reshape(blocks, 4, groups, -1).transpose(0, 2, 1, 3).reshape(blocks, groups, -1)
    return (torch.from_numpy(np.ascontiguousarray(row_bytes, dtype=np.uint8)),
            torch.from_numpy(np.ascontiguousarray(params, dtype=np.float32)))


# ----------------------------------------------------------------------------------------------
# GGUF blocks -> the int8-activation kernel's tiles (csrc/cpu_linear/int8_gemm.h): the file's own
# codes, bits and float16 scales, rearranged so that one 64-byte load gives the 16 rows of a tile
# four adjacent features each. Unsigned codes u; the file's signed ones shifted by the format's zero.

INT8_FORMATS = {"Q4_K": 0, "Q6_K": 1, "Q5_0": 2, "Q8_0": 3}  # GGUF type -> int8_gemm.h's Int8Format
TILE_ROWS = 16


def _tile_rows(a: np.ndarray) -> np.ndarray:
    """[out, ...] -> [tiles, 16, ...], padded with zero rows."""
    pad = -a.shape[0] % TILE_ROWS
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(-1, TILE_ROWS, *a.shape[1:])


def _by_tile(per_row: np.ndarray) -> np.ndarray:
    """[out, n, ...] values per row -> [tiles, n, 16 rows x ...] bytes (a tile's rows adjacent)."""
    t = _tile_rows(per_row)
    t = np.moveaxis(t, 1, 2)  # [tiles, n, 16, ...]
    return np.ascontiguousarray(t).view(np.uint8).reshape(*t.shape[:2], -1)


def _operand_order(codes: np.ndarray) -> np.ndarray:
    """codes [out, groups, 32] -> [tiles, groups, 8 operands, 16 rows, 4 features]: operand j holds
    features 4j..4j+3 of each row of the tile."""
    t = _tile_rows(codes).reshape(-1, TILE_ROWS, codes.shape[1], 8, 4)
    return t.transpose(0, 2, 3, 1, 4)


def _nibbles_and_planes(u: np.ndarray, planes: int = 0, crumbs: bool = False) -> np.ndarray:
    """u [out, groups, 32] -> [tiles, groups, 256 + ...]: chunk k's byte holds operand k's code in its
    low nibble and operand k + 4's in its high one; then either `planes` bit planes (plane p's bit
    4 i + t of qword j is bit 4 + p of operand j's code) or, with crumbs, bits 4-5 of every code in
    two chunks of 64 bytes (chunk h's byte 4 i + t holds operand 4 h + k's in bits 2k, 2k + 1)."""
    ops = _operand_order(u)
    nibbles = (ops[:, :, :4] & 15) | ((ops[:, :, 4:] & 15) << 4)  # [tiles, groups, 4, 16, 4]
    parts = [nibbles.reshape(*ops.shape[:2], 256)]
    for plane in range(planes):
        bits = ((ops >> (4 + plane)) & 1).reshape(*ops.shape[:3], 64)
        parts.append(np.packbits(bits, axis=-1, bitorder="little").reshape(*ops.shape[:2], 64))
    if crumbs:
        high = ((ops >> 4) & 3).reshape(*ops.shape[:2], 2, 4, 64)  # [tiles, groups, h, k, 4 i + t]
        packed = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
        parts.append(packed.reshape(*ops.shape[:2], 128).astype(np.uint8))
    return np.concatenate(parts, axis=-1)


def _float16_bytes(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block [out, n, bytes] -> [out, n] float16."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _pack_int8_q4_k(blocks):  # [out, n, 144]
    out, n, _ = blocks.shape
    sc, m = _k_scales(blocks[..., 4:16].reshape(-1, 12))
    qs = blocks[..., 16:144].reshape(out, n, 4, 1, 32)  # chunk c: low nibbles group 2c, high 2c + 1
    u = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(out, n * 8, 32)
    groups = np.concatenate([_nibbles_and_planes(u),
                             _by_tile(sc.astype(np.uint8).reshape(out, n * 8)),
                             _by_tile(m.astype(np.uint8).reshape(out, n * 8))], axis=-1)
    header = np.concatenate([_by_tile(_float16_bytes(blocks, 0)), _by_tile(_float16_bytes(blocks, 2))], axis=-1)
    return header, groups


def _pack_int8_q6_k(blocks):  # [out, n, 210]
    out, n, _ = blocks.shape
    codes, _, _ = _q6_k(blocks.reshape(-1, 210))
    u = (codes.astype(np.int16) + 32).astype(np.uint8).reshape(out, n * 8, 32)
    scales = blocks[..., 192:208].reshape(out, n * 8, 2)  # group g: features 0-15, then 16-31
    groups = np.concatenate([_nibbles_and_planes(u, crumbs=True), _by_tile(scales[..., 0]), _by_tile(scales[..., 1])],
                            axis=-1)
    return _by_tile(_float16_bytes(blocks, 208)), groups


def _pack_int8_q5_0(blocks):  # [out, n, 22]
    out, n, _ = blocks.shape
    codes, _, _ = _q5_0(blocks.reshape(-1, 22))
    u = (codes.astype(np.int16) + 16).astype(np.uint8).reshape(out, n, 32)
    return None, np.concatenate([_nibbles_and_planes(u, planes=1), _by_tile(_float16_bytes(blocks, 0))], axis=-1)


def _pack_int8_q8_0(blocks):  # [out, n, 34]
    out, n, _ = blocks.shape
    u = blocks[..., 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128
    ops = _operand_order(np.ascontiguousarray(u))
    return None, np.concatenate([ops.reshape(*ops.shape[:2], 512), _by_tile(_float16_bytes(blocks, 0))], axis=-1)


_INT8_PACKERS = {"Q4_K": (256, 144, _pack_int8_q4_k), "Q6_K": (256, 210, _pack_int8_q6_k),
                 "Q5_0": (32, 22, _pack_int8_q5_0), "Q8_0": (32, 34, _pack_int8_q8_0)}


def pack_int8(raw: np.ndarray, type_name: str, in_features: int) -> torch.Tensor:
    """A GGUF matrix's raw bytes ([out, bytes per row] uint8) of type `type_name` (one of
    INT8_FORMATS) -> uint8 [ceil(out / 16), tile bytes] in int8_gemm.h's layout."""
    if type_name not in _INT8_PACKERS:
        raise ValueError(f"GGUF type {type_name} has no int8 layout (one of {', '.join(INT8_FORMATS)})")
    block_weights, block_bytes, packer = _INT8_PACKERS[type_name]
    out = raw.shape[0]
    if in_features % block_weights or raw.shape[1] != in_features // block_weights * block_bytes:
        raise ValueError(f"a {type_name} row of {in_features} weights takes "
                         f"{in_features // block_weights * block_bytes} bytes, got {raw.shape[1]}")
    header, groups = packer(np.asarray(raw).reshape(out, -1, block_bytes))
    tiles, nblocks = groups.shape[0], in_features // block_weights
    blocks = groups.reshape(tiles, nblocks, -1)
    if header is not None:
        blocks = np.concatenate([header, blocks], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(tiles, -1)))


# ----------------------------------------------------------------------------------------------
# A model's nn.Linear modules <- a GGUF file's tensors.

@dataclass
class Report:
    """What load_gguf_linear_weights did: module name -> GGUF type for the swapped modules, and
    module name -> why for the linear modules kept as they were."""

    replaced: Dict[str, str] = field(default_factory=dict)
    kept: Dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0  # the swapped modules' weights as they were
    bytes_after: int = 0   # their codes and params
    seconds: float = 0.0
    cached: bool = False   # read from a cache file

    def summary(self) -> str:
        counts: Dict[str, int] = {}
        for type_name in self.replaced.values():
            counts[type_name] = counts.get(type_name, 0) + 1
        types = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        line = (f"{len(self.replaced)} of {len(self.replaced) + len(self.kept)} linear layers read "
                f"from the GGUF file ({types or 'none'}): {self.bytes_before / 1e9:.2f} -> "
                f"{self.bytes_after / 1e9:.2f} GB of weights, {self.seconds:.1f} s")
        if self.kept:
            reasons: Dict[str, int] = {}
            for reason in self.kept.values():
                reasons[reason] = reasons.get(reason, 0) + 1
            line += "; kept: " + "; ".join(f"{n} x {r}" for r, n in reasons.items())
        return line


def _architecture(reader) -> str:
    return str(reader.fields["general.architecture"].contents())


def _name_map(reader, model):
    import gguf

    arch_name = _architecture(reader)
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise ValueError(f"gguf-py does not know the architecture {arch_name!r} of this file")
    return arch_name, gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)


def _llama_row_order(module_name: str, out: int, config) -> Optional[np.ndarray]:
    """For a llama file's q / k projection: GGUF row index of each HF row (transformers' reverse
    of llama.cpp's rotary permutation); None for other modules."""
    heads = config.num_attention_heads
    if module_name.endswith("self_attn.k_proj"):
        heads = getattr(config, "num_key_value_heads", None) or heads
    elif not module_name.endswith("self_attn.q_proj"):
        return None
    return np.arange(out).reshape(heads, out // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _repack_checked(tensor, type_name: str, weight: torch.Tensor, order: Optional[np.ndarray], verify: str,
                    int8: bool = False, rows_per_chunk: int = 4096):
    """The file's codes for `weight` repacked -> (codes, params, format) for QuantWeightLinear, or with
    int8 -> (packed, None, "int8") for QuantInt8Linear; None where they do not give the module's
    weights (verify: see load_gguf_linear_weights). A chunk of rows at a time: unpacking a whole
    output layer at once takes several times its codes in temporaries.
    order: the file's row of each of the module's rows (llama's q / k), or None."""
    import gguf

    out, in_features = weight.shape
    if weight.is_meta and verify != "file":
        raise ValueError("a weight on the meta device can be checked against the file only: verify='file'")
    raw = np.asarray(tensor.data)
    chunks = []
    for start in range(0, out, rows_per_chunk):  # (rows_per_chunk: a multiple of both layouts' tiles)
        rows = slice(start, min(start + rows_per_chunk, out))
        source = raw[order[rows]] if order is not None else raw[rows]
        if int8:
            packed = pack_int8(source, type_name, in_features)
            format_id = INT8_FORMATS[type_name]
            ours = torch.ops.fsd_cpu_linear.int8_dequantize(packed, format_id, rows.stop - rows.start).numpy()
            chunk = (packed,)
        else:
            unpacked = unpack(source, type_name, in_features)
            ours = unpacked.dequantize()
            chunk = pack(unpacked)
        if verify == "file":
            # the whole chunk against gguf-py; the module's weight (if it has one) at its first and last rows only
            same = np.array_equal(ours, gguf.quants.dequantize(source, tensor.tensor_type))
            read = [(0, 4), (out - 4, out)] if not weight.is_meta else []
        else:
            same, read = True, [(rows.start, rows.stop)]
        for first, stop in read:
            first, stop = max(first, rows.start), min(stop, rows.stop)
            if same and first < stop:
                same = torch.equal(torch.from_numpy(ours[first - start:stop - start]).to(weight.dtype),
                                   weight.detach()[first:stop].cpu())
        if not same:
            return None
        chunks.append(chunk)
    if int8:
        return torch.cat([c[0] for c in chunks]), None, "int8"
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]), _TYPES[type_name][0]


def release_file_pages(reader) -> None:
    """Lets the process's resident set drop the GGUF file's pages read so far (a read-only file
    mapping: they are read again from the page cache if needed); without it a first conversion or
    repack holds the whole file in its resident set on top of what it builds."""
    import mmap

    mapping = getattr(reader.data, "_mmap", None)  # (np.memmap's mmap object)
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def _gguf_tensor(tensors, name_map, module_name: str, model):
    """The GGUF tensor holding `module_name`'s weight, or None. A tied output layer with no
    `output.weight` in the file reads the token embedding, as transformers does."""
    gguf_name = name_map.get_name(module_name)
    tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
    if tensor is None and getattr(model.config, "tie_word_embeddings", False):
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if output is not None and output is model.get_submodule(module_name):
            tensor = tensors.get("token_embd.weight")
    return tensor


def _linear_modules(model):
    from . import Bfloat16WeightLinear
    return [(name, module) for name, module in model.named_modules()
            if type(module) in (torch.nn.Linear, Bfloat16WeightLinear)]


def _swap(model, name: str, module, codes, params, fmt: str, type_name: str, report: Report) -> None:
    """Replace `module` by a QuantInt8Linear (fmt "int8": codes is the packed tensor, params None) or
    a QuantWeightLinear holding the repacked weight."""
    from . import QuantInt8Linear, QuantWeightLinear

    weight = module.weight
    out, in_features = weight.shape
    if fmt == "int8":
        quant = QuantInt8Linear(codes, type_name, in_features, out, bias=module.bias)
    else:
        quant = QuantWeightLinear(codes, params, fmt, in_features, out, bias=module.bias, source=type_name)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, quant)
    report.replaced[name] = type_name
    report.bytes_before += weight.numel() * weight.element_size()
    report.bytes_after += codes.numel() + (params.numel() * 4 if params is not None else 0)


def _file_stamp(path: Path) -> Dict[str, str]:
    stat = path.stat()
    return {"version": CACHE_VERSION, "gguf_size": str(stat.st_size), "gguf_mtime_ns": str(stat.st_mtime_ns)}


CACHE_VERSION = "fsd_ext.gguf_linears/4"  # 3: the int8 layout (fmt "int8"); 4: its Q6_K in crumbs


def _cached_rows(codes, params, fmt: str, type_name: str, block: int) -> torch.Tensor:
    """Rows of block `block` (4 rows; a 16-row tile for "int8") of a cached weight, as float32."""
    from . import INT8_LAYOUT, dequantize_torch

    if fmt == "int8":
        return torch.ops.fsd_cpu_linear.int8_dequantize(codes[block:block + 1], list(INT8_LAYOUT).index(type_name), 16)
    return dequantize_torch(codes[block:block + 1], params[block:block + 1], fmt, 4)


def _from_cache(model, cache_path: Path, gguf_path: Path, report: Report) -> bool:
    """Swap the modules listed in a cache written for this very file; False if there is none (or it
    is stale). The whole file is checked against its digest first (cache_files.check_file: a
    damaged file is deleted with a warning, and so rebuilt); each cached layer's first and last
    block are compared with the module's weight (a cache written for another model's weights)."""
    import json

    from safetensors import safe_open

    from .. import cache_files

    if not cache_path.exists():
        return False
    try:
        cache_files.check_file(cache_path)
    except cache_files.CorruptCache as error:
        cache_files.warn_rebuild(error)
        cache_files.remove(cache_path)
        return False
    with safe_open(str(cache_path), framework="pt") as cache:
        meta = cache.metadata() or {}
        if {k: meta.get(k) for k in ("version", "gguf_size", "gguf_mtime_ns")} != _file_stamp(gguf_path):
            return False
        entries = json.loads(meta["modules"])
        modules = dict(_linear_modules(model))
        if not set(entries) <= set(modules):
            return False
        loaded = {name: (cache.get_tensor(f"{name}.codes"),
                         cache.get_tensor(f"{name}.params") if fmt != "int8" else None)
                  for name, (_, fmt) in entries.items()}
    for name, (type_name, fmt) in entries.items():
        codes, params = loaded[name]
        weight = modules[name].weight.detach()
        rows_per_block = 16 if fmt == "int8" else 4
        for block in (0, codes.shape[0] - 1) if not weight.is_meta else ():
            rows = _cached_rows(codes, params, fmt, type_name, block)
            expected = weight[rows_per_block * block:rows_per_block * (block + 1)]
            if not torch.equal(rows[:expected.shape[0]].to(weight.dtype), expected):
                return False
    for name, (type_name, fmt) in entries.items():
        _swap(model, name, modules[name], *loaded[name], fmt, type_name, report)
    for name, reason in json.loads(meta.get("kept", "{}")).items():
        report.kept[name] = reason
    report.cached = True
    return True


def _write_cache(model, cache_path: Path, gguf_path: Path, report: Report) -> None:
    import json

    from safetensors.torch import save_file

    from .. import cache_files
    from . import QuantInt8Linear

    tensors, entries = {}, {}
    for name in report.replaced:
        module = model.get_submodule(name)
        if isinstance(module, QuantInt8Linear):
            tensors[f"{name}.codes"], fmt = module.packed, "int8"
        else:
            tensors[f"{name}.codes"], tensors[f"{name}.params"], fmt = module.codes, module.params, module.format
        entries[name] = (report.replaced[name], fmt)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_files.remove(cache_files.digest_path(cache_path))
    tmp = cache_files.tmp_path(cache_path)
    save_file(tensors, str(tmp), metadata={**_file_stamp(gguf_path), "modules": json.dumps(entries),
                                           "kept": json.dumps(report.kept)})
    cache_files.commit(tmp, cache_path)
    cache_files.write_file_digest(cache_path)  # last: a file without it is rebuilt


def load_gguf_linear_weights(model: torch.nn.Module, gguf_path, cache_path=None, log: bool = True,
                             verify: str = "model", activations: str = "float32",
                             check_file: Optional[Callable[[], object]] = None) -> Report:
    """Swap every CPU nn.Linear of `model` (a transformers model loaded from, or converted from,
    the GGUF file `gguf_path`) whose weight the file stores in a type of SUPPORTED_TYPES, and whose
    float weight the file's codes reproduce exactly, for a module holding those codes (the module's
    weight is freed). In place; returns a Report.

    activations: "float32", a cpu_linear.QuantWeightLinear (float32 products of the exact weights);
    "int8", a cpu_linear.QuantInt8Linear where the type has an int8 layout (INT8_FORMATS: x
    quantised to int8 per 32 features, int8 dot products) and QuantWeightLinear for the other types.

    verify: "model" compares every repacked weight with the module's; "file", for a model whose
    weights were dequantised from this very file (models.load), compares them with gguf-py's
    dequantisation of the file and only the module's first and last rows, so that a memory-mapped
    checkpoint's linear weights are never read (the first `fsd-ext demo` would otherwise hold the
    whole float32 model in memory). A weight on the meta device (models.load never builds the
    float32 copy) is checked against gguf-py only, so it needs "file".
    cache_path: a safetensors file for the repacked codes. Repacking reads and checks every weight
    (about 30 s for the 1.5B model on 2 cores); a cache written for the same file (same size and
    modification time) is read instead, after its sha256 is checked (a damaged cache is deleted
    with a warning and rebuilt), each layer's first and last rows still checked against the model's
    weights. Building it holds a lock (cache_files.lock): a second process waits, then reads it.
    check_file: called before the GGUF file's bytes are read (models.load: its sha256), not when
    the cache is read.
    """
    if verify not in ("model", "file"):
        raise ValueError(f"verify must be 'model' or 'file', got {verify!r}")
    if activations not in ("float32", "int8"):
        raise ValueError(f"activations must be 'float32' or 'int8', got {activations!r}")

    start = time.perf_counter()
    gguf_path = Path(gguf_path)
    report = Report()
    if cache_path is None:
        _load_linear_weights(model, gguf_path, None, verify, activations, check_file, report)
    else:
        from .. import cache_files

        with cache_files.lock(Path(cache_path)):
            _load_linear_weights(model, gguf_path, Path(cache_path), verify, activations, check_file, report)
    report.seconds = time.perf_counter() - start
    if log:
        cached = " (cached)" if report.cached else ""
        print(f"[fsd-ext] {gguf_path.name}: {report.summary()}{cached}", file=sys.stderr, flush=True)
    return report


def _load_linear_weights(model, gguf_path: Path, cache_path: Optional[Path], verify: str, activations: str,
                         check_file, report: Report) -> None:
    import gguf

    if cache_path is not None and _from_cache(model, cache_path, gguf_path, report):
        return
    if check_file is not None:
        check_file()
    reader = gguf.GGUFReader(str(gguf_path))
    arch_name, name_map = _name_map(reader, model)
    tensors = {t.name: t for t in reader.tensors}
    for name, module in _linear_modules(model):
        weight = module.weight
        tensor = _gguf_tensor(tensors, name_map, name, model)
        out, in_features = weight.shape
        if weight.device.type not in ("cpu", "meta"):  # (meta: models.load builds it from the file)
            report.kept[name] = "not on the CPU"
        elif tensor is None:
            report.kept[name] = "no tensor in the file"
        elif tensor.tensor_type.name not in _TYPES:
            report.kept[name] = f"GGUF type {tensor.tensor_type.name}"
        elif tuple(int(n) for n in tensor.shape) != (in_features, out):
            report.kept[name] = "another shape in the file"
        else:
            type_name = tensor.tensor_type.name
            order = _llama_row_order(name, out, model.config) if arch_name == "llama" else None
            int8 = activations == "int8" and type_name in INT8_FORMATS
            repacked = _repack_checked(tensor, type_name, weight, order, verify, int8=int8)
            release_file_pages(reader)
            if repacked is not None:
                _swap(model, name, module, *repacked, type_name, report)
            else:
                report.kept[name] = "weights differ from the file's"
    if cache_path is not None and report.replaced:
        _write_cache(model, cache_path, gguf_path, report)
