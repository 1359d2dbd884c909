"""Fp8BlockLinear against the nn.Linear it replaces (reference backend on CPU, Triton on a GPU)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from fp8linear import Fp8BlockLinear, dequantize_weight, fp8_linear, quantize_weight

from fp8linear.ops import HAS_TRITON

from _utils import FP8_LINEAR_TOL, rel_err, same_bits, without_cyclic_gc
from conftest import HAS_CUDA, KERNEL_DEVICE

DEV = "cuda" if HAS_CUDA else "cpu"
GRANS = ["block", "row", "tensor"]


@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_f,out_f,lead", [(300, 576, (2, 5)), (576, 1000, (7,)), (128, 128, (1, 1, 3))])
def test_matches_nn_linear(in_f, out_f, lead, dtype, granularity):
    lin = nn.Linear(in_f, out_f, device=DEV, dtype=dtype)
    mod = Fp8BlockLinear.from_linear(lin, granularity)
    x = torch.randn(*lead, in_f, device=DEV, dtype=dtype)
    y = mod(x)
    assert y.shape == (*lead, out_f) and y.dtype == dtype
    with torch.no_grad():
        assert rel_err(y, lin(x)) < FP8_LINEAR_TOL
        # against the dequantized linear the only differences are activation quantization + rounding
        assert rel_err(y, mod.to_linear(dtype)(x)) < FP8_LINEAR_TOL


@pytest.mark.parametrize("granularity", GRANS)
def test_state_dict_and_repr(granularity):
    mod = Fp8BlockLinear(300, 2112, bias=True, granularity=granularity)
    assert list(mod.state_dict()) == ["weight", "weight_scale_inv", "bias"]
    assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale_inv.dtype == torch.float32
    assert mod.granularity == granularity
    text = repr(mod)
    assert "in_features=300" in text and f"granularity={granularity}" in text and "float8_e4m3fn" in text
    assert list(Fp8BlockLinear(8, 8, bias=False).state_dict()) == ["weight", "weight_scale_inv"]


def test_state_dict_round_trip():
    lin = nn.Linear(300, 576, dtype=torch.bfloat16)
    src = Fp8BlockLinear.from_linear(lin, "row")
    dst = Fp8BlockLinear(300, 576, granularity="row")
    dst.load_state_dict(src.state_dict())
    x = torch.randn(4, 300, dtype=torch.bfloat16)
    assert same_bits(dst(x), src(x))
    assert torch.equal(dst.to_linear(torch.float32).weight, dequantize_weight(src.weight, src.weight_scale_inv))


def test_load_other_granularity_and_refuse_other_fp8_dtype():
    lin = nn.Linear(300, 576, dtype=torch.bfloat16)
    src = Fp8BlockLinear.from_linear(lin, "row")
    dst = Fp8BlockLinear(300, 576, granularity="block")
    dst.load_state_dict(src.state_dict())
    assert dst.granularity == "row"
    x = torch.randn(4, 300, dtype=torch.bfloat16)
    assert same_bits(dst(x), src(x))
    with pytest.raises(ValueError, match="matches no granularity"):
        dst.load_state_dict({**src.state_dict(), "weight_scale_inv": torch.ones(3, 3)})
    fnuz = Fp8BlockLinear(300, 576, fp8_dtype=torch.float8_e4m3fnuz)
    with pytest.raises(TypeError, match="e4m3fn_to_e4m3fnuz"):
        fnuz.load_state_dict(src.state_dict())


def test_fnuz_module_on_reference_path():
    lin = nn.Linear(256, 200)
    mod = Fp8BlockLinear.from_linear(lin, fp8_dtype=torch.float8_e4m3fnuz, backend="reference")
    x = torch.randn(3, 256)
    assert mod.weight.dtype == torch.float8_e4m3fnuz
    with torch.no_grad():
        assert rel_err(mod(x), lin(x)) < FP8_LINEAR_TOL


def test_bad_construction_and_input():
    with pytest.raises(ValueError, match="granularity must be one of"):
        Fp8BlockLinear(8, 8, granularity="channel")
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        Fp8BlockLinear(0, 8)
    with pytest.raises(TypeError, match="expects an nn.Linear"):
        Fp8BlockLinear.from_linear(nn.Conv1d(2, 2, 1))
    mod = Fp8BlockLinear.from_linear(nn.Linear(256, 64))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., K=256\)"):
        mod(torch.randn(3, 255))
    with pytest.raises(TypeError, match="x must be bfloat16"):
        mod(torch.ones(3, 256, dtype=torch.int64))


def test_triton_path_matches_reference_path():
    lin = nn.Linear(300, 130, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    x = torch.randn(5, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    a = Fp8BlockLinear.from_linear(lin, backend="triton")(x)
    b = Fp8BlockLinear.from_linear(lin, backend="reference")(x)
    assert rel_err(a, b) < 1e-2  # same FP8 operands; only fp32 summation order and bf16 rounding differ


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("granularity", GRANS)
def test_decode_split_k_counts_in_the_layer_counters(granularity):
    """Decode GEMMs long enough to split K count their tiles in the layer's counters: the same
    bits as fresh counters, the counters left zeroed, dropped on device moves, never saved."""
    from fp8linear.ops.router import splitk_config

    k, n, m = 4096, 200, 3
    assert splitk_config(m, n, k, torch.device(KERNEL_DEVICE)) is not None  # this shape does split K
    mod = Fp8BlockLinear.from_linear(nn.Linear(k, n, device=KERNEL_DEVICE), granularity, backend="triton")
    assert mod._split_k_counters is not None  # made with the weight, before any forward (what compile traces)
    mod._split_k_counters = None  # a layer without one makes it on its first eager forward
    for _ in range(2):
        x = torch.randn(m, k, device=KERNEL_DEVICE)
        fresh = fp8_linear(x, mod.weight, mod.weight_scale_inv, mod.bias, backend="triton")
        assert same_bits(mod(x), fresh)
        ws = mod._split_k_counters
        assert ws is not None and ws.dtype == torch.int32 and ws.device == mod.weight.device and not ws.any()
    assert "_split_k_counters" not in "".join(mod.state_dict())
    ws.fill_(7)
    mod.to(KERNEL_DEVICE)  # a device move makes it again, zeroed, where the weight lives
    assert mod._split_k_counters is not ws and not mod._split_k_counters.any()
    meta = Fp8BlockLinear(k, n, device="meta")
    assert meta._split_k_counters is None
    meta.to_empty(device=KERNEL_DEVICE)  # to_empty leaves garbage in parameters, never in the counters
    assert meta._split_k_counters is not None and not meta._split_k_counters.any()


def test_split_k_counters_are_marked_static_for_cuda_graphs(monkeypatch):
    """CUDA-graph trees must read the counters in place, not copy it in before each replay: it is
    marked as torch._dynamo.mark_static_address would (with or without Dynamo imported)."""
    import torch._dynamo
    from fp8linear.module import _mark_static_address

    expected = torch.zeros(4, dtype=torch.int32)
    torch._dynamo.mark_static_address(expected)
    ours = torch.zeros(4, dtype=torch.int32)
    _mark_static_address(ours)
    assert ours._dynamo_static_input_type == expected._dynamo_static_input_type
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # the path taken where nothing imported Dynamo yet
    without_dynamo = torch.zeros(4, dtype=torch.int32)
    _mark_static_address(without_dynamo)
    assert without_dynamo._dynamo_static_input_type == expected._dynamo_static_input_type
    if HAS_TRITON:
        mod = Fp8BlockLinear.from_linear(nn.Linear(256, 64, device=KERNEL_DEVICE))
        assert mod._split_k_counters._dynamo_static_input_type == expected._dynamo_static_input_type


def test_fp8_linear_refuses_bad_counters():
    from fp8linear import block_fp8_matmul, quantize_activation

    mod = Fp8BlockLinear.from_linear(nn.Linear(256, 64))
    x = torch.randn(2, 256)
    with pytest.raises(TypeError, match="counters must be a 1-D int32"):
        fp8_linear(x, mod.weight, mod.weight_scale_inv, counters=torch.zeros(64))
    with pytest.raises(ValueError, match="counters are on meta"):
        fp8_linear(x, mod.weight, mod.weight_scale_inv, counters=torch.zeros(64, dtype=torch.int32, device="meta"))
    x_q, x_s = quantize_activation(x)
    with pytest.raises(TypeError, match="counters must be a 1-D int32"):
        block_fp8_matmul(x_q, x_s, mod.weight, mod.weight_scale_inv, counters=torch.zeros(2, 64, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("k", [2048, 4096])  # 4096: split K, counting in the layer's counters
def test_cuda_graph_capture(granularity, k):
    lin = nn.Linear(k, 576, device="cuda", dtype=torch.bfloat16)
    mod = Fp8BlockLinear.from_linear(lin, granularity)
    static_x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    mod(static_x)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = mod(static_x)
    for _ in range(2):
        fresh = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        # the graph runs the route fp8_linear takes (eager calls may take the one-launch decode
        # kernel, whose split of K can differ: the same products summed in another order)
        assert same_bits(static_y, fp8_linear(fresh, mod.weight, mod.weight_scale_inv, mod.bias))
        ref = fresh.double() @ dequantize_weight(mod.weight, mod.weight_scale_inv, torch.float64).t() + mod.bias.double()
        assert rel_err(static_y, ref) < FP8_LINEAR_TOL and rel_err(mod(fresh), ref) < FP8_LINEAR_TOL
    if k == 4096:
        assert mod._split_k_counters is not None and not mod._split_k_counters.any()


@pytest.mark.gpu
def test_large_m_times_k_int64_addressing():
    """M*K > 2^31 elements: 32-bit offsets would wrap."""
    m, k, n = 2**31 // 4096 + 64, 4096, 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = Fp8BlockLinear.from_linear(lin)
    y = mod(x)
    tail = slice(m - 64, m)
    with torch.no_grad():
        ref = mod.to_linear(torch.float32)(x[tail].float())
    assert rel_err(y[tail], ref) < FP8_LINEAR_TOL


def test_dtype_casts_keep_fp8_weights():
    mod = Fp8BlockLinear.from_linear(nn.Linear(256, 130))
    w = mod.weight.clone()
    mod.to(torch.bfloat16)
    mod.half()
    assert mod.weight.dtype == torch.float8_e4m3fn and same_bits(mod.weight, w)
    assert mod.weight_scale_inv.dtype == torch.float32
    assert mod.bias.dtype == torch.float16  # high-precision parameters still follow the cast


@pytest.mark.gpu
def test_torch_compile_reduce_overhead():
    """Inductor + CUDA graphs (mode='reduce-overhead') around a stack of FP8 linears."""
    torch.manual_seed(0)
    # K=4096 at M=8: a split-K GEMM counting in the layer's counters inside the compiled graph
    mlp = nn.Sequential(nn.Linear(4096, 1536), nn.SiLU(), nn.Linear(1536, 576)).cuda().bfloat16()
    fp8 = nn.Sequential(Fp8BlockLinear.from_linear(mlp[0]), nn.SiLU(), Fp8BlockLinear.from_linear(mlp[2], "row"))
    compiled = torch.compile(fp8, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out = compiled(x).clone()
            assert rel_err(out, fp8(x)) < 1e-2
    assert not fp8[0]._split_k_counters.any()


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_from_quantized(granularity):
    lin = nn.Linear(300, 130, dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(lin.weight, granularity)
    mod = Fp8BlockLinear.from_quantized(w_q, w_s, lin.bias)
    ref = Fp8BlockLinear.from_linear(lin, granularity)
    assert mod.granularity == granularity and mod.in_features == 300 and mod.out_features == 130
    assert list(mod.state_dict()) == list(ref.state_dict())
    for a, b in zip(mod.state_dict().values(), ref.state_dict().values()):
        assert same_bits(a, b)
    assert mod.bias.data_ptr() != lin.bias.data_ptr()  # the bias is copied, not shared
    with pytest.raises(TypeError, match="2-D FP8 tensor"):
        Fp8BlockLinear.from_quantized(lin.weight, w_s)
    with pytest.raises(TypeError, match="weight_scale_inv must be a torch.float32"):
        Fp8BlockLinear.from_quantized(w_q, w_s.double())
    with pytest.raises(ValueError, match="matches no granularity"):
        Fp8BlockLinear.from_quantized(w_q, torch.ones(7, 7))
    with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \(130,\)"):
        Fp8BlockLinear.from_quantized(w_q, w_s, torch.zeros(129))


def test_workspace_keyword_is_a_deprecated_name_of_counters():
    from fp8linear import fp8_linear

    mod = Fp8BlockLinear.from_linear(nn.Linear(256, 64))
    x = torch.randn(2, 256)
    ws = torch.zeros(64, dtype=torch.int32)
    with pytest.warns(DeprecationWarning, match="'workspace' is deprecated"):
        y = fp8_linear(x, mod.weight, mod.weight_scale_inv, workspace=ws)
    assert torch.equal(y, fp8_linear(x, mod.weight, mod.weight_scale_inv, counters=ws))
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="once"):
        fp8_linear(x, mod.weight, mod.weight_scale_inv, counters=ws, workspace=ws)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="counters must be a 1-D int32"):
        fp8_linear(x, mod.weight, mod.weight_scale_inv, workspace=torch.zeros(64))


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("lead", [(1,), (2, 3)])
def test_cpu_plan_is_the_cpu_path_without_per_call_checks(granularity, lead, monkeypatch):
    """On CPU under "auto" the layer keeps a plan per input shape that runs the CPU path directly:
    the same bits as fp8_linear from the first call on, validation and backend lookup once per shape."""
    import fp8linear.module as module_mod
    from fp8linear import fp8_linear

    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    torch.manual_seed(0)
    layer = Fp8BlockLinear.from_linear(nn.Linear(300, 200, bias=True), granularity=granularity)
    checks = []
    real_validate = module_mod.validate_linear
    monkeypatch.setattr(module_mod, "validate_linear", lambda *a: (checks.append(1), real_validate(*a))[1])
    x = torch.randn(*lead, 300, dtype=torch.bfloat16)
    expected = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias)
    for call in range(3):
        y = layer(x)
        assert y.shape == (*lead, 200) and y.dtype == torch.bfloat16
        assert torch.equal(y, expected), f"call {call}"
    assert len(checks) == 1 and len(layer._plans) == 1
    layer(torch.randn(4, 300, dtype=torch.bfloat16))  # another shape: another plan
    assert len(checks) == 2 and len(layer._plans) == 2
    with pytest.raises(ValueError):
        layer(torch.randn(2, 299, dtype=torch.bfloat16))  # a bad input is still refused
    layer.backend = "reference"  # a new backend drops the plans; the reference runs
    assert not layer._plans
    assert torch.equal(layer(x), fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="reference"))


@pytest.mark.parametrize("granularity", ["block", "tensor"])
@pytest.mark.parametrize("lead", [(1,), (2, 5)])
def test_cpu_plan_follows_in_place_updates_and_thread_counts(lead, granularity, monkeypatch):
    """The CPU plan's prepared one-call kernel (where the compiled kernel runs) gives the CPU path's
    bits, and follows in-place updates of the weight (a NaN code included), its scales (a tensor
    scale is folded into the prepared arguments) and the bias, and a new thread count."""
    from fp8linear import fp8_linear
    from fp8linear.ops import cpu_linear, cpu_native

    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    general = []
    real = cpu_linear.cpu_fp8_linear
    monkeypatch.setattr(cpu_linear, "cpu_fp8_linear", lambda *a, **kw: (general.append(1), real(*a, **kw))[1])
    torch.manual_seed(0)
    layer = Fp8BlockLinear.from_linear(nn.Linear(300, 200, bias=True).to(torch.bfloat16), granularity=granularity)
    x = torch.randn(*lead, 300, dtype=torch.bfloat16)

    def expected():
        return fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias)

    assert torch.equal(layer(x), expected()) and torch.equal(layer(x), expected())
    with torch.no_grad():
        other = Fp8BlockLinear.from_linear(nn.Linear(300, 200, bias=True).to(torch.bfloat16), granularity=granularity)
        layer.weight.copy_(other.weight)
        assert torch.equal(layer(x), expected())
        layer.weight_scale_inv.mul_(3)
        y = layer(x)
        assert torch.equal(y, expected())
        layer.bias.add_(1)
        assert torch.equal(layer(x), expected())
        layer.weight.view(torch.uint8)[7, 3] = 0x7F  # a NaN code: output column 7 is NaN
        y = layer(x)
        assert y[..., 7].isnan().all() and y.isnan().sum() == y[..., 7].numel()
        assert same_bits(y, expected())
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if saved > 1 else 2)
        assert same_bits(layer(x), expected())
    finally:
        torch.set_num_threads(saved)
    if cpu_native.native_kernel() is not None:
        assert general == []  # every call ran the prepared kernel


def test_cpu_layer_compiles_into_one_graph(monkeypatch):
    """Under torch.compile the CPU path is one custom op: one graph, no breaks (a fresh weight is
    prepared inside the op, not traced), the eager bits."""
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    torch.manual_seed(0)
    layer = Fp8BlockLinear.from_linear(nn.Linear(300, 200, bias=True).to(torch.bfloat16), granularity="tensor")
    x = torch.randn(2, 3, 300, dtype=torch.bfloat16)
    explain = torch._dynamo.explain(layer)(x)
    assert explain.graph_count == 1 and explain.graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True)
    assert same_bits(compiled(x), layer(x))


NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=NEEDS_TRITON)])
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_layer_runs_the_weight_it_holds_when_parameters_are_swapped(backend, granularity):
    """Tensor parallelism runs a layer with its parameters swapped for this rank's shards (the
    layer's in/out_features stay the full model's): every call, first, routed and planned, computes
    with the weight it holds and returns that weight's N columns."""
    torch.manual_seed(0)
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    layer = Fp8BlockLinear.from_linear(nn.Linear(256, 512, bias=True, device=device, dtype=torch.bfloat16),
                                       granularity=granularity, backend=backend)
    rows = 256  # the first rank's half of N (two 128-row scale blocks)
    scale_rows = rows // 128 if granularity == "block" else rows
    layer._parameters.update(weight=layer.weight[:rows].contiguous(), bias=layer.bias[:rows].contiguous(),
                             weight_scale_inv=layer.weight_scale_inv[:scale_rows].contiguous())
    x = torch.randn(3, 5, 256, device=device, dtype=torch.bfloat16)
    expected = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend=backend)
    for call in range(3):
        y = layer(x)
        assert y.shape == (3, 5, rows), f"call {call}"
        assert torch.equal(y, expected), f"call {call}"


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=NEEDS_TRITON)])
@pytest.mark.parametrize("m", [1, 8, 200])
def test_layer_with_plans_is_freed_when_deleted(backend, m):
    """Plans hold the weights, not the layer: deleting a planned layer frees its weights at once,
    without Python's cyclic garbage collector (GPU memory a deleted model still holds is memory
    `torch.cuda.empty_cache` cannot hand back). A guard: no plan kind makes such a cycle today;
    on a GPU "auto" covers the GPU plans, on a CPU the CPU plan."""
    import weakref

    device = KERNEL_DEVICE if backend == "triton" else DEV
    layer = Fp8BlockLinear.from_linear(nn.Linear(256, 384, bias=True, device=device, dtype=torch.bfloat16),
                                       backend=backend)
    x = torch.randn(m, 256, device=device, dtype=torch.bfloat16)
    with without_cyclic_gc():
        for _ in range(3):
            layer(x)
        assert layer._plans
        weight, module = weakref.ref(layer.weight), weakref.ref(layer)
        del layer
        assert module() is None and weight() is None
