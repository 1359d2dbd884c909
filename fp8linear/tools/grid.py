"""`fp8linear bench --grid`: FP8 against BF16 over the whole operating range, per M bucket.

The grid is every M of GRID_MS (decode, continuous-batching decode, chunked prefill, prefill; many
not multiples of 4) times the linear shapes of DeepSeek-V3, DeepSeek-V2-Lite, Llama-3 8B/70B,
Qwen2.5 7B/72B, Mixtral-8x7B and SmolLM2-135M. Each case is timed by :mod:`fp8linear.tools.bench`
(CUDA-graph replays over operand sets rotated past L2, methods interleaved, medians). The summary
gives, per M bucket, the geometric-mean time of each method, ours over per-tensor cuBLAS FP8 (the
FP8 ceiling), the worst ours/BF16 with its case, and the same for our Triton kernels alone
(``backend="triton"``) and for row-wise 1x128 weights. CSV + JSON + a PNG (speedup vs BF16 over M,
one line per model) are written next to it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .bench import (
    _METHOD_LABELS,
    _SUSPICIOUS_ERR,
    BenchConfig,
    BenchResult,
    BenchRow,
    Shape,
    _geomean,
    bf16_base,
    format_table,
    parse_shape,
    run_benchmark,
    write_outputs,
)

__all__ = [
    "GRID_MS",
    "QUICK_GRID_MS",
    "BUCKETS",
    "GRID_METHODS",
    "MODEL_SHAPES",
    "grid_shapes",
    "quick_grid_shapes",
    "bucket_of",
    "summarize_grid",
    "format_grid_summary",
    "plot_grid",
    "run_grid",
]

# Every M the speed targets cover: decode 1-64, decode batches of continuous batching and chunked
# prefill (77, 200, 333, 1000, 1500, 3000 are not multiples of 4, or not powers of two), prefill.
GRID_MS: tuple[int, ...] = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 77, 96, 128, 160, 192, 200, 256, 320, 333, 384, 512,
    640, 768, 1000, 1024, 1500, 2048, 3000, 4096, 8192,
)
# `--grid --quick`: one M per regime, two of them not multiples of 4.
QUICK_GRID_MS: tuple[int, ...] = (1, 16, 77, 200, 333, 1000, 4096)
# M buckets of the summary: (label, lowest M, highest M).
BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("1-64", 1, 64), ("65-512", 65, 512), ("513-2048", 513, 2048), (">2048", 2049, 1 << 62),
)
GRID_METHODS: tuple[str, ...] = (
    "bf16", "bf16_linear", "cublas_tensor", "cublas_block", "ours_block", "triton_block", "ours_row", "ours_forward",
)
# (N, K, layer) per model; N = out_features, K = in_features. From each model's config.json:
# q/k/v/o, gate/up and down (MLA projections for DeepSeek; experts where the model has them).
MODEL_SHAPES: dict[str, tuple[tuple[int, int, str], ...]] = {
    "DeepSeek-V3": (
        (1536, 7168, "q_a_proj"), (576, 7168, "kv_a_proj_with_mqa"), (24576, 1536, "q_b_proj"),
        (32768, 512, "kv_b_proj"), (7168, 16384, "o_proj"), (18432, 7168, "mlp gate/up"),
        (7168, 18432, "mlp down"), (2048, 7168, "expert gate/up"), (7168, 2048, "expert down"),
        (2112, 7168, "fused q_a + kv_a"),
    ),
    "DeepSeek-V2-Lite": ((1408, 2048, "expert gate/up"), (2048, 1408, "expert down"), (576, 2048, "kv_a_proj")),
    "Llama-3-8B": ((4096, 4096, "q/o_proj"), (1024, 4096, "k/v_proj"), (14336, 4096, "gate/up"),
                   (4096, 14336, "down")),
    "Llama-3-70B": ((8192, 8192, "q/o_proj"), (1024, 8192, "k/v_proj"), (28672, 8192, "gate/up"),
                    (8192, 28672, "down")),
    "Qwen2.5-7B": ((3584, 3584, "q/o_proj"), (512, 3584, "k/v_proj"), (18944, 3584, "gate/up"),
                   (3584, 18944, "down")),
    "Qwen2.5-72B": ((8192, 8192, "q/o_proj"), (1024, 8192, "k/v_proj"), (29568, 8192, "gate/up"),
                    (8192, 29568, "down")),
    "Mixtral-8x7B": ((4096, 4096, "q/o_proj"), (1024, 4096, "k/v_proj"), (14336, 4096, "expert w1/w3"),
                     (4096, 14336, "expert w2")),
    "SmolLM2-135M": ((576, 576, "q/o_proj"), (192, 576, "k/v_proj"), (1536, 576, "gate/up"),
                     (576, 1536, "down")),
}
# `--grid --quick`: one shape per regime (tiny N long K, wide N short K, big square, ragged K).
_QUICK_SHAPES = ((576, 7168), (24576, 1536), (7168, 18432), (1024, 8192), (2048, 1408), (1536, 576))


def _families() -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = {}
    for family, shapes in MODEL_SHAPES.items():
        for n, k, _ in shapes:
            fams = out.setdefault((n, k), [])
            if family not in fams:
                fams.append(family)
    return out


def grid_shapes() -> list[Shape]:
    """Every distinct (N, K) of MODEL_SHAPES, named by the models that have it."""
    seen: dict[tuple[int, int], list[str]] = {}
    for family, shapes in MODEL_SHAPES.items():
        for n, k, layer in shapes:
            seen.setdefault((n, k), []).append(f"{family} {layer}")
    return [Shape(n, k, "; ".join(names)) for (n, k), names in seen.items()]


def quick_grid_shapes() -> list[Shape]:
    by_nk = {(s.n, s.k): s for s in grid_shapes()}
    return [by_nk[nk] for nk in _QUICK_SHAPES]


def bucket_of(m: int) -> str:
    """The summary bucket label of M."""
    for label, lo, hi in BUCKETS:
        if lo <= m <= hi:
            return label
    raise ValueError(f"M must be >= 1, got {m}")


def _times(rows: Sequence[BenchRow]) -> dict[tuple[int, int, int], dict[str, float]]:
    t: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in rows:
        if r.status == "ok" and r.us and (r.rel_err is None or r.rel_err < _SUSPICIOUS_ERR):
            t.setdefault((r.n, r.k, r.m), {})[r.method] = r.us
    return t


def _worst(cases: Mapping[tuple[int, int, int], dict[str, float]], method: str, base: str) -> dict[str, Any]:
    """The case with the largest time(method)/time(base), and how many exceed 1 and 1.03."""
    ratios = {c: ts[method] / ts[base] for c, ts in cases.items() if method in ts and base in ts}
    if not ratios:
        return {"ratio": None, "case": None, "slower": 0, "slower_3pct": 0, "cases": 0}
    c = max(ratios, key=ratios.get)
    return {"ratio": ratios[c], "case": f"M={c[2]} N={c[0]} K={c[1]}",
            "slower": sum(v > 1.0 for v in ratios.values()),
            "slower_3pct": sum(v > 1.03 for v in ratios.values()), "cases": len(ratios)}


def _forward_base(method: str, cases: Mapping[tuple[int, int, int], dict[str, float]]) -> str:
    """The BF16 method `method` is compared with over `cases` (:func:`~fp8linear.tools.bench.bf16_base`)."""
    return bf16_base(method, {m for ts in cases.values() for m in ts}) or "bf16"


def summarize_grid(rows: Sequence[BenchRow]) -> dict[str, Any]:
    """Per bucket: geomean µs per method, geomean ratios, worst ratios against BF16."""
    t = _times(rows)
    out: dict[str, Any] = {"buckets": {}}
    for label, lo, hi in BUCKETS:
        cases = {c: ts for c, ts in t.items() if lo <= c[2] <= hi}
        if not cases:
            continue
        methods = sorted({m for ts in cases.values() for m in ts}, key=GRID_METHODS.index)
        b: dict[str, Any] = {"cases": len(cases)}
        b["geomean_us"] = {m: _geomean(ts[m] for ts in cases.values() if m in ts) for m in methods}
        for method in ("ours_block", "triton_block", "ours_row", "ours_forward"):
            both = [ts[method] / ts["cublas_tensor"] for ts in cases.values() if method in ts and "cublas_tensor" in ts]
            b[f"{method}_over_per_tensor"] = _geomean(both)
            base = _forward_base(method, cases)
            bf = [ts[base] / ts[method] for ts in cases.values() if method in ts and base in ts]
            b[f"{method}_speedup_vs_bf16"] = _geomean(bf)
            b[f"{method}_worst_vs_bf16"] = _worst(cases, method, base)
        out["buckets"][label] = b
    everything = {c: ts for c, ts in t.items()}
    out["worst_ours_vs_bf16"] = _worst(everything, "ours_block", "bf16")
    out["worst_forward_vs_bf16"] = _worst(everything, "ours_forward", _forward_base("ours_forward", everything))
    out["worst_row_vs_bf16"] = _worst(everything, "ours_row", "bf16")
    out["worst_triton_vs_bf16_m_le_1024"] = _worst({c: ts for c, ts in t.items() if c[2] <= 1024}, "triton_block", "bf16")
    big = [ts["bf16"] / ts["triton_block"] for c, ts in t.items() if c[2] >= 2048 and "triton_block" in ts and "bf16" in ts]
    out["triton_speedup_vs_bf16_m_ge_2048"] = _geomean(big)
    return out



def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else f"{v:{spec}}"


def format_grid_summary(summary: Mapping[str, Any]) -> str:
    """The bucket table and the worst cases, as text."""
    buckets = summary.get("buckets", {})
    methods = [m for m in GRID_METHODS if any(m in b["geomean_us"] for b in buckets.values())]
    head = f"{'bucket':>9} {'cases':>5} | " + " ".join(f"{_METHOD_LABELS[m]:>10}" for m in methods)
    head += " | ours/ptensor triton/ptensor | ours xBF16 worst  slower(>3%)"
    lines = ["Geomean µs per call per M bucket (ours = block_fp8_matmul, backend auto; forward = fp8_linear "
             "from a BF16 input, bias included, against BF16-lin = F.linear with the bias; per-tensor = cuBLAS "
             "FP8 with one scale per tensor):", head, "-" * len(head)]
    for label, b in buckets.items():
        g = b["geomean_us"]
        w = b["ours_block_worst_vs_bf16"]
        lines.append(
            f"{label:>9} {b['cases']:5d} | " + " ".join(f"{_f(g.get(m), '.1f'):>10}" for m in methods)
            + f" | {_f(b['ours_block_over_per_tensor']):>12} {_f(b['triton_block_over_per_tensor']):>14}"
            + f" | {_f(b['ours_block_speedup_vs_bf16']):>9} {_f(w['ratio']):>5}  {w['slower']}({w['slower_3pct']})"
        )
    lines.append("")
    for key, what in (("worst_ours_vs_bf16", "ours/BF16"), ("worst_forward_vs_bf16", "forward/BF16 nn.Linear"),
                      ("worst_row_vs_bf16", "ours row-wise/BF16"),
                      ("worst_triton_vs_bf16_m_le_1024", "triton/BF16, M <= 1024")):
        w = summary.get(key) or {}
        if w.get("ratio") is not None:
            lines.append(f"worst {what}: {w['ratio']:.2f} at {w['case']}; slower than BF16 in {w['slower']} of "
                         f"{w['cases']} cases ({w['slower_3pct']} by more than 3%)")
    tb = summary.get("triton_speedup_vs_bf16_m_ge_2048")
    if tb is not None:
        lines.append(f"triton speedup vs BF16 at M >= 2048 (geomean): {tb:.2f}x")
    return "\n".join(lines)


def plot_grid(result: BenchResult, path: str | Path) -> bool:
    """PNG: geomean speedup of ours (solid) and our Triton kernels (dashed) vs BF16 over M, per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)", file=sys.stderr)
        return False
    t = _times(result.rows)
    fams = _families()
    fig, ax = plt.subplots(figsize=(12, 6))
    cmap = plt.get_cmap("tab10")
    drawn = False
    for i, family in enumerate(MODEL_SHAPES):
        for method, style in (("ours_block", "-"), ("triton_block", "--")):
            pts = []
            for m in sorted({c[2] for c in t}):
                sp = _geomean(ts["bf16"] / ts[method] for c, ts in t.items()
                              if c[2] == m and family in fams.get((c[0], c[1]), ()) and method in ts and "bf16" in ts)
                if sp is not None:
                    pts.append((m, sp))
            if pts:
                drawn = True
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, color=cmap(i % 10),
                        label=f"{family} ({_METHOD_LABELS[method]})")
    if not drawn:
        plt.close(fig)
        return False
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speedup vs BF16 (x), geomean over the model's shapes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    meta = result.meta
    ax.set_title(f"fp8linear {meta.get('fp8linear')} on {meta.get('gpu')} (torch {meta.get('torch')}, "
                 f"triton {meta.get('triton')}); solid: ours (auto), dashed: our Triton kernels", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grid", action="store_true",
                        help="the whole operating range: 29 Ms x the linear shapes of 8 models, summarised per "
                             "M bucket (with --quick: 7 Ms x 6 shapes)")


def grid_config(args: argparse.Namespace, device: str, timer: str) -> BenchConfig:
    """BenchConfig of `bench --grid` (--shapes, --m and --methods narrow it)."""
    quick = getattr(args, "quick", False)
    shapes = [parse_shape(s) for s in args.shapes] if args.shapes else (quick_grid_shapes() if quick else grid_shapes())
    ms = tuple(args.m) if args.m else (QUICK_GRID_MS if quick else GRID_MS)
    methods = tuple(m for m in GRID_METHODS if m in args.methods)
    return BenchConfig(shapes=tuple(shapes), ms=ms, methods=methods, device=device, timer=timer,
                       replays=args.replays, backend=None if args.backend in (None, "auto") else args.backend,
                       bias=not args.no_bias, deadline_s=args.deadline_s or 540.0)


def run_grid(cfg: BenchConfig, out_dir: str | Path, log=None) -> tuple[BenchResult, dict[str, Path]]:
    """Run the grid, print the per-case table and the bucket summary, write CSV/JSON/PNG."""
    result = run_benchmark(cfg, log=log)
    result.summary = {"grid": summarize_grid(result.rows)}
    return result, write_outputs(result, out_dir, stem="bench_grid", plot=plot_grid)


def run(args: argparse.Namespace, device: str, timer: str) -> int:
    cfg = grid_config(args, device, timer)
    result, paths = run_grid(cfg, args.out)
    print(format_table(result.rows, cfg.methods, cfg.timer))
    print()
    print(format_grid_summary(result.summary["grid"]))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    meta = result.meta
    print(f"{meta.get('gpu')}, torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}; "
          f"{meta.get('seconds')}s" + (f"; {meta['truncated']}" if meta.get("truncated") else ""))
    return 0 if any(r.status == "ok" for r in result.rows) else 1
