"""The one router: which kernel runs a GEMM-shaped FP8 call, with which launch configuration.

Every choice between kernels is made here and nowhere else:

- ``gemv``: one token and a weight below FUSED_GEMV_MAX_WEIGHT elements (eager callers on NVIDIA:
  EAGER_GEMV_MAX_WEIGHT), activations not yet quantized -> the fused quantize + GEMV kernel
  (:mod:`fp8linear.ops.fused_gemv`), one launch;
- ``cublas``: on Hopper under backend "auto", GEMMs cuBLAS blockwise FP8 computes correctly
  (:mod:`fp8linear.ops.cublas_gemm`) where it is the faster kernel: as this GPU's routes table
  measured (:mod:`fp8linear.ops.route_table`), else by the tile-count rules (CUBLAS_MIN_TILES_PER_SM;
  128x128 weights as 1x128 weights below CUBLAS_ROW_FORM_MAX_TILES_PER_SM);
  eager callers only from EAGER_CUBLAS_MIN_MNK, below which a cuBLAS call's host cost
  exceeds the GPU time saved;
- ``decode``: asked for by eager callers only (``eager=True``: ``Fp8BlockLinear``'s plans
  outside CUDA-graph capture), a weight below ONE_LAUNCH_MAX_WEIGHT elements, NVIDIA GPUs (and
  the CPU interpreter); 2 to SMALL_M_MAX tokens, or more up to ONE_LAUNCH_MAX_MNK multiply-adds
  where the GEMM would run on our split-K or tiled kernel (with that config) -> activation
  quantization and the split-K GEMM in one launch (:mod:`fp8linear.ops.fused_decode`);
- ``splitk``: too few output tiles to fill the GPU and K long enough to split
  (:mod:`fp8linear.ops.splitk_gemm`; decode rules up to SMALL_M_MAX rows, MID_SPLIT_TILE above);
- ``persistent``: short K (<= PERSISTENT_MAX_K), M >= PERSISTENT_MIN_M, uniform weight scales, TMA-addressable
  operands, NVIDIA Hopper or newer (the persistent TMA kernel of :mod:`fp8linear.ops.gemm`);
- ``tiled``: everything else, with the tuned table entry for this GPU or the heuristic
  (:func:`fp8linear.ops.config_tables.select_config`; MID_M_CONFIG where 128x128 tiles leave SMs idle).

Where this GPU has a routes table entry for the shape and a nearby M (measured by
``fp8linear tune-routes``), its kernel and config win over these rules.

Grouped MoE GEMMs (:mod:`fp8linear.ops.grouped_gemm`) take their tiles from
:func:`grouped_config`, by the average number of rows per expert, and their routing alignment
method (one Triton program or torch ops) from :func:`align_on_kernel`.

Programmatic dependent launch (``FP8LINEAR_PDL=1``, :mod:`fp8linear.ops.pdl`) is decided here too.
A :class:`Route` is a plain value: callers that run the same shape again (``Fp8BlockLinear``
keeps one per input shape) decide once and reuse it, so no environment variable is read and no
device is queried on their forward path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..backend import interpreting
from ..formats import GROUP_SIZE
from .config_tables import select_config
from .configs import SMALL_M_MAX, GemmConfig, amd_grouped_config_here
from .cublas_gemm import CublasConfig, cublas_accepts, cublas_device_ok
from .fused_gemv import GemvConfig, gemv_config, use_fused_gemv
from .pdl import use_pdl
from .route_table import lookup_route
from .splitk_gemm import SplitKConfig, counters_fit, sm_count, splitk_config

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the tiled kernel serves every shape
    TensorDescriptor = None

__all__ = [
    "ALIGN_KERNEL_MAX_WORK",
    "KERNELS",
    "EAGER_CUBLAS_MIN_MNK",
    "EAGER_GEMV_MAX_WEIGHT",
    "GROUPED_WIDE_TILE_MAX_ROWS",
    "grouped_config",
    "LONG_SPLITK_K",
    "ONE_LAUNCH_MAX_MNK",
    "ONE_LAUNCH_MAX_WEIGHT",
    "PERSISTENT_CONFIG",
    "PERSISTENT_MAX_K",
    "PERSISTENT_MIN_M",
    "CUBLAS_ANY_TILES_M",
    "CUBLAS_MIN_TILES_PER_SM",
    "CUBLAS_ROW_FORM_MAX_TILES_PER_SM",
    "MID_M_CONFIG",
    "MID_SPLIT_TILE",
    "Route",
    "align_on_kernel",
    "mid_splitk_config",
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
# Eager single tokens take the fused GEMV up to this weight size, past FUSED_GEMV_MAX_WEIGHT (where
# under CUDA graphs it and the split-K kernels tie, 18.5 us at 24576x1536 on H100): eagerly the
# GEMV's plan launches one kernel with one allocation, the one-launch decode kernel's two
# allocations and a counters argument (planned host time 14.5 against 38.5 us, H100).
EAGER_GEMV_MAX_WEIGHT = ONE_LAUNCH_MAX_WEIGHT
# Eager callers take the one-launch kernel above SMALL_M_MAX rows too, up to this M*N*K, where the
# route would be our split-K or tiled kernel (its config run in one launch): there the host sets
# the pace (two launches and two allocations: 35-41 us of host time, H100), and the kernel's
# in-launch wait (1.2-2.3x the two launches' GPU time above decode sizes) stays below it. H100,
# benchmarks/decode_ab.py, nine DeepSeek-V3 shapes x M 96/200/333/512, eager wall time one / two
# launches: 0.70-0.88 in every case up to 4e9 (e.g. 7168x2048 M=200 32.6 vs 46.3 us), 0.82-1.47
# above it (24576x1536 M=333 77.9 vs 53.0, 2048x7168 M=512 55.0 vs 47.3).
ONE_LAUNCH_MAX_MNK = 4 * 10**9
# Eager callers send GEMMs to cuBLAS blockwise only from this M*N*K up. A plan's cuBLAS call
# (act_quant, then cuBLASLt called directly: fp8linear.ops.cublaslt) costs 35-50 us of host time
# (H100 host, torch 2.11), more than our directly launched kernels; below the cut the GEMM finishes
# before the host does. H100, benchmarks/eager_cublas_ab.py (eager wall time, plans on our kernels /
# plans on cuBLAS, one run): 0.50-0.86 up to 9.7e9 (7168x2048 and 2112x7168 at M=512, 24576x1536 at
# M=256), 0.78 at 1536x7168 M=1024 (1.13e10), 1.01 at 7168x2048 M=1024 (1.50e10), 1.43 at 2112x7168
# M=1024 (1.55e10) and 1.19-1.99 from 1.7e10 up.
EAGER_CUBLAS_MIN_MNK = 12 * 10**9
# Shapes in no routes table (the heuristic): above SMALL_M_MAX rows cuBLAS blockwise runs once its
# 128x128 tiles give a quarter of a tile per SM, or from 1024 rows on; below that our kernels do.
# Fitted on an H100 sweep of every kernel (fp8linear tune-routes, the 31 shapes of `bench --grid`,
# M 1-4096): this rule's choice took 1.07x the time of the fastest kernel (geometric mean of 341
# cases); 0.5 tiles per SM gave 1.10x, 0.75 1.12x, and cuBLAS from M=128 on weights of 8M+
# elements 1.24x.
CUBLAS_MIN_TILES_PER_SM = 0.25
CUBLAS_ANY_TILES_M = 1024
# Below this many 128x128 output tiles per SM, 128x128 weights go to cuBLAS as 1x128 weights
# (CublasConfig(row_scales=True)) above SMALL_M_MAX rows: cuBLAS's 1x128-scaled kernels beat its
# 128x128 ones and ours there. H100, CUDA graphs, benchmarks/cublaslt_probe.py --padded-grid, 11
# shapes x M 4-2048, scales held: 1x128 / 128x128 time 0.47-1.01 below 66 tiles (one exception:
# 576x1536 M=1024, 1.21), 1.12-1.69 from 84 tiles up; against our kernels at M 128-512 0.68-1.02.
CUBLAS_ROW_FORM_MAX_TILES_PER_SM = 0.5
_ROW_FORM = CublasConfig(row_scales=True)
# Above SMALL_M_MAX rows, split-K with 64x64 tiles where they do not fill the SMs (one program per
# SM; in that sweep 1 program per SM beat 2), and the tiled kernel with 64x64 tiles where 128x128
# tiles leave SMs idle (N=576, K=1536, M=512: 6.3 vs 7.8 us for 128x128).
MID_SPLIT_TILE = (64, 64)
MID_M_CONFIG = GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
# TMA wants 16-byte aligned bases and row strides.
_TMA_ALIGN = 16


@dataclass(frozen=True)
class Route:
    """What runs one GEMM: the kernel (one of KERNELS), its launch config (cuBLAS: its workspace
    limit, None for the default), and PDL flags.

    ``pdl``: the GEMM is launched with programmatic dependent launch; ``release_early``: the
    activation quantization before it lets it be scheduled early (:mod:`fp8linear.ops.pdl`).
    """

    kernel: str
    config: GemmConfig | SplitKConfig | GemvConfig | CublasConfig | None = None
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


def _ours(device: torch.device, m: int, n: int, k: int, granularity: str, operands_tma_ok: bool, pdl: bool) -> Route:
    """Our kernel for this GEMM without a table entry: split-K where the output tiles leave SMs idle
    (decode rules of :func:`splitk_config`, or MID_SPLIT_TILE tiles above SMALL_M_MAX on NVIDIA),
    else the persistent TMA kernel or the tiled kernel (MID_M_CONFIG where 128x128 tiles leave
    SMs idle, on NVIDIA)."""
    # The rules above SMALL_M_MAX rows were measured on NVIDIA GPUs; ROCm keeps its tables' and
    # heuristic's tiles there (docs/amd.md).
    mid_rules = m > SMALL_M_MAX and torch.version.hip is None
    split = splitk_config(m, n, k, device) if m <= SMALL_M_MAX else (
        mid_splitk_config(m, n, k, device) if mid_rules else None)
    if split is not None:
        return Route("splitk", split, pdl=pdl, release_early=pdl and k <= LONG_SPLITK_K)
    if use_persistent(device, m, k, granularity, operands_tma_ok):
        return Route("persistent", PERSISTENT_CONFIG)
    if mid_rules and _tiles(m, n, GROUP_SIZE, GROUP_SIZE) < sm_count(device):
        return Route("tiled", MID_M_CONFIG, pdl=pdl, release_early=pdl)
    return Route("tiled", select_config(device, m, n, k, granularity), pdl=pdl, release_early=pdl)


def _tiles(m: int, n: int, block_m: int, block_n: int) -> int:
    return -(-m // block_m) * -(-n // block_n)


def mid_splitk_config(m: int, n: int, k: int, device: torch.device) -> SplitKConfig | None:
    """Split-K above SMALL_M_MAX rows: MID_SPLIT_TILE tiles, enough splits for one program per SM,
    each at least 2 K groups; None where the tiles already fill the GPU or K is too short."""
    bm, bn = MID_SPLIT_TILE
    tiles = _tiles(m, n, bm, bn)
    groups = -(-k // GROUP_SIZE)
    split = min(-(-sm_count(device) // tiles), groups // 2)
    if split < 2:
        return None
    split = -(-groups // -(-groups // split))  # no empty splits
    return SplitKConfig(block_m=bm, block_n=bn, split_k=split, num_warps=4, num_stages=4)


def _heuristic(device: torch.device, m: int, n: int, k: int, granularity: str, cublas_ok: bool,
               operands_tma_ok: bool, pdl: bool) -> Route:
    """Shapes without a table entry: above SMALL_M_MAX rows, cuBLAS with 128x128 weights as 1x128
    weights below CUBLAS_ROW_FORM_MAX_TILES_PER_SM 128x128 tiles per SM, and cuBLAS once the tiles
    give CUBLAS_MIN_TILES_PER_SM per SM; else our split-K where it applies; else cuBLAS from
    CUBLAS_ANY_TILES_M rows; else our persistent or tiled kernel."""
    if cublas_ok and m > SMALL_M_MAX:
        tiles = _tiles(m, n, 128, 128)
        if granularity == "block" and tiles < CUBLAS_ROW_FORM_MAX_TILES_PER_SM * sm_count(device):
            return Route("cublas", _ROW_FORM)
        if tiles >= CUBLAS_MIN_TILES_PER_SM * sm_count(device):
            return Route("cublas")
    route = _ours(device, m, n, k, granularity, operands_tma_ok, pdl)
    if route.kernel != "splitk" and cublas_ok and m >= CUBLAS_ANY_TILES_M:
        return Route("cublas")
    return route


def _choose(device: torch.device, m: int, n: int, k: int, granularity: str, cublas_ok: bool, operands_tma_ok: bool,
            pdl: bool) -> Route:
    """The measured choice where this GPU's table has one (:mod:`fp8linear.ops.route_table`), else the heuristic."""
    entry = lookup_route(device, m, n, k, granularity)
    if entry is None:
        return _heuristic(device, m, n, k, granularity, cublas_ok, operands_tma_ok, pdl)
    if entry.kernel == "cublas" and cublas_ok:
        return Route("cublas", entry.config)
    if entry.kernel == "splitk":
        return Route("splitk", entry.config, pdl=pdl, release_early=pdl and k <= LONG_SPLITK_K)
    if entry.kernel == "tiled":
        return Route("tiled", entry.config, pdl=pdl, release_early=pdl)
    return _ours(device, m, n, k, granularity, operands_tma_ok, pdl)  # cuBLAS measured fastest but not allowed here


def _decode_config(device: torch.device, m: int, n: int, k: int, granularity: str) -> SplitKConfig | None:
    """The one-launch decode kernel's tiles: split-K's where it splits, else the tiled kernel's tuned
    or heuristic tile as one split; None where that tile is not one the split-K program runs."""
    split = splitk_config(m, n, k, device)
    if split is not None:
        return split
    return _one_split(select_config(device, m, n, k, granularity))


def _one_split(cfg: GemmConfig) -> SplitKConfig | None:
    """A tiled config as the split-K program's single split, where that program runs its tile."""
    if cfg.block_k != GROUP_SIZE or cfg.block_m > GROUP_SIZE or cfg.block_n > GROUP_SIZE or cfg.num_warps > 8:
        return None
    return SplitKConfig(block_m=cfg.block_m, block_n=cfg.block_n, split_k=1, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def _eager_gemv(m: int, n: int, k: int) -> bool:
    """Whether an eager call takes the fused GEMV past FUSED_GEMV_MAX_WEIGHT (EAGER_GEMV_MAX_WEIGHT;
    measured on NVIDIA only)."""
    return m == 1 and n * k < EAGER_GEMV_MAX_WEIGHT and torch.version.hip is None


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
    if use_fused_gemv(m, n, k) or (eager and _eager_gemv(m, n, k)):
        return Route("gemv", gemv_config(m, n, k))
    cublas_ok = (allow_cublas and not (eager and m * n * k < EAGER_CUBLAS_MIN_MNK)
                 and cublas_accepts(n, k, granularity, fp8_dtype, out_dtype, bias) and cublas_device_ok(device))
    pdl = use_pdl(device, m)
    one_launch = eager and n * k < ONE_LAUNCH_MAX_WEIGHT and not pdl and _one_launch_decode_ok(device)
    if one_launch and 1 <= m <= SMALL_M_MAX:
        cfg = _decode_config(device, m, n, k, granularity)
        if cfg is not None:
            return Route("decode", cfg)
    route = _choose(device, m, n, k, granularity, cublas_ok, weight_tma_ok and k % _TMA_ALIGN == 0, pdl)
    if one_launch and m > SMALL_M_MAX and m * n * k <= ONE_LAUNCH_MAX_MNK and route.kernel in ("splitk", "tiled"):
        cfg = route.config if route.kernel == "splitk" else _one_split(route.config)
        if cfg is not None and counters_fit(m, n, cfg):
            return Route("decode", cfg)
    return route


def route_gemm(device: torch.device, m: int, n: int, k: int, granularity: str, fp8_dtype: torch.dtype,
               out_dtype: torch.dtype, bias: torch.Tensor | None, allow_cublas: bool,
               operands_tma_ok: bool) -> Route:
    """The route of a GEMM on already quantized activations (no fused GEMV; where cuBLAS runs an M
    that is not a multiple of 4, :func:`~fp8linear.ops.cublas_gemm.cublas_fp8_gemm` pads a copy)."""
    cublas_ok = (allow_cublas and cublas_accepts(n, k, granularity, fp8_dtype, out_dtype, bias)
                 and cublas_device_ok(device))
    return _choose(device, m, n, k, granularity, cublas_ok, operands_tma_ok, use_pdl(device, m))


# The routing is aligned by one single-program Triton kernel (one launch: what decode needs) while
# pairs x histogram bins (the next power of two above the expert count) stay within this; above it
# by ~20 device-side torch ops, whose launch cost is noise next to the GEMMs while one program
# would serialise the work. H100, Qwen3-MoE widths (128 experts, 256 bins), CUDA graphs, the whole
# experts module: 298 us at 512 pairs, 358 us at 1024, 484 us at 2048 and 700 us at 4096 on the
# kernel; 355 us at 2048 and 382 us at 4096 pairs on the torch ops.
ALIGN_KERNEL_MAX_WORK = 512 * 256


def align_on_kernel(num_pairs: int, num_experts: int) -> bool:
    """Whether :func:`fp8linear.ops.grouped_gemm.moe_align_block_size` aligns `num_pairs` pairs over `num_experts` experts with
    its one-launch kernel (else with torch ops), see ALIGN_KERNEL_MAX_WORK."""
    return 0 < num_pairs and num_pairs * triton.next_power_of_2(num_experts + 1) <= ALIGN_KERNEL_MAX_WORK


# Average rows per expert up to which the grouped GEMM uses 64x128 tiles (see grouped_config).
GROUPED_WIDE_TILE_MAX_ROWS = 384


def grouped_config(num_pairs: int, num_experts: int, n: int, k: int) -> GemmConfig:
    """Tile config from the average number of rows per expert (a static, host-known quantity).

    H100 sweeps (`benchmarks/bench_moe.py --sweep`, CUDA graphs): 64x128 tiles, 4 warps, 4 stages
    were best from 48 to 384 rows per expert. H=2048, I=1408, 64 experts, top-6: 2,048 tokens (192
    rows/expert) gate_up 347 vs 395 us and down 206 vs 255 us for 128x128 / 8 warps; 4,096 tokens
    (384) 559 vs 596 and 314 vs 364 us. H=7168, I=2048, 32 experts, top-8: 1,024 tokens (256) gate_up
    922 us, best; 2,048 tokens (512 rows/expert) 128x128 / 8 warps won, gate_up 1479 vs 1759 us and
    down 845 vs 851 us, and at 4,096 tokens (1,024). So above 384 rows the dense prefill tile takes over.
    """
    amd = amd_grouped_config_here(num_pairs, num_experts)  # AMD tiles and options on ROCm
    if amd is not None:
        return amd
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:  # decode: each block is ~one expert's few rows; stream W with the smallest M tile
        return GemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if rows_per_expert <= GROUPED_WIDE_TILE_MAX_ROWS:  # little padding per expert, one warpgroup per tile
        return GemmConfig(block_m=64, block_n=128, block_k=128, group_m=4, num_warps=4, num_stages=4)
    return GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
