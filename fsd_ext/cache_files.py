"""Files of the weight cache that prove themselves (models.py, cpu_linear/gguf_weights.py).

Every artefact is written under a temporary name (`<name>.tmp`), flushed and fsynced (the file, then
its folder), renamed into place, and its digest is written last, so that a crash leaves either no
artefact, a stale `.tmp` (removed by the next build), or an artefact without a digest (rebuilt).
Builders hold `lock(path)` (fcntl.flock on `<name>.lock`): a second process or thread converting the
same model waits, then finds the finished artefact. Digests are sha256 (hashlib: 0.75 s per GB in
memory on the project's 2-core Xeon, with SHA instructions, where blake2b took 1.4 s). A digest that differs, a missing or
truncated file: CorruptCache, which the loaders turn into a warning naming the file, delete the
artefact and build it again once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import warnings
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Tuple

ALGORITHM = "sha256"
CHUNK = 4 << 20


class CorruptCache(RuntimeError):
    """A cached artefact whose bytes are not the ones written (names the file and what differs)."""


class CacheWarning(RuntimeWarning):
    """A cached artefact was found damaged and is being rebuilt."""


def warn_rebuild(error: Exception) -> None:
    warnings.warn(f"{error}; deleting it and building it again", CacheWarning, stacklevel=3)


def sha256_file(path: Path, start: int = 0, length: int = -1) -> str:
    """sha256 of `length` bytes of `path` from `start` (-1: to the end), read in 4 MiB chunks."""
    digest, buffer = hashlib.new(ALGORITHM), bytearray(CHUNK)
    view, left = memoryview(buffer), length
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        while left:
            n = handle.readinto(view if left < 0 else view[:min(CHUNK, left)])
            if not n:
                if left > 0:
                    raise CorruptCache(f"{path}: ends {left} bytes early")
                break
            digest.update(view[:n])
            left = left - n if left > 0 else left
    return digest.hexdigest()


def sha256_bytes(data) -> str:
    return hashlib.new(ALGORITHM, memoryview(data).cast("B")).hexdigest()


# ----------------------------------------------------------------------------------------------
# Writing.

def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def remove(path: Path) -> None:
    """Delete a file or a folder (tree); nothing if it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def commit(tmp: Path, path: Path) -> None:
    """Rename the written `tmp` (a file or a folder, its contents fsynced) to `path`, durably."""
    if tmp.is_dir():
        fsync_dir(tmp)
        remove(path)  # (a damaged folder being replaced: os.replace cannot overwrite a folder)
    else:
        fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """`path` <- text: written to `path.tmp`, fsynced, renamed."""
    tmp = tmp_path(path)
    tmp.write_text(text)
    commit(tmp, path)


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for building `path` (fcntl.flock on `<path>.lock`, released on exit or
    when the process dies); stale `<path>.tmp` leftovers are removed once it is held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            remove(tmp_path(path))
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------
# A single file with its digest beside it: <file>.sha256 holds {"size", "sha256"}.

def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def write_file_digest(path: Path, sha256: Optional[str] = None) -> None:
    """After `path` is committed: its digest (`sha256` if the writer hashed the bytes it wrote, else
    read back), size and modification time, written last."""
    stat = path.stat()
    record = {"algorithm": ALGORITHM, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "sha256": sha256 or sha256_file(path)}
    write_text(digest_path(path), json.dumps(record) + "\n")


def read_digest(path: Path) -> Optional[dict]:
    """The record write_file_digest wrote for `path`, or None (none, or unreadable)."""
    try:
        record = json.loads(digest_path(path).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("sha256"), str) else None
    except (OSError, ValueError):
        return None


def unchanged(path: Path, record: Optional[dict]) -> bool:
    """Whether `path` has the size and modification time its digest record saw (a cheap stamp,
    for files read only when something is built from them)."""
    stat = path.stat()
    return record is not None and [record.get("size"), record.get("mtime_ns")] == [stat.st_size, stat.st_mtime_ns]


def check_file(path: Path, expected: Optional[str] = None) -> None:
    """Raise CorruptCache unless `path`'s bytes hash to `expected` (default: its digest file's)."""
    record = read_digest(path)
    if expected is None:
        if record is None:
            raise CorruptCache(f"{path}: no digest file {digest_path(path).name} (written by an older "
                               f"fsd-ext, or interrupted)")
        expected, size = record["sha256"], record.get("size")
        if path.stat().st_size != size:
            raise CorruptCache(f"{path}: {path.stat().st_size} bytes, {size} written (truncated or overwritten)")
    actual = sha256_file(path)
    if actual != expected:
        raise CorruptCache(f"{path}: its sha256 is {actual[:12]}.., not the {expected[:12]}.. expected "
                           f"(damaged on disk)")


# ----------------------------------------------------------------------------------------------
# A folder of files and safetensors shards, its manifest written last (fsd_ext_digests.json):
# small files are hashed whole; a shard's header whole and each tensor on its own, so that a
# loader can check the tensors a model uses without reading the ones it does not.

MANIFEST = "fsd_ext_digests.json"
MANIFEST_FORMAT = "fsd_ext.folder/1"


def safetensors_layout(path: Path) -> Tuple[int, Dict[str, Tuple[int, int]]]:
    """-> (bytes before the data, {tensor name: (start, end) in the file}) from a shard's header."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise CorruptCache(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > path.stat().st_size:
            raise CorruptCache(f"{path}: header length {length} beyond the file")
        try:
            header = json.loads(handle.read(length))
            spans = {name: tuple(int(x) + 8 + length for x in entry["data_offsets"])
                     for name, entry in header.items() if name != "__metadata__"}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CorruptCache(f"{path}: unreadable safetensors header") from None
    return 8 + length, spans


def write_manifest(folder: Path, tensor_digests: Dict[str, str]) -> None:
    """After every file of `folder` is written: the manifest. tensor_digests: the sha256 of each
    tensor's bytes as the writer held them (not read back)."""
    files, shards = {}, {}
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        fsync_file(path)
        if path.suffix == ".safetensors":
            header, spans = safetensors_layout(path)
            shards[path.name] = {"size": path.stat().st_size, "header": sha256_file(path, 0, header),
                                 "tensors": {name: tensor_digests[name] for name in spans}}
        else:
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "files": files, "shards": shards}
    write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        raise CorruptCache(f"{folder}: no readable {MANIFEST} (converted by an older fsd-ext, or "
                           f"interrupted)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptCache(f"{folder / MANIFEST}: not a {MANIFEST_FORMAT} manifest")
    return manifest


def check_folder(folder: Path, tensors: Iterable[str] = ()) -> dict:
    """Check `folder` against its manifest: every file's size, the small files' and shard headers'
    digests, and the digests of `tensors` (names; "all": every tensor). -> the manifest.
    Raises CorruptCache naming the first file that differs."""
    manifest = read_manifest(folder)
    for name, entry in {**manifest["files"], **manifest["shards"]}.items():
        path = folder / name
        if not path.is_file():
            raise CorruptCache(f"{path}: missing")
        if path.stat().st_size != entry["size"]:
            raise CorruptCache(f"{path}: {path.stat().st_size} bytes, {entry['size']} written "
                               f"(truncated or overwritten)")
    for name, entry in manifest["files"].items():
        if sha256_file(folder / name) != entry["sha256"]:
            raise CorruptCache(f"{folder / name}: its sha256 differs from the one written")
    wanted = None if tensors == "all" else set(tensors)
    for name, entry in manifest["shards"].items():
        path = folder / name
        header, spans = safetensors_layout(path)
        if sha256_file(path, 0, header) != entry["header"] or spans.keys() != entry["tensors"].keys():
            raise CorruptCache(f"{path}: its safetensors header differs from the one written")
        for tensor, digest in entry["tensors"].items():
            if wanted is None or tensor in wanted:
                start, end = spans[tensor]
                if sha256_file(path, start, end - start) != digest:
                    raise CorruptCache(f"{path}: tensor {tensor} differs from the one written")
    return manifest


def folder_tensors(manifest: dict) -> set:
    return {name for entry in manifest["shards"].values() for name in entry["tensors"]}


def size_on_disk(path: Path) -> int:
    """Bytes allocated to a file or a folder's files."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in paths if p.exists())
