"""The one router: which kernel runs a GEMM-shaped FP8 call, with which launch configuration.

Every choice between kernels is made here and nowhere else:

- ``gemv``: one token and a weight below FUSED_GEMV_MAX_WEIGHT elements, activations not yet
  quantized -> the fused quantize + GEMV kernel (:mod:`fp8linear.ops.fused_gemv`), one launch;
- ``cublas``: on Hopper under backend "auto", prefill-sized GEMMs cuBLAS blockwise FP8 computes
  correctly and faster (:mod:`fp8linear.ops.cublas_gemm`); eager callers only from
  EAGER_CUBLAS_MIN_MNK, below which ``torch._scaled_mm``'s host cost exceeds the GPU time saved;
- ``decode``: asked for by eager callers only (``eager=True``: ``Fp8BlockLinear``'s plans
  outside CUDA-graph capture), 2 to SMALL_M_MAX tokens, a weight below ONE_LAUNCH_MAX_WEIGHT
  elements, NVIDIA GPUs (and the CPU interpreter) -> activation quantization and the split-K GEMM
  in one launch (:mod:`fp8linear.ops.fused_decode`);
- ``splitk``: M <= SMALL_M_MAX with long K and too few output tiles to fill the GPU
  (:mod:`fp8linear.ops.splitk_gemm`), on quantized activations or with PDL;
- ``persistent``: short K (<= PERSISTENT_MAX_K), M >= PERSISTENT_MIN_M, uniform weight scales, TMA-addressable
  operands, NVIDIA Hopper or newer (the persistent TMA kernel of :mod:`fp8linear.ops.gemm`);
- ``tiled``: everything else, with the tuned table entry for this GPU or the heuristic
  (:func:`fp8linear.ops.configs.select_config`).

Programmatic dependent launch (``FP8LINEAR_PDL=1``, :mod:`fp8linear.ops.pdl`) is decided here too.
A :class:`Route` is a plain value: callers that run the same shape again (``Fp8BlockLinear``
keeps one per input shape) decide once and reuse it, so no environment variable is read and no
device is queried on their forward path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend import interpreting
from ..formats import GROUP_SIZE
from .config_tables import select_config
from .configs import SMALL_M_MAX, GemmConfig
from .cublas_gemm import CUBLAS_ROW_ALIGN, cublas_device_ok, cublas_shape_ok
from .fused_gemv import GemvConfig, gemv_config, use_fused_gemv
from .pdl import use_pdl
from .splitk_gemm import SplitKConfig, splitk_config

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the tiled kernel serves every shape
    TensorDescriptor = None

__all__ = [
    "KERNELS",
    "EAGER_CUBLAS_MIN_MNK",
    "LONG_SPLITK_K",
    "ONE_LAUNCH_MAX_WEIGHT",
    "PERSISTENT_CONFIG",
    "PERSISTENT_MAX_K",
    "PERSISTENT_MIN_M",
    "Route",
    "route_gemm",
    "route_linear",
    "tma_ok",
    "use_persistent",
]

KERNELS = ("gemv", "decode", "cublas", "splitk", "persistent", "tiled")

# Short K (up to PERSISTENT_MAX_K) with M >= PERSISTENT_MIN_M and 128x128-block or per-tensor
# weights runs the persistent TMA kernel (H100, M=4096: K=512 211 vs 304 us, K=1536 413 vs 437 us
# against the tiled kernel; at K >= 7168 it was 2-4% slower; with row-wise scales or smaller tiles
# it was slower, up to 9x for row-wise at N=24576, K=1536).
PERSISTENT_MAX_K = 2304
PERSISTENT_MIN_M = 2048
PERSISTENT_CONFIG = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
# Split-K GEMMs with a longer K get no early release under PDL: measured at K=16384 and 18432
# (slower with it) and K=7168 (faster); the cut is between.
LONG_SPLITK_K = 8192
# The one-launch decode kernel runs, eagerly, weights below this many elements. H100, interleaved
# A/B against act_quant + GEMM (benchmarks/decode_ab.py, DeepSeek-V3 shapes, M 2/8/64): eager wall
# time per call 0.82-0.90x up to 24576x1536 (38M elements), where the host sets the pace; on
# 117-132M-element weights the GPU does, and there the kernel's in-launch wait costs more than a
# launch (18432x7168 M=8: 113 vs 65 us). Under CUDA graphs it is slower everywhere (GPU time 1.48x
# geometric mean: its GEMM programs wait for the quantized x instead of streaming weights), so graphs
# and torch.compile get the two launches.
ONE_LAUNCH_MAX_WEIGHT = 48 * 2**20
# Eager callers send GEMMs to cuBLAS blockwise only from this M*N*K up. A plan's `torch._scaled_mm`
# call costs 45-90 us of host time (H100 host, torch 2.11), more than our directly launched kernels;
# below the cut the GEMM finishes before the host does. H100, benchmarks/eager_cublas_ab.py (eager
# wall time, plans on our kernels / plans on cuBLAS, one run): 0.57-0.87 at M*N*K 0.2e10-1.55e10
# (2112x7168 M=1024 0.87, 7168x2048 M=1024 0.57), 1.11 at 7168x18432 M=128 (1.69e10), and
# 1.10-2.27 from 2.2e10 up; one case is lost by the cut: 24576x1536 M=512 (1.93e10), 0.84.
EAGER_CUBLAS_MIN_MNK = 16 * 10**9
# TMA wants 16-byte aligned bases and row strides.
_TMA_ALIGN = 16


@dataclass(frozen=True)
class Route:
    """What runs one GEMM: the kernel (one of KERNELS), its launch config, and PDL flags.

    ``pdl``: the GEMM is launched with programmatic dependent launch; ``release_early``: the
    activation quantization before it lets it be scheduled early (:mod:`fp8linear.ops.pdl`).
    """

    kernel: str
    config: GemmConfig | SplitKConfig | GemvConfig | None = None
    pdl: bool = False
    release_early: bool = False


def tma_ok(t: torch.Tensor) -> bool:
    """A 2-D K-contiguous FP8 tensor TMA can address: 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and t.stride(0) % _TMA_ALIGN == 0 and t.data_ptr() % _TMA_ALIGN == 0


def use_persistent(device: torch.device, m: int, k: int, granularity: str, operands_tma_ok: bool) -> bool:
    """Whether the persistent TMA kernel runs this GEMM (see PERSISTENT_MAX_K); never on AMD (no TMA)."""
    if m < PERSISTENT_MIN_M or k > PERSISTENT_MAX_K or granularity == "row" or not operands_tma_ok:
        return False
    if torch.version.hip is not None or TensorDescriptor is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9  # TMA: Hopper or newer
    return interpreting()  # the CPU interpreter emulates TMA descriptors, so CI runs this kernel too


def _tiled_or_splitk(device: torch.device, m: int, n: int, k: int, granularity: str, operands_tma_ok: bool,
                     pdl: bool) -> Route:
    if m <= SMALL_M_MAX:
        split = splitk_config(m, n, k, device)
        if split is not None:
            return Route("splitk", split, pdl=pdl, release_early=pdl and k <= LONG_SPLITK_K)
    if use_persistent(device, m, k, granularity, operands_tma_ok):
        return Route("persistent", PERSISTENT_CONFIG)
    return Route("tiled", select_config(device, m, n, k, granularity), pdl=pdl, release_early=pdl)


def _decode_config(device: torch.device, m: int, n: int, k: int, granularity: str) -> SplitKConfig | None:
    """The one-launch decode kernel's tiles: split-K's where it splits, else the tiled kernel's tuned
    or heuristic tile as one split; None where that tile is not one the split-K program runs."""
    split = splitk_config(m, n, k, device)
    if split is not None:
        return split
    cfg = select_config(device, m, n, k, granularity)
    if cfg.block_k != GROUP_SIZE or cfg.block_m > GROUP_SIZE or cfg.block_n > GROUP_SIZE or cfg.num_warps > 8:
        return None
    return SplitKConfig(block_m=cfg.block_m, block_n=cfg.block_n, split_k=1, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def _one_launch_decode_ok(device: torch.device) -> bool:
    """Where the decode kernel's in-launch wait is safe: NVIDIA GPUs and the CPU interpreter
    (both run programs in increasing id order, see :mod:`fp8linear.ops.fused_decode`)."""
    if torch.version.hip is not None:
        return False
    return device.type == "cuda" or interpreting()


def route_linear(device: torch.device, m: int, n: int, k: int, granularity: str, fp8_dtype: torch.dtype,
                 out_dtype: torch.dtype, bias: torch.Tensor | None, allow_cublas: bool,
                 weight_tma_ok: bool, eager: bool = False) -> Route:
    """The route of a whole FP8 linear (x not yet quantized, output in x's dtype `out_dtype`).

    `weight_tma_ok`: :func:`tma_ok` of the weight (the quantized activations are made
    16-byte aligned, so they are TMA-addressable whenever K is a multiple of 16). `eager`: the
    caller launches eagerly (not in a CUDA graph or compiled region), where host time per call
    counts as much as GPU time (see ONE_LAUNCH_MAX_WEIGHT and EAGER_CUBLAS_MIN_MNK).
    """
    if use_fused_gemv(m, n, k):
        return Route("gemv", gemv_config(m, n, k))
    if (allow_cublas and not (eager and m * n * k < EAGER_CUBLAS_MIN_MNK)
            and cublas_shape_ok(m, n, k, granularity, fp8_dtype, out_dtype, bias) and cublas_device_ok(device)):
        return Route("cublas")
    pdl = use_pdl(device, m)
    if eager and 1 <= m <= SMALL_M_MAX and n * k < ONE_LAUNCH_MAX_WEIGHT and not pdl and _one_launch_decode_ok(device):
        cfg = _decode_config(device, m, n, k, granularity)
        if cfg is not None:
            return Route("decode", cfg)
    return _tiled_or_splitk(device, m, n, k, granularity, weight_tma_ok and k % _TMA_ALIGN == 0, pdl)


def route_gemm(device: torch.device, m: int, n: int, k: int, granularity: str, fp8_dtype: torch.dtype,
               out_dtype: torch.dtype, bias: torch.Tensor | None, allow_cublas: bool,
               operands_tma_ok: bool) -> Route:
    """The route of a GEMM on already quantized activations (no fused GEMV; cuBLAS only where M is
    a multiple of 4, since quantized rows cannot be padded here)."""
    if (allow_cublas and m % CUBLAS_ROW_ALIGN == 0 and cublas_shape_ok(m, n, k, granularity, fp8_dtype, out_dtype, bias)
            and cublas_device_ok(device)):
        return Route("cublas")
    return _tiled_or_splitk(device, m, n, k, granularity, operands_tma_ok, use_pdl(device, m))
