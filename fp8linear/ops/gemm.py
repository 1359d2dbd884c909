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

Short K (<= 2304) with M >= 2048 and uniform weight scales runs, on Hopper, a persistent
variant: one program per SM walks the output tiles, loading operands through TMA descriptors, and Triton's flattened loop overlaps a tile's
epilogue with the next tile's loads. H100, M=4096: K=512 211 vs 304 us, K=1536 413 vs 437 us;
at K >= 7168 it was 2-4% slower, so long K keeps the plain kernel. Also measured on H100 and not
adopted (no gain): TMA loads in the plain kernel (+-3%), ``tl.range(warp_specialize=True)``
(Triton 3.6 ignores it on Hopper: same registers, same time), promoting the previous K group's
product while the next one runs on the tensor cores (241 registers, 3-15% slower). The same
overlap written in Gluon with explicitly asynchronous WGMMA (benchmarks/gluon_prefill.py) was
slower too, and showed the limit: 128x128 tiles reach at most cuBLAS's speed with no promotion at
all, and larger tiles do not fit an fp32 promotion in the register file.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP_SIZE
from .configs import SMALL_M_MAX, GemmConfig, launch_options, select_config
from .cublas_gemm import cublas_fp8_gemm, use_cublas_prequantized
from .gemm_common import promote, store_tile, weight_scale_ptrs
from .pdl import pdl_launch, use_pdl, wait_for_producer
from .splitk_gemm import SplitKConfig, sm_count, splitk_config, splitk_fp8_gemm

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the plain kernel serves every shape
    TensorDescriptor = None

__all__ = ["block_fp8_gemm"]

# Short K (up to PERSISTENT_MAX_K) with M >= PERSISTENT_MIN_M and 128x128-block or per-tensor
# weights runs the persistent TMA kernel with PERSISTENT_CONFIG (H100, see the module docstring;
# with row-wise scales or smaller tiles it was slower, up to 9x for row-wise at N=24576, K=1536).
PERSISTENT_MAX_K = 2304
PERSISTENT_MIN_M = 2048
PERSISTENT_CONFIG = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)


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
    GROUP_M: tl.constexpr, SCALE_GROUP_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)  # before any load or store (ops/pdl.py)
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows/cols read row 0 / col 0 (always valid) and are masked on store.
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_k[:, None]
    xs_ptrs = xs_ptr + safe_m * stride_xsm
    ws_ptrs = weight_scale_ptrs(ws_ptr, pid_n, safe_n, stride_wsn, BLOCK_N, WS_GROUP_N, W_SCALE_UNIFORM)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k_step * BLOCK_K
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        k_group = k_step // SCALE_GROUP_K  # BLOCK_K divides 128: several K steps share a scale
        x_s = tl.load(xs_ptrs + k_group)
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


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D K-contiguous FP8 tensor TMA can address: 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def _use_persistent(x_q: torch.Tensor, w_q: torch.Tensor, k: int) -> bool:
    if TensorDescriptor is None or k > PERSISTENT_MAX_K or torch.version.hip is not None:
        return False  # AMD has no TMA: the plain kernel serves MI300X
    if x_q.device.type == "cuda" and torch.cuda.get_device_capability(x_q.device)[0] < 9:
        return False  # TMA needs Hopper or newer
    return _tma_ok(x_q) and _tma_ok(w_q)


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

    With `allow_cublas` and no `config`, GEMMs cuBLAS blockwise takes and runs faster
    (:mod:`fp8linear.ops.cublas_gemm`; here M must also be a multiple of 4) go there.
    Without a `config`: GEMMs with M <= SMALL_M_MAX whose tiles leave SMs idle over a long K
    take the split-K kernel (:mod:`fp8linear.ops.splitk_gemm`); short-K GEMMs with M >= 2048 and
    uniform weight scales the persistent TMA kernel; everything else the tiled kernel with the
    tuned/heuristic config. `counters` (a :func:`~fp8linear.ops.splitk_gemm.splitk_workspace`)
    spares the split-K kernel its per-call counter memset.
    """
    m, k = x_q.shape
    n = w_q.shape[0]
    if config is None and use_cublas_prequantized(x_q, w_q, granularity, out_dtype, bias, allow_cublas):
        return cublas_fp8_gemm(x_q, x_s, w_q, w_s, granularity, bias)
    # Our kernels read x_s row-major. M-major scales (cuBLAS's layout) were measured 1.2-1.9x slower
    # in the tiled kernel (H100, 512x7168 M=1024: 37.1 vs 19.4 us; 18432x7168 M=4096: 1628 vs 1190):
    # likely because each K step's scale load then misses L1 (row-major, one line serves 32 K steps).
    x_s = x_s.contiguous()
    if config is None and m <= SMALL_M_MAX:
        config = splitk_config(m, n, k, x_q.device)
    if isinstance(config, SplitKConfig):
        return splitk_fp8_gemm(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, config, counters)
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    if granularity == "tensor":
        ws_group_n, stride_wsn, stride_wsk = 1, 0, 0
    else:
        ws_group_n = GROUP_SIZE if granularity == "block" else 1
        stride_wsn, stride_wsk = w_s.stride(0), w_s.stride(1)
    persistent = config is None and m >= PERSISTENT_MIN_M and granularity != "row" and _use_persistent(x_q, w_q, k)
    cfg = PERSISTENT_CONFIG if persistent else (config or select_config(x_q.device, m, n, k, granularity))
    # The weight scale is one value per K group across a tile for per-tensor weights, and for
    # 128x128 blocks when a tile never straddles two 128-row blocks.
    uniform = granularity == "tensor" or (granularity == "block" and GROUP_SIZE % cfg.block_n == 0)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if persistent:
        programs = min(tiles, sm_count(x_q.device))
        _block_fp8_gemm_persistent_kernel[(programs,)](
            TensorDescriptor.from_tensor(x_q, [cfg.block_m, cfg.block_k]), x_s,
            TensorDescriptor.from_tensor(w_q, [cfg.block_n, cfg.block_k]), w_s, y, bias if bias is not None else y,
            m, n, k,
            x_s.stride(0), stride_wsn, stride_wsk, y.stride(0),
            WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform, HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, SCALE_GROUP_K=GROUP_SIZE // cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return y
    grid = (tiles,)
    pdl = use_pdl(x_q.device, m)
    _block_fp8_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, y, bias if bias is not None else y,
        m, n, k,
        x_q.stride(0), x_s.stride(0), w_q.stride(0), stride_wsn, stride_wsk, y.stride(0),
        WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SCALE_GROUP_K=GROUP_SIZE // cfg.block_k, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl), **launch_options(cfg),
    )
    return y
