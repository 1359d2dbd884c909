"""Which implementation runs an op: the Triton kernels or the pure-PyTorch reference.

Choose per call with ``backend=`` or for the process with ``FP8LINEAR_BACKEND`` =
``auto`` (default: our Triton kernels for CUDA/ROCm tensors, the reference elsewhere, except the
whole FP8 linear on CPU tensors, which runs :mod:`fp8linear.ops.cpu_linear`; on Hopper,
prefill-sized GEMMs that cuBLAS blockwise FP8 takes run there, see :mod:`fp8linear.ops.cublas_gemm`),
``triton`` (our Triton kernels only) or ``reference``. Forcing Triton on CPU tensors needs
``TRITON_INTERPRET=1`` (set before the kernels are first used); ``auto`` never picks the slow
interpreter.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs without Triton fall back to the reference path
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "BACKENDS", "BACKEND_ENV", "cpu_fast_path", "cublas_allowed", "interpreting", "resolve_backend"]

BACKENDS = ("auto", "triton", "reference")
BACKEND_ENV = "FP8LINEAR_BACKEND"


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _requested(backend: str | None) -> str:
    return (backend or os.environ.get(BACKEND_ENV) or "auto").lower()


def cpu_fast_path(backend: str | None, device: torch.device) -> bool:
    """Whether an FP8 linear on `device` runs :func:`fp8linear.ops.cpu_linear.cpu_fp8_linear` (CPU tensors
    under 'auto': the same quantized values as the reference, tile-wise weight decode, fp32 GEMMs)
    rather than the reference (forced with backend 'reference')."""
    return device.type == "cpu" and _requested(backend) == "auto"


def cublas_allowed(backend: str | None) -> bool:
    """Whether GEMMs may go to cuBLAS blockwise FP8 where it is faster: under 'auto' only."""
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
