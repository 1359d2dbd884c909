"""The FP8 linear for several tokens: quantize x per token, then the GEMM (cuBLAS or ours).

With `allow_cublas` (backend "auto"), prefill-sized GEMMs that cuBLAS blockwise FP8 takes
(:mod:`fp8linear.ops.cublas_gemm`) get their activations quantized straight into cuBLAS's
layout (M padded to a multiple of 4, M-major scales) and run there; everything else runs our
act-quant kernel and our GEMM. Single tokens take :mod:`fp8linear.ops.fused_gemv` instead
(dispatched in :func:`fp8linear.functional.fp8_linear`).
"""

from __future__ import annotations

import torch

from .cublas_gemm import cublas_fp8_gemm, use_cublas
from .gemm import block_fp8_gemm
from .quant import act_quant

__all__ = ["fp8_linear_tokens"]


def fp8_linear_tokens(
    x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str, bias: torch.Tensor | None,
    allow_cublas: bool, workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (M, N) in x.dtype for a validated, K-contiguous x (M, K) and weight w_q (N, K); `workspace`:
    split-K counters (:func:`fp8linear.ops.splitk_gemm.splitk_workspace`) or None."""
    m = x.shape[0]
    if use_cublas(x, w_q, granularity, x.dtype, bias, allow_cublas):
        x_q, x_s = act_quant(x, w_q.dtype, cublas_layout=True)
        y = cublas_fp8_gemm(x_q, x_s, w_q, w_s, granularity, bias)
        return y if y.shape[0] == m else y[:m]  # drop the padding rows (a contiguous view)
    x_q, x_s = act_quant(x, w_q.dtype)
    return block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, x.dtype, bias, counters=workspace)
