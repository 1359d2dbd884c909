"""RMSNorm in one launch (Triton), with the numerics of transformers' Llama-family RMSNorm.

``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``: the normalised row is
rounded to the input's dtype before the weight multiplies it, and the product takes
``torch.result_type(weight, x)``. Eagerly that formula is eight ATen kernels (and as many launches
of host work); this kernel is one. It differs from the ATen formula only in the order of the
row's sum of squares and in rsqrt's last bit, so an output may be one rounding step of its dtype
away (tests/ops/test_rmsnorm.py bounds it against float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rms_norm_args", "rms_norm_supported", "rows_view"]

# Rows up to this many elements are held in registers in one pass (DeepSeek-V3 7168, Llama-70B /
# Qwen-72B 8192 fit: 16 or 32 fp32 values a thread at 16 warps); wider rows loop over chunks.
ONE_PASS_MAX = 16384
CHUNK = 4096
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 `v` rounded to `dtype`, ties to even, returned as fp32 (for bfloat16 by integer
    arithmetic: the CPU interpreter's conversion truncates, the GPUs' rounds; both agree then)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_xm, eps,
                     BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * N
    in_dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        h = _round_to(x * r, in_dtype)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + offs, _round_to(w * h, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = start + offs < N
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        r = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            mask = start + offs < N
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            h = _round_to(x * r, in_dtype)
            w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            y = _round_to(w * h, y_ptr.dtype.element_ty)
            tl.store(y_row + start + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """`x` as a 2-D view of evenly strided rows with unit stride along them (a split or a slice
    of a wider tensor's last dim qualifies), or None."""
    if x.dim() == 0 or x.stride(-1) != 1 and x.shape[-1] != 1:
        return None
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError:  # the leading dims do not merge into one evenly strided one
        return None
    return x2 if x2.stride(1) == 1 else x2.as_strided(x2.shape, (x2.stride(0), 1))


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: a non-empty float `x` of evenly strided rows
    (:func:`rows_view`) and a contiguous float weight of its row width, on x's device."""
    return (x.dtype in _DTYPES and weight.dtype in _DTYPES and x.dim() >= 1 and x.numel() > 0
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.is_contiguous()
            and x.device == weight.device and rows_view(x) is not None)


def rms_norm_args(x2: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, eps: float) -> tuple[tuple[int], dict, dict]:
    """(grid, arguments, launch options) of the kernel over the rows of 2-D `x2` into contiguous `y`."""
    n = x2.shape[1]
    one_pass = n <= ONE_PASS_MAX
    block = triton.next_power_of_2(n) if one_pass else CHUNK
    # A warp per 512 elements, at most 16. H100 (benchmarks/norm_ab.py): 8192x7168 bf16 in 85.5 us,
    # 2.7 TB/s of the 3.0 copy ceiling; one 7168-wide row in 6.7 us.
    num_warps = max(1, min(16, block // 512))
    args = dict(x_ptr=x2, w_ptr=weight, y_ptr=y, N=n, stride_xm=x2.stride(0), eps=float(eps),
                BLOCK_N=block, ONE_PASS=one_pass)
    return (x2.shape[0],), args, dict(num_warps=num_warps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x`'s last dimension in one Triton launch (CUDA/ROCm, or the CPU interpreter).

    Raises TypeError / ValueError for operands the kernel does not take (see
    :func:`rms_norm_supported`; callers fall back to :func:`fp8linear.reference.rms_norm_ref`)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm takes tensors, got {type(x).__name__} and {type(weight).__name__}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise TypeError(f"rms_norm takes bf16/fp16/fp32 tensors, got x {x.dtype} and weight {weight.dtype}")
    if not rms_norm_supported(x, weight):
        raise ValueError(
            "rms_norm needs x [..., N] with unit stride in its last dim and a contiguous weight [N] on x's device, "
            f"got x {tuple(x.shape)} strides {x.stride()} on {x.device}, "
            f"weight {tuple(weight.shape)} on {weight.device}"
        )
    x2 = rows_view(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    grid, args, options = rms_norm_args(x2, weight, y, eps)
    _rms_norm_kernel[grid](**args, **options)
    return y
