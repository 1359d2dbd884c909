"""Small-M (decode) blockwise FP8 GEMM (Triton): split-K over the 128-wide K groups.

At decode a GEMM reads the whole weight for a handful of rows, so it is bound by HBM and by how
many SMs stream the weight at once: with N=576 and 64-column tiles there are only 9 output tiles.
Split-K spreads each tile's K groups over several programs so that every SM streams weights. Each
program writes its fp32 partial tile to a partial-sums buffer and bumps a per-tile counter; the program that
arrives last sums the partials *in split order* — the result does not depend on which program
arrives last, so it is deterministic — and writes y (+ bias) in the output dtype. Where K is
short or the tiles already fill the GPU, the router (:func:`fp8linear.ops.router.splitk_config`) says no
and the tiled kernel runs.

Scaling is the same promotion as :mod:`fp8linear.ops.gemm`: one 128-K group per tensor-core
product, scaled into the fp32 accumulator. Fusing the activation quantization into this kernel
was measured and rejected: re-quantizing x in every program (16-row MMA tiles for 1 real row)
made M=1 three times slower on H100 (47.8 vs 18.8 us geometric mean, DeepSeek-V3 shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE
from .configs import SplitKConfig, launch_options
from .gemm_common import (even_k, load_k_step, promote, store_tile, uniform_weight_scale, weight_scale_layout,
                          weight_scale_ptrs)
from .pdl import pdl_launch, wait_for_producer
from .router import decode_tile_counters, splitk_config

__all__ = ["WS_TAIL_COUNTERS", "splitk_args", "splitk_buffers", "splitk_fp8_gemm", "splitk_counters"]

# Counters at the end of a splitk_counters tensor for the one-launch decode kernel (fused_decode.SYNC_COUNTERS).
_SYNC_COUNTERS = 2
# Two per tail tile of ws_gemm.tail_plan (fewer than one per SM) on GPUs of up to 256 SMs.
WS_TAIL_COUNTERS = 512


@triton.jit
def _splitk_program(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr,
    pid_n, pid_s, pid_m, num_n, num_s,
    M, N, K, groups_per_split,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_ym,
    WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, X_FROM_THIS_LAUNCH: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One program of the split-K GEMM: output tile (pid_m, pid_n), K groups of split pid_s of num_s.
    `X_FROM_THIS_LAUNCH`: x and its scales were written by other programs of this launch, so they are
    read from L2 (``.cg``), never from a stale L1 line. `EVEN_K`: K is a multiple of GROUP
    (:func:`~fp8linear.ops.gemm_common.load_k_step`)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    # Rows/cols past M/N point at row 0 / col 0 (valid addresses), load nothing (masked: see the
    # tiled kernel in fp8linear.ops.gemm) and are masked on store.
    m_ok = offs_m < M
    n_ok = offs_n < N
    safe_m = tl.where(m_ok, offs_m, 0).to(tl.int64)
    safe_n = tl.where(n_ok, offs_n, 0).to(tl.int64)
    g_first = pid_s * groups_per_split
    g_last = tl.minimum(g_first + groups_per_split, tl.cdiv(K, GROUP))
    k_first = g_first * GROUP
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + (k_first + offs_k)[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + (k_first + offs_k)[:, None]
    ws_ptrs = weight_scale_ptrs(ws_ptr, pid_n, safe_n, stride_wsn, BLOCK_N, WS_GROUP_N, W_SCALE_UNIFORM)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(g_first, g_last):
        k_left = K - g * GROUP
        w = load_k_step(w_ptrs, n_ok[None, :], offs_k, k_left, EVEN_K, 0, False)
        if X_FROM_THIS_LAUNCH:
            x = load_k_step(x_ptrs, m_ok[:, None], offs_k, k_left, EVEN_K, 1, True)
            x_s = tl.load(xs_ptr + safe_m * stride_xsm + g, mask=m_ok, other=0.0, cache_modifier=".cg")
        else:
            x = load_k_step(x_ptrs, m_ok[:, None], offs_k, k_left, EVEN_K, 1, False)
            x_s = tl.load(xs_ptr + safe_m * stride_xsm + g, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptrs + g * stride_wsk)
        acc = promote(acc, tl.dot(x, w), x_s, w_s, W_SCALE_UNIFORM)
        x_ptrs += GROUP
        w_ptrs += GROUP

    if SPLIT:
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + mn, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        count_ptr += pid_m * num_n + pid_n
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if arrived == num_s - 1:  # the last program of this tile reduces it
            tl.atomic_xchg(count_ptr, 0)  # and leaves the counter at zero for the next launch
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part_ptrs = part_ptr + mn
            for _ in range(0, num_s):  # split order, whoever arrived last
                acc += tl.load(part_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                part_ptrs += M * N
            store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, safe_n, M, N, stride_ym, HAS_BIAS)
    else:
        store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, safe_n, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _splitk_fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr,
    M, N, K, groups_per_split,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_ym,
    WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    wait_for_producer(USE_PDL)  # before any load or store (ops/pdl.py)
    _splitk_program(
        x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr,
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), tl.num_programs(1),
        M, N, K, groups_per_split,
        stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_ym,
        WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N, GROUP, False, EVEN_K,
    )


def splitk_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for the decode GEMMs of an N-column weight at M <= SMALL_M_MAX
    (:mod:`fp8linear.ops.router`): the split-K tile counters (at least WS_TAIL_COUNTERS, which the
    warp-specialized kernel's split tail tiles count in), then the two counters
    :mod:`fp8linear.ops.fused_decode` synchronises on.

    Every launch leaves its counters at zero again, so one counters tensor serves every call in turn
    and spares each call a memset launch (H100, CUDA graphs: 1.2-1.4 us of a 6.5-55 us GEMM).
    Calls running at the same time on different streams must not share one.
    """
    return torch.zeros(max(decode_tile_counters(n), WS_TAIL_COUNTERS) + _SYNC_COUNTERS, dtype=torch.int32,
                       device=device)


def splitk_buffers(m: int, n: int, cfg: SplitKConfig, k: int, device: torch.device,
                   counters: torch.Tensor | None) -> tuple[tuple[int, int], torch.Tensor | None, tuple | None]:
    """((splits, K groups per split), tile counters, partial sums' shape) of a launch: the counters
    are `counters` when it is large enough, else fresh zeros; None, None without a split."""
    groups = triton.cdiv(k, GROUP_SIZE)
    groups_per_split = triton.cdiv(groups, min(cfg.split_k, groups))
    split = triton.cdiv(groups, groups_per_split)  # no empty splits
    if split == 1:
        return (1, groups_per_split), None, None
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros((tiles,), dtype=torch.int32, device=device)
    return (split, groups_per_split), counters, (split, m, n)


def splitk_args(x: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, y: torch.Tensor,
                granularity: str, bias: torch.Tensor | None, cfg: SplitKConfig, split: tuple[int, int],
                part: torch.Tensor | None, count: torch.Tensor | None, pdl: bool) -> tuple[tuple[int, int, int], dict, dict]:
    """(grid, kernel arguments, launch options) of the split-K GEMM writing y (M, N); `part` and
    `count` and `split` (splits, K groups per split) from :func:`splitk_buffers`."""
    m, k = x.shape
    n = w_q.shape[0]
    ws_group_n, stride_wsn, stride_wsk = weight_scale_layout(w_s, granularity)
    split, groups_per_split = split
    args = dict(
        x_ptr=x, xs_ptr=x_s, w_ptr=w_q, ws_ptr=w_s, y_ptr=y, bias_ptr=bias if bias is not None else y,
        part_ptr=part if part is not None else y, count_ptr=count if count is not None else y,
        M=m, N=n, K=k, groups_per_split=groups_per_split,
        stride_xm=x.stride(0), stride_xsm=x_s.stride(0), stride_wn=w_q.stride(0), stride_wsn=stride_wsn,
        stride_wsk=stride_wsk, stride_ym=y.stride(0),
        WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform_weight_scale(granularity, cfg.block_n), HAS_BIAS=bias is not None,
        SPLIT=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP=GROUP_SIZE, USE_PDL=pdl,
        EVEN_K=even_k(k, GROUP_SIZE),
    )
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    return grid, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **pdl_launch(pdl),
                        **launch_options(cfg)}


def splitk_fp8_gemm(
    x: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    granularity: str,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: SplitKConfig | None = None,
    counters: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """y = dequant(x, x_s) @ dequant(w).T (+ bias) for small M on validated, K-contiguous operands.

    `counters`: a :func:`splitk_counters` (int32 zeros, left zeroed) to count in; without one,
    or one too small for this launch's tiles, each call zeroes fresh counters. `pdl`: launch with
    programmatic dependent launch (:mod:`fp8linear.ops.pdl`; the router decides).
    """
    m, k = x.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    cfg = config or splitk_config(m, n, k, x.device) or SplitKConfig(block_m=16, block_n=64, split_k=1)
    split, count, part_shape = splitk_buffers(m, n, cfg, k, x.device, counters)
    part = torch.empty(part_shape, dtype=torch.float32, device=x.device) if part_shape else None
    grid, args, options = splitk_args(x, x_s, w_q, w_s, y, granularity, bias, cfg, split, part, count, pdl)
    _splitk_fp8_gemm_kernel[grid](**args, **options)
    return y
