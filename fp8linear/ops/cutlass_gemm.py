"""The blockwise FP8 GEMM on CUTLASS's Hopper warp-specialized kernels: an optional backend, built
once by ``fp8linear build-cutlass`` and loaded from the cache.

CUTLASS's sm_90a kernels (``fp8linear/ops/cutlass/blockwise_gemm.cu``) run the DeepSeek-V3 recipe
with a TMA producer warp and consumer warpgroups that get the registers (what a Triton ``tl``
kernel cannot do on Hopper, see :mod:`fp8linear.ops.gemm`): the ping-pong kernel on 64x128 tiles
and the cooperative kernel on 128x128 tiles, data-parallel or stream-K, and for 128x128 weights
both on 64-column tiles too (64x64 and 128x64, reading the weight scale per 64 rows:
:func:`narrow_block_scale`). They read the activation
scales row-major and the 128x128 weight scale grid as stored (1x128 weight scales N-major: the
(K/128, N) layout :func:`fp8linear.ops.cublas_gemm.held_weight_scale` gives, a view of the copy
``Fp8BlockLinear`` keeps), and take any M, so nothing is padded (the 64-column tiles read a small
copy of the grid), where cuBLAS needs M a multiple of 4 and, for K/128 not a multiple of 4, a
padded grid (:mod:`fp8linear.ops.cublas_gemm`). H100, CUDA graphs, GEMM alone (benchmarks/cutlass_probe.py,
16 shapes x M 64-4096, 160 cases): the faster of the 64- and 128-row kernels beat the routed
kernel by more than 3% in 55 cases, e.g. 2048x7168 at M=333 19.0 against 22.6 us (BF16 20.6),
1536x576 at M=4096 12.7 against 18.4; at M >= 1024 on large weights they are cuBLAS blockwise's
speed. So the router runs CUTLASS only where a routes table measured it fastest
(:mod:`fp8linear.ops.route_table`), and the kernel measured next where the library is not built.

The library is compiled by nvcc from that source and CUTLASS's headers (the ``nvidia-cutlass``
package, or ``CUTLASS_PATH``) into the cache (:func:`library_path`), by
:mod:`fp8linear.tools.cutlass_build`: never on the forward path. Where it is not built, the GPU is
not an sm_90 part, its code does not load (a probe per kernel, once per GPU), or
``FP8LINEAR_CUTLASS=0`` (read once), :func:`cutlass_available` is False (a log line says why,
except for the variable) and nothing changes. Calls go through ``ctypes`` on raw addresses, on the
current stream, so they are CUDA-graph capturable; the bits are the same on every call of a shape.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import logging
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .config_tables import cache_dir
from .configs import sm_count
from .cublas_gemm import held_scale, held_weight_scale

__all__ = ["CUTLASS_CANDIDATES", "CUTLASS_CONFIGS", "CUTLASS_ROW_CONFIGS", "CUTLASS_ENV", "CUTLASS_TILE_N", "MAX_SPLITS",
           "CutlassConfig", "SOURCE", "BUILD_FLAGS", "PLAN_CALL_SOURCE", "PLAN_CALL_MODULE", "library_path",
           "plan_call_path",
           "CutlassCall", "candidates_for", "configs_for", "cutlass_accepts", "cutlass_available",
           "cutlass_fp8_gemm", "narrow_block_scale", "one_call_available", "pdl_supported", "variants"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "cutlass" / "blockwise_gemm.cu"
# nvcc flags every object is built with (the sm_90a target: wgmma and setmaxnreg need it).
BUILD_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
               "-gencode=arch=compute_90a,code=sm_90a")
CUTLASS_ENV = "FP8LINEAR_CUTLASS"  # "0" turns the backend off (read once per process)
_LIBRARY_NAME = "libfp8linear_cutlass.so"
# The eager plans' one-call host side (allocations and the library call from C++), a Python
# extension module built against the installed torch by ``fp8linear build-cutlass``.
PLAN_CALL_SOURCE = SOURCE.with_name("plan_call.cpp")
PLAN_CALL_MODULE = "fp8linear_plan_call"
# TMA: 16-byte aligned bases and rows (K a multiple of 16 FP8 values, N of 8 bf16 outputs).
_ALIGN_BYTES = 16
_ALIGN_K, _ALIGN_N = 16, 8


@dataclass(frozen=True)
class CutlassConfig:
    """A CUTLASS GEMM config: 64-row tiles run the ping-pong kernel (two consumer warpgroups
    alternate between tiles: mid M), 128-row tiles the cooperative kernel (both on one tile);
    `stream_k` (128-row tiles only) schedules it stream-K: where the tiles make a partial last
    wave, SMs share the K loops of those tiles instead of idling. `splits` > 1 (with `stream_k`)
    runs that kernel as split-K instead: every tile's K loop in `splits` parts, their partial sums
    reduced in a fixed order (a runtime argument: :attr:`kernel` is the built kernel it runs on).
    `tile_n` 64 (128x128 weights only, without `stream_k`) runs 64-column tiles: the ping-pong kernel
    on 64x64 tiles, or the cooperative kernel on 128x64 tiles: twice the tiles of the 128-column
    kernel of the same rows at half the work each, where those leave SMs idle on a long K loop; they
    read the weight scale per 64 weight rows (:func:`narrow_block_scale`).
    Written ``p64x128`` / ``p64x64`` / ``c128x128`` / ``c128x64`` / ``s128x128`` / ``kS_128x128``
    (:attr:`name`), and in tune-routes' labels ``cutlass:64`` / ``cutlass:64x64`` / ``cutlass:128`` /
    ``cutlass:128x64`` / ``cutlass:128sk`` / ``cutlass:128kS``."""

    tile_m: int
    stream_k: bool = False
    splits: int = 1
    tile_n: int = 128

    def __post_init__(self) -> None:
        if self.tile_m not in (64, 128):
            raise ValueError(f"CutlassConfig.tile_m must be 64 or 128, got {self.tile_m!r}")
        if not isinstance(self.stream_k, bool):
            raise TypeError(f"CutlassConfig.stream_k must be a bool, got {self.stream_k!r}")
        if type(self.tile_n) is not int or self.tile_n not in (64, 128):
            raise ValueError(f"CutlassConfig.tile_n must be 64 or 128, got {self.tile_n!r}")
        if self.tile_n == 64 and self.stream_k:
            raise ValueError("CutlassConfig.tile_n 64 runs the ping-pong or cooperative kernel: stream_k must be "
                             "False")
        if self.stream_k and self.tile_m != 128:
            raise ValueError("CutlassConfig.stream_k runs the cooperative kernel: tile_m must be 128")
        if type(self.splits) is not int:
            raise TypeError(f"CutlassConfig.splits must be an int, got {self.splits!r}")
        if not 1 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"CutlassConfig.splits must be from 1 to {MAX_SPLITS}, got {self.splits}")
        if self.splits > 1 and not self.stream_k:
            raise ValueError("CutlassConfig.splits > 1 runs the stream-K kernel's split-K mode: stream_k must be True")

    @property
    def name(self) -> str:
        if self.splits > 1:
            return f"k{self.splits}_{self.tile_m}x128"
        kind = "s" if self.stream_k else ("p" if self.tile_m == 64 else "c")
        return f"{kind}{self.tile_m}x{self.tile_n}"

    @property
    def kernel(self) -> CutlassConfig:
        """The built kernel that runs this config (split-K runs on the stream-K kernel)."""
        return CutlassConfig(self.tile_m, self.stream_k) if self.splits > 1 else self


# Split-K parts a config may name: a bound for the tables' values only (CUTLASS's scheduler also
# caps the parts at a tile's K blocks); the candidates below use 2-4.
MAX_SPLITS = 16
# The N width of the kernels' tiles (but the 64-column kernels': CutlassConfig.tile_n).
CUTLASS_TILE_N = 128
# The built kernels (one object each, with and without bias).
CUTLASS_CONFIGS = (CutlassConfig(64), CutlassConfig(64, tile_n=64), CutlassConfig(128),
                   CutlassConfig(128, tile_n=64), CutlassConfig(128, stream_k=True))
# What tune-routes times: the built kernels, and the stream-K kernel as split-K in 2, 3 and 4 parts.
# H200, the shipped entries re-timed against the six other than the 128x64 tiles: split-K won one
# entry by more than 3% (8192x29568 at M=128, 72.2 against 78.3 us); on long K with tiles that leave
# SMs idle it did not help (docs/benchmarks.md, "Split-K on CUTLASS").
CUTLASS_CANDIDATES = CUTLASS_CONFIGS + tuple(CutlassConfig(128, stream_k=True, splits=s) for s in (2, 3, 4))
# The kernels built for 1x128 (row-wise) weights: one scale per weight row and K group, N-major.
CUTLASS_ROW_CONFIGS = (CutlassConfig(64), CutlassConfig(128))


def configs_for(granularity: str) -> tuple[CutlassConfig, ...]:
    """The built kernels for this weight granularity (none for per-tensor weights)."""
    return CUTLASS_CONFIGS if granularity == "block" else CUTLASS_ROW_CONFIGS if granularity == "row" else ()


def candidates_for(granularity: str) -> tuple[CutlassConfig, ...]:
    """What tune-routes times for this weight granularity: its built kernels, and for 128x128
    weights the stream-K kernel as split-K too."""
    return CUTLASS_CANDIDATES if granularity == "block" else configs_for(granularity)


def variants() -> list[tuple[str, dict[str, int]]]:
    """(symbol prefix, compile-time macros) of every object the library holds: each config of each
    granularity with and without a fused bias."""
    out = []
    for granularity in ("block", "row"):
        for cfg in configs_for(granularity):
            for bias in (0, 1):
                out.append((_symbol(cfg, bool(bias), granularity),
                            {"FP8L_TILE_M": cfg.tile_m, "FP8L_TILE_N": cfg.tile_n, "FP8L_STREAMK": int(cfg.stream_k),
                             "FP8L_BIAS": bias, "FP8L_ROW": int(granularity == "row")}))
    return out


def _symbol(cfg: CutlassConfig, bias: bool, granularity: str = "block") -> str:
    return f"fp8l_{'row_' if granularity == 'row' else ''}{cfg.name}" + ("_bias" if bias else "")


def library_path(root: Path | None = None) -> Path:
    """The library built from this package's source and flags, under `root` (default: the package's
    cache folder, :func:`fp8linear.ops.config_tables.cache_dir`): a new source builds a new file."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(repr((BUILD_FLAGS, variants())).encode())
    return (root or cache_dir()) / "cutlass" / digest.hexdigest()[:16] / _LIBRARY_NAME


def plan_call_path(root: Path | None = None) -> Path:
    """The plan-call module built from this package's source for the installed torch and Python,
    under `root` (default: the package's cache folder): a new source, torch or Python gets a new file."""
    digest = hashlib.sha256(PLAN_CALL_SOURCE.read_bytes())
    digest.update(repr((torch.__version__, sys.version_info[:2], torch.compiled_with_cxx11_abi())).encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return (root or cache_dir()) / "cutlass-plan-call" / digest.hexdigest()[:16] / f"{PLAN_CALL_MODULE}{suffix}"


@lru_cache(maxsize=1)
def _plan_call():
    """The built plan-call module, loaded once per process; None (with a log line) where it is not built
    or does not load: eager plans then allocate in Python and call the library through ``ctypes``."""
    try:
        path = plan_call_path()
    except OSError as e:
        log.warning("fp8linear: CUTLASS plan-call source not readable (%s); eager plans call the library "
                    "through ctypes", e)
        return None
    if not path.is_file():
        log.info("fp8linear: CUTLASS plan call not built (no %s); `fp8linear build-cutlass` builds it", path)
        return None
    try:
        spec = importlib.util.spec_from_file_location(PLAN_CALL_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as e:
        log.warning("fp8linear: CUTLASS plan call %s not usable (%s); eager plans call the library through "
                    "ctypes", path, e)
        return None


class _Library:
    """The loaded library's entry points, per (config, bias, granularity)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.run, self.workspace, self.probe = {}, {}, {}
        self.prepare, self.run_prepared, self.quant_run_prepared, self.release = {}, {}, {}, {}
        self.quant_run_prepared_pdl, self.pdl = {}, {}
        for granularity in ("block", "row"):
            for cfg, bias in ((c, b) for c in configs_for(granularity) for b in (False, True)):
                sym = _symbol(cfg, bias, granularity)
                run = getattr(lib, f"{sym}_run")
                run.restype = ctypes.c_int
                run.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 2
                ws = getattr(lib, f"{sym}_workspace_size")
                ws.restype = ctypes.c_size_t
                ws.argtypes = [ctypes.c_int] * 6
                probe = getattr(lib, f"{sym}_probe")
                probe.restype = ctypes.c_int
                probe.argtypes = []
                prepare = getattr(lib, f"{sym}_prepare")
                prepare.restype = ctypes.c_void_p
                prepare.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
                run_prepared = getattr(lib, f"{sym}_run_prepared")
                run_prepared.restype = ctypes.c_int
                run_prepared.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p]
                quant_run_prepared = getattr(lib, f"{sym}_quant_run_prepared")
                quant_run_prepared_pdl = getattr(lib, f"{sym}_quant_run_prepared_pdl")
                for fn in (quant_run_prepared, quant_run_prepared_pdl):
                    fn.restype = ctypes.c_int
                    fn.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_longlong] + [ctypes.c_void_p] * 3
                                   + [ctypes.c_int] * 3 + [ctypes.c_void_p])
                pdl = getattr(lib, f"{sym}_pdl")
                pdl.restype = ctypes.c_int
                pdl.argtypes = []
                release = getattr(lib, f"{sym}_release")
                release.restype = None
                release.argtypes = [ctypes.c_void_p]
                key = (cfg, bias, granularity)
                self.run[key], self.workspace[key], self.probe[key] = run, ws, probe
                self.prepare[key], self.run_prepared[key], self.release[key] = prepare, run_prepared, release
                self.quant_run_prepared[key] = quant_run_prepared
                self.quant_run_prepared_pdl[key] = quant_run_prepared_pdl
                self.pdl[key] = bool(pdl())


@lru_cache(maxsize=1)
def _library() -> _Library | None:
    """The built library, loaded once per process (a library built later is seen by the next process)."""
    try:
        path = library_path()
    except OSError as e:  # an install without the kernel source
        log.warning("fp8linear: CUTLASS kernel source not readable (%s); running without CUTLASS", e)
        return None
    if not path.is_file():
        log.info("fp8linear: CUTLASS kernels not built (no %s); `fp8linear build-cutlass` builds them", path)
        return None
    try:
        return _Library(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as e:
        log.warning("fp8linear: CUTLASS library %s not usable (%s); running without it", path, e)
        return None


@lru_cache(maxsize=16)
def _device_ok(index: int) -> bool:
    if os.environ.get(CUTLASS_ENV, "1") == "0" or torch.version.hip is not None:
        return False
    capability = torch.cuda.get_device_capability(index)
    if capability != (9, 0):  # sm_90a code runs on sm_90 only
        log.info("fp8linear: CUTLASS kernels are built for sm_90a; GPU %d is sm_%d%d: not used", index, *capability)
        return False
    lib = _library()
    if lib is None:
        return False
    with torch.cuda.device(index):
        failed = {cfg.name: rc for (cfg, _, _), probe in lib.probe.items() if (rc := probe()) != 0}
    if failed:  # e.g. built by an nvcc newer than the driver: the code does not load
        log.warning("fp8linear: CUTLASS kernels do not load on GPU %d (cudaError %s); running without them",
                    index, failed)
        return False
    return True


@lru_cache(maxsize=1)
def _several_gpus() -> bool:
    return torch.cuda.device_count() > 1


def one_call_available() -> bool:
    """Whether eager CUTLASS plans allocate, quantize and launch in one host call
    (:meth:`CutlassCall.allocating_call`): the plan-call module loads."""
    return _plan_call() is not None


def pdl_supported(config: CutlassConfig, bias: bool = False, granularity: str = "block") -> bool:
    """Whether the built kernel running `config` (`bias`: its fused-bias variant) may be launched with
    programmatic dependent launch after the library's quantization (CutlassCall's `pdl`): its CTAs are
    placed while the quantization runs, and every producer warp waits in griddepcontrol.wait before its
    first global access (the consumer warps read only what those warps loaded). The data-parallel
    kernels, where the build made the cooperative kernel's scale-loading warp wait
    (fp8linear.tools.cutlass_build.cooperative_overlay); never the stream-K kernel."""
    if not isinstance(config, CutlassConfig):
        raise TypeError(f"pdl_supported takes a CutlassConfig, got {type(config).__name__}")
    if not isinstance(bias, bool):
        raise TypeError(f"pdl_supported takes bias as a bool (whether the kernel fuses one), got {type(bias).__name__}")
    if granularity not in ("block", "row"):
        raise ValueError(f"the CUTLASS kernels take 'block' or 'row' weights, got granularity {granularity!r}")
    lib = _library()
    return lib is not None and lib.pdl.get((config.kernel, bias, granularity), False)


def cutlass_available(device: torch.device) -> bool:
    """Whether CUTLASS GEMMs can run on `device`: a Hopper GPU and the library built for this source,
    its kernels loading there (decided once per GPU)."""
    if device.type != "cuda":
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def cutlass_accepts(n: int, k: int, granularity: str, fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                    bias: torch.Tensor | None) -> bool:
    """Whether the built kernels compute this GEMM (any M; the device and the operands' alignment
    aside): 128x128 or 1x128 weights, e4m3fn, bf16 output and bias, K a multiple of 16 and N of 8."""
    if granularity not in ("block", "row") or fp8_dtype != torch.float8_e4m3fn or out_dtype != torch.bfloat16:
        return False
    if k % _ALIGN_K or n % _ALIGN_N:
        return False
    return bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()
                            and bias.data_ptr() % _ALIGN_BYTES == 0)


class CutlassCall:
    """One CUTLASS GEMM prepared for one weight and M: the entry point, the weight's addresses, the
    scalars and the workspace size held, so that a call passes only the activations', output's and
    workspace's raw device addresses (what an eager plan needs: no tensor, no lookup per call).

    w_q (N, K) e4m3fn, contiguous, on a device where :func:`cutlass_available`; w_s for
    `granularity` "block" (ceil(N/128), ceil(K/128)) fp32 contiguous, for "row" (N, ceil(K/128))
    fp32, read N-major (:func:`_row_scale`); the shape must pass :func:`cutlass_accepts`. The weight
    tensors are held (their addresses stay valid while they are updated in place; the 64-column
    tiles' scale per 64 rows is a copy, :func:`narrow_block_scale`).

    With `prepare` (for calls made many times: a plan's), a data-parallel config's kernel parameters
    are made once here (``_prepare`` in the C source: TMA descriptors encoded, scheduler set up), and
    a call only points them at its activations and output; otherwise, and for the stream-K kernel,
    each call builds them (``_run``). With `pdl` (a kernel built for it, :func:`pdl_supported`),
    :meth:`with_quantization`'s two kernels are launched with programmatic dependent launch: the
    quantization after the stream's previous kernel (it waits for it before reading x), the GEMM
    after the quantization."""

    __slots__ = ("run", "args", "held", "index", "several", "workspace_bytes", "config", "shape", "prepared",
                 "run_prepared", "quant_run_prepared", "release")

    def __init__(self, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None, m: int,
                 config: CutlassConfig, granularity: str = "block", prepare: bool = True, pdl: bool = False) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError(f"the CUTLASS kernels are not built ({library_path()}): run `fp8linear build-cutlass`")
        if not isinstance(config, CutlassConfig):
            raise TypeError(f"CutlassCall takes a CutlassConfig, got {type(config).__name__}")
        if config.kernel not in configs_for(granularity):
            raise ValueError(f"no CUTLASS kernel {config.name} is built for {granularity!r} weights "
                             f"(built: {[c.name for c in configs_for(granularity)]})")
        if pdl and not lib.pdl[(config.kernel, bias is not None, granularity)]:
            variant = "with" if bias is not None else "without"
            built = sorted(c.name for (c, b, g), ok in lib.pdl.items()
                           if ok and g == granularity and b == (bias is not None))
            raise ValueError(f"CutlassCall: the {config.name} kernel {variant} bias is not built to wait for the "
                             f"quantization in every producer warp, so it cannot launch with PDL (built for PDL "
                             f"{variant} bias: {built}), got pdl=True")
        if type(m) is not int or m < 1:
            raise ValueError(f"CutlassCall takes a row count M >= 1 (an int), got {m!r}")
        if w_q.dim() != 2:
            raise ValueError(f"CutlassCall takes a 2-D weight (N, K), got shape {tuple(w_q.shape)}")
        for name, t in (("w_s", w_s), ("bias", bias)):
            if t is not None and t.device != w_q.device:
                raise ValueError(f"CutlassCall: {name} is on {t.device}, the weight on {w_q.device}")
        n, k = w_q.shape
        groups = -(-k // 128)
        if w_q.device.type != "cuda" or not cutlass_accepts(n, k, granularity, w_q.dtype, torch.bfloat16, bias):
            raise ValueError(f"CUTLASS GEMMs take CUDA e4m3fn weights with K % {_ALIGN_K} == 0, N % {_ALIGN_N} == 0 "
                             f"and an aligned bf16 bias or none; got {tuple(w_q.shape)} {w_q.dtype} on {w_q.device}")
        rows = -(-n // 128) if granularity == "block" else n
        if w_s.shape != (rows, groups) or w_s.dtype != torch.float32:
            raise ValueError(f"CUTLASS GEMMs take a ({rows}, {groups}) fp32 weight scale for {granularity} weight "
                             f"{tuple(w_q.shape)}, got {tuple(w_s.shape)} {w_s.dtype}")
        if not w_q.is_contiguous():
            raise ValueError(f"CUTLASS GEMMs need w_q contiguous, got strides {w_q.stride()}")
        if granularity == "block" and not w_s.is_contiguous():
            raise ValueError(f"CUTLASS GEMMs need a 128x128 weight's w_s contiguous, got strides {w_s.stride()}")
        if granularity == "row":
            w_s = _row_scale(w_q, w_s)
        elif config.tile_n != CUTLASS_TILE_N:  # kept on w_s: made once per scale, outside graph pools
            grid, tile_n = w_s, config.tile_n
            w_s = held_scale(grid, ("narrow", tile_n, n), lambda: narrow_block_scale(grid, n, tile_n))
        if w_q.data_ptr() % _ALIGN_BYTES:
            raise ValueError("CUTLASS GEMMs need w_q 16-byte aligned")
        key = (config.kernel, bias is not None, granularity)
        self.index = w_q.device.index if w_q.device.index is not None else torch.cuda.current_device()
        sms = sm_count(w_q.device)
        self.run = lib.run[key]
        self.workspace_bytes = int(lib.workspace[key](m, n, k, self.index, sms, config.splits))
        # the fixed arguments after x_q, x_s: w_q, w_s; after y: bias, m, n, k, device, SM count, splits
        self.args = ((w_q.data_ptr(), w_s.data_ptr()),
                     (None if bias is None else bias.data_ptr(), m, n, k, self.index, sms, config.splits))
        self.held = (w_q, w_s, bias)
        self.several = _several_gpus()
        self.config, self.shape = config, (m, n, k)
        self.run_prepared, self.release = lib.run_prepared[key], lib.release[key]
        self.quant_run_prepared = (lib.quant_run_prepared_pdl if pdl else lib.quant_run_prepared)[key]
        self.prepared = None
        if prepare and self.workspace_bytes == 0:
            bias_ptr = self.args[1][0]
            with torch.cuda.device(self.index) if self.several else contextlib.nullcontext():
                self.prepared = lib.prepare[key](*self.args[0], bias_ptr, m, n, k, self.index, sms)

    def __del__(self) -> None:
        if getattr(self, "prepared", None):
            self.release(self.prepared)

    def __call__(self, x_q: int, x_s: int, y: int, workspace: int | None) -> None:
        """Enqueue y = x_q @ w_q.T on the current stream: x_q (M, K) e4m3fn and x_s (M, ceil(K/128))
        fp32 row-major, y (M, N) bf16, `workspace` :attr:`workspace_bytes` long (None where that is
        0); raw device addresses, 16-byte aligned."""
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        prepared = self.prepared
        if prepared and not self.several:  # the common case, without building an argument tuple
            rc = self.run_prepared(prepared, x_q, x_s, y, self.index, stream)
        else:
            if prepared:
                run, args = self.run_prepared, (prepared, x_q, x_s, y, self.index, stream)
            else:
                w, tail = self.args
                run, args = self.run, (x_q, x_s, *w, y, *tail, workspace, stream)
            if self.several:  # the launch and CUTLASS's per-device kernel attributes go to the current device
                with torch.cuda.device(self.index):
                    rc = run(*args)
            else:
                rc = run(*args)
        if rc:
            m, n, k = self.shape
            raise RuntimeError(f"CUTLASS {self.config.name} GEMM {m}x{n}x{k} failed with status {rc}")

    def with_quantization(self) -> Callable[[int, int, int, int], None] | None:
        """A call ``f(x, x_q, x_s, y)`` that quantizes x (M, K) bf16, contiguous, per token in 1x128
        groups into x_q (M, K) e4m3fn and x_s (M, ceil(K/128)) fp32 row-major (the bytes and scales
        of :func:`fp8linear.ops.quant.act_quant` on NVIDIA GPUs) and then runs this GEMM into y: two
        kernels on the current stream from one host call, on raw device addresses (x 16-byte
        aligned). None where the parameters are not prepared (the stream-K kernel, ``prepare=False``)."""
        if not self.prepared:
            return None
        owner = self  # held by the call: its parameters are released when it goes
        m, n, k = self.shape
        fn, prepared, index, several = self.quant_run_prepared, self.prepared, self.index, self.several
        current_stream = torch._C._cuda_getCurrentRawStream

        def quantize_and_run(x: int, x_q: int, x_s: int, y: int) -> None:
            if several:
                with torch.cuda.device(index):
                    rc = fn(prepared, x, k, x_q, x_s, y, m, k, index, current_stream(index))
            else:
                rc = fn(prepared, x, k, x_q, x_s, y, m, k, index, current_stream(index))
            if rc:
                raise RuntimeError(f"CUTLASS {owner.config.name} GEMM {m}x{n}x{k} with its input quantization "
                                   f"failed with status {rc}")

        return quantize_and_run

    def allocating_call(self, out_shape: tuple[int, ...], scratch_bytes: int,
                        scale_offset: int) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None:
        """A call ``f(x, keep=False)`` that runs :meth:`with_quantization`'s two kernels on buffers it
        allocates in the same C++ call (the plan-call module, :func:`plan_call_path`): y (`out_shape`,
        x's dtype, bf16) and a scratch of `scratch_bytes` bytes holding the quantized x at its start and
        its scales at `scale_offset` (16-byte aligned). Returns y, with `keep` (y, scratch). x is on the
        weight's GPU; where several GPUs are visible the C++ call makes it current for the allocations
        and launches. None where the parameters are not prepared or the module is not built or does
        not load."""
        module = _plan_call()
        if not self.prepared or module is None:
            return None
        if scale_offset % _ALIGN_BYTES or not 0 < scale_offset < scratch_bytes:
            raise ValueError(f"CutlassCall.allocating_call: the scales' offset must be 16-byte aligned inside the "
                             f"{scratch_bytes}-byte scratch, got {scale_offset}")
        m, n, k = self.shape
        entry = ctypes.cast(self.quant_run_prepared, ctypes.c_void_p).value
        index = self.index
        what = f"CUTLASS {self.config.name} GEMM {m}x{n}x{k} with its input quantization"
        prepared_run = module.PreparedRun(list(out_shape), entry, self.prepared, scratch_bytes, scale_offset, m, k,
                                          index, self.several, what)
        run, run_kept = prepared_run.__call__, prepared_run.kept
        current_stream = torch._C._cuda_getCurrentRawStream

        def allocate_quantize_and_run(x: torch.Tensor, keep: bool = False):
            return (run_kept if keep else run)(x, current_stream(index))

        allocate_quantize_and_run.holds = self  # the prepared parameters live as long as the call
        return allocate_quantize_and_run


def narrow_block_scale(w_s: torch.Tensor, n: int, tile_n: int) -> torch.Tensor:
    """A 128x128 weight's (ceil(N/128), ceil(K/128)) fp32 scale grid as the kernels on `tile_n`-wide
    tiles read it: one row per `tile_n` weight rows, (ceil(N/tile_n), ceil(K/128)) contiguous, each
    block's scale repeated for the row blocks inside it (CUTLASS takes no tile narrower than the
    weight scales' N granularity). A copy: :class:`CutlassCall` keeps it on `w_s`
    (:func:`~fp8linear.ops.cublas_gemm.held_scale`, made again when `w_s` changes in place), but a
    prepared call holds the copy it was made with (after changing a scale in place by other means
    than loading, ``Fp8BlockLinear.clear_plans``)."""
    if w_s.dim() != 2 or w_s.shape[0] != -(-n // 128):
        raise ValueError(f"narrow_block_scale takes the (ceil(N/128), K/128) grid of an N={n} weight, "
                         f"got shape {tuple(w_s.shape)}")
    if tile_n not in (32, 64):
        raise ValueError(f"narrow_block_scale: tile_n must be 32 or 64 (dividing 128, narrower), got {tile_n!r}")
    return w_s.repeat_interleave(128 // tile_n, dim=0)[:-(-n // tile_n)].contiguous()


def _row_scale(w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """A 1x128 weight's (N, K/128) scales as the row kernels read them, N-major: (K/128, N)
    contiguous, a view of an N-major scale, else made once and kept on `w_s`
    (:func:`fp8linear.ops.cublas_gemm.held_weight_scale`, cuBLAS's layout of it)."""
    return held_weight_scale(w_q, w_s, "row", True)


def cutlass_fp8_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                     bias: torch.Tensor | None, config: CutlassConfig, granularity: str = "block") -> torch.Tensor:
    """y (M, N) bf16 = dequant(x_q, x_s) @ dequant(w_q, w_s).T (+ bias) on a CUTLASS kernel.

    x_q (M, K) and w_q (N, K) e4m3fn, contiguous, 16-byte aligned; x_s (M, ceil(K/128))
    contiguous fp32; w_s (ceil(N/128), ceil(K/128)) contiguous fp32 for `granularity` "block", (N,
    ceil(K/128)) fp32 for "row" (N-major is read as is, another layout through a copy made once);
    the shape must pass :func:`cutlass_accepts` and the device :func:`cutlass_available` (the router
    checks both, and contiguity)."""
    if _library() is None:
        raise RuntimeError(f"the CUTLASS kernels are not built ({library_path()}): run `fp8linear build-cutlass`")
    m, k = x_q.shape
    n = w_q.shape[0]
    groups = -(-k // 128)
    if x_q.device.type != "cuda" or not cutlass_accepts(n, k, granularity, w_q.dtype, torch.bfloat16, bias):
        raise ValueError(f"cutlass_fp8_gemm takes CUDA e4m3fn operands with K % {_ALIGN_K} == 0, N % {_ALIGN_N} == 0 "
                         f"and an aligned bf16 bias or none; got {tuple(x_q.shape)} x {tuple(w_q.shape)} "
                         f"{w_q.dtype} on {x_q.device}")
    rows = -(-n // 128) if granularity == "block" else n
    if (x_q.dtype != w_q.dtype or w_q.shape[1] != k or x_s.shape != (m, groups)
            or w_s.shape != (rows, groups) or x_s.dtype != torch.float32 or w_s.dtype != torch.float32):
        raise ValueError(f"cutlass_fp8_gemm: x_q {tuple(x_q.shape)} {x_q.dtype}, x_s {tuple(x_s.shape)} {x_s.dtype}, "
                         f"w_q {tuple(w_q.shape)} {w_q.dtype}, w_s {tuple(w_s.shape)} {w_s.dtype} do not fit "
                         f"(M, K), (M, {groups}) fp32, (N, K), ({rows}, {groups}) fp32 ({granularity} weights)")
    if x_s.device != x_q.device or w_q.device != x_q.device:
        raise ValueError(f"cutlass_fp8_gemm: x_q on {x_q.device}, x_s on {x_s.device}, w_q on {w_q.device}: "
                         "all operands must be on one GPU")
    for name, t in (("x_q", x_q), ("x_s", x_s)):
        if not t.is_contiguous():
            raise ValueError(f"cutlass_fp8_gemm needs {name} contiguous, got strides {t.stride()}")
    if x_q.data_ptr() % _ALIGN_BYTES:
        raise ValueError("cutlass_fp8_gemm needs x_q 16-byte aligned")
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x_q.device)
    if m == 0 or n == 0:
        return y
    if k == 0:  # an empty sum
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    call = CutlassCall(w_q, w_s, bias, m, config, granularity, prepare=False)  # one call: checks the weight side
    size = call.workspace_bytes
    workspace = torch.empty(size, dtype=torch.uint8, device=x_q.device) if size else None
    call(x_q.data_ptr(), x_s.data_ptr(), y.data_ptr(), None if workspace is None else workspace.data_ptr())
    return y
