"""Safe reading and writing of sharded safetensors checkpoints, one tensor (chunk) at a time.

* :func:`open_checkpoint` reads a Hugging Face model folder's index and shard headers (no tensor
  data), and refuses what it cannot handle safely: pickle checkpoints, missing or corrupt
  shards, index entries that leave the folder, tensors listed in the wrong shard.
* :class:`ShardReader` reads tensors or row ranges through ``safetensors.safe_open`` and reopens
  the file regularly, so the memory-mapped pages it touched do not pile up in RSS.
* :class:`ShardWriter` writes a safetensors file whose header is known up front: the data is
  written where it belongs as it is produced (``os.pwrite``), into a temporary name that is
  fsynced and renamed into place only when every byte is there.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from safetensors import safe_open

from ..checkpoint_format import path_in_checkpoint

__all__ = [
    "CheckpointError",
    "TensorInfo",
    "Checkpoint",
    "OutputSpec",
    "ShardReader",
    "ShardWriter",
    "PICKLE_SUFFIXES",
    "TMP_SUFFIX",
    "DTYPE_SIZES",
    "open_checkpoint",
    "safe_join",
    "atomic_write_bytes",
    "atomic_copy",
    "fsync_dir",
    "tensor_bytes",
    "iter_row_ranges",
    "list_tmp_files",
    "walk_regular_files",
    "check_output_path",
    "REOPEN_BYTES",
]

# File suffixes of pickle-based checkpoints, which are never read (arbitrary code execution).
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Suffix of files being written; they are renamed into place only when complete.
TMP_SUFFIX = ".fp8linear-tmp"
# Bytes per element of each safetensors dtype.
DTYPE_SIZES: Mapping[str, int] = MappingProxyType({
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
})  # fmt: skip
# The index file names safetensors checkpoints use (HF's name first).
INDEX_NAME = "model.safetensors.index.json"
# Reopen a shard after this many bytes were read through its memory map, to drop the mapped
# pages from RSS (the mapping, not the page cache, is what counts against the process).
REOPEN_BYTES = 32 * 2**20
# Alignment of the data section and of every tensor in files we write (safetensors pads to 8).
ALIGN = 8


class CheckpointError(Exception):
    """A problem with an input or output checkpoint; the message is one line and names the file/tensor."""


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor (any dtype, any dims) as a uint8 numpy array, no value conversion."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as listed in a shard's header."""

    name: str
    shard: str  # path relative to the checkpoint folder, POSIX separators
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES.get(self.dtype, 0)


@dataclass
class Checkpoint:
    """A validated safetensors checkpoint folder (headers only)."""

    root: Path
    shards: list[str]
    tensors: dict[str, TensorInfo]
    index: dict | None  # parsed index JSON, or None for a single file without index
    index_name: str | None
    config: dict | None  # parsed config.json
    other_files: list[str] = field(default_factory=list)  # relative paths to copy unchanged
    skipped_files: list[str] = field(default_factory=list)  # weight files not read (pickle, unindexed)

    def shard_tensors(self, shard: str) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.shard == shard]

    def shard_path(self, shard: str) -> Path:
        return self.root / shard

    def shard_size(self, shard: str) -> int:
        return self.shard_path(shard).stat().st_size

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_size(s) for s in self.shards)

    @property
    def quantization_config(self) -> dict | None:
        q = (self.config or {}).get("quantization_config")
        return q if isinstance(q, dict) else None


def safe_join(root: Path, rel: str, what: str = "path") -> Path:
    """`root / rel` by :func:`fp8linear.checkpoint_format.path_in_checkpoint` (links unresolved),
    its refusal raised as a CheckpointError."""
    try:
        return path_in_checkpoint(root, rel, what)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _read_header(path: Path, shard: str) -> list[TensorInfo]:
    try:
        with safe_open(str(path), framework="pt") as f:
            infos = []
            for name in f.keys():
                sl = f.get_slice(name)
                infos.append(TensorInfo(name, shard, sl.get_dtype(), tuple(int(d) for d in sl.get_shape())))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard not found") from None
    except Exception as exc:  # safetensors raises SafetensorError / OSError / others for bad files
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: not a valid safetensors file ({msg})") from None
    for t in infos:
        if t.dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {t.name!r} has unsupported dtype {t.dtype}")
    return infos


def _load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _walk_files(root: Path) -> list[str]:
    """Relative POSIX paths of regular files under root, skipping hidden entries (.git, .cache)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            full = Path(dirpath) / fn
            if full.is_file():  # follows symlinked files (Hugging Face cache snapshots)
                out.append(full.relative_to(root).as_posix())
    return sorted(out)


def _is_pickle(rel: str) -> bool:
    name = rel.lower()
    return name.endswith(PICKLE_SUFFIXES) or name.endswith(tuple(s + ".index.json" for s in PICKLE_SUFFIXES))


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Validate a checkpoint folder (or a single ``.safetensors`` file) and read its headers."""
    root = Path(path)
    single_file = None
    if root.is_file():
        if root.suffix != ".safetensors":
            raise CheckpointError(f"{root}: not a safetensors file or model folder")
        single_file, root = root.name, root.parent
    elif not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder")
    files = [single_file] if single_file else _walk_files(root)
    index_files = [f for f in files if f.endswith(".safetensors.index.json")]
    safetensor_files = [f for f in files if f.endswith(".safetensors")]
    pickles = [f for f in files if _is_pickle(f)]
    if not safetensor_files and not index_files:
        if pickles:
            raise CheckpointError(
                f"{root / pickles[0]}: pickle checkpoints (.bin/.pt/.pth) are not supported, only "
                "safetensors; convert it first (e.g. transformers' save_pretrained(safe_serialization=True))"
            )
        raise CheckpointError(f"{root}: no *.safetensors files found")

    index = None
    index_name = None
    if len(index_files) > 1:
        if INDEX_NAME not in index_files:
            raise CheckpointError(f"{root}: several safetensors index files {index_files}; keep one")
        index_files = [INDEX_NAME]
    if index_files:
        index_name = index_files[0]
        index = _load_json(root / index_name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{root / index_name}: missing or empty 'weight_map'")
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise CheckpointError(f"{root / index_name}: tensor {tensor!r} maps to {shard!r}, not a file name")
            target = safe_join(root, shard, f"{root / index_name}: shard of {tensor!r}")
            if not target.is_file():
                raise CheckpointError(f"{root / index_name}: lists missing shard {shard!r} (for tensor {tensor!r})")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(safetensor_files)

    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for info in _read_header(safe_join(root, shard, "shard"), shard):
            if info.name in tensors:
                raise CheckpointError(
                    f"{root / shard}: tensor {info.name!r} also in {tensors[info.name].shard}; duplicate names"
                )
            tensors[info.name] = info
    if index is not None:
        for tensor, shard in index["weight_map"].items():
            found = tensors.get(tensor)
            if found is None or found.shard != shard:
                raise CheckpointError(
                    f"{root / index_name}: tensor {tensor!r} is listed in {shard!r} but is not in that shard"
                )

    config = _load_json(root / "config.json") if (root / "config.json").is_file() else None
    skipped = sorted(set(pickles) | {f for f in safetensor_files if f not in shards})
    used = set(shards) | set(skipped) | ({index_name} if index_name else set())
    other = [] if single_file else [f for f in files if f not in used and f != "config.json" and not _is_pickle(f)]
    return Checkpoint(root, shards, tensors, index, index_name, config, other, skipped)


class ShardReader:
    """Reads tensors (or ranges along their first dims) from one shard via ``safe_open``.

    The file is reopened after :data:`REOPEN_BYTES` bytes were read, which unmaps the pages read
    so far: RSS stays near one chunk no matter how large the shard is.
    """

    def __init__(self, path: Path, reopen_bytes: int = REOPEN_BYTES):
        self.path = path
        self.reopen_bytes = reopen_bytes
        self._handle = None
        self._read = 0

    def _file(self):
        if self._handle is None or self._read >= self.reopen_bytes:
            self.close()
            try:
                self._handle = safe_open(str(self.path), framework="pt")
            except Exception as exc:  # safetensors raises several types for unreadable files
                raise CheckpointError(f"{self.path}: cannot open ({str(exc).splitlines()[0]})") from None
            self._read = 0
        return self._handle

    def read(self, name: str, index: tuple | None = None) -> torch.Tensor:
        """The tensor `name`, or `tensor[index]` (basic slices / ints on the leading dims), as a copy."""
        f = self._file()
        try:
            if index is None:
                t = f.get_tensor(name)
            else:
                t = f.get_slice(name)[index]
        except Exception as exc:  # SafetensorError for missing names / truncated data
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r} ({str(exc).splitlines()[0]})") from None
        t = t.clone()  # own the memory, so the mapping can be dropped
        self._read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class OutputSpec:
    """A tensor of an output shard: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * DTYPE_SIZES[self.dtype]


def _layout(specs: Sequence[OutputSpec], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """(header bytes incl. the 8-byte length prefix, name -> absolute data offset in the file).

    Tensors are laid out like safetensors' own writer: largest element size first, then by name,
    so every tensor is aligned to its element size.
    """
    ordered = sorted(specs, key=lambda s: (-DTYPE_SIZES[s.dtype], s.name))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    rel: dict[str, int] = {}
    for s in ordered:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        rel[s.name] = offset
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % ALIGN)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, {name: len(prefix) + off for name, off in rel.items()}


class ShardWriter:
    """Writes one safetensors file with a known list of tensors, atomically.

    ``write(name, offset, data)`` puts bytes of tensor `name` at byte `offset` within that tensor,
    in any order; ``commit()`` checks every byte was written, fsyncs and renames the temporary
    file into place. Leaving the ``with`` block on an exception deletes the temporary file.
    """

    def __init__(self, path: Path, specs: Sequence[OutputSpec], metadata: dict[str, str] | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{path}: duplicate output tensor names")
        self.path = path
        self.tmp_path = path.with_name("." + path.name + TMP_SUFFIX)
        self.specs = {s.name: s for s in specs}
        self.header, self.offsets = _layout(specs, metadata or {"format": "pt"})
        self.size = len(self.header) + sum(s.nbytes for s in specs)
        self._written = {s.name: 0 for s in specs}
        self._fd: int | None = None

    def __enter__(self) -> ShardWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_path.unlink(missing_ok=True)
        # O_EXCL | O_NOFOLLOW: never write through a file or link that someone else put there
        self._fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self._pwrite(self.header, 0)
        return self

    def _pwrite(self, data: bytes | memoryview | np.ndarray, pos: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            try:
                n = os.pwrite(self._fd, view, pos)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: write failed ({exc.strerror or exc})") from None
            view, pos = view[n:], pos + n

    def write(self, name: str, offset: int, data: np.ndarray | torch.Tensor) -> None:
        """Write bytes of tensor `name` starting `offset` bytes into it."""
        buf = tensor_bytes(data) if isinstance(data, torch.Tensor) else data
        spec = self.specs[name]
        if offset < 0 or offset + buf.nbytes > spec.nbytes:
            raise CheckpointError(f"{self.path}: write of {buf.nbytes} bytes at {offset} overflows tensor {name!r}")
        self._pwrite(buf, self.offsets[name] + offset)
        self._written[name] += buf.nbytes

    def commit(self) -> None:
        for name, n in self._written.items():
            if n != self.specs[name].nbytes:
                raise CheckpointError(f"{self.path}: tensor {name!r} got {n} of {self.specs[name].nbytes} bytes")
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)

    def is_complete_on_disk(self) -> bool:
        """True if `path` already holds exactly this file's header and size (a finished earlier run)."""
        try:
            if self.path.is_symlink() or self.path.stat().st_size != self.size:
                return False
            with open(self.path, "rb") as f:
                return f.read(len(self.header)) == self.header
        except OSError:
            return False

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if exc_type is not None:
            self.tmp_path.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name next to `path`, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + TMP_SUFFIX)
    try:
        tmp.unlink(missing_ok=True)
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from None


def atomic_copy(src: Path, dst: Path, chunk: int = 16 * 2**20) -> None:
    """Copy a file's bytes to `dst` through a temporary name (16 MiB at a time)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name("." + dst.name + TMP_SUFFIX)
    try:
        tmp.unlink(missing_ok=True)
        with open(src, "rb") as fi, open(tmp, "xb") as fo:
            while block := fi.read(chunk):
                fo.write(block)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"copying {src} -> {dst} failed ({exc.strerror or exc})") from None


def iter_row_ranges(rows: int, step: int) -> Iterator[tuple[int, int]]:
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def walk_regular_files(root: Path) -> Iterator[Path]:
    """Regular files under `root` (symlinks listed but never followed into other folders)."""
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for fn in filenames:
            yield Path(dirpath) / fn


def list_tmp_files(root: Path) -> list[Path]:
    return [p for p in walk_regular_files(root) if p.name.endswith(TMP_SUFFIX)]


def check_output_path(root: Path, rel: str, what: str = "output") -> Path:
    """`root / rel` for writing: inside root, and no folder on the way is a symlink."""
    path = safe_join(root, rel, what)
    parent = path.parent
    while parent != root and parent != parent.parent:
        if parent.is_symlink():
            raise CheckpointError(f"{parent}: is a symlink; refusing to write {rel!r} through it")
        parent = parent.parent
    return path
