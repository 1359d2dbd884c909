"""`@triton.jit` building blocks shared by the blockwise FP8 GEMM kernels (tiled, persistent, split-K).

One place for the numerics every kernel must agree on: where a tile's weight scales live, how one
128-wide K group's tensor-core product is promoted into the fp32 accumulator, and the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE

__all__ = ["even_k", "load_k_step", "prefetch_scales", "promote", "store_tile", "uniform_weight_scale", "weight_scale_layout",
           "weight_scale_ptrs"]

# Narrowest tile whose per-column weight scales the tiled kernel loads one K step ahead.
PREFETCH_SCALES_MIN_BLOCK_N = 128


def weight_scale_layout(w_s: torch.Tensor, granularity: str) -> tuple[int, int, int]:
    """(WS_GROUP_N, stride along N, stride along K groups) of a weight scale: 128x128 blocks
    (128, s0, s1), 1x128 rows (1, s0, s1), per-tensor (1, 0, 0) for any 0-d or 1-element scale."""
    if granularity == "tensor":
        return 1, 0, 0
    return (GROUP_SIZE if granularity == "block" else 1), w_s.stride(0), w_s.stride(1)


def uniform_weight_scale(granularity: str, block_n: int) -> bool:
    """Whether a tile of `block_n` columns has one weight scale per K group: per-tensor, or 128x128
    blocks when a tile never straddles two 128-row blocks."""
    return granularity == "tensor" or (granularity == "block" and GROUP_SIZE % block_n == 0)


def prefetch_scales(granularity: str, block_n: int) -> bool:
    """Whether the tiled kernel loads a K group's activation and weight scales one step ahead, so
    their latency overlaps the previous step's product: for 1x128 weights (a scale per output
    column) on tiles at least PREFETCH_SCALES_MIN_BLOCK_N wide. H100, kernel alone, 1x128 weights:
    128x128 tiles 0.77-0.98x the time (3584x3584 M=333 52.3 -> 40.2 us; 24576x1536 M=4096 949 ->
    854), 64x128 0.97-1.01x; but 64x64 and 16x32 tiles 1.02-1.12x, and 128x128 blocks (one scale
    per tile and step) 0.97-1.15x, so those load each step's scales in that step
    (benchmarks/scale_prefetch_ab.py)."""
    return granularity == "row" and block_n >= PREFETCH_SCALES_MIN_BLOCK_N


def even_k(k: int, block_k: int) -> bool:
    """Whether every K step of `block_k` is whole (the EVEN_K of :func:`load_k_step`)."""
    return k % block_k == 0


@triton.jit
def load_k_step(ptrs, ok, offs_k, k_left, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr, FROM_L2: tl.constexpr):
    """One K step's tile of an operand, zeros where `ok` (rows or columns inside M / N, broadcast along
    K) is false and past K. With EVEN_K (K a multiple of the step) there is no K mask: a mask that
    varies along the contiguous K axis keeps the compiler from vectorising the FP8 loads: without it
    the tiled kernel took 0.936x the time on 128x128 weights (geomean of 12 cases; H100, CUDA graphs,
    kernel alone, same bits, benchmarks/k_mask_ab.py): 64x128 tiles 0.85-0.89x (7168x2048 M=512 22.5
    against 26.6 us), 64x64 0.96-0.97x, 128x128 at M=4096 0.99-1.00x; 1x128 weights 0.979x. `K_AXIS`: the axis K runs along (x tiles 1, w tiles
    0), that of `offs_k`; `FROM_L2`: load through L2 only (``.cg``: data written by other programs
    of the same launch)."""
    if EVEN_K:
        mask = ok
    elif K_AXIS == 1:
        mask = ok & (offs_k[None, :] < k_left)
    else:
        mask = ok & (offs_k[:, None] < k_left)
    if FROM_L2:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def weight_scale_ptrs(ws_ptr, pid_n, safe_n, stride_wsn, BLOCK_N: tl.constexpr, WS_GROUP_N: tl.constexpr,
                      W_SCALE_UNIFORM: tl.constexpr):
    """Pointers to a tile's weight scales of K group 0 (add ``group * stride_wsk``): one scalar when
    the scale is uniform across the tile (per-tensor, or 128x128 blocks with BLOCK_N <= 128), else
    one per output column (row-wise: WS_GROUP_N=1)."""
    if W_SCALE_UNIFORM:
        return ws_ptr + (pid_n * BLOCK_N // WS_GROUP_N) * stride_wsn
    else:
        return ws_ptr + (safe_n // WS_GROUP_N) * stride_wsn


@triton.jit
def promote(acc, product, x_s, w_s, W_SCALE_UNIFORM: tl.constexpr):
    """acc + product * x_s[m] * w_s[n]: one K group's tensor-core product, scaled, into the fp32
    accumulator (one FMA per element when the weight scale is a scalar)."""
    if W_SCALE_UNIFORM:
        return acc + product * (x_s * w_s)[:, None]
    else:
        return acc + product * (x_s[:, None] * w_s[None, :])


@triton.jit
def store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, safe_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """Add the bias (fp32) and store the tile in y's dtype, masked to the (M, N) output."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
