"""The converted-weights cache proves itself (fsd_ext.cache_files): each artefact kind (the
assembled GGUF file, the converted safetensors folder, the repacked gguf-linears file) damaged on
purpose (random bytes mid-file, truncation, a zeroed region, a deleted index, a stale .tmp) is
found, named in a warning, deleted and rebuilt once; two first loads at once build it once.
Small synthetic artefacts written by the very functions models.load uses."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from fsd_ext import cache_files, cli, models  # noqa: E402
from fsd_ext.cpu_linear import gguf_weights  # noqa: E402
from gguf_blocks import tiny_model, write_checkpoint_gguf, write_gguf  # noqa: E402

IDS = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(0))


def damage(path: Path, how: str, at: float = 0.5) -> None:
    """Damage a file in place the ways a disk or an interrupted write does, keeping its
    modification time (bit rot does not touch it)."""
    stat = path.stat()
    size = stat.st_size
    offset = int(size * at)
    with open(path, "r+b") as handle:
        if how == "random":
            handle.seek(offset)
            handle.write(os.urandom(min(4096, size - offset)))
        elif how == "zeroed":
            handle.seek(offset)
            handle.write(bytes(min(4096, size - offset)))
        elif how == "truncated":
            handle.truncate(offset)
        else:
            raise ValueError(how)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


# ----------------------------------------------------------------------------------------------
# The repacked GGUF linear weights (gguf_weights' cache file).

@pytest.fixture
def linears(tmp_path):
    """(a fresh model factory, the GGUF file, the cache path): the cache written once."""
    model = tiny_model("qwen2")
    write_gguf(model, "qwen2", tmp_path / "tiny.gguf")
    state = model.state_dict()

    def fresh():
        again = tiny_model("qwen2")
        again.load_state_dict(state)
        return again

    cache = tmp_path / "cache" / "tiny.safetensors"
    first = gguf_weights.load_gguf_linear_weights(fresh(), tmp_path / "tiny.gguf", cache_path=cache, log=False)
    assert not first.cached and cache_files.digest_path(cache).exists()
    return fresh, tmp_path / "tiny.gguf", cache


@pytest.mark.parametrize("how", ["random", "zeroed", "truncated"])
def test_damaged_linears_cache_is_found_and_rebuilt(linears, how):
    fresh, path, cache = linears
    expected = fresh()
    gguf_weights.load_gguf_linear_weights(expected, path, log=False)  # (no cache)
    damage(cache, how)
    model = fresh()
    with pytest.warns(cache_files.CacheWarning, match=cache.name):
        report = gguf_weights.load_gguf_linear_weights(model, path, cache_path=cache, log=False)
    assert not report.cached  # repacked from the GGUF file, the cache written anew
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected(IDS).logits)
    cache_files.check_file(cache)
    assert gguf_weights.load_gguf_linear_weights(fresh(), path, cache_path=cache, log=False).cached


def test_linears_cache_without_digest_is_rebuilt_and_stale_tmp_removed(linears):
    """A cache from an older fsd-ext (no digest file) or whose write was interrupted after the
    rename: rebuilt. A .tmp left by an interrupted write: removed."""
    fresh, path, cache = linears
    cache_files.digest_path(cache).unlink()
    tmp = cache_files.tmp_path(cache)
    tmp.write_bytes(b"half a cache")
    with pytest.warns(cache_files.CacheWarning, match="no digest file"):
        assert not gguf_weights.load_gguf_linear_weights(fresh(), path, cache_path=cache, log=False).cached
    assert not tmp.exists()
    assert gguf_weights.load_gguf_linear_weights(fresh(), path, cache_path=cache, log=False).cached


def test_two_first_loads_of_the_linears_cache_build_it_once(tmp_path, monkeypatch):
    """Two threads (as two processes would: each opens the lock file) load the same model at once:
    one repacks and writes the cache under the lock, the other waits, then reads it."""
    model = tiny_model("qwen2")
    write_gguf(model, "qwen2", tmp_path / "tiny.gguf")
    models_ = [tiny_model("qwen2") for _ in range(2)]
    for m in models_:
        m.load_state_dict(model.state_dict())
    repacks = []
    repack = gguf_weights._repack_checked

    def slow_repack(*args, **kwargs):
        repacks.append(threading.get_ident())
        threading.Event().wait(0.01)  # (widens the window in which both would build)
        return repack(*args, **kwargs)

    monkeypatch.setattr(gguf_weights, "_repack_checked", slow_repack)
    cache = tmp_path / "cache" / "tiny.safetensors"
    reports = [None, None]

    def load(i):
        reports[i] = gguf_weights.load_gguf_linear_weights(models_[i], tmp_path / "tiny.gguf", cache_path=cache,
                                                           log=False)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.cached for r in reports) == [False, True]
    assert len(set(repacks)) == 1
    cache_files.check_file(cache)
    with torch.no_grad():
        assert torch.equal(models_[0](IDS).logits, models_[1](IDS).logits)


# ----------------------------------------------------------------------------------------------
# A built-in checkpoint end to end: packages -> assembled GGUF -> converted folder -> load.

class _Tokenizer:
    """(the test GGUF files hold no vocabulary)"""

    pad_token_id = 0

    def save_pretrained(self, folder):
        pass


@pytest.fixture
def builtin(tmp_path, monkeypatch):
    """A built-in name "tiny" whose package data is a tiny Qwen2 checkpoint in two parts, the cache
    in tmp_path: -> (the name, the float model the GGUF file holds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "source"
    source.mkdir()
    write_checkpoint_gguf(tiny_model("qwen2"), "qwen2", source / "m.gguf")
    data = (source / "m.gguf").read_bytes()
    parts = [source / "part1.bin", source / "part2.bin"]
    parts[0].write_bytes(data[:1000])
    parts[1].write_bytes(data[1000:])
    spec = models.WeightSpec("tiny", ("p1", "p2"), "1.0", hashlib.sha256(data).hexdigest(), "tiny")
    monkeypatch.setitem(models.BUILTIN, "tiny", spec)
    monkeypatch.setattr(models, "ensure_installed", lambda spec: None)
    monkeypatch.setattr(models, "part_files", lambda spec: parts)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: _Tokenizer())
    monkeypatch.setenv("FSD_EXT_CACHE", str(tmp_path / "cache"))
    reference = AutoModelForCausalLM.from_pretrained(str(source), gguf_file="m.gguf", dtype=torch.float32)
    return "tiny", reference


def load(name, **kwargs):
    kwargs = {"dtype": torch.float32, "linear_weights": None, "cpu_linears": False, **kwargs}
    return models.load(name, **kwargs)[0]


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def shard(name: str, tensor: str, nonlinear: bool = False) -> Path:
    """The converted shard holding `tensor` (nonlinear: in the folder without the GGUF linears)."""
    import json

    folder = models.cache_dir() / (name + models.NONLINEAR_SUFFIX if nonlinear else name)
    index = json.loads((folder / (models.NONLINEAR_INDEX if nonlinear else "model.safetensors.index.json")).read_text())
    return folder / index["weight_map"][tensor]


def test_converted_folder_carries_digests_and_loads_as_the_gguf(builtin):
    name, reference = builtin
    model = load(name)
    assert torch.equal(logits(model), logits(reference))
    folder = models.cache_dir() / name
    manifest = cache_files.check_folder(folder, "all")
    assert len(manifest["shards"]) == 1 and "model.safetensors.index.json" in manifest["files"]
    cache_files.check_file(models.cache_dir() / "tiny.gguf")


@pytest.mark.parametrize("how", ["random", "zeroed", "truncated"])
def test_damaged_converted_shard_is_found_and_rebuilt(builtin, how):
    """Damage in a tensor the model uses: the warning names the shard, the folder is converted
    again and the model is the GGUF file's. (Before: loaded silently, or a safetensors error on
    every run.)"""
    name, reference = builtin
    load(name)
    path = shard(name, "model.layers.0.mlp.down_proj.weight")
    damage(path, how, at=0.6)
    with pytest.warns(cache_files.CacheWarning, match=path.name):
        model = load(name)
    assert torch.equal(logits(model), logits(reference))
    cache_files.check_folder(models.cache_dir() / name, "all")


def test_deleted_index_and_stale_tmp_folder_are_rebuilt(builtin):
    """(Before: a deleted index re-converted, then failed on every run with 'Directory not empty'.)"""
    name, reference = builtin
    load(name)
    folder = models.cache_dir() / name
    (folder / "model.safetensors.index.json").unlink()
    stale = cache_files.tmp_path(folder)
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"interrupted")
    with pytest.warns(cache_files.CacheWarning, match="model.safetensors.index.json: missing"):
        model = load(name)
    assert torch.equal(logits(model), logits(reference))
    assert not stale.exists()
    assert torch.equal(logits(load(name)), logits(reference))  # and on every later run


def test_gguf_linears_of_a_builtin_are_checked_and_rebuilt(builtin):
    """linear_weights="gguf": the repacked cache is rebuilt from the assembled file, whose sha256
    is checked before it is read (not on a load that finds the cache good)."""
    name, reference = builtin
    expected = logits(load(name, linear_weights="gguf", activations="float32"))  # (int8: not exact)
    assert (expected - logits(reference)).abs().max() < 1e-4
    cache = next((models.cache_dir() / "gguf-linears").glob("*.safetensors"))
    damage(cache, "random")
    assembled = models.cache_dir() / "tiny.gguf"
    damage(assembled, "random")  # found too: the rebuild reads it
    with pytest.warns(cache_files.CacheWarning) as warned:
        model = load(name, linear_weights="gguf", activations="float32")
    named = " ".join(str(w.message) for w in warned)
    assert cache.name in named and assembled.name in named
    assert torch.equal(logits(model), expected)


def test_a_second_failure_raises(builtin, monkeypatch):
    """Damage that a rebuild does not cure (here: digests that never match) is an error naming the
    file, not a loop."""
    name, _ = builtin
    load(name)
    damage(shard(name, "model.embed_tokens.weight"), "random", at=0.5)
    monkeypatch.setattr(cache_files, "sha256_bytes", lambda data: "0" * 64)
    with pytest.warns(cache_files.CacheWarning), \
            pytest.raises(cache_files.CorruptCache, match="again after converting it anew"):
        load(name)


def test_assembled_gguf_is_hashed_before_use(builtin):
    """Bit rot in the assembled GGUF file (size and modification time unchanged) is found by the
    full check and the file assembled again; verify=False trusts the stamp."""
    name, _ = builtin
    spec = models.BUILTIN[name]
    out = models.assemble_gguf(spec)
    good = out.read_bytes()
    damage(out, "zeroed")
    assert models.assemble_gguf(spec, verify=False) == out and out.read_bytes() != good
    with pytest.warns(cache_files.CacheWarning, match="tiny.gguf"):
        models.assemble_gguf(spec)
    assert out.read_bytes() == good


def test_two_first_conversions_convert_once(builtin, monkeypatch):
    name, _ = builtin
    calls = []
    convert = models._convert

    def counted(*args, **kwargs):
        calls.append(1)
        return convert(*args, **kwargs)

    monkeypatch.setattr(models, "_convert", counted)
    threads = [threading.Thread(target=models.resolve, args=(name,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    cache_files.check_folder(models.cache_dir() / name, "all")


# ----------------------------------------------------------------------------------------------
# Each weight stored once: a load with GGUF linears never converts the linear weights to float32.

def folder_tensors(folder: Path) -> set:
    return cache_files.folder_tensors(cache_files.read_manifest(folder))


def test_gguf_linears_load_converts_no_linear_weight(builtin):
    """(Before: the whole model was converted to float32, the linear weights never read.)"""
    name, reference = builtin
    model = load(name, linear_weights="gguf", activations="float32")
    nonlinear = models.cache_dir() / (name + models.NONLINEAR_SUFFIX)
    assert not (models.cache_dir() / name).exists()
    linear_weights = {f"{n}.weight" for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    stored = folder_tensors(nonlinear)
    assert stored and not stored & linear_weights
    assert "model.embed_tokens.weight" in stored and "model.layers.0.self_attn.q_proj.bias" in stored
    assert not any(p.is_meta for p in model.parameters())
    # the same model as the one built from the full float32 folder (the earlier way)
    full = load(name, linear_weights="gguf", activations="float32", convert=False)
    assert torch.equal(logits(model), logits(full))
    assert (logits(model) - logits(reference)).abs().max() < 1e-4


def test_full_folder_replaces_the_nonlinear_one(builtin):
    name, reference = builtin
    expected = logits(load(name, linear_weights="gguf", activations="float32"))
    assert models.resolve(name) == str(models.cache_dir() / name)
    assert not (models.cache_dir() / (name + models.NONLINEAR_SUFFIX)).exists()
    assert torch.equal(logits(load(name, linear_weights="gguf", activations="float32")), expected)
    assert not (models.cache_dir() / (name + models.NONLINEAR_SUFFIX)).exists()  # the full one serves
    assert torch.equal(logits(load(name)), logits(reference))


def test_transformers_refuses_the_nonlinear_folder(builtin):
    """A folder without its linear weights must not load as a model with random ones."""
    from transformers import AutoModelForCausalLM

    name, _ = builtin
    folder = models.resolve(name, linears=False)
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(folder)


def test_linears_the_file_does_not_give_fall_back_to_the_full_folder(builtin, monkeypatch):
    name, reference = builtin
    models.resolve(name, linears=False)
    monkeypatch.setattr(gguf_weights, "_TYPES", {})  # now no GGUF type is read as codes
    model = load(name, linear_weights="gguf", activations="float32")
    assert torch.equal(logits(model), logits(reference))
    assert (models.cache_dir() / name).exists()


# ----------------------------------------------------------------------------------------------
# `fsd-ext cache`.

def test_cache_command_lists_verifies_and_clears(builtin, capsys):
    name, _ = builtin
    load(name, linear_weights="gguf")
    (models.cache_dir() / "other.gguf.tmp").write_bytes(b"x")
    assert cli.main(["cache", "list"]) == 0
    listed = capsys.readouterr().out
    for kind in ("gguf", "nonlinear", "gguf-linears", "leftover"):
        assert f" {kind} " in listed
    assert "MB on disk" in listed
    assert cli.main(["cache", "clear", "other"]) == 0
    assert cli.main(["cache", "verify"]) == 0
    damage(shard(name, "model.embed_tokens.weight", nonlinear=True), "zeroed", at=0.7)
    capsys.readouterr()
    assert cli.main(["cache", "verify", name]) == 1
    assert "BAD" in capsys.readouterr().out
    assert cli.main(["cache", "clear", name]) == 0
    assert models.cached_artefacts() == []
