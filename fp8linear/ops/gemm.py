"""Blockwise-scaled FP8 GEMM (Triton): y = dequant(x) @ dequant(w).T (+ bias).

One kernel serves the three weight granularities: the weight scale is read at
``(n // WS_GROUP_N) * stride_wsn + k_block * stride_wsk`` (block: WS_GROUP_N=128; row:
WS_GROUP_N=1; per-tensor: both strides 0).

Scaling (DeepSeek-V3 "promotion"): each 128-wide K group is multiplied on the FP8 tensor
cores into a fresh fp32 tile and added to the fp32 accumulator on the CUDA cores with one
FMA per element when the weight scale is uniform across the tile (128x128 blocks with
BLOCK_N <= 128, per-tensor). Letting the tensor cores accumulate across groups instead
(acc rescaled by s_{k-1}/s_k and fed back as the MMA's C operand) was measured on H100 at
2.5e-3 relative error for K=7168 and 5.3e-3 for K=18432, against 1.3e-4 with promotion,
and was no faster (1348 vs 1243 us at M=4096, N=18432, K=7168): Hopper's FP8 MMA keeps
about 14 bits while accumulating.

Short K with M >= 2048 and uniform weight scales runs, on Hopper, a persistent variant (the
router, :mod:`fp8linear.ops.router`, decides): one program per SM walks the output tiles, loading operands through TMA descriptors, and Triton's flattened loop overlaps a tile's
epilogue with the next tile's loads. H100, M=4096: K=512 211 vs 304 us, K=1536 413 vs 437 us;
at K >= 7168 it was 2-4% slower, so long K keeps the plain kernel. Also measured on H100 and not
adopted (no gain): TMA loads in the plain kernel (+-3%), ``tl.range(warp_specialize=True)``
(Triton 3.6 ignores it on Hopper: same registers, same time), promoting the previous K group's
product while the next one runs on the tensor cores (241 registers, 3-15% slower). The overlap
that works is across warpgroups: on Hopper the router sends long-K tiled routes to the
warp-specialized Gluon kernel of :mod:`fp8linear.ops.ws_gemm` (same bits, 0.61-0.92x the time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE
from .configs import GemmConfig, SplitKConfig, launch_options, sm_count
from .cublas_gemm import cublas_fp8_gemm
from .cutlass_gemm import cutlass_fp8_gemm
from .gemm_common import (even_k, load_k_step, prefetch_scales, promote, store_tile, uniform_weight_scale,
                          weight_scale_layout, weight_scale_ptrs)
from .pdl import pdl_launch, wait_for_producer
from .router import TensorDescriptor, Route, dense_scale, route_gemm, tma_ok
from .splitk_gemm import splitk_fp8_gemm
from .ws_gemm import ws_fp8_gemm

__all__ = ["block_fp8_gemm", "run_gemm_route", "tiled_args"]


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share each column of W while it is in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (tile // pids_per_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % pids_per_group) % group_m, (tile % pids_per_group) // group_m


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_ym,
    WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_GROUP_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    wait_for_producer(USE_PDL)  # before any load or store (ops/pdl.py)
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/cols past M/N point at row 0 / col 0 (valid addresses) and are masked: a partly filled
    # tile loads nothing for them (unmasked, dozens of rows reading one line of x cost up to 1.6x the
    # time of the full tile, H100), and they are masked on store.
    m_ok = offs_m < M
    n_ok = offs_n < N
    safe_m = tl.where(m_ok, offs_m, 0).to(tl.int64)
    safe_n = tl.where(n_ok, offs_n, 0).to(tl.int64)
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_k[:, None]
    xs_ptrs = xs_ptr + safe_m * stride_xsm
    ws_ptrs = weight_scale_ptrs(ws_ptr, pid_n, safe_n, stride_wsn, BLOCK_N, WS_GROUP_N, W_SCALE_UNIFORM)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = tl.cdiv(K, BLOCK_K)
    if PREFETCH_SCALES:  # (see prefetch_scales) group 0's scales; each step then loads the next group's
        x_s_next = tl.load(xs_ptrs, mask=m_ok, other=0.0)
        w_s_next = tl.load(ws_ptrs)
    for k_step in range(0, k_steps):
        k_left = K - k_step * BLOCK_K
        x = load_k_step(x_ptrs, m_ok[:, None], offs_k, k_left, EVEN_K, 1, False)
        w = load_k_step(w_ptrs, n_ok[None, :], offs_k, k_left, EVEN_K, 0, False)
        if PREFETCH_SCALES:
            x_s = x_s_next
            w_s = w_s_next
            # the last step reloads the last group (a valid address) rather than reading past it
            k_next = tl.minimum((k_step + 1) // SCALE_GROUP_K, (k_steps - 1) // SCALE_GROUP_K)
            x_s_next = tl.load(xs_ptrs + k_next, mask=m_ok, other=0.0)
            w_s_next = tl.load(ws_ptrs + k_next * stride_wsk)
        else:
            k_group = k_step // SCALE_GROUP_K  # BLOCK_K divides 128: several K steps share a scale
            x_s = tl.load(xs_ptrs + k_group, mask=m_ok, other=0.0)
            w_s = tl.load(ws_ptrs + k_group * stride_wsk)
        acc = promote(acc, tl.dot(x, w), x_s, w_s, W_SCALE_UNIFORM)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, safe_n, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _block_fp8_gemm_persistent_kernel(
    x_desc, xs_ptr, w_desc, ws_ptr, y_ptr, bias_ptr,
    M, N, K,
    stride_xsm, stride_wsn, stride_wsk, stride_ym,
    WS_GROUP_N: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_GROUP_K: tl.constexpr,
):
    # TMA zero-fills reads past M, N and K, so no masks until the store.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        xs_ptrs = xs_ptr + safe_m * stride_xsm
        ws_ptrs = weight_scale_ptrs(ws_ptr, pid_n, safe_n, stride_wsn, BLOCK_N, WS_GROUP_N, W_SCALE_UNIFORM)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_step in range(0, k_steps):
            x = x_desc.load([pid_m * BLOCK_M, k_step * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k_step * BLOCK_K])
            k_group = k_step // SCALE_GROUP_K
            x_s = tl.load(xs_ptrs + k_group)
            w_s = tl.load(ws_ptrs + k_group * stride_wsk)
            acc = promote(acc, tl.dot(x, w.T), x_s, w_s, W_SCALE_UNIFORM)
        store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, safe_n, M, N, stride_ym, HAS_BIAS)


def tiled_args(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, y: torch.Tensor,
               granularity: str, bias: torch.Tensor | None, cfg: GemmConfig, pdl: bool) -> tuple[tuple[int], dict, dict]:
    """(grid, kernel arguments, launch options) of the tiled GEMM writing y (M, N)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    ws_group_n, stride_wsn, stride_wsk = weight_scale_layout(w_s, granularity)
    args = dict(
        x_ptr=x_q, xs_ptr=x_s, w_ptr=w_q, ws_ptr=w_s, y_ptr=y, bias_ptr=bias if bias is not None else y,
        M=m, N=n, K=k,
        stride_xm=x_q.stride(0), stride_xsm=x_s.stride(0), stride_wn=w_q.stride(0), stride_wsn=stride_wsn,
        stride_wsk=stride_wsk, stride_ym=y.stride(0),
        WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform_weight_scale(granularity, cfg.block_n), HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SCALE_GROUP_K=GROUP_SIZE // cfg.block_k, USE_PDL=pdl,
        PREFETCH_SCALES=prefetch_scales(granularity, cfg.block_n), EVEN_K=even_k(k, cfg.block_k),
    )
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    return grid, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **pdl_launch(pdl),
                        **launch_options(cfg)}


def _persistent_gemm(x_q, x_s, w_q, w_s, y, granularity, bias, cfg: GemmConfig) -> None:
    m, k = x_q.shape
    n = w_q.shape[0]
    ws_group_n, stride_wsn, stride_wsk = weight_scale_layout(w_s, granularity)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _block_fp8_gemm_persistent_kernel[(min(tiles, sm_count(x_q.device)),)](
        TensorDescriptor.from_tensor(x_q, [cfg.block_m, cfg.block_k]), x_s,
        TensorDescriptor.from_tensor(w_q, [cfg.block_n, cfg.block_k]), w_s, y, bias if bias is not None else y,
        m, n, k,
        x_s.stride(0), stride_wsn, stride_wsk, y.stride(0),
        WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform_weight_scale(granularity, cfg.block_n), HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SCALE_GROUP_K=GROUP_SIZE // cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def run_gemm_route(route: Route, x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                   granularity: str, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   counters: torch.Tensor | None = None) -> torch.Tensor:
    """Run the GEMM on the kernel `route` names (:func:`fp8linear.ops.router.route_gemm`)."""
    if route.kernel == "cublas":
        return cublas_fp8_gemm(x_q, x_s, w_q, w_s, granularity, bias, route.config)
    # Our kernels read x_s row-major. M-major scales (cuBLAS's layout) were measured 1.2-1.9x slower
    # in the tiled kernel (H100, 512x7168 M=1024: 37.1 vs 19.4 us; 18432x7168 M=4096: 1628 vs 1190):
    # likely because each K step's scale load then misses L1 (row-major, one line serves 32 K steps).
    x_s = x_s.contiguous()
    if route.kernel == "cutlass":  # reads x_s row-major too
        return cutlass_fp8_gemm(x_q, x_s, w_q, w_s, bias, route.config, granularity)
    if route.kernel == "splitk":
        return splitk_fp8_gemm(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, route.config, counters, route.pdl)
    if route.kernel == "ws":
        return ws_fp8_gemm(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, route.config, counters)
    m, n = x_q.shape[0], w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    if route.kernel == "persistent":
        _persistent_gemm(x_q, x_s, w_q, w_s, y, granularity, bias, route.config)
        return y
    grid, args, options = tiled_args(x_q, x_s, w_q, w_s, y, granularity, bias, route.config, route.pdl)
    _block_fp8_gemm_kernel[grid](**args, **options)
    return y


def block_fp8_gemm(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    granularity: str,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: GemmConfig | SplitKConfig | None = None,
    allow_cublas: bool = False,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the GEMM on validated, K-contiguous operands: x_q (M, K), w_q (N, K); x_s (M, K/128)
    row-major or M-major (cuBLAS reads the latter as is, our kernels the former).

    Without a `config` the router (:func:`fp8linear.ops.router.route_gemm`) picks the kernel
    (cuBLAS only with `allow_cublas`); a GemmConfig runs the tiled kernel with it, a SplitKConfig
    the split-K kernel. `counters` (a :func:`~fp8linear.ops.splitk_gemm.splitk_counters`)
    spares the split-K kernel its per-call counter memset.
    """
    m, k = x_q.shape
    n = w_q.shape[0]
    if config is None:
        route = route_gemm(x_q.device, m, n, k, granularity, w_q.dtype, out_dtype, bias, allow_cublas,
                           tma_ok(x_q) and tma_ok(w_q),
                           x_q.is_contiguous() and w_q.is_contiguous() and dense_scale(w_s, granularity))
    else:
        route = Route("splitk" if isinstance(config, SplitKConfig) else "tiled", config)
    return run_gemm_route(route, x_q, x_s, w_q, w_s, granularity, out_dtype, bias, counters)
