"""Triton kernels, one module per op. Each `@triton.jit` kernel is followed by a thin launcher.

Launchers assume validated inputs (see :mod:`fp8linear.functional`) and are importable only
where Triton is installed; :data:`HAS_TRITON` says whether it is.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs without Triton fall back to the reference path
    HAS_TRITON = False

__all__ = ["HAS_TRITON"]
