"""Programmatic dependent launch (PDL) for decode-sized GEMMs, opt-in (``FP8LINEAR_PDL=1``).

A decode-sized FP8 linear is two short kernels, act_quant then the GEMM. With PDL (Hopper and
newer, CUDA >= 12.3) the GEMM is launched with ``launch_pdl=True`` and its first instruction is
``griddepcontrol.wait`` (:func:`wait_for_producer`; SASS ``ACQBULK``, ahead of every global load
and store, checked in the compiled kernels): it may be scheduled before the preceding kernel has
finished, and waits there until that kernel has completed and its writes are visible. So the GEMM
can never read x before act_quant wrote it, nor write y where an earlier kernel still reads: the
ordering of a plain launch, minus part of the launch gap. act_quant lets it be scheduled from its
own start (:func:`release_dependents`, ``griddepcontrol.launch_dependents``) where that pays
(:func:`fp8linear.ops.linear.release_early`). Both instructions are no-ops without PDL. Only
decode sizes (M <= SMALL_M_MAX) use it: there act_quant is one wave of small programs, so GEMM
programs placed early never keep act_quant's from starting.

Why it is off by default (H100): `benchmarks/pdl_ab.py` (interleaved CUDA-graph
A/B, 15 shapes x M 1-64) measured the forward at 0.976x the time of plain launches (geometric
mean; 0.985x summed; 0.95-0.97x on short K, e.g. 4096x512 5.55 -> 5.45 us) and the GEMM alone at
0.979x (0.990x summed), but in two of five whole `fp8linear bench` runs with early release one or two graphs ran
their forward 1.5-2.4x slower throughout (4608x7168 M=32: 32.6 vs 23.9 us; 32768x512 M=2: 23.3
vs 11.5 us), and three re-runs of those cases did not reproduce it. A ~2% gain does not pay for
an unexplained stall in serving, so plain launches stay the default. A PDL launch without the
early release was slower than plain launches (1.025x). Not in the Triton CPU interpreter (no
inline PTX) or on ROCm.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from .configs import SMALL_M_MAX

try:  # griddepcontrol wrappers: Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: plain launches only
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False

__all__ = ["PDL_ENV", "use_pdl", "pdl_launch", "wait_for_producer", "release_dependents"]

# Opt-in: FP8LINEAR_PDL=1 turns PDL on (see the module docstring for why it is off by default).
PDL_ENV = "FP8LINEAR_PDL"
# griddepcontrol: sm_90 (Hopper) and newer.
_MIN_CAPABILITY = 9


@lru_cache(maxsize=16)
def _device_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= _MIN_CAPABILITY


def _requested() -> bool:
    value = os.environ.get(PDL_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def use_pdl(device: torch.device, m: int) -> bool:
    """Whether a decode-sized (M rows) act_quant -> GEMM pair on `device` runs with PDL."""
    # The opt-in first: with PDL off (the default) a launch pays one environment lookup.
    if not _requested() or not HAS_GDC or m > SMALL_M_MAX or device.type != "cuda":
        return False
    if torch.version.hip is not None or interpreting():
        return False
    return _device_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(enabled: bool) -> dict[str, bool]:
    """Launch keyword arguments: ``launch_pdl=True`` where PDL is on, nothing otherwise (the CPU
    interpreter takes no such argument)."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """First thing in a kernel launched with PDL: block until the preceding kernel has finished."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def release_dependents(RELEASE: tl.constexpr):
    """Let the kernel launched next with PDL be scheduled now, before this one's programs exit."""
    if RELEASE:
        gdc_launch_dependents()
