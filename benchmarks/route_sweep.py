"""Which kernel should run each (N, K, M)? Times every candidate the router could choose, per case.

Candidates: cuBLAS blockwise (M padded to a multiple of 4, as the router runs it), our tiled
kernel with the config the router picks today and with fixed tiles, and our split-K kernel with
several tiles and splits. Timed like `fp8linear bench` (CUDA-graph replays over operand sets
rotated past L2, candidates interleaved, medians). Writes one JSON row per case with every
candidate's µs, for deriving the router's rules and tables (benchmarks/route_fit.py).

    python benchmarks/route_sweep.py --out route_sweep.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

import fp8linear.bench as bench
from fp8linear.bench import _prepare, BenchConfig, _time_rounds, rotation_sets
from fp8linear.functional import quantize_activation, quantize_weight
from fp8linear.ops.configs import GemmConfig, select_config
from fp8linear.ops.cublas_gemm import cublas_fp8_gemm
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.ops.quant import act_quant
from fp8linear.ops.splitk_gemm import SplitKConfig, sm_count, splitk_workspace
from fp8linear.tools.grid import GRID_MS, grid_shapes

TILED = (
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 128, num_warps=4, num_stages=3),
    GemmConfig(128, 64, 128, num_warps=4, num_stages=4),
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4),
)
SPLIT_TILES = ((16, 64), (32, 64), (64, 64), (64, 128), (128, 128))


def split_candidates(m: int, n: int, k: int, sms: int) -> list[SplitKConfig]:
    groups = triton.cdiv(k, 128)
    out = []
    for bm, bn in SPLIT_TILES:
        if bm > max(16, 1 << (m - 1).bit_length()) or (m > 64 and bm < 64) or (m <= 16 and bm > 16):
            continue
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        for programs_per_sm in (1, 2):
            split = min(triton.cdiv(programs_per_sm * sms, tiles), max(1, groups // 2))
            if split < 2:
                continue
            split = triton.cdiv(groups, triton.cdiv(groups, split))
            warps = 8 if bm * bn >= 128 * 128 else 4
            c = SplitKConfig(bm, bn, split, num_warps=warps, num_stages=4 if bm * bn < 128 * 128 else 3)
            if c not in out:
                out.append(c)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--m", nargs="+", type=int, default=None)
    p.add_argument("--shapes", nargs="+", default=None, help="N,K")
    p.add_argument("--deadline-s", type=float, default=540)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    bench._TARGET_GRAPH_US = 1500.0  # shorter graphs: many candidates per case
    cfg = BenchConfig(shapes=tuple(grid_shapes()), ms=(1,), replays=5)
    shapes = [(s.n, s.k) for s in grid_shapes()]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    ms = args.m or [1, 8, 64, 77, 128, 200, 333, 512, 1000, 2048, 4096]
    sms = sm_count(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    t0 = time.monotonic()
    for n, k in shapes:
        if time.monotonic() - t0 > args.deadline_s:
            print(f"deadline: stopped before {n}x{k}", file=sys.stderr)
            break
        w = (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        w_q, w_s = quantize_weight(w, "block", torch.float8_e4m3fn)
        ws = splitk_workspace(n, dev)
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            x_q, x_s = quantize_activation(x, fp8_dtype=torch.float8_e4m3fn)
            xp_q, xp_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
            cands = {"bf16": (lambda a, b: a @ b.t(), (x, w))}
            if n % 16 == 0 and k % 16 == 0 and (k // 128) % 4 == 0:
                cands["cublas"] = (lambda a, sa, b, sb: cublas_fp8_gemm(a, sa, b, sb, "block", None), (xp_q, xp_s, w_q, w_s))
            now = select_config(dev, m, n, k)
            for c in (now,) + TILED:
                name = f"tiled:{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}"
                cands.setdefault(name, ((lambda c_: lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None, config=c_))(c), (x_q, x_s, w_q, w_s)))
            for c in split_candidates(m, n, k, sms):
                name = f"splitk:{c.block_m}x{c.block_n}x{c.split_k}w{c.num_warps}"
                cands[name] = ((lambda c_: lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None, config=c_, counters=ws))(c), (x_q, x_s, w_q, w_s))
            rounds = {}
            for name, (fn, a) in cands.items():
                try:
                    nbytes = sum(t.numel() * t.element_size() for t in a)
                    sets = rotation_sets(a, nbytes, dev)
                    rounds[name], _ = _prepare(fn, sets, cfg)
                except (RuntimeError, ValueError) as e:
                    print(f"  {n}x{k} M={m} {name}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            us = _time_rounds(rounds, 5)
            del rounds
            best = min((v, kname) for kname, v in us.items() if kname != "bf16")
            rows.append({"n": n, "k": k, "m": m, "now": f"tiled:{now.block_m}x{now.block_n}", "us": us})
            print(f"[{time.monotonic() - t0:5.0f}s] {n}x{k} M={m}: bf16 {us['bf16']:.1f} cublas {us.get('cublas', float('nan')):.1f} "
                  f"best {best[1]} {best[0]:.1f}", flush=True)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "sms": sms, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
