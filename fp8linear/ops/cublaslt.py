"""The blockwise FP8 GEMM on cuBLASLt, called directly: descriptors and algorithm chosen once per
(weight, M), then one ``cublasLtMatmul`` per call.

``torch._scaled_mm`` builds its cuBLASLt descriptors and asks cuBLASLt's heuristic for an algorithm
on every call, and takes tensors: the quantized activations and their scales must be tensor objects
(two allocations), and the output a third. :class:`LtBlockGemm` holds the weight's descriptors, and
per M the activation and output layouts and the algorithm, so a call is one attribute update (the
activation scales' address) and the matmul, through ``ctypes`` into the libcublasLt that torch
itself loaded, on raw addresses: :class:`fp8linear.ops.linear.CublasLinear` puts the quantized
activations, their scales and the workspace in one allocation. H100 host, torch 2.11: the whole
eager call (act_quant + GEMM) 0.66-0.82x the wall time of the same call on ``torch._scaled_mm``
where the host sets the pace (e.g. 7168x2048 at M=512 36.8 against 56.1 us), the same GPU time and
the same bits (``benchmarks/cublaslt_probe.py``).

The call is the one ``torch._scaled_mm`` makes (cuBLAS's column-major view of y = x @ w.T):
A = the weight (K x N, transposed), with 128x128 (``BLK128x128_32F``) or 1x128 (``VEC128_32F``)
scales in the layout :func:`fp8linear.ops.cublas_gemm.cublas_weight_scale` makes; B = the
activations (K x M) with 1x128 scales M-major (``VEC128_32F``); D = y (N x M) in bf16, an
optional bf16 bias fused (``EPILOGUE_BIAS``). A workspace, where the chosen algorithm needs one,
comes with each call's scratch from torch's caching allocator (stream-ordered, and safe under
CUDA-graph capture).

The workspace limit is torch's (``CUBLASLT_WORKSPACE_SIZE``), so cuBLASLt's heuristic picks the
algorithm ``torch._scaled_mm`` runs: the same bits as the functional path.

Where anything is missing (no libcublasLt in the process, a cuBLASLt without the blockwise scale
modes, no algorithm for a shape) :func:`lt_block_gemm` or :meth:`LtBlockGemm.plan` returns None and
the caller runs ``torch._scaled_mm``; a log line says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from functools import lru_cache

import torch

__all__ = ["LtBlockGemm", "lt_block_gemm"]

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
# The largest workspace an algorithm may ask for: torch's cuBLASLt limit (CUBLASLT_WORKSPACE_SIZE,
# KiB, default 1024), so the heuristic picks the algorithm torch._scaled_mm runs and the results are
# the same bits as the functional path's. (H100: a 32 MiB limit lets 2112x7168 at M=64 take a
# 1.03 MiB split-K algorithm, 17.4 against 23.6 us under CUDA graphs.)
_TORCH_LT_WORKSPACE_KIB = 1024
# M values a weight keeps layouts and an algorithm for (the oldest is dropped): transformers'
# DeepSeek attention meets a new M (the cached sequence length) at every decode step.
_MAX_PLANS = 512


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P = ctypes.c_void_p


def _workspace_limit() -> int:
    """torch's cuBLASLt workspace limit in bytes (the environment variable it reads, in KiB)."""
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


class LtBlockGemm:
    """y (M, N) bf16 = dequant(x_q, x_s) @ dequant(w_q, scale_b).T (+ bias) for one weight, on cuBLASLt.

    `w_q` (N, K) float8_e4m3fn, row-major; `scale_b` the weight scale in cuBLAS's layout
    (:func:`~fp8linear.ops.cublas_gemm.cublas_weight_scale`: (K/128, N/128) for 128x128 blocks, or
    (K/128, N) for 1x128 scales, `row_scales`); `bias` bf16 (N,) or None. Tensors are held by
    reference (their addresses are in the descriptors). :meth:`plan` gives the per-M part,
    :meth:`run` enqueues one GEMM (M a multiple of 4).
    """

    __slots__ = ("lib", "handle", "desc", "a_layout", "plans", "w_q", "w_ptr", "scale_b", "bias", "n", "k",
                 "device_index", "scale_ptr", "one", "zero", "lock")

    def __init__(self, w_q: torch.Tensor, scale_b: torch.Tensor, row_scales: bool, bias: torch.Tensor | None) -> None:
        lib = self.lib = _lib()
        self.device_index = w_q.device.index if w_q.device.index is not None else torch.cuda.current_device()
        self.handle = _handle(self.device_index)
        self.w_q, self.scale_b, self.bias = w_q, scale_b, bias  # held: the descriptors keep their addresses
        self.w_ptr = w_q.data_ptr()
        self.n, self.k = w_q.shape
        desc = _P()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        self.desc = desc.value
        _set(lib, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(lib, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(lib, self.desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F if row_scales else _SCALE_BLK128X128_32F))
        _set(lib, self.desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        _set(lib, self.desc, _DESC_A_SCALE_POINTER, _P(scale_b.data_ptr()))
        # the activation scales' address is set per call; the heuristic refuses a null one
        # (CUBLAS_STATUS_INVALID_VALUE), so until the first call it holds the weight scale's
        _set(lib, self.desc, _DESC_B_SCALE_POINTER, _P(scale_b.data_ptr()))
        if bias is not None:
            _set(lib, self.desc, _DESC_EPILOGUE, ctypes.c_int32(_EPILOGUE_BIAS))
            _set(lib, self.desc, _DESC_BIAS_POINTER, _P(bias.data_ptr()))
            _set(lib, self.desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(_CUDA_R_16BF))
        self.a_layout = _layout(lib, _CUDA_R_8F_E4M3, self.k, self.n, self.k)
        self.plans: dict[int, tuple | None] = {}  # M -> (B layout, D layout, algo, workspace bytes), None: no algo
        self.scale_ptr = _P()  # the activation scales' address, updated per call
        self.lock = threading.Lock()
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def plan(self, m: int) -> tuple | None:
        """(B layout, D layout, algorithm, workspace bytes) for M rows, made on first use and kept
        (_MAX_PLANS of them); None where cuBLASLt has no algorithm for this M."""
        plan = self.plans.get(m, False)
        if plan is False:
            if len(self.plans) >= _MAX_PLANS:
                self._destroy(self.plans.pop(next(iter(self.plans))))
            plan = self.plans[m] = self._make_plan(m)
        return plan

    def _make_plan(self, m: int) -> tuple | None:
        lib = self.lib
        b_layout = _layout(lib, _CUDA_R_8F_E4M3, self.k, m, self.k)
        d_layout = _layout(lib, _CUDA_R_16BF, self.n, m, self.n)
        pref = _P()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_size_t(_workspace_limit())
        status = lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                          ctypes.sizeof(limit))
        result, found = _Heuristic(), ctypes.c_int(0)
        if status == 0:
            status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a_layout, b_layout, d_layout,
                                                        d_layout, pref, 1, ctypes.byref(result), ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0 or found.value < 1:
            self._destroy((b_layout, d_layout))
            log.info("fp8linear: cuBLASLt has no blockwise algorithm for %dx%dx%d (status %d); torch._scaled_mm runs it",
                     m, self.n, self.k, status)
            return None
        return b_layout, d_layout, result.algo, result.workspace_size

    def _destroy(self, plan: tuple | None) -> None:
        if plan is not None:
            self.lib.cublasLtMatrixLayoutDestroy(plan[0])
            self.lib.cublasLtMatrixLayoutDestroy(plan[1])

    def __del__(self) -> None:
        if getattr(self, "lib", None) is None:
            return
        for plan in getattr(self, "plans", {}).values():
            self._destroy(plan)
        if getattr(self, "a_layout", None):
            self.lib.cublasLtMatrixLayoutDestroy(self.a_layout)
        if getattr(self, "desc", None):
            self.lib.cublasLtMatmulDescDestroy(self.desc)

    def run(self, plan: tuple, x_q: int, x_s: int, y: int, workspace: int) -> None:
        """Enqueue y = the GEMM of `plan`'s M on the current stream. Raw device addresses: x_q (M, K)
        row-major, x_s (M, K/128) M-major, y (M, N) bf16, and `plan`'s workspace bytes (256-byte aligned)."""
        b_layout, d_layout, algo, ws_bytes = plan
        lib = self.lib
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        with self.lock:  # the descriptor's B-scale address is per call: one thread at a time sets and uses it
            self.scale_ptr.value = x_s
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_B_SCALE_POINTER, ctypes.byref(self.scale_ptr),
                                                      8), "cublasLtMatmulDescSetAttribute(B scale)")
            _check(lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.one), self.w_ptr, self.a_layout, x_q,
                                      b_layout, ctypes.byref(self.zero), y, d_layout, y, d_layout, ctypes.byref(algo),
                                      workspace if ws_bytes else None, ws_bytes, stream), "cublasLtMatmul")


def lt_block_gemm(w_q: torch.Tensor, scale_b: torch.Tensor, row_scales: bool,
                  bias: torch.Tensor | None) -> LtBlockGemm | None:
    """The direct cuBLASLt GEMM for this weight, or None where it cannot be set up (logged once per
    reason): no CUDA tensor, no libcublasLt, or a cuBLASLt that refuses the descriptors."""
    if w_q.device.type != "cuda" or torch.version.hip is not None or _lib() is None:
        return None
    try:
        return LtBlockGemm(w_q, scale_b, row_scales, bias)
    except _Failed as e:
        log.info("fp8linear: cuBLASLt setup failed (%s); cuBLAS GEMMs run through torch._scaled_mm", e)
        return None
