"""Kernel-development sweep for decode (M <= 64): split-K configs vs the tiled kernel and cuBLAS.

Times, per DeepSeek-V3 shape and M, per-tensor cuBLAS FP8, the tiled kernel with the shipped table
(`tiled`), the tiled kernel after a separate activation quantization (`tiled_fwd`), the default
dispatch (`default`: split-K where fp8linear.ops.splitk_gemm.splitk_config asks for it), row-wise
weights, and a grid of split-K configs (block_m x block_n x stages x programs-per-SM x warps; p0 =
no split). CUDA-graph timing over weight copies larger than 2x L2, as `fp8linear bench` does. This
is the sweep behind splitk_config's rules; needs a CUDA GPU (~2.5 minutes on H100).

    python benchmarks/splitk_sweep.py [M,M,...] [N:K,N:K,...]    # default 1,4,16,64 and the DeepSeek-V3 shapes
"""
import itertools
import math
import sys
import time
import types

import torch
import triton

from fp8linear import quantize_activation, quantize_weight
from fp8linear.bench import _time_cuda, _n_sets, _clone_set, _l2_bytes
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.ops.quant import act_quant
from fp8linear.ops.configs import select_config
from fp8linear.ops.splitk_gemm import SplitKConfig, splitk_config, splitk_fp8_gemm

SHAPES = [(1536, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (18432, 7168), (7168, 18432), (2048, 7168), (7168, 2048)]
cfg = types.SimpleNamespace(warmup=3, replays=5, timer="graph")


def main() -> None:
    dev = torch.device("cuda")
    l2 = _l2_bytes(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    MS = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 64]
    print(torch.cuda.get_device_name(), "SMs", sms, flush=True)
    t_start = time.time()
    geo = {}
    shapes = [tuple(int(v) for v in s.split(":")) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else SHAPES
    for (n, k) in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
        w_q, w_s = quantize_weight(w, "block")
        _, w_s_row = quantize_weight(w, "row")
        one = torch.ones((), device=dev)
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = quantize_activation(x)
            nsets = _n_sets(n * k, l2)
            base = (x, x_q, x_s, w_q, w_s, w_s_row)
            sets = [base] + [_clone_set(base) for _ in range(nsets - 1)]
            ref = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16).float()
            res = {}
            def t(name, fn):
                y = fn(*sets[0])
                e = ((y.float() - ref).norm() / ref.norm()).item()
                us, _ = _time_cuda(fn, sets, cfg)
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
            bms = (16,) if m <= 16 else (16, 32, 64)
            for bm, bn, st, pps, nw in itertools.product(bms, (64, 128), (4, 6), (0, 1, 2, 4), (4, 8)):
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                split = 1 if pps == 0 else max(1, min(triton.cdiv(pps * sms, tiles), groups // 2))
                c = SplitKConfig(bm, bn, split, nw, st)
                t(f"f_bm{bm}_bn{bn}_s{st}_p{pps}_w{nw}", lambda x, xq, xs, wq, ws, wr, c=c: splitk_fp8_gemm(xq, xs, wq, ws, "block", torch.bfloat16, None, c))
            best = min((v[0], kk) for kk, v in res.items() if kk.startswith("f_"))
            pt = res["pertensor"][0]
            print(f"\n== M={m} N={n} K={k} split-K heuristic={h} W={n*k/1e6:.1f}MB  [{time.time()-t_start:.0f}s]", flush=True)
            for name in ("pertensor", "tiled", "tiled_fwd", "default", "default_row"):
                us, e = res[name]
                print(f"  {name:14s} {us:8.2f} us  {n*k/us/1e6:6.2f} TB/s  vs_pt={us/pt:5.2f}  err={e:.1e}", flush=True)
            print(f"  best sweep {best[1]} {best[0]:.2f} us vs_pt={best[0]/pt:.2f}", flush=True)
            top = sorted((v[0], kk) for kk, v in res.items() if kk.startswith("f_"))[:4]
            print("  top4:", ", ".join(f"{kk}={v:.1f}" for v, kk in top), flush=True)
    print("\nGEOMEAN per M:")
    for m in MS:
        g = {name: math.exp(sum(map(math.log, v)) / len(v)) for (mm, name), v in geo.items() if mm == m}
        pt = g["pertensor"]
        print(f"M={m}: " + "  ".join(f"{nm}={g[nm]:.1f}({g[nm]/pt:.2f})" for nm in ("pertensor", "tiled", "tiled_fwd", "default", "default_row")))
        cands = sorted((v, nm) for nm, v in g.items() if nm.startswith("f_"))[:6]
        print("   best uniform configs:", cands)


if __name__ == "__main__":
    main()
