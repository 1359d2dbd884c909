"""Where act_quant's time goes: the shipped kernel against variants that drop one piece each.

Per (M, K), in one run (CUDA-graph replays, inputs rotated past L2):

- ``shipped``: :func:`fp8linear.ops.quant.act_quant` with its launch rule;
- ``copy``: load and cast to FP8 with a constant scale (the floor of any quantization kernel);
- ``fma``: x / scale as the fp32 product with a correctly rounded fp32 reciprocal and two fma
  corrections (the same quotients from 2**-12 up, see CHANGELOG.md) instead of the shipped fp64
  product;
- ``div_rn``: a correctly rounded fp32 division per element (``tl.math.div_rn``);
- ``fp32_recip``: x * fp32(1 / scale) (not bit-exact: the floor of the division's cost);
- ``no_nan``: without the NaN check's second reduction;
- ``hw_round``: the hardware FP8 conversion (:func:`~fp8linear.ops.quant.to_fp8`, as shipped on
  NVIDIA GPUs) instead of round_to_fp8_grid;
- ``hw_no_nan`` / ``hw_one_reduce`` / ``hw_fma`` / ``hw_one_reduce_fma``: the hardware conversion
  without the NaN check, with the NaN check folded into the amax reduction (a max that propagates
  NaN), with the fma division, or both;
- ``lean``: all three shortcuts at once (not bit-exact: the floor of the arithmetic's cost);
- ``rows{R}w{W}``: the shipped quantization with R rows per program and W warps.

    python benchmarks/act_quant_probe.py [--cases 4096x18432 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from fp8linear.formats import activation_max, fp8_min_exponent
from fp8linear.ops.quant import act_quant, act_quant_outputs, round_to_fp8_grid, to_fp8
from fp8linear.reference import AMAX_FLOOR
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

CASES = [(77, 576), (333, 576), (200, 512), (16, 7168), (512, 1536), (333, 7168), (1024, 7168), (4096, 7168)]
_GRAPH_US = 1500.0


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _variant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, qmax, amax_floor,
                    MIN_EXP: tl.constexpr, BLOCK_M: tl.constexpr, COPY: tl.constexpr, DIVIDE: tl.constexpr,
                    NAN_CHECK: tl.constexpr, GRID_ROUND: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = pid_g * 128 + tl.arange(0, 128)
    mask = (offs_m < M)[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if COPY:
        q = x
        scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        if NAN_CHECK == 2:  # one reduction whose max propagates NaN
            amax = tl.reduce(tl.abs(x), 1, _max_keep_nan)
        else:
            amax = tl.max(tl.abs(x), 1)
        if NAN_CHECK == 1:
            amax = tl.where(tl.max((x != x).to(tl.int32), 1) > 0, float("nan"), amax)
        amax = tl.maximum(amax, amax_floor, propagate_nan=tl.PropagateNan.ALL)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32))
        if DIVIDE == 0:  # as shipped (fp8linear.ops.quant.quantize_groups)
            q = (x.to(tl.float64) * (1.0 / scale.to(tl.float64))[:, None]).to(tl.float32)
        elif DIVIDE == 3:  # the fp32 reciprocal and two fma corrections (exact from 2**-12 up)
            r = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)[:, None]
            q0 = x * r
            q = tl.fma(tl.fma(-q0, scale[:, None], x), r, q0)
            q = tl.fma(tl.fma(-q, scale[:, None], x), r, q)
            q = tl.where(scale[:, None] == float("inf"), q0, q)
        elif DIVIDE == 1:
            q = tl.math.div_rn(x, scale[:, None])
        else:
            q = x * (1.0 / scale)[:, None]
        q = tl.minimum(tl.maximum(q, -qmax, propagate_nan=tl.PropagateNan.ALL), qmax,
                       propagate_nan=tl.PropagateNan.ALL)
        if GRID_ROUND:
            q = round_to_fp8_grid(q, MIN_EXP)
    if GRID_ROUND:
        q8 = q.to(q_ptr.dtype.element_ty)
    else:
        q8 = to_fp8(q, q_ptr.dtype.element_ty, True, MIN_EXP)
    tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :], q8, mask=mask)
    tl.store(s_ptr + offs_m * tl.cdiv(K, 128) + pid_g, scale, mask=offs_m < M)


def _variant(block_m: int, warps: int, copy=False, divide=0, nan_check=True, grid_round=True):
    def run(x):
        m, k = x.shape
        x_q, x_s = act_quant_outputs(m, k, torch.float8_e4m3fn, x.device)
        _variant_kernel[(triton.cdiv(m, block_m), triton.cdiv(k, 128))](
            x, x_q, x_s, m, k, x.stride(0), activation_max(torch.float8_e4m3fn), AMAX_FLOOR,
            MIN_EXP=fp8_min_exponent(torch.float8_e4m3fn), BLOCK_M=block_m, COPY=copy, DIVIDE=divide,
            NAN_CHECK=nan_check, GRID_ROUND=grid_round, num_warps=warps)
        return x_q, x_s
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--cases", nargs="+", help="MxK cases instead of the built-in list, e.g. 4096x18432")
    a = p.parse_args()
    cases = [tuple(map(int, c.split("x"))) for c in a.cases] if a.cases else CASES
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__, triton.__version__)
    out = []
    for m, k in cases:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        rows = 16 if m > 64 else 4
        fns = {"shipped": lambda x: act_quant(x, torch.float8_e4m3fn),
               "copy": _variant(rows, 4, copy=True),
               "fma": _variant(rows, 4, divide=3),
               "div_rn": _variant(rows, 4, divide=1),
               "fp32_recip": _variant(rows, 4, divide=2),
               "no_nan": _variant(rows, 4, nan_check=False),
               "hw_round": _variant(rows, 4, grid_round=False),
               "lean": _variant(rows, 4, divide=2, nan_check=False, grid_round=False),
               "hw_no_nan": _variant(rows, 4, nan_check=False, grid_round=False),
               "hw_one_reduce": _variant(rows, 4, nan_check=2, grid_round=False),
               "hw_fma": _variant(rows, 4, divide=3, grid_round=False),
               "hw_one_reduce_fma": _variant(rows, 4, divide=3, nan_check=2, grid_round=False)}
        for r, w in ((1, 1), (4, 1), (4, 4), (8, 2), (16, 4), (32, 4), (32, 8), (64, 8)):
            fns[f"rows{r}w{w}"] = _variant(r, w)
        sets = rotation_sets((x,), x.numel() * 2, device)
        rounds = {lab: prepare_cuda(fn, sets, 3, True, _GRAPH_US)[0] for lab, fn in fns.items()}
        us = time_rounds(rounds, 5)
        out.append({"m": m, "k": k, "us": us})
        gbs = m * k * 3 / 1e3
        print(f"M={m:5d} K={k:5d} " + " ".join(f"{lab} {v:.2f}" for lab, v in us.items())
              + f" | shipped {gbs / us['shipped']:.0f} GB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
