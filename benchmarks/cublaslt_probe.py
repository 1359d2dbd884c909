"""Host cost of the cuBLAS route: cuBLASLt called directly (fp8linear.ops.cublaslt) against
torch._scaled_mm, both behind the same CublasLinear (act_quant into cuBLAS's layout, then the GEMM),
with BF16 nn.Linear in the same interleaved eager rounds; GPU time under CUDA graphs; and whether
the two give the same bits.

    python benchmarks/cublaslt_probe.py [--m 64 128 512 2048]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from fp8linear import quantize_weight
from fp8linear.ops.linear import CublasLinear
from fp8linear.tools.bench_eager import _gpu_us, interleaved_wall_us

SHAPES = ((2112, 7168), (24576, 1536), (7168, 2048), (1536, 7168), (32768, 512), (1536, 576))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[64, 128, 512, 2048])
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; eager wall us per call (GPU us under graphs)")
    print(f"{'shape':>12s} {'M':>5s} {'bf16':>14s} {'scaled_mm':>14s} {'direct':>14s} {'dir/mm':>7s} {'dir/bf16':>8s} same")
    for n, k in SHAPES:
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        w_q, w_s = quantize_weight(lin.weight.detach(), "block")
        direct = CublasLinear(w_q, w_s, "block", None, direct=True)
        via_torch = CublasLinear(w_q, w_s, "block", None, direct=False)
        if direct.lt is None:
            raise SystemExit("cuBLASLt could not be set up here (see the log)")
        for m in args.m:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                  for _ in range(max(2, min(16, (100 << 20) // (m * k * 2))))]
            methods = {"bf16": lin, "scaled_mm": via_torch, "direct": direct}
            with torch.inference_mode():
                same = torch.equal(direct(xs[0]).view(torch.int16), via_torch(xs[0]).view(torch.int16))
                wall = interleaved_wall_us(methods, xs)
                gpu = {name: _gpu_us(fn, xs) for name, fn in methods.items()}
            cell = lambda name: f"{wall[name]:6.1f} ({gpu[name] or float('nan'):5.1f})"  # noqa: E731
            print(f"{n:>5d}x{k:<6d} {m:5d} {cell('bf16'):>14s} {cell('scaled_mm'):>14s} {cell('direct'):>14s}"
                  f" {wall['direct'] / wall['scaled_mm']:7.3f} {wall['direct'] / wall['bf16']:8.3f} {same}")


if __name__ == "__main__":
    main()
