"""The one router: which backend, kernel and launch configuration run a GEMM-shaped FP8 call.

Every choice between implementations is made here and nowhere else; every other module of
:mod:`fp8linear.ops` is a kernel with its launcher (which takes the config it is given), or a
caller of this module. The router imports without Triton (CPU-only installs route too).

Backend (:func:`resolve_backend`, :func:`cpu_fast_path`, :func:`cublas_allowed`): "auto" runs our
Triton kernels on CUDA/ROCm tensors (and cuBLAS blockwise, or CUTLASS's kernels where built, where
they are faster), the compiled CPU
path for a whole linear on CPU tensors and the reference elsewhere; "triton" and "reference" force one.

CPU tensors (:mod:`fp8linear.ops.cpu_linear`): the compiled kernels of :mod:`fp8linear.ops.cpu_native`
up to CPU_NATIVE_MAX_M rows (:func:`use_cpu_native`), their weight rows split over the intra-op
threads by :func:`cpu_row_parts`; above, the torch-ops path, whose single-token bf16 calls take
float16 tiles (:func:`use_cpu_half_gemv`). How that path tiles its weight decode (tile sizes, the
order of its GEMMs) is the formulation of one implementation, kept with it.

GPU, a whole linear (:func:`route_linear`) or a GEMM on quantized activations (:func:`route_gemm`):

- ``gemv``: one token and a weight below FUSED_GEMV_MAX_WEIGHT elements (eager callers on NVIDIA:
  EAGER_GEMV_MAX_WEIGHT), activations not yet quantized -> the fused quantize + GEMV kernel
  (:mod:`fp8linear.ops.fused_gemv`, config :func:`gemv_config`), one launch;
- ``cublas``: on Hopper under backend "auto", GEMMs cuBLAS blockwise FP8 computes correctly
  (:mod:`fp8linear.ops.cublas_gemm`) where it is the faster kernel: as this GPU's routes table
  measured (:mod:`fp8linear.ops.route_table`), else by the tile-count rules (CUBLAS_MIN_TILES_PER_SM;
  128x128 weights as 1x128 weights, and row-wise weights, below CUBLAS_ROW_FORM_MAX_TILES_PER_SM);
  eager callers only from EAGER_CUBLAS_MIN_MNK, below which a cuBLAS call's host cost
  exceeds the GPU time saved;
- ``cutlass``: on Hopper under backend "auto", where this GPU's routes table measured CUTLASS's
  warp-specialized blockwise kernel fastest and its library is built
  (:mod:`fp8linear.ops.cutlass_gemm`; else the entry's fallback, the kernel measured next);
  eager callers from EAGER_CUTLASS_MIN_MNK, where above SMALL_M_MAX rows it also runs in place of
  our tiled kernel when no table entry chose that kernel (:func:`eager_cutlass_config`), and in
  place of cuBLAS where its tiles fill their waves (:func:`eager_cutlass_over_cublas`); below that
  cut, from EAGER_ONE_CALL_MIN_M rows and on weights below EAGER_ONE_CALL_MAX_WEIGHT elements,
  wherever the whole eager call is one host call (the library quantizes, the plan-call module
  allocates): :func:`eager_cutlass_config`'s kernel. Where the library quantizes the input, both
  rules launch the library call's two kernels with PDL on weights below
  EAGER_CUTLASS_PDL_MAX_WEIGHT elements, unless ``FP8LINEAR_PDL=0``;
- ``decode``: asked for by eager callers only (``eager=True``: ``Fp8BlockLinear``'s plans
  outside CUDA-graph capture) where the one-call CUTLASS rule above does not apply (CUTLASS or
  its plan-call module not built, another GPU), a weight below
  ONE_LAUNCH_MAX_WEIGHT elements, NVIDIA GPUs (and
  the CPU interpreter); 2 to SMALL_M_MAX tokens, or more up to ONE_LAUNCH_MAX_MNK multiply-adds
  where the GEMM would run on our split-K or tiled kernel (with that config) -> activation
  quantization and the split-K GEMM in one launch (:mod:`fp8linear.ops.fused_decode`);
- ``splitk``: too few output tiles to fill the GPU and K long enough to split (16 groups of 128 on
  NVIDIA where a quarter of the SMs would idle, else 32)
  (:mod:`fp8linear.ops.splitk_gemm`; :func:`splitk_config` up to SMALL_M_MAX rows,
  :func:`mid_splitk_config` above);
- ``persistent``: short K (<= PERSISTENT_MAX_K), M >= PERSISTENT_MIN_M, uniform weight scales, TMA-addressable
  operands, NVIDIA Hopper or newer (the persistent TMA kernel of :mod:`fp8linear.ops.gemm`);
- ``ws``: on Hopper, where the route would be our tiled or persistent kernel, on 128x128 weights,
  from WS_MIN_M rows filling at least WS_MIN_ROW_FILL of their 128-row tiles, K >= WS_MIN_K and
  WS_MIN_TILES_PER_SM 128x128 tiles per SM, with contiguous TMA-addressable operands and no PDL,
  for callers other than eager plans (CUDA graphs, torch.compile, the functional ops); and where a
  routes table names it: the warp-specialized Gluon kernel (:mod:`fp8linear.ops.ws_gemm`,
  WS_CONFIG: persistent; the tiled kernel's bits but where it splits a last wave of long-K tiles
  along K, whose tiles it sums in split order; :func:`ws_config`: 128x192 or 128x256 tiles (the
  latter at long K) where they take fewer waves, each wave weighed by its tiles' cost);
- ``tiled``: everything else, with the tuned table entry for this GPU or the heuristic
  (:func:`select_config`: :func:`heuristic_config` on NVIDIA, :func:`amd_heuristic_config` on ROCm;
  MID_M_CONFIG where 128x128 tiles leave SMs idle).

Where this GPU has a routes table entry for the shape and a nearby M (measured by
``fp8linear tune-routes``), its kernel and config win over these rules.

The activation quantization before a GEMM (:mod:`fp8linear.ops.quant`) takes its rows per program
from :func:`act_quant_launch`.

Grouped MoE GEMMs (:mod:`fp8linear.ops.grouped_gemm`) take their tiles from
:func:`grouped_config`, by the average number of rows per expert, and their routing alignment
method (one Triton program or torch ops) from :func:`align_on_kernel`.

Programmatic dependent launch is decided here too: for the Triton decode kernels (:func:`use_pdl`,
off unless ``FP8LINEAR_PDL=1``) and for eager CUTLASS plans whose library call quantizes the input
(on by default, EAGER_CUTLASS_PDL_MAX_WEIGHT).
A :class:`Route` is a plain value: callers that run the same shape again (``Fp8BlockLinear``
keeps one per input shape) decide once and reuse it, so no environment variable is read and no
device is queried on their forward path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..backend import BACKEND_ENV, BACKENDS, HAS_TRITON, has_gdc, interpreting
from ..formats import GROUP_SIZE
from .config_tables import device_name, lookup_config
from .configs import (AMD_CU_COUNT, DEFAULT_CU_COUNT, GemmConfig, GemvConfig, SplitKConfig, amd_gemm_config,
                      device_arch, is_amd_arch, sm_count)
from .cpu_native import GEMV_MAX_M as CPU_GEMV_MAX_M
from .cublas_gemm import CublasConfig, cublas_accepts, cublas_device_ok
from .cutlass_gemm import (CUTLASS_TILE_N, CutlassConfig, cutlass_accepts, cutlass_available, one_call_available,
                           pdl_supported)
from .route_table import OPTIONAL_KERNELS, lookup_route
from .ws_gemm import WsConfig, ws_device_ok

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - no Triton, or an older one: the tiled kernel serves every shape
    TensorDescriptor = None

__all__ = [
    "ACT_QUANT_SMALL_INPUT_ELEMENTS",
    "ALIGN_KERNEL_MAX_WORK",
    "CPU_HALF_GEMV",
    "CPU_EXPERTS_NATIVE_MAX_M",
    "CPU_HALF_GEMV_MIN_ELEMS",
    "CPU_NATIVE_MAX_M",
    "CPU_THREAD_MIN_ELEMS",
    "CUBLAS_ANY_TILES_M",
    "CUBLAS_MIN_TILES_PER_SM",
    "CUBLAS_ROW_FORM_MAX_TILES_PER_SM",
    "EAGER_CUBLAS_MIN_MNK",
    "EAGER_CUTLASS_MIN_MNK",
    "EAGER_CUTLASS_PDL_MAX_WEIGHT",
    "EAGER_ONE_CALL_MAX_WEIGHT",
    "EAGER_ONE_CALL_MIN_M",
    "EAGER_CUTLASS_MIN_WAVE_FILL",
    "EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK",
    "EAGER_GEMV_MAX_WEIGHT",
    "FUSED_GEMV_MAX_WEIGHT",
    "GROUPED_WIDE_TILE_MAX_ROWS",
    "KERNELS",
    "LIB_QUANT_MAX_ELEMENTS",
    "LONG_SPLITK_K",
    "MID_M_CONFIG",
    "MID_SPLIT_TILE",
    "NARROW_TILE_N",
    "N_MAJOR_SCALE_MIN_M",
    "N_MAJOR_SCALE_WS_MIN_K",
    "ONE_LAUNCH_MAX_MNK",
    "ONE_LAUNCH_MAX_WEIGHT",
    "PDL_ENV",
    "PERSISTENT_CONFIG",
    "PERSISTENT_MAX_K",
    "PERSISTENT_MIN_M",
    "SMALL_M_MAX",
    "WS_CONFIG",
    "WS_MIN_K",
    "WS_MIN_M",
    "WS_MIN_ROW_FILL",
    "WS_MIN_TILES_PER_SM",
    "WS_CONFIGS_BY_WIDTH",
    "WS_MID_CONFIG",
    "WS_MID_TILE_COST",
    "WS_WIDE_CONFIG",
    "WS_WIDE_MIN_K",
    "WS_WIDE_TILE_COST",
    "Route",
    "act_quant_launch",
    "align_on_kernel",
    "amd_grouped_config",
    "amd_heuristic_config",
    "config_for_arch",
    "counters_fit",
    "cpu_experts_in_parallel",
    "cpu_fast_path",
    "cpu_row_parts",
    "cublas_allowed",
    "decode_tile_counters",
    "dense_scale",
    "eager_cutlass_config",
    "eager_cutlass_over_cublas",
    "gemv_config",
    "grouped_config",
    "heuristic_config",
    "mid_splitk_config",
    "moe_align_num_warps",
    "resolve_backend",
    "route_gemm",
    "route_linear",
    "select_config",
    "splitk_config",
    "splitk_num_stages",
    "tma_ok",
    "use_cpu_half_gemv",
    "use_cpu_native",
    "use_fused_gemv",
    "use_library_quantization",
    "use_n_major_scales",
    "use_pdl",
    "use_persistent",
    "ws_config",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- backend
def _requested(backend: str | None) -> str:
    return (backend or os.environ.get(BACKEND_ENV) or "auto").lower()


def cpu_fast_path(backend: str | None, device: torch.device) -> bool:
    """Whether an FP8 linear on `device` runs :func:`fp8linear.ops.cpu_linear.cpu_fp8_linear` (CPU tensors
    under 'auto': the same quantized values as the reference, tile-wise weight decode, fp32 GEMMs)
    rather than the reference (forced with backend 'reference')."""
    return device.type == "cpu" and _requested(backend) == "auto"


def cublas_allowed(backend: str | None) -> bool:
    """Whether GEMMs may go to a vendor library (cuBLAS blockwise FP8, CUTLASS's kernels) where it is
    faster: under 'auto' only."""
    return _requested(backend) == "auto"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return 'triton' or 'reference' for tensors on `device`; clear error if a forced backend cannot run."""
    requested = _requested(backend)
    if requested not in BACKENDS:
        source = "backend argument" if backend else BACKEND_ENV
        raise ValueError(f"{source} must be one of {BACKENDS}, got {requested!r}")
    if requested == "reference":
        return "reference"
    if requested == "auto":
        return "triton" if HAS_TRITON and device.type == "cuda" else "reference"
    if not HAS_TRITON:
        raise RuntimeError("backend 'triton' was requested but Triton is not installed (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"backend 'triton' needs CUDA/ROCm tensors, got tensors on {device}; "
            "set TRITON_INTERPRET=1 to run the Triton kernels on CPU (slow), or use backend='reference'"
        )
    return "triton"


# ----------------------------------------------------------------------------- CPU tensors
# Rows of activations the compiled CPU kernels run (cpu_fp8_linear hands them up to this many; torch
# ops above). 2 threads, Zen 3 (AVX2), blocked kernel / torch ops: 0.24-0.64 at M 5-14 (2048x7168 M=8
# 4.0 against 12.0 ms, BF16 10.9), 0.60-1.20 at 16, 1.11 at 32.
CPU_NATIVE_MAX_M = 12
# MoE experts on CPU tensors run their hit experts side by side (cpu_experts_in_parallel), each expert's
# linears as one compiled-kernel call on one thread, while no hit expert has more rows than this. A
# row split hands work to a Python worker thread per linear (40-100 us, CPU_THREAD_MIN_ELEMS), and the
# torch-ops path pays its per-tile ops per expert; whole experts need one hand-off per call. 2 threads,
# Xeon with AVX-512 BF16, Qwen3-30B-A3B widths (top-8 of 32 experts; benchmarks/cpu_moe.py), ms per
# call, side by side / one by one: 1 token 6.5 / 10.0 (BF16 8.5), 8 tokens 33.4 / 51.7 (38.1); most
# rows per expert 14 / 24 / 40 / 76 / 152: 45 / 84 / 139 / 186 / 382 against 83 / 137 / 530 / 220 /
# 572 one by one (BF16 42 / 106 / 142 / 196 / 413); at 278 rows the torch-ops path won (518 against
# 831, BF16 670).
CPU_EXPERTS_NATIVE_MAX_M = 192
# Weights of at least this much work split their rows over the intra-op threads (work: weight
# elements, times M above the GEMV's rows): a hand-off to a Python worker thread costs 40-100 us
# here. 2 threads, us per call, split / one thread: 576x1536 M=1 156 / 83, M=2 184 / 123; 192x576 M=1
# 122 / 26; 2048x2048 (4M elements) M=1 422 / 432, M=2 486 / 618; 2048x7168 M=1 about 1.0 / 1.6 ms.
CPU_THREAD_MIN_ELEMS = 1 << 21
# On the torch-ops path, M=1 with bf16 x and 'block'/'tensor' scales: float16 tiles and torch's
# float16 GEMV (fp32 sums, outputs rounded to float16 before the bf16 output), no float32 tile ...
CPU_HALF_GEMV = True
# ... for weights of at least this many elements (N * K padded to 128); below, its extra fixed ops
# cost more than it saves (1 thread, M=1: 128x576 fp32 path 72 us, float16 85; 192x576 105 / 96).
CPU_HALF_GEMV_MIN_ELEMS = 96 * 1024


def cpu_experts_in_parallel(rows_per_expert: int, experts: int, expert_weight_elems: int) -> bool:
    """Whether an MoE experts layer on CPU tensors runs its hit experts side by side, each whole expert
    (both linears, each one compiled-kernel call) on one intra-op thread, rather than one after the
    other: where two or more experts are hit, none has more than CPU_EXPERTS_NATIVE_MAX_M rows, and one
    after the other would hand rows to a worker thread per linear (:func:`cpu_row_parts`' rule on the
    larger weight, `expert_weight_elems` elements) or run torch ops (above CPU_NATIVE_MAX_M rows).
    Below that work the threads' hand-offs cost more than they bring (2 threads, hidden 1024, expert
    width 512: 7.6 against 6.5 ms at 8 tokens; hidden 320, width 192: 1.5 against 1.0 ms at 1)."""
    if experts < 2 or torch.get_num_threads() < 2 or not 0 < rows_per_expert <= CPU_EXPERTS_NATIVE_MAX_M:
        return False
    work = expert_weight_elems * (rows_per_expert if rows_per_expert > CPU_GEMV_MAX_M else 1)
    return rows_per_expert > CPU_NATIVE_MAX_M or work >= CPU_THREAD_MIN_ELEMS


def use_cpu_native(m: int) -> bool:
    """Whether an M-row call on CPU tensors runs the compiled kernels (where they build, and for
    fp32/bf16/fp16 x with unit column stride: the caller checks), see CPU_NATIVE_MAX_M."""
    return 0 < m <= CPU_NATIVE_MAX_M


def cpu_row_parts(n: int, k: int, m: int) -> list[tuple[int, int]]:
    """The weight-row ranges the compiled CPU kernels split an (M, K) x (N, K) call into, one per
    intra-op thread (one range below CPU_THREAD_MIN_ELEMS of work)."""
    threads = torch.get_num_threads()
    if threads <= 1 or n * k * (m if m > CPU_GEMV_MAX_M else 1) < CPU_THREAD_MIN_ELEMS:
        return [(0, n)]
    step = -(-n // threads)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def use_cpu_half_gemv(m: int, n: int, kp: int, x_dtype: torch.dtype, granularity: str) -> bool:
    """Whether the torch-ops CPU path runs this call on float16 tiles (see CPU_HALF_GEMV); `kp`: K
    padded to a multiple of 128."""
    return (m == 1 and CPU_HALF_GEMV and x_dtype == torch.bfloat16 and granularity != "row"
            and n * kp >= CPU_HALF_GEMV_MIN_ELEMS)


# ----------------------------------------------------------------------------- GPU: limits
# GEMMs with at most this many rows may take the split-K kernel (ops/splitk_gemm.py), where
# splitk_config asks for a split (long K, few tiles); everything else runs the tiled kernel
# (ops/gemm.py) with these configs. H100 sweep behind the limit: on the DeepSeek-V3 shapes the
# split-K kernel beat the tuned tiled kernel up to M=64 (geometric mean 21.5 vs 22.8 us at M=64).
SMALL_M_MAX = 64
# Single-token GEMMs with fewer weight elements than this take the fused kernel. H100 sweep
# (benchmarks/gemv_sweep.py, CUDA graphs, M=1; fused vs act_quant + GEMM): 4.5-6.3 vs 8.7-12.2 us
# for 3-6 MB of weight (N=1536..3072, K=1536..2816), 8.6 vs 9.2 us at N=576, K=7168, 18.5 vs 18.5
# at 24576x1536; from 117 MB up (7168x16384, 18432x7168) the split-K GEMM streams HBM faster
# (51.4 vs 50.4 and 58.5 vs 53.8 us). At M >= 2 each row re-reads the weight tile and the
# two-kernel path won (geometric mean 19.9 vs 16.8 us at M=2). Another H100 sweep: from
# 33M elements the two kernels win too (4608x7168 19.6 vs 21.7 us; 18432x7168 54.5 vs 63.8) or tie
# (24576x1536 18.2 vs 18.5; 32768x512, 16.8M: 10.7 vs 10.7), while below it the fused kernel still
# wins (7168x2304 11.1 vs 13.6, 1536x7168 10.2 vs 11.4): hence 24M.
FUSED_GEMV_MAX_WEIGHT = 24 * 2**20
# Split-K gives each output tile the fewest splits that make at least this many programs per SM
# (H100 sweep: 2 beat 1 and 4; rounding the split up rather than to nearest, so N=7168 at M=16-64
# with 224 tiles on 132 SMs splits in 2: K=18432 M=16 55.4 vs 58.2 us, M=64 61.6 vs 68.6).
_PROGRAMS_PER_SM = 2
# Each program gets at least 4 K groups (512 of K): N=576, K=7168, M=1 was best at 14 splits; K of
# fewer than _LONG_SPLIT_GROUPS groups at least 2 (576x1536 M 1-32: 6 splits of 2 groups).
_MIN_GROUPS_PER_SPLIT = 4
_SHORT_MIN_GROUPS_PER_SPLIT = 2
_LONG_SPLIT_GROUPS = 16
# Split-K tiles are 64 columns wide up to this many rows, 32 above: the wider tile doubles the split
# that reaches _PROGRAMS_PER_SM. H200, tune-routes --challengers tiled (31 shapes x M 1-64, both
# granularities; scored with benchmarks/heuristic_rescore.py): with 64 columns up to M=32 and K of
# 8-15 groups split, our kernels' no-table choice took 1.048x the fastest of our kernels (128x128
# weights, max 1.49) and 1.031x (1x128, max 1.39), against 1.081x (max 1.55) and 1.067x (max 1.57)
# with 64 columns up to M=8 and no split below 16 groups; shapes in no table at M=16 (5120x5120,
# 13824x5120, 5120x13824, 3072x3072, 16384x3072, 3072x8192, 2560x10240) 1.011x and 1.000x against
# 1.089x and 1.097x (5120x13824 25.8 against 30.8 us). At M=64, 64x64 tiles lost to 64x32 (1024x4096
# 11.4 against 8.9 us).
_SPLIT_WIDE_MAX_M = 32
# K of at least 32 groups of 128 (K > 3968) is split; K of 8-31 groups (897-3968) only where the tiles
# leave a quarter of the SMs idle at least (on NVIDIA; 576x1536 M=1 on H200: 4.7 split / 7.1 us
# unsplit, 2048x1408 5.2 / 6.9); shorter K stays unsplit (N=4096, K=512, M=16: 6.0 split / 3.7 us).
# H100, `fp8linear tune-routes`, split-K / tiled 16x32 tiles, us:
# 512x3584 M=1 6.0 / 10.4, 3584x3584 M=1 (56 tiles) 9.4 / 11.6, 576x2048 M=1 5.4 / 6.4, shapes in
# no table at M=16: 1024x3072 6.2 / 9.0, 2560x2560 (80 tiles) 7.5 / 9.1, 3072x3072 (96) 8.8 / 10.2;
# but 7168x2048 M=1 (112 tiles of 132 SMs) 10.6 / 9.1 and 8192x3072 M=16 (256) 13.8 / 13.5.
_MIN_SPLIT_GROUPS = 32
_SHORT_SPLIT_GROUPS = 8
_SHORT_SPLIT_MAX_TILES_PER_SM = 0.75

KERNELS = ("gemv", "decode", "cublas", "cutlass", "splitk", "persistent", "ws", "tiled")

# Short K (up to PERSISTENT_MAX_K) with M >= PERSISTENT_MIN_M and 128x128-block or per-tensor
# weights runs the persistent TMA kernel (H100, M=4096: K=512 211 vs 304 us, K=1536 413 vs 437 us
# against the tiled kernel; at K >= 7168 it was 2-4% slower; with row-wise scales or smaller tiles
# it was slower, up to 9x for row-wise at N=24576, K=1536).
PERSISTENT_MAX_K = 2304
PERSISTENT_MIN_M = 2048
PERSISTENT_CONFIG = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
# A GEMM our tiled or persistent kernel would run goes to the persistent warp-specialized Gluon kernel
# (fp8linear.ops.ws_gemm, 4 ring slots) on Hopper from WS_MIN_M rows that fill at least
# WS_MIN_ROW_FILL of their 128-row tiles, K >= WS_MIN_K, 128x128 weights, where its 128x128 tiles
# number at least WS_MIN_TILES_PER_SM per SM. 1x128 weights only where a routes table names it: their
# consumers spill a little (ptxas), and it took 1.43x the tiled route's time at 7168x2048 M=320 (37.0
# vs 25.9 us, 64x128 tiles) and 1.52x at 2112x7168 M=320 (60.6 vs 39.8, 64x64; H200).
# benchmarks/ws_gemm_ab.py (CUDA graphs, kernel alone, same bits as the tiled kernel on 128x128
# tiles), H200, against the route it replaces:
# - K 512-2048 (32768x512, 24576x1536, 7168x2048, 2048x1408 from 128 tiles, 1536x576 from 192):
#   0.57-0.78x at M 256-8192 (32768x512 M=1024 46.7 vs 81.8 us, 24576x1536 M=4096 330 vs 483 on the
#   persistent kernel); long K (4096x4096 to 7168x18432, >= 68 tiles): 0.86-0.98x;
# - M 96-128 with >= 112 tiles: 0.63-0.93x (14336x4096 M=128 21.7 vs 34.5); M 160, whose second
#   row of tiles is a quarter full, 0.76-0.88x at K <= 1536 but 0.97-1.11x at K >= 4096 (18432x7168
#   94.4 vs 84.9), hence the fill rule; M=64 (half a tile) 1.07-1.52x;
# - 64 tiles or fewer: 1.0-1.3x (4096x14336 M=256 51.3 vs 51.6, 2048x1408 M=256 8.8 vs 6.8), and
#   split-K routes stay faster (576x7168 M=512 25.9 vs 15.8).
# Over the 73 cases of those runs the rule selects: 0.57-0.995x the replaced route (geomean 0.80).
# Its persistent programs (one per SM) load a tile's first K groups while they store the last one;
# one program per tile (WsConfig(persistent=False)) took 0.98-1.68x the time (geomean 1.16), 3 slots
# 1.06x and 6 slots 1.05x of 4. A last, partly filled wave of long-K tiles is split along K into up to
# 4 pieces (ws_gemm.tail_plan: 8 and 16 were slower at 2112x7168 M=1024-2048, where the last program
# sums every piece).
# Eager callers keep the tiled kernel: its plan launches it prepared (raw addresses, 26-28 us of host
# time a call), while the warp-specialized kernel goes through Gluon's launcher with two TMA
# descriptors made per call: H100, benchmarks/eager_ws_ab.py (CUTLASS off), eager wall 4.00x at
# 2112x7168 M=512 (143.3 vs 35.8 us, host 142.7 vs 26.2) and 2.85x at 1536x7168 M=1024.
WS_MIN_M = 96
WS_MIN_ROW_FILL = 0.75
WS_MIN_K = 512  # the shortest K measured (32768x512)
WS_MIN_TILES_PER_SM = 0.5
WS_CONFIG = WsConfig(block_n=128, stages=4, persistent=True, tail_split=4)
# 128x256 tiles (WS_WIDE_CONFIG) move a quarter less through L2 per product, and so are faster where
# that bounds the 128-column kernel: long K and enough tiles. H100, CUDA graphs, the kernels alone
# (as benchmarks/ws_gemm_ab.py times them, wsp256s4 against wsp128s4t4), 11 shapes x M 256-8192:
# 0.82-0.98x at K >= 4096 where the 256-column tiles fill their waves (18432x7168 M=8192 2039 against
# 2477 us, 8192x28672 M=1024 434 against 522), 1.0-2.4x where they do not (576x7168: 3 column tiles
# for 576 columns; 8192x28672 M=256: 64 tiles on 132 SMs) and 0.95-1.12x at K <= 2048. The rule: K >=
# WS_WIDE_MIN_K, at least a wave of 256-column tiles, and their waves (each counted whole) times
# WS_WIDE_TILE_COST fewer than the 128-column tiles' waves; over the 66 cases it selects 23 at 0.82-1.06x
# (geomean 0.944; 7168x16384 M=1024 the worst, 246.5 against 231.7 us).
# Their last, partly filled wave is split along K too (tail_split): over 96 cases of 12 shapes at M
# 256-8192 (H100, benchmarks/ws_gemm_ab.py, wsp256s4t4 and wsp256s4 against wsp128s4t4), in the 32
# the rule selects, 0.946x the 128-column kernel's time split against 0.950x unsplit (geomean),
# 7168x16384 M=3000 0.955x against 1.054x, 3584x18944 M=8192 0.837x against 0.862x.
WS_WIDE_CONFIG = WsConfig(block_n=256, stages=4, persistent=True, tail_split=4)
WS_WIDE_MIN_K = 4096
# Time of a 128x256 tile in 128x128 tiles' time: 2 x 0.88, the per-tile gain at 8 or more waves.
WS_WIDE_TILE_COST = 1.76
# 128x192 tiles (WS_MID_CONFIG: 576 columns in 3 tiles, not 4.5; 1536 in 8, not 12) where their
# waves times WS_MID_TILE_COST are fewer than the 128-column tiles' (and the 128x256 tiles' by their
# rule), at any K from WS_MIN_K. A wave of 128x192 tiles takes 1.53-1.60 times a wave of 128x128
# tiles at 10 or more waves (H100, CUDA graphs, the kernels alone, benchmarks/ws_gemm_ab.py's
# wsp192s4t4 against wsp128s4t4: 18432x7168 M=2048 530.3 against 497.7 us in 12 against 18 waves;
# 24576x1536 M=8192, 3584x3584 M=8192, 7168x2048 M=8192). Where the rule picks them over 14 shapes x M 512-8192:
# 576x576 M=4096 8.4 against 9.8 us, 576x2048 M=4096 14.5 against 18.8, 1536x576 M=2048 8.2 against
# 9.5, 1408x2048 M=2048 15.0 against 18.1, 576x7168 M=4096 40.7 against 47.7, 1536x7168 M=2048 43.5
# against 51.4, 18432x7168 M=512 132.0 against 136.6 (the 128x128 kernel with its split tail).
WS_MID_CONFIG = WsConfig(block_n=192, stages=4, persistent=True, tail_split=4)
WS_MID_TILE_COST = 1.6
# The config of each tile width, as ws_config picks them (what tune-routes times for 128x128 weights).
WS_CONFIGS_BY_WIDTH = {cfg.block_n: cfg for cfg in (WS_CONFIG, WS_MID_CONFIG, WS_WIDE_CONFIG)}
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
# Eager callers run CUTLASS (where built) from this M*N*K up: a routes table's CUTLASS entries, and,
# above SMALL_M_MAX rows, in place of our tiled kernel where no table entry chose it (its cuBLAS
# entry refused eagerly, or a shape in no table; eager_cutlass_config). A CUTLASS plan (act_quant,
# then fp8linear.ops.cutlass_gemm.CutlassCall: 8.6-9.3 us of host time for the call alone) costs
# 26-28 us of host time per call against 19-26 for our two launches: below the cut the host sets
# the pace and that shows; above it CUTLASS's shorter GPU time does. H200,
# benchmarks/eager_cutlass_ab.py, eager wall time of the router's choice with / without CUTLASS,
# where they differ (two runs): from 7.5e9 on 0.65-0.92 (24576x1536 M=256 26.2 against 40.1 us,
# 7168x2048 M=512 28.8 against 32.3, 1536x7168 M=1024 46.8 against 50.7); at 4.8e9-5.6e9 (M of
# 128-512) 0.83-1.11 from run to run, its GPU time equal to our kernel's; with this cut, 18 cases of
# M 333-1024: 0.72-1.00 in the 8 it changes, 0.957 over all 18 (that host's BF16 nn.Linear costs
# 16-19 us of host time). H100, same script, M 96-2048: the router's choice 0.977x its time without
# CUTLASS, the fastest forced CUTLASS config 0.992x the router's: the same rule holds there.
EAGER_CUTLASS_MIN_MNK = 6 * 10**9
# Eager callers also run CUTLASS in place of cuBLAS blockwise (128x128 weights, above SMALL_M_MAX
# rows, GEMMs up to EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK) where the CUTLASS kernel's tiles fill at least
# EAGER_CUTLASS_MIN_WAVE_FILL of their waves (eager_cutlass_over_cublas): there its GPU time is
# cuBLAS's (within 2%, or 6% at K=18432), and its host time 20-50 us less (cuBLASLt's call, and the
# split-K algorithms a 32 MiB workspace admits launching more kernels). H100,
# benchmarks/eager_cutlass_ab.py, eager wall us, the router's choice with / without this rule, on
# two hosts: 24576x1536 M=512 48.4 / 63.3 and 45.6 / 84.2 (768 tiles of 128x128, 0.97 of 6 waves;
# BF16 65.6 and 61.1), 7168x2048 M=1024 40.4 / 69.5, M=2048 70.5 / 71.8 and 70.0 / 77.6 (0.97),
# 24576x1536 M=1024 89.7 / 90.1. Where the tiles leave more of their last wave idle cuBLAS's GPU
# time is shorter (2112x7168 M=2048, 272 tiles, 0.69: 82 against 89 us), and above the cut the GPU
# sets the pace (7168x18432 M 512-2048: CUTLASS 1.02-1.06x cuBLAS's GPU time).
EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK = 4 * 10**10
EAGER_CUTLASS_MIN_WAVE_FILL = 0.8
# Eager CUTLASS plans quantize inputs of at most this many elements in the library's own call
# (fp8linear.ops.cutlass_gemm.CutlassCall.with_quantization): one host call instead of act_quant's
# Triton launch and the GEMM's, 11-16% less host time per call (H200, benchmarks/eager_cutlass_ab.py,
# geomean over 18 cases, five runs; an H100 host, with this cut: eager wall 0.92-0.94x at M 256-512),
# for 1.2-1.4x act_quant's GPU time (benchmarks/library_quant_probe.py,
# CUDA graphs: 512x7168 6.5 against 5.6 us, 1024x7168 10.0 against 7.9, 2048x18432 42.5 against
# 31.1). Up to 2**22 elements (512x7168) the GPU pays under a microsecond for 3-4 us of host time;
# above it the GEMM's GPU time sets the eager pace (2112x7168 M=1024: 53 us of GPU time, 25 of host).
LIB_QUANT_MAX_ELEMENTS = 1 << 22
# Eager calls of 128x128 weights from this many rows and below EAGER_CUTLASS_MIN_MNK (where host
# time sets the pace) run CUTLASS (eager_cutlass_config) wherever the whole call is one host call:
# the library quantizes the input (use_library_quantization) and the plan-call module allocates
# (fp8linear.ops.cutlass_gemm.one_call_available). One C++ call costs less host time than
# act_quant's and our GEMM's Triton launches, or the one-launch decode kernel's launch; its two
# kernels are launched with PDL (EAGER_CUTLASS_PDL_MAX_WEIGHT). H100,
# benchmarks/eager_one_call_ab.py, eager wall time with / without this rule, 6 DeepSeek-V3 shapes:
# M 96-512 0.64-0.88 where it changes the route (2112x7168 M=333 27.6 against 41.7 us, 1536x7168
# M=512 27.7 against 43.6); M 2-64, the decode kernel's range: the ping-pong kernel forced 0.76-0.96
# at M 16-64 (2112x7168 M=16 32.5 against 42.9 us), the rule 0.71-0.97 at M 2-8 (24576x1536 M=8
# 23.4 against 33.1); on the cooperative kernel 24576x1536 M=2 took 1.07x, on the ping-pong kernel
# (eager_cutlass_config's choice up to 64 rows) 19.5 us against 22.7 without the rule.
EAGER_ONE_CALL_MIN_M = 2
# ... on weights below this many elements: on larger ones the GPU sets the pace even at a few rows,
# and there our split-K and tiled kernels stream the weight faster (same script: 18432x7168 M 2-32
# 1.14-1.16x the route before, 65.8 against 57.3 us; 7168x18432 M 2-16 0.94-0.98x; 24576x1536,
# 38M elements, 0.54-0.87x).
EAGER_ONE_CALL_MAX_WEIGHT = ONE_LAUNCH_MAX_WEIGHT
# Eager CUTLASS plans whose library call quantizes the input (use_library_quantization: the one-call
# rule, and the eager routes from EAGER_CUTLASS_MIN_MNK) launch both its kernels with programmatic
# dependent launch on weights below this many elements, unless FP8LINEAR_PDL=0: the quantization's
# CTAs are placed while the stream's previous kernel runs, the GEMM's while the quantization runs.
# H100, benchmarks/eager_one_call_ab.py, eager wall with / without PDL, same kernel, weights up to 38M
# elements (6 shapes, N, K <= 24576, 7168), M 96-512, 30 cases: the cooperative kernel 0.87-0.99x
# (geomean 0.914; 2112x7168 M=512 29.0 against 31.6 us), the ping-pong kernel 0.89-1.08x in the 18
# cases where eager_cutlass_config runs it (geomean 0.926; above 1 only at 2112x7168 M=333). On
# weights of 117M-132M elements (7168x16384, 7168x18432, 18432x7168), GPU-bound, with the GEMM alone
# under PDL: 0.89-0.97x at M 32-96 but 1.06-1.22x at M 160-227 (cooperative), up to 1.29x
# (ping-pong). At M 2-64 (the one-call rule's decode range) the GEMM
# alone under PDL took 0.88-1.02x (geomean 0.945 over 25 cases of M 2-512); both kernels under PDL
# are not timed there yet. The cut is EAGER_ONE_CALL_MAX_WEIGHT's, between the 38M and 117M measured.
EAGER_CUTLASS_PDL_MAX_WEIGHT = EAGER_ONE_CALL_MAX_WEIGHT
# The tile width of the 64-column kernels eager_cutlass_config runs where their tiles fit in one
# wave (CutlassConfig.tile_n; measured there).
NARROW_TILE_N = 64
# Shapes in no routes table (the heuristic): above SMALL_M_MAX rows cuBLAS blockwise runs once its
# 128x128 tiles give a quarter of a tile per SM, or from 1024 rows on; below that our kernels do.
# Fitted on an H100 sweep of every kernel (fp8linear tune-routes, the 31 shapes of `bench --grid`,
# M 1-4096): this rule's choice took 1.07x the time of the fastest kernel (geometric mean of 341
# cases); 0.5 tiles per SM gave 1.10x, 0.75 1.12x, and cuBLAS from M=128 on weights of 8M+
# elements 1.24x.
CUBLAS_MIN_TILES_PER_SM = 0.25
CUBLAS_ANY_TILES_M = 1024
# Below this many 128x128 output tiles per SM, 128x128 weights go to cuBLAS as 1x128 weights
# (CublasConfig(row_scales=True)) above SMALL_M_MAX rows, and so do row-wise (1x128) weights:
# cuBLAS's 1x128-scaled kernels beat its 128x128 ones and ours there. H100, CUDA graphs,
# benchmarks/cublaslt_probe.py --padded-grid, 11 shapes x M 4-2048, scales held: 1x128 / 128x128
# time 0.47-1.01 below 66 tiles (one exception: 576x1536 M=1024, 1.21), 1.12-1.69 from 84 tiles up;
# against our kernels at M 128-512 0.68-1.02. Row-wise weights: in the routes tables' row sections
# (H100 / H200) at M > 64 below this cuBLAS won 100 / 104 of 137 cases, our split-K 1; shapes in no
# table, H100, M=96, cuBLAS / our split-K: 3072x8192 17.6 / 30.4 us, 3072x3072 10.2 / 14.0,
# 2560x2560 9.0 / 12.0.
CUBLAS_ROW_FORM_MAX_TILES_PER_SM = 0.5
_ROW_FORM = CublasConfig(row_scales=True)
# At decode (up to SMALL_M_MAX rows) the same 1x128-scaled cuBLAS kernels beat our split-K on
# square-ish weights of mid width: N in [DECODE_CUBLAS_MIN_NK, DECODE_CUBLAS_MAX_N], K from
# DECODE_CUBLAS_MIN_NK to DECODE_CUBLAS_MAX_K_OVER_N x N. H100, CUDA graphs, cuBLAS timed with the
# weight scale held (tune-routes --challengers cublas): on every table shape the rule picks
# (1408x2048, 2048x1408, 3584x3584, 4096x4096, 7168x2048, 8192x8192) cuBLAS took 0.64-0.94x our
# kernels' time at M 1-64, both granularities; outside it our kernels tie or win at some M below
# DECODE_CUBLAS_LONG_K_MIN_M (576x7168 1.24-1.33x, 2112x7168 1.07-1.12x, 1024x8192 1.08-1.11x,
# 18944x3584 1.05-1.16x); shapes in no table
# (tune-routes --quick, M=16): 3072x3072 0.77x, 2560x2560 0.82x, 5120x5120 0.83x, 8192x3072 0.89x.
DECODE_CUBLAS_MIN_NK = 1024
DECODE_CUBLAS_MAX_N = 8192
DECODE_CUBLAS_MAX_K_OVER_N = 1.5
# From DECODE_CUBLAS_LONG_K_MIN_M rows the 1x128-scaled cuBLAS kernels also win on long K (any K from
# DECODE_CUBLAS_MIN_NK on weights of N in [DECODE_CUBLAS_MIN_NK, DECODE_CUBLAS_MAX_N]) and, for
# row-wise weights, on wider weights from DECODE_CUBLAS_WIDE_ROW_MIN_K. The routes tables' entries at
# M 32 and 64 on the shapes this adds (27 per M, both sections) name cuBLAS in 45 of 54 on H100 and 53
# of 54 on H200 (e.g. H100 4096x14336 block M=32 25.0 against our 29.3 us, 7168x18432 row M=64 51.4
# against 69.7); the known loss is 1024x8192 on H100, where our split-K is the entry in both sections
# at M 32 and 64 (cuBLAS 1.08-1.11x its time, above). At M=16 the entries split: cuBLAS in 11 of 27
# on H100, 15 of 27 on H200, our kernels or CUTLASS in the rest. Shapes in no table (H100, tune-routes,
# cuBLAS's time over our kernel's, the route without this rule, M=32 / 64): 4096x12288 block 0.86 /
# 0.82x and row 0.78 / 0.74x, 5120x13824 block 0.86 / 0.74x and row 0.80 / 0.71x, 13824x5120 row 0.80
# / 0.89x. The cut is the middle of 16 and 32. Left out: block weights wider than DECODE_CUBLAS_MAX_N
# (our tiled kernel or CUTLASS is the entry in 22 of their 24 at M 32 and 64), and row-wise 24576x1536
# (K=1536; our tiled kernel on H100).
DECODE_CUBLAS_LONG_K_MIN_M = 24
DECODE_CUBLAS_WIDE_ROW_MIN_K = 2048
# Above SMALL_M_MAX rows, split-K with 64x64 tiles where they do not fill the SMs (one program per
# SM; in that sweep 1 program per SM beat 2), and the tiled kernel with 64x64 tiles where 128x128
# tiles leave SMs idle (N=576, K=1536, M=512: 6.3 vs 7.8 us for 128x128).
MID_SPLIT_TILE = (64, 64)
# ... and only from this many K groups of 128: with fewer the partial sums' round trip costs more than
# the idle SMs bring. H100 sweep of our kernels (tune-routes --challengers tiled, 31 shapes, M 96-1024;
# split-K as this rule sizes it against the fastest tiled config, geomean per K): 5-16 groups 1.14-1.56x
# the time on 128x128 weights (0 of 58 cases faster), 0.96-1.56x on 1x128 weights; 28-148 groups
# 0.71-0.94x and 0.54-0.79x (52 and 59 of 60 faster). No grid shape has 17-27 groups; the cut is their
# middle. Scored with benchmarks/heuristic_rescore.py, our kernels' no-table choice went from 1.092x
# to 1.026x the fastest (128x128 weights, max 1.77 -> 1.32) and from 1.121x to 1.093x (1x128).
MID_SPLIT_MIN_GROUPS = 24
MID_M_CONFIG = GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
# TMA wants 16-byte aligned bases and row strides.
_TMA_ALIGN = 16


# 1x128 (row-wise) weights above SMALL_M_MAX rows: 64x128 tiles, 4 warps, 3 stages at every M. A
# 128x128 tile promotes each product with a scale per column, which cost 2.2-2.9x the fastest of our
# kernels at M 96-1024 (H100, tune-routes --challengers tiled, 31 shapes: geomean per M bucket), where
# this config took 1.09-1.29x; over the 558 row-wise entries above 64 rows of the routes tables the
# fastest of our kernels is this config (or the warp-specialized kernel falling back to it) in 315 on
# H100 and 305 on H200, a 128x128 tile in none.
ROW_MID_CONFIG = GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)


# ----------------------------------------------------------------------------- GPU: configs
def heuristic_config(m: int, n: int, k: int, granularity: str = "block") -> GemmConfig:
    """A good tiled-kernel config without tuning (H100 sweep, benchmarks/kernel_sweep.py; row-wise
    weights above SMALL_M_MAX rows: ROW_MID_CONFIG)."""
    if m > SMALL_M_MAX and granularity == "row":
        return ROW_MID_CONFIG
    if m <= SMALL_M_MAX:
        # Decode shapes split-K does not take. What H100 `fp8linear tune` picked under CUDA graphs
        # (8 shapes x M 1..64): one tile of 16/32/64 rows covering M, 64 columns up to
        # M=8 and 32 above, 4 warps, 3-6 stages (18432x7168 M=64: 64x64 54 us where 16x64 with
        # 6 stages, one tile for every M, took 91 us).
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        return GemmConfig(block_m=block_m, block_n=64 if m <= 8 else 32, block_k=128, num_warps=4, num_stages=4)
    if m <= 256 or k <= 256:  # short K or few rows: more CTAs (64x128 best for K=256: 47.5 us)
        return GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    # prefill: 128x128, 8 warps (two consumer warpgroups), 4 stages: 871 TF/s at 4096x18432x7168
    return GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)


# Rows up to which AMD decode-sized GEMMs use 32x32 tiles, and up to which 64x64.
AMD_DECODE_MAX_M = 128
AMD_MID_MAX_M = 1024
# Prefill tiles from largest to smallest: the first giving every CU a tile is used.
_AMD_PREFILL_TILES = ((64, 128), (64, 64), (64, 32), (32, 32))


def amd_heuristic_config(m: int, n: int, k: int, arch: str = "gfx942") -> GemmConfig:
    """A config for AMD Instinct GPUs without tuning; unmeasured on hardware (docs/amd.md).

    The tiles follow vLLM's MI300X block-FP8 tunings (files "N=..,K=..,device_name=
    AMD_Instinct_MI300X,dtype=fp8_w8a8,block_shape=[128,128].json" for N,K = 1536,7168; 576,7168;
    32768,512; 7168,16384; 7168,18432; 7168,2048: 4 warps and nonkdim 16 throughout; 32x32 tiles
    up to M=128-256; 64x64 for M=256-1536; 64x128, GROUP_SIZE_M 32, at M=2048-4096; small N
    64x32 or 64x64), a kernel of the same structure as ours (one scaled dot per 128-wide K group).
    Options per tile: AMD_TILE_OPTIONS. Decode (M <= 128): 32x32. Up to M=1024 or K <= 256:
    64x64. Above: the largest of 64x128, 64x64, 64x32, 32x32 that still gives every CU a tile.
    """
    if m <= AMD_DECODE_MAX_M:
        return amd_gemm_config(32, 32)
    if m <= AMD_MID_MAX_M or k <= 256:
        return amd_gemm_config(64, 64)
    cus = AMD_CU_COUNT.get(arch, DEFAULT_CU_COUNT)
    for bm, bn in _AMD_PREFILL_TILES:
        if -(-m // bm) * -(-n // bn) >= cus:
            return amd_gemm_config(bm, bn, group_m=32)
    return amd_gemm_config(*_AMD_PREFILL_TILES[-1], group_m=32)


def config_for_arch(arch: str, m: int, n: int, k: int, granularity: str = "block") -> GemmConfig:
    """The tiled-kernel config for a GPU whose tables are keyed `arch` (a device name on NVIDIA, an
    arch such as 'gfx942' on AMD): its table entry, else the matching heuristic."""
    cfg = lookup_config(arch, m, n, k, granularity)
    if cfg is not None:
        return cfg
    return amd_heuristic_config(m, n, k, arch) if is_amd_arch(arch) else heuristic_config(m, n, k, granularity)


def select_config(device: torch.device, m: int, n: int, k: int, granularity: str = "block") -> GemmConfig:
    """Tuned table entry for this GPU and shape if there is one, else the heuristic (never tunes here).

    On ROCm the table is the arch's (``fp8linear/ops/tuned_configs/gfx942.json``) and the heuristic
    :func:`amd_heuristic_config`."""
    if device.type == "cuda":
        return config_for_arch(device_name(device), m, n, k, granularity)
    return heuristic_config(m, n, k, granularity)


def use_fused_gemv(m: int, n: int, k: int) -> bool:
    """Whether the fused kernel is the faster forward for this GEMM (see FUSED_GEMV_MAX_WEIGHT)."""
    return m == 1 and n * k < FUSED_GEMV_MAX_WEIGHT


def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """The fused GEMV's launch config (H100 sweep, benchmarks/gemv_sweep.py, M=1).

    Up to N=4096, 8 columns and 8 warps per program (more programs to stream a small weight; e.g.
    N=1536, K=7168: 10.2 us vs 16.3 us with 16 columns / 4 groups / 4 warps), 8 groups per step
    where K has 16 groups or more; above, 32 columns x 4 groups, 4 warps (N=7168, K=2048: 9.1 us).
    """
    groups = _cdiv(k, GROUP_SIZE)
    if n <= 4096:
        return GemvConfig(block_n=8, groups_per_step=8 if groups >= 16 else 4, num_warps=8, num_stages=2)
    return GemvConfig(block_n=32, groups_per_step=4, num_warps=4, num_stages=2)


def splitk_num_stages(default: int, device: torch.device | None = None) -> int:
    """Pipeline depth of the split-K kernel: 2 on AMD (the stream pipeliner's usual depth; at 4,
    64x32 tiles take 36 KiB of LDS and one workgroup per SIMD), `default` elsewhere."""
    return default if device_arch(device) is None else 2


def splitk_config(m: int, n: int, k: int, device: torch.device) -> SplitKConfig | None:
    """Split-K launch config for a small-M GEMM, or None where the tiled kernel is the better choice.

    From H100 sweeps (benchmarks/splitk_sweep.py, DeepSeek-V3 shapes plus 4608x7168, M in
    {1, 4, 16, 32, 64}): splitting pays when K is long (>= 32 groups; 8-31 groups where the tiles
    leave SMs idle, see _SHORT_SPLIT_GROUPS), e.g. M=1, N=576, K=7168:
    7.1 vs 19.9 us for the tuned tiled kernel, N=4608: 16.8 vs 22.6 us. At least two programs per
    SM were best (one program per SM plus a few left over, e.g. 144 programs on 132 SMs, was 20.0
    us at N=4608), with at least 4 K groups each (2 below _LONG_SPLIT_GROUPS groups); the split is
    the smallest that reaches two. Tiles: 16/32/64 rows (as M needs) x 64 columns up to
    _SPLIT_WIDE_MAX_M rows, x 32 columns above; 4 warps, 4 stages. Short K stays tiled: there the
    partial-sum round trip and the counter reset cost more than the extra SMs bring.
    """
    groups = _cdiv(k, GROUP_SIZE)
    if groups < _SHORT_SPLIT_GROUPS or (groups < _MIN_SPLIT_GROUPS and torch.version.hip is not None):
        return None
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= _SPLIT_WIDE_MAX_M else 32
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    if groups < _MIN_SPLIT_GROUPS and tiles > _SHORT_SPLIT_MAX_TILES_PER_SM * sm_count(device):
        return None
    per_split = _MIN_GROUPS_PER_SPLIT if groups >= _LONG_SPLIT_GROUPS else _SHORT_MIN_GROUPS_PER_SPLIT
    split = min(_cdiv(_PROGRAMS_PER_SM * sm_count(device), tiles), groups // per_split)
    if split < 2:
        return None
    split = _cdiv(groups, _cdiv(groups, split))  # no empty splits
    return SplitKConfig(block_m=block_m, block_n=block_n, split_k=split, num_stages=splitk_num_stages(4, device))


def decode_tile_counters(n: int) -> int:
    """Tile counters a :func:`fp8linear.ops.splitk_gemm.splitk_counters` of an N-column weight holds:
    enough for SMALL_M_MAX rows in any tile shape SplitKConfig allows (block_m, block_n >= 16)."""
    return _cdiv(SMALL_M_MAX, 16) * _cdiv(n, 16)


def counters_fit(m: int, n: int, cfg: SplitKConfig) -> bool:
    """Whether a :func:`fp8linear.ops.splitk_gemm.splitk_counters` of an N-column weight has a tile
    counter for every output tile of an (m, n) split-K launch with `cfg` (it is sized for SMALL_M_MAX
    rows of 16x16 tiles)."""
    return cfg.split_k == 1 or _cdiv(n, cfg.block_n) * _cdiv(m, cfg.block_m) <= decode_tile_counters(n)


# Programmatic dependent launch of the Triton decode kernels (fp8linear.ops.pdl) is opt-in:
# FP8LINEAR_PDL=1 (the eager CUTLASS plans' is not: EAGER_CUTLASS_PDL_MAX_WEIGHT). Why it is off by
# default (H100): benchmarks/pdl_ab.py (interleaved CUDA-graph A/B, 15 shapes x M 1-64) measured the
# forward at 0.976x the time of plain launches (geometric mean; 0.985x summed; 0.95-0.97x on short K,
# e.g. 4096x512 5.55 -> 5.45 us) and the GEMM alone at 0.979x (0.990x summed), but in two of five
# whole `fp8linear bench` runs with early release one or two graphs ran their forward 1.5-2.4x slower
# throughout (4608x7168 M=32: 32.6 vs 23.9 us; 32768x512 M=2: 23.3 vs 11.5 us), and three re-runs of
# those cases did not reproduce it. A ~2% gain does not pay for an unexplained stall in serving. A
# PDL launch without the early release was slower than plain launches (1.025x). Only decode sizes
# (M <= SMALL_M_MAX) use it: there act_quant is one wave of small programs, so GEMM programs placed
# early never keep act_quant's from starting.
PDL_ENV = "FP8LINEAR_PDL"
# griddepcontrol: sm_90 (Hopper) and newer.
_MIN_CAPABILITY = 9


@lru_cache(maxsize=16)
def _device_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= _MIN_CAPABILITY


def _pdl_requested() -> bool:
    value = os.environ.get(PDL_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def _eager_cutlass_pdl(cfg: CutlassConfig, n: int, k: int, bias: torch.Tensor | None) -> bool:
    """Whether an eager CUTLASS plan whose library call quantizes the input launches its two kernels
    with PDL: weights below EAGER_CUTLASS_PDL_MAX_WEIGHT elements, the kernel built for it, unless
    ``FP8LINEAR_PDL=0`` (the Triton decode kernels' PDL stays opt-in)."""
    _pdl_requested()  # a value other than 0, 1 or unset is an error here too
    return (n * k < EAGER_CUTLASS_PDL_MAX_WEIGHT and os.environ.get(PDL_ENV, "") != "0"
            and pdl_supported(cfg, bias is not None))


def use_pdl(device: torch.device, m: int) -> bool:
    """Whether a decode-sized (M rows) act_quant -> GEMM pair on `device` runs with PDL."""
    # The opt-in first: with PDL off (the default) a launch pays one environment lookup.
    if not _pdl_requested() or not has_gdc() or m > SMALL_M_MAX or device.type != "cuda":
        return False
    if torch.version.hip is not None or interpreting():
        return False
    return _device_pdl(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------- GPU: activation quantization
# Inputs of at most this many elements are quantized 4 rows per program (see act_quant_launch).
ACT_QUANT_SMALL_INPUT_ELEMENTS = 2**21


def act_quant_launch(m: int, k: int) -> tuple[int, int]:
    """(rows per program, warps) of the activation quantization (:mod:`fp8linear.ops.quant`) for an (m, k) output."""
    # Rows per program: 16 (4 KB of bf16) saturates HBM at prefill; decode-sized inputs take fewer
    # rows so no program works on padding (H100, K=7168, do_bench incl. launch: M=1 4.7 vs 7.2 us
    # with 1 row / 1 warp; M=16 5.1 vs 5.6 us with 4 rows; M=4096 42.2 vs 42.4 us, unchanged), and
    # so do inputs up to ACT_QUANT_SMALL_INPUT_ELEMENTS, where more, smaller programs finish sooner
    # (benchmarks/act_quant_probe.py, H100, CUDA graphs, 4 rows against 16: 77x576 1.74 vs 1.89 us,
    # 200x512 1.68 vs 1.86, 512x1536 3.13 vs 3.20, 333x7168 5.95 vs 5.80, 1024x7168 13.6 vs 10.6).
    return (1, 1) if m == 1 else ((4, 4) if m <= 64 or m * k <= ACT_QUANT_SMALL_INPUT_ELEMENTS else (16, 4))


# ----------------------------------------------------------------------------- GPU: routes
@dataclass(frozen=True)
class Route:
    """What runs one GEMM: the kernel (one of KERNELS), its launch config (cuBLAS: its workspace
    limit and scale form, None for the defaults; CUTLASS: which built kernel), and PDL flags.

    ``pdl``: the GEMM is launched with programmatic dependent launch (CUTLASS: both kernels of the
    library's quantize-and-GEMM call, the quantization after the stream's previous kernel,
    :class:`~fp8linear.ops.cutlass_gemm.CutlassCall`);
    ``release_early``: the activation quantization before it lets it be scheduled early
    (:mod:`fp8linear.ops.pdl`).
    """

    kernel: str
    config: GemmConfig | SplitKConfig | GemvConfig | CublasConfig | CutlassConfig | WsConfig | None = None
    pdl: bool = False
    release_early: bool = False


# 1x128 weight scales read N-major (stride (1, N); a copy `Fp8BlockLinear` keeps) by our kernels from
# this many rows: a K group's scales for a tile's columns sit in a few cache lines, where the
# checkpoint's K-major (row-major) layout puts each column's in its own line. H100, CUDA graphs, our
# kernels as routed for 7 shapes x M 1-2048 (benchmarks/scale_layout_ab.py): tiled 0.75-0.99x the
# time from M=256 (4096x14336 M=2048 525 -> 393 us, 18432x7168 M=2048 1092 -> 851), split-K 0.88-0.97x
# and the one-launch decode kernel 0.89-1.01x at M 128-512; below 128 rows 1.05-1.19x (16x32 tiles)
# and 1.02-1.15x (split-K): a line per K step on a short step's critical path. Two runs; measured on
# NVIDIA only.
N_MAJOR_SCALE_MIN_M = 128
# The warp-specialized kernel gains on long K only: 18432x7168 M 128-256 0.89-0.90x, 24576x1536
# M 128-2048 1.26-1.41x (same runs).
N_MAJOR_SCALE_WS_MIN_K = 4096


def dense_scale(w_s: torch.Tensor, granularity: str) -> bool:
    """Whether a weight scale is laid out as the kernels that want a dense one read it: contiguous,
    or for 1x128 weights also N-major, stride (1, N) (only the 128x128-weight CUTLASS kernels need
    it contiguous; the rest read any strides)."""
    return w_s.is_contiguous() or (granularity == "row" and w_s.dim() == 2 and w_s.stride(0) == 1
                                   and w_s.stride(1) == w_s.shape[0])


def use_n_major_scales(route: Route, m: int, k: int, granularity: str) -> bool:
    """Whether the kernel on `route` reads 1x128 weight scales faster N-major (N_MAJOR_SCALE_MIN_M,
    N_MAJOR_SCALE_WS_MIN_K; our kernels read either layout, with the same bits), or only N-major
    (CUTLASS's 1x128-weight kernels: another layout goes through a copy made once)."""
    if granularity == "row" and route.kernel == "cutlass":
        return True
    if granularity != "row" or m < N_MAJOR_SCALE_MIN_M or torch.version.hip is not None:
        return False
    if route.kernel == "ws":
        return k >= N_MAJOR_SCALE_WS_MIN_K
    return route.kernel in ("tiled", "splitk", "decode")


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


def _ws_in_place_of_tiled(route: Route, device: torch.device, m: int, n: int, k: int, granularity: str,
                          operands_ok: bool) -> Route:
    """The warp-specialized kernel where `route` runs our tiled or persistent kernel and its rule holds
    (WS_MIN_M, WS_MIN_ROW_FILL, WS_MIN_K, WS_MIN_TILES_PER_SM, 128x128 weights, no PDL);
    `operands_ok`: the operands are contiguous and TMA-addressable."""
    if route.kernel not in ("tiled", "persistent") or route.pdl or not _ws_rule(device, m, n, k, granularity,
                                                                                 operands_ok):
        return route
    return Route("ws", ws_config(device, m, n, k))


def ws_config(device: torch.device, m: int, n: int, k: int) -> WsConfig:
    """The warp-specialized kernel's config for a GEMM of 128x128 weights without a table entry: the
    tile width whose waves (each counted whole) times its tile cost are fewest: 128 columns (cost 1,
    WS_CONFIG), 192 (WS_MID_TILE_COST, WS_MID_CONFIG), 256 where K >= WS_WIDE_MIN_K and they make at
    least a wave (WS_WIDE_TILE_COST, WS_WIDE_CONFIG); a tie keeps the narrower tiles."""
    sms = sm_count(device)
    best, cost = WS_CONFIG, _cdiv(_tiles(m, n, 128, 128), sms)
    mid = round(_cdiv(_tiles(m, n, 128, 192), sms) * WS_MID_TILE_COST, 6)  # rounded: exact ties stay ties
    if mid < cost:
        best, cost = WS_MID_CONFIG, mid
    wide = _tiles(m, n, 128, 256)
    if k >= WS_WIDE_MIN_K and wide >= sms and round(_cdiv(wide, sms) * WS_WIDE_TILE_COST, 6) < cost:
        best = WS_WIDE_CONFIG
    return best


def _ws_rule(device: torch.device, m: int, n: int, k: int, granularity: str, operands_ok: bool) -> bool:
    """Whether the warp-specialized kernel's rule holds for this GEMM (see WS_MIN_M)."""
    return (operands_ok and granularity == "block" and m >= WS_MIN_M and k >= WS_MIN_K
            and m >= WS_MIN_ROW_FILL * 128 * _cdiv(m, 128) and ws_device_ok(device)
            and _tiles(m, n, 128, 128) >= WS_MIN_TILES_PER_SM * sm_count(device))


def _tiles(m: int, n: int, block_m: int, block_n: int) -> int:
    return -(-m // block_m) * -(-n // block_n)


def mid_splitk_config(m: int, n: int, k: int, device: torch.device) -> SplitKConfig | None:
    """Split-K above SMALL_M_MAX rows: MID_SPLIT_TILE tiles, enough splits for one program per SM,
    each at least 2 K groups; None where the tiles already fill the GPU or K has fewer than
    MID_SPLIT_MIN_GROUPS groups."""
    bm, bn = MID_SPLIT_TILE
    tiles = _tiles(m, n, bm, bn)
    groups = -(-k // GROUP_SIZE)
    if groups < MID_SPLIT_MIN_GROUPS:
        return None
    split = min(-(-sm_count(device) // tiles), groups // 2)
    if split < 2:
        return None
    split = -(-groups // -(-groups // split))  # no empty splits
    return SplitKConfig(block_m=bm, block_n=bn, split_k=split, num_warps=4, num_stages=4)


def decode_cublas(m: int, n: int, k: int, granularity: str) -> bool:
    """Whether a shape in no table runs cuBLAS with 1x128 scales at up to SMALL_M_MAX rows (where
    cuBLAS takes it): square-ish weights of mid width at any M (DECODE_CUBLAS_MIN_NK,
    DECODE_CUBLAS_MAX_N, DECODE_CUBLAS_MAX_K_OVER_N); from DECODE_CUBLAS_LONG_K_MIN_M rows also long K
    there, and row-wise weights of any width from DECODE_CUBLAS_WIDE_ROW_MIN_K; never per-tensor
    weights."""
    if granularity not in ("block", "row") or n < DECODE_CUBLAS_MIN_NK or k < DECODE_CUBLAS_MIN_NK:
        return False
    if n <= DECODE_CUBLAS_MAX_N and k <= DECODE_CUBLAS_MAX_K_OVER_N * n:
        return True
    if m < DECODE_CUBLAS_LONG_K_MIN_M:
        return False
    return n <= DECODE_CUBLAS_MAX_N or (granularity == "row" and k >= DECODE_CUBLAS_WIDE_ROW_MIN_K)


def _heuristic(device: torch.device, m: int, n: int, k: int, granularity: str, cublas_ok: bool,
               operands_tma_ok: bool, pdl: bool) -> Route:
    """Shapes without a table entry: above SMALL_M_MAX rows, cuBLAS with 1x128 scales (row-wise
    weights, and 128x128 weights as 1x128 weights) below CUBLAS_ROW_FORM_MAX_TILES_PER_SM 128x128
    tiles per SM, and cuBLAS once the tiles
    give CUBLAS_MIN_TILES_PER_SM per SM; else our split-K where it applies; else cuBLAS from
    CUBLAS_ANY_TILES_M rows; else our persistent or tiled kernel. Up to SMALL_M_MAX rows, cuBLAS
    with 1x128 scales where :func:`decode_cublas` says so."""
    if cublas_ok and m <= SMALL_M_MAX and decode_cublas(m, n, k, granularity):
        return Route("cublas", _ROW_FORM if granularity == "block" else None)
    if cublas_ok and m > SMALL_M_MAX:
        tiles = _tiles(m, n, 128, 128)
        if granularity != "tensor" and tiles < CUBLAS_ROW_FORM_MAX_TILES_PER_SM * sm_count(device):
            return Route("cublas", _ROW_FORM if granularity == "block" else None)
        if tiles >= CUBLAS_MIN_TILES_PER_SM * sm_count(device):
            return Route("cublas")
    route = _ours(device, m, n, k, granularity, operands_tma_ok, pdl)
    if route.kernel != "splitk" and cublas_ok and m >= CUBLAS_ANY_TILES_M:
        return Route("cublas")
    return route


def _choose(device: torch.device, m: int, n: int, k: int, granularity: str, cublas_ok: bool, operands_tma_ok: bool,
            pdl: bool, cutlass_ok: bool = False, ws_ok: bool = False) -> Route:
    """The measured choice where this GPU's table has one (:mod:`fp8linear.ops.route_table`), else the
    heuristic. A CUTLASS entry runs where `cutlass_ok`, a warp-specialized one where `ws_ok`, else
    their fallback entry does; a cuBLAS entry (or fallback) where `cublas_ok`, else the entry's
    ``ours`` (the fastest of our kernels measured there), else our kernels' heuristic."""
    entry = lookup_route(device, m, n, k, granularity)
    if entry is None:
        return _heuristic(device, m, n, k, granularity, cublas_ok, operands_tma_ok, pdl)
    ours = entry.ours
    if entry.kernel in OPTIONAL_KERNELS:
        if (cutlass_ok if entry.kernel == "cutlass" else ws_ok and ws_device_ok(device)):
            return Route(entry.kernel, entry.config)
        entry = entry.fallback
    if entry.kernel == "cublas" and cublas_ok:
        return Route("cublas", entry.config)
    if entry.kernel == "cublas":  # measured fastest but not allowed here: the fastest of ours measured there
        entry = ours
        if entry is not None and entry.kernel == "ws":
            if ws_ok and ws_device_ok(device):
                return Route("ws", entry.config)
            entry = entry.fallback
    if entry is not None and entry.kernel == "splitk":
        return Route("splitk", entry.config, pdl=pdl, release_early=pdl and k <= LONG_SPLITK_K)
    if entry is not None and entry.kernel == "tiled":
        return Route("tiled", entry.config, pdl=pdl, release_early=pdl)
    return _ours(device, m, n, k, granularity, operands_tma_ok, pdl)  # a table without ``ours`` there


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


def use_library_quantization(m: int, k: int, x_dtype: torch.dtype) -> bool:
    """Whether an eager CUTLASS plan for an (m, k) input quantizes it in the library's call
    (bf16 inputs of at most LIB_QUANT_MAX_ELEMENTS; CUDA-graph capture always takes act_quant)."""
    return x_dtype == torch.bfloat16 and m * k <= LIB_QUANT_MAX_ELEMENTS


def eager_cutlass_config(device: torch.device, m: int, n: int) -> CutlassConfig:
    """The CUTLASS kernel an eager call runs in place of our tiled kernel: the ping-pong kernel on
    64x64 tiles where those fit in one wave of the SMs, else on 64x128 tiles where those do, else the
    cooperative kernel on 128x64 tiles where those do, else on 128x128 tiles.

    128x64 tiles where the 64-row ones overflow a wave (H100): 2112x7168 M=512 (136 tiles of 64x128,
    132 of 128x64, 68 of 128x128) eager wall with PDL 25.5 us against 29.7 on 128x128 tiles and 31.5
    for BF16's nn.Linear (benchmarks/eager_one_call_ab.py); the GEMM alone under CUDA graphs 16.8
    against 22.7 (benchmarks/cutlass_probe.py). Where the 64x128 tiles fit too, the 128x64 ones were
    faster in 7 of 10 cases but slower on 1024x8192 M=768 (24.3 against 20.9 us) and M=1024 (24.2
    against 21.4) and 4096x4096 M=256 (14.1 against 12.9), so they keep the 64x128 tiles.

    64x64 tiles: twice the tiles at half the work each, which pays where the 64x128 tiles leave most
    SMs idle on a long K loop. H100, forced routes, the library's quantization included, CUDA graphs
    (GPU us), 64x64 against 64x128 tiles: 576x7168 M 16-512 13.7-18.1 against 19.2-23.5 (M=512:
    18.1 against 23.5, BF16 15.2); 1536x7168 M 16-256 and 2112x7168 M 16-256 13.8-18.4 against
    19.2-21.5; 7168x2048 M 16 and 64 (112 tiles) 9.7 / 8.4 against 10.1 / 9.1. Where they overflow a
    wave they lose: 1536x7168 M=333 (144 tiles) 28.1 against 22.7, 2112x7168 M=333 30.3 against
    23.1, 7168x2048 M=96 12.8 against 9.9, 24576x1536 M 16-512 up to 1.5x. Eager wall (PDL), the
    same cases: 576x7168 M=512 19.2 against 24.5 us, M=333 18.6 against 23.8.

    64x128 against 128x128 tiles (H200, benchmarks/eager_cutlass_ab.py, CUDA graphs, act_quant
    included): where the 64-row tiles fit one wave, 0.83-0.88x the cooperative kernel's time
    (2112x7168 M=333 24.2 against 28.1 us, 576x7168 M=1024 28.8 against 32.9, 1536x7168 M=512 25.6
    against 30.1); where they do not, 1.21-1.38x (2112x7168 M=512, 136 tiles on 132 SMs: 39.9 against
    29.0). Up to 64 rows both make the same number of tiles, the 64-row ones without empty rows: the
    ping-pong kernel at any N (H100, benchmarks/eager_one_call_ab.py, 24576x1536 eager wall M=2 19.9
    against 24.1 us, M=8 19.3 against 22.9, M=64 25.9 against 25.5)."""
    sms = sm_count(device)
    if _cdiv(m, 64) * _cdiv(n, NARROW_TILE_N) <= sms:
        return CutlassConfig(64, tile_n=NARROW_TILE_N)
    if m <= 64 or _cdiv(m, 64) * _cdiv(n, CUTLASS_TILE_N) <= sms:
        return CutlassConfig(64)
    if _cdiv(m, 128) * _cdiv(n, NARROW_TILE_N) <= sms:
        return CutlassConfig(128, tile_n=NARROW_TILE_N)
    return CutlassConfig(128)


def eager_cutlass_over_cublas(device: torch.device, m: int, n: int, k: int) -> bool:
    """Whether an eager call runs CUTLASS (:func:`eager_cutlass_config`) where the router chose cuBLAS:
    GEMMs up to EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK whose kernel tiles fill at least
    EAGER_CUTLASS_MIN_WAVE_FILL of the waves they take (measured on 64x128 and 128x128 tiles: not
    where the 64-column tiles run; against cuBLAS those were not timed at these sizes)."""
    if m * n * k > EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK:
        return False
    sms = sm_count(device)
    cfg = eager_cutlass_config(device, m, n)
    if cfg.tile_n != CUTLASS_TILE_N:  # measured on 64x128 and 128x128 tiles only
        return False
    tiles = _cdiv(m, cfg.tile_m) * _cdiv(n, cfg.tile_n)
    return tiles >= EAGER_CUTLASS_MIN_WAVE_FILL * _cdiv(tiles, sms) * sms


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
                 weight_tma_ok: bool, eager: bool = False, weight_contiguous: bool = False) -> Route:
    """The route of a whole FP8 linear (x not yet quantized, output in x's dtype `out_dtype`).

    `weight_tma_ok`: :func:`tma_ok` of the weight (the quantized activations are made
    16-byte aligned, so they are TMA-addressable whenever K is a multiple of 16).
    `weight_contiguous`: the weight and its scale are contiguous (what the CUTLASS kernels read;
    the quantized activations always are). `eager`: the
    caller launches eagerly (not in a CUDA graph or compiled region), where host time per call
    counts as much as GPU time (see ONE_LAUNCH_MAX_WEIGHT, EAGER_CUBLAS_MIN_MNK and
    EAGER_CUTLASS_MIN_MNK).
    """
    if use_fused_gemv(m, n, k) or (eager and _eager_gemv(m, n, k)):
        return Route("gemv", gemv_config(m, n, k))
    mnk = m * n * k
    cublas_ok = (allow_cublas and not (eager and mnk < EAGER_CUBLAS_MIN_MNK)
                 and cublas_accepts(n, k, granularity, fp8_dtype, out_dtype, bias) and cublas_device_ok(device))
    # the quantized activations are 16-byte aligned with K-long rows: TMA-addressable where K % 16 == 0
    cutlass_fits = (allow_cublas and weight_tma_ok and weight_contiguous
                    and cutlass_accepts(n, k, granularity, fp8_dtype, out_dtype, bias) and cutlass_available(device))
    cutlass_ok = cutlass_fits and not (eager and mnk < EAGER_CUTLASS_MIN_MNK)
    if (eager and m >= EAGER_ONE_CALL_MIN_M and mnk < EAGER_CUTLASS_MIN_MNK and n * k < EAGER_ONE_CALL_MAX_WEIGHT
            and cutlass_fits and granularity == "block" and use_library_quantization(m, k, out_dtype)
            and one_call_available()):
        cfg = eager_cutlass_config(device, m, n)
        return Route("cutlass", cfg, pdl=_eager_cutlass_pdl(cfg, n, k, bias))
    pdl = use_pdl(device, m)
    one_launch = eager and n * k < ONE_LAUNCH_MAX_WEIGHT and not pdl and _one_launch_decode_ok(device)
    if one_launch and 1 <= m <= SMALL_M_MAX:
        cfg = _decode_config(device, m, n, k, granularity)
        if cfg is not None:
            return Route("decode", cfg)
    ws_operands_ok = weight_tma_ok and weight_contiguous and k % _TMA_ALIGN == 0
    route = _choose(device, m, n, k, granularity, cublas_ok, weight_tma_ok and k % _TMA_ALIGN == 0, pdl, cutlass_ok,
                    ws_ok=ws_operands_ok and not eager and not pdl)
    if one_launch and m > SMALL_M_MAX and mnk <= ONE_LAUNCH_MAX_MNK and route.kernel in ("splitk", "tiled"):
        cfg = route.config if route.kernel == "splitk" else _one_split(route.config)
        if cfg is not None and counters_fit(m, n, cfg):
            return Route("decode", cfg)
    if eager and m > SMALL_M_MAX and cutlass_ok and granularity == "block" and (  # measured on 128x128 weights
            route.kernel == "tiled" and not _table_tiled(device, m, n, k, granularity)
            or route.kernel == "cublas" and eager_cutlass_over_cublas(device, m, n, k)):
        cfg = eager_cutlass_config(device, m, n)
        pdl = use_library_quantization(m, k, out_dtype) and _eager_cutlass_pdl(cfg, n, k, bias)
        return Route("cutlass", cfg, pdl=pdl)
    if eager:  # eager plans keep the tiled kernel's prepared launch (see WS_MIN_M)
        return route
    return _ws_in_place_of_tiled(route, device, m, n, k, granularity, ws_operands_ok)


def _table_tiled(device: torch.device, m: int, n: int, k: int, granularity: str) -> bool:
    """Whether this GPU's routes table names our tiled kernel here: the tables are timed against the
    CUTLASS kernels where they are built (tune-routes), so such an entry beat them."""
    entry = lookup_route(device, m, n, k, granularity)
    return entry is not None and entry.kernel == "tiled"


def route_gemm(device: torch.device, m: int, n: int, k: int, granularity: str, fp8_dtype: torch.dtype,
               out_dtype: torch.dtype, bias: torch.Tensor | None, allow_cublas: bool,
               operands_tma_ok: bool, operands_contiguous: bool = False) -> Route:
    """The route of a GEMM on already quantized activations (no fused GEMV; where cuBLAS runs an M
    that is not a multiple of 4, :func:`~fp8linear.ops.cublas_gemm.cublas_fp8_gemm` pads a copy).
    `operands_contiguous`: x_q, w_q and w_s are contiguous (what the CUTLASS kernels read; x_s is
    made row-major contiguous for every kernel but cuBLAS)."""
    cublas_ok = (allow_cublas and cublas_accepts(n, k, granularity, fp8_dtype, out_dtype, bias)
                 and cublas_device_ok(device))
    cutlass_ok = (allow_cublas and operands_tma_ok and operands_contiguous
                  and cutlass_accepts(n, k, granularity, fp8_dtype, out_dtype, bias) and cutlass_available(device))
    pdl = use_pdl(device, m)
    ws_operands_ok = operands_tma_ok and operands_contiguous
    route = _choose(device, m, n, k, granularity, cublas_ok, operands_tma_ok, pdl, cutlass_ok,
                    ws_ok=ws_operands_ok and not pdl)
    return _ws_in_place_of_tiled(route, device, m, n, k, granularity, ws_operands_ok)


# ----------------------------------------------------------------------------- grouped MoE GEMMs
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
    return 0 < num_pairs and num_pairs * (1 << num_experts.bit_length()) <= ALIGN_KERNEL_MAX_WORK


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
    if device_arch() is not None:  # AMD tiles and options on ROCm
        return amd_grouped_config(num_pairs, num_experts)
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:  # decode: each block is ~one expert's few rows; stream W with the smallest M tile
        return GemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if rows_per_expert <= GROUPED_WIDE_TILE_MAX_ROWS:  # little padding per expert, one warpgroup per tile
        return GemmConfig(block_m=64, block_n=128, block_k=128, group_m=4, num_warps=4, num_stages=4)
    return GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)


def amd_grouped_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """Grouped MoE GEMM tiles on AMD from the rows per expert, as grouped_config does on NVIDIA,
    with AMD options and 2 stages (NVIDIA's 128x128 / 4 stages needs 96 KiB of LDS; a CU has 64)."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:
        return amd_gemm_config(16, 64, group_m=1)
    if rows_per_expert <= 384:
        return amd_gemm_config(64, 128, group_m=4)
    return amd_gemm_config(128, 128, group_m=8)


def moe_align_num_warps() -> int:
    """Warps of the one-program MoE alignment kernel: 8 on AMD (with 4 it spills 23 SGPRs on
    gfx942), 4 elsewhere."""
    return 4 if device_arch() is None else 8
