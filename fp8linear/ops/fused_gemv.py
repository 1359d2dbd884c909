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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR
from .gemm_common import uniform_weight_scale, weight_scale_layout, weight_scale_ptrs
from .quant import quantize_groups

__all__ = ["FUSED_GEMV_MAX_WEIGHT", "GemvConfig", "gemv_config", "use_fused_gemv", "fused_fp8_gemv", "fused_gemv_args"]

# Single-token GEMMs with fewer weight elements than this take the fused kernel. H100 sweep
# (benchmarks/gemv_sweep.py, CUDA graphs, M=1; fused vs act_quant + GEMM): 4.5-6.3 vs 8.7-12.2 us
# for 3-6 MB of weight (N=1536..3072, K=1536..2816), 8.6 vs 9.2 us at N=576, K=7168, 18.5 vs 18.5
# at 24576x1536; from 117 MB up (7168x16384, 18432x7168) the split-K GEMM streams HBM faster
# (51.4 vs 50.4 and 58.5 vs 53.8 us). At M >= 2 each row re-reads the weight tile and the
# two-kernel path won (geometric mean 19.9 vs 16.8 us at M=2). Re-swept (H100): from
# 33M elements the two kernels win too (4608x7168 19.6 vs 21.7 us; 18432x7168 54.5 vs 63.8) or tie
# (24576x1536 18.2 vs 18.5; 32768x512, 16.8M: 10.7 vs 10.7), while below it the fused kernel still
# wins (7168x2304 11.1 vs 13.6, 1536x7168 10.2 vs 11.4): hence 24M.
FUSED_GEMV_MAX_WEIGHT = 24 * 2**20


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration: BLOCK_N output columns per program, GROUPS_PER_STEP 128-wide K groups per step."""

    block_n: int
    groups_per_step: int = 4
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, hi in (("block_n", GROUP_SIZE), ("groups_per_step", 8)):
            v = getattr(self, name)
            if v < 1 or v > hi or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two in [1, {hi}], got {v}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"GemvConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")


def use_fused_gemv(m: int, n: int, k: int) -> bool:
    """Whether the fused kernel is the faster forward for this GEMM (see FUSED_GEMV_MAX_WEIGHT)."""
    return m == 1 and n * k < FUSED_GEMV_MAX_WEIGHT


def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """Default launch config (H100 sweep, benchmarks/gemv_sweep.py, M=1).

    Up to N=4096, 8 columns and 8 warps per program (more programs to stream a small weight; e.g.
    N=1536, K=7168: 10.2 us vs 16.3 us with 16 columns / 4 groups / 4 warps), 8 groups per step
    where K has 16 groups or more; above, 32 columns x 4 groups, 4 warps (N=7168, K=2048: 9.1 us).
    """
    groups = triton.cdiv(k, GROUP_SIZE)
    if n <= 4096:
        return GemvConfig(block_n=8, groups_per_step=8 if groups >= 16 else 4, num_warps=8, num_stages=2)
    return GemvConfig(block_n=32, groups_per_step=4, num_warps=4, num_stages=2)


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
