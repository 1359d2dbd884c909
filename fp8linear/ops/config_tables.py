"""Tuned launch configs for the blockwise FP8 GEMM: per-device tables read on the forward path.

Where a config comes from (first hit wins; :func:`lookup_config` only *reads*):

1. ``$FP8LINEAR_GEMM_TABLE``: an explicit table file (e.g. the output of ``fp8linear tune --out``),
   or ``off`` to use no table at all (the heuristic only);
2. the autotune cache, ``$FP8LINEAR_CACHE_DIR`` or ``~/.cache/fp8linear`` (``$XDG_CACHE_HOME``
   respected), one file per device, written by ``fp8linear tune`` (:mod:`fp8linear.tools.tune`);
3. the tables shipped in the package, ``fp8linear/ops/tuned_configs/<device>.json``.

Every source uses one JSON format (see :class:`ConfigTable`), keyed by device name, (N, K)
and an M bucket (powers of two 1..4096; 4096 stands for 4096 and above). A miss returns
``None`` and the router (:func:`fp8linear.ops.router.select_config`) falls back to its heuristic.
Nothing here launches a kernel; the tuner lives in :mod:`fp8linear.tools.tune`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .configs import GemmConfig, hip_arch

__all__ = [
    "TABLE_FORMAT",
    "TABLE_VERSION",
    "M_BUCKETS",
    "CACHE_DIR_ENV",
    "DEPRECATED_CACHE_ENV",
    "TABLE_ENV",
    "TABLES_OFF",
    "GRANULARITY_KEYS",
    "ConfigTable",
    "m_bucket",
    "table_filename",
    "shipped_table_path",
    "cache_dir",
    "cache_table_path",
    "load_table",
    "save_table",
    "device_name",
    "lookup_config",
    "clear_lookup_cache",
]

# Identifies a table file; bump TABLE_VERSION on incompatible changes to the layout.
TABLE_FORMAT = "fp8linear-gemm-configs"
TABLE_VERSION = 1
# M buckets: a GEMM with M rows uses the bucket of the next power of two, capped at 4096
# (prefill tiles are saturated by then; 4096 is the largest M of `fp8linear bench`).
M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_MAX_BUCKET = M_BUCKETS[-1]
# A missing bucket borrows a tuned neighbour at most this many buckets (a factor 4 in M) away.
MAX_BUCKET_DISTANCE = 2
CACHE_DIR_ENV = "FP8LINEAR_CACHE_DIR"
# The older name of CACHE_DIR_ENV, still read (with a DeprecationWarning) when CACHE_DIR_ENV is unset.
DEPRECATED_CACHE_ENV = "FP8LINEAR_CACHE"
TABLE_ENV = "FP8LINEAR_GEMM_TABLE"
# $FP8LINEAR_GEMM_TABLE values that switch every table off (heuristic only, e.g. for A/B runs).
TABLES_OFF = ("off", "none", "0")
# Weight granularities with their own entries; 'block' is the default key "N,K".
GRANULARITY_KEYS = ("block", "row", "tensor")
_SHIPPED_DIR = Path(__file__).resolve().parent / "tuned_configs"
_CONFIG_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
# AMD compiler options an entry may carry (AMD tables); written only where they differ from
# Triton's defaults, so NVIDIA tables keep exactly the fields above.
_AMD_FIELDS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
AMD_OPTION_DEFAULTS = {"waves_per_eu": 0, "matrix_instr_nonkdim": 0, "kpack": 1}
# Measurement fields an entry may carry besides the config (informational, never required).
_INFO_FIELDS = ("us", "heuristic_us", "tried")


# ----------------------------------------------------------------------------- keys
def m_bucket(m: int) -> int:
    """The M bucket of a GEMM with `m` rows: next power of two, clamped to [1, 4096]."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    b = 1 << (int(m) - 1).bit_length()
    return min(b, M_BUCKETS[-1])


def _shape_key(n: int, k: int, granularity: str = "block") -> str:
    if granularity not in GRANULARITY_KEYS:
        raise ValueError(f"granularity must be one of {GRANULARITY_KEYS}, got {granularity!r}")
    return f"{n},{k}" if granularity == "block" else f"{n},{k},{granularity}"


def _parse_shape_key(key: str) -> tuple[int, int, str]:
    parts = key.split(",")
    if len(parts) not in (2, 3):
        raise ValueError(f"shape key must be 'N,K' or 'N,K,granularity', got {key!r}")
    gran = parts[2] if len(parts) == 3 else "block"
    if gran not in GRANULARITY_KEYS:
        raise ValueError(f"unknown granularity {gran!r} in shape key {key!r}")
    n, k = int(parts[0]), int(parts[1])
    if n < 1 or k < 1:
        raise ValueError(f"N and K must be positive in shape key {key!r}")
    return n, k, gran


def table_filename(device: str) -> str:
    """File name of a device's table: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'."""
    stem = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    if not stem:
        raise ValueError(f"device name {device!r} has no usable characters")
    return stem + ".json"


def shipped_table_path(device: str) -> Path:
    return _SHIPPED_DIR / table_filename(device)


def cache_dir() -> Path:
    """The autotune cache folder: $FP8LINEAR_CACHE_DIR, else $XDG_CACHE_HOME/fp8linear, else ~/.cache/fp8linear."""
    env_dir = os.environ.get(CACHE_DIR_ENV, "")
    if not env_dir and os.environ.get(DEPRECATED_CACHE_ENV):
        warnings.warn(f"${DEPRECATED_CACHE_ENV} is deprecated; set ${CACHE_DIR_ENV} instead",
                      DeprecationWarning, stacklevel=2)
        env_dir = os.environ[DEPRECATED_CACHE_ENV]
    return _cache_dir_from(env_dir, os.environ.get("XDG_CACHE_HOME", ""))


def cache_table_path(device: str, directory: Path | None = None) -> Path:
    return (directory if directory is not None else cache_dir()) / table_filename(device)


# ----------------------------------------------------------------------------- tables
def _config_from_entry(entry: Mapping[str, Any]) -> GemmConfig:
    unknown = set(entry) - set(_CONFIG_FIELDS) - set(_AMD_FIELDS) - set(_INFO_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} in table entry {dict(entry)}")
    return GemmConfig(**{f: int(entry[f]) for f in _CONFIG_FIELDS + _AMD_FIELDS if f in entry})


def _entry_from_config(config: GemmConfig) -> dict[str, Any]:
    entry = {f: getattr(config, f) for f in _CONFIG_FIELDS}
    entry.update({f: getattr(config, f) for f in _AMD_FIELDS if getattr(config, f) != AMD_OPTION_DEFAULTS[f]})
    return entry


@dataclass
class ConfigTable:
    """One device's tuned configs.

    JSON layout::

        {"format": "fp8linear-gemm-configs", "version": 1, "device": "NVIDIA H100 80GB HBM3",
         "meta": {...free-form: versions, date, tool...},
         "shapes": {"18432,7168": {"1": {"block_m": 16, "block_n": 64, "block_k": 128,
                                          "group_m": 8, "num_warps": 4, "num_stages": 5,
                                          "us": 55.0, "heuristic_us": 61.2, "tried": 21},
                                    "4096": {...}},
                    "576,7168,row": {...}}}

    Shape keys are "N,K" (128x128 weights, also used for other granularities without an
    entry of their own) or "N,K,row" / "N,K,tensor"; bucket keys are the M buckets as strings.
    """

    device: str
    shapes: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"ConfigTable.device must be a non-empty string, got {self.device!r}")
        for key, buckets in self.shapes.items():
            _parse_shape_key(key)
            for bucket, entry in buckets.items():
                if bucket not in M_BUCKETS:
                    raise ValueError(f"M bucket {bucket} of shape {key} is not one of {M_BUCKETS}")
                _config_from_entry(entry)

    def set(
        self, n: int, k: int, bucket: int, config: GemmConfig, granularity: str = "block", **info: Any
    ) -> None:
        """Store `config` for (N, K, bucket) with optional measurements (us=, heuristic_us=, tried=)."""
        if bucket not in M_BUCKETS:
            raise ValueError(f"bucket must be one of {M_BUCKETS}, got {bucket}")
        bad = set(info) - set(_INFO_FIELDS)
        if bad:
            raise ValueError(f"unknown info fields {sorted(bad)}; allowed: {_INFO_FIELDS}")
        entry = _entry_from_config(config)
        entry.update({k_: v for k_, v in info.items() if v is not None})
        self.shapes.setdefault(_shape_key(n, k, granularity), {})[bucket] = entry

    def get(self, n: int, k: int, bucket: int, granularity: str = "block") -> GemmConfig | None:
        entry = self.shapes.get(_shape_key(n, k, granularity), {}).get(bucket)
        return None if entry is None else _config_from_entry(entry)

    def merge(self, other: ConfigTable) -> None:
        """Take every entry of `other` (same device), replacing ours where both have one."""
        if other.device != self.device:
            raise ValueError(f"cannot merge a table for {other.device!r} into one for {self.device!r}")
        for key, buckets in other.shapes.items():
            self.shapes.setdefault(key, {}).update({b: dict(e) for b, e in buckets.items()})

    def to_json(self) -> dict[str, Any]:
        shapes = {
            key: {str(b): self.shapes[key][b] for b in sorted(self.shapes[key])}
            for key in sorted(self.shapes, key=lambda s: _parse_shape_key(s))
        }
        return {
            "format": TABLE_FORMAT,
            "version": TABLE_VERSION,
            "device": self.device,
            "meta": self.meta,
            "shapes": shapes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConfigTable:
        if not isinstance(data, Mapping):
            raise ValueError(f"a config table must be a JSON object, got {type(data).__name__}")
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"not a {TABLE_FORMAT} table (format={data.get('format')!r})")
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"table version {data.get('version')!r} is not supported (expected {TABLE_VERSION})")
        shapes_in = data.get("shapes", {})
        if not isinstance(shapes_in, Mapping):
            raise ValueError("table 'shapes' must be an object")
        shapes = {
            str(key): {int(b): dict(e) for b, e in buckets.items()} for key, buckets in shapes_in.items()
        }
        return cls(device=str(data.get("device", "")), shapes=shapes, meta=dict(data.get("meta", {})))


def load_table(path: str | os.PathLike[str]) -> ConfigTable:
    """Read and validate a table file (ValueError on a malformed one, OSError if unreadable)."""
    with open(path, encoding="utf-8") as f:
        return ConfigTable.from_json(json.load(f))


def save_table(table: ConfigTable, path: str | os.PathLike[str]) -> Path:
    """Write `table` atomically (:func:`write_json_atomic`)."""
    path = write_json_atomic(table.to_json(), path)
    clear_lookup_cache()
    return path


def write_json_atomic(doc: Any, path: str | os.PathLike[str]) -> Path:
    """Write a JSON document: a temp file in the same folder, fsync, then rename over `path`; a
    failure leaves `path` as it was and no temp file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@lru_cache(maxsize=64)
def _read_table_entries(path: str, device: str) -> Mapping[str, Mapping[int, GemmConfig]]:
    """Parsed configs of one table file, or {} if it is missing, broken or for another device."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        table = load_table(p)
    except (OSError, ValueError, TypeError, KeyError) as e:
        warnings.warn(f"fp8linear: ignoring unreadable GEMM config table {p}: {e}", RuntimeWarning, stacklevel=3)
        return {}
    if table.device not in (device, "any"):
        return {}
    return {
        key: {b: _config_from_entry(e) for b, e in buckets.items()} for key, buckets in table.shapes.items()
    }


def _nearest_bucket(buckets: Mapping[int, GemmConfig], bucket: int) -> GemmConfig | None:
    if bucket in buckets:
        return buckets[bucket]
    i = M_BUCKETS.index(bucket)
    best: tuple[int, int] | None = None  # (distance, -bucket): ties prefer the larger M
    for b in buckets:
        d = abs(M_BUCKETS.index(b) - i)
        if d <= MAX_BUCKET_DISTANCE and (best is None or (d, -b) < best):
            best = (d, -b)
    return None if best is None else buckets[-best[1]]


def _cache_dir_from(env_dir: str, xdg: str) -> Path:
    if env_dir:
        return Path(env_dir).expanduser()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "fp8linear"


@lru_cache(maxsize=8192)
def _lookup(device: str, bucket: int, n: int, k: int, granularity: str) -> GemmConfig | None:
    env_table = os.environ.get(TABLE_ENV, "")
    if env_table.lower() in TABLES_OFF:
        return None
    try:
        cache_path = str(cache_table_path(device))
        shipped = str(shipped_table_path(device))
    except (RuntimeError, ValueError):  # no home directory for a cache, or an unusable device name
        return None
    sources = [p for p in (env_table, cache_path, shipped) if p]
    keys = [_shape_key(n, k, granularity)] if granularity == "block" else [
        _shape_key(n, k, granularity), _shape_key(n, k, "block")
    ]
    for key in keys:  # a granularity's own entry beats the block entry, in any source
        for src in sources:
            buckets = _read_table_entries(src, device).get(key)
            if buckets:
                cfg = _nearest_bucket(buckets, bucket)
                if cfg is not None:
                    return cfg
    return None


def lookup_config(device_name: str, m: int, n: int, k: int, granularity: str = "block") -> GemmConfig | None:
    """The tuned config for an (M, N, K) GEMM on `device_name`, or None if no table has one.

    Reads only (never tunes, never launches); parsed tables and results are cached, so a
    repeated call costs one cached-dict hit (~1 µs). $FP8LINEAR_GEMM_TABLE and the cache
    folder's variables are read on a cache miss: call :func:`clear_lookup_cache` after
    changing them. Safe inside CUDA-graph capture and torch.compile tracing.
    """
    if m < 1 or n < 1 or k < 1:
        return None
    bucket = min(1 << (m - 1).bit_length(), _MAX_BUCKET)  # m_bucket(m), inlined: this is a hot path
    return _lookup(device_name, bucket, n, k, granularity)


def clear_lookup_cache() -> None:
    """Forget parsed tables and lookup results (done automatically after :func:`save_table`)."""
    _lookup.cache_clear()
    _read_table_entries.cache_clear()


@lru_cache(maxsize=16)
def _cuda_device_name(index: int) -> str:
    if torch.version.hip is not None:  # AMD: the arch ('gfx942'), shared by MI300X/MI300A/MI325X
        return hip_arch(torch.cuda.get_device_properties(index).gcnArchName)
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str | int | None = None) -> str:
    """The name tables are keyed by: torch.cuda.get_device_name on NVIDIA, the arch name
    ('gfx942') on ROCm (both cached), 'cpu' for CPU devices."""
    if isinstance(device, int):
        return _cuda_device_name(device)
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return dev.type
    return _cuda_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
