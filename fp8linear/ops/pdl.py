"""Programmatic dependent launch (PDL): the launch keywords and the two in-kernel instructions.

A decode-sized FP8 linear is two short kernels, act_quant then the GEMM. With PDL (Hopper and
newer, CUDA >= 12.3) the GEMM is launched with ``launch_pdl=True`` and its first instruction is
``griddepcontrol.wait`` (:func:`wait_for_producer`; SASS ``ACQBULK``, ahead of every global load
and store, checked in the compiled kernels): it may be scheduled before the preceding kernel has
finished, and waits there until that kernel has completed and its writes are visible. So the GEMM
can never read x before act_quant wrote it, nor write y where an earlier kernel still reads: the
ordering of a plain launch, minus part of the launch gap. act_quant lets it be scheduled from its
own start (:func:`release_dependents`, ``griddepcontrol.launch_dependents``). Both instructions
are no-ops without PDL. Whether a call uses PDL, and whether act_quant releases early, is the
router's choice (:func:`fp8linear.ops.router.use_pdl`, off unless ``FP8LINEAR_PDL=1``, with the
measurements behind that). Not in the Triton CPU interpreter (no inline PTX) or on ROCm.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # griddepcontrol wrappers: Triton >= 3.3 (fp8linear.backend.has_gdc says the same)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: plain launches only
    gdc_launch_dependents = gdc_wait = None

__all__ = ["pdl_launch", "wait_for_producer", "release_dependents"]


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
