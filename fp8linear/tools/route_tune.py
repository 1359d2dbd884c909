"""`fp8linear tune-routes`: time every kernel the router could pick per (N, K, M); write the routes table.

For each weight shape and M it times, interleaved under CUDA graphs over operand sets rotated
past L2 (the `fp8linear bench` timer): cuBLAS blockwise (on activations quantized into its padded
layout, as the linear layer runs it; with two cuBLASLt workspace limits), our tiled kernel with the router's config and fixed tiles,
our split-K kernel at several tiles and splits, the heuristic's own choice, and BF16 for reference.
The fastest kernel becomes the table entry (:mod:`fp8linear.ops.route_table`), so
GEMMs of these shapes run what measured fastest on this GPU model. 128x128-block and 1x128
row-wise weights are measured apart (``--granularity``), each into its section of the table;
``--update`` keeps the shapes not measured now (per granularity) from the table already in ``--out``
(with ``--merge-ms``, also a measured shape's entries at the Ms not measured now: how Ms are added).
The optional kernels are candidates where they run: CUTLASS's where the library is built
(``fp8linear build-cutlass``), the warp-specialized Gluon kernel on Hopper; an optional kernel's
entry records the fastest other kernel as its fallback. cuBLAS is also timed on the algorithms
cuBLASLt's heuristic picks for the next larger and the next smaller M, from ALGO_MIN_M rows
(``CublasConfig.algo_m``: its choice is not monotonic in M; named only where it beats M's own by
OPTIONAL_MIN_GAIN). ``--challengers cutlass ws algo cublas`` times just the shipped table's
entries against the named optional kernels (algo: cuBLAS on M's own algorithm and on those of
the next two Ms and the two before; cublas: cuBLAS in every form a full sweep times), a few
minutes instead of a full sweep, and merges per (shape, M).
cuBLAS candidates get the weight scale in cuBLAS's layout made once, as the linear layer holds it.
Before it is timed, each candidate's output is compared with the fp32 product of the dequantized
operands: one whose error is above MAX_REL_ERR is logged and not timed, so it can become no entry.
Writes the table (JSON, by a temporary file and a rename) and every candidate's time
(``route_sweep.json``) to ``--out``; copy the table into ``fp8linear/ops/tuned_configs/routes/`` to ship it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..ops.route_table import route_label
from .grid import grid_shapes
from .shapes import parse_shape
from .timing import prepare_cuda, rotation_sets, time_rounds

__all__ = ["MAX_REL_ERR", "TABLE_MS", "candidate_error", "candidates", "sweep", "build_table", "write_table",
           "add_arguments", "run"]

# The Ms a table is measured at: powers of two to 64, then steps of at most 1.5x (an entry serves
# M within 1.5x, route_table.MAX_M_RATIO), up to 8192.
TABLE_MS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                             4096, 6144, 8192)
_QUICK_MS: tuple[int, ...] = (16, 96, 384, 1024)
# Narrow tiles (N 32) spread weights of 1-4M elements (2048x1408, 576x2048) over more SMs.
# cuBLAS is timed with the default cuBLASLt workspace limit (torch._scaled_mm's, 1 MiB) and with this
# one, where split-K algorithms fit (fp8linear.ops.cublas_gemm.CublasConfig).
_LARGE_WORKSPACE_MIB = 32
# Tiles below 64x64 are timed up to this M (above it they need 4x the programs of 64x64 tiles).
_NARROW_TILE_MAX_M = 512
_SPLIT_TILES = ((16, 32), (32, 32), (16, 64), (32, 64), (64, 64), (64, 128), (128, 128))
# An optional kernel (CUTLASS, warp-specialized) becomes the entry only if it beats the fastest other
# kernel by this factor: the timer's run-to-run spread is 1-2%, and an entry whose win is noise would
# only add a dependency.
OPTIONAL_MIN_GAIN = 0.97
# The optional kernels --challengers may name, and the label prefix of their candidates.
CHALLENGERS = {"cutlass": "cutlass:", "ws": "ws:"}
# --challengers may also name "algo": cuBLAS running the algorithm cuBLASLt's heuristic picks for
# one of the next ALGO_NEXT_MS larger Ms or of the ALGO_PREV_MS smaller ones (CublasConfig.algo_m),
# from ALGO_MIN_M rows (below, our kernels take most cases). A full sweep times the next M's and the
# previous M's. Smaller Ms' algorithms win too (H200, 1x128 weights, one run: 2112x7168 M=768 38.5
# us on its own, 35.2 on M=512's; 8192x29568 M=320 243.9 on M=512's, 207.0 on M=192's).
ALGO = "algo"
ALGO_NEXT_MS = 2
ALGO_PREV_MS = 2
ALGO_MIN_M = 65
# --challengers may also name "cublas": cuBLAS in each of its forms (workspace limit, and for 128x128
# weights the 1x128 form), as a full sweep times it, against the shipped entry.
CUBLAS = "cublas"
# --challengers may also name "tiled": our tiled and split-K kernels on every config a full sweep times
# (the tables' ``ours`` and the entries of those kernels move with their kernels' speed).
TILED = "tiled"
# A candidate whose output differs from the fp32 product of the dequantized operands by more than
# this is not timed (candidate_error: the larger of the relative Frobenius error and the largest
# element error relative to the largest product). The bf16 output's rounding bounds both near
# 2**-9 (Frobenius: every kernel measures 1.5-1.8e-3 on its random data); a misread scale layout
# or a tile left unwritten gives 0.1 to inf, in the largest element error even where the tile is
# one of thousands.
MAX_REL_ERR = 1e-2
# A candidate graph runs about this long (µs): many candidates per case, each timed 5 times.
_GRAPH_US = 1500.0
_REPLAYS = 5


def _tiled_candidates() -> list:
    """Our tiled kernel's tiles. 64x128 at 3 and 4 stages: with whole K steps loaded unmasked, 4 stages
    took 0.91-0.94x the time of 3 on weights up to 11M elements at M 128-1024 and 1.00-1.05x on
    larger GEMMs (H100, kernel alone: 1536x7168 M=256 27.0 against 29.7 us, 2112x7168 M=4096 179.6
    against 170.3)."""
    from ..ops.configs import GemmConfig

    return [GemmConfig(16, 32, 128, num_warps=4, num_stages=4), GemmConfig(32, 32, 128, num_warps=4, num_stages=4),
            GemmConfig(32, 64, 128, num_warps=4, num_stages=4),
            GemmConfig(64, 64, 128, num_warps=4, num_stages=4), GemmConfig(64, 128, 128, num_warps=4, num_stages=3),
            GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
            GemmConfig(128, 64, 128, num_warps=4, num_stages=4), GemmConfig(128, 128, 128, num_warps=8, num_stages=4)]


def _split_candidates(m: int, n: int, k: int, sms: int) -> list:
    from ..ops.configs import SplitKConfig

    groups = -(-k // 128)
    out = []
    for bm, bn in _SPLIT_TILES:
        if bm > max(16, 1 << (m - 1).bit_length()) or (m > 64 and bm < 64) or (m <= 16 and bm > 16):
            continue
        tiles = -(-m // bm) * -(-n // bn)
        for per_sm in (1, 2):
            split = min(-(-per_sm * sms // tiles), max(1, groups // 2))
            if split < 2:
                continue
            split = -(-groups // -(-groups // split))
            # 128x128 tiles take 8 warps; 4 stages beat 3 for them in
            # benchmarks/midm_probe.py (2112x7168 M=200: 22.6 vs 23.8 us)
            big = bm * bn >= 128 * 128
            c = SplitKConfig(bm, bn, split, num_warps=8 if big else 4, num_stages=4)
            if c not in out:
                out.append(c)
    return out


def _cutlass_candidates(n: int, k: int, device: torch.device, granularity: str) -> dict[str, tuple[str, Any]]:
    from ..ops.cutlass_gemm import candidates_for, cutlass_accepts, cutlass_available

    if not (cutlass_accepts(n, k, granularity, torch.float8_e4m3fn, torch.bfloat16, None) and cutlass_available(device)):
        return {}
    return {route_label("cutlass", cfg): ("cutlass", cfg) for cfg in candidates_for(granularity)}


def _ws_candidates(n: int, k: int, device: torch.device, granularity: str) -> dict[str, tuple[str, Any]]:
    """The warp-specialized kernel's configs: 128-column tiles, and for 128x128 weights 192- and
    256-column ones (1x128 weights' per-column scales spill there)."""
    from ..ops.router import WS_CONFIG, WS_CONFIGS_BY_WIDTH
    from ..ops.ws_gemm import ws_device_ok

    if granularity == "tensor" or k % 16 or not ws_device_ok(device):
        return {}
    configs = WS_CONFIGS_BY_WIDTH.values() if granularity == "block" else (WS_CONFIG,)
    return {route_label("ws", cfg): ("ws", cfg) for cfg in configs}


def _optional_runs(kernel: str, n: int, k: int, device: torch.device, granularity: str) -> bool:
    """Whether an optional kernel's table entry can be timed here."""
    if kernel == "cutlass":
        from ..ops.cutlass_gemm import cutlass_accepts, cutlass_available

        return (cutlass_accepts(n, k, granularity, torch.float8_e4m3fn, torch.bfloat16, None)
                and cutlass_available(device))
    from ..ops.ws_gemm import ws_device_ok

    return granularity != "tensor" and k % 16 == 0 and ws_device_ok(device)


def _shipped_candidates(m: int, n: int, k: int, device: torch.device, granularity: str) -> dict[str, tuple[str, Any]]:
    """The shipped table's entry for this GEMM, its ``ours`` and, for an optional kernel's entry, its
    fallback (the optional kernel itself where it runs here)."""
    from ..ops.route_table import OPTIONAL_KERNELS, lookup_route

    out: dict[str, tuple[str, Any]] = {}
    entry = lookup_route(device, m, n, k, granularity)
    ours = entry.ours if entry is not None else None
    while ours is not None:
        if ours.kernel != "ws" or _optional_runs("ws", n, k, device, granularity):
            out[route_label(ours.kernel, ours.config)] = (ours.kernel, ours.config)
        ours = ours.fallback
    while entry is not None:
        if entry.kernel not in OPTIONAL_KERNELS or _optional_runs(entry.kernel, n, k, device, granularity):
            out[route_label(entry.kernel, entry.config)] = (entry.kernel, entry.config)
        entry = entry.fallback
    return out


def _algo_candidates(out: dict[str, tuple[str, Any]], m: int, algo_ms: Sequence[int], granularity: str,
                     count: int, below: int = 0) -> dict[str, tuple[str, Any]]:
    """cuBLAS on the algorithms the heuristic picks for the row counts of the first `count` of
    `algo_ms` above M's and the last `below` under it, from ALGO_MIN_M rows (each padded as cuBLAS
    runs it): in each cuBLAS form of `out`, else in the 32 MiB forms; and each form on M's own
    algorithm, which they must beat (:func:`_drop_idle_algos`)."""
    from dataclasses import replace

    from ..ops.cublas_gemm import CublasConfig
    from ..ops.quant import cublas_rows

    if m < ALGO_MIN_M:
        return {}
    forms = {c or CublasConfig() for kernel, c in out.values() if kernel == "cublas"}
    forms = {replace(c, algo_m=0) for c in forms} or {CublasConfig(workspace_mib=_LARGE_WORKSPACE_MIB)} | (
        {CublasConfig(workspace_mib=_LARGE_WORKSPACE_MIB, row_scales=True)} if granularity == "block" else set())
    own = cublas_rows(m)
    rows = sorted({cublas_rows(a) for a in algo_ms if cublas_rows(a) > own})[:count]
    smaller = sorted({cublas_rows(a) for a in algo_ms if ALGO_MIN_M <= a and cublas_rows(a) < own})
    rows += smaller[len(smaller) - below:] if below else []
    found = {}
    for config in forms:
        for cfg in [config] + [replace(config, algo_m=a) for a in rows]:
            found[route_label("cublas", cfg)] = ("cublas", cfg)
    return found


def _cublas_candidates(granularity: str) -> dict[str, tuple[str, Any]]:
    """cuBLAS at the default and the large workspace limit, and for 128x128 weights also as 1x128
    weights (cuBLAS's 1x128-scaled kernels are faster at low tile counts, fp8linear.ops.cublas_gemm)."""
    from ..ops.cublas_gemm import CublasConfig

    out: dict[str, tuple[str, Any]] = {"cublas": ("cublas", None)}
    large = CublasConfig(workspace_mib=_LARGE_WORKSPACE_MIB)
    out[route_label("cublas", large)] = ("cublas", large)
    if granularity == "block":
        for mib in (CublasConfig.workspace_mib, _LARGE_WORKSPACE_MIB):
            rows = CublasConfig(workspace_mib=mib, row_scales=True)
            out[route_label("cublas", rows)] = ("cublas", rows)
    return out


def _plain_label(label: str) -> str:
    """The label of a borrowed-algorithm cuBLAS candidate's form on its own M's algorithm."""
    return label.rsplit(":a", 1)[0]


def _drop_idle_algos(us: dict[str, float]) -> dict[str, float]:
    """`us` without the borrowed-algorithm cuBLAS candidates that do not beat their form on M's own
    algorithm by OPTIONAL_MIN_GAIN (timed beside them): the borrowed algorithm may be M's own, or
    refused for M (then M's own runs), and an entry should name one only for a measured gain."""
    from ..ops.cublas_gemm import CublasConfig

    default = route_label("cublas", CublasConfig())  # timed as "cublas" (config None) in a full sweep

    def plain_us(label: str) -> float | None:
        plain = _plain_label(label)
        return us.get(plain, us.get("cublas") if plain == default else None)

    return {lab: v for lab, v in us.items()
            if not (lab.startswith("cublas:") and ":a" in lab and plain_us(lab) is not None
                    and v >= OPTIONAL_MIN_GAIN * plain_us(lab))}


def _our_candidates(m: int, n: int, k: int, device: torch.device, granularity: str) -> dict[str, tuple[str, Any]]:
    """Our tiled kernel (the tuned or heuristic config and the tiles of _tiled_candidates, narrow ones up
    to _NARROW_TILE_MAX_M rows) and split-K kernel (_split_candidates) for one GEMM."""
    from ..ops import router
    from ..ops.configs import sm_count

    table_cfg = router.select_config(device, m, n, k, granularity)
    out = {route_label("tiled", table_cfg): ("tiled", table_cfg)}
    for cfg in _tiled_candidates():
        if m > _NARROW_TILE_MAX_M and cfg.block_m * cfg.block_n < 64 * 64:
            continue
        out.setdefault(route_label("tiled", cfg), ("tiled", cfg))
    for cfg in _split_candidates(m, n, k, sm_count(device)):
        out.setdefault(route_label("splitk", cfg), ("splitk", cfg))
    return out


def cublas_runs(n: int, k: int, device: torch.device, granularity: str) -> bool:
    """Whether cuBLAS blockwise takes this weight shape on `device` (bf16 output, no bias): the
    heuristic's `cublas_ok` for a layer of this shape."""
    from ..ops.cublas_gemm import cublas_accepts, cublas_device_ok

    return cublas_accepts(n, k, granularity, torch.float8_e4m3fn, torch.bfloat16, None) and cublas_device_ok(device)


def heuristic_route(device: torch.device, m: int, n: int, k: int, granularity: str):
    """The route a shape in no table gets on `device` as CUDA graphs run it: cuBLAS open to it wherever
    cuBLAS takes the shape (:func:`cublas_runs`), whether or not a sweep times cuBLAS there."""
    from ..ops import router

    return router._heuristic(device, m, n, k, granularity, cublas_runs(n, k, device, granularity), True, False)


def heuristic_label(device: torch.device, m: int, n: int, k: int, granularity: str) -> str:
    """The label of :func:`heuristic_route` (what a sweep row records as the heuristic's choice)."""
    heur = heuristic_route(device, m, n, k, granularity)
    return route_label(heur.kernel, heur.config)


def candidates(m: int, n: int, k: int, device: torch.device, granularity: str = "block",
               challengers: Sequence[str] = (), algo_ms: Sequence[int] = ()) -> dict[str, tuple[str, Any]]:
    """label -> (kernel, config) of every candidate for one GEMM (cuBLAS where it accepts the shape,
    also on the algorithms of the next larger and the next smaller of `algo_ms`; the optional
    kernels where they run); with `challengers` (optional kernels, CHALLENGERS, ALGO, CUBLAS or
    TILED): the shipped table's entry and those kernels' candidates (ALGO: cuBLAS on the algorithms
    of the next ALGO_NEXT_MS of `algo_ms` and of the ALGO_PREV_MS before M; CUBLAS: cuBLAS in every
    form; TILED: our tiled and split-K kernels on every config a full sweep times)."""
    unknown = set(challengers) - set(CHALLENGERS) - {ALGO, CUBLAS, TILED}
    if unknown:
        raise ValueError(f"challengers are optional kernels {tuple(CHALLENGERS)}, {ALGO!r}, {CUBLAS!r} or {TILED!r}, "
                         f"got {sorted(unknown)}")
    cublas_ok = cublas_runs(n, k, device, granularity)
    heur = heuristic_route(device, m, n, k, granularity)
    optional = {"cutlass": _cutlass_candidates, "ws": _ws_candidates}
    if challengers:
        # a shape in no table: the heuristic's choice is what the challengers must beat
        out = _shipped_candidates(m, n, k, device, granularity) or {
            route_label(heur.kernel, heur.config): (heur.kernel, heur.config)}
        for kernel in challengers:
            if kernel == ALGO:
                if cublas_ok:
                    out.update(_algo_candidates(out, m, algo_ms, granularity, ALGO_NEXT_MS, ALGO_PREV_MS))
            elif kernel == CUBLAS:
                if cublas_ok:
                    out.update(_cublas_candidates(granularity))
            elif kernel == TILED:
                for label, cand in _our_candidates(m, n, k, device, granularity).items():
                    out.setdefault(label, cand)
            else:
                out.update(optional[kernel](n, k, device, granularity))
        return out
    out: dict[str, tuple[str, Any]] = {}
    if cublas_ok:
        out.update(_cublas_candidates(granularity))
    if heur.kernel in ("tiled", "splitk"):
        out[route_label(heur.kernel, heur.config)] = (heur.kernel, heur.config)
    for label, cand in _our_candidates(m, n, k, device, granularity).items():
        out.setdefault(label, cand)
    for label, cand in _shipped_candidates(m, n, k, device, granularity).items():
        if cand[1] is not None:
            out.setdefault(label, cand)
    if cublas_ok:
        out.update(_algo_candidates({lab: c for lab, c in out.items() if c[0] == "cublas" and not
                                     (c[1] is not None and c[1].algo_m)}, m, algo_ms, granularity, 1, 1))
    for make in optional.values():
        out.update(make(n, k, device, granularity))
    return out


def candidate_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Error of a candidate's output `y` (its first ref.shape[0] rows: cuBLAS's padded forms may
    return more) against `ref`, the fp32 product of the dequantized operands: the larger of the
    relative Frobenius error and max |y - ref| / max |ref| (one wrong tile among thousands moves the
    first little, the second fully). NaN or inf in `y` gives inf."""
    if y.dim() != 2 or y.shape[0] < ref.shape[0] or y.shape[1] != ref.shape[1]:
        raise ValueError(f"a candidate returned shape {tuple(y.shape)} for a {tuple(ref.shape)} product")
    diff = y[:ref.shape[0]].float() - ref
    frobenius, largest = diff.norm().item(), diff.abs().amax().item()
    if not (math.isfinite(frobenius) and math.isfinite(largest)):
        return math.inf
    return max(frobenius / max(ref.norm().item(), 1e-30), largest / max(ref.abs().amax().item(), 1e-30))


def sweep(shapes: Sequence[tuple[int, int]], ms: Sequence[int], device: torch.device, deadline_s: float,
          log: Callable[[str], None], granularities: Sequence[str] = ("block",),
          challengers: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per (granularity, N, K, M): every candidate's µs per call, BF16's, and the heuristic's
    label. A candidate whose output is off (candidate_error above MAX_REL_ERR) is logged and left out."""
    from ..functional import quantize_weight
    from ..ops import router
    from ..ops.cublas_gemm import cublas_fp8_gemm, cublas_row_scales, cublas_weight_scale
    from ..ops.cutlass_gemm import cutlass_fp8_gemm
    from ..ops.gemm import block_fp8_gemm
    from ..ops.quant import act_quant
    from ..ops.route_table import table_ms
    from ..ops.splitk_gemm import splitk_counters
    from ..ops.ws_gemm import ws_fp8_gemm
    from ..reference import dequantize_activation_ref, dequantize_weight_ref

    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.monotonic()
    for n, k in shapes:
        if time.monotonic() - t0 > deadline_s:
            log(f"deadline of {deadline_s:.0f}s reached: not measured from {n}x{k} on")
            break
        w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        counters = splitk_counters(n, device)
        for gran in granularities:
            w_q, w_s = quantize_weight(w, gran, torch.float8_e4m3fn)
            # 1x128 scales as Fp8BlockLinear hands them over: N-major to cuBLAS (the layer's cuBLAS route
            # holds that storage as its (K/128, N) scale) and to our kernels where the router says so
            w_sn = w_s.t().contiguous().t() if gran == "row" else w_s
            w_ref = dequantize_weight_ref(w_q, w_s).t()
            for m in ms:
                x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
                x_q, x_s = act_quant(x, torch.float8_e4m3fn)
                ref = dequantize_activation_ref(x_q, x_s) @ w_ref  # fp32 (no TF32: torch's default)
                xp_q, xp_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
                fns: dict[str, tuple[Callable, tuple]] = {"bf16": (lambda a, b: a @ b.t(), (x, w))}
                algo_ms = sorted(set(ms) | set(TABLE_MS) | set(table_ms(device, n, k, gran)))
                for label, (kernel, c) in candidates(m, n, k, device, gran, challengers, algo_ms).items():
                    scale = w_sn if kernel == "cublas" or router.use_n_major_scales(
                        router.Route(kernel, c), m, k, gran) else w_s
                    if kernel == "cublas":
                        # the weight scale in cuBLAS's layout for this form, made once and handed over as
                        # the layer's cuBLAS route holds it
                        held = cublas_weight_scale(w_q, scale, gran, cublas_row_scales(w_q, gran, c))
                        fns[label] = ((lambda g, c_: lambda a, sa, b, sb, hb: cublas_fp8_gemm(
                            a, sa, b, sb, g, None, c_, scale_b=hb))(gran, c), (xp_q, xp_s, w_q, scale, held))
                    elif kernel == "cutlass":
                        fns[label] = ((lambda c_, g: lambda a, sa, b, sb: cutlass_fp8_gemm(a, sa, b, sb, None, c_, g))(
                            c, gran), (x_q, x_s, w_q, scale))
                    elif kernel == "ws":
                        fns[label] = ((lambda c_, g: lambda a, sa, b, sb: ws_fp8_gemm(
                            a, sa, b, sb, g, torch.bfloat16, None, c_))(c, gran), (x_q, x_s, w_q, scale))
                    else:
                        fns[label] = ((lambda c_, g: lambda a, sa, b, sb: block_fp8_gemm(
                            a, sa, b, sb, g, torch.bfloat16, None, config=c_, counters=counters))(c, gran),
                            (x_q, x_s, w_q, scale))
                rounds = {}
                for label, (fn, args) in fns.items():
                    try:
                        err = 0.0 if label == "bf16" else candidate_error(fn(*args), ref)
                        if not err <= MAX_REL_ERR:
                            log(f"  {gran} {n}x{k} M={m} {label}: error {err:.2e} against the fp32 product "
                                f"(> {MAX_REL_ERR:.0e}): not timed")
                            continue
                        nbytes = sum(t.numel() * t.element_size() for t in args)
                        rounds[label], _ = prepare_cuda(fn, rotation_sets(args, nbytes, device), 3, True, _GRAPH_US)
                    except (RuntimeError, ValueError) as e:
                        log(f"  {gran} {n}x{k} M={m} {label}: {str(e).splitlines()[0][:120]}")
                us = time_rounds(rounds, _REPLAYS)
                del rounds, ref
                if not any(lab != "bf16" and not _optional(lab) for lab in us):
                    # BF16 alone, or optional kernels only (their entries need a fallback)
                    log(f"  {gran} {n}x{k} M={m}: no kernel but optional ones gave a usable product; no entry")
                    continue
                rows.append({"granularity": gran, "n": n, "k": k, "m": m, "us": us,
                             "heuristic": heuristic_label(device, m, n, k, gran)})
                best = min((v, lab) for lab, v in us.items() if lab != "bf16")
                log(f"[{time.monotonic() - t0:5.0f}s] {gran} {n}x{k} M={m}: BF16 {us['bf16']:.1f} "
                    f"best {best[1]} {best[0]:.1f}")
            del w_q, w_s, w_sn, w_ref
        del w
        torch.cuda.empty_cache()
    return rows


def _entry_from_label(label: str) -> dict[str, Any]:
    if label == "cublas":
        return {"kernel": "cublas"}
    if label.startswith("cutlass:"):  # cutlass:TILE, cutlass:TILEsk (stream-K), cutlass:TILEkS (S split-K parts),
        spec = label[len("cutlass:"):]  # cutlass:TILExWIDTH (a tile narrower than 128 columns)
        if "x" in spec:
            tile, _, width = spec.partition("x")
            return {"kernel": "cutlass", "tile_m": int(tile), "tile_n": int(width)}
        if spec.endswith("sk"):
            return {"kernel": "cutlass", "tile_m": int(spec[:-2]), "stream_k": True}
        tile, _, splits = spec.partition("k")
        return {"kernel": "cutlass", "tile_m": int(tile), **({"stream_k": True, "splits": int(splits)} if splits else {})}
    if label.startswith("ws:"):  # ws:BLOCK_NsSTAGESgGROUP_M, p: persistent, tSPLIT: tail_split
        spec, _, tail_split = label[len("ws:"):].partition("t")
        persistent = spec.endswith("p")
        block_n, rest = spec.rstrip("p").split("s")
        stages, group_m = rest.split("g")
        return {"kernel": "ws", "block_n": int(block_n), "stages": int(stages), "group_m": int(group_m),
                **({"persistent": True} if persistent else {}), **({"tail_split": int(tail_split)} if tail_split else {})}
    if label.startswith("cublas:ws"):  # cublas:wsMIB, then :row (1x128 form) and :aM (algo_m), in that order
        mib, *parts = label[len("cublas:ws"):].split(":")
        row = parts[:1] == ["row"]
        algo = parts[1:] if row else parts
        if len(algo) > 1 or (algo and not (algo[0][:1] == "a" and algo[0][1:].isdigit())):
            raise ValueError(f"a cuBLAS label is cublas:wsMIB[:row][:aM], got {label!r}")
        return {"kernel": "cublas", "workspace_mib": int(mib), **({"row_scales": True} if row else {}),
                **({"algo_m": int(algo[0][1:])} if algo else {})}
    kernel, spec = label.split(":")
    dims, rest = spec.split("w", 1)
    sizes = [int(v) for v in dims.split("x")]
    warps = int(rest.split("s")[0])
    stages = int(rest.split("s")[1].split("g")[0])
    if kernel == "splitk":
        return {"kernel": "splitk", "block_m": sizes[0], "block_n": sizes[1], "split_k": sizes[2],
                "num_warps": warps, "num_stages": stages}
    return {"kernel": "tiled", "block_m": sizes[0], "block_n": sizes[1], "block_k": sizes[2],
            "group_m": int(rest.split("g")[1]), "num_warps": warps, "num_stages": stages}


def build_table(rows: Sequence[dict[str, Any]], device_name: str, meta: dict[str, Any],
                base: dict[str, Any] | None = None, merge_ms: bool = False) -> dict[str, Any]:
    """The routes table document: per granularity and (N, K, M) the fastest candidate, with its and
    BF16's µs. `base`: a table whose shapes these rows did not measure are kept (per granularity
    and shape: a measured shape's entries are all replaced, unless `merge_ms`, which keeps its
    entries at the Ms not measured now); where it has an entry at a measured (N, K, M), that entry's
    kernels stay unless beaten by the margin (:func:`_best_entry`)."""
    from ..ops.route_table import ROUTE_SECTIONS, ROUTES_FORMAT, ROUTES_VERSION, parse_routes

    doc = {"format": ROUTES_FORMAT, "version": ROUTES_VERSION, "device": device_name, "meta": meta, "routes": {}}
    measured = {(ROUTE_SECTIONS[r.get("granularity", "block")], f"{r['n']},{r['k']}") for r in rows}
    if base is not None:
        for gran, section in ROUTE_SECTIONS.items():
            parse_routes(base, "base routes table", gran)  # it must read back too
            kept = {shape: dict(per_m) for shape, per_m in base.get(section, {}).items()
                    if merge_ms or (section, shape) not in measured}
            if kept:
                doc.setdefault(section, {}).update(kept)
    for r in rows:
        section_name = ROUTE_SECTIONS[r.get("granularity", "block")]
        held = (base or {}).get(section_name, {}).get(f"{r['n']},{r['k']}", {}).get(str(r["m"]))
        entry = _best_entry(r["us"], held)
        entry.update(bf16_us=round(r["us"]["bf16"], 2))
        section = doc.setdefault(section_name, {})
        section.setdefault(f"{r['n']},{r['k']}", {})[str(r["m"])] = entry
    for gran in ROUTE_SECTIONS:
        parse_routes(doc, "new routes table", gran)  # what we write must read back
    return doc


def _held_labels(held: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(label of the mandatory kernel, label of the optional kernel or None) of a table entry."""
    if held is None:
        return None, None
    from ..ops.route_table import OPTIONAL_KERNELS, parse_entry

    entry = parse_entry(held, "base table entry")
    if entry.kernel in OPTIONAL_KERNELS:
        return route_label(entry.fallback.kernel, entry.fallback.config), route_label(entry.kernel, entry.config)
    return route_label(entry.kernel, entry.config), None


def _optional(label: str) -> bool:
    """Whether a candidate label names an optional kernel (CUTLASS, warp-specialized)."""
    return label.startswith(tuple(CHALLENGERS.values()))


def _best_entry(us: dict[str, float], held: dict[str, Any] | None = None) -> dict[str, Any]:
    """The table entry of one case's times: the fastest kernel, an optional kernel (CUTLASS,
    warp-specialized) only where it beats the fastest other one by OPTIONAL_MIN_GAIN (then with that
    one as its fallback); where that is cuBLAS, with the fastest of our kernels (``ours``: tiled or
    split-K, or the warp-specialized kernel by the same margin, with that one as its fallback) for
    callers cuBLAS is not allowed to serve. `held`: the table's entry for this case, whose kernels
    (and whose ``ours``' kernels) stay where the fastest other candidate is within OPTIONAL_MIN_GAIN
    of them (re-timing moves times by the timer's spread; an entry should change only for a measured
    gain)."""
    us = _drop_idle_algos(us)

    others = [(v, lab) for lab, v in us.items() if lab != "bf16" and not _optional(lab)]
    if not others:
        raise ValueError(f"no kernel but optional ones was timed ({sorted(us)}): their entries need a fallback")
    entry = _pick(others, [(v, lab) for lab, v in us.items() if _optional(lab)], _held_labels(held))
    ours = [(v, lab) for lab, v in us.items() if lab.startswith(("tiled:", "splitk:"))]
    if entry.get("fallback", entry)["kernel"] == "cublas" and ours:
        ws = [(v, lab) for lab, v in us.items() if lab.startswith(CHALLENGERS["ws"])]
        entry["ours"] = _pick(ours, ws, _held_labels((held or {}).get("ours")))
    return entry


def _pick(others: list[tuple[float, str]], opt: list[tuple[float, str]],
          held: tuple[str | None, str | None]) -> dict[str, Any]:
    """An entry from (us, label) pairs: the fastest of `others`, or of `opt` (optional kernels) with
    that one as its fallback where it is faster by OPTIONAL_MIN_GAIN; `held` (the table's (other,
    optional) labels) stay while within OPTIONAL_MIN_GAIN of the fastest."""
    us = {lab: v for v, lab in others + opt}
    other_us, other = min(others)
    held_other, held_opt = held
    if held_other in {lab for _, lab in others} and OPTIONAL_MIN_GAIN * us[held_other] <= other_us:
        other_us, other = us[held_other], held_other  # the fastest is within the timer's spread of it
    entry = {**_entry_from_label(other), "us": round(other_us, 2)}
    if held_opt in {lab for _, lab in opt} and us[held_opt] < other_us and (
            OPTIONAL_MIN_GAIN * us[held_opt] <= min(opt)[0]):
        # the table's optional kernel stays while faster than the fallback and within the spread of the fastest
        entry = {**_entry_from_label(held_opt), "us": round(us[held_opt], 2), "fallback": entry}
    elif opt and min(opt)[0] < OPTIONAL_MIN_GAIN * other_us:
        opt_us, label = min(opt)
        entry = {**_entry_from_label(label), "us": round(opt_us, 2), "fallback": entry}
    return entry


def write_table(doc: dict[str, Any], path: Path) -> Path:
    """Write by a temporary file in the same folder and an atomic rename."""
    from ..ops.config_tables import write_json_atomic

    return write_json_atomic(doc, path)


def heuristic_report(rows: Sequence[dict[str, Any]]) -> str:
    """How the heuristic's choice compares with the fastest candidate (for shapes in no table), per granularity."""
    lines = []
    for gran in dict.fromkeys(r.get("granularity", "block") for r in rows):
        ratios = [r["us"][r["heuristic"]] / min(v for lab, v in r["us"].items() if lab != "bf16")
                  for r in rows if r.get("granularity", "block") == gran and r["heuristic"] in r["us"]]
        if not ratios:
            lines.append(f"heuristic ({gran}): no case where its choice was timed")
            continue
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(f"heuristic / fastest ({gran}): geomean {gm:.3f}, max {max(ratios):.2f}, within 1.2x in "
                     f"{sum(r <= 1.2 for r in ratios)} of {len(ratios)} cases")
    return "\n".join(lines) or "heuristic: no case where its choice was timed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="route_tune", help="folder for the table and route_sweep.json")
    parser.add_argument("--shapes", nargs="+", metavar="N,K", default=None, help="default: the `bench --grid` shapes")
    parser.add_argument("--m", nargs="+", type=int, default=None, help=f"default: {list(TABLE_MS)}")
    parser.add_argument("--quick", action="store_true", help=f"M in {list(_QUICK_MS)} only")
    parser.add_argument("--deadline-s", type=float, default=560.0, help="stop starting new shapes after this long")
    parser.add_argument("--granularity", nargs="+", choices=("block", "row"), default=["block", "row"],
                        help="weight granularities to measure (default: both)")
    parser.add_argument("--update", action="store_true",
                        help="keep the shapes (per granularity) not measured now from the table already in --out")
    parser.add_argument("--merge-ms", action="store_true",
                        help="with --update: keep a measured shape's entries at the Ms not measured now "
                             "(to add Ms to a table, e.g. --m 160 320 640)")
    parser.add_argument("--challengers", nargs="+", choices=tuple(CHALLENGERS) + (ALGO, CUBLAS, TILED), default=None,
                        help="time only the shipped entries against these optional kernels (CUTLASS: built; ws: the "
                             "warp-specialized kernel, Hopper), cuBLAS on the algorithms of the "
                             f"next {ALGO_NEXT_MS} and previous {ALGO_PREV_MS} table Ms (algo), cuBLAS in every "
                             "form (cublas) or our tiled and split-K "
                             "kernels on every config (tiled), and update the table in --out (the shipped one "
                             "where --out has none) per (shape, M)")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("fp8linear tune-routes: needs a CUDA GPU (it times kernels)", file=sys.stderr)
        return 2
    try:
        shapes = [(s.n, s.k) for s in (map(parse_shape, args.shapes) if args.shapes else grid_shapes())]
    except ValueError as e:
        print(f"fp8linear tune-routes: {e}", file=sys.stderr)
        return 2
    ms = tuple(args.m) if args.m else (_QUICK_MS if args.quick else TABLE_MS)
    if getattr(args, "merge_ms", False) and not args.update:
        print("fp8linear tune-routes: --merge-ms merges into the table in --out: give --update too", file=sys.stderr)
        return 2
    if any(m < 1 for m in ms):
        print(f"fp8linear tune-routes: M must be positive, got {ms}", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    name = torch.cuda.get_device_name(device)
    import json

    import triton

    from ..ops.route_table import routes_path

    base = None
    granularities = tuple(dict.fromkeys(args.granularity))
    challengers = tuple(dict.fromkeys(args.challengers or ()))
    from ..ops.cutlass_gemm import cutlass_available, library_path
    from ..ops.ws_gemm import ws_device_ok

    if "cutlass" in challengers and not cutlass_available(device):
        print(f"fp8linear tune-routes: --challengers cutlass needs the CUTLASS library ({library_path()}; "
              "`fp8linear build-cutlass`) and an sm_90 GPU", file=sys.stderr)
        return 2
    if "ws" in challengers and not ws_device_ok(device):
        print("fp8linear tune-routes: --challengers ws needs a Hopper GPU and a Triton whose Gluon has warp_specialize",
              file=sys.stderr)
        return 2
    if challengers and not routes_path(name, out).is_file():
        import shutil

        shipped = routes_path(name)
        if shipped.is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shipped, routes_path(name, out))
    if args.update or (challengers and routes_path(name, out).is_file()):
        from ..ops.route_table import ROUTE_SECTIONS, parse_routes

        path = routes_path(name, out)
        try:
            with open(path, encoding="utf-8") as f:
                base = json.load(f)
            sections = [parse_routes(base, str(path), gran) for gran in ROUTE_SECTIONS]  # refused now, not later
        except (OSError, ValueError) as e:
            print(f"fp8linear tune-routes: --update needs a valid table in {out}: {e}", file=sys.stderr)
            return 2
        names_cutlass = any(e.kernel == "cutlass" for sec in sections for per_m in sec.values() for e in per_m.values())
        if challengers and names_cutlass and not cutlass_available(device):
            # its CUTLASS entries could not be re-timed, and the merge would replace them with their fallbacks
            print(f"fp8linear tune-routes: the table in {out} names CUTLASS kernels: build them first "
                  "(`fp8linear build-cutlass`)", file=sys.stderr)
            return 2
    rows = sweep(shapes, ms, device, args.deadline_s, lambda s: print(s, file=sys.stderr, flush=True),
                 granularities, challengers)

    meta = {"tool": "fp8linear tune-routes", "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
    if challengers:
        meta["challengers"] = list(challengers)  # the other kernels' entries are the base table's, re-timed
    if any(lab.startswith("cutlass:") for r in rows for lab in r["us"]):
        from ..ops.cutlass_gemm import library_path

        meta["cutlass_library"] = library_path().parent.name  # the source and flags' digest
    if base is not None and isinstance(base.get("meta"), dict):
        meta["base"] = {k: v for k, v in base["meta"].items() if k != "base"}
    write_table({"gpu": name, "meta": meta, "rows": rows}, out / "route_sweep.json")
    merge = bool(challengers) or getattr(args, "merge_ms", False)
    path = write_table(build_table(rows, name, meta, base, merge_ms=merge), routes_path(name, out))
    if challengers:  # only the table's entries and the challengers were timed: the heuristic's choice mostly not
        print("heuristic / fastest: not reported with --challengers (run without it on shapes in no table)")
    else:
        print(heuristic_report(rows))
    print(f"wrote {path} ({len(rows)} cases) and {out / 'route_sweep.json'}")
    return 0
