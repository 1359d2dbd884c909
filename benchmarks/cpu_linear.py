"""CPU time of the FP8 linear: BF16 `nn.Linear` vs the reference path vs `cpu_fp8_linear`.

Each round times the three methods back to back (interleaved), so that load from other processes
on a shared machine hits them alike; the table shows medians over rounds of the per-round times
and of the per-round ratios (fp8 / bf16). The thread count is fixed (torch.set_num_threads).

    python benchmarks/cpu_linear.py [--threads 2] [--m 1,4,16,128,512] [--shapes 2048:7168 ...]
                                    [--granularity block] [--rounds 7] [--json out.json]
    python benchmarks/cpu_linear.py --tile-sweep      # M=1 time per TILE_ELEMS value (elements per thread)
    python benchmarks/cpu_linear.py --half-tile-sweep # M=1, bf16 x: time per HALF_TILE_ELEMS value (float16 path)

The reference path (dequantize the whole weight, then an fp32 GEMM) is slow: it is timed with
fewer calls per round and skipped above --ref-max-m.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

from fp8linear.ops import cpu_linear
from fp8linear.ops.cpu_linear import cpu_fp8_linear, prepare_cpu_weight
from fp8linear.reference import block_fp8_matmul_ref, quantize_activation_ref, quantize_weight_ref

# N:K of two large DeepSeek-V3-sized shapes and of SmolLM2-135M's linears (q/o 576x576, gate/up 1536x576,
# down 576x1536, k/v 192x576).
DEFAULT_SHAPES = ("2048:7168", "7168:2048", "576:576", "1536:576", "576:1536", "192:576")


def per_call_s(fn: Callable[[], object], budget_s: float, max_calls: int = 50) -> float:
    """Mean seconds per call over enough calls to fill about `budget_s` (one call at least)."""
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    calls = max(1, min(max_calls, int(budget_s / max(one, 1e-7))))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def reference_linear(x, w_q, w_s, bias):
    x_q, x_s = quantize_activation_ref(x, w_q.dtype)
    return block_fp8_matmul_ref(x_q, x_s, w_q, w_s, x.dtype, bias)


def bench_shape(n: int, k: int, m: int, granularity: str, rounds: int, budget_s: float, with_ref: bool) -> dict:
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w_q, w_s = quantize_weight_ref(w, granularity, torch.float8_e4m3fn)
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(m, k, generator=gen).bfloat16()
    prep = prepare_cpu_weight(w_q, w_s, granularity)
    methods = {
        "bf16": lambda: lin(x),
        "fp8": lambda: cpu_fp8_linear(x, w_q, w_s, granularity, None, prep),
    }
    if with_ref:
        methods["ref"] = lambda: reference_linear(x, w_q, w_s, None)
    times: dict[str, list[float]] = {name: [] for name in methods}
    with torch.inference_mode():
        for fn in methods.values():
            fn()
        for _ in range(rounds):
            for name, fn in methods.items():
                times[name].append(per_call_s(fn, budget_s if name != "ref" else budget_s / 4))
    row = {"n": n, "k": k, "m": m, "granularity": granularity}
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts) * 1e3
    row["fp8_over_bf16"] = statistics.median(f / b for f, b in zip(times["fp8"], times["bf16"]))
    if with_ref:
        row["ref_over_bf16"] = statistics.median(r / b for r, b in zip(times["ref"], times["bf16"]))
        row["ref_over_fp8"] = statistics.median(r / f for r, f in zip(times["ref"], times["fp8"]))
    return row


def tile_sweep(shapes: list[tuple[int, int]], rounds: int, budget_s: float, name: str = "TILE_ELEMS",
               exponents: range = range(16, 23)) -> list[dict]:
    """M=1 (bf16 x, 'block') time per value of cpu_linear.`name` (elements per intra-op thread)."""
    rows = []
    saved = getattr(cpu_linear, name)
    try:
        for n, k in shapes:
            w_q, w_s = quantize_weight_ref(torch.randn(n, k) / math.sqrt(k), "block", torch.float8_e4m3fn)
            prep = prepare_cpu_weight(w_q, w_s, "block")
            x = torch.randn(1, k).bfloat16()
            tiles = [1 << e for e in exponents]
            times: dict[int, list[float]] = {t: [] for t in tiles}
            for _ in range(rounds):
                for t in tiles:
                    setattr(cpu_linear, name, t)
                    times[t].append(per_call_s(lambda: cpu_fp8_linear(x, w_q, w_s, "block", None, prep), budget_s))
            for t in tiles:
                rows.append({"n": n, "k": k, name.lower(): t, "fp8_ms": statistics.median(times[t]) * 1e3})
                print(f"{n:>5d}x{k:<5d} {name} 2^{int(math.log2(t)):<2d} {rows[-1]['fp8_ms']:8.3f} ms", flush=True)
    finally:
        setattr(cpu_linear, name, saved)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--m", default="1,4,16,128,512")
    p.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES), help="N:K weight shapes")
    p.add_argument("--granularity", default="block", choices=("block", "row", "tensor"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--budget-ms", type=float, default=30.0, help="time per method per round")
    p.add_argument("--ref-max-m", type=int, default=512, help="time the reference path up to this M")
    p.add_argument("--tile-sweep", action="store_true", help="M=1 time per TILE_ELEMS value instead")
    p.add_argument("--half-tile-sweep", action="store_true", help="M=1, bf16 x: time per HALF_TILE_ELEMS value instead")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(map(int, s.split(":"))) for s in args.shapes]
    print(f"{platform.processor() or platform.machine()}  torch {torch.__version__}  threads {args.threads}  "
          f"granularity {args.granularity}  TILE_ELEMS {cpu_linear.TILE_ELEMS}")
    if args.tile_sweep:
        rows = tile_sweep(shapes, args.rounds, args.budget_ms / 1e3)
    elif args.half_tile_sweep:
        rows = tile_sweep(shapes, args.rounds, args.budget_ms / 1e3, "HALF_TILE_ELEMS", range(16, 22))
    else:
        ms = [int(v) for v in args.m.split(",")]
        print(f"{'N x K':>11s} {'M':>4s} {'bf16 ms':>9s} {'ref ms':>9s} {'fp8 ms':>9s} {'fp8/bf16':>8s} "
              f"{'ref/bf16':>8s} {'ref/fp8':>7s}")
        rows = []
        for n, k in shapes:
            for m in ms:
                r = bench_shape(n, k, m, args.granularity, args.rounds, args.budget_ms / 1e3, m <= args.ref_max_m)
                rows.append(r)
                ref = f"{r['ref_ms']:9.3f}" if "ref_ms" in r else f"{'-':>9s}"
                rr = f"{r['ref_over_bf16']:8.1f}" if "ref_ms" in r else f"{'-':>8s}"
                rf = f"{r['ref_over_fp8']:7.1f}" if "ref_ms" in r else f"{'-':>7s}"
                print(f"{n:>5d}x{k:<5d} {m:4d} {r['bf16_ms']:9.3f} {ref} {r['fp8_ms']:9.3f} "
                      f"{r['fp8_over_bf16']:8.2f} {rr} {rf}", flush=True)
    if args.json:
        meta = {"torch": torch.__version__, "threads": args.threads, "tile_elems": cpu_linear.TILE_ELEMS,
                "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        with open(args.json + ".tmp", "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
        import os

        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
