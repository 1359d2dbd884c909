"""FastKernel: the cached launch path must pick a kernel only where Triton would pick the same one."""

from __future__ import annotations

import pytest
import torch

from fp8linear import fp8_linear, quantize_weight
from fp8linear.ops import HAS_TRITON
from fp8linear.reference import quantize_activation_ref

from _utils import GEMM_TOL, rel_err, same_bits
from conftest import HAS_CUDA, KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def _key(values, constexpr=None, **options):
    from fp8linear.ops.launch import specialization_key

    return specialization_key(values, constexpr or [False] * len(values), options)


def test_key_separates_what_triton_specialises_on():
    t = torch.empty(64, dtype=torch.float32)
    assert _key([t]) == _key([torch.empty(32, dtype=torch.float32)])  # same dtype, both 16-byte aligned
    assert _key([t]) != _key([t[1:]])  # 4-byte offset: not 16-byte aligned
    assert _key([t]) != _key([t.to(torch.bfloat16)])
    assert _key([16]) == _key([32]) and _key([16]) != _key([17]) and _key([1]) != _key([17])
    assert _key([2**31 - 1]) != _key([2**31 + 15])  # int32 vs int64 argument
    assert _key([-16]) != _key([16])
    assert _key([1.0]) == _key([2.5]) and _key([None]) != _key([0])
    assert _key([True]) != _key([False]) and _key([True]) != _key([1])
    assert _key([4], [True]) != _key([8], [True])  # constexprs by value
    assert _key([4], num_warps=4) != _key([4], num_warps=8)


def test_key_refuses_unknown_argument_kinds():
    from fp8linear.ops.launch import _Unkeyable

    with pytest.raises(_Unkeyable):
        _key([object()])


def test_interpreted_kernels_take_tritons_path():
    """Under TRITON_INTERPRET=1 (CI) the wrapper is a pass-through, and the kernels still run."""
    from fp8linear.ops import quant

    if KERNEL_DEVICE != "cpu":
        pytest.skip("interpreter-only check")
    assert not quant._act_quant_launch._fast
    x = torch.randn(5, 300) * 3
    q, s = quant.act_quant(x, torch.float8_e4m3fn)
    r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert same_bits(q, r_q) and same_bits(s, r_s)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_fast_path_reuses_compiled_kernel_and_respects_alignment(monkeypatch):
    """Second launch skips JITFunction.run; misaligned views get their own (correct) kernel."""
    from fp8linear.ops import quant

    launcher = quant._act_quant_launch
    assert launcher._fast
    calls = []
    orig = type(launcher.fn).run
    monkeypatch.setattr(type(launcher.fn), "run", lambda self, *a, **k: (calls.append(1), orig(self, *a, **k))[1])
    base = torch.randn(8, 1 + 7168, device="cuda", dtype=torch.bfloat16) * 4
    for x in (base[:, :7168], base[:, :7168], base[:, 1:], base[:, 1:]):  # aligned twice, then 2-byte offset twice
        q, s = quant.act_quant(x, torch.float8_e4m3fn)
        r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
        assert same_bits(q, r_q) and same_bits(s, r_s)
    assert len(calls) <= 2  # at most one Triton launch per specialisation (0 if cached by earlier tests)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3, 64])
def test_gpu_fast_path_matches_triton_path(m):
    """fp8_linear twice (second call cached) equals itself and the first call, bit for bit."""
    w_q, w_s = quantize_weight(torch.randn(2112, 576, device="cuda") / 24, "block")
    x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
    first = fp8_linear(x, w_q, w_s, backend="triton")
    for _ in range(3):
        assert same_bits(fp8_linear(x, w_q, w_s, backend="triton"), first)
    ref = fp8_linear(x, w_q, w_s, backend="reference")
    assert rel_err(first, ref) < GEMM_TOL[torch.bfloat16]
