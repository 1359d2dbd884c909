"""Decode-sized FP8 linear in one kernel (Triton): per-token 1x128 quantization of x + GEMV + bias.

For a handful of tokens the separate activation-quantization launch costs as much as the GEMM
(on H100 ~2 us of a ~7 us decode linear), and tensor-core tiles of 16 rows carry 15 rows of
padding. Here each program takes one token row and BLOCK_N output columns, quantizes the row's
1x128 groups in registers (:func:`fp8linear.ops.quant.quantize_groups`: the very values the
act-quant kernel would store) and multiplies on the CUDA cores, GROUPS_PER_STEP groups (up to
512 of K) per loop step so that enough weight bytes are in flight per SM:

    y[m, n] = sum_g (x_s[m, g] * w_s[n, g]) * sum_{k in g} q[m, k] * w_q[n, k]  (+ bias[n])

Products of two FP8 values are exact in fp32, and the scaled products are summed in fp32 at the
end of the K loop. Consecutive programs take consecutive token rows of one column block, so a
weight tile read for row 0 is in L2 for the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR
from .configs import GemvConfig
from .gemm_common import uniform_weight_scale, weight_scale_layout, weight_scale_ptrs
from .quant import quantize_groups
from .router import gemv_config

__all__ = ["fused_fp8_gemv", "fused_gemv_args"]

@triton.jit
def _fused_fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr,
    N, K,
    stride_xm, stride_wn, stride_wsn, stride_wsk, stride_ym,
    qmax, amax_floor,
    MIN_EXP: tl.constexpr, WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, GROUP: tl.constexpr,
):
    STEP_K: tl.constexpr = GROUPS_PER_STEP * GROUP
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    safe_n = tl.where(n_ok, offs_n, 0).to(tl.int64)  # columns past N: a valid address, loads masked, not stored
    offs_k = tl.arange(0, STEP_K)
    offs_g = tl.arange(0, GROUPS_PER_STEP)
    x_ptrs = x_ptr + row * stride_xm + offs_k
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = weight_scale_ptrs(ws_ptr, pid_n, safe_n, stride_wsn, BLOCK_N, WS_GROUP_N, W_SCALE_UNIFORM)
    num_groups = tl.cdiv(K, GROUP)

    acc = tl.zeros((BLOCK_N, STEP_K), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, STEP_K)):
        k_ok = offs_k < K - step * STEP_K
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        q, x_s = quantize_groups(tl.reshape(x, (GROUPS_PER_STEP, GROUP)), qmax, amax_floor, MIN_EXP)
        group = step * GROUPS_PER_STEP + offs_g
        g_ok = group < num_groups  # groups past K: q is 0 there, and their weight scale reads as 0
        if W_SCALE_UNIFORM:
            w_s = tl.load(ws_ptrs + group * stride_wsk, mask=g_ok, other=0.0)
            xq = tl.reshape(q * (x_s * w_s)[:, None], (STEP_K,))
            acc += xq[None, :] * w
        else:
            w_s = tl.load(ws_ptrs[:, None] + group[None, :] * stride_wsk, mask=g_ok[None, :], other=0.0)
            xq = tl.reshape(q * x_s[:, None], (STEP_K,))
            w = tl.reshape(tl.reshape(w, (BLOCK_N, GROUPS_PER_STEP, GROUP)) * w_s[:, :, None], (BLOCK_N, STEP_K))
            acc += xq[None, :] * w
        x_ptrs += STEP_K
        w_ptrs += STEP_K
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + safe_n).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def fused_gemv_args(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, y: torch.Tensor, granularity: str,
                    bias: torch.Tensor | None, cfg: GemvConfig) -> tuple[tuple[int, int], dict, dict]:
    """(grid, kernel arguments, launch options) of the fused GEMV writing y (M, N)."""
    m, k = x.shape
    n = w_q.shape[0]
    ws_group_n, stride_wsn, stride_wsk = weight_scale_layout(w_s, granularity)
    uniform = uniform_weight_scale(granularity, cfg.block_n)
    args = dict(
        x_ptr=x, w_ptr=w_q, ws_ptr=w_s, y_ptr=y, bias_ptr=bias if bias is not None else y,
        N=n, K=k,
        stride_xm=x.stride(0), stride_wn=w_q.stride(0), stride_wsn=stride_wsn, stride_wsk=stride_wsk,
        stride_ym=y.stride(0),
        qmax=activation_max(w_q.dtype), amax_floor=AMAX_FLOOR,
        MIN_EXP=fp8_min_exponent(w_q.dtype), WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, GROUPS_PER_STEP=cfg.groups_per_step, GROUP=GROUP_SIZE,
    )
    return (m, triton.cdiv(n, cfg.block_n)), args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def fused_fp8_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    granularity: str,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """y = dequant(quant(x)) @ dequant(w_q, w_s).T (+ bias) in x's dtype, for validated operands:
    x (M, K) bf16/fp16/fp32 with unit K stride, w_q (N, K) FP8 with unit K stride, w_s per
    `granularity` ('tensor': 0-d)."""
    m, k = x.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    grid, args, options = fused_gemv_args(x, w_q, w_s, y, granularity, bias, config or gemv_config(m, n, k))
    _fused_fp8_gemv_kernel[grid](**args, **options)
    return y
