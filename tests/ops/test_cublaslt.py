"""cuBLASLt called directly (fp8linear.ops.cublaslt) for the cuBLAS route of CublasLinear.

The GPU tests need cuBLAS blockwise FP8 (Hopper, torch >= 2.11) and skip elsewhere; on the CPU only
the refusals run.
"""

from __future__ import annotations

import pytest
import torch

from fp8linear import dequantize_weight, quantize_weight
from fp8linear.ops import HAS_TRITON

from _utils import FP8_LINEAR_TOL, capture_graph, rel_err, same_bits
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

HOPPER_CUBLAS = False
if HAS_CUDA and HAS_TRITON:
    from fp8linear.ops.cublas_gemm import cublas_device_ok

    HOPPER_CUBLAS = cublas_device_ok(torch.device("cuda"))
needs_hopper = pytest.mark.skipif(not HOPPER_CUBLAS, reason="needs cuBLAS blockwise FP8 (Hopper, torch >= 2.11)")


def test_no_direct_gemm_off_nvidia_gpus():
    from fp8linear.ops.cublaslt import lt_block_gemm

    w_q, w_s = quantize_weight(torch.randn(256, 512), "block")
    assert lt_block_gemm(w_q, w_s.t(), False, None) is None  # a CPU weight


def test_borrowed_plans_share_the_bounded_book_and_are_destroyed_once(monkeypatch):
    """Plans for (M, algo M) keys live in the same book as plain ones: the book stays within
    _MAX_PLANS (also when planning the borrowed M's own plan fills it), each plan's layouts are
    destroyed exactly once when dropped, a refused borrowing keeps a plan of M's own algorithm under
    its key, and a key asked again is not planned again. No GPU: cuBLASLt is a stub."""
    import itertools

    from fp8linear.ops import cublaslt

    destroyed, made = [], itertools.count(1)

    class Lib:
        def cublasLtMatrixLayoutDestroy(self, layout):
            destroyed.append(layout)

    lib = Lib()
    gemm = cublaslt.LtBlockGemm.__new__(cublaslt.LtBlockGemm)
    gemm.book = cublaslt._PlanBook(lib)
    gemm.plans, gemm.lock, gemm.lib = gemm.book.plans, gemm.book.lock, lib

    def own(self, m):
        return (next(made), next(made), ("own", m), 0)

    def borrowed(self, m, algo_m):
        source = self.plan(algo_m)
        return None if algo_m % 3 == 0 else (next(made), next(made), source[2], 0)

    monkeypatch.setattr(cublaslt, "_MAX_PLANS", 3)
    monkeypatch.setattr(cublaslt.LtBlockGemm, "_make_plan", own)
    monkeypatch.setattr(cublaslt.LtBlockGemm, "_borrowed_plan", borrowed)
    with gemm.lock:
        assert gemm.plan(4)[2] == ("own", 4) and gemm.plan(4, 4) is gemm.plan(4)  # algo_m == M: the plain key
        assert gemm.plan(8, 16)[2] == ("own", 16)  # 16's algorithm, on 8's own layouts
        assert gemm.plan(8, 12)[2] == ("own", 8)  # refused: 8's own algorithm
        again = gemm.plan(8, 12)
        assert gemm.plan(8, 12) is again
        for m in range(20, 60, 4):
            gemm.plan(m, m + 8)
            assert len(gemm.plans) <= 3
    layouts = [lay for plan in gemm.plans.values() for lay in plan[:2]]
    assert len(destroyed) == len(set(destroyed))  # none twice
    assert not set(destroyed) & set(layouts)  # none still held
    assert len(destroyed) + len(layouts) == next(made) - 1  # every layout made is held or destroyed


def _pair(n: int, k: int, granularity: str, bias: bool, seed: int = 0):
    from fp8linear.ops.linear import CublasLinear

    torch.manual_seed(n * 7 + k + seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w_q, w_s = quantize_weight(w, granularity)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    direct, via_torch = CublasLinear(w_q, w_s, granularity, b, direct=True), CublasLinear(w_q, w_s, granularity, b,
                                                                                          direct=False)
    assert direct.lt is not None and via_torch.lt is None
    return w_q, w_s, b, direct, via_torch


SHAPES = [(2112, 7168, "block", False), (7168, 2048, "block", True), (1536, 576, "block", False),  # K/128 = 4.5: padded grid
          (7168, 2304, "block", False), (576, 7168, "row", False), (4096, 1152, "row", True)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("n,k,granularity,bias", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 77, 333, 1024, 2050])
def test_direct_cublaslt_matches_functional_path_and_reference(n, k, granularity, bias, m):
    """The module's cuBLAS route and the functional path's run the same algorithm, bit for bit,
    within the float64 reference's bound, for M on both sides of the padding to 4 rows; the
    functional path keeps one descriptor set per weight shape."""
    from fp8linear.ops.cublaslt import shape_gemm
    from fp8linear.ops.linear import run_linear_route
    from fp8linear.ops.router import Route

    w_q, w_s, b, direct, _ = _pair(n, k, granularity, bias)
    for _ in range(2):  # a new M, then the same M from the kept plan
        x = torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16)
        y = direct(x)
        assert y.shape == (2, m, n) and y.dtype == torch.bfloat16
        functional = run_linear_route(Route("cublas"), x.view(-1, k), w_q, w_s, granularity, b)
        assert same_bits(y, functional.view_as(y))
        ref = x.double() @ dequantize_weight(w_q, w_s, torch.float64).t()
        if b is not None:
            ref = ref + b.double()
        assert rel_err(y, ref) < FP8_LINEAR_TOL
    rows = -(-2 * m // 4) * 4
    assert direct.lt.plans[rows] is not None
    from fp8linear.ops.cublas_gemm import cublas_row_scales

    from fp8linear.ops.cublaslt import LT_WORKSPACE_LIMIT

    shared = shape_gemm(torch.cuda.current_device(), n, k, cublas_row_scales(w_q, granularity), bias,
                        LT_WORKSPACE_LIMIT)
    assert shared is not None and shared.plans is direct.lt.plans  # one plan book per GEMM kind


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("limit_mib", [1, 32])
def test_layers_of_one_shape_share_plans(limit_mib, monkeypatch):
    """Every GEMM of one kind (shape, scale modes, bias, workspace limit) plans an M once: a second
    layer meets the first layer's plan (no heuristic call), and computes its own weight's product
    with it; another limit or a bias is another kind."""
    from fp8linear.ops.cublaslt import LtBlockGemm

    calls = []
    make_plan = LtBlockGemm._make_plan

    def counting(self, m):
        calls.append(m)
        return make_plan(self, m)

    layers = [_pair(1536, 7168, "block", False, seed) for seed in range(3)]
    limit = limit_mib << 20
    lts = [direct.lt_for(limit) for _, _, _, direct, _ in layers]
    assert lts[0].plans is lts[1].plans is lts[2].plans
    m = 1000 + 4 * limit_mib + 1  # an M no other test plans
    rows = -(-m // 4) * 4
    from fp8linear.ops.cublaslt import _destroy_plan

    _destroy_plan(lts[0].lib, lts[0].plans.pop(rows, None))
    monkeypatch.setattr(LtBlockGemm, "_make_plan", counting)
    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    ys = [direct(x, limit) for _, _, _, direct, _ in layers]
    assert calls == [rows]
    for (w_q, w_s, _, _, via_torch), y in zip(layers, ys):
        ref = x.double() @ dequantize_weight(w_q, w_s, torch.float64).t()
        assert rel_err(y, ref) < FP8_LINEAR_TOL
    assert not same_bits(ys[0], ys[1])  # different weights, one plan
    other = _pair(1536, 7168, "block", True)[3].lt_for(limit)  # with a bias: another kind
    assert other.plans is not lts[0].plans


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("n,k,granularity,bias", SHAPES)
@pytest.mark.parametrize("m", [4, 77, 1024])
def test_direct_cublaslt_at_torchs_workspace_limit_matches_scaled_mm(n, k, granularity, bias, m):
    """With torch's workspace limit and the weight-scale form torch._scaled_mm reads (1x128 where a
    128x128 grid would need padding) the descriptors built here make cuBLASLt pick torch._scaled_mm's
    algorithm: the same bits (the check that the descriptors say what torch's say)."""
    from fp8linear.ops.cublas_gemm import cublas_row_scales, cublas_weight_scale
    from fp8linear.ops.cublaslt import LtBlockGemm, torch_workspace_limit

    w_q, w_s, b, direct, via_torch = _pair(n, k, granularity, bias)
    as_rows = cublas_row_scales(w_q, granularity, direct=False)
    direct.lt = LtBlockGemm.for_weight(w_q, cublas_weight_scale(w_q, w_s, granularity, as_rows), as_rows, b,
                                       workspace_limit=torch_workspace_limit())
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert same_bits(direct(x), via_torch(x))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("n,k,granularity,bias", SHAPES[:4])
@pytest.mark.parametrize("m", [77, 256, 1024])
def test_route_workspace_limit_reaches_module_and_functional_paths(n, k, granularity, bias, m):
    """A cuBLAS route's workspace limit (CublasConfig) is the one both paths run: at 32 MiB the module's
    call and the functional route give the same bits; at the default (torch's limit) both give
    torch._scaled_mm's where they read the weight scale in its form."""
    from fp8linear.ops.cublas_gemm import CublasConfig
    from fp8linear.ops.linear import run_linear_route
    from fp8linear.ops.router import Route

    w_q, w_s, b, direct, via_torch = _pair(n, k, granularity, bias)
    large = CublasConfig(workspace_mib=32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = direct(x, large.workspace_limit)
    assert same_bits(y, run_linear_route(Route("cublas", large), x, w_q, w_s, granularity, b))
    assert rel_err(y, x.double() @ dequantize_weight(w_q, w_s, torch.float64).t()
                   + (b.double() if b is not None else 0)) < FP8_LINEAR_TOL
    assert direct.lt_for(large.workspace_limit) is not direct.lt  # one held GEMM per limit
    y = direct(x)
    assert same_bits(y, run_linear_route(Route("cublas"), x, w_q, w_s, granularity, b))
    if direct.row_scales == via_torch.row_scales:  # one scale form: torch._scaled_mm's algorithm and bits
        assert same_bits(y, via_torch(x))
    else:  # 128x128 weights whose grid needs padding: the padded grid here, 1x128 scales through torch
        assert granularity == "block" and w_s.shape[1] % 4 and via_torch.row_scales
        assert rel_err(via_torch(x), x.double() @ dequantize_weight(w_q, w_s, torch.float64).t()) < FP8_LINEAR_TOL


@pytest.mark.gpu
@needs_hopper
def test_functional_cublas_path_falls_back_on_unaligned_or_strided_operands(monkeypatch):
    """Operands cuBLASLt's heuristic does not assume (an activation address off 256 bytes, a strided
    weight) run torch._scaled_mm, aligned ones cuBLASLt: each within the reference's bound."""
    import fp8linear.ops.cublas_gemm as cg
    from fp8linear.ops.quant import act_quant

    torch.manual_seed(3)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    w_q, w_s = quantize_weight(w, "block")
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ dequantize_weight(w_q, w_s, torch.float64).t()
    x_q, x_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
    calls = {"lt": 0, "torch": 0}
    real_shape_gemm, real_scaled_mm = cg.shape_gemm, torch._scaled_mm

    def counting_shape_gemm(*a):
        calls["lt"] += 1
        return real_shape_gemm(*a)

    def counting_scaled_mm(*a, **kw):
        calls["torch"] += 1
        return real_scaled_mm(*a, **kw)

    monkeypatch.setattr(cg, "shape_gemm", counting_shape_gemm)
    monkeypatch.setattr(torch, "_scaled_mm", counting_scaled_mm)
    assert rel_err(cg.cublas_fp8_gemm(x_q, x_s, w_q, w_s, "block", None), ref) < FP8_LINEAR_TOL
    assert calls == {"lt": 1, "torch": 0}
    shifted = torch.empty(64 * 2048 + 16, dtype=torch.float8_e4m3fn, device="cuda")[16:].view(64, 2048)
    shifted.copy_(x_q)
    assert rel_err(cg.cublas_fp8_gemm(shifted, x_s, w_q, w_s, "block", None), ref) < FP8_LINEAR_TOL
    assert calls == {"lt": 1, "torch": 1}
    w_wide = torch.zeros(1024, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    w_wide[:, :2048] = w_q
    strided = w_wide[:, :2048]  # row stride 4096: not contiguous
    assert rel_err(cg.cublas_fp8_gemm(x_q, x_s, strided, w_s, "block", None), ref) < FP8_LINEAR_TOL
    assert calls == {"lt": 1, "torch": 2}


@pytest.mark.gpu
@needs_hopper
def test_direct_cublaslt_in_cuda_graphs_and_fallback(monkeypatch):
    """Captured in a CUDA graph, replays give the eager bits, the functional path's too; an M cuBLASLt
    has no algorithm for runs torch._scaled_mm."""
    from fp8linear.ops.cublas_gemm import cublas_fp8_gemm
    from fp8linear.ops.quant import act_quant

    w_q, w_s, b, direct, via_torch = _pair(2048, 7168, "block", False)
    xs = [torch.randn(256, 7168, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    eager = [direct(x) for x in xs]
    static_x = xs[0].clone()
    graph, static_y = capture_graph(direct, static_x)
    functional = lambda x: cublas_fp8_gemm(*act_quant(x, torch.float8_e4m3fn, cublas_layout=True), w_q, w_s,  # noqa: E731
                                           "block", None)
    graph_f, static_yf = capture_graph(functional, static_x)
    for x, y in zip(xs, eager):
        static_x.copy_(x)
        graph.replay()
        graph_f.replay()
        assert same_bits(static_y, y) and same_bits(static_yf, y)
    from fp8linear.ops.cublaslt import _destroy_plan

    _destroy_plan(direct.lt.lib, direct.lt.plans.pop(100, None))  # the book is shared: start without M=100
    monkeypatch.setattr(type(direct.lt), "_make_plan", lambda self, m: None)
    x = torch.randn(100, 7168, device="cuda", dtype=torch.bfloat16)
    try:
        assert same_bits(direct(x), via_torch(x))
        assert direct.lt.plans[100] is None
    finally:
        direct.lt.plans.pop(100, None)  # later tests of this shape plan M=100 themselves


@pytest.mark.gpu
@needs_hopper
def test_borrowed_algorithms_differ_where_the_tables_name_them():
    """1x128 weights of 4096x14336 (the H100 table borrows larger Ms' algorithms there): cuBLASLt
    accepts each larger M's algorithm for the smaller M, and for at least one pair it is another
    algorithm than the smaller M's own, which the kept (M, algo M) plan then holds."""
    from fp8linear.ops.cublaslt import _destroy_plan

    w_q, w_s, _, direct, _ = _pair(4096, 14336, "row", False)
    lt = direct.lt_for(32 << 20)
    other = 0
    with lt.lock:
        for m, algo_m in ((160, 192), (192, 256), (320, 384), (640, 768), (1280, 1536)):
            borrowed = lt.borrowed_plan(m, algo_m)
            assert borrowed is not None, (m, algo_m)
            assert bytes(borrowed[2]) == bytes(lt.plan(algo_m)[2])
            _destroy_plan(lt.lib, borrowed)
            kept = lt.plan(m, algo_m)
            assert bytes(kept[2]) == bytes(lt.plan(algo_m)[2])
            other += bytes(kept[2]) != bytes(lt.plan(m)[2])
    assert other >= 1
