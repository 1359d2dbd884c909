"""cuBLAS blockwise dispatch (backend "auto", Hopper): the rules on CPU, the numbers on the GPU.

The cuBLAS-layout activation quantization is a Triton kernel and runs in the interpreter here;
torch._scaled_mm's blockwise path needs an H100/H200, so those tests skip elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from fp8linear import Fp8BlockLinear, block_fp8_matmul, fp8_linear, quantize_activation, quantize_weight
from fp8linear.ops.router import cublas_allowed
from fp8linear.ops import HAS_TRITON
from fp8linear.reference import AMAX_FLOOR, quantize_activation_ref

from _utils import GEMM_TOL, capture_graph, rel_err, same_bits
from conftest import HAS_CUDA, KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

HOPPER_CUBLAS = False
if HAS_CUDA and HAS_TRITON:
    from fp8linear.ops.cublas_gemm import cublas_device_ok

    HOPPER_CUBLAS = cublas_device_ok(torch.device("cuda"))
needs_hopper = pytest.mark.skipif(not HOPPER_CUBLAS, reason="needs cuBLAS blockwise FP8 (Hopper, torch >= 2.11)")


@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (8, 256), (130, 576)])
def test_act_quant_cublas_layout(m, k):
    """M padded to a multiple of 4 with zero rows, scales M-major; real rows bit-exact with the reference."""
    from fp8linear.ops.quant import act_quant, cublas_rows

    x = torch.randn(m, k, device=KERNEL_DEVICE, dtype=torch.bfloat16) * 5
    x_q, x_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
    mp, groups = cublas_rows(m), -(-k // 128)
    assert mp % 4 == 0 and mp - m < 4
    assert x_q.shape == (mp, k) and x_s.shape == (mp, groups) and x_s.stride() == (1, mp)
    r_q, r_s = quantize_activation_ref(x, torch.float8_e4m3fn)
    assert same_bits(x_q[:m], r_q) and same_bits(x_s[:m].contiguous(), r_s)
    assert (x_q[m:].float() == 0).all()
    assert torch.equal(x_s[m:], torch.full_like(x_s[m:], AMAX_FLOOR / 448.0))


@pytest.mark.parametrize("m,k", [(1, 128), (2, 300), (3, 576), (77, 1000), (18, 2048)])
@pytest.mark.parametrize("scale_layout", ["row-major", "m-major"])
def test_pad_rows_for_cublas(m, k, scale_layout):
    """Quantized activations of M % 4 != 0 rows (given to block_fp8_matmul already quantized) go to
    cuBLAS on a copy with M rounded up to 4: real rows and scales copied bit for bit, scales M-major,
    padding rows zero with scale 1."""
    from fp8linear.ops.cublas_gemm import _pad_rows

    x = torch.randn(m, k, device=KERNEL_DEVICE, dtype=torch.bfloat16) * 5
    x_q, x_s = quantize_activation(x, backend="triton")
    if scale_layout == "m-major":
        x_s = x_s.t().contiguous().t()
    x_p, s_p = _pad_rows(x_q, x_s)
    rows, groups = -(-m // 4) * 4, -(-k // 128)
    assert x_p.shape == (rows, k) and x_p.is_contiguous() and x_p.dtype == x_q.dtype
    assert s_p.shape == (rows, groups) and s_p.stride() == (1, rows)
    assert same_bits(x_p[:m], x_q) and same_bits(s_p[:m].contiguous(), x_s.contiguous())
    assert (x_p[m:].float() == 0).all() and (s_p[m:] == 1).all()


@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (77, 1000), (333, 256)])
def test_padded_rows_view_of_the_cublas_layout(m, k):
    """The first M rows of act_quant's cuBLAS layout (M rounded up to 4) are read as the whole padded
    layout, no copy; anything else (x_q without padding rows in its storage, row-major or other
    leading-dimension scales) is refused, so it gets the padded copy."""
    from fp8linear.ops.cublas_gemm import padded_rows_view

    rows, groups = -(-m // 4) * 4, -(-k // 128)
    buf_q = torch.zeros(rows, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    buf_s = torch.empty_strided((rows, groups), (1, rows), dtype=torch.float32)
    x_q, x_s = buf_q[:m], buf_s[:m]
    if m % 4:
        v_q, v_s = padded_rows_view(x_q, x_s)
        assert v_q.shape == (rows, k) and v_q.data_ptr() == buf_q.data_ptr() and v_q.stride() == (k, 1)
        assert v_s.shape == (rows, groups) and v_s.data_ptr() == buf_s.data_ptr() and v_s.stride() == (1, rows)
    assert padded_rows_view(x_q.clone(), x_s) is None or m % 4 == 0  # no padding rows in its storage
    assert padded_rows_view(x_q, x_s.contiguous()) is None or groups == 1  # row-major scales
    m_major = torch.empty_strided((m, groups), (1, m), dtype=torch.float32)  # leading dimension M
    assert padded_rows_view(x_q, m_major) is None or m % 4 == 0
    assert padded_rows_view(buf_q[1:m], buf_s[1:m]) is None  # scales start past the layout's


def test_pad_rows_refuses_fewer_rows():
    from fp8linear.ops.cublas_pad import pad_rows

    x_q, x_s = quantize_activation(torch.randn(6, 256, device=KERNEL_DEVICE), backend="triton")
    with pytest.raises(ValueError, match="rows >= M = 6"):
        pad_rows(x_q, x_s, 4)


@pytest.mark.parametrize("n", [300, 512])
@pytest.mark.parametrize("k", [256, 576, 1408, 2048])
def test_cublas_weight_scale_layouts(n, k):
    """128x128 grid: (K/128, N/128) values, rows padded to a multiple of 4 in memory; 1x128 form:
    each block scale over its 128 rows; torch._scaled_mm (not direct) reads the 1x128 form where the
    grid would need padding."""
    from fp8linear.ops.cublas_gemm import cublas_row_scales, cublas_weight_scale

    w_q, w_s = quantize_weight(torch.randn(n, k), "block")
    groups = w_s.shape[1]
    grid = cublas_weight_scale(w_q, w_s, "block", False)
    assert torch.equal(grid, w_s.t())
    assert grid.stride() == (1, -(-groups // 4) * 4)  # cuBLAS reads each block row 16-byte aligned
    rows = cublas_weight_scale(w_q, w_s, "block", True)
    assert rows.is_contiguous() and torch.equal(rows, w_s.t().repeat_interleave(128, dim=1)[:, :n])
    unaligned = groups % 4 != 0
    assert cublas_row_scales(w_q, "block", direct=False) is unaligned
    assert cublas_row_scales(w_q, "block") is False
    torch_form = cublas_weight_scale(w_q, w_s, "block", cublas_row_scales(w_q, "block", direct=False))
    assert torch.equal(torch_form, rows if unaligned else grid)
    w_q_r, w_s_r = quantize_weight(torch.randn(n, k), "row")
    assert cublas_row_scales(w_q_r, "row") is True
    assert torch.equal(cublas_weight_scale(w_q_r, w_s_r, "row", True), w_s_r.t())


def test_cublas_config_row_form():
    from fp8linear.ops.cublas_gemm import CublasConfig, cublas_row_scales

    w_q, _ = quantize_weight(torch.randn(256, 512), "block")
    assert cublas_row_scales(w_q, "block", CublasConfig(row_scales=True)) is True
    assert cublas_row_scales(w_q, "block", CublasConfig(workspace_mib=32)) is False
    with pytest.raises(TypeError, match="row_scales must be a bool, got 'yes'"):
        CublasConfig(row_scales="yes")


@pytest.mark.parametrize("n,k", [(576, 1408), (300, 2048)])
def test_cublas_held_scale_must_be_the_forms_layout(n, k):
    """A held weight scale (scale_b) is cublas_weight_scale's tensor for the route's form: another form,
    the 128x128 grid unpadded where cuBLAS needs its rows padded, or a 1x128 scale K-major is refused
    with what was expected, before any GPU work."""
    from fp8linear.ops.cublas_gemm import CublasConfig, cublas_fp8_gemm, cublas_weight_scale

    w_q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    x_q, x_s = torch.zeros(4, k, dtype=torch.float8_e4m3fn), torch.ones(4, -(-k // 128))
    w_s = torch.rand(-(-n // 128), -(-k // 128))
    grid, rows = cublas_weight_scale(w_q, w_s, "block", False), cublas_weight_scale(w_q, w_s, "block", True)
    bad = [(rows, None), (grid, CublasConfig(row_scales=True)), (rows.t().contiguous().t(), CublasConfig(row_scales=True)),
           (rows.double(), CublasConfig(row_scales=True))]
    if k == 1408:  # 11 groups: cuBLAS reads the grid's rows 12 apart
        bad.append((w_s.t(), None))
    for scale_b, config in bad:
        with pytest.raises(ValueError, match="scale_b must be this block weight's cuBLAS scale"):
            cublas_fp8_gemm(x_q, x_s, w_q, w_s, "block", None, config, scale_b=scale_b)
    r_s = torch.rand(n, -(-k // 128))
    with pytest.raises(ValueError, match="in the 1x128 form"):
        cublas_fp8_gemm(x_q, x_s, w_q, r_s, "row", None, None, scale_b=r_s)


@pytest.mark.parametrize("gran,n,k,as_rows", [("block", 576, 1408, True), ("block", 576, 1408, False),
                                               ("block", 300, 2048, True), ("row", 300, 2048, True)])
def test_held_weight_scale_made_once_and_remade_when_the_scale_changes(gran, n, k, as_rows):
    """The cuBLAS layout that needs a copy (the 1x128 form of 128x128 weights, a padded grid, a
    K-major 1x128 scale) is made once per scale tensor and form, remade after an in-place change of
    the scale or a new storage, and pickles as nothing (a cache, not data)."""
    import io

    from fp8linear.ops.cublas_gemm import _HELD_ATTR, cublas_weight_scale, held_weight_scale

    w_q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    groups = -(-k // 128)
    w_s = torch.rand(-(-n // 128), groups) if gran == "block" else torch.rand(n, groups)
    first = held_weight_scale(w_q, w_s, gran, as_rows)
    assert torch.equal(first, cublas_weight_scale(w_q, w_s, gran, as_rows))
    assert held_weight_scale(w_q, w_s, gran, as_rows) is first
    w_s.mul_(2.0)
    again = held_weight_scale(w_q, w_s, gran, as_rows)
    assert again is not first and torch.equal(again, cublas_weight_scale(w_q, w_s, gran, as_rows))
    w_s.data = w_s.data.clone() + 1.0  # new storage (the version counter may not move)
    assert torch.equal(held_weight_scale(w_q, w_s, gran, as_rows), cublas_weight_scale(w_q, w_s, gran, as_rows))
    buf = io.BytesIO()
    torch.save(w_s, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert len(getattr(loaded, _HELD_ATTR, {})) == 0 and torch.equal(loaded, w_s)
    assert torch.equal(held_weight_scale(w_q, loaded, gran, as_rows), cublas_weight_scale(w_q, loaded, gran, as_rows))
    with torch.inference_mode():
        inf = w_s.clone()
    assert torch.equal(held_weight_scale(w_q, inf, gran, as_rows), cublas_weight_scale(w_q, inf, gran, as_rows))


def test_held_weight_scale_keeps_nothing_for_views():
    """Where cuBLAS's layout is a view of the scale (an N-major 1x128 scale, an unpadded 128x128 grid)
    nothing is made or kept."""
    from fp8linear.ops.cublas_gemm import _HELD_ATTR, held_weight_scale

    w_q = torch.zeros(512, 2048, dtype=torch.float8_e4m3fn)
    grid = torch.rand(4, 16)
    rows = torch.rand(512, 16).t().contiguous().t()
    for w_s, gran in ((grid, "block"), (rows, "row")):
        held = held_weight_scale(w_q, w_s, gran, gran == "row")
        assert held.data_ptr() == w_s.data_ptr() and not hasattr(w_s, _HELD_ATTR)
    strided = torch.rand(32, 1024).t()[::2]  # (512, 32) with stride (1, 32): N-major but not dense
    w_16 = torch.zeros(512, 32 * 128, dtype=torch.float8_e4m3fn)
    held = held_weight_scale(w_16, strided, "row", True)
    assert held.is_contiguous() and torch.equal(held, strided.t())


@pytest.mark.parametrize("bad", [-1, 1.5, True, "384", 322])
def test_cublas_config_algo_rows(bad):
    from fp8linear.ops.cublas_gemm import CublasConfig, algo_rows

    assert algo_rows(None) == 0 and algo_rows(CublasConfig()) == 0 and algo_rows(CublasConfig(algo_m=384)) == 384
    with pytest.raises(ValueError, match=f"algo_m must be an int >= 0 and a multiple of 4 .*, got {bad!r}"):
        CublasConfig(algo_m=bad)


@pytest.mark.parametrize(
    "n,k,gran,fp8,out,bias,ok",
    [
        (7168, 2048, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),
        (1536, 7168, "row", torch.float8_e4m3fn, torch.bfloat16, None, True),
        (1536, 7168, "block", torch.float8_e4m3fn, torch.bfloat16, torch.bfloat16, True),
        (576, 7168, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),
        (7168, 2304, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),  # K/128 = 18: padded grid
        (4096, 1152, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),  # K/128 = 9: padded grid
        (7168, 640, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),  # K/128 = 5: padded grid
        (1536, 576, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),
        (7168, 256, "block", torch.float8_e4m3fn, torch.bfloat16, None, True),
        (7168, 128, "block", torch.float8_e4m3fn, torch.bfloat16, None, False),  # one K group: ours
        (7168, 2304, "row", torch.float8_e4m3fn, torch.bfloat16, None, True),  # row scales are fine
        (300, 2048, "block", torch.float8_e4m3fn, torch.bfloat16, None, False),  # N % 16
        (512, 300, "row", torch.float8_e4m3fn, torch.bfloat16, None, False),  # K % 16
        (512, 512, "tensor", torch.float8_e4m3fn, torch.bfloat16, None, False),
        (512, 512, "block", torch.float8_e4m3fnuz, torch.bfloat16, None, False),
        (512, 512, "block", torch.float8_e4m3fn, torch.float16, None, False),
        (512, 512, "block", torch.float8_e4m3fn, torch.bfloat16, torch.float32, False),
    ],
)
def test_cublas_accepts(n, k, gran, fp8, out, bias, ok):
    from fp8linear.ops.cublas_gemm import cublas_accepts

    b = None if bias is None else torch.zeros(n, dtype=bias)
    assert cublas_accepts(n, k, gran, fp8, out, b) is ok


def test_cublas_only_under_auto(monkeypatch):
    from fp8linear.ops.cublas_gemm import cublas_device_ok

    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    assert cublas_allowed(None) and cublas_allowed("auto") and cublas_allowed("AUTO")
    assert not cublas_allowed("triton") and not cublas_allowed("reference")
    monkeypatch.setenv("FP8LINEAR_BACKEND", "triton")
    assert not cublas_allowed(None) and cublas_allowed("auto")
    assert not cublas_device_ok(torch.device("cpu"))


@pytest.mark.skipif(HOPPER_CUBLAS, reason="the path without cuBLAS blockwise (no Hopper GPU)")
def test_cpu_auto_path_never_reaches_cublas(monkeypatch):
    """On the interpreter the "auto" flag reaches the launcher, which must keep our kernels."""
    from fp8linear.ops import linear

    monkeypatch.setattr(linear, "cublas_fp8_gemm", lambda *a: pytest.fail("cuBLAS called without a Hopper GPU"))
    x = torch.randn(130, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(64, 256, device=KERNEL_DEVICE) / 16, "block")
    y = linear.fp8_linear_tokens(x, w_q, w_s, "block", None, True)
    ref = fp8_linear(x, w_q, w_s, backend="reference")
    assert y.shape == (130, 64) and rel_err(y, ref) < 2 * GEMM_TOL[torch.bfloat16]


@pytest.mark.parametrize("to_cublas", [True, False])
def test_block_fp8_matmul_hands_each_path_its_scale_layout(to_cublas, monkeypatch):
    """M-major x_s reaches the cuBLAS call uncopied (same storage); our kernels get it row-major."""
    from fp8linear.ops import gemm
    from fp8linear.ops.router import Route

    seen: list[torch.Tensor] = []
    real_route = gemm.route_gemm
    monkeypatch.setattr(gemm, "route_gemm", lambda *a: Route("cublas") if to_cublas else real_route(*a))
    monkeypatch.setattr(gemm, "cublas_fp8_gemm", lambda x_q, x_s, *a: (seen.append(x_s), x_q.new_empty(0))[1])
    kernel = gemm._block_fp8_gemm_kernel

    class TiledKernelSpy:  # kernel[grid](x_q, x_s, ...): record x_s, then launch the real kernel
        def __getitem__(self, grid):
            return lambda **kw: (seen.append(kw["xs_ptr"]), kernel[grid](**kw))[1]

    monkeypatch.setattr(gemm, "_block_fp8_gemm_kernel", TiledKernelSpy())
    x_q, x_s = quantize_activation(torch.randn(8, 300, device=KERNEL_DEVICE), backend="triton")
    w_q, w_s = quantize_weight(torch.randn(64, 300, device=KERNEL_DEVICE), "block")  # short K: tiled kernel
    x_s_mm = x_s.t().contiguous().t()
    # the cuBLAS rule is patched, so the backend name only has to pick the Triton launchers over the reference
    y = block_fp8_matmul(x_q, x_s_mm, w_q, w_s, torch.float32, backend="triton")
    assert len(seen) == 1
    if to_cublas:
        assert seen[0].data_ptr() == x_s_mm.data_ptr() and seen[0].stride() == (1, 8)
    else:
        assert seen[0].is_contiguous() and torch.equal(seen[0], x_s)
        assert torch.equal(y, block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, backend="triton"))


# ----------------------------------------------------------------------------- GPU (Hopper)
CUBLAS_CASES = [
    (m, n, k, gran)
    for m, n, k in [(128, 1536, 7168), (130, 2112, 512), (1027, 7168, 2048), (4096, 576, 7168), (257, 4096, 2304),
                    (1030, 2112, 576), (1030, 2112, 1152), (1024, 4000, 2304), (2051, 1536, 576), (1024, 7168, 640)]
    for gran in ("block", "row")
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m,n,k,gran", CUBLAS_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_auto_matches_triton_and_reference(m, n, k, gran, with_bias, monkeypatch):
    """fp8_linear under "auto" (cuBLAS where the router takes it: CUTLASS's entries go to CUTLASS where
    its library is built) vs our kernels vs float64, and the path taken."""
    from fp8linear.ops import linear
    from fp8linear.ops.router import route_linear, tma_ok

    taken: list[bool] = []
    orig = linear.cublas_fp8_gemm
    monkeypatch.setattr(linear, "cublas_fp8_gemm", lambda *a: (taken.append(True), orig(*a))[1])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 2
    w_q, w_s = quantize_weight(torch.randn(n, k, device="cuda") / k**0.5, gran)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    y = fp8_linear(x, w_q, w_s, bias)
    y_triton = fp8_linear(x, w_q, w_s, bias, backend="triton")
    x_q, x_s = quantize_activation_ref(x, w_q.dtype)
    ref = block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias, backend="reference").double()
    expected = route_linear(x.device, m, n, k, gran, w_q.dtype, x.dtype, bias, True, tma_ok(w_q),
                            weight_contiguous=w_q.is_contiguous() and w_s.is_contiguous()).kernel == "cublas"
    assert taken == ([True] if expected else [])
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert rel_err(y, ref) < GEMM_TOL[torch.bfloat16] and rel_err(y_triton, ref) < GEMM_TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("gran", ["block", "row"])
def test_gpu_block_fp8_matmul_auto_uses_cublas(gran, monkeypatch):
    """block_fp8_matmul takes row-major activation scales (the cuBLAS path transposes them) and M-major ones."""
    from fp8linear.ops import gemm

    taken: list[bool] = []
    orig = gemm.cublas_fp8_gemm
    monkeypatch.setattr(gemm, "cublas_fp8_gemm", lambda *a: (taken.append(True), orig(*a))[1])
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(4096, 2048, device="cuda") / 45, gran)
    x_q, x_s = quantize_activation(x)
    y = block_fp8_matmul(x_q, x_s, w_q, w_s)
    y_t = block_fp8_matmul(x_q, x_s, w_q, w_s, backend="triton")
    assert taken == [True]
    assert torch.equal(block_fp8_matmul(x_q, x_s.t().contiguous().t(), w_q, w_s), y)
    ref = block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, backend="reference").double()
    assert rel_err(y, ref) < GEMM_TOL[torch.bfloat16] and rel_err(y_t, ref) < GEMM_TOL[torch.bfloat16]


ROW_FORM_CASES = [(77, 2048, 1408), (128, 512, 3584), (333, 576, 2112), (1030, 7168, 640), (4, 1536, 576),
                  (512, 4096, 2304), (2048, 1536, 7168)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m,n,k", ROW_FORM_CASES)
@pytest.mark.parametrize("form", ["block-1M", "row-1M", "row-32M", "block-32M-algo", "row-32M-algo"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_cublas_scale_forms_match_reference_and_each_path(m, n, k, form, with_bias):
    """128x128 weights on cuBLAS as the (padded) 128x128 grid or as 1x128 scales, with the heuristic's
    algorithm for M or (-algo) the one it picks for more rows: functional path, the layer's
    CublasLinear (cuBLASLt and torch._scaled_mm) against the float64 reference; the functional path
    (with the scale made per call, or held as the tuner hands it) and the layer's cuBLASLt give the
    same bits."""
    from fp8linear.ops.cublas_gemm import CublasConfig, cublas_fp8_gemm, cublas_row_scales, cublas_weight_scale
    from fp8linear.ops.cublaslt import _destroy_plan
    from fp8linear.ops.linear import CublasLinear
    from fp8linear.ops.quant import cublas_rows

    config = CublasConfig(workspace_mib=1 if "-1M" in form else 32, row_scales=form.startswith("row"),
                          algo_m=cublas_rows(m) + 128 if form.endswith("algo") else 0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(n, k, device="cuda") / k**0.5, "block")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    x_q, x_s = quantize_activation(x)
    ref = block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias, backend="reference").double()
    y = cublas_fp8_gemm(x_q, x_s, w_q, w_s, "block", bias, config)
    held = cublas_weight_scale(w_q, w_s, "block", cublas_row_scales(w_q, "block", config))
    assert same_bits(cublas_fp8_gemm(x_q, x_s, w_q, w_s, "block", bias, config, scale_b=held), y)
    layer = CublasLinear(w_q, w_s, "block", bias)
    limit, as_rows, algo_m = layer.form(config)
    assert as_rows is config.row_scales and algo_m == config.algo_m
    y_layer = layer(x, limit, as_rows, algo_m)
    y_torch = CublasLinear(w_q, w_s, "block", bias, direct=False)(x, limit, as_rows, algo_m)
    for out in (y, y_layer, y_torch):
        assert out.shape == (m, n) and rel_err(out, ref) < GEMM_TOL[torch.bfloat16]
    lt = layer.lt_for(limit, as_rows)
    if lt is not None:
        assert same_bits(y_layer, y)
    if lt is not None and algo_m:  # the plan kept for (rows, algo_m) runs algo_m's algorithm where cuBLASLt takes it
        rows = cublas_rows(m)
        with lt.lock:
            borrowed = lt.borrowed_plan(rows, algo_m)
            kept, source, own = lt.plan(rows, algo_m), lt.plan(algo_m), lt.plan(rows)
        expected = source if borrowed is not None else own
        assert bytes(kept[2]) == bytes(expected[2])
        if borrowed is not None:
            _destroy_plan(lt.lib, borrowed)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m,n,k", [(77, 2048, 1408), (333, 576, 2112), (5, 1536, 7168)])
def test_gpu_cublas_reads_the_padded_layout_without_a_copy(m, n, k, monkeypatch):
    """Activations quantized into cuBLAS's layout and cut to M rows (M % 4 != 0) go to cuBLAS as they
    are: same bits as the padded copy of the same rows, and no copy made."""
    from fp8linear.ops import cublas_gemm
    from fp8linear.ops.quant import act_quant

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_weight(torch.randn(n, k, device="cuda") / k**0.5, "block")
    xp_q, xp_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
    copied = cublas_gemm.cublas_fp8_gemm(xp_q[:m].clone(), xp_s[:m].contiguous(), w_q, w_s, "block", None)

    def no_copy(*a):
        raise AssertionError("padded copy made")

    monkeypatch.setattr(cublas_gemm, "_pad_rows", no_copy)
    y = cublas_gemm.cublas_fp8_gemm(xp_q[:m], xp_s[:m], w_q, w_s, "block", None)
    assert y.shape == (m, n) and same_bits(y, copied)
    ref = block_fp8_matmul(xp_q[:m], xp_s[:m], w_q, w_s, torch.float32, backend="reference").double()
    assert rel_err(y, ref) < GEMM_TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_hopper
def test_gpu_cublas_path_captures_in_cuda_graph_and_compiles():
    lin = torch.nn.Linear(2048, 4096, bias=True, device="cuda", dtype=torch.bfloat16)
    mod = Fp8BlockLinear.from_linear(lin)
    x = torch.randn(2, 65, 2048, device="cuda", dtype=torch.bfloat16)  # M=130: padded to 132
    eager = mod(x)
    # graphs and torch.compile run the functional route (eager calls may take another kernel: the router's eager cut)
    functional = fp8_linear(x, mod.weight, mod.weight_scale_inv, mod.bias)
    graph, out = capture_graph(mod, x)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, functional)
    compiled = torch.compile(mod, fullgraph=True)
    assert same_bits(compiled(x), functional)
    assert rel_err(eager, functional.double()) < GEMM_TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_hopper
def test_gpu_compiled_layer_holds_its_cublas_scale_form(monkeypatch):
    """A compiled layer whose route runs cuBLAS with the 1x128 form of its 128x128 weight makes that
    form once, on its own scale tensor, not per call; a form made during CUDA-graph capture is not
    kept (its values exist only once the graph replays)."""
    from fp8linear.ops import cublas_gemm, linear
    from fp8linear.ops.cublas_gemm import _HELD_ATTR, CublasConfig, held_weight_scale
    from fp8linear.ops.router import Route

    rows_form = Route("cublas", CublasConfig(workspace_mib=32, row_scales=True))
    monkeypatch.setattr(linear, "route_linear", lambda *a, **kw: rows_form)
    made = []
    make = cublas_gemm.cublas_weight_scale
    monkeypatch.setattr(cublas_gemm, "cublas_weight_scale", lambda *a: made.append(a[3]) or make(*a))
    mod = Fp8BlockLinear.from_linear(torch.nn.Linear(2048, 576, bias=False, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(200, 2048, device="cuda", dtype=torch.bfloat16)
    expect = block_fp8_matmul(*quantize_activation(x), mod.weight, mod.weight_scale_inv, torch.float32,
                              backend="reference").double()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = held_weight_scale(mod.weight, mod.weight_scale_inv, "block", True)
    assert made == [True] and not getattr(mod.weight_scale_inv, _HELD_ATTR, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, make(mod.weight, mod.weight_scale_inv, "block", True))
    made.clear()
    compiled = torch.compile(mod, fullgraph=True)
    ys = [compiled(x) for _ in range(3)]
    assert made == [True] and len(getattr(mod.weight_scale_inv, _HELD_ATTR)) == 1
    assert all(same_bits(y, ys[0]) for y in ys) and rel_err(ys[0], expect) < GEMM_TOL[torch.bfloat16]
