"""Kernel-development sweep: time GEMM launch configs on a few shapes against BF16 and cuBLAS FP8.

Not the user benchmark (that is `fp8linear bench`); this is what the kernel author runs to pick
configs and check the compiled code (QGMMA instructions) on a new GPU.
    python benchmarks/kernel_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.testing

from fp8linear import quantize_activation, quantize_weight
from fp8linear.ops.configs import GemmConfig
from fp8linear.ops.router import heuristic_config
from fp8linear.ops.gemm import _block_fp8_gemm_kernel, block_fp8_gemm

PREFILL = [(4096, 18432, 7168), (4096, 576, 7168), (4096, 7168, 2304), (4096, 24576, 1536), (4096, 7168, 256), (4096, 7168, 18432)]
DECODE = [(1, 18432, 7168), (16, 7168, 2048), (64, 2048, 7168), (4, 7168, 18432)]

PREFILL_CONFIGS = [GemmConfig(bm, bn, bk, 8, w, s) for (bm, bn, bk, w, s) in [
    (64, 128, 128, 4, 3),  # the popular vLLM/SGLang kernel shape
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 3), (128, 128, 64, 8, 4),
    (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 64, 128, 4, 4), (128, 128, 128, 8, 2),
]]
DECODE_CONFIGS = [GemmConfig(bm, bn, bk, 1, w, s) for (bm, bn, bk, w, s) in [
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 128, 4, 6), (16, 128, 128, 4, 4),
    (16, 64, 128, 2, 6), (16, 128, 128, 8, 4), (32, 64, 128, 4, 5), (64, 64, 128, 4, 4), (64, 128, 128, 4, 4),
]]


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median") * 1e3


def scaled_mm_tensor(x8, w8, one):
    return torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for shapes, configs in ((PREFILL, PREFILL_CONFIGS), (DECODE, DECODE_CONFIGS)):
        for m, n, k in shapes[: 3 if args.quick else None]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
            x_q, x_s = quantize_activation(x)
            w_q, w_s = quantize_weight(w, "block")
            _, w_s_row = quantize_weight(w, "row")
            one = torch.ones((), device=dev)
            t_bf16 = bench_us(lambda: x @ w.T)
            t_pt = bench_us(lambda: scaled_mm_tensor(x_q, w_q, one))
            flops = 2 * m * n * k
            best = None
            ref = (x_q[:256].double() * x_s[:256].repeat_interleave(128, -1)[:, :k].double()) @ \
                (w_q.double() * w_s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k].double()).T
            for cfg in configs:
                try:
                    y = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.float32, None, cfg)
                    e = ((y[:256].double() - ref).norm() / ref.norm()).item()
                    t = bench_us(lambda: block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None, cfg))
                except Exception as e:  # out of shared memory etc.: report and go on
                    print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
                print(f"M={m} N={n} K={k} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: "
                      f"{t:8.1f} us {flops / t / 1e6:7.0f} TF/s err {e:.1e} bf16 {t_bf16:7.1f}  pertensor {t_pt:7.1f}")
            cfg = best[1]
            t_row = bench_us(lambda: block_fp8_gemm(x_q, x_s, w_q, w_s_row, "row", torch.bfloat16, None, cfg))
            t_heur = bench_us(lambda: block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None, heuristic_config(m, n, k)))
            gbs = (n * k + m * k + 2 * m * n) / best[0] / 1e3
            rows.append((m, n, k, best[0], t_heur, t_row, t_bf16, t_pt, cfg, gbs))
    print("\nM N K | best us | heur us | row us | bf16 us | pertensor us | best/bf16 speedup | best vs pertensor | GB/s | best cfg")
    for m, n, k, tb, th, tr, t16, tpt, cfg, gbs in rows:
        print(f"{m} {n} {k} | {tb:.1f} | {th:.1f} | {tr:.1f} | {t16:.1f} | {tpt:.1f} | {t16 / tb:.2f}x | {tpt / tb:.2f} | {gbs:.0f} | "
              f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}")
    # compiled code check: are the FP8 wgmma instructions (QGMMA) in the machine code?
    from triton.tools.disasm import get_sass

    x_q, x_s = quantize_activation(torch.randn(512, 1024, device=dev))
    w_q, w_s = quantize_weight(torch.randn(512, 1024, device=dev))
    for cfg in (PREFILL_CONFIGS[1], DECODE_CONFIGS[3]):
        block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None, cfg)
    seen = set()
    for cache in _block_fp8_gemm_kernel.device_caches.values():
        for kern in cache[0].values():
            sass = get_sass(kern.asm["cubin"])
            key = (kern.metadata.num_warps, kern.metadata.num_stages, kern.n_regs)
            if key in seen:
                continue
            seen.add(key)
            print(f"kernel warps={key[0]} stages={key[1]} regs={kern.n_regs} spills={kern.n_spills} "
                  f"QGMMA={sass.count('QGMMA')} HMMA={sass.count('HMMA')} FFMA={sass.count('FFMA')} FMUL={sass.count('FMUL')}")


if __name__ == "__main__":
    main()
