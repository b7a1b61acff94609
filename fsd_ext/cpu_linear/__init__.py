"""CPU model execution for decoding: faster linear layers, attention and decoder layers on the CPU.

A component of its own beside the FSD core (which does not use it): its C++ is csrc/cpu_linear/,
its torch ops `torch.ops.fsd_cpu_linear.*` live in their own extension (fsd_ext.cpu_linear._C).
`fsd_ext.models.load` puts it into the models it loads where it pays off; for a model of your
own, `use_skinny_cpu_linears(model)`, `store_linear_weights_bfloat16(model)`,
`gguf_weights.load_gguf_linear_weights(model, path, activations=...)`,
`attention.use_grouped_attention(model)` or `fused.fuse_decoder_layers(model)`.
`fsd_ext.generate` runs whatever modules the models have.

CPU decoding is bound by reading the weights: the target's verification multiplies K+1 rows by
every weight matrix, the draft's catch-up 2 rows, an AR or draft step one.

- `skinny_linear` (csrc/cpu_linear/skinny_gemm.cpp) streams each float32 or bfloat16 weight row
  from memory once for all rows of x (at most MAX_ROWS); where it pays off (`skinny_pays_off`, a
  fixed rule so that two runs round alike): bfloat16 with AVX512-BF16 (the CPU's bfloat16 dot
  product on the stored weights), bfloat16 with AVX2 (widened in registers), float32 unless
  torch's BLAS is MKL on an Intel CPU. `Bfloat16WeightLinear` keeps bfloat16 weights under float32
  activations (half the weight bytes).
- `QuantWeightLinear` (csrc/cpu_linear/quant_gemm.cpp) keeps a GGUF file's own 4-8-bit codes
  (0.75-1.25 bytes a weight), every weight exactly the file's float32 value.
- `QuantInt8Linear` (csrc/cpu_linear/int8_gemm.cpp, the default with AVX512-VNNI) keeps the file's
  Q4_K / Q6_K / Q5_0 / Q8_0 blocks in their own size (0.58-1.06 bytes a weight) and multiplies them
  with x quantised to int8 per 32 features by int8 dot products, for any number of rows.
- `attention.grouped_sdpa` (no copy of the cache per query head) and `fused.fuse_decoder_layers`
  (a decoding step's decoder layer in one op, csrc/cpu_linear/torch_int8.cpp and decode_ops.cpp).

Each kernel stays only while it beats what PyTorch ships for the same job end to end by 1.25x
or more on some supported CPU: the measurements are in docs/cpu.md.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from . import _C  # noqa: F401  (registers torch.ops.fsd_cpu_linear.*)
    _IMPORT_ERROR = None
except ImportError as error:  # pragma: no cover - only without a build
    _IMPORT_ERROR = error

# Input columns per code group of the quant_* ops' formats, by format id (Q4, Q8, Q8G32): the C++
# side's quant_group_size (csrc/cpu_linear/quant_gemm.h).
QUANT_GROUP_SIZE = (32, 16, 32)

if _IMPORT_ERROR is None:  # fake kernels: output shapes for torch.compile and FakeTensor tracing

    @torch.library.register_fake("fsd_cpu_linear::skinny_linear")
    def _skinny_linear_fake(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("fsd_cpu_linear::quant_linear")
    def _quant_linear_fake(x, codes, params, format, out_features, bias):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("fsd_cpu_linear::int8_linear")
    def _int8_linear_fake(x, weight, format, out_features, bias):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("fsd_cpu_linear::int8_linear_cat")
    def _int8_linear_cat_fake(x, weights, formats, out_features, bias):
        return x.new_empty((*x.shape[:-1], sum(out_features)))

    @torch.library.register_fake("fsd_cpu_linear::decoder_layer")
    def _decoder_layer_fake(hidden, *args):
        return torch.empty_like(hidden)

    @torch.library.register_fake("fsd_cpu_linear::rotate_half_")
    def _rotate_half_fake(x, cos, sin, heads):
        return None

    @torch.library.register_fake("fsd_cpu_linear::int8_dequantize")
    def _int8_dequantize_fake(weight, format, out_features):
        block_cols, block_bytes = list(INT8_LAYOUT.values())[format]
        return weight.new_empty((out_features, weight.shape[1] // block_bytes * block_cols), dtype=torch.float32)

    @torch.library.register_fake("fsd_cpu_linear::quant_dequantize")
    def _quant_dequantize_fake(codes, params, format, out_features, dtype=None):
        group = QUANT_GROUP_SIZE[format]
        return params.new_empty((out_features, codes.shape[1] * group), dtype=dtype or torch.float32)

MAX_ROWS = 16  # the kernel's limit (kSkinnyMaxRows); prefill-sized inputs keep F.linear's GEMM
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_ORIGINAL = "_fsd_original_forward"


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in]. For 1..MAX_ROWS float32 or 2..MAX_ROWS bfloat16 CPU
    rows (1..MAX_ROWS with bf16_dot_available() or avx2_available()), and no autograd: the fsd_ext
    kernel, else for float32 (W @ x^T)^T; anything else goes to F.linear. A bfloat16 weight with
    float32 x (and bias) is the weight-only case (Bfloat16WeightLinear): the kernel at 1..MAX_ROWS
    rows, more rows by _widening_linear, and F.linear with the weight widened under autograd."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    weight_only = x.dtype == torch.float32 and weight.dtype == torch.bfloat16
    native = _native_op()
    if weight_only and rows > MAX_ROWS and x.device.type == "cpu" and not needs_grad:
        return _widening_linear(x, weight, bias)
    if (not 0 < rows <= MAX_ROWS or x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES
            or (weight.dtype != x.dtype and not weight_only) or needs_grad):
        return _plain_linear(x, weight, bias, weight_only)
    # torch's bfloat16 GEMV is faster than the portable loops there (the intrinsics paths win)
    one_bf16_row = rows == 1 and x.dtype == torch.bfloat16 and not (bf16_dot_available() or avx2_available())
    if native is not None and not one_bf16_row and weight.stride(-1) == 1 and (
            bias is None or bias.dtype == x.dtype):
        return native(x, weight, bias)
    if x.dtype != torch.float32 or weight_only:
        return _plain_linear(x, weight, bias, weight_only)
    # The BLAS is fast here only with a contiguous x (x^T is then a transposed operand, not a copy).
    x_rows = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
    out = (weight @ x_rows.t()).t().contiguous()  # [rows, out]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias, weight_only: bool) -> torch.Tensor:
    """F.linear, with a bfloat16 weight widened to x's float32 in the weight-only case (other dtype
    mismatches raise F.linear's error, as nn.Linear would)."""
    return F.linear(x, weight.to(x.dtype) if weight_only else weight, bias)


_WIDENED_BLOCK_BYTES = 4 << 20  # float32 weight rows widened at a time: cache-sized


def _widening_linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """F.linear(x, weight.float(), bias) for float32 x with many rows (a prompt) and a bfloat16
    weight, by blocks of weight rows widened into one reused float32 buffer: the BLAS's GEMM speed
    without a float32 copy of the whole weight (allocating that, 0.9 GB for the 1.5B's output
    layer, made a 40-token prompt forward 2.1x as slow as in float32)."""
    out_features, in_features = weight.shape
    block = max(1, _WIDENED_BLOCK_BYTES // (4 * in_features))
    widened = torch.empty(min(block, out_features), in_features, dtype=x.dtype)

    def rows(begin: int, end: int) -> torch.Tensor:
        w = widened[:end - begin]
        w.copy_(weight[begin:end])
        return w

    return _blockwise_linear(x, rows, out_features, block, bias)


def _blockwise_linear(x: torch.Tensor, weight_rows, out_features: int, block: int, bias) -> torch.Tensor:
    """F.linear(x, W, bias) for float32 x, with W's float32 rows [begin, end) given by
    weight_rows(begin, end) a block of rows at a time (each block's product by torch.mm)."""
    x_rows = x.reshape(-1, x.shape[-1])
    y_t = torch.empty(out_features, x_rows.shape[0], dtype=x.dtype)  # [out, rows]: row blocks contiguous
    for begin in range(0, out_features, block):
        end = min(out_features, begin + block)
        torch.mm(weight_rows(begin, end), x_rows.t(), out=y_t[begin:end])
    y = y_t.t()
    if bias is not None:
        y = y + bias
    return y.contiguous().reshape(*x.shape[:-1], out_features)


class Bfloat16WeightLinear(torch.nn.Linear):
    """An nn.Linear whose weight is stored in bfloat16 while its input, bias and output stay float32
    (made by store_linear_weights_bfloat16): half the weight bytes for decoding to read, and every
    other operation of the model in float32. Few-row inputs go to the kernel, which widens the
    weights to float32 in registers or cache; prompt-sized ones to _widening_linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


def store_linear_weights_bfloat16(model: torch.nn.Module) -> int:
    """Store the weight of every float32 CPU nn.Linear of `model` in bfloat16, in place (the module
    becomes a Bfloat16WeightLinear; the float32 weight is freed, so this is one-way). Embeddings,
    norms, biases and activations stay float32; a weight tied to an embedding gets its own bfloat16
    copy and the embedding keeps float32. Returns the number of modules converted."""
    converted = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is not torch.nn.Linear or weight is None or weight.device.type != "cpu"
                or weight.dtype != torch.float32):
            continue
        module.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        module.__class__ = Bfloat16WeightLinear
        converted += 1
    return converted


class QuantWeightLinear(torch.nn.Module):
    """A linear layer whose weight is stored as small integer codes with a float scale (and
    offset) per group of 32 (format "q4", 4-bit codes; "q8g32", 8-bit codes) or 16 ("q8", 8-bit
    codes) input features, in the layout of csrc/cpu_linear/quant_gemm.h: a GGUF checkpoint's own
    quantised weights, repacked by fsd_ext.cpu_linear.gguf_weights.load_gguf_linear_weights, which makes these
    modules. Every weight is exactly the float32 value the checkpoint's dequantisation gives;
    decoding reads 0.75 (q4), 1.125 (q8g32) or 1.25 (q8) bytes per weight instead of bfloat16's 2
    or float32's 4.

    codes: uint8 [ceil(out / 4), in / group, 64 (q4, q8) or 128 (q8g32)]; params: float32
    [ceil(out / 4), in / group, 8 (q4) or 4 (q8, q8g32)]; bias: float32 [out] or None. Input and
    output are float32 (another floating dtype is computed in float32 and cast back). Few-row CPU
    inputs (decoding: 1..MAX_ROWS rows) go to the fsd_ext kernel; more rows (a prompt) to torch.mm
    on cache-sized blocks of dequantised rows, in bfloat16 on CPUs where that is much faster
    (prompt_matmul_dtype; y rounded to bfloat16; set `prompt_dtype` to torch.float32, or use
    set_prompt_dtype(model, torch.float32), for float32 there too); other devices, autograd, or a
    build without the extension dequantise with torch ops.
    """

    def __init__(self, codes: torch.Tensor, params: torch.Tensor, format: str, in_features: int,
                 out_features: int, bias: Optional[torch.Tensor] = None, source: str = ""):
        super().__init__()
        if format not in _QUANT_GROUP:
            raise ValueError(f"format must be one of {sorted(_QUANT_GROUP)}, got {format!r}")
        group, blocks = _QUANT_GROUP[format], -(-out_features // 4)
        params_per_group, code_bytes = (8 if format == "q4" else 4), 4 * group if format == "q8g32" else 64
        shape = (blocks, in_features // group, code_bytes)
        if in_features % group or codes.shape != shape or codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8 [{blocks}, {in_features // group}, {code_bytes}] for a {format} "
                             f"[{out_features}, {in_features}] weight, got {codes.dtype} {tuple(codes.shape)}")
        if params.shape != (blocks, in_features // group, params_per_group) or params.dtype != torch.float32:
            raise ValueError(f"params must be float32 [{blocks}, {in_features // group}, {params_per_group}], "
                             f"got {params.dtype} {tuple(params.shape)}")
        self.format, self.source = format, source
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("params", params.contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.prompt_dtype: Optional[torch.dtype] = None  # see prompt_matmul_dtype

    def extra_repr(self) -> str:
        source = f", from {self.source}" if self.source else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format}{source}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.forward(x.float()).to(x.dtype)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        native = _native_op()
        on_cpu = x.device.type == "cpu" and self.codes.device.type == "cpu"
        if native is not None and on_cpu and not needs_grad and 0 < rows <= MAX_ROWS:
            return torch.ops.fsd_cpu_linear.quant_linear(x, self.codes, self.params, _QUANT_FORMAT_ID[self.format],
                                                  self.out_features, self.bias)
        if native is not None and on_cpu and not needs_grad:
            bfloat16_product = self.prompt_matmul_dtype() == torch.bfloat16
            block = max(4, _WIDENED_BLOCK_BYTES // (4 * self.in_features) // 4 * 4)
            if bfloat16_product:
                def rows(begin: int, end: int) -> torch.Tensor:
                    return self._dequantized_rows(begin, end, torch.bfloat16)

                y = _blockwise_linear(x.bfloat16(), rows, self.out_features, 2 * block, None).float()
                return y if self.bias is None else y + self.bias
            return _blockwise_linear(x, self._dequantized_rows, self.out_features, block, self.bias)
        return F.linear(x, self.dequantized_weight(), self.bias)

    def prompt_matmul_dtype(self) -> torch.dtype:
        """The dtype of the product for more than MAX_ROWS rows (a prompt): self.prompt_dtype, or
        when that is None ("auto"), bfloat16 on a CPU with AVX512-BF16 (whose bfloat16 GEMM, AMX
        where it has it, is several times torch's float32 GEMM: docs/cpu.md) and float32 elsewhere.
        bfloat16 rounds that product's weights, inputs and outputs as a bfloat16 model does; decoding steps (at most MAX_ROWS rows) always
        multiply the float32 weights exactly."""
        if self.prompt_dtype is not None:
            return self.prompt_dtype
        return torch.bfloat16 if bf16_dot_available() else torch.float32

    def _dequantized_rows(self, begin: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [begin, end) of the weight (begin a multiple of 4) by the fsd_ext kernel, float32 or
        rounded to bfloat16."""
        blocks = slice(begin // 4, -(-end // 4))
        return torch.ops.fsd_cpu_linear.quant_dequantize(self.codes[blocks], self.params[blocks],
                                                  _QUANT_FORMAT_ID[self.format], end - begin, dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] (the same values on every path)."""
        if _native_op() is not None and self.codes.device.type == "cpu":
            return self._dequantized_rows(0, self.out_features)
        return dequantize_torch(self.codes, self.params, self.format, self.out_features)


class QuantInt8Linear(torch.nn.Module):
    """A linear layer holding a GGUF file's own codes (Q4_K, Q6_K, Q5_0 or Q8_0) in the tile layout
    of csrc/cpu_linear/int8_gemm.h (made by gguf_weights.load_gguf_linear_weights with
    activations="int8"), multiplied with x quantised to int8 per group of 32 features by the CPU's
    int8 dot-product instruction (AVX512-VNNI; portable loops elsewhere). About the file's own size
    (0.58 bytes a weight for Q4_K, 0.82 Q6_K, 0.69 Q5_0, 1.06 Q8_0), any number of rows (decoding
    steps and prompts alike), and each row's result independent of the other rows in the call.

    packed: uint8 [ceil(out / 16), tile bytes]; bias: float32 [out] or None. Output float32 (another
    floating dtype is computed in float32 and cast back). Autograd, other devices and builds without
    the extension multiply the float32 weights (dequantized_weight: exactly gguf's values).
    """

    def __init__(self, packed: torch.Tensor, type_name: str, in_features: int, out_features: int,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        if type_name not in INT8_LAYOUT:
            raise ValueError(f"type_name must be one of {sorted(INT8_LAYOUT)}, got {type_name!r}")
        block_cols, block_bytes = INT8_LAYOUT[type_name]
        shape = (-(-out_features // 16), in_features // block_cols * block_bytes)
        if in_features % block_cols or tuple(packed.shape) != shape or packed.dtype != torch.uint8:
            raise ValueError(f"packed must be uint8 {list(shape)} for a {type_name} [{out_features}, {in_features}] "
                             f"weight, got {packed.dtype} {list(packed.shape)}")
        self.type_name, self.in_features, self.out_features = type_name, in_features, out_features
        self.format_id = list(INT8_LAYOUT).index(type_name)
        self.register_buffer("packed", packed.contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.type_name} (int8 activations), bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (_native_op() is not None and x.device.type == "cpu" and self.packed.device.type == "cpu"
                and not (torch.is_grad_enabled() and x.requires_grad)):
            return torch.ops.fsd_cpu_linear.int8_linear(x, self.packed, self.format_id, self.out_features, self.bias)
        return F.linear(x, self.dequantized_weight().to(x), None if self.bias is None else self.bias.to(x))

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] on the CPU: exactly gguf's dequantisation of the file."""
        return torch.ops.fsd_cpu_linear.int8_dequantize(self.packed.cpu(), self.format_id, self.out_features)


# GGUF type -> (features per block, bytes per block of a 16-row tile) of int8_gemm.h's layout, in its
# Int8Format order.
INT8_LAYOUT = {"Q4_K": (256, 2368), "Q6_K": (256, 3360), "Q5_0": (32, 352), "Q8_0": (32, 544)}


@functools.lru_cache(maxsize=None)
def int8_linear_path() -> str:
    """The loops QuantInt8Linear runs on this CPU: "avx512-vnni" or "portable" ("" without the
    compiled extension)."""
    return str(torch.ops.fsd_cpu_linear.int8_linear_path()) if _native_op() is not None else ""


_QUANT_FORMAT_ID = {"q4": 0, "q8": 1, "q8g32": 2}
_QUANT_GROUP = {name: QUANT_GROUP_SIZE[i] for name, i in _QUANT_FORMAT_ID.items()}


def dequantize_torch(codes: torch.Tensor, params: torch.Tensor, format: str, out_features: int) -> torch.Tensor:
    """QuantWeightLinear's float32 weight [out, in] from codes and params in torch ops (any device;
    the kernel's fma rounds once where these round the product and the sum apart, which differs
    only where code x scale is not exact: never for GGUF's scales)."""
    blocks, groups, code_bytes = codes.shape
    by_row = codes.reshape(blocks, groups, 4, code_bytes // 4)
    if format == "q4":
        values = torch.cat([by_row & 15, by_row >> 4], dim=-1).float()  # [blocks, groups, 4, 32]
        scale, offset = params[..., 0::2, None], params[..., 1::2, None]  # [blocks, groups, 4, 1]
        weights = values * scale + offset
    else:
        weights = by_row.view(torch.int8).float() * params[..., None]
    return weights.permute(0, 2, 1, 3).reshape(blocks * 4, -1)[:out_features]


@functools.lru_cache(maxsize=None)
def _native_op():
    """torch.ops.fsd_cpu_linear.skinny_linear, or None when the extension is not built (looked up
    once: this runs for every linear of every decoding forward)."""
    return torch.ops.fsd_cpu_linear.skinny_linear if _IMPORT_ERROR is None else None


@functools.lru_cache(maxsize=None)
def bf16_dot_available() -> bool:
    """Whether the kernel multiplies bfloat16 weights and activations with the CPU's AVX512-BF16
    dot-product instruction (False without the compiled extension)."""
    return _native_op() is not None and bool(torch.ops.fsd_cpu_linear.skinny_linear_bf16_dot())


@functools.lru_cache(maxsize=None)
def avx2_available() -> bool:
    """Whether the kernel takes its AVX2 + FMA path for float32 activations (with float32 weights, or
    bfloat16 ones widened in registers; False without the compiled extension)."""
    return _native_op() is not None and bool(torch.ops.fsd_cpu_linear.skinny_linear_avx2())


@functools.lru_cache(maxsize=None)
def quant_linear_path() -> str:
    """The loops QuantWeightLinear's decoding products run on this CPU: "avx512", "avx2" or
    "portable" ("" without the compiled extension)."""
    return str(torch.ops.fsd_cpu_linear.quant_linear_path()) if _native_op() is not None else ""


def quant_linears_pay_off() -> bool:
    """Whether a GGUF checkpoint's own quantised linear weights (QuantWeightLinear) beat the other
    CPU linears here, by a fixed rule: where the kernel has its AVX-512 path (measured on an Intel
    Xeon: docs/cpu.md); the AVX2 path is tested but not yet measured against the bfloat16 kernel."""
    return quant_linear_path() == "avx512"


def set_prompt_dtype(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> int:
    """Set `prompt_dtype` (QuantWeightLinear.prompt_matmul_dtype: None = auto, torch.float32,
    torch.bfloat16) on every QuantWeightLinear of `model`; returns how many."""
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be None, torch.float32 or torch.bfloat16, got {dtype}")
    layers = [m for m in model.modules() if isinstance(m, QuantWeightLinear)]
    for layer in layers:
        layer.prompt_dtype = dtype
    return len(layers)


def linear_weights_kind(model: torch.nn.Module) -> Optional[str]:
    """"gguf-int8" if some linear layer of `model` multiplies quantised codes with int8 activations
    (QuantInt8Linear), "gguf" if some holds quantised codes under float32 activations
    (QuantWeightLinear), "bfloat16" if some holds bfloat16 weights under float32 activations
    (Bfloat16WeightLinear), else None."""
    kinds = {type(m) for m in model.modules()}
    if QuantInt8Linear in kinds:
        return "gguf-int8"
    if QuantWeightLinear in kinds:
        return "gguf"
    return "bfloat16" if Bfloat16WeightLinear in kinds else None


def cpu_vendor() -> str:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD", ...; "" when unknown)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "GenuineIntel" if "GenuineIntel" in platform.processor() else ""


@functools.lru_cache(maxsize=None)
def skinny_pays_off(dtype: torch.dtype = torch.float32) -> bool:
    """Whether skinny_linear beats F.linear for decoding's few-row products of `dtype` here, by a
    fixed rule (a timed choice could differ between two runs, and with it the float rounding of
    their tokens): bfloat16 with bf16_dot_available() always does; otherwise F.linear wins where
    torch's BLAS is MKL on an Intel CPU (the numbers above), the kernel wins on the AMD CPU it was
    measured on, and is kept elsewhere."""
    if dtype == torch.bfloat16 and bf16_dot_available():
        return True
    return not (torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel")


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, self.weight, self.bias)


def use_skinny_cpu_linears(model: torch.nn.Module, enable: bool = True) -> int:
    """Route every nn.Linear of `model` through skinny_linear (enable=False restores them).
    Returns the number of modules changed. Idempotent; other devices and dtypes are unaffected."""
    changed = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        patched = _ORIGINAL in module.__dict__
        if enable and not patched:
            module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
            module.forward = _forward.__get__(module)
            changed += 1
        elif not enable and patched:
            original = module.__dict__.pop(_ORIGINAL)
            if original is None:
                del module.forward
            else:
                module.forward = original
            changed += 1
    return changed


@contextlib.contextmanager
def skinny_cpu_linears(*models, enabled: bool = True):
    """use_skinny_cpu_linears on `models` (None entries skipped) for the duration of the block; the
    modules it changed are restored afterwards (ones already patched are left as they were)."""
    changed = []
    try:
        for model in models:
            if enabled and model is not None and use_skinny_cpu_linears(model):
                changed.append(model)
        yield
    finally:
        for model in changed:
            use_skinny_cpu_linears(model, enable=False)
