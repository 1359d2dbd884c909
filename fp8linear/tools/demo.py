"""`fp8linear demo`: quantize one linear layer, run it, print the error and (on a GPU) speed vs BF16."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ..formats import GRANULARITIES
from ..module import Fp8BlockLinear

__all__ = ["add_arguments", "run"]

# A DeepSeek-V3 MLP shape (hidden 7168 -> intermediate 18432), trimmed on CPU to stay quick.
GPU_SHAPE = (4096, 7168, 18432)  # (tokens, in_features, out_features)
CPU_SHAPE = (64, 2048, 1536)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", type=int, help="tokens (rows of x)")
    p.add_argument("--k", type=int, help="in_features")
    p.add_argument("--n", type=int, help="out_features")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)


def _time_us(fn, x: torch.Tensor) -> float:
    import triton.testing

    return triton.testing.do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median") * 1e3


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    m, k, n = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    m, k, n = args.m or m, args.k or k, args.n or n
    torch.manual_seed(args.seed)
    linear = nn.Linear(k, n, bias=True, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = x.double() @ linear.weight.double().T + linear.bias.double()
        y_bf16 = linear(x)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (reference path)"
    print(f"fp8linear demo on {name}: x ({m}, {k}) bf16 @ W ({n}, {k}).T, weight {n * k / 2**20:.1f} M elements")
    print(f"{'method':<22}{'rel. error vs fp64':>20}{'weight MB':>11}" + (f"{'time us':>10}{'vs BF16':>9}" if device.type == "cuda" else ""))
    t_bf16 = _time_us(linear, x) if device.type == "cuda" else None
    err = ((y_bf16.double() - ref).norm() / ref.norm()).item()
    print(f"{'BF16 nn.Linear':<22}{err:>20.2e}{n * k * 2 / 1e6:>11.1f}" + (f"{t_bf16:>10.1f}{1.0:>8.2f}x" if t_bf16 else ""))
    for gran in GRANULARITIES:
        mod = Fp8BlockLinear.from_linear(linear, gran)
        with torch.no_grad():
            y = mod(x)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        mb = (mod.weight.numel() + 4 * mod.weight_scale_inv.numel()) / 1e6
        line = f"{'FP8 ' + gran:<22}{err:>20.2e}{mb:>11.1f}"
        if t_bf16:
            t = _time_us(mod, x)
            line += f"{t:>10.1f}{t_bf16 / t:>8.2f}x"
        print(line)
    return 0
