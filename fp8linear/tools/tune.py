"""`fp8linear tune`: time candidate launch configs of the blockwise FP8 GEMM and write a table.

The tables it writes are read by :func:`fp8linear.ops.config_tables.lookup_config` (format,
sources and priority there). Tuning launches kernels and times them, so it refuses to run inside
a CUDA-graph capture or a ``torch.compile`` trace; run it ahead of serving.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..ops.config_tables import (
    AMD_OPTION_DEFAULTS,
    GRANULARITY_KEYS,
    M_BUCKETS,
    ConfigTable,
    cache_table_path,
    device_name,
    load_table,
    lookup_config,
    m_bucket,
    save_table,
)
from ..ops.configs import GemmConfig

__all__ = [
    "TuneResult",
    "candidate_configs",
    "refine_candidates",
    "autotune_config",
    "tune_shape",
    "add_arguments",
    "run",
]


# ----------------------------------------------------------------------------- candidates
# Hopper register budget: the fp32 accumulator plus the fresh per-K-step dot tile must fit
# in 255 registers/thread, so accumulator elements per thread are capped at 128; below 2 a
# warp has too little work per tensor-core instruction to be worth timing.
_MAX_ACC_PER_THREAD = 128
_MIN_ACC_PER_THREAD = 2
# Shared memory for the pipelined FP8 operand tiles; H100/H200 allow 227 KiB per block,
# minus room for the epilogue/layout conversion scratch.
_SMEM_BUDGET = 200 * 1024
# Phase-two (block_k, num_stages) variations; half-size K steps need deeper pipelines.
_REFINE_STEPS = ((128, 3), (128, 5), (128, 6), (64, 4), (64, 6), (64, 8))
# Phase two refines this many of the fastest phase-one configs.
_REFINE_TOP = 3


def _fits(bm: int, bn: int, bk: int, warps: int, stages: int) -> bool:
    acc = bm * bn // (32 * warps)
    return _MIN_ACC_PER_THREAD <= acc <= _MAX_ACC_PER_THREAD and stages * (bm + bn) * bk <= _SMEM_BUDGET


def candidate_configs(m: int, n: int, k: int, arch: str | None = None) -> list[GemmConfig]:
    """Phase-one candidates for an (M, N, K) GEMM: tile shapes and warps at a default pipeline depth.

    Decode (M <= 64): block_m 16/32/64 (no larger than M needs), block_n 32-256, 4 or 8
    warps. Prefill: block_m 64/128/256 x block_n 64/128/256 with 4 or 8 warps, as far as the
    accumulator fits in registers. block_k is 128 (one scale group per step) here; 64 and the
    pipeline depth are explored by :func:`refine_candidates`. On an AMD `arch` ('gfx942'):
    the AMD heuristic's config, then every tile of the AMD option table (spill-free options).
    """
    from ..ops.configs import GemmConfig, is_amd_arch
    from ..ops.router import heuristic_config

    if is_amd_arch(arch):
        return _amd_candidates(m, n, k, arch)

    pow2_m = 1 << max(int(m) - 1, 0).bit_length()
    if m <= 64:  # memory bound: enough CTAs to stream W matters more than tile efficiency
        bms = [b for b in (16, 32, 64) if b <= max(16, pow2_m)]
        bns = (64, 128, 32, 256)
    elif m <= 256:
        bms = [128, 64]
        bns = (128, 256, 64)
    else:  # compute bound: large tiles first
        bms = [128, 256, 64]
        bns = (128, 256, 64)
    max_bn = max(32, 1 << (int(n) - 1).bit_length())  # no tile wider than N rounded up
    found: list[GemmConfig] = []
    for bm in bms:
        for bn in bns:
            if bn > max_bn:
                continue
            for warps in (8, 4) if bm * bn >= 128 * 128 else (4, 8):
                stages = 4
                while stages > 2 and not _fits(bm, bn, 128, warps, stages):
                    stages -= 1
                if _fits(bm, bn, 128, warps, stages):
                    found.append(GemmConfig(block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages))
    if m > 256:  # biggest tiles first, so a short budget still sees the likely winners
        found.sort(key=lambda c: -c.block_m * c.block_n)
    out = [heuristic_config(m, n, k)]
    out += [c for c in found if c not in out]
    return out


def _amd_candidates(m: int, n: int, k: int, arch: str) -> list[GemmConfig]:
    from ..ops.configs import AMD_TILE_OPTIONS, amd_gemm_config
    from ..ops.router import amd_heuristic_config

    pow2_m = 1 << max(int(m) - 1, 0).bit_length()
    max_bn = max(32, 1 << (int(n) - 1).bit_length())
    tiles = [t for t in AMD_TILE_OPTIONS if t[1] <= max_bn and (m > 64 or t[0] <= max(16, pow2_m))]
    tiles.sort(key=lambda t: -t[0] * t[1] if m > 256 else t[0] * t[1])
    out = [amd_heuristic_config(m, n, k, arch)]
    out += [c for c in (amd_gemm_config(bm, bn, group_m=32 if m > 256 else 8) for bm, bn in tiles) if c not in out]
    return out


def _amd_refinements(cfg: GemmConfig) -> list[GemmConfig]:
    """AMD phase two: pipeline depth 1/3, the other MFMA size and kpack, waves_per_eu 0..2."""
    from dataclasses import replace

    out = [replace(cfg, num_stages=s) for s in (1, 3) if s != cfg.num_stages]
    out.append(replace(cfg, matrix_instr_nonkdim=32 if cfg.matrix_instr_nonkdim == 16 else 16))
    out.append(replace(cfg, kpack=3 - cfg.kpack))
    out += [replace(cfg, waves_per_eu=w) for w in (0, 1, 2) if w != cfg.waves_per_eu]
    return out


def refine_candidates(best: Sequence[GemmConfig], arch: str | None = None) -> list[GemmConfig]:
    """Phase-two candidates around the fastest configs: other pipeline depths, and block_k=64
    (on an AMD `arch`: the AMD options, see :func:`_amd_refinements`)."""
    from ..ops.configs import GemmConfig, is_amd_arch

    out: list[GemmConfig] = []
    if is_amd_arch(arch):
        for cfg in best:
            out += [c for c in _amd_refinements(cfg) if c not in out and c not in best]
        return out
    for cfg in best:
        for bk, stages in _REFINE_STEPS:
            if not _fits(cfg.block_m, cfg.block_n, bk, cfg.num_warps, stages):
                continue
            c = GemmConfig(
                block_m=cfg.block_m, block_n=cfg.block_n, block_k=bk,
                group_m=cfg.group_m, num_warps=cfg.num_warps, num_stages=stages,
            )
            if c not in out and c not in best:
                out.append(c)
    return out


# ----------------------------------------------------------------------------- autotuning
@dataclass(frozen=True)
class TuneResult:
    """Outcome of tuning one (N, K, M bucket): the winner, its time and the heuristic's."""

    n: int
    k: int
    bucket: int
    granularity: str
    config: GemmConfig
    us: float
    heuristic_us: float | None
    tried: int
    failed: int
    seconds: float

    def __post_init__(self) -> None:
        if self.bucket not in M_BUCKETS:
            raise ValueError(f"bucket must be one of {M_BUCKETS}, got {self.bucket}")
        if self.granularity not in GRANULARITY_KEYS:
            raise ValueError(f"granularity must be one of {GRANULARITY_KEYS}, got {self.granularity!r}")
        if not (self.us > 0 and math.isfinite(self.us)):
            raise ValueError(f"us must be a positive finite time, got {self.us}")


def _check_can_tune() -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "fp8linear autotuning cannot run inside a torch.compile trace; tune ahead of time "
            "(fp8linear tune, or fp8linear.tools.tune.autotune_config before compiling)"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fp8linear autotuning cannot run inside a CUDA-graph capture; tune before capturing"
        )


def _candidate_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a candidate config may raise (too much shared memory, compile failure, ...)."""
    errs: list[type[BaseException]] = [RuntimeError, ValueError, AssertionError]
    try:
        from triton.runtime.errors import OutOfResources

        errs.append(OutOfResources)
    except ImportError:  # older/newer Triton layouts: RuntimeError still covers launch failures
        pass
    try:
        from triton.compiler.errors import CompilationError

        errs.append(CompilationError)
    except ImportError:
        pass
    return tuple(errs)


# A candidate whose output differs from the heuristic's by more than this is rejected
# (configs only change the fp32 summation order, which moves bf16 outputs ~1e-3 at most).
_MAX_CANDIDATE_DIFF = 1e-2

# Timer(fn, sets): median µs per call of fn(*set), cycling over the operand sets.
Timer = Callable[[Callable[..., object], Sequence[tuple]], float]


def _default_timer(device: torch.device) -> Timer:
    """On a GPU, the benchmark's timer: CUDA-graph replays over weight copies larger than twice
    the L2, so each call reads its weight from HBM with no launch gaps, as decode in a captured
    model does. (triton's do_bench, used before, flushes L2 with a memset and times each call
    alone: at decode sizes it added 4-15 us and picked e.g. 16x128 w8 for 7168x2048 at M=16,
    11.1 us under graphs, against 8.7 for 16x32 w4; H100.) Wall clock on a CPU."""
    if device.type == "cuda":
        from .timing import time_graph

        return time_graph

    def wall_timer(fn: Callable[..., object], sets: Sequence[tuple]) -> float:  # CPU / interpreter dry runs
        times = []
        for i in range(3):
            t0 = time.perf_counter()
            fn(*sets[i % len(sets)])
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    return wall_timer


def _make_weight(n: int, k: int, granularity: str, device: torch.device, seed: int = 0):
    from ..functional import quantize_weight

    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
    w_q, w_s = quantize_weight(w, granularity)
    return w_q, (w_s.reshape(()) if granularity == "tensor" else w_s.contiguous())


def _make_activation(m: int, k: int, device: torch.device, seed: int = 1):
    from ..functional import quantize_activation

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    x_q, x_s = quantize_activation(x, backend="reference")
    return x_q, x_s.contiguous()


def tune_shape(
    n: int,
    k: int,
    ms: Iterable[int] = M_BUCKETS,
    device: torch.device | str | None = None,
    *,
    granularity: str = "block",
    budget_s: float = 30.0,
    max_candidates: int | None = None,
    timer: Timer | None = None,
    log: Callable[[str], None] | None = None,
) -> list[TuneResult]:
    """Tune one (N, K) for the buckets of `ms` within about `budget_s` seconds.

    Each bucket gets an equal share of what is left of the budget: the heuristic config is
    always timed first, then phase-one candidates, then (if time is left) refinements of the
    fastest three. A bucket can overrun its share by one compile (a few seconds).
    """
    _check_can_tune()
    from ..ops.configs import is_amd_arch
    from ..ops.router import amd_heuristic_config, heuristic_config
    from ..ops.gemm import block_fp8_gemm

    dev = torch.device(device) if device is not None else torch.device("cuda")
    arch = device_name(dev)  # 'gfx942' on ROCm: AMD heuristic and candidates
    timer = timer or _default_timer(dev)
    errors = _candidate_errors()
    buckets = sorted({m_bucket(m) for m in ms})
    start = time.monotonic()
    deadline = start + budget_s
    results: list[TuneResult] = []
    w_q, w_s = _make_weight(n, k, granularity, dev)
    from .timing import rotation_sets

    w_sets = rotation_sets((w_q, w_s), w_q.numel() * w_q.element_size(), dev)  # one set where there is no L2
    for i, bucket in enumerate(buckets):
        t_bucket = time.monotonic()
        bucket_deadline = t_bucket + max(0.0, deadline - t_bucket) / (len(buckets) - i)
        x_q, x_s = _make_activation(bucket, k, dev)
        times: dict[GemmConfig, float] = {}
        failed = 0
        reference = None

        def measure(cfg: GemmConfig) -> None:
            nonlocal failed, reference

            def call(w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
                return block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, torch.bfloat16, None, config=cfg)

            try:
                y = call(*w_sets[0])
                if reference is None:
                    reference = y.float()
                else:
                    diff = ((y.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()
                    if not diff <= _MAX_CANDIDATE_DIFF:
                        raise ValueError(f"output differs from the heuristic config's by {diff:.3g}")
                times[cfg] = timer(call, w_sets)
            except errors as e:
                failed += 1
                if log:
                    first = str(e).splitlines()[0][:120] if str(e) else ""
                    log(f"    {_cfg_str(cfg)}: skipped ({type(e).__name__}: {first})")

        heuristic = amd_heuristic_config(bucket, n, k, arch) if is_amd_arch(arch) else heuristic_config(bucket, n, k)
        # Always timed: the heuristic and the config a table already has for this bucket, so a
        # re-tune whose budget runs out early (compiles on a fresh machine) never picks worse.
        current = lookup_config(device_name(dev), bucket, n, k, granularity)
        must = [heuristic] + ([current] if current is not None and current != heuristic else [])
        phase1 = must + [c for c in candidate_configs(bucket, n, k, arch) if c not in must]
        if max_candidates is not None:
            phase1 = phase1[: max(len(must), max_candidates)]
        for rank, cfg in enumerate(phase1):
            if rank >= len(must) and times and time.monotonic() > bucket_deadline:
                break
            measure(cfg)
        if times and time.monotonic() < bucket_deadline:
            top = sorted(times, key=times.__getitem__)[:_REFINE_TOP]
            phase2 = [c for c in refine_candidates(top, arch) if c not in times]
            if max_candidates is not None:
                phase2 = phase2[: max(0, max_candidates - len(phase1))]
            for cfg in phase2:
                if time.monotonic() > bucket_deadline:
                    break
                measure(cfg)
        if not times:
            if log:
                log(f"  ({n},{k}) M={bucket}: no candidate ran; keeping the heuristic (no entry written)")
            continue
        best = min(times, key=times.__getitem__)
        res = TuneResult(
            n=n, k=k, bucket=bucket, granularity=granularity, config=best, us=times[best],
            heuristic_us=times.get(heuristic), tried=len(times), failed=failed,
            seconds=time.monotonic() - t_bucket,
        )
        results.append(res)
        if log:
            h = f"{res.heuristic_us:9.1f}" if res.heuristic_us is not None else "        -"
            log(
                f"  ({n},{k}) M={bucket:<5d} best {_cfg_str(best):28s} {res.us:9.1f} us  heuristic {h} us"
                f"  [{res.tried} timed, {failed} failed, {res.seconds:.1f}s]"
            )
    return results


def _cfg_str(cfg: GemmConfig) -> str:
    s = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} g{cfg.group_m}"
    if cfg.amd_options() != AMD_OPTION_DEFAULTS:
        s += f" wpe{cfg.waves_per_eu} nk{cfg.matrix_instr_nonkdim} kp{cfg.kpack}"
    return s


def _table_meta() -> dict[str, Any]:
    meta: dict[str, Any] = {
        "tool": "fp8linear tune",
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.version.hip is not None:
        meta["hip"] = torch.version.hip
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    return meta


def _store_results(results: Sequence[TuneResult], device: str, path: Path, base: ConfigTable | None = None) -> Path:
    """Merge `results` into the table at `path` (or `base`) and write it atomically."""
    table = ConfigTable(device=device)
    if path.is_file():
        try:
            table.merge(load_table(path))
        except (OSError, ValueError) as e:
            warnings.warn(f"fp8linear: replacing unreadable table {path}: {e}", RuntimeWarning, stacklevel=2)
    if base is not None:
        table.merge(base)
    for r in results:
        table.set(r.n, r.k, r.bucket, r.config, r.granularity, us=round(r.us, 3),
                  heuristic_us=None if r.heuristic_us is None else round(r.heuristic_us, 3), tried=r.tried)
    table.meta.update(_table_meta())
    return save_table(table, path)


def autotune_config(
    m: int,
    n: int,
    k: int,
    device: torch.device | str | None = None,
    *,
    granularity: str = "block",
    budget_s: float = 10.0,
    store: bool = True,
    path: str | os.PathLike[str] | None = None,
) -> GemmConfig:
    """Time candidate configs for an (M, N, K) GEMM, store the winner in the autotune cache, return it.

    The result lands in :func:`cache_table_path` (or `path`), where :func:`lookup_config`
    finds it from then on, in this process and later ones. Raises RuntimeError inside a
    CUDA-graph capture or a torch.compile trace.
    """
    _check_can_tune()
    dev = torch.device(device) if device is not None else torch.device("cuda")
    results = tune_shape(n, k, [m], dev, granularity=granularity, budget_s=budget_s)
    if not results:
        raise RuntimeError(f"no GEMM config could be launched for M={m}, N={n}, K={k} on {dev}")
    if store:
        name = device_name(dev)
        _store_results(results, name, Path(path) if path is not None else cache_table_path(name))
    return results[0].config


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", metavar="N,K", default=None,
                        help="weight shapes (N=out_features, K=in_features); default: the benchmark's set "
                             "(DeepSeek-V3 + extra shapes)")
    parser.add_argument("--hf-config", metavar="PATH", default=None,
                        help="a Hugging Face config.json (or its folder): tune the shapes of its linear layers")
    parser.add_argument("--m", nargs="+", type=int, default=None, metavar="M",
                        help=f"M values; tuned per bucket {list(M_BUCKETS)} (default: all buckets)")
    parser.add_argument("--granularity", choices=GRANULARITY_KEYS, default="block",
                        help="weight scale granularity to tune for (default: block = 128x128)")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="table to write (merged into if it exists); default: this device's autotune cache")
    parser.add_argument("--base", metavar="FILE", default=None,
                        help="start from this table (e.g. a shipped one) and add the new results")
    parser.add_argument("--budget-s", type=float, default=30.0,
                        help="seconds per (N, K) shape, split over its M buckets (default 30)")
    parser.add_argument("--total-budget-s", type=float, default=450.0,
                        help="stop starting new shapes after this many seconds "
                             "(default 450, so the default run fits in 10 minutes)")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="time at most this many configs per bucket (for quick or CPU dry runs)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda; cpu needs TRITON_INTERPRET=1)")


def _resolve_shapes(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    from .shapes import default_shapes, parse_shape, shapes_from_hf_config

    shapes = []
    if args.shapes:
        shapes += [parse_shape(s) for s in args.shapes]
    if args.hf_config:
        shapes += shapes_from_hf_config(args.hf_config)
    if not shapes:
        shapes = default_shapes()
    seen: dict[tuple[int, int], str] = {}
    for s in shapes:
        seen.setdefault((s.n, s.k), s.name)
    return [(n, k, name) for (n, k), name in seen.items()]


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    dev = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        log("fp8linear tune: needs a CUDA/ROCm GPU (set TRITON_INTERPRET=1 for a slow CPU dry run)")
        return 2
    from ..ops import HAS_TRITON

    if not HAS_TRITON:
        log("fp8linear tune: Triton is not installed (pip install triton)")
        return 2
    try:
        shapes = _resolve_shapes(args)
    except (OSError, ValueError) as e:
        log(f"fp8linear tune: {e}")
        return 2
    name = device_name(dev) if dev.type == "cuda" else "cpu"
    out = Path(args.out) if args.out else cache_table_path(name)
    base = load_table(args.base) if args.base else None
    if base is not None and base.device != name:
        log(f"fp8linear tune: --base is a table for {base.device!r}, this device is {name!r}")
        return 2
    ms = args.m or list(M_BUCKETS)
    if any(m < 1 for m in ms):
        log("fp8linear tune: --m values must be >= 1")
        return 2
    log(f"tuning {len(shapes)} shapes x M buckets {sorted({m_bucket(m) for m in ms})} on {name}; "
        f"{args.budget_s:.0f}s per shape, writing {out}")
    t0 = time.monotonic()
    all_results: list[TuneResult] = []
    for n, k, shape_name in shapes:
        if time.monotonic() - t0 > args.total_budget_s:
            log(f"total budget of {args.total_budget_s:.0f}s spent: skipping ({n},{k}) and the rest")
            continue
        log(f"({n},{k}) {shape_name}")
        results = tune_shape(n, k, ms, dev, granularity=args.granularity, budget_s=args.budget_s,
                             max_candidates=args.max_candidates, log=log)
        all_results += results
        _store_results(results, name, out, base)  # after every shape: a kill keeps what is done
        base = None
    gains = [r.heuristic_us / r.us for r in all_results if r.heuristic_us]
    if gains:
        gm = math.exp(sum(map(math.log, gains)) / len(gains))
        log(f"tuned {len(all_results)} (shape, bucket) pairs in {time.monotonic() - t0:.0f}s; "
            f"geomean speedup over the heuristic {gm:.3f}x; table: {out}")
    print(out)
    return 0 if all_results else 1
