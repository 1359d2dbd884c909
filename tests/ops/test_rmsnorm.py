"""The one-launch RMSNorm kernel against the float64 formula and the ATen formula it replaces.

On a GPU the kernel runs there; without one in Triton's CPU interpreter (small shapes). The
module and model-level tests are in tests/core/test_norm.py.
"""

from __future__ import annotations

import pytest
import torch

from fp8linear.ops import HAS_TRITON

from conftest import HAS_CUDA, KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

# (M, N): ragged widths, DeepSeek-V3's 7168, and one past the one-pass limit (chunked loop).
SHAPES = [(1, 300), (3, 576), (77, 2112), (2, 7168), (2, 16500)]
if HAS_CUDA:
    SHAPES += [(1000, 7168), (4099, 576), (333, 8192), (5, 40000)]
DTYPES = [  # (x dtype, weight dtype): outputs take torch.result_type
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
]
MANTISSA = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
EPS = 1e-6


def _float64_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _operands(m: int, n: int, xd: torch.dtype, wd: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=gen) * torch.rand(m, 1, generator=gen).mul(8).add(0.01)).to(xd)
    w = (torch.rand(n, generator=gen) * 2 - 0.5).to(wd)  # signs and magnitudes as trained norms have
    return x.to(KERNEL_DEVICE), w.to(KERNEL_DEVICE)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    from fp8linear.reference import rms_norm_ref

    ref64 = _float64_norm(x, w, EPS)
    assert y.dtype == torch.promote_types(w.dtype, x.dtype) and y.shape == x.shape
    # Two roundings (the normalised row to x's dtype, the product to the output's), each half an
    # ulp relative or, among fp16's subnormals, half its 2**-24 spacing; and rsqrt's few ulps.
    rel = 2.0 ** -MANTISSA[x.dtype] + 2.0 ** -MANTISSA[y.dtype] + 2.0 ** -20
    absolute = (w.double().abs() * (2.0 ** -25 if x.dtype == torch.float16 else 0.0)
                + (2.0 ** -25 if y.dtype == torch.float16 else 2.0 ** -120))
    err = (y.double() - ref64).abs()
    bound = ref64.abs() * rel + absolute
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"
    if x.dtype != torch.float32:
        # The same rounding sequence as ATen's (not only close to float64): only the sum's order
        # may differ, which moves the row's rounding to x's dtype in few elements (skipping that
        # rounding moves about half of them). With fp32 inputs there is no such rounding, and the
        # sum's last bit shows in every output.
        aten = rms_norm_ref(x, w, EPS)
        same = (y == aten).double().mean().item()
        assert same >= 0.98, f"only {same:.3f} of the outputs equal the ATen formula's"


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("xd,wd", DTYPES)
def test_kernel_matches_float64_and_aten_formula(m, n, xd, wd):
    from fp8linear.ops.rmsnorm import rms_norm

    x, w = _operands(m, n, xd, wd, seed=m * 7 + n)
    _check(rms_norm(x, w, EPS), x, w)


@pytest.mark.parametrize("n", [576, 2112])
def test_kernel_reads_evenly_strided_rows(n):
    """A split of a wider projection (DeepSeek-V3's kv_a_layernorm input) is read in place."""
    from fp8linear.ops.rmsnorm import rms_norm, rows_view

    wide, w = _operands(6, n + 64, torch.bfloat16, torch.bfloat16, seed=n)
    x = wide.view(2, 3, n + 64)[..., :n]
    assert not x.is_contiguous() and rows_view(x) is not None
    y = rms_norm(x, w[:n].contiguous(), EPS)
    assert y.is_contiguous()
    _check(y, x.contiguous(), w[:n].contiguous())
    assert torch.equal(y, rms_norm(x.contiguous(), w[:n].contiguous(), EPS))


def test_bad_operands_raise_clear_errors():
    from fp8linear.ops.rmsnorm import rms_norm

    x = torch.randn(4, 256, device=KERNEL_DEVICE)
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        rms_norm(x.to(torch.int32), torch.ones(256, device=KERNEL_DEVICE), EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(128, device=KERNEL_DEVICE), EPS)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(x.t(), torch.ones(4, device=KERNEL_DEVICE), EPS)
    with pytest.raises(TypeError, match="tensors"):
        rms_norm([1.0], torch.ones(1), EPS)
