"""Kernel-development sweep for decode: the fused quantize+GEMV kernel against the two-kernel forward.

Per shape and M, times (CUDA graphs over weight copies larger than 2x L2, as `fp8linear bench`
does): per-tensor cuBLAS FP8 (GEMM only), our GEMM only (`gemm`: default dispatch on pre-quantized
x), the two-kernel forward (`fwd`: act_quant + GEMM, what Fp8BlockLinear ran before the fused
kernel), and a grid of fused-kernel configs (`g_bn{block_n}_gs{groups_per_step}_w{warps}_s{stages}`),
plus the shipped default (`fused`) and row-wise weights with it. This is the sweep behind
fp8linear.ops.router.gemv_config and use_fused_gemv; needs a CUDA GPU.

    python benchmarks/gemv_sweep.py [M,M,...] [N:K,N:K,...]   # default 1,2,4 and DeepSeek-V3 + small shapes
"""
import itertools
import math
import sys
import time
import types

import torch

from fp8linear import quantize_activation, quantize_weight
from fp8linear.tools.bench import time_cuda
from fp8linear.tools.timing import clone_set, l2_bytes, n_sets
from fp8linear.ops.fused_gemv import fused_fp8_gemv
from fp8linear.ops.configs import GemvConfig
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.ops.quant import act_quant

SHAPES = [(1536, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (18432, 7168), (7168, 18432),
          (2048, 7168), (7168, 2048), (1536, 2048), (3072, 1536), (2816, 2048), (2048, 2816), (10944, 2048)]
cfg = types.SimpleNamespace(warmup=3, replays=5, timer="graph")


def main() -> None:
    dev = torch.device("cuda")
    l2 = l2_bytes(dev)
    ms = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4]
    shapes = [tuple(int(v) for v in s.split(":")) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else SHAPES
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t_start = time.time()
    geo: dict = {}
    grid = list(itertools.product((8, 16, 32), (2, 4, 8), (4, 8), (2, 4)))
    for (n, k) in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
        w_q, w_s = quantize_weight(w, "block")
        _, w_s_row = quantize_weight(w, "row")
        one = torch.ones((), device=dev)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = quantize_activation(x)
            base = (x, x_q, x_s, w_q, w_s, w_s_row)
            sets = [base] + [clone_set(base) for _ in range(n_sets(n * k, l2) - 1)]
            ref = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.float32)
            res = {}

            def t(name, fn):
                y = fn(*sets[0])
                e = ((y.float() - ref).norm() / ref.norm()).item()
                us, _ = time_cuda(fn, sets, cfg)
                res[name] = (us, e)
                geo.setdefault((m, name), []).append(us)

            t("pertensor", lambda x, xq, xs, wq, ws, wr: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            t("gemm", lambda x, xq, xs, wq, ws, wr: block_fp8_gemm(xq, xs, wq, ws, "block", torch.bfloat16))
            t("fwd", lambda x, xq, xs, wq, ws, wr: block_fp8_gemm(*act_quant(x, wq.dtype), wq, ws, "block", torch.bfloat16))
            t("fused", lambda x, xq, xs, wq, ws, wr: fused_fp8_gemv(x, wq, ws, "block"))
            t("fused_row", lambda x, xq, xs, wq, ws, wr: fused_fp8_gemv(x, wq, wr, "row"))  # timing only: block FP8 values with row scales
            for bn, gs, nw, st in grid:
                c = GemvConfig(bn, gs, nw, st)
                t(f"g_bn{bn}_gs{gs}_w{nw}_s{st}", lambda x, xq, xs, wq, ws, wr, c=c: fused_fp8_gemv(x, wq, ws, "block", None, c))
            pt = res["pertensor"][0]
            print(f"\n== M={m} N={n} K={k} W={n * k / 1e6:.1f}MB  [{time.time() - t_start:.0f}s]", flush=True)
            for name in ("pertensor", "gemm", "fwd", "fused", "fused_row"):
                us, e = res[name]
                print(f"  {name:10s} {us:8.2f} us  {n * k / us / 1e6:6.2f} TB/s  vs_pt={us / pt:5.2f}  err={e:.1e}", flush=True)
            top = sorted((v[0], kk) for kk, v in res.items() if kk.startswith("g_"))[:4]
            print("  top4:", ", ".join(f"{kk}={v:.1f}" for v, kk in top), flush=True)
    print("\nGEOMEAN per M:")
    for m in ms:
        g = {name: math.exp(sum(map(math.log, v)) / len(v)) for (mm, name), v in geo.items() if mm == m}
        pt = g["pertensor"]
        print(f"M={m}: " + "  ".join(f"{nm}={g[nm]:.1f}({g[nm] / pt:.2f})" for nm in ("pertensor", "gemm", "fwd", "fused", "fused_row")))
        print("   best uniform configs:", [(round(v, 2), nm) for v, nm in sorted((v, nm) for nm, v in g.items() if nm.startswith("g_"))[:6]])


if __name__ == "__main__":
    main()
