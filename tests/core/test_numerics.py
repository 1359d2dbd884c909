"""Reference numerics: formats, quantization contract, GEMM accuracy, bad input (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

import fp8linear
from fp8linear import (
    block_fp8_matmul,
    dequantize_weight,
    e4m3fn_to_e4m3fnuz,
    fp8_max,
    quantize_activation,
    quantize_weight,
)
from fp8linear.formats import activation_max, parse_fp8_dtype
from fp8linear.reference import AMAX_FLOOR, dequantize_activation_ref, weight_granularity

from _utils import GEMM_TOL, rel_err, same_bits

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
GRANS = ["block", "row", "tensor"]


def test_fp8_max_values():
    assert fp8_max(torch.float8_e4m3fn) == torch.finfo(torch.float8_e4m3fn).max == 448
    assert fp8_max(torch.float8_e4m3fnuz) == torch.finfo(torch.float8_e4m3fnuz).max == 240
    assert activation_max(torch.float8_e4m3fnuz) == 224
    assert parse_fp8_dtype("e4m3fnuz") is torch.float8_e4m3fnuz
    with pytest.raises(TypeError, match="FP8 dtype"):
        fp8_max(torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3fn"):
        parse_fp8_dtype("e5m2")


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape", [(1, 128), (3, 300), (2, 5, 576), (7168,)])
def test_activation_quant_contract(fp8_dtype, shape):
    x = torch.randn(shape, dtype=torch.bfloat16) * 4
    x_q, x_s = quantize_activation(x, fp8_dtype=fp8_dtype)
    k = shape[-1]
    assert x_q.shape == x.shape and x_q.dtype == fp8_dtype
    assert x_s.shape == (*shape[:-1], math.ceil(k / 128)) and x_s.dtype == torch.float32
    # scale = amax / ACT_MAX for every group, the partial group from its valid elements only
    xf = x.float()
    for g in range(x_s.shape[-1]):
        amax = xf[..., g * 128 : (g + 1) * 128].abs().amax(-1)
        assert torch.equal(x_s[..., g], amax / torch.full_like(amax, activation_max(fp8_dtype)))
    assert x_q.float().abs().max() <= activation_max(fp8_dtype)
    # dequantization is within half an FP8 ulp (2^-4 relative) of the input
    deq = dequantize_activation_ref(x_q, x_s)
    assert ((deq - xf).abs() <= xf.abs() * 2**-4 + x_s.repeat_interleave(128, -1)[..., :k] * 2**-9).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_rounding_is_nearest_even(fp8_dtype):
    # Every FP8 value and every midpoint between neighbours: ties go to the even mantissa.
    values = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    values = values[values.isfinite() & (values > 0)].sort().values
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, mids, -values]).reshape(1, -1)
    from fp8linear.reference import round_to_fp8_grid

    r = round_to_fp8_grid(x.clone(), fp8_dtype)
    assert torch.equal(r[0, : len(values)], values)  # representable values are fixed points
    lo, hi = values[:-1], values[1:]
    got = r[0, len(values) : len(values) + len(mids)]
    lo_even = (lo.to(fp8_dtype).view(torch.uint8) & 1) == 0
    assert torch.equal(got, torch.where(lo_even, lo, hi))


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("shape", [(128, 128), (576, 300), (1000, 2112), (3, 130, 200)])
def test_weight_quant_contract(fp8_dtype, granularity, shape):
    w = torch.randn(shape) * 0.02
    w_q, w_s = quantize_weight(w, granularity, fp8_dtype)
    assert w_q.shape == w.shape and w_q.dtype == fp8_dtype and w_s.dtype == torch.float32
    *batch, n, k = shape
    expected = {
        "block": (*batch, math.ceil(n / 128), math.ceil(k / 128)),
        "row": (*batch, n, math.ceil(k / 128)),
        "tensor": tuple(batch),
    }[granularity]
    assert tuple(w_s.shape) == expected
    if w_s.numel() > math.prod(batch):  # one scale per weight is per-tensor whatever the name
        assert weight_granularity(w_q.shape, w_s.shape) == granularity
    deq = dequantize_weight(w_q, w_s)
    # FP8 e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4 (plus subnormals).
    assert rel_err(deq, w) < 0.04
    assert w_q.float().abs().max() <= fp8_max(fp8_dtype)
    # The largest element of each group maps to exactly +-FP8_MAX.
    assert w_q.float().abs().max() == fp8_max(fp8_dtype)


@pytest.mark.parametrize("granularity", GRANS)
def test_zero_groups_give_zeros_and_finite_scales(granularity):
    w = torch.randn(256, 256)
    w[:128, :128] = 0
    w_q, w_s = quantize_weight(w if granularity != "tensor" else torch.zeros(64, 64), granularity)
    assert torch.isfinite(w_s).all() and (w_s > 0).all()
    assert (dequantize_weight(w_q, w_s)[:64, :64] == 0).all()
    x = torch.zeros(3, 300)
    x_q, x_s = quantize_activation(x)
    assert torch.isfinite(x_s).all() and (x_q.float() == 0).all()
    assert (x_s == AMAX_FLOOR / 448).all()


def test_partial_block_scale_uses_valid_elements_only():
    w = torch.full((130, 300), 0.5)
    w[128:, 256:] = 2.0  # the ragged corner block (2 x 44 valid elements)
    w_q, w_s = quantize_weight(w, "block")
    assert w_s.shape == (2, 3)
    assert w_s[1, 2] == torch.tensor(2.0) / 448 and w_s[0, 0] == torch.tensor(0.5) / 448


def test_out_of_range_values_clamp_not_nan():
    x = torch.tensor([[1e30, -1e30, 1.0] + [0.0] * 125])
    x_q, x_s = quantize_activation(x)
    assert torch.isfinite(x_q.float()).all()
    assert x_q.float()[0, 0] == 448 and x_q.float()[0, 1] == -448


def test_nan_and_inf_propagate():
    x = torch.randn(4, 256)
    x[1, 3] = float("nan")
    x[2, 200] = float("inf")
    w_q, w_s = quantize_weight(torch.randn(64, 256))
    x_q, x_s = quantize_activation(x)
    y = block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()


@pytest.mark.parametrize("granularity", GRANS)
def test_e4m3fn_to_fnuz_keeps_values(granularity):
    w = torch.randn(200, 300)
    w_q, w_s = quantize_weight(w, granularity, torch.float8_e4m3fn)
    w_q = w_q.clone()
    w_q.view(torch.uint8)[0, :5] = 0x80  # -0.0 in e4m3fn, NaN in fnuz
    nq, ns = e4m3fn_to_e4m3fnuz(w_q, w_s)
    assert nq.dtype == torch.float8_e4m3fnuz
    assert torch.equal(dequantize_weight(nq, ns), dequantize_weight(w_q, w_s))
    assert (nq.view(torch.uint8)[0, :5] == 0).all()
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        e4m3fn_to_e4m3fnuz(nq, ns)


# --- GEMM (reference backend here; test_kernels.py runs the same on Triton) -------------------
SHAPES_M = [1, 3, 64, 257, 1024]
SHAPES_N = [128, 576, 1000, 2112]
SHAPES_K = [128, 300, 576, 7168]
# CPU budget: skip products above ~2^28 multiply-adds (the float64 check dominates).
CPU_MAX_MACS = 2**28


def _gemm_cases():
    cases = []
    for i, (m, n, k) in enumerate((m, n, k) for m in SHAPES_M for n in SHAPES_N for k in SHAPES_K):
        if m * n * k > CPU_MAX_MACS:
            continue
        # Cycle dtype pairs so every fp8/out dtype meets every shape class without a full product.
        cases.append((m, n, k, FP8[i % 2], [torch.bfloat16, torch.float16, torch.float32][i % 3]))
    return cases


@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("m,n,k,fp8_dtype,out_dtype", _gemm_cases())
def test_matmul_reference_accuracy(m, n, k, fp8_dtype, out_dtype, granularity):
    x = torch.randn(m, k)
    w = torch.randn(n, k) / math.sqrt(k)
    bias = torch.randn(n) if m % 2 else None
    x_q, x_s = quantize_activation(x, fp8_dtype=fp8_dtype)
    w_q, w_s = quantize_weight(w, granularity, fp8_dtype)
    y = block_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype, bias)
    assert y.shape == (m, n) and y.dtype == out_dtype
    ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight(w_q, w_s).double().T
    if bias is not None:
        ref += bias.double()
    assert rel_err(y, ref) < GEMM_TOL[out_dtype]


# --- bad input ------------------------------------------------------------------------------
def _operands(m=4, n=256, k=256, granularity="block"):
    x_q, x_s = quantize_activation(torch.randn(m, k))
    w_q, w_s = quantize_weight(torch.randn(n, k), granularity)
    return x_q, x_s, w_q, w_s


def test_matmul_rejects_bad_input():
    x_q, x_s, w_q, w_s = _operands()
    with pytest.raises(ValueError, match="K mismatch"):
        block_fp8_matmul(x_q[:, :128], x_s[:, :1], w_q, w_s)
    with pytest.raises(ValueError, match="matches no granularity"):
        block_fp8_matmul(x_q, x_s, w_q, w_s[:1, :1].expand(3, 2).contiguous())
    with pytest.raises(TypeError, match="w_q must be float8"):
        block_fp8_matmul(x_q, x_s, w_q.float(), w_s)
    with pytest.raises(ValueError, match="x_q must be 2-D"):
        block_fp8_matmul(x_q[None], x_s[None], w_q, w_s)
    with pytest.raises(ValueError, match="w_q must be 2-D"):
        block_fp8_matmul(x_q, x_s, w_q[None], w_s[None])
    with pytest.raises(TypeError, match="out_dtype"):
        block_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="x_s must have shape"):
        block_fp8_matmul(x_q, x_s[:, :1], w_q, w_s)
    with pytest.raises(TypeError, match="x_s must be float32"):
        block_fp8_matmul(x_q, x_s.half(), w_q, w_s)
    with pytest.raises(ValueError, match="bias must have shape"):
        block_fp8_matmul(x_q, x_s, w_q, w_s, bias=torch.zeros(3))
    with pytest.raises(TypeError, match="same FP8 dtype"):
        block_fp8_matmul(x_q, x_s, w_q.view(torch.uint8).view(torch.float8_e4m3fnuz), w_s)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size must be 128"):
        quantize_activation(torch.randn(2, 256), group_size=64)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        quantize_activation(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="granularity must be one of"):
        quantize_weight(torch.randn(4, 4), "channel")
    with pytest.raises(ValueError, match="w must be 2-D"):
        quantize_weight(torch.randn(4))
    with pytest.raises(TypeError, match="not already quantized"):
        quantize_weight(torch.randn(4, 4).to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        quantize_weight([[1.0]])
    with pytest.raises(ValueError, match="backend argument must be one of"):
        quantize_activation(torch.randn(2, 128), backend="cuda")


def test_empty_m_and_noncontiguous():
    x_q, x_s, w_q, w_s = _operands(m=0)
    assert block_fp8_matmul(x_q, x_s, w_q, w_s).shape == (0, 256)
    x = torch.randn(300, 5).T  # (5, 300), stride (1, 5)
    xq1, xs1 = quantize_activation(x)
    xq2, xs2 = quantize_activation(x.contiguous())
    assert same_bits(xq1, xq2) and torch.equal(xs1, xs2)


def test_public_names():
    for name in fp8linear.__all__:
        assert hasattr(fp8linear, name)
