"""The benchmark's vocabulary and its reports: methods, speed targets, configs and result rows,
the target summaries, the text table, CSV/JSON files and the plot (`fp8linear bench`).

Measurement lives in :mod:`fp8linear.tools.bench`, which re-exports every name here.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .shapes import DSV3_SHAPES, Shape

__all__ = [
    "METHODS",
    "DECODE_MS",
    "PREFILL_MS",
    "BenchConfig",
    "BenchRow",
    "BenchResult",
    "summarize",
    "format_table",
    "format_summary",
    "write_outputs",
    "plot_results",
]

METHODS: tuple[str, ...] = (
    "bf16", "bf16_linear", "cublas_block", "cublas_tensor", "ours_block", "triton_block", "ours_row", "ours_forward",
)
_METHOD_LABELS = {
    "bf16": "BF16",
    "bf16_linear": "BF16-lin",
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


def write_outputs(result: BenchResult, out_dir: str | os.PathLike[str], stem: str = "bench_gemm",
                  plot: Callable[[BenchResult, Path], bool] | None = None) -> dict[str, Path]:
    """Write <stem>.csv (one row per shape, M, method), <stem>.json (meta, rows, summary) and the
    plot (`plot`, default :func:`plot_results`; it returns False where it draws nothing)."""
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
    if not (plot or plot_results)(result, paths["png"]):
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
