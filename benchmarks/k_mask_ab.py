"""A/B of the K mask on our kernels' operand loads (``fp8linear.ops.gemm_common.load_k_step``): where K
is a multiple of the K step, each step's x and w tiles are loaded with only their row / column masks
(EVEN_K) against with a mask along K too, on the same operands and launch config (kernel alone, CUDA
graphs, operands rotated past L2). The tiled kernel, the split-K kernel and the grouped MoE kernel,
128x128 and 1x128 weights. Prints both times, their ratio and whether the outputs have the same bits.
Needs a GPU.

    python benchmarks/k_mask_ab.py
"""

from __future__ import annotations

import math

import torch

from fp8linear import quantize_activation, quantize_weight
from fp8linear.ops import gemm, splitk_gemm
from fp8linear.ops.configs import GemmConfig, SplitKConfig
from fp8linear.ops.splitk_gemm import splitk_buffers, splitk_counters
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

TILED = (  # N, K, M, (block_m, block_n, num_warps, num_stages)
    (576, 2048, 128, (64, 64, 4, 4)), (576, 2048, 384, (64, 128, 4, 3)), (1024, 4096, 384, (64, 64, 4, 4)),
    (1536, 7168, 256, (64, 128, 4, 3)), (512, 3584, 384, (128, 64, 4, 4)), (576, 1536, 256, (64, 64, 4, 4)),
    (1024, 8192, 333, (64, 64, 4, 4)), (576, 7168, 1024, (64, 128, 4, 3)), (7168, 2048, 512, (64, 128, 4, 3)),
    (3584, 3584, 333, (128, 128, 8, 4)), (18432, 7168, 4096, (128, 128, 8, 4)), (24576, 1536, 4096, (128, 128, 8, 4)),
)
SPLIT = (  # N, K, M, (block_m, block_n, split_k, num_warps)
    (576, 7168, 16, (16, 64, 8, 4)), (2112, 7168, 64, (64, 64, 4, 4)), (7168, 2048, 8, (16, 64, 4, 4)),
    (1536, 7168, 200, (64, 64, 4, 4)), (24576, 1536, 32, (32, 64, 2, 4)),
)


def _tiled(x_q, x_s, w_q, w_s, gran, cfg, even):
    y = torch.empty((x_q.shape[0], w_q.shape[0]), dtype=torch.bfloat16, device=x_q.device)
    grid, args, options = gemm.tiled_args(x_q, x_s, w_q, w_s, y, gran, None, cfg, False)
    args["EVEN_K"] = even
    gemm._block_fp8_gemm_kernel[grid](**args, **options)
    return y


def _split(x_q, x_s, w_q, w_s, gran, cfg, counters, even):
    m, k = x_q.shape
    y = torch.empty((m, w_q.shape[0]), dtype=torch.bfloat16, device=x_q.device)
    split, count, part_shape = splitk_buffers(m, w_q.shape[0], cfg, k, x_q.device, counters)
    part = torch.empty(part_shape, dtype=torch.float32, device=x_q.device) if part_shape else None
    grid, args, options = splitk_gemm.splitk_args(x_q, x_s, w_q, w_s, y, gran, None, cfg, split, part, count, False)
    args["EVEN_K"] = even
    splitk_gemm._splitk_fp8_gemm_kernel[grid](**args, **options)
    return y


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ratios: dict[str, list[float]] = {}
    cases = [("tiled", c) for c in TILED] + [("splitk", c) for c in SPLIT]
    for gran in ("block", "row"):
        for kind, (n, k, m, tile) in cases:
            w_q, w_s = quantize_weight(torch.randn(n, k, device=dev), gran)
            x_q, x_s = quantize_activation(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            if kind == "tiled":
                bm, bn, warps, stages = tile
                cfg = GemmConfig(block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages)
                fns = {even: (lambda e: lambda a, sa, b, sb: _tiled(a, sa, b, sb, gran, cfg, e))(even)
                       for even in (True, False)}
            else:
                bm, bn, split, warps = tile
                cfg = SplitKConfig(block_m=bm, block_n=bn, split_k=split, num_warps=warps, num_stages=4)
                counters = splitk_counters(n, dev)
                fns = {even: (lambda e: lambda a, sa, b, sb: _split(a, sa, b, sb, gran, cfg, counters, e))(even)
                       for even in (True, False)}
            args = (x_q, x_s, w_q, w_s)
            same = torch.equal(fns[True](*args), fns[False](*args))
            sets = rotation_sets(args, sum(t.numel() * t.element_size() for t in args), dev)
            rounds = {even: prepare_cuda(fn, sets, 3, True, 1500)[0] for even, fn in fns.items()}
            us = time_rounds(rounds, 7)
            del rounds, sets
            r = us[True] / us[False]
            ratios.setdefault(f"{kind} {gran}", []).append(r)
            print(f"{kind:6} {gran:5} {n}x{k} M={m} {tile}: no K mask {us[True]:8.2f} us, K mask {us[False]:8.2f} us, "
                  f"ratio {r:.3f}, same bits {same}", flush=True)
    for key, rs in ratios.items():
        print(f"{key}: geomean {math.exp(sum(map(math.log, rs)) / len(rs)):.3f}, range {min(rs):.3f}-{max(rs):.3f}")


if __name__ == "__main__":
    main()
