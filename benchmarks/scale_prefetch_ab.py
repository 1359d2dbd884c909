"""A/B of the tiled kernel's scale prefetch (``fp8linear.ops.gemm_common.prefetch_scales``): each K
group's activation and weight scales loaded one step ahead, against loading them in the step that
uses them, per granularity and tile, on the same operands (kernel alone, CUDA graphs, L2-warm:
the scale loads' latency is what differs). Prints both times, their ratio and whether the outputs
have the same bits. Needs a GPU.

    python benchmarks/scale_prefetch_ab.py
"""

from __future__ import annotations

import math

import torch
from triton.testing import do_bench_cudagraph

from fp8linear import quantize_activation, quantize_weight
from fp8linear.ops import gemm
from fp8linear.ops.configs import GemmConfig

CASES = (  # N, K, M, tile (block_m, block_n, num_warps, num_stages)
    (576, 2048, 128, (16, 32, 4, 4)), (576, 1536, 256, (64, 64, 4, 4)), (2048, 1408, 96, (64, 64, 4, 4)),
    (1024, 4096, 128, (64, 64, 4, 4)), (2048, 7168, 128, (64, 128, 4, 3)), (7168, 2048, 512, (64, 128, 4, 3)),
    (3584, 3584, 333, (128, 128, 8, 4)), (4096, 4096, 1024, (128, 128, 8, 4)), (18432, 7168, 4096, (128, 128, 8, 4)),
    (7168, 18432, 4096, (128, 128, 8, 4)), (24576, 1536, 4096, (128, 128, 8, 4)),
)


def main() -> None:
    torch.manual_seed(0)
    shipped = gemm.prefetch_scales
    ratios = []
    for gran in ("row", "block"):
        for n, k, m, (bm, bn, warps, stages) in CASES:
            cfg = GemmConfig(block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages)
            w_q, w_s = quantize_weight(torch.randn(n, k, device="cuda"), gran)
            x_q, x_s = quantize_activation(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            times, outs = {}, {}
            for rep in range(2):  # each variant timed first once
                for on in ((True, False) if rep == 0 else (False, True)):
                    gemm.prefetch_scales = (lambda g, b, _on=on: _on)
                    try:
                        def fn():
                            return gemm.block_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.bfloat16, None, cfg)
                        outs[on] = fn()
                        times.setdefault(on, []).append(do_bench_cudagraph(fn, rep=60) * 1e3)
                    finally:
                        gemm.prefetch_scales = shipped
            t_on, t_off = min(times[True]), min(times[False])
            ratios.append(t_on / t_off)
            same = torch.equal(outs[True].view(torch.int16), outs[False].view(torch.int16))
            print(f"{gran:5s} {n:6d}x{k:<6d} M={m:5d} {bm}x{bn} w{warps} s{stages}: in-step {t_off:8.2f} us, "
                  f"prefetch {t_on:8.2f} us, ratio {t_on / t_off:.3f}, same bits {same}, shipped rule: "
                  f"{'prefetch' if shipped(gran, bn) else 'in-step'}", flush=True)
    print(f"geomean prefetch / in-step: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")


if __name__ == "__main__":
    main()
