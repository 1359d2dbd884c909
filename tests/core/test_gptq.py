"""GPTQ rounding (fp8linear.gptq) against round-to-nearest, on fresh random data and ragged shapes."""

from __future__ import annotations

import pytest
import torch

from fp8linear import dequantize_weight, quantize_weight
from fp8linear.gptq import GPTQConfig, gptq_quantize_weight, hessian_from_inputs
from fp8linear.reference import quantize_weight_ref

from _utils import same_bits

SHAPES = [(300, 576), (256, 384), (130, 200), (64, 128)]  # (N, K); ragged ones first
GRANS = ["block", "row", "tensor"]
FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def correlated_inputs(k: int, rows: int = 2048, seed: int = 0, basis_seed: int = 0) -> torch.Tensor:
    """Inputs near a k/4-dimensional subspace plus noise, with 4 strong channels, like transformer activations."""
    basis = torch.randn(k // 4, k, generator=torch.Generator().manual_seed(basis_seed))
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(rows, k // 4, generator=g) @ basis + 0.3 * torch.randn(rows, k, generator=g)
    x[:, torch.randperm(k, generator=torch.Generator().manual_seed(basis_seed))[:4]] *= 8.0  # outlier channels
    return x


def weight(n: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)


def output_error(x: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> float:
    ref = x @ w.float().T
    return ((x @ dequantize_weight(w_q, w_s).T - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("act_order", [True, False])
def test_diagonal_or_zero_hessian_gives_round_to_nearest(n, k, gran, fp8_dtype, act_order):
    # Without correlations between inputs there is nothing to compensate: GPTQ = round-to-nearest, bit for bit.
    w = weight(n, k)
    q_ref, s_ref = quantize_weight_ref(w, gran, fp8_dtype)
    cfg = GPTQConfig(act_order=act_order)
    diag = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.1)
    for h in (diag, torch.zeros(k, k)):
        q, s = gptq_quantize_weight(w, h, gran, fp8_dtype, cfg)
        assert q.dtype == fp8_dtype and q.shape == (n, k)
        assert same_bits(q, q_ref) and same_bits(s, s_ref)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gptq_lowers_output_error(n, k, gran, fp8_dtype):
    # Output error relative to round-to-nearest's, measured over these shapes, granularities and dtypes:
    # 0.18-0.28 with act_order, 0.29-0.65 without. Asserted: < 0.35 and < 0.75.
    x = correlated_inputs(k)
    w = weight(n, k)
    q_rtn, s_rtn = quantize_weight(w, gran, fp8_dtype)
    h = hessian_from_inputs(x) / x.shape[0]
    for act_order, bound in ((True, 0.35), (False, 0.75)):
        q, s = gptq_quantize_weight(w, h, gran, fp8_dtype, GPTQConfig(act_order=act_order))
        assert same_bits(s, s_rtn), "GPTQ keeps round-to-nearest's scales"
        assert torch.isfinite(q.float()).all()
        rtn, gptq = output_error(x, w, q_rtn, s_rtn), output_error(x, w, q, s)
        assert gptq < bound * rtn, f"act_order={act_order}: GPTQ {gptq:.4g} vs round-to-nearest {rtn:.4g}"


def test_held_out_inputs_and_block_size():
    # Error measured on inputs GPTQ did not see still drops; block_size changes only float rounding.
    n, k = 256, 640
    w = weight(n, k)
    h = hessian_from_inputs(correlated_inputs(k, seed=3)) / 2048
    x_test = correlated_inputs(k, seed=4)  # same distribution, other samples
    q_rtn, s_rtn = quantize_weight(w, "row")
    q, s = gptq_quantize_weight(w, h, "row")
    assert output_error(x_test, w, q, s) < 0.5 * output_error(x_test, w, q_rtn, s_rtn)
    q2, _ = gptq_quantize_weight(w, h, "row", config=GPTQConfig(block_size=32))
    differ = (q.float() != q2.float()).float().mean().item()
    assert differ < 0.01, f"{differ:.2%} of values differ between block sizes 128 and 32"


def test_values_pushed_past_the_range_are_clamped():
    # A huge input correlation pushes corrections past the FP8 range: values saturate, never NaN.
    n, k = 128, 256
    w = weight(n, k)
    x = correlated_inputs(k)
    h = hessian_from_inputs(x) / x.shape[0]
    for fp8_dtype in FP8:
        q, s = gptq_quantize_weight(w, h, "tensor", fp8_dtype, GPTQConfig(damp=1e-6))
        qf = q.float()
        assert torch.isfinite(qf).all()


def test_bad_input():
    w, h = weight(64, 256), torch.eye(256)
    with pytest.raises(ValueError, match=r"hessian must be \(256, 256\)"):
        gptq_quantize_weight(w, torch.eye(128), "row")
    with pytest.raises(ValueError, match="2-D high-precision"):
        gptq_quantize_weight(w.to(torch.float8_e4m3fn), h, "row")
    with pytest.raises(ValueError, match="granularity"):
        gptq_quantize_weight(w, h, "column")
    with pytest.raises(TypeError, match="FP8 dtype"):
        gptq_quantize_weight(w, h, "row", torch.bfloat16)
    bad = w.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(ValueError, match="layers.0.q_proj: weight has NaN"):
        gptq_quantize_weight(bad, h, "row", name="layers.0.q_proj")
    with pytest.raises(ValueError, match="hessian has NaN"):
        gptq_quantize_weight(w, h * float("inf"), "row")
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize_weight(w, -torch.eye(256) - 1.0, "row")
    with pytest.raises(TypeError, match="tensors"):
        gptq_quantize_weight(w.tolist(), h, "row")


@pytest.mark.parametrize(
    "kwargs,err",
    [
        (dict(damp=0), ValueError), (dict(damp=2.0), ValueError), (dict(damp=True), ValueError),
        (dict(act_order=1), TypeError), (dict(block_size=0), ValueError), (dict(block_size=1.5), ValueError),
        (dict(quantized_inputs="yes"), TypeError),
    ],
)
def test_config_validation(kwargs, err):
    with pytest.raises(err, match="GPTQConfig"):
        GPTQConfig(**kwargs)
