"""Grouped blockwise-scaled FP8 GEMM for mixture-of-experts (Triton), one launch for all experts.

Routing layout (the vLLM ``moe_align_block_size`` scheme; built by a one-program Triton kernel
for decode-sized batches, by device-side torch ops for large ones):
the S = T * top_k (token, expert) pairs are numbered ``pair = token * top_k + slot``, sorted
by expert, and each expert's list is padded to a multiple of BLOCK_M with the sentinel S.
Every BLOCK_M-row block therefore belongs to exactly one expert, recorded in
``block_expert``. The buffers are sized from static upper bounds (no host synchronisation):

    capacity = S + min(S, E + 1) * (BLOCK_M - 1)        rows in ``sorted_pair_ids``
    blocks   = capacity // BLOCK_M                      programs along M

Blocks past the used ones carry ``block_expert = E + 1`` and exit at once. Pairs routed to an
expert id outside ``[0, E)`` (expert-parallel sentinels) form a "null expert" E whose blocks
skip the K loop and store zeros, so every output row is written.

The kernel computes, for each pair p in a block of expert e,

    C[p, :] = (dequant(A[p // A_ROW_DIV]) @ dequant(W[e]).T + bias[e]) * topk_weight[p]

with the numerics of :mod:`fp8linear.ops.gemm`: each 128-wide K step is multiplied on the FP8
tensor cores into a fresh fp32 tile, scaled by ``a_s[row] * w_s[e, n]`` and added to the fp32
accumulator. ``A_ROW_DIV = top_k`` lets the gate/up GEMM read the token's activation row
(quantized once per token); the down GEMM reads the pair's own row (``A_ROW_DIV = 1``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE
from .configs import GemmConfig, launch_options
from .gemm_common import even_k, load_k_step, promote, weight_scale_ptrs
from .router import align_on_kernel, grouped_config, moe_align_num_warps

__all__ = ["MoeRouting", "align_args", "align_num_blocks", "grouped_fp8_gemm",
           "grouped_gemm_args", "moe_align_block_size"]


class MoeRouting(NamedTuple):
    """Expert-sorted, block-padded routing (all int32 device tensors, sizes from static bounds)."""

    sorted_pair_ids: torch.Tensor  # (capacity,) pair index, or S for padding
    block_expert: torch.Tensor  # (capacity // block_m,) expert of each block; E = null, E + 1 = unused
    block_m: int
    num_pairs: int  # S = T * top_k
    top_k: int


# Elements of the (chunk x experts) one-hot tile the align kernel holds per step.
_ALIGN_TILE = 8192


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: count pairs per expert, pad to BLOCK_M, scatter pair ids stably, label blocks."""
    bins = tl.arange(0, NUM_BINS)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        p = start + offs
        valid = p < num_pairs
        e = tl.load(ids_ptr + p, mask=valid, other=0)
        e = tl.where((e >= 0) & (e < num_experts), e, num_experts).to(tl.int32)  # null expert E
        hit = ((e[:, None] == bins[None, :]) & valid[:, None]).to(tl.int32)
        counts += tl.sum(hit, axis=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    cursor = padded_end - padded

    capacity = num_blocks * BLOCK_M
    for start in range(0, capacity, CHUNK):
        q = start + offs
        tl.store(sorted_ptr + q, tl.full((CHUNK,), 0, tl.int32) + num_pairs, mask=q < capacity)
    tl.debug_barrier()  # the padding fill is visible before the scatter overwrites real rows

    for start in range(0, num_pairs, CHUNK):
        p = start + offs
        valid = p < num_pairs
        e = tl.load(ids_ptr + p, mask=valid, other=0)
        e = tl.where((e >= 0) & (e < num_experts), e, num_experts).to(tl.int32)
        hit = ((e[:, None] == bins[None, :]) & valid[:, None]).to(tl.int32)
        rank = tl.sum(hit * (tl.cumsum(hit, axis=0) - 1), axis=1)  # order within the chunk: stable
        base = tl.sum(hit * cursor[None, :], axis=1)
        tl.store(sorted_ptr + base + rank, p.to(tl.int32), mask=valid)
        cursor += tl.sum(hit, axis=0)

    for start in range(0, num_blocks, CHUNK):
        b = start + offs
        # owner = number of experts whose padded range ends at or before the block start
        owner = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        owner = tl.minimum(owner, num_experts + 1)  # unused tail blocks: E + 1, as the torch path
        tl.store(block_expert_ptr + b, owner, mask=b < num_blocks)


def align_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks needed at most: min(S, E + 1) non-empty experts each waste at most block_m - 1 rows."""
    # torch.sym_min / floor division: also valid on symbolic sizes (fake implementations)
    return (num_pairs + torch.sym_min(num_pairs, num_experts + 1) * (block_m - 1) + block_m - 1) // block_m


def moe_align_block_size(
    top_k_index: torch.Tensor, num_experts: int, block_m: int, method: str | None = None
) -> MoeRouting:
    """Sort the (token, expert) pairs of `top_k_index` (T, top_k) by expert, pad each expert to `block_m`.

    No host synchronisation and output sizes from shapes only (CUDA-graph safe). `method`:
    'kernel' (one Triton launch), 'torch' (sort/scatter_add/cumsum/searchsorted; no `bincount`,
    whose output size depends on the data), or None: as :func:`align_on_kernel` says. Both give identical results (pairs of one expert keep their order).
    """
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be 2-D (T, top_k), got shape {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be >= 1, got {num_experts} and {block_m}")
    if method not in (None, "kernel", "torch"):
        raise ValueError(f"method must be None, 'kernel' or 'torch', got {method!r}")
    top_k = top_k_index.shape[1]
    num_pairs = top_k_index.numel()
    num_blocks = align_num_blocks(num_pairs, num_experts, block_m)
    if method is None:
        method = "kernel" if align_on_kernel(num_pairs, num_experts) else "torch"
    if method == "torch" or num_pairs == 0:
        sorted_pair_ids, block_expert = _align_torch(top_k_index, num_experts, block_m, num_blocks)
    else:
        device = top_k_index.device
        sorted_pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
        grid, args, options = align_args(top_k_index.reshape(-1).contiguous(), sorted_pair_ids, block_expert,
                                         num_experts, block_m)
        _moe_align_kernel[grid](**args, **options)
    return MoeRouting(sorted_pair_ids, block_expert, block_m, num_pairs, top_k)


def align_args(ids: torch.Tensor, sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, num_experts: int,
               block_m: int) -> tuple[tuple[int], dict, dict]:
    """(grid, kernel arguments, launch options) of the one-program alignment kernel: `ids` the flat
    (T * top_k,) expert ids, into `sorted_pair_ids` (num_blocks * block_m,) and `block_expert` (num_blocks,)."""
    num_bins = triton.next_power_of_2(num_experts + 1)
    args = dict(ids_ptr=ids, sorted_ptr=sorted_pair_ids, block_expert_ptr=block_expert, num_pairs=ids.numel(),
                num_experts=num_experts, num_blocks=block_expert.shape[0], BLOCK_M=block_m, NUM_BINS=num_bins,
                CHUNK=max(16, min(128, _ALIGN_TILE // num_bins)))
    return (1,), args, {"num_warps": moe_align_num_warps()}


def _align_torch(
    top_k_index: torch.Tensor, num_experts: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    device = top_k_index.device
    num_pairs = top_k_index.numel()
    null = num_experts  # ids outside [0, E) go to a null expert whose rows are written as zeros
    expert = top_k_index.reshape(-1).to(torch.int64)
    expert = torch.where((expert >= 0) & (expert < num_experts), expert, torch.full_like(expert, null))

    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    sorted_expert, order = torch.sort(expert, stable=True)
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_expert]
    dest = padded_start[sorted_expert] + rank

    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pair_ids.scatter_(0, dest, order)
    block_start = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    # Expert owning each block: the first expert whose padded range ends after the block start.
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    return sorted_pair_ids.to(torch.int32), block_expert.to(torch.int32)


@triton.jit
def _grouped_fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, bias_ptr, topk_w_ptr,
    sorted_ids_ptr, block_expert_ptr,
    N, K, num_pairs, num_experts, num_blocks,
    stride_am, stride_asm,
    stride_we, stride_wn,
    stride_wse, stride_wsn, stride_wsk,
    stride_cm, stride_be,
    A_ROW_DIV: tl.constexpr, WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M row-blocks (often of one expert) share W's columns in L2.
    pids_per_group = GROUP_M * num_pid_n
    group_id = pid // pids_per_group
    first_m = group_id * GROUP_M
    group_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_m
    pid_n = (pid % pids_per_group) // group_m

    expert = tl.load(block_expert_ptr + pid_m)
    if expert > num_experts:  # block past the padded end of the last expert: no work
        return
    is_real = expert < num_experts
    safe_e = tl.where(is_real, expert, 0).to(tl.int64)

    offs_bm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_bm)
    pair_ok = pair < num_pairs
    # Padding rows and columns past N point at row 0 / col 0 (valid addresses), load nothing
    # (masked: see the tiled kernel in fp8linear.ops.gemm) and are masked on store.
    a_row = tl.where(pair_ok, pair // A_ROW_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    safe_n = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + safe_e * stride_we + safe_n[None, :] * stride_wn + offs_k[:, None]
    as_ptrs = as_ptr + a_row * stride_asm
    ws_ptrs = weight_scale_ptrs(ws_ptr + safe_e * stride_wse, pid_n, safe_n, stride_wsn, BLOCK_N, WS_GROUP_N,
                                W_SCALE_UNIFORM)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The null expert runs no K steps and stores zeros.
    k_steps = tl.where(is_real, tl.cdiv(K, BLOCK_K), 0)
    for k_step in range(0, k_steps):
        k_left = K - k_step * BLOCK_K
        a = load_k_step(a_ptrs, pair_ok[:, None], offs_k, k_left, EVEN_K, 1, False)
        w = load_k_step(w_ptrs, n_ok[None, :], offs_k, k_left, EVEN_K, 0, False)
        k_group = k_step // SCALE_GROUP_K  # BLOCK_K divides 128: several K steps share a scale
        a_s = tl.load(as_ptrs + k_group, mask=pair_ok, other=0.0)
        w_s = tl.load(ws_ptrs + k_group * stride_wsk)
        acc = promote(acc, tl.dot(a, w), a_s, w_s, W_SCALE_UNIFORM)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        bias = tl.load(bias_ptr + safe_e * stride_be + safe_n).to(tl.float32)
        acc += tl.where(is_real, bias, 0.0)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_w_ptr + tl.where(pair_ok, pair, 0)).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & (offs_n[None, :] < N))


def grouped_fp8_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    granularity: str,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Launch on validated operands -> C (num_pairs, N); row p is pair p's output.

    a_q (rows, K) fp8 with unit K stride, a_s (rows, ceil(K/128)); w_q (E, N, K) with unit K
    stride; w_s (E, ...) per granularity ('tensor': (E,)); bias (E, N) or None; topk_weights
    (num_pairs,) fp32 or None. `sorted_pair_ids` / `block_expert` come from
    :func:`moe_align_block_size` with the same block_m as `config` (block_m is read from their
    sizes; a given `config` must agree with it).
    """
    num_experts, n, k = w_q.shape
    c = torch.empty((num_pairs, n), dtype=out_dtype, device=a_q.device)
    num_blocks = block_expert.shape[0]
    if num_pairs == 0 or n == 0 or num_blocks == 0:
        return c
    block_m = sorted_pair_ids.shape[0] // num_blocks
    cfg = config or replace(grouped_config(num_pairs, num_experts, n, k), block_m=block_m)
    if cfg.block_m != block_m:
        raise ValueError(f"config.block_m={cfg.block_m} does not match the routing's block_m={block_m}")
    grid, args, options = grouped_gemm_args(a_q, a_s, w_q, w_s, c, sorted_pair_ids, block_expert, num_pairs,
                                            a_row_div, granularity, bias, topk_weights, cfg)
    _grouped_fp8_gemm_kernel[grid](**args, **options)
    return c


def grouped_gemm_args(
    a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, c: torch.Tensor,
    sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, num_pairs: int, a_row_div: int, granularity: str,
    bias: torch.Tensor | None, topk_weights: torch.Tensor | None, cfg: GemmConfig,
) -> tuple[tuple[int], dict, dict]:
    """(grid, kernel arguments, launch options) of the grouped GEMM into `c` (num_pairs, N), see
    :func:`grouped_fp8_gemm` for the operands (num_pairs > 0, N > 0, cfg.block_m the routing's)."""
    num_experts, n, k = w_q.shape
    num_blocks = block_expert.shape[0]
    if granularity == "tensor":
        ws_group_n, stride_wse, stride_wsn, stride_wsk = 1, w_s.stride(0), 0, 0
    else:
        ws_group_n = GROUP_SIZE if granularity == "block" else 1
        stride_wse, stride_wsn, stride_wsk = w_s.stride(0), w_s.stride(1), w_s.stride(2)
    args = dict(
        a_ptr=a_q, as_ptr=a_s, w_ptr=w_q, ws_ptr=w_s, c_ptr=c,
        bias_ptr=bias if bias is not None else c,
        topk_w_ptr=topk_weights if topk_weights is not None else c,
        sorted_ids_ptr=sorted_pair_ids, block_expert_ptr=block_expert,
        N=n, K=k, num_pairs=num_pairs, num_experts=num_experts, num_blocks=num_blocks,
        stride_am=a_q.stride(0), stride_asm=a_s.stride(0),
        stride_we=w_q.stride(0), stride_wn=w_q.stride(1),
        stride_wse=stride_wse, stride_wsn=stride_wsn, stride_wsk=stride_wsk,
        stride_cm=c.stride(0), stride_be=bias.stride(0) if bias is not None else 0,
        A_ROW_DIV=a_row_div, WS_GROUP_N=ws_group_n,
        W_SCALE_UNIFORM=granularity == "tensor" or (granularity == "block" and GROUP_SIZE % cfg.block_n == 0),
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SCALE_GROUP_K=GROUP_SIZE // cfg.block_k, EVEN_K=even_k(k, cfg.block_k),
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(cfg))
    return (num_blocks * triton.cdiv(n, cfg.block_n),), args, options
