"""Per-token 1x128 activation quantization (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from ..formats import GROUP_SIZE, SCALE_DTYPE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR
from .cublas_gemm import CUBLAS_ROW_ALIGN
from .pdl import release_dependents
from .router import act_quant_launch

__all__ = ["CUBLAS_ROW_ALIGN", "act_quant", "act_quant_args", "act_quant_outputs", "cublas_rows", "hardware_rounding",
           "quantize_groups", "round_to_fp8_grid", "to_fp8"]


@triton.jit
def round_to_fp8_grid(v, MIN_EXP: tl.constexpr):
    """Triton twin of reference.round_to_fp8_grid: round fp32 to the FP8 grid, ties to even."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exponent, MIN_EXP) - 3
    up = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    down = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    y = v * up
    # |y| < 16 here, so adding and subtracting 1.5 * 2**23 rounds it to an integer, ties to even.
    r = ((y + 12582912.0) - 12582912.0) * down
    return tl.where(r == 0.0, 0.0, r)


@triton.jit
def quantize_groups(x, qmax, amax_floor, MIN_EXP: tl.constexpr, GRID_ROUND: tl.constexpr = True):
    """fp32 (R, 128) tile, one 1x128 group per row -> (q (R, 128) fp32 values on the FP8 grid, scale (R,)).
    Without GRID_ROUND q is returned before rounding to the grid (clamped to +-qmax), for
    :func:`to_fp8` to round with the hardware conversion.

    Same results as reference._quantize_groups, bit for bit; NaN propagates through max and clamp
    (an Inf makes its group's scale Inf, its own value NaN and the group's finite values 0).

    x / scale, correctly rounded to fp32 as the reference divides, is computed as
    fp32(fp64(x) * fp64(1 / scale)): one fp64 division per group instead of a correctly rounded
    fp32 division per element (H100, act_quant of 77x576 under CUDA graphs: 1.7 vs 4.0 us;
    ``div.rn.f32`` per element was most of the kernel's time). It is exact: with 24-bit x and
    scale, x / scale is either an fp32 value or at least 2**-49 (relative) away from every
    midpoint between two fp32 values, while the fp64 product is within a few 2**-53 of it, so
    rounding it to fp32 gives the same value (tests/ops/test_kernels.py checks every bf16 value
    and wide-range fp32 inputs).
    """
    amax = tl.max(tl.abs(x), 1)  # tl.max drops NaN: put it back for groups that hold one
    amax = tl.where(tl.max((x != x).to(tl.int32), 1) > 0, float("nan"), amax)
    amax = tl.maximum(amax, amax_floor, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32))
    inv_scale = 1.0 / scale.to(tl.float64)
    q = (x.to(tl.float64) * inv_scale[:, None]).to(tl.float32)
    q = tl.minimum(tl.maximum(q, -qmax, propagate_nan=tl.PropagateNan.ALL), qmax, propagate_nan=tl.PropagateNan.ALL)
    if GRID_ROUND:
        q = round_to_fp8_grid(q, MIN_EXP)
    return q, scale


@triton.jit
def to_fp8(q, dtype: tl.constexpr, HW_ROUND: tl.constexpr, MIN_EXP: tl.constexpr):
    """FP8 bytes of `q`: values already on the grid (HW_ROUND False), or clamped values rounded by the
    hardware conversion (to nearest even, as round_to_fp8_grid), after values that round to zero
    (at most half the smallest subnormal, 2**(MIN_EXP - 4)) are set to +0: the conversion would give
    negative ones -0, the grid +0."""
    if HW_ROUND:
        half_tiny = tl.full((), (127 + MIN_EXP - 4) << 23, tl.int32).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(q) <= half_tiny, 0.0, q).to(dtype)
    else:
        return q.to(dtype)


# What depends on M unspecialized: a layer's cuBLAS route reuses one compiled launch for every M
# (fp8linear.ops.linear.CublasLinear; M-major scales have a column stride of M).
@triton.jit(do_not_specialize=["M", "M_IN", "stride_sg"])
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, M_IN, K,
    stride_xm, stride_qm, stride_sm, stride_sg,
    qmax, amax_floor,
    MIN_EXP: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, RELEASE_EARLY: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    release_dependents(RELEASE_EARLY)  # the decode GEMM after us may be scheduled now (ops/pdl.py)
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = pid_g * GROUP + tl.arange(0, GROUP)
    row_ok = offs_m < M
    k_ok = offs_k[None, :] < K
    # Rows M_IN..M-1 are padding (cuBLAS layout): read as zeros, stored as zeros with the floor scale.
    x_mask = (offs_m < M_IN)[:, None] & k_ok
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, qmax, amax_floor, MIN_EXP, not HW_ROUND)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :],
             to_fp8(q, q_ptr.dtype.element_ty, HW_ROUND, MIN_EXP), mask=row_ok[:, None] & k_ok)
    tl.store(s_ptr + offs_m * stride_sm + pid_g * stride_sg, scale, mask=row_ok)


def hardware_rounding(fp8_dtype: torch.dtype) -> bool:
    """Whether act_quant rounds to e4m3fn with the hardware conversion (NVIDIA GPUs) instead of
    round_to_fp8_grid's arithmetic (the CPU interpreter, whose conversion does not round ties to
    even, and ROCm's e4m3fnuz): the same bytes (tests/ops/test_kernels.py, every bf16 value on H100),
    0.87-0.96x the time under CUDA graphs (H100, benchmarks/act_quant_probe.py: 1024x7168 9.04
    against 10.38 us, 333x7168 5.29 against 5.80, 77x576 1.69 against 1.76)."""
    return fp8_dtype == torch.float8_e4m3fn and torch.version.hip is None and not interpreting()


def cublas_rows(m: int) -> int:
    """Rows of the cuBLAS-layout output for an M-row input: M rounded up to a multiple of 4."""
    return -(-m // CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN


def act_quant_outputs(m_in: int, k: int, fp8_dtype: torch.dtype, device: torch.device,
                      cublas_layout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (x_q, x_s) for :func:`act_quant` of an (m_in, K) input (see there for the layouts)."""
    m = cublas_rows(m_in) if cublas_layout else m_in
    groups = triton.cdiv(k, GROUP_SIZE)
    x_q = torch.empty((m, k), dtype=fp8_dtype, device=device)
    x_s = torch.empty_strided((m, groups), (1, m) if cublas_layout else (groups, 1), dtype=SCALE_DTYPE, device=device)
    return x_q, x_s


def act_quant_args(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor,
                   release_early: bool = False) -> tuple[tuple[int, int], dict, dict]:
    """(grid, kernel arguments, launch options) quantizing x (M_in, K) into x_q, x_s (M >= M_in rows)."""
    m_in, k = x.shape
    m = x_q.shape[0]
    block_m, num_warps = act_quant_launch(m, k)
    fp8_dtype = x_q.dtype
    args = dict(
        x_ptr=x, q_ptr=x_q, s_ptr=x_s, M=m, M_IN=m_in, K=k,
        stride_xm=x.stride(0), stride_qm=x_q.stride(0), stride_sm=x_s.stride(0), stride_sg=x_s.stride(1),
        qmax=activation_max(fp8_dtype), amax_floor=AMAX_FLOOR,
        MIN_EXP=fp8_min_exponent(fp8_dtype), BLOCK_M=block_m, GROUP=GROUP_SIZE, RELEASE_EARLY=release_early,
        HW_ROUND=hardware_rounding(fp8_dtype),
    )
    return (triton.cdiv(m, block_m), triton.cdiv(k, GROUP_SIZE)), args, {"num_warps": num_warps}


def act_quant(x: torch.Tensor, fp8_dtype: torch.dtype, cublas_layout: bool = False,
              release_early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D `x` (M, K) with unit stride along K -> (x_q (M, K), x_s (M, ceil(K/128))).

    `release_early`: let a GEMM launched next with PDL be scheduled while this kernel runs
    (:class:`fp8linear.ops.router.Route`); the GEMM still waits for this kernel's results.

    With `cublas_layout`, the layout torch._scaled_mm's blockwise path takes: M is padded to
    M' = cublas_rows(M) with zero rows (scale = the amax floor's), x_q is (M', K) and x_s is
    (M', ceil(K/128)) with strides (1, M') (M-major).
    """
    m_in, k = x.shape
    x_q, x_s = act_quant_outputs(m_in, k, fp8_dtype, x.device, cublas_layout)
    if x_q.shape[0] == 0 or k == 0:
        return x_q, x_s
    grid, args, options = act_quant_args(x, x_q, x_s, release_early)
    _act_quant_kernel[grid](**args, **options)
    return x_q, x_s
