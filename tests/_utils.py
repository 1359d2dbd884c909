"""Helpers shared by the core tests."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off (after one collection): inside, an object is freed
    only when its last reference goes, so a test sees whether `del` frees a module at once."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def spy_cutlass_library_calls(monkeypatch, on_call) -> None:
    """Run ``on_call(method, args)`` before every call of the CUTLASS plans' quantize-and-GEMM
    library calls (``CutlassCall.with_quantization``, and ``allocating_call``, its form in the
    plan-call module where that is built) that plans made after this returns hold."""
    from fp8linear.ops import cutlass_gemm

    for method in ("with_quantization", "allocating_call"):
        real = getattr(cutlass_gemm.CutlassCall, method)

        def make(self, *args, real=real, method=method):
            fused = real(self, *args)
            if fused is None:
                return None

            def spied(*call_args):
                on_call(method, call_args)
                return fused(*call_args)

            return spied

        monkeypatch.setattr(cutlass_gemm.CutlassCall, method, make)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors of the same dtype (NaN == NaN if encoded alike)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


# Tolerances for the GEMM output against a float64 product of the dequantized operands:
# fp32 accumulation leaves ~1e-7; the rest is one rounding of the output (unit roundoff
# 2^-24 fp32, 2^-11 fp16, 2^-8 bf16; Frobenius averages it to about a third of that).
GEMM_TOL = {torch.float32: 1e-5, torch.float16: 5e-4, torch.bfloat16: 3e-3}
# Our Triton kernels: Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to
# nearest, which doubles the output rounding error (measured 3.6e-3 vs the 3e-3 bound); GPUs round.
# On Hopper, FP8 wgmma accumulates inside one 128-wide K step with ~14 bits of mantissa
# (DeepSeek-V3 report, sec. 3.3.2) before our fp32 promotion: measured 1.3e-4 relative on
# H100 with fp32 output (M=64, N=K=128), so fp32 outputs get 3e-4 there.
KERNEL_GEMM_TOL = {
    **GEMM_TOL,
    torch.bfloat16: GEMM_TOL[torch.bfloat16] * (1 if torch.cuda.is_available() else 2),
    torch.float32: 3e-4 if torch.cuda.is_available() else GEMM_TOL[torch.float32],
}

# FP8 e4m3 against the unquantized product: each operand carries ~2^-4/sqrt(3) relative
# rounding error, so x@w.T lands near 3-4% on random data; 5% catches real mistakes.
FP8_LINEAR_TOL = 0.05


def capture_graph(fn, *static_args):
    """A CUDA graph of fn(*static_args) after one warm-up call on a side stream; (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static_args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    return graph, out
