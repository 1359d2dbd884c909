"""The CPU fast path (fp8linear/ops/cpu_linear.py) against the reference numerics (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8linear.ops import cpu_linear, router
from fp8linear.ops.cpu_linear import cpu_fp8_linear, prepare_cpu_weight, quantize_activation_grid
from fp8linear.formats import activation_max
from fp8linear.reference import (
    block_fp8_matmul_ref,
    dequantize_activation_ref,
    dequantize_weight_ref,
    quantize_activation_ref,
    quantize_weight_ref,
)

from _utils import GEMM_TOL, rel_err, same_bits

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
GRANS = ["block", "row", "tensor"]
OUT = [torch.bfloat16, torch.float16, torch.float32]
SIZES = [576, 2112, 300, 130]
MS = [1, 3, 77, 333]
# The float64 check dominates: skip products above this many multiply-adds (M=333 runs with K, N <= 576).
MAX_MACS = 2**26


def _ref64(x_q, x_s, w_q, w_s, bias):
    y = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().T
    return y + bias.double() if bias is not None else y


@pytest.fixture(autouse=True)
def _torch_ops_path(monkeypatch):
    """This file tests the torch-ops path; the compiled kernel (M <= router.CPU_NATIVE_MAX_M) has
    tests/ops/test_cpu_native.py."""
    monkeypatch.setattr(router, "CPU_NATIVE_MAX_M", 0)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the numerics do not depend on it, and on a shared CPU the many small
    parallel regions of a tiled call wait on descheduled threads (seconds per test)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# --- activation quantization: bit-exact with quantize_activation_ref ------------------------
def _hard_activations(m: int, k: int, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Random rows plus rows built to hit FP8 rounding ties, subnormals, zeros and -0.0."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).unsqueeze(1)
    qmax = activation_max(fp8_dtype)
    if m >= 4 and k >= 8:
        # amax = qmax makes the scale 1: the row holds exact midpoints between FP8 values (ties),
        # values around the subnormal range and signed zeros
        codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
        grid = codes[torch.isfinite(codes)].abs().unique()
        mids = (grid[1:] + grid[:-1]) / 2
        row = torch.cat([mids, -mids, grid * 0.999, -grid * 1.001, torch.tensor([0.0, -0.0])])
        row = torch.cat([row[torch.randperm(row.numel(), generator=gen)], torch.zeros(k)])[:k].clone()
        row[0] = qmax
        x[0] = row
        x[1] = row * 2.0**-10  # same pattern, scale 2**-10: still ties
        x[2] = 0.0  # all-zero row: amax floored
        x[3, : k // 2] = -0.0
    return x


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("x_dtype", OUT)
@pytest.mark.parametrize("m,k", [(1, 128), (5, 576), (9, 300), (4, 130), (33, 2112), (6, 7)])
def test_activation_grid_bit_exact(m, k, x_dtype, fp8_dtype):
    x = _hard_activations(m, k, fp8_dtype).to(x_dtype)
    q_ref, s_ref = quantize_activation_ref(x, fp8_dtype)
    grid, s = quantize_activation_grid(x, fp8_dtype)
    assert same_bits(s, s_ref)
    q = grid.reshape(m, -1)[:, :k]
    assert same_bits(q.to(fp8_dtype), q_ref)  # the same FP8 bytes
    assert same_bits(q, q_ref.float())  # and the grid is those values exactly (+0.0 for zeros)
    assert (grid.reshape(m, -1)[:, k:] == 0).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_activation_grid_nan_inf_and_huge(fp8_dtype):
    x = torch.randn(4, 256)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    x[2, 5] = -1e38
    x[3, 130] = 3e-39  # fp32 subnormal
    q_ref, s_ref = quantize_activation_ref(x, fp8_dtype)
    grid, s = quantize_activation_grid(x, fp8_dtype)
    assert same_bits(s, s_ref)
    assert same_bits(grid.reshape(4, -1).to(fp8_dtype), q_ref)


# --- weight decode -----------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("k", [256, 300, 130])
def test_decode_every_code(fp8_dtype, k):
    codes = torch.arange(256, dtype=torch.uint8).repeat(k // 256 + 3)[: 3 * k].view(3, k)
    w = codes.view(fp8_dtype)
    p = prepare_cpu_weight(w, torch.tensor(1.0), "tensor")
    kp = p.groups * 128
    h = torch.full((3, kp), 12345, dtype=torch.int16)
    h[:, k:] = 0
    f = torch.empty(3, kp)
    cpu_linear._decode(p, 0, 3, h, f)
    want = w.float()
    finite = torch.isfinite(want)
    assert torch.equal((f[:, :k] * p.x_factor)[finite], want[finite])  # exact, subnormals included
    assert (f[:, k:] == 0).all()
    nan_rows = torch.nonzero((~finite).any(dim=1)).flatten()
    assert torch.equal(p.nan_rows, nan_rows) if nan_rows.numel() else p.nan_rows is None


# --- the whole linear against float64 -----------------------------------------------------------
def _linear_cases():
    cases = []
    i = 0
    for n in SIZES:
        for k in SIZES:
            for m in MS:
                if m * n * k > MAX_MACS:
                    continue
                for gran in GRANS:
                    # cycle dtype / bias so every combination class meets every shape class
                    cases.append((m, n, k, gran, FP8[i % 2], OUT[i % 3], (i // 2) % 2 == 0))
                    i += 1
    return cases


@pytest.mark.parametrize("m,n,k,granularity,fp8_dtype,out_dtype,with_bias", _linear_cases())
def test_linear_matches_float64(m, n, k, granularity, fp8_dtype, out_dtype, with_bias):
    gen = torch.Generator().manual_seed(m + 7 * n + 31 * k)
    x = torch.randn(m, k, generator=gen).to(out_dtype)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    bias = torch.randn(n, generator=gen) if with_bias else None
    w_q, w_s = quantize_weight_ref(w, granularity, fp8_dtype)
    y = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    assert y.shape == (m, n) and y.dtype == out_dtype and y.is_contiguous()
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    ref = _ref64(x_q, x_s, w_q, w_s, bias)
    assert rel_err(y, ref) < GEMM_TOL[out_dtype]  # the bound the reference path meets (test_numerics.py)


@pytest.mark.parametrize("tile_elems", [1, 300, 128 * 256, 1 << 22])
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("m", [1, 4, 40])
def test_tilings_agree(tile_elems, granularity, m, monkeypatch):
    """Every tiling (one row, powers of two inside a 128-row block, whole blocks, one tile)."""
    monkeypatch.setattr(cpu_linear, "TILE_ELEMS", tile_elems)
    monkeypatch.setattr(cpu_linear, "TILE_ELEMS_LARGE_M", tile_elems)
    x = torch.randn(m, 300)
    w_q, w_s = quantize_weight_ref(torch.randn(300, 300) / 17, granularity, torch.float8_e4m3fn)
    bias = torch.randn(300)
    y = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    assert y.shape == (m, 300) and y.is_contiguous()
    x_q, x_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert rel_err(y, _ref64(x_q, x_s, w_q, w_s, bias)) < GEMM_TOL[torch.float32]


@pytest.mark.parametrize("granularity", GRANS)
def test_strided_weight_and_empty_batch(granularity):
    w_q, w_s = quantize_weight_ref(torch.randn(256, 200), granularity, torch.float8_e4m3fn)
    w_nc = w_q.t().contiguous().t()  # same values, column-major storage
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    assert torch.equal(cpu_fp8_linear(x, w_nc, w_s, granularity), cpu_fp8_linear(x, w_q, w_s, granularity))
    assert cpu_fp8_linear(x[:0], w_q, w_s, granularity).shape == (0, 256)


# --- NaN / Inf -------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("m", [4, 40])
def test_nan_inf_in_x_give_nan_rows(fp8_dtype, granularity, m):
    x = torch.randn(m, 256)
    x[1, 3] = float("nan")
    x[2, 200] = float("inf")
    x[3, 7] = -float("inf")
    w_q, w_s = quantize_weight_ref(torch.randn(200, 256), granularity, fp8_dtype)
    y = cpu_fp8_linear(x, w_q, w_s, granularity, torch.randn(200))
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, None)
    assert torch.equal(y.isnan(), ref.isnan())
    assert y[1:4].isnan().all() and torch.isfinite(y[0]).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("granularity", GRANS)
def test_nan_weight_codes_give_nan_columns(fp8_dtype, granularity):
    w_q, w_s = quantize_weight_ref(torch.randn(300, 256), granularity, fp8_dtype)
    w_q = w_q.clone()
    nan_code = 0x7F if fp8_dtype == torch.float8_e4m3fn else 0x80
    w_q.view(torch.uint8)[5, 17] = nan_code
    w_q.view(torch.uint8)[299, 255] = nan_code | 0x80 if fp8_dtype == torch.float8_e4m3fn else nan_code
    x = torch.randn(3, 256)
    y = cpu_fp8_linear(x, w_q, w_s, granularity)
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, None)
    assert torch.equal(y.isnan(), ref.isnan())
    assert y[:, [5, 299]].isnan().all() and ref.isnan().sum() == 6


# --- per-weight preparation ---------------------------------------------------------------------
def test_weak_cache_follows_in_place_updates():
    w_q, w_s = quantize_weight_ref(torch.randn(256, 256), "row", torch.float8_e4m3fn)
    x = torch.randn(2, 256)
    y0 = cpu_fp8_linear(x, w_q, w_s, "row")
    w2, s2 = quantize_weight_ref(torch.randn(256, 256), "row", torch.float8_e4m3fn)
    w_q.copy_(w2)  # bumps the version counter: prepared again
    w_s.copy_(s2)
    y1 = cpu_fp8_linear(x, w_q, w_s, "row")
    assert not torch.equal(y0, y1)
    assert torch.equal(y1, cpu_fp8_linear(x, w2, s2, "row", prepared=prepare_cpu_weight(w2, s2, "row")))
    w_q.view(torch.uint8)[0, 0] = 0x7F  # a NaN code written in place: row 0 becomes NaN
    assert cpu_fp8_linear(x, w_q, w_s, "row")[:, 0].isnan().all()


def test_prepared_weight_holds_no_weight_copy():
    w_q, w_s = quantize_weight_ref(torch.randn(1024, 1024), "block", torch.float8_e4m3fn)
    p = prepare_cpu_weight(w_q, w_s, "block")
    assert p.codes.data_ptr() == w_q.data_ptr()
    extra = sum(t.numel() * t.element_size() for t in (p.row_scale, p.block_scale) if t is not None)
    assert extra <= w_q.numel() * 4 // 128 + w_s.numel() * 4


def test_two_threads_agree_with_one():
    w_q, w_s = quantize_weight_ref(torch.randn(600, 2112) / 46, "block", torch.float8_e4m3fn)
    x = torch.randn(5, 2112)
    y1 = cpu_fp8_linear(x, w_q, w_s, "block")
    torch.set_num_threads(2)
    y2 = cpu_fp8_linear(x, w_q, w_s, "block")
    assert rel_err(y2, y1) < GEMM_TOL[torch.float32]


# --- M=1, bf16 x, 'block'/'tensor': float16 tiles through torch's float16 GEMV ----------------------
def _fp32_path(monkeypatch, *args):
    with monkeypatch.context() as mp:
        mp.setattr(router, "CPU_HALF_GEMV", False)
        return cpu_fp8_linear(*args)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("granularity", ["block", "tensor"])
@pytest.mark.parametrize("n,k", [(300, 2112), (576, 130), (2112, 576), (1, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_half_gemv_matches_float64(n, k, granularity, fp8_dtype, with_bias, monkeypatch):
    monkeypatch.setattr(router, "CPU_HALF_GEMV_MIN_ELEMS", 0)
    gen = torch.Generator().manual_seed(n + 3 * k)
    x = torch.randn(1, k, generator=gen).bfloat16()
    w_q, w_s = quantize_weight_ref(torch.randn(n, k, generator=gen) / math.sqrt(k), granularity, fp8_dtype)
    bias = torch.randn(n, generator=gen) if with_bias else None
    p = prepare_cpu_weight(w_q, w_s, granularity)
    grid, x_s = quantize_activation_grid(x, fp8_dtype)
    y_half = cpu_linear._half_gemv(p, grid, x_s, bias)
    assert y_half is not None  # this input takes the float16 path
    y = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    assert torch.equal(y, y_half) and y.dtype == torch.bfloat16 and y.shape == (1, n)
    x_q, x_s_ref = quantize_activation_ref(x, fp8_dtype)
    ref = _ref64(x_q, x_s_ref, w_q, w_s, bias)
    assert rel_err(y, ref) < GEMM_TOL[torch.bfloat16]
    # the float16 rounding of activations and outputs stays far below bf16's own rounding
    assert rel_err(y, _fp32_path(monkeypatch, x, w_q, w_s, granularity, bias)) < 2e-3


@pytest.mark.parametrize("granularity", ["block", "tensor"])
@pytest.mark.parametrize("exp2", [-35, -20, 0, 60, 110])
def test_half_gemv_any_activation_range(granularity, exp2, monkeypatch):
    """x of any magnitude (above the amax floor): a power of two keeps float16 in range, or the fp32 path runs."""
    monkeypatch.setattr(router, "CPU_HALF_GEMV_MIN_ELEMS", 0)
    gen = torch.Generator().manual_seed(exp2 + 200)
    x = (torch.randn(1, 1024, generator=gen) * 2.0**exp2).bfloat16()
    w_q, w_s = quantize_weight_ref(torch.randn(256, 1024, generator=gen) / 32, granularity, torch.float8_e4m3fn)
    y = cpu_fp8_linear(x, w_q, w_s, granularity)
    assert torch.isfinite(y).all()
    x_q, x_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert rel_err(y, _ref64(x_q, x_s, w_q, w_s, None)) < GEMM_TOL[torch.bfloat16]


@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_half_gemv_nan_inf_and_nan_codes(granularity, monkeypatch):
    monkeypatch.setattr(router, "CPU_HALF_GEMV_MIN_ELEMS", 0)
    w_q, w_s = quantize_weight_ref(torch.randn(300, 256), granularity, torch.float8_e4m3fn)
    x = torch.randn(1, 256).bfloat16()
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[0, 7] = bad
        assert cpu_fp8_linear(xb, w_q, w_s, granularity).isnan().all()  # as the reference
    w_q = w_q.clone()
    w_q.view(torch.uint8)[130, 5] = 0xFF  # a NaN code: that output is NaN, the others are not
    y = cpu_fp8_linear(x, w_q, w_s, granularity)
    assert y[0, 130].isnan() and torch.isfinite(torch.cat([y[0, :130], y[0, 131:]])).all()


@pytest.mark.parametrize("half_tile_elems", [1, 300, 128 * 300, 1 << 22])
@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_half_gemv_tilings(half_tile_elems, granularity, monkeypatch):
    monkeypatch.setattr(cpu_linear, "HALF_TILE_ELEMS", half_tile_elems)
    monkeypatch.setattr(router, "CPU_HALF_GEMV_MIN_ELEMS", 0)
    x = torch.randn(1, 300).bfloat16()
    w_q, w_s = quantize_weight_ref(torch.randn(300, 300) / 17, granularity, torch.float8_e4m3fn)
    bias = torch.randn(300)
    y = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    x_q, x_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert rel_err(y, _ref64(x_q, x_s, w_q, w_s, bias)) < GEMM_TOL[torch.bfloat16]


def test_small_weights_take_the_fp32_path(monkeypatch):
    w_q, w_s = quantize_weight_ref(torch.randn(64, 256), "block", torch.float8_e4m3fn)
    assert 64 * 256 < router.CPU_HALF_GEMV_MIN_ELEMS
    x = torch.randn(1, 256).bfloat16()
    assert torch.equal(cpu_fp8_linear(x, w_q, w_s, "block"), _fp32_path(monkeypatch, x, w_q, w_s, "block"))


# --- scratch buffers kept between calls -----------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2, 40])
def test_scratch_reuse_does_not_leak_between_weights(m):
    """Two weights sharing tile buffers (same K, N not a multiple of 128): results as if run alone."""
    x = torch.randn(m, 200)
    w_a, s_a = quantize_weight_ref(torch.randn(256, 200) * 100, "block", torch.float8_e4m3fn)
    w_b, s_b = quantize_weight_ref(torch.randn(130, 200), "block", torch.float8_e4m3fn)
    cpu_linear._SCRATCH.__dict__.clear()
    alone = cpu_fp8_linear(x, w_b, s_b, "block")
    cpu_fp8_linear(x, w_a, s_a, "block")
    assert torch.equal(cpu_fp8_linear(x, w_b, s_b, "block"), alone)


def test_calls_from_two_threads():
    import threading

    w_q, w_s = quantize_weight_ref(torch.randn(384, 576), "block", torch.float8_e4m3fn)
    xs = [torch.randn(2, 576).bfloat16() for _ in range(2)]
    want = [cpu_fp8_linear(x, w_q, w_s, "block") for x in xs]
    got = [None, None]

    def run(i):
        for _ in range(20):
            y = cpu_fp8_linear(xs[i], w_q, w_s, "block")
            if not torch.equal(y, want[i]):
                got[i] = y
                return
        got[i] = want[i]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# --- tile layouts that follow the intra-op threads --------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("granularity", ["block", "tensor"])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("n,k,blocks", [(1100, 576, 8), (640, 130, 2), (300, 300, 64), (2112, 300, 3)])
def test_half_gemv_interleaved_tiles(n, k, blocks, fp8_dtype, granularity, threads, monkeypatch):
    """Float16 tiles of several 128-row blocks, decoded interleaved (row i of block b at i * blocks + b),
    with a last tile of other length: same numerics as the fp32 path, any thread count."""
    monkeypatch.setattr(router, "CPU_HALF_GEMV_MIN_ELEMS", 0)
    monkeypatch.setattr(cpu_linear, "HALF_TILE_ELEMS", blocks * 128 * k // threads)  # per thread
    torch.set_num_threads(threads)
    rows = cpu_linear._half_gemv_rows(n, k)
    assert rows == min(blocks * 128, n // 128 * 128) and rows >= 256  # tiles of 2 blocks or more
    gen = torch.Generator().manual_seed(n + k + threads)
    x = torch.randn(1, k, generator=gen).bfloat16()
    w_q, w_s = quantize_weight_ref(torch.randn(n, k, generator=gen) / math.sqrt(k), granularity, fp8_dtype)
    bias = torch.randn(n, generator=gen)
    y = cpu_fp8_linear(x, w_q, w_s, granularity, bias)
    x_q, x_s = quantize_activation_ref(x, fp8_dtype)
    assert rel_err(y, _ref64(x_q, x_s, w_q, w_s, bias)) < GEMM_TOL[torch.bfloat16]
    assert rel_err(y, _fp32_path(monkeypatch, x, w_q, w_s, granularity, bias)) < 2e-3
    # each output comes from its own weight row: a NaN code in row 1 of the first tile's block 1
    w_bad = w_q.clone()
    w_bad.view(torch.uint8)[129, 3] = 0x80 if fp8_dtype == torch.float8_e4m3fnuz else 0x7F
    y_bad = cpu_fp8_linear(x, w_bad, w_s, granularity, bias)
    assert y_bad[0, 129].isnan() and y_bad.isnan().sum() == 1


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [2, 8, 30])
def test_block_tiles_follow_threads(threads, m):
    """'block' with few rows of x: tiles of whole 128-row blocks, their count a multiple of the
    thread count where the tile budget holds at least one block per thread; numerics unchanged."""
    torch.set_num_threads(threads)
    for n, k in [(1536, 576), (576, 1536), (1100, 300), (640, 130)]:
        rows = cpu_linear._tile_rows(n, k, True, m)
        n_blocks = -(-n // 128)
        budget_blocks = cpu_linear.TILE_ELEMS * threads // k / 128
        if budget_blocks < 1:  # tiles inside one block
            assert rows < 128 and rows & (rows - 1) == 0
            continue
        assert rows % 128 == 0 and 128 <= rows <= n_blocks * 128
        if rows < n_blocks * 128 and budget_blocks >= threads:
            assert (rows // 128) % threads == 0
    gen = torch.Generator().manual_seed(m * threads)
    x = torch.randn(m, 576, generator=gen)
    w_q, w_s = quantize_weight_ref(torch.randn(1536 + 70, 576, generator=gen) / 24, "block", torch.float8_e4m3fnuz)
    bias = torch.randn(1536 + 70, generator=gen)
    x_q, x_s = quantize_activation_ref(x, torch.float8_e4m3fnuz)
    ref = _ref64(x_q, x_s, w_q, w_s, bias)
    for dtype in (torch.float32, torch.bfloat16):
        y = cpu_fp8_linear(x.to(dtype), w_q, w_s, "block", bias)
        assert y.shape == ref.shape and y.dtype == dtype and y.is_contiguous()
        if dtype == torch.float32:
            assert rel_err(y, ref) < GEMM_TOL[torch.float32]


# --- scratch buffers: bounded by bytes, usable in and out of inference mode --------------------------
def test_scratch_eviction_keeps_results(monkeypatch):
    shapes = [(192, 576), (576, 576), (1536, 576), (576, 1536), (300, 130)]
    gen = torch.Generator().manual_seed(5)
    cases = []
    for n, k in shapes:
        w_q, w_s = quantize_weight_ref(torch.randn(n, k, generator=gen) / math.sqrt(k), "block", torch.float8_e4m3fn)
        cases.append((torch.randn(2, k, generator=gen), w_q, w_s))
    cpu_linear._SCRATCH.__dict__.clear()
    want = [cpu_fp8_linear(x, w_q, w_s, "block") for x, w_q, w_s in cases]
    monkeypatch.setattr(cpu_linear, "MAX_SCRATCH_BYTES", 600_000)  # holds about one tile's buffers
    cpu_linear._SCRATCH.__dict__.clear()
    for _ in range(2):
        for (x, w_q, w_s), y in zip(cases, want):
            assert torch.equal(cpu_fp8_linear(x, w_q, w_s, "block"), y)
            kept = [t.numel() * t.element_size() for t in cpu_linear._SCRATCH.tile.values()]
            assert sum(kept) <= max(600_000, max(kept))  # a buffer above the bound is kept alone


def test_first_call_in_inference_mode_then_outside():
    w_q, w_s = quantize_weight_ref(torch.randn(256, 200), "block", torch.float8_e4m3fn)
    x = torch.randn(2, 200, dtype=torch.bfloat16)
    cpu_linear._SCRATCH.__dict__.clear()
    with torch.inference_mode():
        y_inf = cpu_fp8_linear(x, w_q, w_s, "block")
    assert torch.equal(cpu_fp8_linear(x, w_q, w_s, "block"), y_inf)  # kept buffers stay writable


@pytest.mark.parametrize("m", [1, 2, 40])
@pytest.mark.parametrize("granularity", GRANS)
def test_scratch_reuse_across_k_of_one_padded_width(m, granularity):
    """K=192 then K=130 (both padded to 256): the second call's padding holds no value of the first."""
    gen = torch.Generator().manual_seed(m)
    calls = []
    for k in (192, 130):
        w_q, w_s = quantize_weight_ref(torch.randn(300, k, generator=gen) / 12, granularity, torch.float8_e4m3fn)
        calls.append((torch.randn(m, k, generator=gen).bfloat16() * 100, w_q, w_s))
    cpu_linear._SCRATCH.__dict__.clear()
    alone = cpu_fp8_linear(*calls[1], granularity)
    cpu_fp8_linear(*calls[0], granularity)
    assert torch.equal(cpu_fp8_linear(*calls[1], granularity), alone)
