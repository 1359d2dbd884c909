"""The backends an op may run on, and what this install and process have for them.

Which one runs a call is decided in :mod:`fp8linear.ops.router` (:func:`~fp8linear.ops.router.resolve_backend`).
Choose per call with ``backend=`` or for the process with ``FP8LINEAR_BACKEND`` =
``auto`` (default: our Triton kernels for CUDA/ROCm tensors, the reference elsewhere, except the
whole FP8 linear on CPU tensors, which runs :mod:`fp8linear.ops.cpu_linear`; on Hopper,
prefill-sized GEMMs that cuBLAS blockwise FP8 takes run there, see :mod:`fp8linear.ops.cublas_gemm`),
``triton`` (our Triton kernels only) or ``reference``. Forcing Triton on CPU tensors needs
``TRITON_INTERPRET=1`` (set before the kernels are first used); ``auto`` never picks the slow
interpreter.
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs without Triton fall back to the reference path
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "BACKENDS", "BACKEND_ENV", "device_guard", "has_gdc", "interpreting"]

BACKENDS = ("auto", "triton", "reference")
BACKEND_ENV = "FP8LINEAR_BACKEND"


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=1)
def has_gdc() -> bool:
    """Whether this Triton has griddepcontrol (programmatic dependent launch) in its language: >= 3.3."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` where `device` is a CUDA device other than the current one,
    else a no-op. Triton launches a kernel on the current device and its stream, not on its
    tensors' device as torch ops do: a layer placed on another GPU (``device_map``) must make
    its device current around its launches."""
    if device.type != "cuda" or device.index is None or device.index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
