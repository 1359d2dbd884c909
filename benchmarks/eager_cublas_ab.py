"""Eager A/B at prefill sizes: plans on cuBLAS blockwise FP8 (``torch._scaled_mm``) against plans on
our Triton kernels (directly launched), with BF16 ``nn.Linear`` in the same interleaved rounds, and
the GPU time of each (CUDA graphs), to place the router's eager cut between them.

    python benchmarks/eager_cublas_ab.py [--m 128 256 512 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from fp8linear import Fp8BlockLinear
from fp8linear.tools.bench_eager import _gpu_us, interleaved_wall_us
from fp8linear.ops import router

SHAPES = ((2112, 7168), (24576, 1536), (7168, 2048), (7168, 18432), (1536, 7168))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 4096])
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; eager wall us per call (GPU us under graphs)")
    print(f"{'shape':>12s} {'M':>5s} {'bf16':>14s} {'cublas':>14s} {'triton':>14s} {'tri/cub':>7s} {'tri/bf16':>8s}"
          "  routes (the 'cublas' plan follows the routes table where it names our kernel)")
    ratios = []
    real, cut = router.cublas_device_ok, router.EAGER_CUBLAS_MIN_MNK
    for n, k in SHAPES:
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        for m in args.m:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, min(16, (100 << 20) // (m * k * 2))))]
            layers = {}
            for name, ok in (("cublas", real), ("triton", lambda device: False)):
                router.cublas_device_ok = ok
                router.EAGER_CUBLAS_MIN_MNK = 0  # cuBLAS wherever it is allowed, below the router's cut too
                layers[name] = Fp8BlockLinear.from_linear(lin, "block")
                layers[name](xs[0])
                layers[name](xs[0])  # a shape's second call makes its plan: under this rule
            router.cublas_device_ok, router.EAGER_CUBLAS_MIN_MNK = real, cut
            methods = {"bf16": lin, **layers}
            with torch.inference_mode():
                wall = interleaved_wall_us(methods, xs)
                gpu = {name: _gpu_us(fn, xs) for name, fn in methods.items()}
            r = wall["triton"] / wall["cublas"]
            ratios.append(r)
            cell = lambda name: f"{wall[name]:6.1f} ({gpu[name] or float('nan'):5.1f})"  # noqa: E731
            kernels = "/".join(next(iter(layers[name]._plans.values())).route.kernel for name in ("cublas", "triton"))
            print(f"{n:>5d}x{k:<6d} {m:5d} {cell('bf16'):>14s} {cell('cublas'):>14s} {cell('triton'):>14s} {r:7.3f}"
                  f" {wall['triton'] / wall['bf16']:8.3f}  {kernels}")
    print(f"geomean triton/cublas eager wall: {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
