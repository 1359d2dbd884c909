"""The compiled CPU kernel (fp8linear/ops/cpu_native.py) behind cpu_fp8_linear at decode sizes,
against the float64 reference; skipped where it cannot be built (no C compiler, not AVX2/F16C/FMA)."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from fp8linear.ops import cpu_linear, cpu_native, router
from fp8linear.ops.cpu_linear import cpu_fp8_linear
from fp8linear.reference import (
    block_fp8_matmul_ref,
    dequantize_activation_ref,
    dequantize_weight_ref,
    quantize_activation_ref,
    quantize_weight_ref,
)

from _utils import GEMM_TOL, rel_err

pytestmark = pytest.mark.skipif(cpu_native.native_kernel() is None,
                                reason="the CPU FP8 kernel cannot be built here (see fp8linear.ops.cpu_native)")

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _ref64(x, w_q, w_s, bias, fp8_dtype):
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    y = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().T
    return y + bias.double() if bias is not None else y


def _spy(monkeypatch) -> list:
    """The rows of x of each call of the compiled kernels (native_gemv after native_quantize, or the
    one-call native_linear)."""
    calls = []
    gemv, linear = cpu_native.native_gemv, cpu_native.native_linear

    def spy_gemv(*args):
        calls.append(args[1].shape[0])
        return gemv(*args)

    def spy_linear(*args):
        calls.append(args[0].shape[0])
        return linear(*args)

    monkeypatch.setattr(cpu_native, "native_gemv", spy_gemv)
    monkeypatch.setattr(cpu_native, "native_linear", spy_linear)
    return calls


@pytest.mark.parametrize("n,k", [(576, 2112), (2112, 576), (300, 300), (130, 17), (1, 128), (7, 300)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 33])
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_kernel_matches_float64(n, k, m, granularity, monkeypatch):
    """The GEMV (M <= GEMV_MAX_M) and the blocked kernel (more rows: chunks of 3 rows and a last
    chunk of 1 or 2, weight rows by 4 and a last 1-3), ragged N and K (K % 16 != 0: the scalar
    tail; K < 16), all granularities, both FP8 formats, bias, output dtypes."""
    monkeypatch.setattr(router, "CPU_NATIVE_MAX_M", 1 << 20)  # every row count to the kernels
    i = n + k + m
    fp8_dtype, out_dtype, with_bias = FP8[i % 2], (torch.bfloat16, torch.float16, torch.float32)[i % 3], i % 2 == 0
    gen = torch.Generator().manual_seed(7 * n + 31 * k + m)
    x = torch.randn(m, k, generator=gen).to(out_dtype)
    w_q, w_s = quantize_weight_ref(torch.randn(n, k, generator=gen) / math.sqrt(k), granularity, fp8_dtype)
    bias = torch.randn(n, generator=gen) if with_bias else None
    calls = _spy(monkeypatch)
    y = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    assert calls == [m]  # the kernel ran it
    assert y.shape == (m, n) and y.dtype == out_dtype and y.is_contiguous()
    assert rel_err(y, _ref64(x, w_q, w_s, bias, fp8_dtype)) < GEMM_TOL[out_dtype]
    # the torch-ops path sums the same products: the two agree far below the output's rounding
    monkeypatch.setattr(router, "CPU_NATIVE_MAX_M", 0)
    y_ops = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    assert rel_err(y.float(), y_ops.float()) < 4 * GEMM_TOL[out_dtype]


@pytest.mark.parametrize("m", [4, 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_split_over_threads(threads, m, monkeypatch):
    """Row ranges over the intra-op threads (uneven splits, weight-row quads cut by a split, included)
    give the one-thread result, bit for bit."""
    monkeypatch.setattr(router, "CPU_THREAD_MIN_ELEMS", 0)
    w_q, w_s = quantize_weight_ref(torch.randn(1001, 640) / 25, "block", torch.float8_e4m3fn)
    x = torch.randn(m, 640)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_fp8_linear(x, w_q, w_s, "block")
        torch.set_num_threads(threads)
        assert torch.equal(cpu_fp8_linear(x, w_q, w_s, "block"), one)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("m", [4, 7])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_nan_codes_and_nan_inf_inputs(fp8_dtype, granularity, m):
    w_q, w_s = quantize_weight_ref(torch.randn(300, 256), granularity, fp8_dtype)
    w_q = w_q.clone()
    w_q.view(torch.uint8)[5, 17] = 0x7F if fp8_dtype == torch.float8_e4m3fn else 0x80
    x = torch.randn(m, 256)
    x[1, 3] = float("nan")
    x[2, 200] = float("inf")
    y = cpu_fp8_linear(x, w_q, w_s, granularity)
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, None)
    assert torch.equal(y.isnan(), ref.isnan())


def test_subnormal_and_extreme_codes():
    """Every FP8 code in the weight (subnormals, the largest values, both signs) decodes exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())]
    w_q = finite.repeat(3)[: 2 * 128].reshape(2, 128).contiguous()
    w_s = torch.ones(1, 1)
    eye = torch.zeros(128, 128)
    eye[torch.arange(128), torch.arange(128)] = 448.0  # each row of x picks one column, scale 1
    for r in range(0, 128, 8):
        y = cpu_fp8_linear(eye[r:r + 8], w_q, w_s, "block")
        assert torch.equal(y, w_q.float()[:, r:r + 8].t() * 448.0)


def test_more_rows_take_the_torch_path(monkeypatch):
    calls = _spy(monkeypatch)
    w_q, w_s = quantize_weight_ref(torch.randn(256, 200), "block", torch.float8_e4m3fn)
    for m in (router.CPU_NATIVE_MAX_M, router.CPU_NATIVE_MAX_M + 1):
        cpu_fp8_linear(torch.randn(m, 200), w_q, w_s, "block")
    assert calls == [router.CPU_NATIVE_MAX_M]


def test_non_contiguous_weight_takes_the_torch_path(monkeypatch):
    w_q, w_s = quantize_weight_ref(torch.randn(256, 200), "block", torch.float8_e4m3fn)
    x = torch.randn(3, 200)
    calls = _spy(monkeypatch)
    y = cpu_fp8_linear(x, w_q.t().contiguous().t(), w_s, "block")
    assert calls == []
    monkeypatch.setattr(router, "CPU_NATIVE_MAX_M", 0)
    assert torch.equal(y, cpu_fp8_linear(x, w_q, w_s, "block"))


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 128), (4, 300), (3, 2112), (8, 17), (64, 576)])
def test_quantization_bit_exact(fp8_dtype, x_dtype, m, k):
    """The compiled quantization gives quantize_activation_grid's values and scales bit for bit:
    ties, subnormals, zeros, -0.0, tiny and huge rows, NaN and Inf, ragged K."""
    from test_cpu_linear import _hard_activations

    x = _hard_activations(m, k, fp8_dtype).to(x_dtype)
    if m >= 3:
        x[1, k // 2] = float("nan")
        x[2, 0] = float("inf")
    kp = -(-k // 128) * 128
    xq, xs = torch.empty(m, kp), torch.empty(m, kp // 128)
    cpu_native.native_quantize(x, kp, fp8_dtype, 2.0, xq, xs)
    grid, scale = cpu_linear.quantize_activation_grid(x, fp8_dtype)
    assert torch.equal(xq.view(torch.int32), grid.reshape(m, kp).view(torch.int32))
    assert torch.equal(xs.view(torch.int32), (scale * 2.0).view(torch.int32))
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)  # the same FP8 values (NaN where the reference has NaN)
    ref = x_q.float()
    ok = ~ref.isnan()
    assert torch.equal(xq[:, :k].isnan(), ~ok)
    assert torch.equal(xq[:, :k][ok].view(torch.int32), ref[ok].view(torch.int32))


def test_strided_rows_of_x(monkeypatch):
    """x with a row stride past K (a slice of a wider tensor) is read in place."""
    calls = _spy(monkeypatch)
    w_q, w_s = quantize_weight_ref(torch.randn(256, 300) / 17, "block", torch.float8_e4m3fn)
    wide = torch.randn(3, 512, dtype=torch.bfloat16)
    y = cpu_fp8_linear(wide[:, :300], w_q, w_s, "block")
    assert calls == [3] and torch.equal(y, cpu_fp8_linear(wide[:, :300].contiguous(), w_q, w_s, "block"))


@pytest.mark.parametrize("m", [1, 2, 5, 7])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_call_linear_gives_the_two_call_bits(m, x_dtype, bias_dtype, monkeypatch):
    """native_linear (one C call: quantization, sums, bias and the output's rounding) gives the bits of
    native_quantize + native_gemv with the bias added and rounded by torch (the split path's output),
    NaN/Inf outputs included."""
    gen = torch.Generator().manual_seed(m * 7 + (bias_dtype is None))
    n, k = 300, 2112
    w_q, w_s = quantize_weight_ref(torch.randn(n, k, generator=gen) / 40, "block", torch.float8_e4m3fn)
    x = (torch.randn(m, k, generator=gen) * 3).to(x_dtype)
    x[0, 5] = float("inf") if m > 1 else x[0, 5]
    bias = None if bias_dtype is None else (torch.randn(n, generator=gen) * 1e4).to(bias_dtype)
    calls = _spy(monkeypatch)
    y = cpu_fp8_linear(x, w_q, w_s, "block", bias)
    monkeypatch.setattr(router, "CPU_THREAD_MIN_ELEMS", 0)  # the row split: two C calls, torch's output
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y_split = cpu_fp8_linear(x, w_q, w_s, "block", bias)
    finally:
        torch.set_num_threads(saved)
    assert calls == [m, m] and y.dtype == x_dtype
    nan = y.isnan()  # (torch writes NaN as 0x7FC0 or 0xFFFF depending on its code path: NaN is compared as NaN)
    assert nan.any() == (m > 1) and torch.equal(nan, y_split.isnan())
    bits = torch.int32 if x_dtype == torch.float32 else torch.int16
    assert torch.equal(y.view(bits)[~nan], y_split.view(bits)[~nan])


def test_one_call_linear_checks_its_buffers():
    w_q, w_s = quantize_weight_ref(torch.randn(128, 256), "block", torch.float8_e4m3fn)
    p = cpu_linear.prepare_cpu_weight(w_q, w_s, "block")
    a, ws, ld, gs, div = p.native_scales
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="y be contiguous"):
        cpu_native.native_linear(x, 256, p.fp8_dtype, a, p.codes, ws, ld, gs, div, None, torch.empty(2, 127))
    with pytest.raises(ValueError, match="bias"):
        cpu_native.native_linear(x, 256, p.fp8_dtype, a, p.codes, ws, ld, gs, div, torch.ones(128, dtype=torch.float64),
                                 torch.empty(2, 128))
    with pytest.raises(ValueError, match="contiguous int8 codes"):
        cpu_native.native_linear(x, 256, p.fp8_dtype, a, p.codes[:, :128], ws, ld, gs, div, None, torch.empty(2, 128))


@pytest.mark.parametrize("x_block_bytes", [1, 3 * 128 * 4 * 2, 1 << 30])
def test_k_blocks_of_the_blocked_kernel_give_the_same_bits(x_block_bytes, monkeypatch):
    """The blocked kernel sums each (row, weight row) group by group in order whatever the K blocks
    (one group a block, a few, all of K): the same bits."""
    w_q, w_s = quantize_weight_ref(torch.randn(130, 1000) / 30, "row", torch.float8_e4m3fn)
    x = torch.randn(11, 1000)
    monkeypatch.setattr(router, "CPU_NATIVE_MAX_M", 11)
    calls = _spy(monkeypatch)
    expected = cpu_fp8_linear(x, w_q, w_s, "row")
    monkeypatch.setattr(cpu_native, "X_BLOCK_BYTES", x_block_bytes)
    assert torch.equal(cpu_fp8_linear(x, w_q, w_s, "row"), expected)
    assert calls == [11, 11]


def test_rows_split_by_work(monkeypatch):
    """Up to GEMV_MAX_M rows the split counts weight elements; above, weight elements times rows."""
    monkeypatch.setattr(router, "CPU_THREAD_MIN_ELEMS", 1000)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert router.cpu_row_parts(20, 30, cpu_native.GEMV_MAX_M) == [(0, 20)]  # 600 elements
        assert router.cpu_row_parts(20, 30, cpu_native.GEMV_MAX_M + 1) == [(0, 10), (10, 20)]  # 3000 of work
        assert router.cpu_row_parts(40, 30, 1) == [(0, 20), (20, 40)]  # 1200 elements
        torch.set_num_threads(1)
        assert router.cpu_row_parts(40, 30, 8) == [(0, 40)]
    finally:
        torch.set_num_threads(saved)


def test_no_rows_are_refused():
    w_q, w_s = quantize_weight_ref(torch.randn(128, 128), "block", torch.float8_e4m3fn)
    p = cpu_linear.prepare_cpu_weight(w_q, w_s, "block")
    with pytest.raises(ValueError, match="1 row"):
        cpu_native.native_gemv(p.codes, torch.zeros(0, 128), torch.ones(0, 1), p.block_scale, 1, 1, 128,
                               torch.empty(0, 128), [(0, 128)])


@pytest.mark.parametrize("parts", [[(0, 129)], [(-1, 64)], [(64, 64)], [(0, 64), (64, 130)], [(0, 60), (64, 128)],
                                   [(0, 70), (64, 128)], []])
def test_row_ranges_outside_the_weight_are_refused(parts):
    w_q, w_s = quantize_weight_ref(torch.randn(128, 128), "block", torch.float8_e4m3fn)
    p = cpu_linear.prepare_cpu_weight(w_q, w_s, "block")
    with pytest.raises(ValueError, match="row ranges"):
        cpu_native.native_gemv(p.codes, torch.zeros(1, 128), torch.ones(1, 1), p.block_scale, 1, 1, 128,
                               torch.empty(1, 128), parts)


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64])
def test_any_default_dtype(default):
    """The kernel's buffers are fp32 whatever torch's default dtype (a bf16 default is common in LLM scripts)."""
    w_q, w_s = quantize_weight_ref(torch.randn(256, 300, dtype=torch.float32) / 17, "block", torch.float8_e4m3fn)
    x = torch.randn(2, 300, dtype=torch.bfloat16)
    expected = cpu_fp8_linear(x, w_q, w_s, "block")
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
        y = cpu_fp8_linear(x, w_q, w_s, "block")
    finally:
        torch.set_default_dtype(saved)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_splits_rows_again(monkeypatch):
    """A forked child does not wait on the parent's worker threads (it makes its own pool)."""
    monkeypatch.setattr(router, "CPU_THREAD_MIN_ELEMS", 0)
    w_q, w_s = quantize_weight_ref(torch.randn(512, 256) / 16, "block", torch.float8_e4m3fn)
    x = torch.randn(2, 256)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = cpu_fp8_linear(x, w_q, w_s, "block")  # the parent's pool exists now
        pid = os.fork()
        if pid == 0:  # child: exit code 0 if the split call returns the same bits within 20 s
            signal.alarm(20)
            os._exit(0 if torch.equal(cpu_fp8_linear(x, w_q, w_s, "block"), y) else 3)
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(saved)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_buffers_are_checked_before_the_c_code_sees_them():
    w_q, w_s = quantize_weight_ref(torch.randn(128, 128), "block", torch.float8_e4m3fn)
    p = cpu_linear.prepare_cpu_weight(w_q, w_s, "block")
    with pytest.raises(ValueError, match="float32"):
        cpu_native.native_gemv(p.codes, torch.zeros(1, 128, dtype=torch.float64), torch.ones(1, 1), p.block_scale,
                               1, 1, 128, torch.empty(1, 128), [(0, 128)])
    with pytest.raises(ValueError, match="shape"):
        cpu_native.native_quantize(torch.randn(1, 128), 128, torch.float8_e4m3fn, 1.0, torch.empty(1, 64),
                                   torch.empty(1, 1))
