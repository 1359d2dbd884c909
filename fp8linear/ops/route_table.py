"""Measured kernel choices: which kernel ran fastest for a weight shape (N, K) at a given M, per GPU.

The router (:mod:`fp8linear.ops.router`) consults these tables before its heuristic. One JSON file
per GPU model in ``fp8linear/ops/tuned_configs/routes/``, written by ``fp8linear tune-routes``
(:mod:`fp8linear.tools.route_tune`), which times every candidate kernel (cuBLAS blockwise, our
tiled kernel at several tiles, our split-K kernel at several tiles and splits, and the optional
kernels: CUTLASS's where built, the warp-specialized Gluon kernel where it runs) per (N, K, M) under
CUDA graphs and keeps the fastest (an optional kernel only by a margin, with the fastest other
kernel as its fallback). Format::

    {"format": "fp8linear-routes", "version": 1, "device": "NVIDIA H100 80GB HBM3", "meta": {...},
     "routes": {"N,K": {"M": {"kernel": "splitk", "block_m": 64, "block_n": 64, "split_k": 5,
                               "num_warps": 4, "num_stages": 4, "us": 12.1, "bf16_us": 13.0}, ...}},
     "row_routes": {"N,K": {...}}}

``routes`` holds 128x128-block weights (the checkpoint format), the optional ``row_routes`` 1x128
row-wise weights (measured apart: their scales cost our kernels and cuBLAS differently);
per-tensor weights use the heuristic.

``kernel`` is ``cublas`` (with an optional ``workspace_mib``, ``row_scales`` and ``algo_m``, a
:class:`~fp8linear.ops.cublas_gemm.CublasConfig`), ``tiled`` (a
:class:`~fp8linear.ops.configs.GemmConfig`), ``splitk`` (a
:class:`~fp8linear.ops.configs.SplitKConfig`), ``cutlass`` (``tile_m`` and optional ``stream_k``,
``splits`` and ``tile_n``, a :class:`~fp8linear.ops.cutlass_gemm.CutlassConfig`) or ``ws`` (``stages`` and optional ``block_n``,
``group_m``, ``persistent`` and ``tail_split``, a :class:`~fp8linear.ops.ws_gemm.WsConfig`). The optional kernels'
entries (OPTIONAL_KERNELS) carry ``fallback``: the entry of the fastest other kernel, which runs where
the CUTLASS library is not built, where the warp-specialized kernel cannot run (no Gluon with warp
specialization, eager calls, operands TMA cannot address). An entry whose kernel, or fallback, is
cuBLAS also carries ``ours``: the fastest of our Triton kernels in that case (tiled or split-K, or
the warp-specialized kernel with the faster of those as its fallback), which runs where cuBLAS may
not (backend "triton", eager calls below the eager cuBLAS cut). A GEMM with M rows uses the entry measured at
the smallest M at or above its own within a factor MAX_M_RATIO, else at the largest M below it
within that factor; otherwise there is no entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .config_tables import table_filename
from .configs import GemmConfig, SplitKConfig
from .cublas_gemm import CublasConfig
from .cutlass_gemm import CUTLASS_TILE_N, CutlassConfig, configs_for
from .ws_gemm import WsConfig

__all__ = ["ROUTES_FORMAT", "ROUTES_VERSION", "MAX_M_RATIO", "ROUTE_KERNELS", "OPTIONAL_KERNELS", "OURS_KERNELS",
           "ROUTE_SECTIONS", "RouteEntry", "routes_dir", "routes_path", "parse_entry", "parse_routes", "lookup_route",
           "entry_to_json", "table_ms", "route_label"]

ROUTES_FORMAT = "fp8linear-routes"
ROUTES_VERSION = 1
# An entry serves M within this factor of the M it was measured at (entries sit at most 1.5x apart).
MAX_M_RATIO = 1.5
ROUTE_KERNELS = ("cublas", "tiled", "splitk", "cutlass", "ws")
# Kernels that may be missing where a table is read: their entries name a fallback entry.
OPTIONAL_KERNELS = ("cutlass", "ws")
# The kernels an entry's ``ours`` may name: our Triton kernels (the warp-specialized one with a tiled
# or split-K fallback, as an optional kernel's entry).
OURS_KERNELS = ("tiled", "splitk", "ws")
# The table section of each weight granularity that has one.
ROUTE_SECTIONS = {"block": "routes", "row": "row_routes"}
_DIR = Path(__file__).resolve().parent / "tuned_configs" / "routes"


@dataclass(frozen=True)
class RouteEntry:
    """One measured choice: the kernel and its launch config; an optional kernel's entry (CUTLASS,
    warp-specialized) also names the fastest other kernel (`fallback`, never an optional kernel's),
    and an entry that runs cuBLAS (itself or as its fallback) the fastest of our kernels (`ours`)."""

    kernel: str
    config: GemmConfig | SplitKConfig | CublasConfig | CutlassConfig | WsConfig | None = None
    fallback: RouteEntry | None = None
    ours: RouteEntry | None = None


def routes_dir() -> Path:
    return _DIR


def routes_path(device_name: str, directory: Path | None = None) -> Path:
    """Table file of a GPU model, named as its tuned-config table: NVIDIA_H100_80GB_HBM3.json."""
    return (directory or _DIR) / table_filename(device_name)


def _entry(raw: Any, where: str) -> RouteEntry:
    entry = _kernel_entry(raw, where)
    ours = raw.get("ours")
    if ours is None:
        return entry
    if not isinstance(ours, dict) or ours.get("kernel") not in OURS_KERNELS:
        raise ValueError(f"{where}: an entry's ours is an entry of a kernel in {OURS_KERNELS}, got {ours!r}")
    ours_entry = _kernel_entry(ours, f"{where}.ours")
    if ours_entry.fallback is not None and ours_entry.fallback.kernel not in OURS_KERNELS:
        raise ValueError(f"{where}.ours: its fallback is an entry of a kernel in {OURS_KERNELS}, got {ours!r}")
    return replace(entry, ours=ours_entry)


def parse_entry(raw: Any, where: str = "routes table entry") -> RouteEntry:
    """One entry of a table's JSON (its kernel, config, fallback and ours); ValueError naming what is wrong."""
    return _entry(raw, where)


def _typed_field(raw: dict, name: str, default: Any, kind: type) -> Any:
    """raw[name] (else `default`), which must be a JSON bool or integer (`kind`), exactly."""
    value = raw.get(name, default)
    if type(value) is not kind:
        raise ValueError(f"{name} must be {'true or false' if kind is bool else 'an integer'}, got {value!r}")
    return value


def _kernel_entry(raw: Any, where: str) -> RouteEntry:
    if not isinstance(raw, dict) or raw.get("kernel") not in ROUTE_KERNELS:
        raise ValueError(f"{where}: an entry is an object with kernel in {ROUTE_KERNELS}, got {raw!r}")
    kernel = raw["kernel"]
    try:
        if kernel == "tiled":
            return RouteEntry(kernel, GemmConfig(block_m=int(raw["block_m"]), block_n=int(raw["block_n"]),
                                                 block_k=int(raw.get("block_k", 128)), group_m=int(raw.get("group_m", 8)),
                                                 num_warps=int(raw["num_warps"]), num_stages=int(raw["num_stages"])))
        if kernel in OPTIONAL_KERNELS:
            fallback = raw["fallback"]
            if not isinstance(fallback, dict) or fallback.get("kernel") in OPTIONAL_KERNELS:
                raise ValueError(f"a {kernel} entry's fallback is an entry of a kernel not in {OPTIONAL_KERNELS}, "
                                 f"got {fallback!r}")
        if kernel == "ws":
            return RouteEntry(kernel, WsConfig(block_n=int(raw.get("block_n", 128)), stages=int(raw["stages"]),
                                               group_m=int(raw.get("group_m", 8)),
                                               persistent=_typed_field(raw, "persistent", False, bool),
                                               tail_split=_typed_field(raw, "tail_split", 1, int)),
                              _entry(raw["fallback"], f"{where}.fallback"))
        if kernel == "cutlass":
            config = CutlassConfig(tile_m=int(raw["tile_m"]), stream_k=_typed_field(raw, "stream_k", False, bool),
                                   splits=_typed_field(raw, "splits", 1, int),
                                   tile_n=_typed_field(raw, "tile_n", 128, int))
            return RouteEntry(kernel, config, _entry(raw["fallback"], f"{where}.fallback"))
        if kernel == "splitk":
            return RouteEntry(kernel, SplitKConfig(block_m=int(raw["block_m"]), block_n=int(raw["block_n"]),
                                                   split_k=int(raw["split_k"]), num_warps=int(raw["num_warps"]),
                                                   num_stages=int(raw["num_stages"])))
        if "workspace_mib" in raw or "row_scales" in raw or "algo_m" in raw:
            config = CublasConfig(workspace_mib=_typed_field(raw, "workspace_mib", CublasConfig.workspace_mib, int),
                                  row_scales=_typed_field(raw, "row_scales", False, bool),
                                  algo_m=_typed_field(raw, "algo_m", 0, int))
            return RouteEntry(kernel, config)
    except KeyError as e:
        raise ValueError(f"{where}: a {kernel} entry needs field {e.args[0]!r}, got {raw!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return RouteEntry(kernel)


def entry_to_json(entry: RouteEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"kernel": entry.kernel}
    c = entry.config
    if isinstance(c, GemmConfig):
        out.update(block_m=c.block_m, block_n=c.block_n, block_k=c.block_k, group_m=c.group_m,
                   num_warps=c.num_warps, num_stages=c.num_stages)
    elif isinstance(c, SplitKConfig):
        out.update(block_m=c.block_m, block_n=c.block_n, split_k=c.split_k, num_warps=c.num_warps,
                   num_stages=c.num_stages)
    elif isinstance(c, CublasConfig):
        out.update(workspace_mib=c.workspace_mib)
        if c.row_scales:
            out.update(row_scales=True)
        if c.algo_m:
            out.update(algo_m=c.algo_m)
    elif isinstance(c, WsConfig):
        out.update(block_n=c.block_n, stages=c.stages, group_m=c.group_m)
        if c.persistent:
            out.update(persistent=True)
        if c.tail_split > 1:
            out.update(tail_split=c.tail_split)
    elif isinstance(c, CutlassConfig):
        out.update(tile_m=c.tile_m)
        if c.tile_n != CUTLASS_TILE_N:
            out.update(tile_n=c.tile_n)
        if c.stream_k:
            out.update(stream_k=True)
        if c.splits > 1:
            out.update(splits=c.splits)
    if entry.fallback is not None:
        out.update(fallback=entry_to_json(entry.fallback))
    if entry.ours is not None:
        out.update(ours=entry_to_json(entry.ours))
    return out


def route_label(kernel: str, config: Any) -> str:
    """The short name of a kernel and its config, as tune-routes logs candidates and bench rows record
    the route that ran (e.g. ``tiled:64x128x128w4s3g8``, ``splitk:64x64x5w4s4``, ``cublas:ws32:row``,
    ``cutlass:128x64``, ``ws:128s4g8pt4``); the kernel's name alone for its default config."""
    if config is None:
        return kernel
    if kernel == "cublas":
        return (f"cublas:ws{config.workspace_mib}" + (":row" if config.row_scales else "")
                + (f":a{config.algo_m}" if config.algo_m else ""))
    if kernel in ("splitk", "decode"):
        return (f"{kernel}:{config.block_m}x{config.block_n}x{config.split_k}w{config.num_warps}"
                f"s{config.num_stages}")
    if kernel == "cutlass":
        return (f"cutlass:{config.tile_m}" + (f"x{config.tile_n}" if config.tile_n != CUTLASS_TILE_N else "")
                + (f"k{config.splits}" if config.splits > 1 else "sk" if config.stream_k else ""))
    if kernel == "ws":
        return (f"ws:{config.block_n}s{config.stages}g{config.group_m}" + ("p" if config.persistent else "")
                + (f"t{config.tail_split}" if config.tail_split > 1 else ""))
    if kernel == "gemv":
        return f"gemv:{config.block_n}g{config.groups_per_step}w{config.num_warps}s{config.num_stages}"
    return (f"{kernel}:{config.block_m}x{config.block_n}x{config.block_k}w{config.num_warps}s{config.num_stages}"
            f"g{config.group_m}")


def parse_routes(doc: Any, source: str = "routes table",
                 granularity: str = "block") -> dict[tuple[int, int], dict[int, RouteEntry]]:
    """{(N, K): {M: RouteEntry}} of one granularity's section (ROUTE_SECTIONS) of a table's JSON
    document ({} where an optional section is absent); ValueError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("format") != ROUTES_FORMAT:
        raise ValueError(f"{source}: not a {ROUTES_FORMAT!r} file")
    if doc.get("version") != ROUTES_VERSION:
        raise ValueError(f"{source}: version {doc.get('version')!r}, this fp8linear reads {ROUTES_VERSION}")
    if granularity not in ROUTE_SECTIONS:
        raise ValueError(f"{source}: tables hold granularities {tuple(ROUTE_SECTIONS)}, got {granularity!r}")
    section = ROUTE_SECTIONS[granularity]
    routes = doc.get(section, None if granularity == "block" else {})
    if not isinstance(routes, dict):
        raise ValueError(f"{source}: {section!r} must be an object, got {type(routes).__name__}")
    out: dict[tuple[int, int], dict[int, RouteEntry]] = {}
    for key, per_m in routes.items():
        try:
            n, k = (int(v) for v in key.split(","))
        except ValueError:
            raise ValueError(f"{source}: shape key must be 'N,K', got {key!r}") from None
        if not isinstance(per_m, dict):
            raise ValueError(f"{source}: {section}[{key!r}] must be an object of M -> entry")
        entries: dict[int, RouteEntry] = {}
        for m_text, raw in per_m.items():
            if not str(m_text).isdigit() or int(m_text) < 1:
                raise ValueError(f"{source}: {section}[{key!r}] has M key {m_text!r}, expected a positive integer")
            entry = entries[int(m_text)] = _entry(raw, f"{source}: {section}[{key!r}][{m_text!r}]")
            if entry.kernel == "cutlass" and entry.config.kernel not in configs_for(granularity):
                raise ValueError(f"{source}: {section}[{key!r}][{m_text!r}] names CUTLASS kernel {entry.config.name}, "
                                 f"not built for {granularity} weights (built: "
                                 f"{[c.name for c in configs_for(granularity)]})")
        out[(n, k)] = entries
    return out


@lru_cache(maxsize=8)
def _table(device_name: str, granularity: str) -> dict[tuple[int, int], dict[int, RouteEntry]]:
    path = routes_path(device_name)
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return parse_routes(json.load(f), str(path), granularity)


@lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_ms(device: torch.device, n: int, k: int, granularity: str) -> tuple[int, ...]:
    """The Ms this GPU's table has entries at for the shape (N, K) and granularity, ascending (none:
    no table, section or shape)."""
    if device.type != "cuda" or granularity not in ROUTE_SECTIONS or torch.version.hip is not None:
        return ()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(sorted(_table(_device_name(index), granularity).get((n, k), {})))


def lookup_route(device: torch.device, m: int, n: int, k: int, granularity: str) -> RouteEntry | None:
    """The measured choice for this GEMM on `device`, or None (no table, shape or nearby M)."""
    if device.type != "cuda" or granularity not in ROUTE_SECTIONS or torch.version.hip is not None:
        return None
    return _lookup(_device_name(device.index if device.index is not None else torch.cuda.current_device()), m, n, k,
                   granularity)


@lru_cache(maxsize=4096)
def _lookup(device_name: str, m: int, n: int, k: int, granularity: str) -> RouteEntry | None:
    per_m = _table(device_name, granularity).get((n, k))
    if not per_m:
        return None
    above = [mm for mm in per_m if m <= mm <= m * MAX_M_RATIO]
    if above:  # a config measured for at least M rows tiles M without an extra row of tiles
        return per_m[min(above)]
    below = [mm for mm in per_m if mm < m and m <= mm * MAX_M_RATIO]
    return per_m[max(below)] if below else None
