"""Kernels the router runs above decode sizes: split-K with 64x64 tiles, the 64x64 tiled config, and
cuBLAS on prequantized activations whose M is not a multiple of 4 (padded copy). Against the
float64 reference, in the Triton interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from fp8linear import block_fp8_matmul, quantize_activation, quantize_weight
from fp8linear.ops import HAS_TRITON
from fp8linear.reference import block_fp8_matmul_ref

from _utils import GEMM_TOL, KERNEL_GEMM_TOL, rel_err
from conftest import KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


def _operands(m, n, k, gran, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(KERNEL_DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(KERNEL_DEVICE)
    w_q, w_s = quantize_weight(w, gran)
    x_q, x_s = quantize_activation(x, fp8_dtype=w_q.dtype)
    ref = block_fp8_matmul_ref(x_q.cpu(), x_s.cpu(), w_q.cpu(), w_s.cpu(), torch.float64)
    return x_q, x_s, w_q, w_s, ref


@pytest.mark.parametrize("m,n,k", [(65, 64, 1024), (70, 300, 1152), (133, 96, 640)])
@pytest.mark.parametrize("gran", ["block", "row"])
def test_mid_m_splitk_matches_reference(m, n, k, gran):
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.router import MID_SPLIT_TILE, mid_splitk_config
    from fp8linear.ops.splitk_gemm import splitk_counters
    from fp8linear.ops.configs import SplitKConfig

    x_q, x_s, w_q, w_s, ref = _operands(m, n, k, gran, m + n)
    cfg = mid_splitk_config(m, n, k, torch.device(KERNEL_DEVICE))
    if cfg is None:  # a GPU with enough SMs for these tiles: still test the kernel at a split
        cfg = SplitKConfig(*MID_SPLIT_TILE, split_k=3)
    for counters in (None, splitk_counters(n, KERNEL_DEVICE)):
        y = block_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.float32, config=cfg, counters=counters)
        assert y.shape == (m, n)
        assert rel_err(y.cpu(), ref) < KERNEL_GEMM_TOL[torch.float32]
        if counters is not None:
            assert int(counters.abs().sum()) == 0  # left zeroed for the next call


@pytest.mark.parametrize("m", [65, 97])
def test_mid_m_tiled_config_matches_reference(m):
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.router import MID_M_CONFIG

    x_q, x_s, w_q, w_s, ref = _operands(m, 200, 384, "block", m)
    y = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.float32, config=MID_M_CONFIG)
    assert rel_err(y.cpu(), ref) < KERNEL_GEMM_TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [77, 333, 1001, 1002, 1003])
@pytest.mark.parametrize("gran", ["block", "row"])
def test_gpu_cublas_pads_prequantized_rows(m, gran):
    from fp8linear.ops.cublas_gemm import cublas_device_ok, cublas_fp8_gemm

    if not cublas_device_ok(torch.device("cuda")):
        pytest.skip("needs cuBLAS blockwise FP8 (Hopper, torch >= 2.11)")
    x_q, x_s, w_q, w_s, ref = _operands(m, 576, 2048, gran, m)
    y = cublas_fp8_gemm(x_q, x_s, w_q, w_s, gran, None)
    assert y.shape == (m, 576) and y.is_contiguous() and torch.isfinite(y).all()
    assert rel_err(y.cpu(), ref) < GEMM_TOL[torch.bfloat16]
    # block_fp8_matmul under "auto" equals "triton" within the GEMM bound, whatever the router picks
    y_auto = block_fp8_matmul(x_q, x_s, w_q, w_s)
    assert rel_err(y_auto.cpu(), ref) < GEMM_TOL[torch.bfloat16]
