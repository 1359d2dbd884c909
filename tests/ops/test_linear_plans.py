"""Fp8BlockLinear's launch plans (fp8linear.ops.linear.LinearPlan): decided once per input shape,
bit-identical to the routed functional path, dropped when what they were made from changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp8linear import Fp8BlockLinear, dequantize_weight, fp8_linear, quantize_activation
from fp8linear.ops import HAS_TRITON

from _utils import FP8_LINEAR_TOL, GEMM_TOL, rel_err, same_bits
from conftest import KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

# (M, N, K, route on the interpreter's 4-SM "GPU"): one token -> fused GEMV; up to 64 tokens -> the
# one-launch decode kernel, split (long K) or not (short K); more rows on our kernels (up to
# ONE_LAUNCH_MAX_MNK) -> that kernel too; beyond -> tiled (two launches).
CASES = [(1, 130, 300, "gemv"), (3, 130, 4224, "decode"), (77, 136, 256, "decode"), (5, 64, 300, "decode"),
         (17, 96, 4352, "decode")]


def _layer(n: int, k: int, granularity: str, bias: bool, device: str = KERNEL_DEVICE) -> Fp8BlockLinear:
    lin = nn.Linear(k, n, bias=bias, device=device, dtype=torch.bfloat16)
    return Fp8BlockLinear.from_linear(lin, granularity, backend="triton")


def _planned(layer: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """Call the layer twice with x: the first call of a shape is routed, the second makes its plan."""
    layer(x)
    return layer(x)


def _count_validated_calls(monkeypatch) -> list[int]:
    """Counts the layer's validated calls (validate_linear before planning, fp8_linear otherwise)."""
    from fp8linear import module

    calls = [0]
    for name in ("fp8_linear", "validate_linear"):
        real = getattr(module, name)

        def spy(*a, _real=real, **kw):
            calls[0] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m,n,k,kernel", CASES)
def test_plan_matches_routed_path_bit_for_bit(m, n, k, kernel, bias, granularity, monkeypatch):
    layer = _layer(n, k, granularity, bias)
    validated = _count_validated_calls(monkeypatch)
    gen = torch.Generator(device=KERNEL_DEVICE).manual_seed(m * n + k)
    lead = (1, m) if m % 2 else (m,)  # leading dims reach the plan unreshaped
    xs = [torch.randn(*lead, k, device=KERNEL_DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    ys = [layer(x) for x in xs]
    assert validated[0] == 2  # the first call validates and runs the route, the second also plans; then the plan
    (plan,) = layer._plans.values()
    assert plan.route.kernel == kernel
    for x, y in zip(xs, ys):
        assert y.shape == (*lead, n) and y.dtype == x.dtype
        routed = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="triton")
        assert same_bits(y, routed)
        ref = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="reference")
        assert rel_err(y, ref) < GEMM_TOL[torch.bfloat16] * 2  # fp32 sums in another order, one bf16 rounding each
    if kernel == "decode":
        assert not layer._split_k_counters.any()  # tile and wait counters left at zero for the next call


@pytest.mark.parametrize("workspace", ["none", "too small", "layer's"])
@pytest.mark.parametrize("m,n,k", [(2, 130, 4224), (33, 64, 300), (70, 64, 4224), (77, 136, 256), (200, 130, 4224)])
def test_one_launch_decode_kernel_matches_two_launches(m, n, k, workspace):
    """Eager routes on our kernels up to ONE_LAUNCH_MAX_MNK run in one launch (quantizing programs
    first, in chunks of QUANT_CHUNK_ROWS rows above it), with the two launches' bits."""
    from fp8linear import block_fp8_matmul, quantize_activation, quantize_weight
    from fp8linear.ops.fused_decode import fused_decode_gemm
    from fp8linear.ops.router import route_linear
    from fp8linear.ops.splitk_gemm import splitk_counters

    dev = torch.device(KERNEL_DEVICE)
    w_q, w_s = quantize_weight(torch.randn(n, k, device=dev) / 30, "block")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    route = route_linear(dev, m, n, k, "block", w_q.dtype, x.dtype, bias, False, True, eager=True)
    assert route.kernel == "decode"
    assert route_linear(dev, m, n, k, "block", w_q.dtype, x.dtype, bias, False, True).kernel != "decode"
    ws = {"none": None, "too small": torch.zeros(3, dtype=torch.int32, device=dev),
          "layer's": splitk_counters(n, dev)}[workspace]
    y = fused_decode_gemm(x, w_q, w_s, "block", bias, route.config, ws)
    x_q, x_s = quantize_activation(x, backend="triton")
    assert same_bits(y, block_fp8_matmul(x_q, x_s, w_q, w_s, bias=bias, backend="triton"))
    if ws is not None:
        assert not ws.any()


def test_two_launch_plan_matches_routed_calls(monkeypatch):
    """Above ONE_LAUNCH_MAX_MNK eager plans quantize, then launch our GEMM: the same bits as the
    routed functional path."""
    from fp8linear.ops import router

    monkeypatch.setattr(router, "ONE_LAUNCH_MAX_MNK", 0)
    layer = _layer(136, 256, "block", True)
    xs = [torch.randn(2, 77, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16) for _ in range(3)]
    ys = [layer(x) for x in xs]
    (plan,) = layer._plans.values()
    assert plan.route.kernel == "tiled" and len(plan.calls) == 2
    for x, y in zip(xs, ys):
        assert same_bits(y, fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="triton"))


def test_one_launch_decode_is_an_eager_nvidia_choice(monkeypatch):
    from fp8linear.ops import router

    dev = torch.device(KERNEL_DEVICE)
    args = (dev, 8, 576, 7168, "block", torch.float8_e4m3fn, torch.bfloat16, None, False, True)
    assert router.route_linear(*args, eager=True).kernel == "decode"
    big = (dev, 8, 18432, 7168) + args[4:]
    assert router.route_linear(*big, eager=True).kernel != "decode"  # GPU-bound: two launches win
    m_max = router.ONE_LAUNCH_MAX_MNK // (576 * 7168)
    for m in (65, 333, m_max):  # above decode sizes, where our kernels run the GEMM, up to ONE_LAUNCH_MAX_MNK
        mid = (dev, m) + args[2:]
        assert router.route_linear(*mid).kernel in ("splitk", "tiled")
        assert router.route_linear(*mid, eager=True).kernel == "decode"
    assert router.route_linear(dev, m_max + 1, *args[2:], eager=True).kernel != "decode"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not router._one_launch_decode_ok(dev)  # no in-launch wait on ROCm


@pytest.mark.parametrize("n,k", [(24576, 1536), (7168, 4096)])
def test_eager_single_tokens_take_the_gemv_on_larger_weights(monkeypatch, n, k):
    """Between FUSED_GEMV_MAX_WEIGHT and EAGER_GEMV_MAX_WEIGHT one eager token runs the fused GEMV;
    graphs, larger weights and ROCm keep their routes."""
    from fp8linear.ops import router

    dev = torch.device(KERNEL_DEVICE)
    assert router.FUSED_GEMV_MAX_WEIGHT <= n * k < router.EAGER_GEMV_MAX_WEIGHT
    args = (dev, 1, n, k, "block", torch.float8_e4m3fn, torch.bfloat16, None, True, True)
    assert router.route_linear(*args, eager=True).kernel == "gemv"
    assert router.route_linear(*args).kernel != "gemv"
    assert router.route_linear(dev, 2, *args[2:], eager=True).kernel != "gemv"  # one token only
    assert router.route_linear(dev, 1, 18432, 7168, *args[4:], eager=True).kernel != "gemv"  # GPU-bound
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert router._eager_gemv(1, n, k) is False  # measured on NVIDIA only


def test_plans_are_per_shape_and_dtype_and_bounded(monkeypatch):
    from fp8linear import module

    layer = _layer(130, 300, "block", True)
    for m in (1, 2, 3):
        _planned(layer, torch.randn(m, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16))
    _planned(layer, torch.randn(2, 300, device=KERNEL_DEVICE, dtype=torch.float32))
    assert len(layer._plans) == 4
    first = next(iter(layer._plans))
    monkeypatch.setattr(module, "MAX_PLANS", 4)
    x4 = torch.randn(4, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    _planned(layer, x4)
    assert len(layer._plans) == 4 and first not in layer._plans  # full: the oldest made room
    assert (x4.shape, x4.dtype, x4.device) in layer._plans


@pytest.mark.parametrize("config", [None, (32, False, 0), (1, True, 0), (32, True, 0), (32, True, 384)])
def test_routed_cublas_call_runs_the_routes_limit_and_scale_form(monkeypatch, config):
    """A shape's first (routed, unplanned) call runs the layer's CublasLinear with the route's
    workspace limit, weight-scale form and algorithm rows, as its plan and the functional route do."""
    from fp8linear.ops import router
    from fp8linear.ops.cublas_gemm import CublasConfig, algo_rows, config_row_scales, workspace_limit
    from fp8linear.ops.linear import CublasLinear
    from fp8linear.ops.router import Route

    cfg = None if config is None else CublasConfig(workspace_mib=config[0], row_scales=config[1], algo_m=config[2])
    monkeypatch.setattr(router, "route_linear", lambda *a, **kw: Route("cublas", cfg))
    layer = _layer(256, 512, "block", False)
    calls = []

    class Runner:
        row_scales = False

        form = CublasLinear.form

        def __call__(self, x, limit, as_rows, algo_m):
            calls.append((limit, as_rows, algo_m))
            return torch.zeros(*x.shape[:-1], 256, dtype=x.dtype, device=x.device)

    monkeypatch.setattr(layer, "_cublas_runner", lambda w_s, granularity: Runner())
    layer(torch.randn(3, 512, device=KERNEL_DEVICE, dtype=torch.bfloat16))
    assert calls == [(workspace_limit(cfg), config_row_scales(cfg), algo_rows(cfg))]


def test_cublas_plans_of_a_layer_share_one_cublas_linear(monkeypatch):
    """cuBLAS plans run the layer's one CublasLinear (the weight scale in cuBLAS's layout: for K/128
    not a multiple of 4 the padded grid with cuBLASLt, a copy expanded to 1x128 with torch._scaled_mm;
    one prepared quantization per launch config),
    made by the first such plan or routed call, dropped with the plans."""
    from fp8linear.ops import linear, router
    from fp8linear.ops.cublas_gemm import cublas_weight_scale
    from fp8linear.ops.router import Route

    monkeypatch.setattr(router, "route_linear", lambda *a, **kw: Route("cublas"))
    made = []
    real = linear.CublasLinear
    monkeypatch.setattr(linear, "CublasLinear", lambda *a: made.append(1) or real(*a))
    layer = _layer(256, 1408, "block", False)  # 11 K groups: the expanded copy
    plans = [layer._make_plan(torch.randn(m, 1408, device=KERNEL_DEVICE, dtype=torch.bfloat16), None)
             for m in (96, 160, 333)]
    assert all(p.route.kernel == "cublas" for p in plans) and len(made) == 1
    runner = layer._cublas_linear
    assert all(p.run is runner for p in plans)
    assert len(runner.quant_calls) == 1  # 96-333 rows of 1408: one launch config
    expected = cublas_weight_scale(layer.weight, layer.weight_scale_inv, "block", runner.row_scales)
    assert runner.row_scales is (runner.lt is None)  # without cuBLASLt: torch._scaled_mm's 1x128 form
    assert expected.shape == ((11, 256) if runner.row_scales else (11, 2))
    assert torch.equal(runner.scale_b, expected)
    layer.clear_plans()
    assert layer._cublas_linear is None
    layer._make_plan(torch.randn(96, 1408, device=KERNEL_DEVICE, dtype=torch.bfloat16), None)
    assert len(made) == 2
    layer.weight_scale_inv = torch.nn.Parameter(layer.weight_scale_inv.detach() * 2, requires_grad=False)
    assert layer._cublas_linear is None  # a replaced scale drops it with the plans


def test_a_plan_pins_no_buffer_it_was_built_with():
    """A prepared launch keeps its fixed tensors (weight, scales, counters), not the output and
    scratch buffers the plan was built with: those are fresh per call."""
    layer = _layer(130, 4224, "block", True)
    x = torch.randn(5, 4224, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    _planned(layer, x)
    (plan,) = layer._plans.values()
    fixed = {t.untyped_storage().data_ptr()
             for t in (layer.weight, layer.weight_scale_inv, layer.bias, layer._split_k_counters)}
    for call in plan.calls:
        assert all(call.values[i] is None for i in call.slot_index)
        kept = [v.untyped_storage() for v in call.values if isinstance(v, torch.Tensor)] + list(call.held)
        assert kept and {st.data_ptr() for st in kept} <= fixed


def test_shapes_seen_once_are_routed_without_a_plan(monkeypatch):
    """A shape that never comes back (the whole-sequence projection of a growing cache) costs a
    routed call, not a plan; a shape's second call plans, with the first call's bits."""
    from fp8linear import module

    layer = _layer(130, 4224, "block", False)
    xs = {m: torch.randn(m, 4224, device=KERNEL_DEVICE, dtype=torch.bfloat16) for m in (3, 4, 5, 6)}
    first = {m: layer(x) for m, x in xs.items()}
    assert not layer._plans and len(layer._seen) == 4
    for m, x in xs.items():
        assert same_bits(layer(x), first[m])  # planned now: the same route, the same bits
    assert len(layer._plans) == 4
    assert {plan.route.kernel for plan in layer._plans.values()} == {"decode"}
    monkeypatch.setattr(module, "MAX_SEEN", 4)
    layer(torch.randn(7, 4224, device=KERNEL_DEVICE, dtype=torch.bfloat16))
    assert len(layer._seen) == 1  # full: forgotten, then the new one kept
    layer.clear_plans()
    assert not layer._plans and not layer._seen


def test_plans_dropped_when_weights_bias_backend_or_device_change():
    layer = _layer(130, 300, "block", True)
    x = torch.randn(2, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    _planned(layer, x)
    assert layer._plans and layer._seen
    other = _layer(130, 300, "row", True)
    layer.weight_scale_inv = other.weight_scale_inv  # now a 1x128 layer
    layer.weight = other.weight
    assert not layer._plans and not layer._seen
    y = _planned(layer, x)
    assert same_bits(y, fp8_linear(x, other.weight, other.weight_scale_inv, layer.bias, backend="triton"))
    layer.bias = None
    assert not layer._plans
    _planned(layer, x)
    layer.backend = "reference"
    assert not layer._plans
    y = layer(x)
    assert not layer._plans  # the reference path keeps no plan
    assert same_bits(y, fp8_linear(x, other.weight, other.weight_scale_inv, None, backend="reference"))
    layer.backend = "triton"
    _planned(layer, x)
    assert layer._plans
    layer.to(KERNEL_DEVICE)
    assert not layer._plans and not layer._seen


@pytest.mark.parametrize("m,n,k", [(130, 136, 4224), (200, 130, 300), (129, 64, 576)])
def test_row_plans_from_128_rows_read_the_n_major_scale_copy(m, n, k):
    """From N_MAJOR_SCALE_MIN_M rows a 1x128 layer's plans hand our kernels its N-major scale copy
    (same bits as the checkpoint layout), made once; it goes with the plans when the scales change."""
    from fp8linear.ops.router import N_MAJOR_SCALE_MIN_M

    layer = _layer(n, k, "row", True)
    gen = torch.Generator(device=KERNEL_DEVICE).manual_seed(m + n + k)
    x = torch.randn(m, k, device=KERNEL_DEVICE, dtype=torch.bfloat16, generator=gen)
    small = x[: N_MAJOR_SCALE_MIN_M - 1].clone()
    _planned(layer, small)
    assert layer.__dict__["_row_scale_n_major"] is None  # fewer rows: the checkpoint's layout
    y = _planned(layer, x)
    copy_ = layer.__dict__["_row_scale_n_major"]
    assert copy_ is not None and copy_.stride() == (1, n) and torch.equal(copy_, layer.weight_scale_inv)
    assert same_bits(y, fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="triton"))
    assert same_bits(layer(x), y) and layer.__dict__["_row_scale_n_major"] is copy_  # the plan: made once
    layer.weight_scale_inv = nn.Parameter(layer.weight_scale_inv * 2, requires_grad=False)
    assert layer.__dict__["_row_scale_n_major"] is None
    y2 = _planned(layer, x)
    assert same_bits(y2, fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="triton"))
    assert not same_bits(y2, y)


def test_a_planned_layer_copies_and_pickles_without_its_plans():
    import copy
    import io

    layer = _layer(130, 300, "block", True)
    x = torch.randn(2, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    y = _planned(layer, x)
    assert layer._plans
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(layer), torch.load(buf, weights_only=False)):
        assert not clone._plans and not clone._seen and layer._plans
        assert same_bits(_planned(clone, x), y) and clone._plans


def test_in_place_updates_reach_the_output():
    layer = _layer(130, 300, "block", False)
    x = torch.randn(2, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    _planned(layer, x)
    other = _layer(130, 300, "block", False)
    layer.load_state_dict(other.state_dict())  # copies into the same tensors, and forgets the plans
    assert not layer._plans
    assert same_bits(_planned(layer, x), other(x))
    with torch.no_grad():
        layer.weight.copy_(_layer(130, 300, "block", False).weight)  # a plan reads the weight where it is
    assert layer._plans
    assert same_bits(layer(x), fp8_linear(x, layer.weight, layer.weight_scale_inv, None, backend="triton"))


def test_misaligned_or_strided_inputs_take_the_validated_path(monkeypatch):
    layer = _layer(130, 300, "block", True)
    validated = _count_validated_calls(monkeypatch)
    x = torch.randn(3, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    _planned(layer, x)
    flat = torch.randn(3 * 300 + 1, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    misaligned = flat[1:].view(3, 300)  # 2 bytes past a 16-byte boundary
    strided = torch.randn(300, 3, device=KERNEL_DEVICE, dtype=torch.bfloat16).t()
    for xi in (misaligned, strided):
        y = layer(xi)
        assert same_bits(y, fp8_linear(xi.contiguous(), layer.weight, layer.weight_scale_inv, layer.bias,
                                       backend="triton"))
    assert validated[0] == 4
    assert len(layer._plans) == 1


def test_bad_input_still_gets_clear_errors_after_planning():
    layer = _layer(130, 300, "block", True)
    _planned(layer, torch.randn(2, 300, device=KERNEL_DEVICE, dtype=torch.bfloat16))
    assert layer._plans
    with pytest.raises(ValueError, match="K=300"):
        layer(torch.randn(2, 299, device=KERNEL_DEVICE, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        layer(torch.randn(2, 300, device=KERNEL_DEVICE).to(torch.float64))


@pytest.mark.parametrize("specs", [
    [((3, 300), torch.float8_e4m3fn), ((3, 3), torch.float32)],
    [((77, 4224), torch.float8_e4m3fnuz), ((77, 33), torch.float32), ((2, 77, 130), torch.float32)],
    [((1, 1), torch.bfloat16)],
])
def test_scratch_buffers_are_aligned_disjoint_and_where_their_addresses_say(specs):
    from fp8linear.ops.launch import Scratch

    scratch = Scratch(specs)
    buf = scratch.allocate(torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() == scratch.nbytes
    views = scratch.views(buf)
    addresses = scratch.addresses(buf)
    assert len(views) == len(addresses) == len(specs)
    end = buf.data_ptr()
    for (shape, dtype), v, a in zip(specs, views, addresses):
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous()
        assert v.data_ptr() == a and (a - buf.data_ptr()) % 256 == 0
        assert a >= end  # after the previous buffer, no overlap
        end = a + v.numel() * v.element_size()
    assert end <= buf.data_ptr() + buf.numel()
    buf.zero_()
    for i, v in enumerate(views, start=1):  # each view covers exactly its own bytes
        v.view(torch.uint8).fill_(i)
    for i, v in enumerate(views, start=1):
        assert int((buf == i).sum()) == v.numel() * v.element_size()


def test_kernel_call_launches_other_grids_with_per_call_rows():
    """KernelCall.launch: one prepared act_quant launch serves inputs of other M (grid, M and the
    M-major scales' stride given per call), with act_quant's bytes and scales (CublasLinear's use)."""
    from fp8linear.ops.launch import KernelCall
    from fp8linear.ops.quant import _act_quant_kernel, act_quant, act_quant_args, act_quant_outputs, cublas_rows

    k = 300
    x0 = torch.randn(5, k, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    q0, s0 = act_quant_outputs(5, k, torch.float8_e4m3fn, x0.device, cublas_layout=True)
    _, args, options = act_quant_args(x0, q0, s0)
    call = KernelCall(_act_quant_kernel, (1, 1), args, options, ("x_ptr", "q_ptr", "s_ptr", "M", "M_IN", "stride_sg"))
    for m in (5, 3, 9, 2):  # 4-row programs throughout (small inputs)
        x = torch.randn(m, k, device=KERNEL_DEVICE, dtype=torch.bfloat16)
        x_q, x_s = act_quant_outputs(m, k, torch.float8_e4m3fn, x.device, cublas_layout=True)
        rows = cublas_rows(m)
        call.launch((-(-rows // 4), -(-k // 128), 1), x, x_q, x_s, rows, m, rows)
        r_q, r_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
        assert same_bits(x_q, r_q) and same_bits(x_s, r_s)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("m,n,k", [(1, 2112, 7168), (1, 18432, 7168), (2, 576, 7168), (8, 576, 7168), (16, 4096, 512),
                                   (33, 24576, 1536), (64, 7168, 2048), (64, 7168, 18432), (3, 300, 4224),
                                   (77, 1536, 7168), (333, 2112, 7168), (1024, 7168, 2048), (2048, 4096, 512)])
def test_gpu_plans_launch_directly_and_match(m, n, k, granularity):
    """On a GPU the prepared launches call the compiled kernels directly after the first call, with
    results bit-identical to their route run unprepared; graphs capture the planned forward, on the
    route the functional path takes (the eager-only choices, one-launch decode and our kernels for
    small prefill GEMMs, give way to the GPU-faster route there)."""
    from fp8linear.ops.linear import run_linear_route
    from fp8linear.ops.router import use_library_quantization
    from fp8linear.ops.splitk_gemm import splitk_counters

    torch.manual_seed(m + n + k)
    layer = Fp8BlockLinear.from_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16), granularity)
    xs = [torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ys = [layer(x) for x in xs]
    (plan,) = layer._plans.values()
    # every prepared launch is direct now; an eager CUTLASS plan that quantizes x in the library's
    # call launches its act_quant only under CUDA-graph capture
    in_library = (plan.route.kernel == "cutlass" and not plan.route.config.stream_k
                  and use_library_quantization(2 * m, k, torch.bfloat16))
    assert all(c.compiled is not None for c in plan.calls[in_library:])
    # and holds its fixed tensors as raw addresses (their storages kept alive)
    assert not any(isinstance(v, torch.Tensor) for c in plan.calls for v in c.values)
    if plan.route.kernel in ("gemv", "decode", "splitk", "tiled"):  # our prepared GEMMs (cuBLAS: only x's
        assert plan.calls and plan.calls[-1].held  # quantization is prepared; persistent: unprepared)
    w_s = layer.weight_scale_inv.reshape(()) if granularity == "tensor" else layer.weight_scale_inv
    for x, y in zip(xs, ys):
        unprepared = run_linear_route(plan.route, x.flatten(0, 1), layer.weight, w_s, granularity, layer.bias,
                                      splitk_counters(layer.out_features, "cuda"))
        assert same_bits(y, unprepared.view_as(y))
        if plan.route.kernel == "decode":  # the same bits as act_quant, then the split-K GEMM of its config
            from fp8linear.ops.splitk_gemm import splitk_fp8_gemm

            x_q, x_s = quantize_activation(x)
            two = splitk_fp8_gemm(x_q.flatten(0, 1), x_s.flatten(0, 1), layer.weight, w_s, granularity,
                                  torch.bfloat16, layer.bias, plan.route.config)
            assert same_bits(y, two.view_as(y))
        ref = x.double() @ dequantize_weight(layer.weight, layer.weight_scale_inv, torch.float64).t() + layer.bias.double()
        assert rel_err(y, ref) < FP8_LINEAR_TOL
    _check_graph_runs_functional_route(layer, xs)
    if layer._split_k_counters is not None:
        assert not layer._split_k_counters.any()


def _check_graph_runs_functional_route(layer: Fp8BlockLinear, xs: list) -> None:
    """A CUDA graph of the planned layer replays the functional path's bits for every x."""
    static_x = xs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    for x in xs:
        static_x.copy_(x)
        graph.replay()
        assert same_bits(static_y, fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(24576, 1536), (7168, 4096)])
def test_gpu_eager_single_token_gemv_plan(n, k):
    """One eager token on a weight past FUSED_GEMV_MAX_WEIGHT: the plan launches the fused GEMV
    directly, bit-identical to that route unprepared and within the float64 reference's bound;
    a CUDA graph captures the functional route."""
    from fp8linear.ops.linear import run_linear_route

    torch.manual_seed(n + k)
    layer = Fp8BlockLinear.from_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
    xs = [torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ys = [layer(x) for x in xs]
    (plan,) = layer._plans.values()
    assert plan.route.kernel == "gemv" and len(plan.calls) == 1 and plan.calls[0].compiled is not None
    for x, y in zip(xs, ys):
        unprepared = run_linear_route(plan.route, x.flatten(0, 1), layer.weight, layer.weight_scale_inv, "block",
                                      layer.bias, None)
        assert same_bits(y, unprepared.view_as(y))
        ref = x.double() @ dequantize_weight(layer.weight, layer.weight_scale_inv, torch.float64).t() + layer.bias.double()
        assert rel_err(y, ref) < FP8_LINEAR_TOL
    _check_graph_runs_functional_route(layer, xs)


def test_launch_hooks_are_recognised_in_every_form():
    """A planned launch goes direct only while no launch hook (profilers) would run: Triton >= 3.5
    keeps hooks in an always-present chain, older builds a plain callable or None."""
    from fp8linear.ops.launch import _hook_set

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_set(None) and not _hook_set(Chain([]))
    assert _hook_set(Chain([print])) and _hook_set(print)


def test_eager_plans_keep_small_prefill_gemms_off_cublas(monkeypatch):
    """Eagerly, a cuBLAS call's host cost outweighs what cuBLAS saves below EAGER_CUBLAS_MIN_MNK;
    graphs and compiled code (eager=False) keep cuBLAS there (the rule, on a stand-in Hopper)."""
    from fp8linear.ops import router

    monkeypatch.setattr(router, "cublas_device_ok", lambda device: True)
    dev = torch.device(KERNEL_DEVICE)

    def kernel(m, n, k, eager):
        return router.route_linear(dev, m, n, k, "block", torch.float8_e4m3fn, torch.bfloat16, None, True, True,
                                   eager=eager).kernel

    assert kernel(512, 2112, 7168, eager=False) == "cublas"
    assert kernel(512, 2112, 7168, eager=True) != "cublas"  # 7.7e9 multiply-adds
    assert kernel(128, 7168, 18432, eager=True) == "cublas"  # 1.7e10: the GPU sets the pace
    assert kernel(1024, 1536, 7168, eager=True) != "cublas"  # 1.13e10
    assert kernel(1024, 2112, 7168, eager=True) == "cublas"  # 1.55e10
    assert kernel(4096, 2112, 7168, eager=True) == "cublas"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 2112, 7168), (333, 4096, 14336), (1000, 24576, 1536), (2049, 576, 7168)])
def test_gpu_row_layers_share_one_n_major_scale(m, n, k):
    """A 1x128 layer's N-major scale copy is what its kernels from 128 rows and its cuBLAS route read:
    one storage, the bits of the checkpoint layout on every route."""
    from fp8linear.ops import router
    from fp8linear.ops.cublas_gemm import cublas_device_ok
    from fp8linear.ops.linear import run_linear_route

    torch.manual_seed(m)
    layer = Fp8BlockLinear.from_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16), "row")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for backend in ("triton", "auto"):
        layer.backend = backend  # drops the plans and the copy
        y = _planned(layer, x)
        args, _, _, dense = layer._route_args(x)
        eager, capture = (router.route_linear(*args, eager=e, weight_contiguous=dense) for e in (True, False))
        ref = run_linear_route(eager, x, layer.weight, layer.weight_scale_inv, "row", layer.bias)
        assert same_bits(y, ref)
        if backend == "triton":  # made by the shape's first (routed) call where its route reads it
            wanted = router.use_n_major_scales(eager, m, k, "row")
            assert (layer.__dict__["_row_scale_n_major"] is not None) == wanted
    if cublas_device_ok(torch.device("cuda")):
        runner = layer._cublas_runner(layer.weight_scale_inv, "row")
        assert runner.scale_b.data_ptr() == layer.row_scale_n_major().data_ptr()  # one copy, not two


@pytest.mark.gpu
def test_gpu_cublas_linear_serves_any_m_bit_identical(monkeypatch):
    """A layer's CublasLinear runs M it has not met (both quantization launch configs, M % 4 in
    0..3) with the bits of the cuBLAS route run unprepared, launching directly after the first
    call of each config; new shapes routed to cuBLAS run it without a plan."""
    from fp8linear.ops import router
    from fp8linear.ops.cublas_gemm import cublas_device_ok
    from fp8linear.ops.linear import run_linear_route
    from fp8linear.ops.router import Route

    if not cublas_device_ok(torch.device("cuda")):
        pytest.skip("cuBLAS blockwise FP8 needs Hopper, CUDA >= 12.9 and torch >= 2.11")
    torch.manual_seed(0)
    layer = Fp8BlockLinear.from_linear(nn.Linear(512, 4096, device="cuda", dtype=torch.bfloat16))
    runner = layer._cublas_runner(layer.weight_scale_inv, "block")
    for m in (1, 2, 3, 4, 5, 77, 1024, 2049, 4097, 4100, 6):
        x = torch.randn(2, m, 512, device="cuda", dtype=torch.bfloat16)
        y = runner(x)
        ref = run_linear_route(Route("cublas"), x.flatten(0, 1), layer.weight, layer.weight_scale_inv, "block",
                               layer.bias)
        assert y.shape == (2, m, 4096) and same_bits(y, ref.view_as(y))
    assert len(runner.quant_calls) == 2 and all(c.direct for c in runner.quant_calls.values())
    layer.clear_plans()
    monkeypatch.setattr(router, "route_linear", lambda *a, **kw: Route("cublas"))
    for m in range(2049, 2053):  # the whole-sequence projection of a growing cache: routed, no plans
        x = torch.randn(1, m, 512, device="cuda", dtype=torch.bfloat16)
        y = layer(x)
        ref = run_linear_route(Route("cublas"), x.flatten(0, 1), layer.weight, layer.weight_scale_inv, "block",
                               layer.bias)
        assert same_bits(y, ref.view_as(y))
    assert not layer._plans and layer._cublas_linear is not None
    from fp8linear.ops.cublas_gemm import CublasConfig

    # a table entry's workspace limit and scale form (1x128 scales: other kernels, other bits), routed and planned
    routes = [Route("cublas", CublasConfig(workspace_mib=32)), Route("cublas", CublasConfig(row_scales=True)),
              Route("cublas", CublasConfig(workspace_mib=32, row_scales=True))]
    for i, route in enumerate(routes):
        layer.clear_plans()
        monkeypatch.setattr(router, "route_linear", lambda *a, route=route, **kw: route)
        x = torch.randn(1, 333 + i, 512, device="cuda", dtype=torch.bfloat16)
        ref = run_linear_route(route, x.flatten(0, 1), layer.weight, layer.weight_scale_inv, "block", layer.bias)
        for _ in range(3):  # first sight (routed), second (planned), third (the plan)
            assert same_bits(layer(x), ref.view(1, 333 + i, 4096))
        assert layer._plans
    assert set(layer._cublas_linear.scales) == {False, True}  # both forms held once used


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 300, 1024])
def test_gpu_layers_back_to_back_and_on_two_streams(m):
    """Planned layers called back to back without synchronising (and on two streams at once) give the
    bits each gives alone: decode-sized, mid-M and cuBLAS routes."""
    torch.manual_seed(m)
    layers = [Fp8BlockLinear.from_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
              for n, k in ((2112, 7168), (7168, 2048), (576, 7168))]
    xs = {(i, j): torch.randn(m, layer.in_features, device="cuda", dtype=torch.bfloat16)
          for i, layer in enumerate(layers) for j in range(3)}
    alone = {}
    for (i, j), x in xs.items():
        for _ in range(3):  # routed, planned, then from the plan
            y = layers[i](x)
        torch.cuda.synchronize()
        alone[(i, j)] = y.clone()
    for _ in range(2):
        out = {key: layers[key[0]](x) for key, x in xs.items()}
        assert all(same_bits(out[key], alone[key]) for key in xs)
    # a layer's split-K counters are its own: the other stream runs copies of the layers
    copies = [copy.deepcopy(layer) for layer in layers]
    for key, x in xs.items():
        for _ in range(3):
            copies[key[0]](x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out_main, out_side = {}, {}
    with torch.cuda.stream(side):
        for key, x in xs.items():
            out_side[key] = copies[key[0]](x)
    for key, x in xs.items():
        out_main[key] = layers[key[0]](x)
    torch.cuda.synchronize()
    assert all(same_bits(out_main[key], alone[key]) and same_bits(out_side[key], alone[key]) for key in xs)


def test_a_cutlass_plan_serves_capture_when_the_routes_differ_in_pdl_only():
    """An eager CUTLASS route with PDL and the capture route without it share one plan (the plan
    launches plain under capture); any other difference makes a second plan."""
    from fp8linear.ops.cutlass_gemm import CutlassConfig
    from fp8linear.ops.linear import serves_capture
    from fp8linear.ops.router import Route

    p64, c128 = CutlassConfig(64), CutlassConfig(128)
    assert serves_capture(Route("cutlass", p64, pdl=True), Route("cutlass", p64))
    assert serves_capture(Route("cutlass", p64), Route("cutlass", p64))
    assert not serves_capture(Route("cutlass", p64, pdl=True), Route("cutlass", c128))
    assert not serves_capture(Route("cutlass", p64, pdl=True), Route("cublas"))
    split = Route("splitk", None, pdl=True, release_early=True)
    assert not serves_capture(split, Route("splitk"))  # a Triton kernel's PDL is in its launch
