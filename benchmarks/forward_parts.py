"""Where a whole FP8 forward's time goes beyond its GEMM (CUDA graphs, operands rotated past L2).

Per (N, K, M), in one run of interleaved replays:

- ``bf16``: ``x @ w.T`` in BF16 (the bar the forward must clear); ``bf16_bias``: ``F.linear``
  with a bias (the bar ``forward_bias`` must clear: a BF16 ``nn.Linear`` with a bias);
- ``quant``: :func:`fp8linear.ops.quant.act_quant` alone, row-major scales (our kernels' layout);
- ``quant_cublas``: the same in cuBLAS's layout (M padded to 4, M-major scales);
- ``gemm``: :func:`fp8linear.block_fp8_matmul` on quantized activations (the router's kernel),
  scales in the layout that kernel reads; ``gemm_bias``: the same with a bias;
- ``forward`` / ``forward_bias``: :func:`fp8linear.fp8_linear`, the whole forward.

It prints forward - gemm, the quantization it should cost, and the activation bytes per us that
quantization moves (read bf16, write FP8 + scales).

    python benchmarks/forward_parts.py [--shapes 7168x18432 ...] [--m 512 2048 4096] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch

from fp8linear import block_fp8_matmul, fp8_linear, quantize_weight
from fp8linear.ops.quant import act_quant
from fp8linear.ops.router import cublas_allowed
from fp8linear.tools.bench import _routed_to_cublas
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

SHAPES = ["7168x18432", "7168x16384", "18432x7168", "576x7168", "2112x7168", "512x3584", "4096x14336"]


def _bytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def measure(n: int, k: int, m: int, gen: torch.Generator) -> dict[str, float]:
    dev = torch.device("cuda")
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
    w_q, w_s = quantize_weight(w, "block")
    x_q, x_s = act_quant(x, w_q.dtype)
    on_cublas = _routed_to_cublas(x_q, w_q, "block", cublas_allowed(None))
    x_qc, x_sc = act_quant(x, w_q.dtype, cublas_layout=True)
    gemm_x = (x_qc[:m], x_sc[:m]) if on_cublas else (x_q, x_s)
    methods = {
        "bf16": (lambda a, b: a @ b.t(), (x, w)),
        "bf16_bias": (lambda a, b, c: torch.nn.functional.linear(a, b, c), (x, w, bias)),
        "quant": (lambda a: act_quant(a, w_q.dtype), (x,)),
        "quant_cublas": (lambda a: act_quant(a, w_q.dtype, cublas_layout=True), (x,)),
        "gemm": (lambda a, sa, b, sb: block_fp8_matmul(a, sa, b, sb, torch.bfloat16), (*gemm_x, w_q, w_s)),
        "gemm_bias": (lambda a, sa, b, sb, c: block_fp8_matmul(a, sa, b, sb, torch.bfloat16, c),
                      (*gemm_x, w_q, w_s, bias)),
        "forward": (lambda a, b, sb: fp8_linear(a, b, sb), (x, w_q, w_s)),
        "forward_bias": (lambda a, b, sb, c: fp8_linear(a, b, sb, c), (x, w_q, w_s, bias)),
    }
    rounds = {}
    for name, (fn, args) in methods.items():
        sets = rotation_sets(args, _bytes(*args), dev)
        rounds[name], _ = prepare_cuda(fn, sets, 3, graph_timer=True)
    t = time_rounds(rounds, 7)
    t["cublas"] = float(on_cublas)
    t["quant_TBps"] = (m * k * 3 + m * ((k + 127) // 128) * 4) / t["quant"] / 1e6
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--m", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--json")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for s in a.shapes:
        n, k = map(int, s.split("x"))
        for m in a.m:
            t = measure(n, k, m, gen)
            rows.append({"n": n, "k": k, "m": m, **t})
            print(f"{n:6}x{k:<6} M={m:5} " + " ".join(f"{kk}={v:.1f}" for kk, v in t.items())
                  + f"  fwd-gemm={t['forward'] - t['gemm']:.1f} fwd_bias-gemm_bias={t['forward_bias'] - t['gemm_bias']:.1f}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
