"""`fp8linear bench`: the command line of the GEMM benchmark (:mod:`fp8linear.tools.bench`), its
eager-mode variant (``--eager``, :mod:`fp8linear.tools.bench_eager`) and the whole-range grid
(``--grid``, :mod:`fp8linear.tools.grid`)."""

from __future__ import annotations

import argparse
import sys

import torch

from .bench import (
    DECODE_MS,
    METHODS,
    PREFILL_MS,
    QUICK_MS,
    QUICK_SHAPES,
    BenchConfig,
    Shape,
    _fmt,
    default_shapes,
    format_summary,
    format_table,
    parse_shape,
    quick_shapes,
    run_benchmark,
    shapes_from_hf_config,
    write_outputs,
)

__all__ = ["add_arguments", "build_config", "run"]


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
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="stop starting new shapes after this many seconds (default 330; with --grid 540)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--long", action="store_true", help="also print one line per (shape, M, method)")
    from .bench_eager import add_eager_arguments
    from .grid import add_grid_arguments

    add_eager_arguments(parser)
    add_grid_arguments(parser)


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
        bias=not args.no_bias, deadline_s=args.deadline_s or 330.0,
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "eager", False):
        from .bench_eager import run_eager

        return run_eager(args)
    if getattr(args, "grid", False):
        from . import grid

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        timer = args.timer or ("graph" if torch.device(device).type == "cuda" else "wall")
        try:
            return grid.run(args, device, timer)
        except (OSError, ValueError) as e:
            print(f"fp8linear bench --grid: {e}", file=sys.stderr)
            return 2
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
