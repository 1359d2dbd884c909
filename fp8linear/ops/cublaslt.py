"""The blockwise FP8 GEMM on cuBLASLt, called directly: descriptors made once per weight (or weight
shape) and workspace limit, the algorithm once per M, then one ``cublasLtMatmul`` per call.

``torch._scaled_mm`` builds its cuBLASLt descriptors and asks cuBLASLt's heuristic for an algorithm
on every call, and takes tensors: the quantized activations and their scales must be tensor objects
(two allocations), and the output a third. :class:`LtBlockGemm` holds the weight's descriptors, and
per M the activation and output layouts and the algorithm (planned once per M for every GEMM of the
same shape, limit and modes: all the layers of a model share one plan book), so a call is one
attribute update (the activation scales' address) and the matmul, through ``ctypes`` into the libcublasLt that torch
itself loaded, on raw addresses: :class:`fp8linear.ops.linear.CublasLinear` puts the quantized
activations, their scales and the workspace in one allocation. H100 host, torch 2.11: the whole
eager call (act_quant + GEMM) 0.66-0.82x the wall time of the same call on ``torch._scaled_mm``
where the host sets the pace (e.g. 7168x2048 at M=512 36.8 against 56.1 us), the same GPU time and
the same bits where both read the weight scale in one form (``benchmarks/cublaslt_probe.py``;
128x128 weights whose K/128 is not a multiple of 4 go here on a padded grid, which
``torch._scaled_mm`` refuses, and there as 1x128 weights).

The call is the one ``torch._scaled_mm`` makes (cuBLAS's column-major view of y = x @ w.T):
A = the weight (K x N, transposed), with 128x128 (``BLK128x128_32F``) or 1x128 (``VEC128_32F``)
scales in the layout :func:`fp8linear.ops.cublas_gemm.cublas_weight_scale` makes; B = the
activations (K x M) with 1x128 scales M-major (``VEC128_32F``); D = y (N x M) in bf16, an
optional bf16 bias fused (``EPILOGUE_BIAS``). A workspace, where the chosen algorithm needs one,
comes with each call's scratch from torch's caching allocator (stream-ordered, and safe under
CUDA-graph capture).

Every cuBLAS-routed GEMM of the package runs here, the functional path's too
(:func:`fp8linear.ops.cublas_gemm.cublas_fp8_gemm`, through :func:`shape_gemm`: one set of
descriptors per weight shape, both scales' and the bias's addresses set per call), with the
workspace limit the route names (:class:`fp8linear.ops.cublas_gemm.CublasConfig`; by default
LT_WORKSPACE_LIMIT, torch's default): the heuristic picks the same algorithm for the same M and
limit on both paths, so the module and the functional ops give the same bits. Both take cuBLASLt
only for operands that pass :func:`lt_operands_ok` (contiguous, 256-byte aligned: what the
heuristic assumes) and run ``torch._scaled_mm`` otherwise.

Where anything is missing (no libcublasLt in the process, a cuBLASLt without the blockwise scale
modes, no algorithm for a shape) :func:`lt_block_gemm`, :func:`shape_gemm` or
:meth:`LtBlockGemm.plan` returns None (:meth:`LtBlockGemm.run_on` False) and the caller runs
``torch._scaled_mm``; a log line says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from functools import lru_cache

import torch

__all__ = ["LT_WORKSPACE_LIMIT", "LtBlockGemm", "lt_aligned", "lt_block_gemm", "lt_operands_ok", "shape_gemm",
           "torch_workspace_limit"]

log = logging.getLogger(__name__)

# cudaDataType_t, cublasComputeType_t, cublasOperation_t (library_types.h, cublas_api.h)
_CUDA_R_32F, _CUDA_R_16BF, _CUDA_R_8F_E4M3 = 0, 14, 28
_CUBLAS_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t (cublasLt.h, CUDA 12.9 / 13.0)
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_BIAS_DATA_TYPE = 17, 18, 26
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
# cublasLtEpilogue_t
_EPILOGUE_BIAS = 4
# cublasLtMatmulMatrixScale_t
_SCALE_VEC128_32F, _SCALE_BLK128X128_32F = 4, 5
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
# torch._scaled_mm's cuBLASLt workspace limit, in KiB, where CUBLASLT_WORKSPACE_SIZE does not set it.
_TORCH_LT_WORKSPACE_KIB = 1024
# The largest workspace an algorithm may ask for, by default: torch's default, so shapes in no
# routes table run torch._scaled_mm's algorithm. Routes tables name 32 MiB where it measured faster
# (fp8linear.ops.cublas_gemm.CublasConfig): there the heuristic takes split-K algorithms where few
# output tiles leave SMs idle (H100, CUDA graphs: 2112x7168 at M=64 17.4 against 23.6 us, a 1.03 MiB
# workspace). An algorithm's workspace comes from torch's caching allocator per call, its own size
# only (not the limit).
LT_WORKSPACE_LIMIT = _TORCH_LT_WORKSPACE_KIB * 1024
# Weight shapes the functional path keeps descriptors for (shape_gemm; the least recently used is dropped).
_MAX_SHAPES = 256
# cuBLASLt's heuristic assumes 256-byte aligned matrices (its default minimum alignment preference);
# the functional path runs other addresses on torch._scaled_mm.
_LT_ALIGN = 256
# M values a GEMM kind keeps layouts and an algorithm for (the oldest is dropped): transformers'
# DeepSeek attention meets a new M (the cached sequence length) at every decode step.
_MAX_PLANS = 512
# GEMM kinds (device, shape, scale modes, bias, workspace limit) whose plan books are kept alive by
# this module for GEMMs made later (a book also lives as long as any GEMM using it).
_MAX_BOOKS = 256


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P = ctypes.c_void_p


def torch_workspace_limit() -> int:
    """torch._scaled_mm's cuBLASLt workspace limit in bytes (the environment variable it reads, in KiB):
    an :class:`LtBlockGemm` made with it runs torch's algorithm, bit for bit."""
    text = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    return (int(text) if text.isdigit() else _TORCH_LT_WORKSPACE_KIB) * 1024


def _loaded_cublaslt_path() -> str | None:
    """The libcublasLt mapped into this process (torch's CUDA libraries load it), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    """libcublasLt with the prototypes used here, or None (logged) where it cannot be loaded."""
    if torch.version.cuda is None:
        return None
    torch.cuda.init()
    names = [p for p in (_loaded_cublaslt_path(),) if p] + [f"libcublasLt.so.{torch.version.cuda.split('.')[0]}"]
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        log.info("fp8linear: no libcublasLt to load (%s); cuBLAS GEMMs run through torch._scaled_mm", names)
        return None
    for fn, args in (
        ("cublasLtCreate", [ctypes.POINTER(_P)]),
        ("cublasLtMatmulDescCreate", [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_int]),
        ("cublasLtMatmulDescSetAttribute", [_P, ctypes.c_int, _P, ctypes.c_size_t]),
        ("cublasLtMatrixLayoutCreate", [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                        ctypes.c_int64]),
        ("cublasLtMatrixLayoutDestroy", [_P]),
        ("cublasLtMatmulDescDestroy", [_P]),
        ("cublasLtMatmulPreferenceDestroy", [_P]),
        ("cublasLtMatmulPreferenceCreate", [ctypes.POINTER(_P)]),
        ("cublasLtMatmulPreferenceSetAttribute", [_P, ctypes.c_int, _P, ctypes.c_size_t]),
        ("cublasLtMatmulAlgoGetHeuristic", [_P, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.POINTER(_Heuristic),
                                            ctypes.POINTER(ctypes.c_int)]),
        ("cublasLtMatmul", [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(_Algo), _P,
                            ctypes.c_size_t, _P]),
    ):
        f = getattr(lib, fn, None)
        if f is None:
            log.info("fp8linear: libcublasLt lacks %s; cuBLAS GEMMs run through torch._scaled_mm", fn)
            return None
        f.argtypes, f.restype = args, ctypes.c_int
    return lib


class _Failed(RuntimeError):
    pass


def _check(status: int, what: str) -> None:
    if status != 0:
        raise _Failed(f"{what} returned cuBLAS status {status}")


@lru_cache(maxsize=16)
def _handle(device_index: int) -> int:
    """One cuBLASLt handle per device (a handle is not bound to a stream)."""
    lib = _lib()
    handle = _P()
    with torch.cuda.device(device_index):
        _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle.value


def _set(lib: ctypes.CDLL, desc: int, attr: int, value: ctypes._SimpleCData) -> None:
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
           f"cublasLtMatmulDescSetAttribute({attr})")


def _layout(lib: ctypes.CDLL, dtype: int, rows: int, cols: int, ld: int) -> int:
    layout = _P()
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
    return layout.value


class _PlanBook:
    """The per-M plans of one GEMM kind (device, N, K, scale modes, bias, workspace limit), shared by
    every :class:`LtBlockGemm` of that kind: a plan (the activation and output layouts, the
    algorithm and its workspace bytes) depends on nothing else, so the heuristic runs once per M (and
    per borrowed M, :meth:`LtBlockGemm.plan`) for all the layers of a shape and for the functional
    path alike (one algorithm per (shape, M, limit, borrowed M): the same bits everywhere). Its `lock` is held from planning to enqueueing a GEMM, so
    that no plan is dropped (its layouts destroyed) by another thread in between."""

    __slots__ = ("lib", "plans", "lock")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # M, or (M, algo M) for a borrowed algorithm -> (B layout, D layout, algo, workspace bytes), None: no algo
        self.plans: dict[int | tuple[int, int], tuple | None] = {}
        # reentrant: every GEMM of the kind shares it, so a holder may call another GEMM's methods
        self.lock = threading.RLock()

    def drop_oldest(self) -> None:
        _destroy_plan(self.lib, self.plans.pop(next(iter(self.plans))))

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is not None:  # no module-level names here: at interpreter exit they may be gone first
            for plan in self.plans.values():
                if plan is not None:
                    lib.cublasLtMatrixLayoutDestroy(plan[0])
                    lib.cublasLtMatrixLayoutDestroy(plan[1])


def _destroy_plan(lib: ctypes.CDLL, plan: tuple | None) -> None:
    if plan is not None:
        lib.cublasLtMatrixLayoutDestroy(plan[0])
        lib.cublasLtMatrixLayoutDestroy(plan[1])


@lru_cache(maxsize=_MAX_BOOKS)
def _plan_book(device_index: int, n: int, k: int, row_scales: bool, has_bias: bool, workspace_limit: int) -> _PlanBook:
    return _PlanBook(_lib())


class LtBlockGemm:
    """y (M, N) bf16 = dequant(x_q, x_s) @ dequant(w_q, scale_b).T (+ bias) for one weight shape, on cuBLASLt.

    `w_q` (N, K) float8_e4m3fn, row-major; `scale_b` the weight scale in cuBLAS's layout
    (:func:`~fp8linear.ops.cublas_gemm.cublas_weight_scale`: (K/128, N/128) for 128x128 blocks, or
    (K/128, N) for 1x128 scales, `row_scales`); `bias` bf16 (N,) or None.

    Made by :meth:`for_weight`, the weight, its scale and bias are held (their addresses stay in the
    descriptors) and :meth:`run` enqueues a GEMM on them. Made for a shape (:func:`shape_gemm`),
    :meth:`run_on` takes the weight, scale and bias per call. :meth:`plan` gives the per-M part
    (layouts, algorithm, workspace bytes), kept in the plan book every GEMM of the same kind shares
    (:class:`_PlanBook`); M a multiple of 4. `workspace_limit`: the largest workspace the heuristic
    may choose an algorithm for (LT_WORKSPACE_LIMIT). :attr:`lock` is the book's.
    """

    __slots__ = ("lib", "handle", "desc", "a_layout", "book", "plans", "w_q", "w_ptr", "scale_b", "bias", "n", "k",
                 "has_bias", "workspace_limit", "device_index", "ptr", "one", "zero", "lock")

    def __init__(self, device_index: int, n: int, k: int, row_scales: bool, has_bias: bool,
                 workspace_limit: int = LT_WORKSPACE_LIMIT) -> None:
        lib = self.lib = _lib()
        self.device_index = device_index
        self.handle = _handle(device_index)
        self.n, self.k, self.has_bias, self.workspace_limit = n, k, has_bias, workspace_limit
        self.w_q = self.scale_b = self.bias = None
        self.w_ptr = 0
        desc = _P()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        self.desc = desc.value
        _set(lib, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(lib, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(lib, self.desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F if row_scales else _SCALE_BLK128X128_32F))
        _set(lib, self.desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        if has_bias:
            _set(lib, self.desc, _DESC_EPILOGUE, ctypes.c_int32(_EPILOGUE_BIAS))
            _set(lib, self.desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(_CUDA_R_16BF))
        self.a_layout = _layout(lib, _CUDA_R_8F_E4M3, k, n, k)
        self.book = _plan_book(device_index, n, k, row_scales, has_bias, workspace_limit)
        self.plans, self.lock = self.book.plans, self.book.lock
        self.ptr = _P()  # an address set per call
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @classmethod
    def for_weight(cls, w_q: torch.Tensor, scale_b: torch.Tensor, row_scales: bool, bias: torch.Tensor | None,
                   workspace_limit: int = LT_WORKSPACE_LIMIT) -> LtBlockGemm:
        """The GEMM on this weight, its scale and bias, held."""
        index = w_q.device.index if w_q.device.index is not None else torch.cuda.current_device()
        self = cls(index, w_q.shape[0], w_q.shape[1], row_scales, bias is not None, workspace_limit)
        self.w_q, self.scale_b, self.bias = w_q, scale_b, bias  # held: the descriptors keep their addresses
        self.w_ptr = w_q.data_ptr()
        _set(self.lib, self.desc, _DESC_A_SCALE_POINTER, _P(scale_b.data_ptr()))
        # the activation scales' address is set per call; the heuristic refuses a null one
        # (CUBLAS_STATUS_INVALID_VALUE), so until the first call it holds the weight scale's
        _set(self.lib, self.desc, _DESC_B_SCALE_POINTER, _P(scale_b.data_ptr()))
        if bias is not None:
            _set(self.lib, self.desc, _DESC_BIAS_POINTER, _P(bias.data_ptr()))
        return self

    def plan(self, m: int, algo_m: int = 0) -> tuple | None:
        """(B layout, D layout, algorithm, workspace bytes) for M rows, made on first use by any GEMM
        of this kind and kept in the shared book (_MAX_PLANS of them); None where cuBLASLt has no
        algorithm for this M. `algo_m` (0: M): run the algorithm the heuristic picks for that many
        rows where cuBLASLt accepts it for M, else M's own (:class:`~fp8linear.ops.cublas_gemm.CublasConfig`).
        The caller holds :attr:`lock` from here until its GEMM is enqueued. The descriptor's scale
        addresses must be set (non-null) when an M is first planned."""
        key = m if not algo_m or algo_m == m else (m, algo_m)
        plan = self.plans.get(key, False)
        if plan is False:
            if len(self.plans) >= _MAX_PLANS:
                self.book.drop_oldest()
            # a borrowed plan is made here, under its own key, with its own layouts (each key's plan
            # is destroyed once, when dropped)
            made = self._make_plan(m) if key == m else (self._borrowed_plan(m, algo_m) or self._make_plan(m))
            if len(self.plans) >= _MAX_PLANS:  # planning algo_m may have filled the book
                self.book.drop_oldest()
            plan = self.plans[key] = made
        return plan

    def borrowed_plan(self, m: int, algo_m: int) -> tuple | None:
        """A plan for M rows that runs the algorithm the heuristic chose for `algo_m` rows, where
        cuBLASLt accepts it for M (``cublasLtMatmulAlgoCheck``), else None. Not kept: the caller
        destroys its layouts (:func:`_destroy_plan`) or keeps the plan."""
        with self.lock:  # planning algo_m may drop another M's plan from the shared book
            return self._borrowed_plan(m, algo_m)

    def _borrowed_plan(self, m: int, algo_m: int) -> tuple | None:
        source = self.plan(algo_m)
        lib = self.lib
        check = getattr(lib, "cublasLtMatmulAlgoCheck", None)  # without it, routes run M's own algorithm
        if source is None or check is None:
            return None
        check.argtypes = [_P, _P, _P, _P, _P, _P, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)]
        check.restype = ctypes.c_int
        b_layout = _layout(lib, _CUDA_R_8F_E4M3, self.k, m, self.k)
        d_layout = _layout(lib, _CUDA_R_16BF, self.n, m, self.n)
        algo, result = _Algo(), _Heuristic()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(source[2]), ctypes.sizeof(_Algo))
        status = check(self.handle, self.desc, self.a_layout, b_layout, d_layout, d_layout, ctypes.byref(algo),
                       ctypes.byref(result))
        if status != 0 or result.workspace_size > self.workspace_limit:
            _destroy_plan(lib, (b_layout, d_layout))
            return None
        return b_layout, d_layout, algo, result.workspace_size

    def candidate_plans(self, m: int, count: int) -> list[tuple]:
        """Up to `count` plans for M rows, one per algorithm the heuristic offers, best first (for probes
        that time them; their layouts live as long as this object's process)."""
        b_layout, d_layout, algos = self._heuristic(m, count)
        return [(b_layout, d_layout, algo, ws) for algo, ws in algos]

    def _heuristic(self, m: int, count: int) -> tuple[int, int, list[tuple[_Algo, int]]]:
        lib = self.lib
        b_layout = _layout(lib, _CUDA_R_8F_E4M3, self.k, m, self.k)
        d_layout = _layout(lib, _CUDA_R_16BF, self.n, m, self.n)
        pref = _P()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_size_t(self.workspace_limit)
        status = lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                          ctypes.sizeof(limit))
        results, found = (_Heuristic * count)(), ctypes.c_int(0)
        if status == 0:
            status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a_layout, b_layout, d_layout,
                                                        d_layout, pref, count, results, ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        algos = [(results[i].algo, results[i].workspace_size) for i in range(found.value)] if status == 0 else []
        if not algos:
            log.info("fp8linear: cuBLASLt has no blockwise algorithm for %dx%dx%d (status %d); torch._scaled_mm runs it",
                     m, self.n, self.k, status)
        return b_layout, d_layout, algos

    def _make_plan(self, m: int) -> tuple | None:
        b_layout, d_layout, algos = self._heuristic(m, 1)
        if not algos:
            _destroy_plan(self.lib, (b_layout, d_layout))
            return None
        return b_layout, d_layout, algos[0][0], algos[0][1]

    def __del__(self) -> None:
        if getattr(self, "lib", None) is None:
            return
        if getattr(self, "a_layout", None):
            self.lib.cublasLtMatrixLayoutDestroy(self.a_layout)
        if getattr(self, "desc", None):
            self.lib.cublasLtMatmulDescDestroy(self.desc)

    def _set_ptr(self, attr: int, address: int) -> None:
        self.ptr.value = address
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(self.ptr), 8),
               "cublasLtMatmulDescSetAttribute(address)")

    def _matmul(self, plan: tuple, w: int, x_q: int, y: int, workspace: int) -> None:
        b_layout, d_layout, algo, ws_bytes = plan
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        _check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.one), w, self.a_layout, x_q,
                                       b_layout, ctypes.byref(self.zero), y, d_layout, y, d_layout,
                                       ctypes.byref(algo), workspace if ws_bytes else None, ws_bytes,
                                       stream), "cublasLtMatmul")

    def run(self, plan: tuple, x_q: int, x_s: int, y: int, workspace: int) -> None:
        """Enqueue y = the GEMM of `plan`'s M on the held weight, on the current stream. Raw device
        addresses: x_q (M, K) row-major, x_s (M, K/128) M-major, y (M, N) bf16, and `plan`'s
        workspace bytes (256-byte aligned)."""
        with self.lock:  # the descriptor's B-scale address is per call: one thread at a time sets and uses it
            self.run_locked(plan, x_q, x_s, y, workspace)

    def run_locked(self, plan: tuple, x_q: int, x_s: int, y: int, workspace: int) -> None:
        """:meth:`run` for a caller that holds :attr:`lock` (from :meth:`plan` on, so that the plan is
        not dropped for another M by another thread before its GEMM is enqueued)."""
        if not self.w_ptr:
            raise ValueError("LtBlockGemm.run needs a weight held by for_weight(); a shape's GEMM runs with run_on()")
        self._set_ptr(_DESC_B_SCALE_POINTER, x_s)
        self._matmul(plan, self.w_ptr, x_q, y, workspace)

    def run_on(self, m: int, w_q: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None,
               x_q: torch.Tensor, x_s: torch.Tensor, y: torch.Tensor, algo_m: int = 0) -> bool:
        """Enqueue y = the GEMM of M rows on this weight (this object's shape), on the current stream;
        False (nothing enqueued) where cuBLASLt has no algorithm for M. Tensors as :meth:`run`'s
        addresses; the workspace is allocated here. `algo_m`: as :meth:`plan`'s."""
        if (bias is not None) != self.has_bias:
            raise ValueError(f"this cuBLASLt GEMM was made {'with' if self.has_bias else 'without'} a bias, "
                             f"got bias={'a tensor' if bias is not None else 'None'}")
        with self.lock:  # the descriptor's addresses are per call
            self._set_ptr(_DESC_A_SCALE_POINTER, scale_b.data_ptr())
            self._set_ptr(_DESC_B_SCALE_POINTER, x_s.data_ptr())
            if bias is not None:
                self._set_ptr(_DESC_BIAS_POINTER, bias.data_ptr())
            plan = self.plan(m, algo_m)
            if plan is None:
                return False
            ws = torch.empty(plan[3], dtype=torch.uint8, device=y.device) if plan[3] else None
            self._matmul(plan, w_q.data_ptr(), x_q.data_ptr(), y.data_ptr(), ws.data_ptr() if ws is not None else 0)
        return True


def lt_operands_ok(w_q: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a weight, its cuBLAS-layout scale and bias can go to cuBLASLt here (both paths ask the
    same, so they run the same algorithm): float8_e4m3fn row-major weight at a 256-byte aligned
    address (what the heuristic assumes), fp32 scales, a contiguous bf16 bias at such an address."""
    return (w_q.dtype == torch.float8_e4m3fn and w_q.is_contiguous() and scale_b.dtype == torch.float32
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and lt_aligned(w_q, bias))


def lt_block_gemm(w_q: torch.Tensor, scale_b: torch.Tensor, row_scales: bool, bias: torch.Tensor | None,
                  workspace_limit: int = LT_WORKSPACE_LIMIT) -> LtBlockGemm | None:
    """The direct cuBLASLt GEMM holding this weight, or None where it cannot be set up (logged once
    per reason): no CUDA tensor, no libcublasLt, operands :func:`lt_operands_ok` refuses, or a
    cuBLASLt that refuses the descriptors."""
    if w_q.device.type != "cuda" or torch.version.hip is not None or not lt_operands_ok(w_q, scale_b, bias):
        return None
    if _lib() is None:
        return None
    try:
        return LtBlockGemm.for_weight(w_q, scale_b, row_scales, bias, workspace_limit)
    except _Failed as e:
        log.info("fp8linear: cuBLASLt setup failed (%s); cuBLAS GEMMs run through torch._scaled_mm", e)
        return None


def lt_aligned(*tensors: torch.Tensor | None) -> bool:
    """Whether every given tensor's address has the alignment cuBLASLt's heuristic assumes (_LT_ALIGN)."""
    return all(t is None or t.data_ptr() % _LT_ALIGN == 0 for t in tensors)


def shape_gemm(device_index: int, n: int, k: int, row_scales: bool, has_bias: bool,
               workspace_limit: int = LT_WORKSPACE_LIMIT) -> LtBlockGemm | None:
    """The functional path's cuBLASLt GEMM for one weight shape, device and workspace limit (kept: the
    least recently used of _MAX_SHAPES is dropped), or None where cuBLASLt cannot be set up (logged) or
    ``FP8LINEAR_CUBLASLT=0`` when the shape is first met: the caller runs torch._scaled_mm."""
    return _shape_gemm(int(device_index), int(n), int(k), bool(row_scales), bool(has_bias), int(workspace_limit))


@lru_cache(maxsize=_MAX_SHAPES)
def _shape_gemm(device_index: int, n: int, k: int, row_scales: bool, has_bias: bool,
                workspace_limit: int) -> LtBlockGemm | None:
    if torch.version.hip is not None or os.environ.get("FP8LINEAR_CUBLASLT", "1") == "0" or _lib() is None:
        return None
    try:
        return LtBlockGemm(device_index, n, k, row_scales, has_bias, workspace_limit)
    except _Failed as e:
        log.info("fp8linear: cuBLASLt setup failed (%s); cuBLAS GEMMs run through torch._scaled_mm", e)
        return None
