"""Decode-sized FP8 linear in one launch (Triton): activation quantization, then the split-K GEMM.

In eager mode a decode linear of 2-64 tokens is bound by the host: each kernel launch and each
allocation costs microseconds, and act_quant + GEMM are two launches. Quantizing x inside every
GEMM program instead repeats the work once per output tile (measured 3x slower on H100 at M=1).
This kernel does both in one launch without repeating anything:

- programs ``0 .. Q-1`` each quantize one 1x128 group column of x for a chunk of rows (all M rows
  up to QUANT_CHUNK_ROWS, else chunks of that many; Q = chunks x ceil(K/128)) with
  :func:`fp8linear.ops.quant.quantize_groups` (the bytes and scales act_quant writes) into x_q /
  x_s, then bump a ready counter (release);
- programs ``Q ..`` are the split-K GEMM's programs (:func:`fp8linear.ops.splitk_gemm._splitk_program`):
  each waits until the ready counter reaches Q (acquire), reads x_q / x_s from L2 and runs as in
  the two-launch path, so y is bit-identical to it; the last one to finish resets the counters.

The wait relies on programs being dispatched in increasing program id, so that the quantizing
programs, which never wait, are running or done before any GEMM program occupies their place (the
order NVIDIA GPUs and Triton's CPU interpreter follow). The router uses this kernel on NVIDIA GPUs
and in the interpreter only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR
from .configs import SplitKConfig
from .gemm_common import even_k, uniform_weight_scale, weight_scale_layout
from .quant import act_quant_outputs, quantize_groups
from .splitk_gemm import _SYNC_COUNTERS, _splitk_program, splitk_buffers

__all__ = ["QUANT_CHUNK_ROWS", "SYNC_COUNTERS", "fused_decode_args", "fused_decode_gemm", "split_counters"]

# Counters the kernel synchronises on (ready, done), after the split-K tile counters in a counters.
SYNC_COUNTERS = _SYNC_COUNTERS
# Rows per quantizing step (a (16, 128) fp32 tile: 8 KB of registers over 4 warps).
_QUANT_ROWS = 16
# Rows one quantizing program covers (4 steps): decode sizes take one chunk, so one program per K
# group; larger M more programs, so that quantization does not serialise over the rows.
QUANT_CHUNK_ROWS = 64


@triton.jit
def _fused_decode_kernel(
    x_ptr, xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, sync_ptr,
    M, N, K, groups_per_split, num_n, num_s, num_q, num_groups, num_gemm,
    stride_xm, stride_wn, stride_wsn, stride_wsk, stride_ym,
    qmax, amax_floor,
    MIN_EXP: tl.constexpr, WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    QUANT_ROWS: tl.constexpr, QUANT_CHUNK: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_q:  # quantize K group `group` of the rows of chunk `chunk`
        group = pid % num_groups
        chunk = pid // num_groups
        offs_k = group * GROUP + tl.arange(0, GROUP)
        k_ok = offs_k < K
        for m0 in range(chunk * QUANT_CHUNK, tl.minimum(M, (chunk + 1) * QUANT_CHUNK), QUANT_ROWS):
            offs_m = (m0 + tl.arange(0, QUANT_ROWS)).to(tl.int64)
            row_ok = offs_m < M
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            q, scale = quantize_groups(x, qmax, amax_floor, MIN_EXP)
            tl.store(xq_ptr + offs_m[:, None] * K + offs_k[None, :], q.to(xq_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & k_ok[None, :])
            tl.store(xs_ptr + offs_m * num_groups + group, scale, mask=row_ok)
        tl.debug_barrier()  # every thread's stores are issued before the counter says so
        tl.atomic_add(sync_ptr, 1, sem="release")
    else:
        gid = pid - num_q
        pid_n = gid % num_n
        pid_s = (gid // num_n) % num_s
        pid_m = gid // (num_n * num_s)
        # Spin on plain volatile loads (hundreds of programs spinning with atomics would queue at the
        # counter's L2 slice ahead of the quantizers' releases), then one acquire to order the reads.
        ready = tl.load(sync_ptr, volatile=True)
        while ready < num_q:
            ready = tl.load(sync_ptr, volatile=True)
        tl.atomic_add(sync_ptr, 0, sem="acquire")
        _splitk_program(
            xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr,
            pid_n, pid_s, pid_m, num_n, num_s,
            M, N, K, groups_per_split,
            K, num_groups, stride_wn, stride_wsn, stride_wsk, stride_ym,
            WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N, GROUP, True, EVEN_K,
        )
        done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
        if done == num_gemm - 1:  # the last GEMM program: every program has passed the wait
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)


def fused_decode_args(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                      y: torch.Tensor, granularity: str, bias: torch.Tensor | None, cfg: SplitKConfig,
                      split: tuple[int, int], part: torch.Tensor | None, count: torch.Tensor | None,
                      sync: torch.Tensor) -> tuple[tuple[int], dict, dict]:
    """(grid, kernel arguments, launch options); `split`, `part`, `count` from
    :func:`fp8linear.ops.splitk_gemm.splitk_buffers`; `sync`: SYNC_COUNTERS int32 zeros (left zeroed)."""
    m, k = x.shape
    n = w_q.shape[0]
    ws_group_n, stride_wsn, stride_wsk = weight_scale_layout(w_s, granularity)
    num_split, groups_per_split = split
    num_n, num_m, num_groups = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), triton.cdiv(k, GROUP_SIZE)
    num_q = triton.cdiv(m, QUANT_CHUNK_ROWS) * num_groups
    num_gemm = num_n * num_split * num_m
    args = dict(
        x_ptr=x, xq_ptr=x_q, xs_ptr=x_s, w_ptr=w_q, ws_ptr=w_s, y_ptr=y, bias_ptr=bias if bias is not None else y,
        part_ptr=part if part is not None else y, count_ptr=count if count is not None else sync, sync_ptr=sync,
        M=m, N=n, K=k, groups_per_split=groups_per_split, num_n=num_n, num_s=num_split, num_q=num_q,
        num_groups=num_groups, num_gemm=num_gemm,
        stride_xm=x.stride(0), stride_wn=w_q.stride(0), stride_wsn=stride_wsn, stride_wsk=stride_wsk,
        stride_ym=y.stride(0),
        qmax=activation_max(w_q.dtype), amax_floor=AMAX_FLOOR,
        MIN_EXP=fp8_min_exponent(w_q.dtype), WS_GROUP_N=ws_group_n,
        W_SCALE_UNIFORM=uniform_weight_scale(granularity, cfg.block_n), HAS_BIAS=bias is not None,
        SPLIT=num_split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP=GROUP_SIZE, QUANT_ROWS=_QUANT_ROWS,
        QUANT_CHUNK=QUANT_CHUNK_ROWS, EVEN_K=even_k(k, GROUP_SIZE),
    )
    return (num_q + num_gemm,), args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def split_counters(counters: torch.Tensor | None, m: int, n: int, cfg: SplitKConfig,
                   device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(split-K tile counters, (ready, done) counters) of a :func:`~fp8linear.ops.splitk_gemm.splitk_counters`
    (its last SYNC_COUNTERS entries are the latter) with room for the tile counters of an (m, n)
    launch with `cfg` (none without a split); without one, or one too small, (None, fresh zeros)."""
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m) if cfg.split_k > 1 else 0
    if counters is None or counters.numel() < tiles + SYNC_COUNTERS:
        return None, torch.zeros(SYNC_COUNTERS, dtype=torch.int32, device=device)
    return counters[:-SYNC_COUNTERS], counters[-SYNC_COUNTERS:]


def fused_decode_gemm(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
                      bias: torch.Tensor | None, cfg: SplitKConfig, counters: torch.Tensor | None = None) -> torch.Tensor:
    """y (M, N) in x.dtype for a validated, K-contiguous x (M, K) and w_q (N, K), in one launch.

    `counters`: a :func:`fp8linear.ops.splitk_gemm.splitk_counters` (tile counters, then the
    SYNC_COUNTERS this kernel waits on), left zeroed; without one, fresh counters per call.
    """
    m, k = x.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    tile_counters, sync = split_counters(counters, m, n, cfg, x.device)
    split, count, part_shape = splitk_buffers(m, n, cfg, k, x.device, tile_counters)
    part = torch.empty(part_shape, dtype=torch.float32, device=x.device) if part_shape else None
    x_q, x_s = act_quant_outputs(m, k, w_q.dtype, x.device)  # the layout act_quant writes
    grid, args, options = fused_decode_args(x, x_q, x_s, w_q, w_s, y, granularity, bias, cfg, split, part, count, sync)
    _fused_decode_kernel[grid](**args, **options)
    return y
