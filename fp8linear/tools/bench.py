"""Benchmark of the FP8 GEMM against BF16 and cuBLAS FP8 on the GPU at hand (`fp8linear bench`).

For every weight shape (N, K) and batch M it times, per call:

==================  ===========================================================================
``bf16``            ``torch.matmul(x, w.t())`` in BF16 (cuBLAS)
``cublas_block``    ``torch._scaled_mm`` with 1x128 activation / 128x128 weight scales (cuBLAS,
                    CUDA >= 12.9, Hopper+); shapes it refuses are reported as ``refused``
``cublas_tensor``   ``torch._scaled_mm`` with one scale per tensor (the FP8 ceiling)
``ours_block``      :func:`fp8linear.block_fp8_matmul`, 128x128 weight scales (GEMM only), as users
                    get it (backend "auto": on Hopper, M >= 128 goes to cuBLAS where it is
                    correct and faster, see :mod:`fp8linear.ops.cublas_gemm`)
``triton_block``    the same with ``backend="triton"``: our Triton kernels alone
``ours_row``        :func:`fp8linear.block_fp8_matmul`, 1x128 row-wise weight scales
``ours_forward``    :func:`fp8linear.fp8_linear` = ``Fp8BlockLinear.forward``: activation
                    quantization + GEMM + bias, from a BF16 input
==================  ===========================================================================

Timing: each method's operands are cloned into enough sets that one pass over them reads
more than twice the L2 cache; a CUDA graph of R calls cycling over the sets is captured per
method (falls back to CUDA events if capture fails); then the graphs of one (shape, M) are
replayed in interleaved rounds, one replay of each method per round, so clock drift during the
run reaches every method alike; the median replay time divided by R is the time per call.
``ours_*`` count split-K tiles in per-layer counters, as ``Fp8BlockLinear`` does. Every
method's output (its first 128 rows) is also compared with a float64 product of the BF16 inputs.
Output: a table on stdout, per-target summaries (the speed targets), CSV + JSON with versions, a PNG.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .shapes import DSV3_SHAPES, QUICK_SHAPES, QUICK_MS, Shape, default_shapes, parse_shape, quick_shapes, shapes_from_hf_config
from .timing import _ROTATE_L2_FACTOR, Round, l2_bytes, prepare_cuda, time_rounds, rotation_sets

__all__ = [
    "METHODS",
    "DECODE_MS",
    "PREFILL_MS",
    "Shape",
    "BenchConfig",
    "BenchRow",
    "BenchResult",
    "QUICK_MS",
    "default_shapes",
    "quick_shapes",
    "parse_shape",
    "shapes_from_hf_config",
    "run_benchmark",
    "summarize",
    "format_table",
    "format_summary",
    "write_outputs",
    "plot_results",
    "build_config",
    "add_arguments",
    "run",
]

METHODS: tuple[str, ...] = (
    "bf16", "cublas_block", "cublas_tensor", "ours_block", "triton_block", "ours_row", "ours_forward",
)
_METHOD_LABELS = {
    "bf16": "BF16",
    "cublas_block": "cuBLAS-blk",
    "cublas_tensor": "per-tensor",
    "ours_block": "ours",
    "triton_block": "triton",
    "ours_row": "ours-row",
    "ours_forward": "forward",
}
DECODE_MS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
PREFILL_MS: tuple[int, ...] = (1024, 2048, 4096)
# The speed targets' boundaries: decode is M <= 64, prefill M >= 1024.
DECODE_MAX_M = 64
PREFILL_MIN_M = 1024
# The M=1 bandwidth target applies to weights of at least 64M elements.
BIG_WEIGHT_ELEMENTS = 64 * 2**20
# The speed targets (ratios of per-call times measured in one run).
TARGET_PREFILL_VS_CUBLAS = 1.0  # ours / cuBLAS blockwise, geomean, M >= 1024
TARGET_PREFILL_MOONSHOT = 1.10  # ours / per-tensor FP8
TARGET_PREFILL_VS_BF16 = 1.6  # BF16 / ours per shape class
TARGET_DECODE_VS_TENSOR = 1.0  # ours / per-tensor FP8, geomean, M <= 64
TARGET_M1_TBPS = 2.7  # weight TB/s at M=1 on big weights
TARGET_ROW_PREFILL = 1.10  # row-wise / block, M >= 1024
TARGET_ROW_DECODE = 1.05  # row-wise / block, M <= 64
TARGET_FWD_PREFILL = 1.15  # forward / GEMM-only, M >= 1024
TARGET_FWD_DECODE_US = 3.0  # forward - GEMM-only, µs, M <= 64

# Flag a method whose error is far above FP8's ~3-4 % on random data (e.g. a misread scale layout).
_SUSPICIOUS_ERR = 0.2
# Errors are measured on the first rows of the output only (rows are independent; a float64
# reference of all 4096 rows of every shape would take minutes of FP64 GEMM).
_ERR_ROWS = 128
# Weight init scale (~ a trained LLM's linear weights); activations are unit normal.
_WEIGHT_STD = 0.02


# ----------------------------------------------------------------------------- config and rows
@dataclass(frozen=True)
class BenchConfig:
    """What to run and how to time it."""

    shapes: tuple[Shape, ...]
    ms: tuple[int, ...]
    methods: tuple[str, ...] = METHODS
    device: str = "cuda"
    timer: str = "graph"  # 'graph' (CUDA graph replay), 'events' (CUDA events), 'wall' (CPU)
    replays: int = 7
    warmup: int = 3
    backend: str | None = None  # fp8linear backend for ours (None: auto)
    bias: bool = True  # ours_forward gets a bias, as Fp8BlockLinear(bias=True) does
    deadline_s: float = 330.0  # stop starting new shapes after this long (the default run fits)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("BenchConfig.shapes is empty")
        if not self.ms or any((not isinstance(m, int)) or m < 1 for m in self.ms):
            raise ValueError(f"BenchConfig.ms must be positive ints, got {self.ms}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown methods {bad}; choose from {METHODS}")
        if self.timer not in ("graph", "events", "wall"):
            raise ValueError(f"timer must be 'graph', 'events' or 'wall', got {self.timer!r}")
        if self.timer != "wall" and torch.device(self.device).type != "cuda":
            raise ValueError(f"timer {self.timer!r} needs a CUDA device, got {self.device!r}")
        if self.replays < 1 or self.warmup < 0:
            raise ValueError("replays must be >= 1 and warmup >= 0")
        if self.deadline_s <= 0:
            raise ValueError("deadline_s must be positive")


@dataclass
class BenchRow:
    """One (shape, M, method) measurement."""

    shape: str
    n: int
    k: int
    m: int
    method: str
    status: str  # 'ok', 'refused' (cuBLAS said no), 'error', 'skipped'
    us: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    weight_tbps: float | None = None
    speedup_vs_bf16: float | None = None
    speedup_vs_cublas: float | None = None
    rel_err: float | None = None
    config: str = ""
    note: str = ""


@dataclass
class BenchResult:
    meta: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- timing
def _prepare_wall(fn: Callable[..., Any], sets: Sequence[tuple], cfg: BenchConfig) -> tuple[Round, str]:
    for i in range(cfg.warmup):
        fn(*sets[i % len(sets)])
    turn = itertools.count()

    def one_round() -> float:
        args = sets[next(turn) % len(sets)]
        t0 = time.perf_counter()
        fn(*args)
        return 1e6 * (time.perf_counter() - t0)

    return one_round, "wall"


def _prepare(fn: Callable[..., Any], sets: Sequence[tuple], cfg: BenchConfig) -> tuple[Round, str]:
    if cfg.timer == "wall":
        return _prepare_wall(fn, sets, cfg)
    return prepare_cuda(fn, sets, cfg.warmup, cfg.timer == "graph")


def time_cuda(fn: Callable[..., Any], sets: Sequence[tuple], cfg: BenchConfig) -> tuple[float, str]:
    """Median µs per call of `fn` alone (the kernel sweeps in benchmarks/ use this)."""
    one_round, used = _prepare(fn, sets, cfg)
    return time_rounds({"fn": one_round}, cfg.replays)["fn"], used


# ----------------------------------------------------------------------------- methods
def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y64 = y.double()
    return ((y64 - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _per_tensor_quant(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from ..formats import fp8_max

    qmax = fp8_max(fp8_dtype)
    scale = (x.abs().amax().float() / qmax).clamp_min(1e-12)
    return (x.float() / scale).clamp(-qmax, qmax).to(fp8_dtype), scale.reshape(())


def _cublas_block_scale_b(w_s: torch.Tensor, layout: str) -> torch.Tensor:
    """scale_b for torch._scaled_mm's BlockWise128x128 rhs: shape (K/128, N/128), scale_b.t() row-major.

    'plain': w_s.t() (stride (1, K/128)); 'padded': the same values with the row stride of
    w_s rounded up to a multiple of 4 floats (16 bytes), which some torch versions require.
    """
    if layout == "plain":
        return w_s.t()
    nb, kb = w_s.shape
    buf = torch.zeros(nb, -(-kb // 4) * 4, dtype=w_s.dtype, device=w_s.device)
    buf[:, :kb] = w_s
    return buf[:, :kb].t()


def _describe_config(m: int, n: int, k: int, device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    try:
        from ..ops.config_tables import select_config
    except ImportError:
        return ""
    try:
        c = select_config(device, m, n, k)
    except (TypeError, ValueError, RuntimeError):  # informational only: never fail a row over it
        return ""
    return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} g{c.group_m}"


@dataclass
class _ShapeOperands:
    w: torch.Tensor  # bf16 (N, K)
    w64: torch.Tensor  # float64 (N, K)
    bias: torch.Tensor  # bf16 (N,)
    quant: dict[str, tuple[torch.Tensor, torch.Tensor]]  # granularity -> (w_q, w_s)


def _make_shape_operands(shape: Shape, device: torch.device, gen: torch.Generator, fp8_dtype: torch.dtype,
                         methods: Sequence[str]) -> _ShapeOperands:
    from ..functional import quantize_weight

    w32 = torch.randn(shape.n, shape.k, generator=gen, device=device, dtype=torch.float32).mul_(_WEIGHT_STD)
    w = w32.to(torch.bfloat16)
    del w32
    bias = (torch.randn(shape.n, generator=gen, device=device, dtype=torch.float32) * _WEIGHT_STD).to(torch.bfloat16)
    quant: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    needs = {
        "block": ("cublas_block", "ours_block", "triton_block", "ours_forward"),
        "row": ("ours_row",),
        "tensor": ("cublas_tensor",),
    }
    for gran, users in needs.items():
        if any(m in methods for m in users):
            w_q, w_s = quantize_weight(w, gran, fp8_dtype)
            quant[gran] = (w_q, w_s.contiguous())
    return _ShapeOperands(w=w, w64=w.double(), bias=bias, quant=quant)


def _ours_counters(n: int, device: torch.device) -> torch.Tensor | None:
    """The split-K counters Fp8BlockLinear keeps per layer, so ours is timed as the layer runs it."""
    from ..ops import HAS_TRITON

    if not HAS_TRITON:
        return None
    from ..ops.splitk_gemm import splitk_workspace

    return splitk_workspace(n, device)


def _method_setup(
    method: str, x: torch.Tensor, ops: _ShapeOperands, fp8_dtype: torch.dtype, cfg: BenchConfig,
    cublas_layout: str = "plain",
) -> tuple[Callable[..., torch.Tensor], tuple, int, int]:
    """(fn, args of one set, bytes one call moves (weight + scales + activation + output), output bytes)."""
    from ..backend import cublas_allowed
    from ..functional import block_fp8_matmul, fp8_linear, quantize_activation
    from ..ops.cublas_gemm import use_cublas_prequantized

    m, k = x.shape
    n = ops.w.shape[0]
    out_bytes = m * n * 2  # bf16 output
    if method == "bf16":
        return (lambda a, b: torch.matmul(a, b.t())), (x, ops.w), 2 * (n * k + m * k) + out_bytes, out_bytes
    if method == "cublas_tensor":
        x_q, x_s = _per_tensor_quant(x, fp8_dtype)
        w_q, w_s = ops.quant["tensor"]
        w_s = w_s.reshape(())

        def per_tensor(a, sa, b, sb):
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        return per_tensor, (x_q, x_s, w_q, w_s), n * k + m * k + 8 + out_bytes, out_bytes
    x_q, x_s = quantize_activation(x, fp8_dtype=fp8_dtype, backend=cfg.backend)
    act_bytes = m * k + x_s.numel() * 4
    scale_a = x_s.t().contiguous().t()  # (M, K/128) M-major, stride (1, M): the layout cuBLAS reads
    if method == "cublas_block":
        w_q, w_s = ops.quant["block"]
        scale_b = _cublas_block_scale_b(w_s, cublas_layout)

        def cublas_block(a, sa, b, sb):
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        return cublas_block, (x_q, scale_a, w_q, scale_b), n * k + w_s.numel() * 4 + act_bytes + out_bytes, out_bytes
    if method in ("ours_block", "triton_block", "ours_row"):
        granularity = "row" if method == "ours_row" else "block"
        w_q, w_s = ops.quant[granularity]
        backend = "triton" if method == "triton_block" and cfg.backend != "reference" else cfg.backend
        # The activation scales in the layout Fp8BlockLinear's forward writes for the path this GEMM
        # takes: M-major where it goes to cuBLAS (as cuBLAS-blk gets them), row-major for our kernels.
        on_cublas = use_cublas_prequantized(x_q, w_q, granularity, torch.bfloat16, None, cublas_allowed(backend))

        counters = _ours_counters(n, x.device)

        def ours(a, sa, b, sb):
            return block_fp8_matmul(a, sa, b, sb, torch.bfloat16, None, backend=backend, counters=counters)

        args = (x_q, scale_a if on_cublas else x_s, w_q, w_s)
        return ours, args, n * k + w_s.numel() * 4 + act_bytes + out_bytes, out_bytes
    if method == "ours_forward":
        w_q, w_s = ops.quant["block"]
        bias = ops.bias if cfg.bias else None

        counters = _ours_counters(n, x.device)

        def forward(a, b, sb, bb):
            return fp8_linear(a, b, sb, bb, backend=cfg.backend, counters=counters)

        extra = n * 2 if bias is not None else 0
        return forward, (x, w_q, w_s, bias), n * k + w_s.numel() * 4 + m * k * 2 + extra + out_bytes, out_bytes
    raise ValueError(f"unknown method {method!r}")


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    return (f"{type(e).__name__}: " + (text[0] if text else ""))[:limit]


def _measure_shape(shape: Shape, cfg: BenchConfig, device: torch.device, fp8_dtype: torch.dtype,
                   gen: torch.Generator, log: Callable[[str], None]) -> list[BenchRow]:
    rows: list[BenchRow] = []
    ops = _make_shape_operands(shape, device, gen, fp8_dtype, cfg.methods)
    for m in cfg.ms:
        x = torch.randn(m, shape.k, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        rows_err = min(m, _ERR_ROWS)
        ref = x[:rows_err].double() @ ops.w64.t()
        ref_bias = ref + ops.bias.double() if cfg.bias else ref
        times: dict[str, float] = {}
        m_rows: list[BenchRow] = []
        prepared: dict[str, tuple[BenchRow, Round, str, int]] = {}  # method -> (row, round, timer, bytes)
        for method in cfg.methods:
            row = BenchRow(shape=shape.name, n=shape.n, k=shape.k, m=m, method=method, status="ok")
            m_rows.append(row)
            if method.startswith("cublas") and device.type != "cuda":
                row.status, row.note = "refused", "needs a CUDA GPU"
                continue
            try:
                # With K/128 not a multiple of 4, cuBLAS accepts the plain scale layout and returns
                # garbage (H100, torch 2.11: relative error 0.09 to 1e3): pad the scale rows first.
                layouts = ("padded", "plain") if method == "cublas_block" and shape.k % 512 else ("plain",)
                refusals: list[str] = []
                for layout in layouts:  # find a scale layout cuBLAS accepts
                    fn, args, nbytes, out_bytes = _method_setup(method, x, ops, fp8_dtype, cfg, layout)
                    try:
                        y = fn(*args)
                    except (RuntimeError, ValueError) as e:
                        if not method.startswith("cublas"):
                            raise
                        refusals.append((f"{layout} scales: " if len(layouts) > 1 else "") + _first_line(e, 200))
                        continue
                    if layout != "plain":
                        row.note = "scale_b rows padded to 16 bytes"
                    break
                else:
                    row.status, row.note = "refused", " | ".join(refusals)
                    continue
                row.rel_err = rel_err(y[:rows_err], ref_bias if method == "ours_forward" else ref)
                if not row.rel_err < _SUSPICIOUS_ERR:
                    row.note = (row.note + "; " if row.note else "") + "SUSPICIOUS ERROR"
                del y
                # the output is written, not read: only inputs count towards exceeding L2
                sets = rotation_sets(args, nbytes - out_bytes, device)
                one_round, used = _prepare(fn, sets, cfg)
                prepared[method] = (row, one_round, used, nbytes)
                del sets  # the round's closure keeps them
            except (RuntimeError, ValueError, TypeError) as e:
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                row.status, row.note = "error", _first_line(e)
        try:
            medians = time_rounds({meth: p[1] for meth, p in prepared.items()}, cfg.replays)
        except RuntimeError as e:  # a failure while replaying: no method of this M gets a time
            medians = {}
            for row, *_ in prepared.values():
                row.status, row.note = "error", _first_line(e)
        for method, (row, _, used, nbytes) in prepared.items():
            if method not in medians:
                continue
            us = medians[method]
            row.us = us
            row.tflops = 2.0 * m * shape.n * shape.k / us * 1e-6
            row.gbps = nbytes / us * 1e-3
            w_bytes = shape.n * shape.k * (2 if method == "bf16" else 1)
            row.weight_tbps = w_bytes / us * 1e-6
            if used != cfg.timer:
                row.note = (row.note + "; " if row.note else "") + f"timed with {used}"
            if method in ("ours_block", "triton_block", "ours_row", "ours_forward"):
                row.config = _describe_config(m, shape.n, shape.k, device)
            times[method] = us
        del prepared
        for row in m_rows:
            if row.us is not None:
                if "bf16" in times:
                    row.speedup_vs_bf16 = times["bf16"] / row.us
                if "cublas_block" in times:
                    row.speedup_vs_cublas = times["cublas_block"] / row.us
        rows += m_rows
        del x, ref, ref_bias
        ours = times.get("ours_block")
        log(f"  M={m:<5d} " + "  ".join(f"{_METHOD_LABELS[k_]} {v:.1f}" for k_, v in times.items())
            + (f"  (ours {times['bf16'] / ours:.2f}x BF16)" if ours and "bf16" in times else ""))
    del ops
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _versions(device: torch.device) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "host": platform.node(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    from .. import __version__

    meta["fp8linear"] = __version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=l2_bytes(device),
        )
        try:
            meta["cublas"] = torch._C._cuda_getCompiledVersion()
        except AttributeError:
            pass
    else:
        meta.update(gpu="none (CPU)", l2_bytes=0)
    return meta


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] | None = None) -> BenchResult:
    """Measure every (shape, M, method) of `cfg`; stops starting new shapes after cfg.deadline_s."""
    from ..formats import default_fp8_dtype

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fp8_dtype = default_fp8_dtype(device)
    l2 = l2_bytes(device)
    meta = _versions(device)
    meta.update(
        timer=cfg.timer, replays=cfg.replays, interleaved=True, fp8_dtype=str(fp8_dtype).removeprefix("torch."),
        rotate_bytes=_ROTATE_L2_FACTOR * l2, backend=cfg.backend or "auto", bias=cfg.bias,
        shapes=[asdict(s) for s in cfg.shapes], ms=list(cfg.ms), methods=list(cfg.methods),
    )
    result = BenchResult(meta=meta)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    t0 = time.monotonic()
    skipped: list[str] = []
    for shape in cfg.shapes:
        if time.monotonic() - t0 > cfg.deadline_s:
            skipped.append(shape.label)
            continue
        log(f"[{time.monotonic() - t0:6.1f}s] ({shape.n},{shape.k}) {shape.name}")
        result.rows += _measure_shape(shape, cfg, device, fp8_dtype, gen, log)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    if skipped:
        meta["truncated"] = f"deadline of {cfg.deadline_s:.0f}s reached; not measured: {skipped}"
        log("TRUNCATED: " + meta["truncated"])
    result.summary = summarize(result.rows)
    return result


# ----------------------------------------------------------------------------- summaries
def _geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def _item(value: float | None, target: float, higher_is_better: bool, n: int, **extra: Any) -> dict[str, Any]:
    ok = None if value is None else (value >= target if higher_is_better else value <= target)
    d = {"value": value, "target": target, "goal": ">=" if higher_is_better else "<=", "pass": ok, "cases": n}
    d.update(extra)
    return d


def summarize(rows: Sequence[BenchRow]) -> dict[str, Any]:
    """The speed targets as ratios over the rows: value, target, pass, number of cases."""
    t: dict[tuple[int, int, int, str], float] = {  # wrong results (e.g. a misread scale layout) do not count
        (r.n, r.k, r.m, r.method): r.us for r in rows
        if r.status == "ok" and r.us and (r.rel_err is None or r.rel_err < _SUSPICIOUS_ERR)
    }
    keys = sorted({(n, k, m) for n, k, m, _ in t})
    pre = [c for c in keys if c[2] >= PREFILL_MIN_M]
    dec = [c for c in keys if c[2] <= DECODE_MAX_M]

    def ratios(cases, a: str, b: str) -> list[float]:
        return [t[(*c, a)] / t[(*c, b)] for c in cases if (*c, a) in t and (*c, b) in t]

    s: dict[str, Any] = {}
    r1 = ratios(pre, "ours_block", "cublas_block")
    s["prefill_ours_over_cublas_block"] = _item(_geomean(r1), TARGET_PREFILL_VS_CUBLAS, False, len(r1))
    r1t = ratios(pre, "triton_block", "cublas_block")
    s["prefill_triton_over_cublas_block"] = _item(_geomean(r1t), TARGET_PREFILL_VS_CUBLAS, False, len(r1t))
    r1m = ratios(pre, "ours_block", "cublas_tensor")
    s["prefill_ours_over_per_tensor"] = _item(_geomean(r1m), TARGET_PREFILL_MOONSHOT, False, len(r1m))
    per_shape = {}
    for n, k in sorted({(c[0], c[1]) for c in pre}):
        sp = _geomean(ratios([c for c in pre if c[:2] == (n, k)], "bf16", "ours_block"))
        if sp is not None:
            per_shape[f"{n},{k}"] = sp
    worst = min(per_shape.items(), key=lambda kv: kv[1]) if per_shape else (None, None)
    s["prefill_min_speedup_vs_bf16"] = _item(worst[1], TARGET_PREFILL_VS_BF16, True, len(per_shape),
                                             worst_shape=worst[0], per_shape=per_shape)
    r2 = ratios(dec, "ours_block", "cublas_tensor")
    s["decode_ours_over_per_tensor"] = _item(_geomean(r2), TARGET_DECODE_VS_TENSOR, False, len(r2))
    bw = {f"{n},{k}": (n * k) / t[(n, k, 1, "ours_block")] * 1e-6
          for n, k, m in keys if m == 1 and n * k >= BIG_WEIGHT_ELEMENTS and (n, k, 1, "ours_block") in t}
    worst_bw = min(bw.items(), key=lambda kv: kv[1]) if bw else (None, None)
    s["decode_m1_weight_tbps_min"] = _item(worst_bw[1], TARGET_M1_TBPS, True, len(bw),
                                           worst_shape=worst_bw[0], per_shape=bw)
    r3p = ratios(pre, "ours_row", "ours_block")
    s["prefill_row_over_block"] = _item(_geomean(r3p), TARGET_ROW_PREFILL, False, len(r3p),
                                        max=max(r3p) if r3p else None)
    r3d = ratios(dec, "ours_row", "ours_block")
    s["decode_row_over_block"] = _item(_geomean(r3d), TARGET_ROW_DECODE, False, len(r3d),
                                       max=max(r3d) if r3d else None)
    r4p = ratios(pre, "ours_forward", "ours_block")
    s["prefill_forward_over_gemm"] = _item(_geomean(r4p), TARGET_FWD_PREFILL, False, len(r4p),
                                           max=max(r4p) if r4p else None)
    d4 = [t[(*c, "ours_forward")] - t[(*c, "ours_block")] for c in dec
          if (*c, "ours_forward") in t and (*c, "ours_block") in t]
    s["decode_forward_minus_gemm_us_max"] = _item(max(d4) if d4 else None, TARGET_FWD_DECODE_US, False, len(d4),
                                                  mean=statistics.fmean(d4) if d4 else None)
    # Reference numbers: geomean µs per method over the DeepSeek-V3 shapes.
    dsv3 = {(n, k) for n, k, _ in DSV3_SHAPES}
    ref: dict[str, dict[str, float | None]] = {}
    for label, m_set in (("M=4096", {4096}), ("M in {1,16,64}", {1, 16, 64})):
        cases = [c for c in keys if (c[0], c[1]) in dsv3 and c[2] in m_set]
        if cases:
            ref[label] = {meth: _geomean(t.get((*c, meth)) for c in cases) for meth in METHODS}
            ref[label]["cases"] = len(cases)
    s["dsv3_geomean_us"] = ref
    return s


# ----------------------------------------------------------------------------- output
def _fmt(v: float | None, spec: str, width: int) -> str:
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}}"


def format_table(rows: Sequence[BenchRow], methods: Sequence[str] = METHODS, timer: str = "graph") -> str:
    """A wide table: per (shape, M) the time and error of each method, then ours' throughput and ratios."""
    how = {"graph": "CUDA-graph replay over L2-cold rotated operands",
           "events": "CUDA events over L2-cold rotated operands, eager launches",
           "wall": "CPU wall clock, median"}[timer]
    by: dict[tuple[int, int, int], dict[str, BenchRow]] = {}
    names: dict[tuple[int, int], str] = {}
    for r in rows:
        by.setdefault((r.n, r.k, r.m), {})[r.method] = r
        names[(r.n, r.k)] = r.shape
    head = f"{'M':>5} |" + "".join(f" {_METHOD_LABELS[m]:>10} {'err':>6} |" for m in methods)
    tail = f" {'TFLOP/s':>7} {'GB/s':>6} {'xBF16':>5} {'xcuBLAS':>7} {'row/blk':>7} {'fwd/gemm':>8}"
    lines = [
        f"times in µs per call ({how}); err = relative Frobenius",
        "error vs float64; TFLOP/s, GB/s (weights+activations+output), xBF16, xcuBLAS refer to 'ours'",
        "(block_fp8_matmul, 128x128 weight scales); 'refused' = cuBLAS rejected the shape/layout.",
    ]
    last_shape = None
    for n, k, m in sorted(by, key=lambda c: (list(names).index((c[0], c[1])), c[2])):
        if (n, k) != last_shape:
            lines += ["", f"(N={n}, K={k}) {names[(n, k)]}", head + tail, "-" * len(head + tail)]
            last_shape = (n, k)
        cells = by[(n, k, m)]
        line = f"{m:5d} |"
        for meth in methods:
            r = cells.get(meth)
            if r is None:
                line += f" {'':>10} {'':>6} |"
            elif r.status != "ok":
                line += f" {r.status:>10} {'':>6} |"
            else:
                line += f" {r.us:10.1f} {_fmt(r.rel_err, '.4f', 6)} |"
        o = cells.get("ours_block")
        ok = o is not None and o.status == "ok"
        rr, fr = cells.get("ours_row"), cells.get("ours_forward")
        row_ratio = rr.us / o.us if ok and rr and rr.us else None
        fwd_ratio = fr.us / o.us if ok and fr and fr.us else None
        line += (f" {_fmt(o.tflops if ok else None, '.1f', 7)} {_fmt(o.gbps if ok else None, '.0f', 6)}"
                 f" {_fmt(o.speedup_vs_bf16 if ok else None, '.2f', 5)}"
                 f" {_fmt(o.speedup_vs_cublas if ok else None, '.2f', 7)}"
                 f" {_fmt(row_ratio, '.3f', 7)} {_fmt(fwd_ratio, '.3f', 8)}")
        lines.append(line)
    notes = sorted({(r.method, r.note) for r in rows if r.note and r.status != "ok"})
    if notes:
        lines += ["", "notes:"] + [f"  {_METHOD_LABELS[m]}: {note}" for m, note in notes]
    return "\n".join(lines)


def format_summary(summary: Mapping[str, Any]) -> str:
    def v(key: str, spec: str = ".3f") -> str:
        it = summary.get(key, {})
        val = it.get("value")
        if val is None:
            return f"n/a ({it.get('goal', '')} {it.get('target', '')}; no cases)"
        mark = "PASS" if it.get("pass") else "MISS"
        return f"{val:{spec}} ({it['goal']} {it['target']}) {mark} [{it['cases']} cases]"

    def extra(key: str, field_name: str, spec: str = ".3f") -> str:
        val = summary.get(key, {}).get(field_name)
        return f", {field_name} {val:{spec}}" if val is not None else ""

    s = summary
    w = s.get("prefill_min_speedup_vs_bf16", {})
    bw = s.get("decode_m1_weight_tbps_min", {})
    lines = [
        "Speed targets (ratios of per-call times from this run):",
        f"  1. prefill M>={PREFILL_MIN_M}: ours/cuBLAS-blockwise geomean {v('prefill_ours_over_cublas_block')}",
        f"     our Triton kernel alone/cuBLAS-blockwise geomean {v('prefill_triton_over_cublas_block')}",
        f"     moonshot ours/per-tensor geomean {v('prefill_ours_over_per_tensor')}",
        f"     speedup vs BF16, worst shape class {v('prefill_min_speedup_vs_bf16')}"
        + (f" at {w.get('worst_shape')}" if w.get("worst_shape") else ""),
    ]
    if w.get("per_shape"):
        lines.append("       per shape: " + ", ".join(f"{k_} {x:.2f}x" for k_, x in w["per_shape"].items()))
    lines += [
        f"  2. decode M<={DECODE_MAX_M}: ours/per-tensor geomean {v('decode_ours_over_per_tensor')}",
        f"     M=1, N*K>=64M: weight read TB/s, worst {v('decode_m1_weight_tbps_min', '.2f')}"
        + (f" at {bw.get('worst_shape')}" if bw.get("worst_shape") else ""),
    ]
    if bw.get("per_shape"):
        lines.append("       per shape: " + ", ".join(f"{k_} {x:.2f} TB/s" for k_, x in bw["per_shape"].items()))
    lines += [
        f"  3. row-wise/block prefill geomean {v('prefill_row_over_block')}{extra('prefill_row_over_block', 'max')}",
        f"     row-wise/block decode geomean {v('decode_row_over_block')}{extra('decode_row_over_block', 'max')}",
        f"  4. forward/GEMM prefill geomean {v('prefill_forward_over_gemm')}{extra('prefill_forward_over_gemm', 'max')}",
        f"     forward-GEMM decode, max µs {v('decode_forward_minus_gemm_us_max', '.2f')}"
        + extra("decode_forward_minus_gemm_us_max", "mean", ".2f"),
    ]
    for label, per in s.get("dsv3_geomean_us", {}).items():
        lines.append(f"  DeepSeek-V3 shapes, {label} ({per.get('cases')} cases), geomean µs: "
                     + ", ".join(f"{_METHOD_LABELS[m]} {per[m]:.1f}" for m in METHODS if per.get(m)))
    return "\n".join(lines)


def write_outputs(result: BenchResult, out_dir: str | os.PathLike[str], stem: str = "bench_gemm") -> dict[str, Path]:
    """Write <stem>.csv (one row per shape, M, method), <stem>.json (meta, rows, summary) and the plot."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / f"{stem}.csv", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    cols = [f.name for f in fields(BenchRow)]
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        wr = csv.DictWriter(f, fieldnames=cols)
        wr.writeheader()
        for r in result.rows:
            wr.writerow(asdict(r))
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({"meta": result.meta, "summary": result.summary, "rows": [asdict(r) for r in result.rows]},
                  f, indent=1)
        f.write("\n")
    if not plot_results(result, paths["png"]):
        del paths["png"]
    return paths


def plot_results(result: BenchResult, path: str | os.PathLike[str]) -> bool:
    """PNG: ours' speedup vs BF16 (left) and vs cuBLAS blockwise (right) against M, one line per shape."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)", file=sys.stderr)
        return False
    ours = [r for r in result.rows if r.method == "ours_block" and r.status == "ok"]
    if not ours:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharex=True)
    shapes = list(dict.fromkeys((r.n, r.k, r.shape) for r in ours))
    cmap = plt.get_cmap("tab20")
    for i, (n, k, name) in enumerate(shapes):
        pts = sorted((r.m, r.speedup_vs_bf16, r.speedup_vs_cublas) for r in ours if (r.n, r.k) == (n, k))
        label = f"{n}x{k} {name}".strip()
        style = dict(marker="o", ms=3, color=cmap(i % 20), label=label)
        axes[0].plot([p[0] for p in pts if p[1]], [p[1] for p in pts if p[1]], **style)
        cu = [(p[0], p[2]) for p in pts if p[2]]
        if cu:
            axes[1].plot([p[0] for p in cu], [p[1] for p in cu], **style)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(TARGET_PREFILL_VS_BF16, color="gray", lw=0.8, ls="--", label="1.6x (prefill target)")
    axes[0].axhline(2.0, color="gray", lw=0.8, ls=":", label="2x (decode, weight bytes halved)")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[0].set_title("ours (128x128 block FP8) speedup vs BF16 matmul")
    axes[1].set_title("ours speedup vs cuBLAS blockwise FP8 (where cuBLAS accepts)")
    ms = sorted({r.m for r in ours})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("M (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup (x)")
    axes[0].legend(fontsize=7, ncol=2)
    meta = result.meta
    fig.suptitle(f"fp8linear {meta.get('fp8linear')} on {meta.get('gpu')} (torch {meta.get('torch')}, "
                 f"triton {meta.get('triton')}, CUDA {meta.get('cuda')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", metavar="N,K", default=None,
                        help="weight shapes N,K (out_features,in_features); default: the 15 DeepSeek-V3 and other shapes")
    parser.add_argument("--hf-config", metavar="PATH", default=None,
                        help="a Hugging Face config.json (or its folder): benchmark its linear-layer shapes")
    parser.add_argument("--m", nargs="+", type=int, default=None, metavar="M",
                        help=f"batch sizes (default: decode {list(DECODE_MS)} and prefill {list(PREFILL_MS)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a ~1 minute subset: {len(QUICK_SHAPES)} shapes x M in {list(QUICK_MS)}")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods to time")
    parser.add_argument("--out", metavar="DIR", default="bench_results", help="folder for CSV/JSON/PNG")
    parser.add_argument("--timer", choices=("graph", "events", "wall"), default=None,
                        help="graph: CUDA-graph replay (default on GPU); events: eager with CUDA events; "
                             "wall: CPU wall clock (default without a GPU)")
    parser.add_argument("--replays", type=int, default=7, help="timed repetitions; the median is reported")
    parser.add_argument("--backend", choices=("auto", "triton", "reference"), default=None,
                        help="fp8linear backend for 'ours' (default: auto)")
    parser.add_argument("--no-bias", action="store_true", help="time the forward without a bias")
    parser.add_argument("--deadline-s", type=float, default=330.0,
                        help="stop starting new shapes after this many seconds (default 330)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--long", action="store_true", help="also print one line per (shape, M, method)")
    from .bench_eager import add_eager_arguments

    add_eager_arguments(parser)


def build_config(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from parsed CLI arguments (--shapes and --hf-config replace the default shapes)."""
    shapes: list[Shape] = [parse_shape(s) for s in args.shapes or ()]
    if args.hf_config:
        shapes += shapes_from_hf_config(args.hf_config)
    if not shapes:
        shapes = quick_shapes() if args.quick else default_shapes()
    ms = tuple(args.m) if args.m else (QUICK_MS if args.quick else DECODE_MS + PREFILL_MS)
    uniq: dict[tuple[int, int], Shape] = {}
    for s in shapes:  # first name wins
        uniq.setdefault((s.n, s.k), s)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    timer = args.timer or ("graph" if torch.device(device).type == "cuda" else "wall")
    return BenchConfig(
        shapes=tuple(uniq.values()), ms=ms, methods=tuple(args.methods),
        device=device, timer=timer, replays=args.replays,
        backend=None if args.backend in (None, "auto") else args.backend,
        bias=not args.no_bias, deadline_s=args.deadline_s,
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "eager", False):
        from .bench_eager import run_eager

        return run_eager(args)
    try:
        cfg = build_config(args)
    except (OSError, ValueError) as e:
        print(f"fp8linear bench: {e}", file=sys.stderr)
        return 2
    if torch.device(cfg.device).type != "cuda":
        print("fp8linear bench: no CUDA device; a CPU dry run (wall clock, reference backend, no cuBLAS FP8)",
              file=sys.stderr)
    result = run_benchmark(cfg)
    print(format_table(result.rows, cfg.methods, cfg.timer))
    if args.long:
        print()
        for r in result.rows:
            print(f"{r.n:6d} {r.k:6d} {r.m:5d} {r.method:14s} {r.status:8s} {_fmt(r.us, '.2f', 10)} µs "
                  f"{_fmt(r.tflops, '.1f', 7)} TFLOP/s {_fmt(r.gbps, '.0f', 6)} GB/s "
                  f"err {_fmt(r.rel_err, '.4f', 7)} {r.config} {r.note}")
    print()
    print(format_summary(result.summary))
    paths = write_outputs(result, args.out)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    print(f"{result.meta.get('gpu')}, torch {result.meta.get('torch')}, triton {result.meta.get('triton')}, "
          f"CUDA {result.meta.get('cuda')}; {result.meta.get('seconds')}s")
    return 0 if any(r.status == "ok" for r in result.rows) else 1
