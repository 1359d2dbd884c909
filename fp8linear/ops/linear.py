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
from .pdl import use_pdl
from .quant import act_quant
from .splitk_gemm import splitk_config

__all__ = ["LONG_SPLITK_K", "fp8_linear_tokens", "release_early"]

# Split-K GEMMs with a longer K get no early release (see release_early): measured at K=16384 and
# 18432 (slower with it) and K=7168 (faster); the cut is between.
LONG_SPLITK_K = 8192


def release_early(device: torch.device, m: int, n: int, k: int) -> bool:
    """Whether act_quant lets the decode GEMM after it be scheduled early (PDL, :mod:`fp8linear.ops.pdl`).

    Yes, except ahead of split-K GEMMs with K > LONG_SPLITK_K. H100, `benchmarks/pdl_ab.py`
    (interleaved CUDA-graph A/B of the forward, 15 shapes x M 1-64): early release vs plain
    launches 0.957-0.997x per shape (4096x512 0.980, 576x7168 0.957), but 1.012x and 1.017x on the
    split-K GEMMs with K=18432 and 16384, whose long programs, two per SM, came out unbalanced when
    placed beside act_quant's; those keep the PDL launch without early release (1.000x, 1.007x).
    """
    return use_pdl(device, m) and not (k > LONG_SPLITK_K and splitk_config(m, n, k, device) is not None)


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
    x_q, x_s = act_quant(x, w_q.dtype, release_early=release_early(x.device, m, w_q.shape[0], x.shape[1]))
    return block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, x.dtype, bias, counters=workspace)
