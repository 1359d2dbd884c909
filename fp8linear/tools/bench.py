"""Benchmark of the FP8 GEMM against BF16 and cuBLAS FP8 on the GPU at hand (`fp8linear bench`).

For every weight shape (N, K) and batch M it times, per call:

==================  ===========================================================================
``bf16``            ``torch.matmul(x, w.t())`` in BF16 (cuBLAS)
``bf16_linear``     ``F.linear(x, w, bias)`` in BF16: the ``nn.Linear`` that ``ours_forward`` replaces,
                    with the same bias (none with ``--no-bias``); ``ours_forward``'s BF16 speedup is
                    against it
``cublas_block``    ``torch._scaled_mm`` with 1x128 activation / 128x128 weight scales (cuBLAS,
                    CUDA >= 12.9, Hopper+); shapes it refuses are reported as ``refused``
``cublas_tensor``   ``torch._scaled_mm`` with one scale per tensor (the FP8 ceiling)
``ours_block``      :func:`fp8linear.block_fp8_matmul`, 128x128 weight scales (GEMM only), as
                    ``Fp8BlockLinear`` runs it (backend "auto": the router's route; where that is
                    cuBLAS, with the weight scale in cuBLAS's layout made once, as the layer holds
                    it, see :mod:`fp8linear.ops.cublas_gemm`)
``triton_block``    the same with ``backend="triton"``: our Triton kernels alone
``ours_row``        :func:`fp8linear.block_fp8_matmul`, 1x128 row-wise weight scales, in the layout
                    ``Fp8BlockLinear`` hands the route (N-major where ``router.use_n_major_scales``, and on cuBLAS)
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
The rows, targets, summaries and files are :mod:`fp8linear.tools.bench_report` (re-exported here);
the shape lists :mod:`fp8linear.tools.shapes`; the timers :mod:`fp8linear.tools.timing`.
"""

from __future__ import annotations

import itertools
import platform
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch

# Re-exported: the report side of the benchmark is importable from here too (e.g. `--grid` uses it).
from .bench_report import (  # noqa: F401
    _METHOD_LABELS,
    _SUSPICIOUS_ERR,
    TARGET_DECODE_VS_TENSOR,
    TARGET_FWD_DECODE_US,
    TARGET_FWD_PREFILL,
    TARGET_M1_TBPS,
    TARGET_PREFILL_MOONSHOT,
    TARGET_PREFILL_VS_BF16,
    TARGET_PREFILL_VS_CUBLAS,
    TARGET_ROW_DECODE,
    TARGET_ROW_PREFILL,
    BIG_WEIGHT_ELEMENTS,
    DECODE_MAX_M,
    DECODE_MS,
    METHODS,
    PREFILL_MIN_M,
    PREFILL_MS,
    BenchConfig,
    BenchResult,
    BenchRow,
    _fmt,
    _geomean,
    _item,
    format_summary,
    format_table,
    plot_results,
    summarize,
    write_outputs,
)
from .shapes import QUICK_MS, QUICK_SHAPES, Shape, default_shapes, parse_shape, quick_shapes, shapes_from_hf_config  # noqa: F401
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
]

# Errors are measured on the first rows of the output only (rows are independent; a float64
# reference of all 4096 rows of every shape would take minutes of FP64 GEMM).
_ERR_ROWS = 128
# Weight init scale (~ a trained LLM's linear weights); activations are unit normal.
_WEIGHT_STD = 0.02


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


def _describe_route(method: str, m: int, n: int, k: int, device: torch.device, fp8_dtype: torch.dtype,
                    cfg: BenchConfig) -> str:
    """The label (:func:`~fp8linear.ops.route_table.route_label`) of the route the router takes for
    this method's GEMM, or for the whole forward ("reference" where the reference path runs); empty
    off CUDA, "unknown (the error)" where the router raises."""
    if device.type != "cuda":
        return ""
    try:  # informational only: never fail a row over it
        return _route_label(method, m, n, k, device, fp8_dtype, cfg)
    except (TypeError, ValueError, RuntimeError) as e:
        return f"unknown ({_first_line(e, 80)})"


def _gemm_backend(method: str, cfg: BenchConfig) -> str | None:
    """The backend our GEMM methods run on: "triton" for triton_block (unless the run is on the
    reference path), the run's backend for the others."""
    return "triton" if method == "triton_block" and cfg.backend != "reference" else cfg.backend


def _route_label(method: str, m: int, n: int, k: int, device: torch.device, fp8_dtype: torch.dtype,
                 cfg: BenchConfig) -> str:
    from ..ops.route_table import route_label
    from ..ops.router import cublas_allowed, resolve_backend, route_gemm, route_linear

    if resolve_backend(cfg.backend, device) == "reference":
        return "reference"
    if method == "ours_forward":
        # the router reads a bias's dtype and layout only
        bias = torch.empty(n, device="meta", dtype=torch.bfloat16) if cfg.bias else None
        route = route_linear(device, m, n, k, "block", fp8_dtype, torch.bfloat16, bias, cublas_allowed(cfg.backend),
                             k % 16 == 0, weight_contiguous=True)
    else:
        backend = _gemm_backend(method, cfg)
        route = route_gemm(device, m, n, k, "row" if method == "ours_row" else "block", fp8_dtype, torch.bfloat16,
                           None, cublas_allowed(backend), k % 16 == 0, True)
    return route_label(route.kernel, route.config) + (":pdl" if route.pdl else "")


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
    from ..ops.splitk_gemm import splitk_counters

    return splitk_counters(n, device)


def _gemm_route(x_q: torch.Tensor, w_q: torch.Tensor, granularity: str, allow_cublas: bool):
    """The router's route for this prequantized GEMM."""
    from ..ops.router import route_gemm, tma_ok

    m, k = x_q.shape
    return route_gemm(x_q.device, m, w_q.shape[0], k, granularity, w_q.dtype, torch.bfloat16, None, allow_cublas,
                      tma_ok(x_q) and tma_ok(w_q), x_q.is_contiguous() and w_q.is_contiguous())


def _routed_to_cublas(x_q: torch.Tensor, w_q: torch.Tensor, granularity: str, allow_cublas: bool) -> bool:
    """Whether the router sends this prequantized GEMM to cuBLAS (which reads M-major activation scales)."""
    return _gemm_route(x_q, w_q, granularity, allow_cublas).kernel == "cublas"


def _layer_row_scale(x_q: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, allow_cublas: bool) -> torch.Tensor:
    """1x128 weight scales in the layout Fp8BlockLinear hands this GEMM's route: its N-major copy where
    the router says our kernel reads that faster (router.use_n_major_scales), and on cuBLAS (the
    layer's cuBLAS route holds that storage as its (K/128, N) scale, so no copy per call); else the
    checkpoint's K-major (row-major) layout."""
    from ..ops.router import use_n_major_scales

    route = _gemm_route(x_q, w_q, "row", allow_cublas)
    if route.kernel == "cublas" or use_n_major_scales(route, x_q.shape[0], x_q.shape[1], "row"):
        return w_s.t().contiguous().t()
    return w_s


def _method_setup(
    method: str, x: torch.Tensor, ops: _ShapeOperands, fp8_dtype: torch.dtype, cfg: BenchConfig,
    cublas_layout: str = "plain",
) -> tuple[Callable[..., torch.Tensor], tuple, int, int]:
    """(fn, args of one set, bytes one call moves (weight + scales + activation + output), output bytes)."""
    from ..ops.router import cublas_allowed
    from ..functional import block_fp8_matmul, fp8_linear, quantize_activation

    m, k = x.shape
    n = ops.w.shape[0]
    out_bytes = m * n * 2  # bf16 output
    if method == "bf16":
        return (lambda a, b: torch.matmul(a, b.t())), (x, ops.w), 2 * (n * k + m * k) + out_bytes, out_bytes
    if method == "bf16_linear":
        bias = ops.bias if cfg.bias else None
        extra = n * 2 if bias is not None else 0
        return (torch.nn.functional.linear, (x, ops.w, bias), 2 * (n * k + m * k) + extra + out_bytes, out_bytes)
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
        backend = _gemm_backend(method, cfg)
        # The activations in the layout Fp8BlockLinear's forward writes for the path this GEMM takes:
        # where it goes to cuBLAS, act_quant's cuBLAS layout (M-major scales, M rounded up to a
        # multiple of 4 rows; as cuBLAS-blk gets them) cut to M rows, row-major for our kernels.
        on_cublas = x.device.type == "cuda" and _routed_to_cublas(x_q, w_q, granularity, cublas_allowed(backend))
        xa_q, xa_s = x_q, x_s
        if on_cublas:
            from ..ops.quant import act_quant

            xp_q, xp_s = act_quant(x, x_q.dtype, cublas_layout=True)
            xa_q, xa_s = xp_q[:m], xp_s[:m]

        if granularity == "row" and x.device.type == "cuda":
            w_s = _layer_row_scale(xa_q, w_q, w_s, cublas_allowed(backend))
        counters = _ours_counters(n, x.device)
        if on_cublas:
            # the route with the weight scale in cuBLAS's layout made once and handed over, as the
            # layer's cuBLAS route holds it (the functional path keeps it on the scale tensor from its
            # first call; handing it over keeps the timing independent of that)
            from ..ops.cublas_gemm import cublas_fp8_gemm, cublas_row_scales, cublas_weight_scale

            config = _gemm_route(xa_q, w_q, granularity, cublas_allowed(backend)).config
            held = cublas_weight_scale(w_q, w_s, granularity, cublas_row_scales(w_q, granularity, config))

            def ours_cublas(a, sa, b, sb, hb):
                return cublas_fp8_gemm(a, sa, b, sb, granularity, None, config, scale_b=hb)

            return (ours_cublas, (xa_q, xa_s, w_q, w_s, held),
                    n * k + held.numel() * 4 + act_bytes + out_bytes, out_bytes)

        def ours(a, sa, b, sb):
            return block_fp8_matmul(a, sa, b, sb, torch.bfloat16, None, backend=backend, counters=counters)

        args = (xa_q, xa_s, w_q, w_s)
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


# Methods that add the bias (with --no-bias, none): compared with the float64 product plus the bias.
_WITH_BIAS = ("bf16_linear", "ours_forward")


def bf16_base(method: str, timed: Collection[str]) -> str | None:
    """The BF16 method `method`'s speedup is measured against, among the methods `timed`: ``bf16_linear``
    (a BF16 ``nn.Linear``, bias included) for the whole forward, else ``bf16`` (the GEMM)."""
    if method == "ours_forward" and "bf16_linear" in timed:
        return "bf16_linear"
    return "bf16" if "bf16" in timed else None


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
                row.rel_err = rel_err(y[:rows_err], ref_bias if method in _WITH_BIAS else ref)
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
            w_bytes = shape.n * shape.k * (2 if method.startswith("bf16") else 1)
            row.weight_tbps = w_bytes / us * 1e-6
            if used != cfg.timer:
                row.note = (row.note + "; " if row.note else "") + f"timed with {used}"
            if method in ("ours_block", "triton_block", "ours_row", "ours_forward"):
                row.config = _describe_route(method, m, shape.n, shape.k, device, fp8_dtype, cfg)
            times[method] = us
        del prepared
        for row in m_rows:
            if row.us is not None:
                base = bf16_base(row.method, times)
                if base is not None:
                    row.speedup_vs_bf16 = times[base] / row.us
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


# ----------------------------------------------------------------------------- CLI
