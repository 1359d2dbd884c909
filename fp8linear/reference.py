"""Pure-PyTorch reference numerics: the contract the Triton kernels are tested against.

Runs on any device. The operation order here is the one the kernels follow, so that
quantized values and scales are bit-exact between the two:

    amax  = max(|x| over a group), floored at AMAX_FLOOR        (NaN propagates)
    scale = amax / FP8_MAX                                      (fp32, the dequant multiplier)
    q     = clamp(x / scale, -FP8_MAX, FP8_MAX).to(fp8)          (round to nearest even)
    dequant(q) = q.float() * scale

Inputs are assumed validated (see :mod:`fp8linear.functional`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import GRANULARITIES, GROUP_SIZE, SCALE_DTYPE, activation_max, check_granularity, fp8_max, fp8_min_exponent

__all__ = [
    "AMAX_FLOOR",
    "GRANULARITIES",
    "round_to_fp8_grid",
    "quantize_activation_ref",
    "quantize_weight_ref",
    "dequantize_activation_ref",
    "dequantize_weight_ref",
    "weight_scale_shape",
    "weight_granularity",
    "expand_weight_scale",
    "block_fp8_matmul_ref",
    "grouped_fp8_matmul_ref",
    "rms_norm_ref",
]

# amax is floored here so an all-zero group gets a finite, non-zero scale and quantizes to 0;
# 1e-12 is far below any real activation/weight magnitude and far above fp32's tiny (1.2e-38).
AMAX_FLOOR = 1e-12


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = _cdiv(x.shape[-1], multiple) * multiple - x.shape[-1]
    return F.pad(x, (0, pad)) if pad else x


def round_to_fp8_grid(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round float32 `v` (already clamped to the FP8 range) to the nearest FP8 value, ties to even.

    Done explicitly so the final cast is exact on every path: casts differ in how they round
    (torch's fnuz cast rounds ties away from zero, hardware rounds them to even, and Triton's
    CPU interpreter mis-rounds e4m3fn). -0.0 becomes +0.0.
    """
    exponent = ((v.view(torch.int32) >> 23) & 0xFF) - 127  # unbiased fp32 exponent
    ulp_exp = exponent.clamp(min=fp8_min_exponent(fp8_dtype)) - 3  # 3 mantissa bits
    up = ((127 - ulp_exp) << 23).view(torch.float32)  # 2**-ulp_exp, exact
    down = ((127 + ulp_exp) << 23).view(torch.float32)  # 2**ulp_exp, exact
    r = torch.round(v * up) * down  # torch.round: half to even
    return torch.where(r == 0, torch.zeros_like(r), r)


def _quantize_groups(xg: torch.Tensor, dims: tuple[int, ...], qmax: float, fp8_dtype: torch.dtype):
    """Quantize float32 `xg` with one scale per slice reduced over `dims`."""
    amax = xg.abs().amax(dim=dims, keepdim=True).clamp(min=AMAX_FLOOR)
    # Divide by a tensor, not a Python scalar: CUDA turns `t / scalar` into `t * (1/scalar)`.
    scale = amax / torch.full_like(amax, qmax)
    q = (xg / scale).clamp(-qmax, qmax)
    return round_to_fp8_grid(q, fp8_dtype).to(fp8_dtype), scale


def quantize_activation_ref(
    x: torch.Tensor, fp8_dtype: torch.dtype, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1 x group_size quantization of `x` (..., K) -> (x_q (..., K), x_s (..., ceil(K/g)))."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    groups = _cdiv(k, group_size)
    xg = _pad_last(x.float(), group_size).reshape(*lead, groups, group_size)
    q, scale = _quantize_groups(xg, (-1,), activation_max(fp8_dtype), fp8_dtype)
    x_q = q.reshape(*lead, groups * group_size)[..., :k].contiguous()
    return x_q, scale.squeeze(-1).to(SCALE_DTYPE)


def dequantize_activation_ref(x_q: torch.Tensor, x_s: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    k = x_q.shape[-1]
    return x_q.float() * x_s.repeat_interleave(group_size, dim=-1)[..., :k]


def weight_scale_shape(shape: tuple[int, ...] | torch.Size, granularity: str) -> tuple[int, ...]:
    """Scale shape for a weight of shape (..., N, K) at the given granularity."""
    check_granularity(granularity)
    *batch, n, k = shape
    if granularity == "block":
        return (*batch, _cdiv(n, GROUP_SIZE), _cdiv(k, GROUP_SIZE))
    if granularity == "row":
        return (*batch, n, _cdiv(k, GROUP_SIZE))
    return tuple(batch)  # tensor


def weight_granularity(weight_shape: tuple[int, ...] | torch.Size, scale_shape: tuple[int, ...] | torch.Size) -> str:
    """Infer the granularity of a weight (..., N, K) from its scale's shape; ValueError if none fits."""
    weight_shape, scale_shape = tuple(weight_shape), tuple(scale_shape)
    batch = weight_shape[:-2]
    # Per-tensor: one element per 2-D weight; accept trailing singleton dims ((), (1,), (1, 1)).
    if scale_shape[: len(batch)] == batch and all(d == 1 for d in scale_shape[len(batch):]):
        return "tensor"
    for gran in ("block", "row"):
        if scale_shape == weight_scale_shape(weight_shape, gran):
            return gran
    expected = ", ".join(f"{g}: {weight_scale_shape(weight_shape, g)}" for g in GRANULARITIES)
    raise ValueError(
        f"weight scale shape {scale_shape} matches no granularity for a weight of shape "
        f"{weight_shape}; expected one of {expected}"
    )


def quantize_weight_ref(w: torch.Tensor, granularity: str, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight (..., N, K) -> (w_q (..., N, K), w_s) at 'block' (128x128), 'row' (1x128) or 'tensor'."""
    check_granularity(granularity)
    *batch, n, k = w.shape
    qmax = fp8_max(fp8_dtype)
    wf = w.float()
    if granularity == "tensor":
        flat = wf.reshape(*batch, n * k, 1)  # one group per 2-D weight
        q, scale = _quantize_groups(flat, (-2, -1), qmax, fp8_dtype)
        return q.reshape(w.shape), scale.reshape(batch).to(SCALE_DTYPE)
    kb = _cdiv(k, GROUP_SIZE)
    wp = _pad_last(wf, GROUP_SIZE)
    if granularity == "row":
        q, scale = _quantize_groups(wp.reshape(*batch, n, kb, GROUP_SIZE), (-1,), qmax, fp8_dtype)
        q = q.reshape(*batch, n, kb * GROUP_SIZE)[..., :k]
        return q.contiguous(), scale.squeeze(-1).to(SCALE_DTYPE)
    nb = _cdiv(n, GROUP_SIZE)  # block
    wp = _pad_last(wp.transpose(-1, -2), GROUP_SIZE).transpose(-1, -2)  # pad N too
    blocks = wp.reshape(*batch, nb, GROUP_SIZE, kb, GROUP_SIZE)
    q, scale = _quantize_groups(blocks, (-3, -1), qmax, fp8_dtype)
    q = q.reshape(*batch, nb * GROUP_SIZE, kb * GROUP_SIZE)[..., :n, :k]
    return q.contiguous(), scale.reshape(*batch, nb, kb).to(SCALE_DTYPE)


def expand_weight_scale(w_s: torch.Tensor, weight_shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Broadcast a weight scale of any granularity to a full (..., N, K) fp32 tensor."""
    *batch, n, k = weight_shape
    gran = weight_granularity(weight_shape, w_s.shape)
    if gran == "tensor":
        return w_s.reshape(*batch, 1, 1).expand(*batch, n, k)
    s = w_s.repeat_interleave(GROUP_SIZE, dim=-1)[..., :k]
    if gran == "block":
        s = s.repeat_interleave(GROUP_SIZE, dim=-2)[..., :n, :]
    return s


def dequantize_weight_ref(w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """fp32 dequantized weight: w_q.float() * scale (broadcast per its granularity)."""
    return w_q.float() * expand_weight_scale(w_s.float(), w_q.shape)


def block_fp8_matmul_ref(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequant(x) @ dequant(w).T (+ bias) in fp32, cast to `out_dtype` at the end."""
    y = dequantize_activation_ref(x_q, x_s) @ dequantize_weight_ref(w_q, w_s).transpose(-1, -2)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def grouped_fp8_matmul_ref(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    pair_expert: torch.Tensor,
    a_row_div: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Grouped FP8 matmul per (token, expert) pair, in the order of the kernel: fp32 GEMM, + bias,
    * routing weight, cast (see :func:`fp8linear.functional.grouped_fp8_matmul`)."""
    num_experts, n, _ = w_q.shape
    num_pairs = pair_expert.shape[0]
    a = dequantize_activation_ref(a_q, a_s)
    out = torch.zeros((num_pairs, n), dtype=torch.float32, device=a_q.device)
    for e in range(num_experts):  # reference path only: the Triton path is one launch
        pairs = (pair_expert == e).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        y = a[pairs // a_row_div] @ dequantize_weight_ref(w_q[e], w_s[e]).transpose(0, 1)
        if bias is not None:
            y = y + bias[e].float()
        out[pairs] = y
    if topk_weights is not None:
        out = out * topk_weights.float()[:, None]
    return out.to(out_dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama-family RMSNorm computes it, in the same ATen ops:
    ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` (the output takes
    ``torch.result_type(weight, x)``). :class:`fp8linear.norm.FusedRMSNorm` runs it on CPU and
    when traced; its kernel (:mod:`fp8linear.ops.rmsnorm`) computes the same in one launch."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
