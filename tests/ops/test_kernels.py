"""Triton kernels against the reference: on the GPU if there is one, else in Triton's CPU interpreter.

On CPU (CI) the shapes are small, the interpreter being slow; on a GPU the full grid of the
core issue runs (M x N x K x granularity x FP8 dtype x out dtype).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fp8linear import block_fp8_matmul, quantize_activation, quantize_weight
from fp8linear.ops import HAS_TRITON
from fp8linear.reference import (
    block_fp8_matmul_ref,
    dequantize_activation_ref,
    dequantize_weight_ref,
    quantize_activation_ref,
)

from _utils import KERNEL_GEMM_TOL, rel_err, same_bits
from conftest import HAS_CUDA, KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
GRANS = ["block", "row", "tensor"]
OUT = [torch.bfloat16, torch.float16, torch.float32]

if HAS_CUDA:
    GEMM_SHAPES = list(itertools.product([1, 3, 64, 257, 1024], [128, 576, 1000, 2112], [128, 300, 576, 7168]))
    QUANT_SHAPES = [(m, k) for m in (1, 3, 64, 257, 1024, 4099) for k in (128, 300, 576, 7168)]
else:  # interpreter: small but ragged in every dimension
    # M <= 64 takes the split-K kernel; larger M the tiled kernel, persistent TMA when K % 16 == 0.
    GEMM_SHAPES = [(1, 128, 128), (3, 300, 300), (20, 576, 256), (33, 130, 576), (80, 200, 300), (96, 136, 256)]
    QUANT_SHAPES = [(1, 128), (3, 300), (17, 576), (40, 1000), (70, 256)]  # 1- and 4-row programs




def _fp8_supported(fp8_dtype: torch.dtype) -> bool:
    # fnuz is AMD's format; NVIDIA GPUs have no instructions for it (tested on CPU and ROCm).
    return not (HAS_CUDA and torch.version.hip is None and fp8_dtype == torch.float8_e4m3fnuz)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", QUANT_SHAPES)
def test_act_quant_bit_exact(m, k, in_dtype, fp8_dtype):
    if not _fp8_supported(fp8_dtype):
        pytest.skip("fp8 e4m3fnuz needs an AMD GPU")
    x = (torch.randn(m, k, device=KERNEL_DEVICE) * 3).to(in_dtype)
    x[0, : min(k, 128)] = 0  # an all-zero group
    if m > 2:
        x[2] *= 1e-6  # tiny values: subnormal FP8 codes
        x[1, 0] = 1e4  # saturates
    x_q, x_s = quantize_activation(x, fp8_dtype=fp8_dtype, backend="triton")
    r_q, r_s = quantize_activation_ref(x, fp8_dtype)
    assert same_bits(x_q, r_q)
    assert same_bits(x_s, r_s)


def _every_finite_bf16() -> torch.Tensor:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("case", ["every_bf16", "wide_fp32", "many_scales"])
def test_act_quant_division_bit_exact_on_hard_inputs(case):
    """x / scale is computed in fp64 from one reciprocal per group (quant.quantize_groups): every
    finite bf16 value, in groups of three different mixes; fp32 values with full 24-bit mantissas
    over 2**-40..2**40; and groups whose amax has a full random mantissa (one scale each, the first
    ones with mantissas of all ones), their other values bf16 at or under it, quantize to the
    reference's bits."""
    g = torch.Generator().manual_seed(7)
    if case == "every_bf16":
        v = _every_finite_bf16()
        x = torch.cat([v[torch.randperm(v.numel(), generator=g)] for _ in range(3)])
        x = x[: x.numel() // 128 * 128].reshape(-1, 128)
    elif case == "many_scales":
        rows = 8192 if HAS_CUDA else 512
        mantissa = torch.randint(0, 2**23, (rows,), generator=g)
        mantissa[:32] = 2**23 - 1 - torch.arange(32)
        exponent = torch.randint(-40, 41, (rows,), generator=g)
        amax = ((exponent + 127) << 23 | mantissa).to(torch.int32).view(torch.float32)
        x = ((torch.rand(rows, 128, generator=g) * 2 - 1) * amax[:, None]).to(torch.bfloat16).float()
        x = torch.minimum(torch.maximum(x, -amax[:, None]), amax[:, None])
        x[torch.arange(rows), torch.randint(0, 128, (rows,), generator=g)] = amax
    else:
        rows = 1024 if HAS_CUDA else 96
        x = torch.randn(rows, 1024, generator=g) * torch.exp2(torch.randint(-40, 41, (rows, 1024), generator=g).float())
    x = x.to(KERNEL_DEVICE)
    x_q, x_s = quantize_activation(x, fp8_dtype=torch.float8_e4m3fn, backend="triton")
    r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert same_bits(x_s, r_s)
    assert same_bits(x_q, r_q)


@pytest.mark.parametrize("m,k", [(70, 256), (100, 300)])
def test_act_quant_16_row_programs_bit_exact(m, k, monkeypatch):
    """Inputs above router.ACT_QUANT_SMALL_INPUT_ELEMENTS take 16-row programs (a partly filled last one here)."""
    from fp8linear.ops import quant, router

    monkeypatch.setattr(router, "ACT_QUANT_SMALL_INPUT_ELEMENTS", 0)
    grid, _, _ = quant.act_quant_args(torch.empty(m, k), torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(m, 3))
    assert grid[0] == -(-m // 16)
    x = (torch.randn(m, k, device=KERNEL_DEVICE) * 3).to(torch.bfloat16)
    x_q, x_s = quantize_activation(x, backend="triton")
    r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert same_bits(x_q, r_q) and same_bits(x_s, r_s)


def test_act_quant_leading_dims_and_strides():
    x = torch.randn(2, 300, 7, device=KERNEL_DEVICE).transpose(1, 2)  # (2, 7, 300), K not unit-stride
    x_q, x_s = quantize_activation(x, backend="triton")
    r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert x_q.shape == (2, 7, 300) and x_s.shape == (2, 7, 3)
    assert same_bits(x_q, r_q) and same_bits(x_s, r_s)


def test_act_quant_nan_inf_stay_nonfinite():
    x = torch.randn(3, 256, device=KERNEL_DEVICE)
    x[1, 5] = float("nan")
    x[2, 130] = float("inf")
    x_q, x_s = quantize_activation(x, backend="triton")
    assert x_s[1, 0].isnan() and not torch.isfinite(x_s[2, 1])
    assert torch.isfinite(x_s[0]).all() and x_s[1, 1].isfinite() and x_s[2, 0].isfinite()
    # as the reference: an Inf group's finite values are 0 and the Inf NaN; a NaN group all NaN
    # (the CPU interpreter casts NaN to FP8 as 384: NaN codes are compared on the GPU only)
    r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert same_bits(x_s, r_s)
    finite = ~r_q.float().isnan()
    assert same_bits(x_q[finite], r_q[finite])
    if HAS_CUDA:
        assert x_q.float()[~finite].isnan().all()


def _gemm_params():
    params = []
    for i, (m, n, k) in enumerate(GEMM_SHAPES):
        for gran in GRANS:
            for fp8_dtype, out_dtype in itertools.product(FP8, OUT) if HAS_CUDA else [(FP8[i % 2], OUT[i % 3])]:
                params.append((m, n, k, gran, fp8_dtype, out_dtype))
    return params


@pytest.mark.parametrize("m,n,k,granularity,fp8_dtype,out_dtype", _gemm_params())
def test_gemm_matches_float64(m, n, k, granularity, fp8_dtype, out_dtype):
    if not _fp8_supported(fp8_dtype):
        pytest.skip("fp8 e4m3fnuz needs an AMD GPU")
    dev = KERNEL_DEVICE
    x = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev) / math.sqrt(k)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if (m + n) % 2 else None
    x_q, x_s = quantize_activation(x, fp8_dtype=fp8_dtype, backend="triton")
    w_q, w_s = quantize_weight(w, granularity, fp8_dtype)
    y = torch.full((m, n), float("nan"), device=dev)  # poison: a stale buffer must not leak through
    y = block_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype, bias, backend="triton")
    assert y.shape == (m, n) and y.dtype == out_dtype and torch.isfinite(y).all()
    ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().T
    if bias is not None:
        ref += bias.double()
    assert rel_err(y, ref) < KERNEL_GEMM_TOL[out_dtype]


@pytest.mark.parametrize(
    "config",
    [
        dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2),
        dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
        dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=2),
    ],
)
@pytest.mark.parametrize("granularity", GRANS)
def test_gemm_launch_configs(config, granularity):
    """Every tile shape the tables may pick computes the same function."""
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.gemm import block_fp8_gemm

    m, n, k = (40, 130, 300) if not HAS_CUDA else (1000, 2112, 7168)
    x_q, x_s = quantize_activation(torch.randn(m, k, device=KERNEL_DEVICE), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(n, k, device=KERNEL_DEVICE), granularity)
    if granularity == "tensor":
        w_s = w_s.reshape(())
    y = block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, torch.float32, None, GemmConfig(**config))
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64)
    assert rel_err(y, ref) < KERNEL_GEMM_TOL[torch.float32]


@pytest.mark.parametrize("block_k", [64, 128])  # one or two K steps per scale group
@pytest.mark.parametrize("k", [128, 300, 576])  # one group; ragged last group
def test_gemm_scale_prefetch_same_bits(block_k, k, monkeypatch):
    """1x128 weights on 128-wide tiles load each K group's scales one step ahead: the same bits as
    loading them in the step that uses them."""
    from fp8linear.ops import gemm
    from fp8linear.ops.configs import GemmConfig

    assert gemm.prefetch_scales("row", 128)
    m, n = (40, 260) if not HAS_CUDA else (1000, 2112)
    x_q, x_s = quantize_activation(torch.randn(m, k, device=KERNEL_DEVICE), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(n, k, device=KERNEL_DEVICE), "row")
    cfg = GemmConfig(block_m=32, block_n=128, block_k=block_k, num_warps=4, num_stages=2)
    y = gemm.block_fp8_gemm(x_q, x_s, w_q, w_s, "row", torch.float32, None, cfg)
    monkeypatch.setattr(gemm, "prefetch_scales", lambda granularity, block_n: False)
    y_plain = gemm.block_fp8_gemm(x_q, x_s, w_q, w_s, "row", torch.float32, None, cfg)
    assert same_bits(y, y_plain)
    assert rel_err(y, block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64)) < KERNEL_GEMM_TOL[torch.float32]


@pytest.mark.parametrize("kind", ["tiled", "splitk"])
@pytest.mark.parametrize("granularity", ["block", "row"])
@pytest.mark.parametrize("k", [256, 300])  # whole K steps (loads masked on rows / columns only); a ragged last one
def test_gemm_k_mask_same_bits(kind, granularity, k, monkeypatch):
    """Where K is a multiple of the K step the kernels load operands without a K mask (EVEN_K): the
    same bits as with it, and the float64 bound; a ragged K keeps the mask."""
    from fp8linear.ops import gemm, gemm_common, splitk_gemm
    from fp8linear.ops.configs import GemmConfig, SplitKConfig

    m, n = (40, 200) if not HAS_CUDA else (333, 2112)
    x_q, x_s = quantize_activation(torch.randn(m, k, device=KERNEL_DEVICE), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(n, k, device=KERNEL_DEVICE), granularity)
    if kind == "tiled":
        cfg = GemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=2)
        y_buf = torch.empty((m, n), device=KERNEL_DEVICE)
        assert gemm.tiled_args(x_q, x_s, w_q, w_s, y_buf, granularity, None, cfg, False)[1]["EVEN_K"] == (k % 128 == 0)
    else:
        cfg = SplitKConfig(block_m=16, block_n=64, split_k=2)
    y = gemm.block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, torch.float32, None, cfg)
    monkeypatch.setattr(gemm, "even_k", lambda k, block_k: False)
    monkeypatch.setattr(splitk_gemm, "even_k", lambda k, block_k: False)
    y_masked = gemm.block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, torch.float32, None, cfg)
    assert gemm_common.even_k(k, 128) == (k % 128 == 0)
    assert same_bits(y, y_masked)
    assert rel_err(y, block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64)) < KERNEL_GEMM_TOL[torch.float32]


@pytest.mark.parametrize("granularity,block_n,expected", [("row", 128, True), ("row", 256, True), ("row", 64, False),
                                                          ("block", 128, False), ("block", 256, False),
                                                          ("tensor", 128, False)])
def test_scale_prefetch_rule(granularity, block_n, expected):
    from fp8linear.ops.gemm_common import prefetch_scales

    assert prefetch_scales(granularity, block_n) is expected


def test_gemm_noncontiguous_and_empty():
    dev = KERNEL_DEVICE
    x_q, x_s = quantize_activation(torch.randn(300, 9, device=dev).T, backend="triton")
    w_q, w_s = quantize_weight(torch.randn(300, 200, device=dev).T)  # (200, 300) non-contiguous source
    w_q_t = w_q.T.contiguous().T  # (200, 300) with K stride != 1
    y = block_fp8_matmul(x_q, x_s, w_q_t, w_s, torch.float32, backend="triton")
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64)
    assert rel_err(y, ref) < KERNEL_GEMM_TOL[torch.float32]
    e_q, e_s = quantize_activation(torch.randn(0, 300, device=dev), backend="triton")
    assert block_fp8_matmul(e_q, e_s, w_q, w_s, backend="triton").shape == (0, 200)


# split-K (M <= 64), tiled, and on Hopper the persistent TMA kernel (M >= 2048, K <= 2304).
_LAYOUT_SHAPES = [(5, 300, 640), (70, 200, 300)] + ([(2048, 384, 1152)] if HAS_CUDA else [])


@pytest.mark.parametrize("m,n,k", _LAYOUT_SHAPES)
@pytest.mark.parametrize("granularity", GRANS)
def test_gemm_takes_m_major_activation_scales(m, n, k, granularity):
    """x_s M-major (strides (1, M), cuBLAS's layout) and row-wise w_s N-major give the same bits."""
    x_q, x_s = quantize_activation(torch.randn(m, k, device=KERNEL_DEVICE), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(n, k, device=KERNEL_DEVICE), granularity)
    x_s_mm = x_s.t().contiguous().t()
    assert x_s_mm.stride() == (1, m) and torch.equal(x_s_mm, x_s)
    w_s_nm = w_s.t().contiguous().t() if granularity == "row" else w_s
    y = block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, backend="triton")
    y_mm = block_fp8_matmul(x_q, x_s_mm, w_q, w_s_nm, torch.float32, backend="triton")
    assert torch.equal(y_mm, y)
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64)
    assert rel_err(y_mm, ref) < KERNEL_GEMM_TOL[torch.float32]


@pytest.mark.parametrize("m", [4, 70])  # split-K kernel, tiled kernel
def test_gemm_nan_rows_propagate(m):
    x = torch.randn(m, 256, device=KERNEL_DEVICE)
    x[2, 7] = float("nan")
    x_q, x_s = quantize_activation(x, backend="triton")
    w_q, w_s = quantize_weight(torch.randn(130, 256, device=KERNEL_DEVICE))
    y = block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, backend="triton")
    others = [i for i in range(m) if i != 2]
    assert y[2].isnan().all() and torch.isfinite(y[others]).all()


class _LaunchSpy:
    """Stands in for a @triton.jit kernel: records which kernel a launcher picked, then launches it."""

    def __init__(self, kernel, name: str, log: list[str]):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize(
    "m,n,k,granularity",
    [(2048, 136, 256, "block"), (2048, 130, 576, "tensor"), (2048, 130, 576, "row"), (96, 136, 256, "block"),
     (2048, 64, 300, "block"), (2048, 64, 256, "long-K block")],
)
def test_gemm_kernel_choice(m, n, k, granularity, monkeypatch):
    """Short TMA-aligned K with M >= 2048 and uniform weight scales runs the persistent kernel;
    everything else the plain tiled kernel; both compute the same function. Split-K, which the router
    takes first on a GPU where these narrow outputs leave SMs idle (its routes table or
    mid_splitk_config, tested in test_mid_m_kernels), is left out here."""
    from fp8linear.ops import gemm, router

    monkeypatch.setattr(router, "lookup_route", lambda *args, **kwargs: None)
    monkeypatch.setattr(router, "mid_splitk_config", lambda *args, **kwargs: None)
    if granularity == "long-K block":  # K above the persistent limit, at an interpreter-friendly size
        monkeypatch.setattr(router, "PERSISTENT_MAX_K", k - 128)
        granularity = "block"
    dev = KERNEL_DEVICE
    x_q, x_s = quantize_activation(torch.randn(m, k, device=dev), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(n, k, device=dev) / math.sqrt(k), granularity)
    if granularity == "tensor":
        w_s = w_s.reshape(())
    hopper = torch.version.hip is None and (not HAS_CUDA or torch.cuda.get_device_capability()[0] >= 9)
    dev_ = torch.device(dev)
    expected = (hopper and k % 16 == 0 and k <= router.PERSISTENT_MAX_K and m >= router.PERSISTENT_MIN_M
                and granularity != "row")
    tma = router.tma_ok(x_q) and router.tma_ok(w_q)
    assert tma == (k % 16 == 0)
    assert router.use_persistent(dev_, m, k, granularity, tma) == expected
    assert not router.use_persistent(dev_, m, k - 1, granularity, router.tma_ok(x_q[:, 1:]) and router.tma_ok(w_q[:, 1:]))
    launched: list[str] = []
    for name in ("_block_fp8_gemm_kernel", "_block_fp8_gemm_persistent_kernel"):
        monkeypatch.setattr(gemm, name, _LaunchSpy(getattr(gemm, name), name, launched))
    bias = torch.randn(n, device=dev)
    y = gemm.block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, torch.float32, bias)
    assert launched == ["_block_fp8_gemm_persistent_kernel" if expected else "_block_fp8_gemm_kernel"]
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64) + bias.double()
    assert rel_err(y, ref) < KERNEL_GEMM_TOL[torch.float32]


SPLITK_CONFIGS = [
    dict(block_m=16, block_n=64, split_k=1),
    dict(block_m=16, block_n=32, split_k=3, num_stages=2),
    dict(block_m=32, block_n=128, split_k=2, num_warps=8),
    dict(block_m=64, block_n=16, split_k=1000),  # more splits than K groups: one group each
]


@pytest.mark.parametrize("config", SPLITK_CONFIGS)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("m,n,k,out_dtype", [(1, 200, 2112, torch.bfloat16), (5, 300, 640, torch.float16),
                                             (40, 130, 300, torch.float32)])
def test_splitk_gemm_configs(config, granularity, m, n, k, out_dtype):
    """The split-K kernel computes the same function for every split, tile and output dtype, bias included."""
    from fp8linear.ops.configs import SplitKConfig
    from fp8linear.ops.gemm import block_fp8_gemm

    dev = KERNEL_DEVICE
    x_q, x_s = quantize_activation(torch.randn(m, k, device=dev), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(n, k, device=dev) / math.sqrt(k), granularity)
    if granularity == "tensor":
        w_s = w_s.reshape(())
    bias = torch.randn(n, device=dev)
    y = block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, SplitKConfig(**config))
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float64) + bias.double()
    assert y.shape == (m, n) and y.dtype == out_dtype and rel_err(y, ref) < KERNEL_GEMM_TOL[out_dtype]


def test_splitk_gemm_is_deterministic():
    """The last program sums the partials in split order: repeated runs give the same bits."""
    from fp8linear.ops.splitk_gemm import splitk_fp8_gemm
    from fp8linear.ops.configs import SplitKConfig

    dev = KERNEL_DEVICE
    x_q, x_s = quantize_activation(torch.randn(3, 1024, device=dev), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(200, 1024, device=dev))
    cfg = SplitKConfig(block_m=16, block_n=64, split_k=4)
    first = splitk_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.float32, None, cfg)
    for _ in range(3):
        assert same_bits(splitk_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.float32, None, cfg), first)


@pytest.mark.parametrize("m,n,k", [(1, 64, 4096), (1, 64, 1024), (64, 2048, 7168), (17, 576, 7168), (8, 128, 128),
                                   (1, 18432, 7168), (16, 7168, 18432), (64, 7168, 16384), (1, 128, 2048),
                                   (16, 1024, 3072), (1, 8192, 3072), (4, 64, 1920), (33, 256, 3968),
                                   (1, 576, 1536), (32, 576, 1536), (9, 2048, 1408), (24, 64, 1024), (1, 64, 896),
                                   (32, 5120, 13824), (16, 128, 1920)])
def test_splitk_heuristic(m, n, k):
    """Split long K (>= 32 groups), and K of 8-31 groups where the tiles leave a quarter of the SMs idle
    (NVIDIA), into the fewest splits giving 2 programs per SM, >= 4 groups each (>= 2 below 16
    groups); tiles 64 columns wide up to 32 rows, 32 above."""
    from fp8linear.ops.configs import sm_count
    from fp8linear.ops.router import splitk_config

    dev = torch.device(KERNEL_DEVICE)
    cfg = splitk_config(m, n, k, dev)
    groups = -(-k // 128)
    block_m, block_n = (16 if m <= 16 else (32 if m <= 32 else 64)), (64 if m <= 32 else 32)
    tiles = -(-m // block_m) * -(-n // block_n)
    if groups < 8 or (groups < 32 and (tiles > 0.75 * sm_count(dev) or torch.version.hip is not None)):
        assert cfg is None
        return
    min_per_split = 4 if groups >= 16 else 2
    if tiles >= 2 * sm_count(dev) or groups < 2 * min_per_split:  # enough tiles, or too short to split
        assert cfg is None
        return
    assert cfg is not None and (cfg.block_m, cfg.block_n) == (block_m, block_n) and cfg.split_k > 1
    per_split = -(-groups // cfg.split_k)
    assert -(-groups // per_split) == cfg.split_k and per_split >= min_per_split  # no empty split
    assert tiles * (cfg.split_k - 1) < 2 * sm_count(dev)  # the fewest splits giving 2 programs per SM


@pytest.mark.parametrize(
    "bad",
    [dict(block_m=8, block_n=64, split_k=1), dict(block_m=16, block_n=256, split_k=1),
     dict(block_m=16, block_n=48, split_k=1), dict(block_m=16, block_n=64, split_k=0),
     dict(block_m=16, block_n=64, split_k=1, num_warps=3), dict(block_m=16, block_n=64, split_k=1, num_stages=0)],
)
def test_splitk_config_validation(bad):
    from fp8linear.ops.configs import SplitKConfig

    with pytest.raises(ValueError, match="SplitKConfig"):
        SplitKConfig(**bad)


def test_custom_ops_pass_opcheck():
    """Fake (meta) implementations agree with the real ops: what torch.compile relies on."""
    from fp8linear import functional

    x = torch.randn(5, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    # Schema/autograd checks compare outputs with ops CPU lacks for FP8; the fake-tensor and
    # dynamic-shape checks are what tracing needs.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(functional._act_quant_op, (x, torch.float8_e4m3fn), test_utils=utils)
    x_q, x_s = quantize_activation(x, backend="triton")
    for gran in GRANS:
        w_q, w_s = quantize_weight(torch.randn(130, 300, device=KERNEL_DEVICE), gran)
        bias = torch.randn(130, device=KERNEL_DEVICE)
        torch.library.opcheck(
            functional._gemm_op, (x_q, x_s, w_q, w_s, gran, torch.bfloat16, bias, False, None), test_utils=utils
        )
        x2 = torch.randn(3, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
        torch.library.opcheck(functional._linear_op, (x2, w_q, w_s, gran, bias.bfloat16(), True, None),
                              test_utils=utils)
    # a decode GEMM long enough to split K, counting in split-K counters
    from fp8linear.ops.splitk_gemm import splitk_counters

    w_q, w_s = quantize_weight(torch.randn(130, 4096, device=KERNEL_DEVICE), "block")
    x3 = torch.randn(3, 4096, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    ws = splitk_counters(130, KERNEL_DEVICE)
    torch.library.opcheck(functional._linear_op, (x3, w_q, w_s, "block", None, False, ws), test_utils=utils)
    x3_q, x3_s = quantize_activation(x3, backend="triton")
    torch.library.opcheck(functional._gemm_op, (x3_q, x3_s, w_q, w_s, "block", torch.bfloat16, None, False, ws),
                          test_utils=utils)
    assert not ws.any()


def test_fp8_linear_traces_fullgraph():
    """torch.compile sees the forward as two custom ops, no graph break."""
    from fp8linear import Fp8BlockLinear

    lin = torch.nn.Linear(300, 130, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    mod = Fp8BlockLinear.from_linear(lin, backend="triton")
    x = torch.randn(2, 3, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager" if not HAS_CUDA else "inductor")
    assert same_bits(compiled(x), mod(x))
    # a split-K decode GEMM whose layer already has its split-K counters (made by an eager call)
    mod = Fp8BlockLinear.from_linear(torch.nn.Linear(4096, 130, device=KERNEL_DEVICE), backend="triton")
    x = torch.randn(3, 4096, device=KERNEL_DEVICE)
    eager = mod(x)
    assert mod._split_k_counters is not None
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager" if not HAS_CUDA else "inductor")
    assert same_bits(compiled(x), eager) and not mod._split_k_counters.any()


def test_forced_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize_activation(torch.randn(2, 128), backend="triton")
    monkeypatch.setenv("FP8LINEAR_BACKEND", "bogus")
    with pytest.raises(ValueError, match="FP8LINEAR_BACKEND must be one of"):
        quantize_activation(torch.randn(2, 128))


def test_eager_calls_skip_the_custom_op_dispatcher():
    """Eager mode calls the launcher directly (host overhead); torch.compile traces the custom op."""
    from fp8linear.functional import eager_or_traced

    calls: list[str] = []

    def op(x):
        calls.append("op")
        return x + 1

    def launcher(x):
        calls.append("launcher")
        return x + 1

    fn = eager_or_traced(op, launcher)
    assert fn(torch.ones(2)).tolist() == [2.0, 2.0] and calls == ["launcher"]
    calls.clear()
    compiled = torch.compile(lambda x: fn(x) * 2, backend="eager", fullgraph=True)
    assert compiled(torch.ones(2)).tolist() == [4.0, 4.0] and calls == ["op"]


# ----------------------------------------------------------------------------- fused quantize + GEMV
GEMV_SHAPES = (
    [(m, n, k) for m in (1, 3) for n in (1, 8, 576, 2112, 7168) for k in (128, 300, 2112, 7168)]
    if HAS_CUDA else [(1, 1, 128), (1, 300, 300), (3, 130, 2112), (1, 576, 576), (2, 8, 1000)]
)


def _gemv_params():
    params = []
    for i, (m, n, k) in enumerate(GEMV_SHAPES):
        for gran in GRANS:
            for fp8_dtype, in_dtype in itertools.product(FP8, OUT) if HAS_CUDA else [(FP8[i % 2], OUT[(i + len(params)) % 3])]:
                params.append((m, n, k, gran, fp8_dtype, in_dtype))
    return params


@pytest.mark.parametrize("m,n,k,granularity,fp8_dtype,in_dtype", _gemv_params())
def test_fused_gemv_matches_float64(m, n, k, granularity, fp8_dtype, in_dtype):
    """Quantize-in-kernel + GEMV against dequant(quant_ref(x)) @ dequant(w).T in float64."""
    from fp8linear.ops.fused_gemv import fused_fp8_gemv

    if not _fp8_supported(fp8_dtype):
        pytest.skip("fp8 e4m3fnuz needs an AMD GPU")
    dev = KERNEL_DEVICE
    x = (torch.randn(m, k, device=dev) * 3).to(in_dtype)
    w_q, w_s = quantize_weight(torch.randn(n, k, device=dev) / math.sqrt(k), granularity, fp8_dtype)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if (n + k) % 2 else None
    y = fused_fp8_gemv(x, w_q, w_s.reshape(()) if granularity == "tensor" else w_s, granularity, bias)
    assert y.shape == (m, n) and y.dtype == in_dtype and torch.isfinite(y).all()
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().T
    if bias is not None:
        ref += bias.double()
    # KERNEL_GEMM_TOL counts on the Frobenius norm averaging the output roundings (about a third
    # of one unit roundoff); with a handful of outputs one rounding can take a whole unit (2^-11
    # for fp16: measured 4.9e-4 against the 5e-4 bound with 3 outputs), so allow one unit more.
    tol = KERNEL_GEMM_TOL[in_dtype] * (1 if m * n >= 64 else 2)
    assert rel_err(y, ref) < tol


@pytest.mark.parametrize("config", [dict(block_n=4, groups_per_step=1, num_warps=1, num_stages=1),
                                    dict(block_n=8, groups_per_step=8, num_warps=8, num_stages=2),
                                    dict(block_n=128, groups_per_step=2, num_warps=4, num_stages=3),
                                    dict(block_n=32, groups_per_step=4, num_warps=4, num_stages=4)])
@pytest.mark.parametrize("granularity", GRANS)
def test_fused_gemv_configs(config, granularity):
    from fp8linear.ops.fused_gemv import fused_fp8_gemv
    from fp8linear.ops.configs import GemvConfig

    dev = KERNEL_DEVICE
    x = torch.randn(2, 1100, device=dev, dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(72, 1100, device=dev) / 33, granularity)
    w_s = w_s.reshape(()) if granularity == "tensor" else w_s
    y = fused_fp8_gemv(x, w_q, w_s, granularity, None, GemvConfig(**config))
    ref = block_fp8_matmul_ref(*quantize_activation_ref(x, w_q.dtype), w_q, w_s, torch.float32)
    assert rel_err(y, ref) < KERNEL_GEMM_TOL[torch.bfloat16]


def test_fused_gemv_nan_row_propagates_and_config_validation():
    from fp8linear.ops.fused_gemv import fused_fp8_gemv
    from fp8linear.ops.configs import GemvConfig

    dev = KERNEL_DEVICE
    x = torch.randn(3, 300, device=dev)
    x[1, 7] = float("nan")
    w_q, w_s = quantize_weight(torch.randn(40, 300, device=dev), "block")
    y = fused_fp8_gemv(x, w_q, w_s, "block")
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    for bad in (dict(block_n=3), dict(block_n=256), dict(block_n=8, groups_per_step=16), dict(block_n=8, num_warps=3),
                dict(block_n=8, num_stages=0)):
        with pytest.raises(ValueError, match="GemvConfig"):
            GemvConfig(**bad)


@pytest.mark.parametrize("m,n,k,fused", [(1, 576, 7168, True), (1, 130, 300, True), (2, 130, 300, False),
                                         (1, 18432, 7168, False), (1, 3072, 8192, False), (1, 3071, 8192, True)])
def test_fp8_linear_fused_dispatch(m, n, k, fused, monkeypatch):
    """One token below 24M weight elements (FUSED_GEMV_MAX_WEIGHT) runs the fused GEMV; otherwise
    act_quant + GEMM (the one-launch decode kernel is for eager module plans only, see test_linear_plans)."""
    from fp8linear import functional
    from fp8linear.ops import fused_decode, fused_gemv, quant
    from fp8linear.ops.router import route_linear

    route = route_linear(torch.device(KERNEL_DEVICE), m, n, k, "row", torch.float8_e4m3fn, torch.bfloat16, None,
                         False, True)
    assert (route.kernel == "gemv") is fused
    if n * k > 1 << 20:
        return  # the rule is what matters; large weights are run by the GPU tests above
    launched: list[str] = []
    for mod, name in ((fused_gemv, "_fused_fp8_gemv_kernel"), (quant, "_act_quant_kernel"),
                      (fused_decode, "_fused_decode_kernel")):
        monkeypatch.setattr(mod, name, _LaunchSpy(getattr(mod, name), name, launched))
    x = torch.randn(m, k, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(n, k, device=KERNEL_DEVICE) / 20, "row")
    y = functional.fp8_linear(x, w_q, w_s, backend="triton")
    assert launched == (["_fused_fp8_gemv_kernel"] if fused else ["_act_quant_kernel"])
    ref = functional.fp8_linear(x, w_q, w_s, backend="reference")
    assert y.dtype == x.dtype and rel_err(y, ref) < KERNEL_GEMM_TOL[torch.bfloat16]


def test_single_token_linear_op_passes_opcheck_and_compiles():
    """One token runs the fused GEMV inside the linear custom op: opcheck and a full-graph compile."""
    from fp8linear import Fp8BlockLinear, functional

    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    x = torch.randn(1, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    for gran in GRANS:
        w_q, w_s = quantize_weight(torch.randn(130, 300, device=KERNEL_DEVICE), gran)
        w_s = w_s.reshape(()) if gran == "tensor" else w_s
        torch.library.opcheck(functional._linear_op,
                              (x, w_q, w_s, gran, torch.randn(130, device=KERNEL_DEVICE), False, None),
                              test_utils=utils)
    lin = torch.nn.Linear(300, 130, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    mod = Fp8BlockLinear.from_linear(lin, backend="triton")
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager" if not HAS_CUDA else "inductor")
    x1 = torch.randn(1, 1, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    assert same_bits(compiled(x1), mod(x1))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from fp8linear.ops.quant import to_fp8

    @triton.jit
    def _to_fp8_kernel(x_ptr, q_ptr, HW_ROUND: tl.constexpr):
        offs = tl.arange(0, 16)
        tl.store(q_ptr + offs, to_fp8(tl.load(x_ptr + offs), q_ptr.dtype.element_ty, HW_ROUND, -6))


def test_hardware_rounding_gives_the_grid_bytes(monkeypatch):
    """quant.to_fp8 with the hardware conversion: values round to nearest even as round_to_fp8_grid
    does, and a negative zero (what the conversion gives for negative values that round to zero)
    becomes the grid's +0. The rule: NVIDIA e4m3fn outside the interpreter only."""
    from fp8linear.ops import quant
    from fp8linear.reference import round_to_fp8_grid

    # values on the grid, and values that round to (negative) zero; on a GPU also ties and values
    # between grid points (the CPU interpreter's conversion does not round to nearest even)
    x = [-0.0, -1e-30, -2.0**-12, 2.0**-12, 1.0, -448.0, 448.0, 0.0, 1.125, -2.0**-9, 240.0, -16.0, 2.0**-9,
         3.0 * 2.0**-9, -1e-20, -2.0**-10]
    if HAS_CUDA:
        x = [-0.0, -1e-30, -2.0**-10, 2.0**-10, -2.0**-10 * 3, 1.0625, -448.0, 1.1875, -0.001, 3.0 * 2.0**-9,
             -17.0, 17.0, 0.3, -0.0004, -2.0**-10 * 1.0000001, -1e-20]
    x = torch.tensor(x, device=KERNEL_DEVICE)
    q = torch.empty(16, dtype=torch.float8_e4m3fn, device=KERNEL_DEVICE)
    _to_fp8_kernel[(1,)](x, q, HW_ROUND=True)
    ref = round_to_fp8_grid(x.cpu(), torch.float8_e4m3fn)
    ref = torch.where(ref == 0, torch.zeros_like(ref), ref).to(torch.float8_e4m3fn)  # the grid's zero is +0
    assert same_bits(q.cpu(), ref)
    assert (q.cpu().view(torch.uint8) != 0x80).all()
    monkeypatch.setattr(quant, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert quant.hardware_rounding(torch.float8_e4m3fn)
    assert not quant.hardware_rounding(torch.float8_e4m3fnuz)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not quant.hardware_rounding(torch.float8_e4m3fn)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(quant, "interpreting", lambda: True)
    assert not quant.hardware_rounding(torch.float8_e4m3fn)


def test_functional_ops_launch_with_their_inputs_device_current(monkeypatch):
    """Triton launches on the current device: each public op's kernels run inside
    device_guard(its first tensor's device), eagerly and through its custom op alike (the op
    bodies run the launchers on real tensors, under torch.compile's graphs too)."""
    from fp8linear import fp8_linear, functional, grouped_fp8_matmul

    entered = []
    real = functional.device_guard
    monkeypatch.setattr(functional, "device_guard", lambda device: entered.append(device) or real(device))
    dev = torch.device(KERNEL_DEVICE)
    x = torch.randn(3, 256, device=dev)
    w_q, w_s = quantize_weight(torch.randn(136, 256, device=dev), "block")
    x_q, x_s = quantize_activation(x, backend="triton")
    assert entered == [dev]
    block_fp8_matmul(x_q, x_s, w_q, w_s, backend="triton")
    fp8_linear(x, w_q, w_s, backend="triton")
    assert entered == [dev] * 3
    idx = torch.tensor([[0, 1], [1, 0], [0, 0]], device=dev)
    grouped_fp8_matmul(x_q, x_s, torch.stack([w_q, w_q]), torch.stack([w_s, w_s]), idx, backend="triton")
    assert len(entered) >= 4 and set(entered) == {dev}
    entered.clear()
    functional._act_quant_op(x, w_q.dtype)  # the custom op's body
    functional._gemm_op(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None, False, None)
    functional._linear_op(x, w_q, w_s, "block", None, False, None)
    assert entered == [dev] * 3


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("m", [1, 8, 333])
def test_gpu_functional_ops_compute_on_their_inputs_gpu(m):
    """Inputs on cuda:1 while cuda:0 is current give the bits the ops give with cuda:1 current."""
    from fp8linear import fp8_linear, grouped_fp8_matmul

    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda:1").manual_seed(m)
    x = torch.randn(m, 7168, generator=gen, device="cuda:1").to(torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(2112, 7168, generator=gen, device="cuda:1"), "block")
    idx = torch.randint(0, 2, (m, 2), generator=gen, device="cuda:1")

    def run():
        x_q, x_s = quantize_activation(x)
        return (x_q, x_s, block_fp8_matmul(x_q, x_s, w_q, w_s), fp8_linear(x, w_q, w_s),
                grouped_fp8_matmul(x_q, x_s, torch.stack([w_q, w_q]), torch.stack([w_s, w_s]), idx))

    with torch.cuda.device(1):
        expect = run()
    got = run()
    assert torch.cuda.current_device() == 0
    for a, b in zip(got, expect):
        assert a.device == torch.device("cuda:1") and same_bits(a, b)
