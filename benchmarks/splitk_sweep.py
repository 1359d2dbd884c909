"""Kernel-development sweep for decode (M <= 64): split-K configs vs the tiled kernel and cuBLAS.

Times, per DeepSeek-V3 shape and M, per-tensor cuBLAS FP8, the tiled kernel with the shipped table
(`tiled`), the tiled kernel after a separate activation quantization (`tiled_fwd`), the default
dispatch (`default`: split-K where fp8linear.ops.router.splitk_config asks for it), row-wise
weights, and a grid of split-K configs (block_m x block_n x stages x programs-per-SM x warps; p0 =
no split). CUDA-graph timing over weight copies larger than 2x L2, as `fp8linear bench` does. This
is the sweep behind splitk_config's rules; needs a CUDA GPU (~1 minute per shape on H100).

    python benchmarks/splitk_sweep.py [M,M,...] [N:K,N:K,...] [out.csv]    # default 1,4,16,32,64 and the DeepSeek-V3 shapes

With a third argument every timing is also written there as CSV (n, k, m, name, us, rel_err).
"""
import csv
import itertools
import math
import sys
import time
import types

import torch
import triton

from fp8linear import quantize_activation, quantize_weight
from fp8linear.tools.bench import time_cuda
from fp8linear.tools.timing import rotation_sets
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.ops.quant import act_quant
from fp8linear.ops.router import select_config
from fp8linear.ops.splitk_gemm import splitk_fp8_gemm
from fp8linear.ops.configs import SplitKConfig
from fp8linear.ops.router import splitk_config

SHAPES = [(1536, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (18432, 7168), (7168, 18432), (2048, 7168), (7168, 2048)]
cfg = types.SimpleNamespace(warmup=3, replays=5, timer="graph")


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    MS = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 32, 64]
    print(torch.cuda.get_device_name(), "SMs", sms, flush=True)
    t_start = time.time()
    geo = {}
    csv_rows = []
    shapes = [tuple(int(v) for v in s.split(":")) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else SHAPES
    for (n, k) in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
        w_q, w_s = quantize_weight(w, "block")
        _, w_s_row = quantize_weight(w, "row")
        one = torch.ones((), device=dev)
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = quantize_activation(x)
            base = (x, x_q, x_s, w_q, w_s, w_s_row)
            sets = rotation_sets(base, n * k, dev)
            ref = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16).float()
            res = {}
            def t(name, fn):
                y = fn(*sets[0])
                e = ((y.float() - ref).norm() / ref.norm()).item()
                us, _ = time_cuda(fn, sets, cfg)
                res[name] = (us, e)
                geo.setdefault((m, name), []).append(us)
            t("pertensor", lambda x, xq, xs, wq, ws, wr: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            tiled = select_config(dev, m, n, k)
            t("tiled", lambda x, xq, xs, wq, ws, wr: block_fp8_gemm(xq, xs, wq, ws, "block", torch.bfloat16, None, tiled))
            t("tiled_fwd", lambda x, xq, xs, wq, ws, wr: block_fp8_gemm(*act_quant(x, wq.dtype), wq, ws, "block", torch.bfloat16, None, tiled))
            h = splitk_config(m, n, k, dev)
            t("default", lambda x, xq, xs, wq, ws, wr: block_fp8_gemm(xq, xs, wq, ws, "block", torch.bfloat16))
            t("default_row", lambda x, xq, xs, wq, ws, wr: block_fp8_gemm(xq, xs, wq, wr, "row", torch.bfloat16))
            groups = triton.cdiv(k, 128)
            seen: set[SplitKConfig] = set()
            # block_m: 16, and the one tile that covers M (with 4 or 8 warps); pps = target programs
            # per SM (0: no split), at least 2 K groups per program.
            grid = [(16, 4)] + ([] if m <= 16 else [(triton.next_power_of_2(m), 4), (triton.next_power_of_2(m), 8)])
            for (bm, nw), bn, st, pps in itertools.product(grid, (32, 64, 128), (4, 6), (0, 1, 2, 3, 4)):
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                split = 1 if pps == 0 else max(1, min(triton.cdiv(pps * sms, tiles), groups // 2))
                split = triton.cdiv(groups, triton.cdiv(groups, split))  # no empty splits
                c = SplitKConfig(bm, bn, split, nw, st)
                if c in seen:
                    continue
                seen.add(c)
                t(f"f_bm{bm}_bn{bn}_s{st}_S{split}_w{nw}", lambda x, xq, xs, wq, ws, wr, c=c: splitk_fp8_gemm(xq, xs, wq, ws, "block", torch.bfloat16, None, c))
            best = min((v[0], kk) for kk, v in res.items() if kk.startswith("f_"))
            pt = res["pertensor"][0]
            print(f"\n== M={m} N={n} K={k} split-K heuristic={h} W={n*k/1e6:.1f}MB  [{time.time()-t_start:.0f}s]", flush=True)
            for name in ("pertensor", "tiled", "tiled_fwd", "default", "default_row"):
                us, e = res[name]
                print(f"  {name:14s} {us:8.2f} us  {n*k/us/1e6:6.2f} TB/s  vs_pt={us/pt:5.2f}  err={e:.1e}", flush=True)
            print(f"  best sweep {best[1]} {best[0]:.2f} us vs_pt={best[0]/pt:.2f}", flush=True)
            csv_rows += [(n, k, m, name, f"{us:.3f}", f"{e:.2e}") for name, (us, e) in res.items()]
            top = sorted((v[0], kk) for kk, v in res.items() if kk.startswith("f_"))[:6]
            print("  top6:", ", ".join(f"{kk}={v:.1f}" for v, kk in top), flush=True)
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w", newline="") as f:
            csv.writer(f).writerows([("n", "k", "m", "name", "us", "rel_err")] + csv_rows)
    print("\nGEOMEAN per M:")
    for m in MS:
        g = {name: math.exp(sum(map(math.log, v)) / len(v)) for (mm, name), v in geo.items() if mm == m}
        pt = g["pertensor"]
        print(f"M={m}: " + "  ".join(f"{nm}={g[nm]:.1f}({g[nm]/pt:.2f})" for nm in ("pertensor", "tiled", "tiled_fwd", "default", "default_row")))
        cands = sorted((v, nm) for nm, v in g.items() if nm.startswith("f_"))[:6]
        print("   best uniform configs:", cands)


if __name__ == "__main__":
    main()
