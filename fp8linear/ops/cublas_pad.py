"""Quantized activations padded to the row count cuBLAS blockwise FP8 takes (Triton).

cuBLAS's blockwise path wants M a multiple of 4 and the 1x128 activation scales M-major
(:mod:`fp8linear.ops.cublas_gemm`). ``Fp8BlockLinear`` and ``fp8_linear`` quantize straight into
that layout (:func:`fp8linear.ops.quant.act_quant` with ``cublas_layout``); activations given to
``block_fp8_matmul`` already quantized, with another M, are copied into it here: one kernel and one
allocation for both the values and the scales (H100, GEMM alone at M=77: 7168x2048 12.7 -> 11.9 us
against two copies and two allocations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pad_rows"]


@triton.jit
def _pad_rows_kernel(xq_ptr, xs_ptr, q_ptr, s_ptr, M, K, G, stride_xq, stride_xs_m, stride_xs_g, ROWS,
                     BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    """Copy rows [pid_m * BLOCK_M, +BLOCK_M) x groups [pid_g * GROUPS, +GROUPS) of x_q (M, K) and its
    scales into the padded output: q (ROWS, K) row-major, s (G, ROWS) (M-major scales); padding rows
    get zeros and scale 1."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_g * GROUPS * 128 + tl.arange(0, GROUPS * 128)
    real = rows < M
    keep = (rows < ROWS)[:, None] & (cols < K)[None, :]
    q = tl.load(xq_ptr + rows[:, None] * stride_xq + cols[None, :], mask=real[:, None] & keep, other=0.0)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=keep)
    groups = pid_g * GROUPS + tl.arange(0, GROUPS)
    g_ok = (rows < ROWS)[:, None] & (groups < G)[None, :]
    s = tl.load(xs_ptr + rows[:, None] * stride_xs_m + groups[None, :] * stride_xs_g,
                mask=real[:, None] & g_ok, other=1.0)
    tl.store(s_ptr + groups[None, :].to(tl.int64) * ROWS + rows[:, None], s, mask=g_ok)


# Rows and 128-wide groups one program copies: 16 x 512 bytes of x_q.
_PAD_BLOCK_M, _PAD_GROUPS = 16, 4


def pad_rows(x_q: torch.Tensor, x_s: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_q (M, K) and its scales x_s (M, ceil(K/128), any layout) as `rows` >= M rows: x_q row-major,
    scales M-major (stride (1, rows)), in one allocation; padding rows are zeros with scale 1 (their
    output rows are dropped)."""
    m, k = x_q.shape
    if rows < m:
        raise ValueError(f"pad_rows needs rows >= M = {m}, got {rows}")
    if x_q.stride(1) != 1:
        x_q = x_q.contiguous()
    g = x_s.shape[1]
    q_bytes = -(-rows * k // 256) * 256  # the scales start 256-byte aligned
    buf = torch.empty(q_bytes + g * rows * 4, dtype=torch.uint8, device=x_q.device)
    x_p = buf[: rows * k].view(x_q.dtype).view(rows, k)
    s_p = buf[q_bytes:].view(torch.float32).view(g, rows)
    grid = (triton.cdiv(rows, _PAD_BLOCK_M), triton.cdiv(g, _PAD_GROUPS))
    _pad_rows_kernel[grid](x_q, x_s, x_p, s_p, m, k, g, x_q.stride(0), x_s.stride(0), x_s.stride(1), rows,
                           BLOCK_M=_PAD_BLOCK_M, GROUPS=_PAD_GROUPS)
    return x_p, s_p.t()
