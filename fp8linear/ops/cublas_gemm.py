"""Prefill-sized blockwise FP8 GEMMs on cuBLAS, where it is faster than ours.

On Hopper, cuBLAS (CUDA >= 12.9; cuBLASLt called directly, :mod:`fp8linear.ops.cublaslt`, with
``torch._scaled_mm`` where that cannot run) runs the DeepSeek-V3
recipe itself: 1x128 activation scales with 128x128 ("block") or 1x128 ("row") weight scales,
promoted to fp32 per K group like our kernel. At M >= 1024 it beat our Triton kernel by 1.43x
(geometric mean of the H100 benchmark, docs/benchmarks.md): with fp32 promotion the register
file caps a Triton tile at 128x128, and 128x128 tiles cannot feed the tensor cores at cuBLAS's
rate even without promotion (Gluon experiment, benchmarks/gluon_prefill.py).
At decode sizes and where few output tiles leave SMs idle our kernels win (split-K, the fused
GEMV). So under ``backend="auto"`` the router (:mod:`fp8linear.ops.router`) hands a GEMM to cuBLAS
where cuBLAS computes it correctly (:func:`cublas_accepts`) and is the faster kernel, and
``backend="triton"`` never does.

What cuBLAS takes, probed on H100 with torch 2.11 + CUDA 13.0 (the GPU tests in
tests/test_cublas_gemm.py check these rules against the reference):

- activations: FP8 (M, K) row-major, M a multiple of 4 (other M run on a padded copy, made by one
  kernel), K a multiple of 16; scales (M, K/128)
  M-major (stride (1, M)). :func:`fp8linear.ops.quant.act_quant` writes them that way directly
  (``cublas_layout=True``), padding M with zero rows, so no copy is needed;
- 128x128 weights: scale_b = ``w_s.t()`` of the contiguous (N/128, K/128) grid whose rows cuBLAS
  reads with a leading dimension of K/128 rounded up to a multiple of 4. Where K/128 is not a
  multiple of 4 (K=256, 1408, 2304, 29568, ...) the grid's rows are padded to it (a small copy,
  made once per layer by :class:`fp8linear.ops.linear.CublasLinear`, per call on the functional
  path); unpadded, cuBLAS accepts the grid and returns garbage (relative error 0.09 to 1e33).
  ``torch._scaled_mm`` refuses a padded grid, so where it runs such weights go as 1x128 weights;
- 128x128 weights as 1x128 weights (``CublasConfig(row_scales=True)``, a routes-table choice):
  each block scale repeated over its 128 rows is the same dequantization, exactly, and cuBLAS's
  1x128-scaled kernels are faster at low tile counts (H100, `benchmarks/cublaslt_probe.py
  --padded-grid`: 0.47-0.70x the 128x128 kernels' time at M <= 32, up to 1.7x slower at M >= 1024;
  the crossover is near half a 128x128 output tile per SM);
- 1x128 weights: scale_b = the (K/128, N) transpose, contiguous: a view of an N-major scale
  (stride (1, N), the copy ``Fp8BlockLinear`` keeps), else a small copy per call on the
  functional path;
- N a multiple of 16; ``float8_e4m3fn`` only; bf16 output (the only one verified), bias fused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..formats import GROUP_SIZE
from .cublaslt import LT_WORKSPACE_LIMIT, lt_aligned, lt_operands_ok, shape_gemm

__all__ = ["CublasConfig", "algo_rows", "workspace_limit", "CUBLAS_ROW_ALIGN", "CUBLAS_EXPANDED_MIN_K", "cublas_accepts",
           "cublas_device_ok", "cublas_fp8_gemm", "padded_rows_view", "config_row_scales", "cublas_row_scales",
           "cublas_weight_scale", "held_scale", "held_weight_scale"]

# cuBLAS wants 16-byte aligned rows: K and N multiples of 16.
_ALIGN_KN = 16
# and M (the M-major activation scales' leading dimension) a multiple of 4 (16 bytes of fp32).
CUBLAS_ROW_ALIGN = 4
# cuBLAS reads the 128x128 scale grid's rows (K/128 fp32 values) 16 bytes apart (see module docstring).
_BLOCK_SCALE_ROW_ALIGN = 4
# 128x128 weights whose K/128 is not a multiple of 4 go to cuBLAS from this K up (the router
# decides by measurement where it runs them). H100, CUDA graphs, cuBLAS with the weight as 1x128
# scales held against ours (benchmarks/midm_probe.py --parts shortk), M=512/2048/8192:
# 1536x576 5.0/11.0/26.7 vs 5.0/11.7/34.7 us; 7168x640 9.8/30.4/101.1 vs 12.3/33.0/115.7;
# 4096x384 5.5/15.6/46.5 vs 7.7/14.6/48.6; 7168x256 6.9/20.6/64.8 vs 8.4/19.9/68.0. With the
# grid made per call (the functional path) 7168x640 and 7168x256 tied or lost at M=1024-4096;
# K=128 (one group) stays on our kernel.
CUBLAS_EXPANDED_MIN_K = 256
# Blockwise scaling in torch._scaled_mm was verified with this torch (2.11 + CUDA 13.0, H100).
_MIN_TORCH = (2, 11)
_MIN_CUDA = (12, 9)


@dataclass(frozen=True)
class CublasConfig:
    """A cuBLAS route's options: the largest cuBLASLt workspace (MiB) its algorithm may use, and
    whether 128x128 weights go to cuBLAS as 1x128 weights (`row_scales`, see the module docstring;
    no effect on 1x128 weights, which always do). cuBLASLt's heuristic picks per M among the
    algorithms that fit. The default, 1 MiB, is torch's default
    for torch._scaled_mm; 32 MiB admits split-K algorithms that pay at mid M on many shapes (H100,
    1536x7168 at M=128: 17.1 against 22.2 us) and lose on others (8192x29568 at M=128: 113.6
    against 103.3). `fp8linear tune-routes` times both and its table names 32 where that won (the
    H200 tables and the H100 row-wise section were measured with 32 MiB only, and name it wherever
    cuBLAS won).

    `algo_m` (0: none; else a row count cuBLAS takes, a multiple of 4): run the algorithm cuBLASLt's
    heuristic picks for `algo_m` rows instead of the one it picks for the GEMM's own (padded) rows,
    where cuBLASLt accepts it for those (``cublasLtMatmulAlgoCheck``; else their own). The heuristic's choice is not monotonic in
    M: H100, 1x128 weights, 4096x14336 at M=320 79.8 us against 56.8 at M=384 (BF16 63.4), 2048x7168
    at M=640 42.1 against 30.5 at M=768. `tune-routes` times the algorithms of the next table Ms and
    names one where it won. ``torch._scaled_mm`` (where cuBLASLt is not called directly) ignores it."""

    workspace_mib: int = LT_WORKSPACE_LIMIT >> 20
    row_scales: bool = False
    algo_m: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.workspace_mib, int) or not 1 <= self.workspace_mib <= 1024:
            raise ValueError(f"CublasConfig.workspace_mib must be an int in [1, 1024], got {self.workspace_mib!r}")
        if not isinstance(self.row_scales, bool):
            raise TypeError(f"CublasConfig.row_scales must be a bool, got {self.row_scales!r}")
        if type(self.algo_m) is not int or self.algo_m < 0 or self.algo_m % CUBLAS_ROW_ALIGN:
            raise ValueError(f"CublasConfig.algo_m must be an int >= 0 and a multiple of {CUBLAS_ROW_ALIGN} "
                             f"(0: the GEMM's own rows), got {self.algo_m!r}")

    @property
    def workspace_limit(self) -> int:
        return self.workspace_mib << 20


def workspace_limit(config: CublasConfig | None) -> int:
    """The cuBLASLt workspace limit in bytes of a cuBLAS route's config (None: the default)."""
    return LT_WORKSPACE_LIMIT if config is None else config.workspace_limit


def algo_rows(config: CublasConfig | None) -> int:
    """The row count whose heuristic algorithm a cuBLAS route's config runs (0: the GEMM's own)."""
    return 0 if config is None else config.algo_m


def config_row_scales(config: CublasConfig | None) -> bool:
    """Whether a cuBLAS route's config hands 128x128 weights to cuBLAS as 1x128 weights."""
    return config is not None and config.row_scales


def _version(text: str | None) -> tuple[int, ...]:
    parts = []
    for p in (text or "0").split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def cublas_accepts(n: int, k: int, granularity: str, fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> bool:
    """Whether cuBLAS blockwise computes this GEMM correctly, for any M (device aside); whether it is
    also the faster kernel is the router's decision (:mod:`fp8linear.ops.router`)."""
    if n % _ALIGN_KN or k % _ALIGN_KN:
        return False
    if fp8_dtype != torch.float8_e4m3fn or out_dtype != torch.bfloat16:
        return False
    if bias is not None and bias.dtype != torch.bfloat16:
        return False
    if granularity == "block":
        return not _block_grid_needs_padding(k) or k >= CUBLAS_EXPANDED_MIN_K
    return granularity == "row"


def _block_grid_needs_padding(k: int) -> bool:
    """Whether this K's 128x128 scale grid needs its rows padded for cuBLAS (see above): through
    cuBLASLt it goes padded, through ``torch._scaled_mm`` (which refuses a padded grid) as 1x128 scales."""
    return (-(-k // GROUP_SIZE)) % _BLOCK_SCALE_ROW_ALIGN != 0


@lru_cache(maxsize=16)
def _device_ok(index: int) -> bool:
    if torch.version.hip is not None or _version(torch.__version__) < _MIN_TORCH:
        return False
    if _version(torch.version.cuda) < _MIN_CUDA:
        return False
    return torch.cuda.get_device_capability(index)[0] == 9  # Hopper: SM90's cuBLAS blockwise kernels


def cublas_device_ok(device: torch.device) -> bool:
    """Whether this device and torch build run cuBLAS blockwise FP8 (Hopper, CUDA >= 12.9, torch >= 2.11)."""
    if device.type != "cuda":
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def cublas_fp8_gemm(
    x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
    bias: torch.Tensor | None, config: CublasConfig | None = None, scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (M, N) bf16 = dequant(x_q, x_s) @ dequant(w_q, w_s).T (+ bias) on cuBLAS.

    x_q (M, K); x_s (M, K/128) in any layout (M-major is used as is); w_s (N/128, K/128) for
    'block', (N, K/128) for 'row'. Shapes must pass cublas_accepts. An M that is not a multiple of
    4 runs on a padded copy of x_q and its scales (:func:`fp8linear.ops.quant.act_quant`
    writes that layout directly, so the linear layer never copies), or on no copy where x_q and
    x_s are the first M rows of that layout (:func:`padded_rows_view`); the padding rows are dropped.
    `config`: the route's cuBLASLt workspace limit, weight-scale form and algorithm rows
    (:class:`CublasConfig`; None: the defaults); the scale in that form is made once and kept on
    `w_s` (:func:`held_weight_scale`), or given (`scale_b`: :func:`cublas_weight_scale` of this
    weight for this config's form). Operands cuBLASLt is not
    called on here (:func:`~fp8linear.ops.cublaslt.lt_operands_ok`, an unaligned or strided x_q) run
    ``torch._scaled_mm``, at torch's own limit, with the scale form it reads.
    """
    if scale_b is not None:
        _check_held_scale(scale_b, w_q, granularity, cublas_row_scales(w_q, granularity, config))
    m = x_q.shape[0]
    if m % CUBLAS_ROW_ALIGN:
        x_q, x_s = padded_rows_view(x_q, x_s) or _pad_rows(x_q, x_s)
    elif x_s.stride(0) != 1 or x_s.stride(1) != x_s.shape[0]:
        x_s = x_s.t().contiguous().t()  # M-major
    rows, (n, k) = x_q.shape[0], w_q.shape
    as_rows = cublas_row_scales(w_q, granularity, config)
    lt = None
    if (x_q.dtype == w_q.dtype and x_q.shape[1] == k and x_s.dtype == torch.float32 and x_q.is_contiguous()
            and lt_aligned(x_q) and lt_operands_ok(w_q, w_s, bias)):
        lt = shape_gemm(x_q.device.index if x_q.device.index is not None else torch.cuda.current_device(), n, k,
                        as_rows, bias is not None, workspace_limit(config))
    if lt is not None:  # the algorithm the module's cuBLAS route runs (fp8linear.ops.cublaslt)
        y = torch.empty((rows, n), dtype=torch.bfloat16, device=x_q.device)
        held = scale_b if scale_b is not None else held_weight_scale(w_q, w_s, granularity, as_rows)
        if not lt.run_on(rows, w_q, held, bias, x_q, x_s, y, algo_rows(config)):
            lt = None
    if lt is None:
        scale_b = held_weight_scale(w_q, w_s, granularity, cublas_row_scales(w_q, granularity, config, direct=False))
        y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=scale_b, bias=bias, out_dtype=torch.bfloat16)
    return y if y.shape[0] == m else y[:m]  # a contiguous view


def _check_held_scale(scale_b: torch.Tensor, w_q: torch.Tensor, granularity: str, as_rows: bool) -> None:
    """A held cuBLAS weight scale must have the shape and strides cublas_weight_scale gives this form."""
    n, k = w_q.shape
    groups = -(-k // GROUP_SIZE)
    if as_rows:
        want, strides = (groups, n), (n, 1)
    else:
        blocks = -(-n // GROUP_SIZE)
        want, strides = (groups, blocks), (1, groups + (-groups % _BLOCK_SCALE_ROW_ALIGN))
    if (not isinstance(scale_b, torch.Tensor) or scale_b.dtype != torch.float32 or tuple(scale_b.shape) != want
            or any(size > 1 and st != s for size, st, s in zip(want, scale_b.stride(), strides))):
        got = (f"{tuple(scale_b.shape)} {scale_b.dtype} strides {scale_b.stride()}" if isinstance(scale_b, torch.Tensor)
               else type(scale_b).__name__)
        form = "1x128" if as_rows else "128x128"
        raise ValueError(f"scale_b must be this {granularity} weight's cuBLAS scale in the {form} form "
                         f"(cublas_weight_scale): float32 {want} strides {strides}, got {got}")


def padded_rows_view(x_q: torch.Tensor, x_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x_q (M, K) and x_s (M, G) as views of M rounded up to CUBLAS_ROW_ALIGN rows where they are the
    first M rows of act_quant's cuBLAS layout (``act_quant(x, cublas_layout=True)`` sliced to M rows):
    x_q row-major with the padding rows in its storage, x_s M-major with that row count as its
    leading dimension, its storage holding every group's padding rows. Else None (copy them). The
    padding rows' values only reach output rows that are dropped."""
    m, k = x_q.shape
    rows = -(-m // CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN
    groups = x_s.shape[1]
    if x_q.stride() != (k, 1) or x_s.stride() != (1, rows) or groups == 0 or k == 0:
        return None
    if (x_q.untyped_storage().nbytes() < (x_q.storage_offset() + rows * k) * x_q.element_size()
            or x_s.untyped_storage().nbytes() < (x_s.storage_offset() + groups * rows) * x_s.element_size()):
        return None
    return x_q.as_strided((rows, k), (k, 1)), x_s.as_strided((rows, groups), (1, rows))


def _pad_rows(x_q: torch.Tensor, x_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_q and x_s with M rounded up to CUBLAS_ROW_ALIGN, scales M-major (:mod:`.cublas_pad`, one kernel)."""
    from .cublas_pad import pad_rows  # Triton: imported where a GPU GEMM runs, so this module loads without it

    return pad_rows(x_q, x_s, -(-x_q.shape[0] // CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN)


def cublas_row_scales(w_q: torch.Tensor, granularity: str, config: CublasConfig | None = None,
                      direct: bool = True) -> bool:
    """Whether cuBLAS reads this weight's scale (:func:`cublas_weight_scale`) as 1x128 scales rather
    than 128x128: 1x128 weights; 128x128 weights where the route's `config` says so, or whose K/128 is
    not a multiple of 4 when cuBLAS is reached through ``torch._scaled_mm`` (`direct` False), which
    refuses the padded grid."""
    if granularity == "row":
        return True
    return granularity == "block" and (config_row_scales(config) or (not direct and _block_grid_needs_padding(w_q.shape[1])))


class _HeldScales(dict):
    """The layouts made from one weight-scale tensor (cuBLAS's, keyed by (1x128 form, N); the narrow
    CUTLASS tiles', by ("narrow", tile width, N)); `source` is the scale's (version counter, address)
    they were made from. Pickles empty (a cache, not data)."""

    __slots__ = ("source",)

    def __init__(self, source: tuple | None = None) -> None:
        super().__init__()
        self.source = source

    def __reduce__(self):
        return (_HeldScales, ())


# The attribute of a weight-scale tensor that holds its cuBLAS layouts (held_weight_scale).
_HELD_ATTR = "_fp8linear_cublas_scales"


def held_weight_scale(w_q: torch.Tensor, w_s: torch.Tensor, granularity: str, as_rows: bool) -> torch.Tensor:
    """:func:`cublas_weight_scale`, made once per scale tensor and form and kept on `w_s` itself (an
    attribute, dropped with the tensor; made again when `w_s` is changed in place or re-pointed), so
    the functional path and compiled models (whose custom ops get the layer's own scale tensor each
    call) pay no per-call copy: the 1x128 form of a 128x128 weight is N x K/128 fp32 written per call
    otherwise, and a padded grid or a K-major 1x128 scale a small copy each. Where the layout is a
    view of `w_s` nothing is kept. Not kept while a CUDA graph is being captured (a captured copy
    holds its values only once the graph replays): the graph then makes it per replay."""
    n = w_q.shape[0]
    if granularity == "row" and w_s.stride(0) == 1 and (w_s.shape[1] == 1 or w_s.stride(1) == w_s.shape[0]):
        return w_s.t()  # dense N-major: the (K/128, N) layout is a view
    if granularity == "block" and not as_rows and not _block_grid_needs_padding(w_q.shape[1]) and w_s.is_contiguous():
        return w_s.t()
    return held_scale(w_s, (as_rows, n), lambda: cublas_weight_scale(w_q, w_s, granularity, as_rows))


def held_scale(w_s: torch.Tensor, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, a layout of the weight scale `w_s`, made once per scale tensor and `key` and kept
    on `w_s` itself (see :func:`held_weight_scale`): on a GPU made outside any CUDA-graph memory pool
    (:func:`_made_outside_pools`); not kept while a CUDA graph is being captured (a captured copy
    holds its values only once the graph replays)."""
    held = w_s.__dict__.get(_HELD_ATTR)
    source = (None if w_s.is_inference() else w_s._version, w_s.data_ptr())  # inference tensors have no version
    scale = held.get(key) if held is not None and held.source == source else None
    if scale is not None:
        return scale
    if w_s.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return make()
        scale = _made_outside_pools(make, w_s.device)
    else:
        scale = make()
    if held is None or held.source != source:
        held = _HeldScales(source)
        setattr(w_s, _HELD_ATTR, held)
    held[key] = scale
    return scale


def _made_outside_pools(make_scale: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make_scale()`` run on a helper thread and its own stream, ordered after the caller's
    stream: a CUDA-graph memory pool may be taking the calling thread's allocations
    (torch.compile's "reduce-overhead" warm-up runs allocate from its graphs' pool, whose memory
    later runs reuse), and a layout kept past the call must not live there."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    made: list = []

    def make() -> None:
        try:
            with torch.cuda.stream(side):
                made.append(make_scale())
        except Exception as e:  # handed to the caller below
            made.append(e)

    helper = threading.Thread(target=make, name="fp8linear-cublas-scale")
    helper.start()
    helper.join()
    if isinstance(made[0], Exception):
        raise made[0]
    scale = made[0]
    current.wait_stream(side)
    scale.record_stream(current)
    return scale


def cublas_weight_scale(w_q: torch.Tensor, w_s: torch.Tensor, granularity: str, as_rows: bool) -> torch.Tensor:
    """The weight scale in the layout cuBLAS reads (see the module docstring); a plan makes it once.
    `as_rows`: :func:`cublas_row_scales` of the path it is for (1x128 scales (K/128, N), else the
    128x128 grid, its rows padded to a multiple of 4 where needed: cuBLASLt only)."""
    if granularity == "row":
        return w_s.t().contiguous()
    if as_rows:  # each block scale repeated over its 128 rows: the same weight, as cuBLAS's 1x128 grid (K/128, N)
        groups, blocks = w_s.shape[1], w_s.shape[0]
        rows = w_s.t().unsqueeze(-1).expand(groups, blocks, GROUP_SIZE).reshape(groups, blocks * GROUP_SIZE)
        return rows[:, : w_q.shape[0]].contiguous()
    groups = w_s.shape[1]
    pad = -groups % _BLOCK_SCALE_ROW_ALIGN
    if pad:  # cuBLAS reads the grid's rows with a leading dimension rounded up to a multiple of 4
        return torch.nn.functional.pad(w_s, (0, pad))[:, :groups].t()
    return (w_s if w_s.is_contiguous() else w_s.contiguous()).t()
