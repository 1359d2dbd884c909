"""The optional CUTLASS backend (fp8linear/ops/cutlass_gemm.py): its rules on CPU, its numbers on a
Hopper GPU where `fp8linear build-cutlass` has built the library (skipped elsewhere)."""

from __future__ import annotations

import contextlib
import ctypes
import types

import pytest
import torch

from fp8linear.ops import cutlass_gemm
from fp8linear.ops.cutlass_gemm import CutlassConfig, cutlass_accepts

from _utils import GEMM_TOL, capture_graph, rel_err, same_bits, spy_cutlass_library_calls
from conftest import HAS_CUDA

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def test_configs_and_variants():
    assert [c.name for c in cutlass_gemm.CUTLASS_CONFIGS] == ["p64x128", "p64x64", "c128x128", "c128x64", "s128x128"]
    assert [c.name for c in cutlass_gemm.CUTLASS_ROW_CONFIGS] == ["p64x128", "c128x128"]
    symbols = [s for s, _ in cutlass_gemm.variants()]
    assert len(set(symbols)) == len(symbols) == 14
    assert {tuple(sorted(m.items())) for _, m in cutlass_gemm.variants()} == {
        (("FP8L_BIAS", b), ("FP8L_ROW", 0), ("FP8L_STREAMK", sk), ("FP8L_TILE_M", t), ("FP8L_TILE_N", w))
        for b in (0, 1) for t, w, sk in ((64, 128, 0), (64, 64, 0), (128, 128, 0), (128, 64, 0), (128, 128, 1))} | {
        (("FP8L_BIAS", b), ("FP8L_ROW", 1), ("FP8L_STREAMK", 0), ("FP8L_TILE_M", t), ("FP8L_TILE_N", 128))
        for b in (0, 1) for t in (64, 128)}
    assert cutlass_gemm.candidates_for("row") == cutlass_gemm.CUTLASS_ROW_CONFIGS
    assert cutlass_gemm.candidates_for("block") == cutlass_gemm.CUTLASS_CANDIDATES
    assert cutlass_gemm.candidates_for("tensor") == ()
    with pytest.raises(ValueError, match="tile_m must be 64 or 128"):
        CutlassConfig(96)
    with pytest.raises(ValueError, match="tile_m must be 128"):
        CutlassConfig(64, stream_k=True)
    with pytest.raises(TypeError, match="stream_k must be a bool"):
        CutlassConfig(128, stream_k=1)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="splits must be an int"):
            CutlassConfig(128, stream_k=True, splits=bad)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="splits must be from 1 to 16"):
            CutlassConfig(128, stream_k=True, splits=bad)
    with pytest.raises(ValueError, match="stream_k must be True"):
        CutlassConfig(128, splits=2)
    for bad in (32, 96, 256, 64.0):
        with pytest.raises(ValueError, match="tile_n must be 64 or 128"):
            CutlassConfig(64, tile_n=bad)
    assert CutlassConfig(128, tile_n=128).name == "c128x128"
    with pytest.raises(ValueError, match="tile_n 64 runs the ping-pong or cooperative kernel: stream_k must be False"):
        CutlassConfig(128, stream_k=True, tile_n=64)
    wide = CutlassConfig(128, tile_n=64)
    assert wide.name == "c128x64" and wide.kernel == wide and wide != CutlassConfig(128)
    with pytest.raises(TypeError, match="stream_k must be a bool"):
        CutlassConfig(64, stream_k=1, tile_n=64)
    narrow = CutlassConfig(64, tile_n=64)
    assert narrow.name == "p64x64" and narrow.kernel == narrow and narrow != CutlassConfig(64)
    split = CutlassConfig(128, stream_k=True, splits=3)
    assert split.name == "k3_128x128" and split.kernel == CutlassConfig(128, stream_k=True)
    assert CutlassConfig(64).kernel == CutlassConfig(64)
    assert set(cutlass_gemm.CUTLASS_CONFIGS) <= set(cutlass_gemm.CUTLASS_CANDIDATES)
    assert {c.kernel for c in cutlass_gemm.CUTLASS_CANDIDATES} == set(cutlass_gemm.CUTLASS_CONFIGS)


@pytest.mark.parametrize("n,k,gran,fp8,out,bias,ok", [
    (576, 7168, "block", FP8, BF16, None, True),
    (2112, 576, "block", FP8, BF16, torch.zeros(2112, dtype=BF16), True),
    (576, 7168, "row", FP8, BF16, None, True),  # 1x128 weights: their own kernels
    (576, 7168, "tensor", FP8, BF16, None, False),
    (576, 7168, "block", torch.float8_e4m3fnuz, BF16, None, False),
    (576, 7168, "block", FP8, torch.float16, None, False),
    (576, 300, "block", FP8, BF16, None, False),  # K % 16: TMA rows
    (300, 576, "block", FP8, BF16, None, False),  # N % 8: the TMA store
    (576, 576, "block", FP8, BF16, torch.zeros(576, dtype=torch.float32), False),
    (576, 576, "block", FP8, BF16, torch.zeros(1152, dtype=BF16)[::2], False),
])
def test_cutlass_accepts(n, k, gran, fp8, out, bias, ok):
    assert cutlass_accepts(n, k, gran, fp8, out, bias) is ok


def test_library_path_follows_the_source_and_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8LINEAR_CACHE_DIR", str(tmp_path / "cache"))
    path = cutlass_gemm.library_path()
    assert path.parent.parent == tmp_path / "cache" / "cutlass" and path.name == "libfp8linear_cutlass.so"
    src = tmp_path / "edited.cu"
    src.write_bytes(cutlass_gemm.SOURCE.read_bytes() + b"// edited\n")
    monkeypatch.setattr(cutlass_gemm, "SOURCE", src)
    assert cutlass_gemm.library_path() != path  # a new source builds a new library
    monkeypatch.delenv("FP8LINEAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cutlass_gemm.library_path().parents[2] == tmp_path / "xdg" / "fp8linear"


def test_not_built_means_not_available(tmp_path, monkeypatch):
    """Without a built library nothing routes to CUTLASS, and a direct call says how to build it."""
    monkeypatch.setenv("FP8LINEAR_CACHE_DIR", str(tmp_path))
    cutlass_gemm._library.cache_clear()
    cutlass_gemm._device_ok.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    try:
        assert cutlass_gemm._library() is None
        assert not cutlass_gemm._device_ok(0)  # an sm_90 GPU, but nothing built
        x = torch.zeros(4, 128, dtype=torch.uint8).view(FP8)
        with pytest.raises(RuntimeError, match="build-cutlass"):
            cutlass_gemm.cutlass_fp8_gemm(x, torch.ones(4, 1), x, torch.ones(1, 1), None, CutlassConfig(64))
    finally:
        cutlass_gemm._library.cache_clear()
        cutlass_gemm._device_ok.cache_clear()


class _FakeLibrary:
    def __init__(self, probe_rc):
        self.probe = {(cfg, b, g): (lambda rc=probe_rc: rc) for g in ("block", "row")
                      for cfg in cutlass_gemm.configs_for(g) for b in (False, True)}


class _FakeEntryPoints:
    """A library whose entry points answer without a GPU: the workspace size asked is recorded."""

    def __init__(self):
        self.asked = []
        keys = [(c, b, g) for g in ("block", "row") for c in cutlass_gemm.configs_for(g) for b in (False, True)]
        self.run = {key: None for key in keys}
        self.workspace = {key: (lambda *a, key=key: self.asked.append((key, a)) or 0) for key in keys}
        # prepared GEMMs: the C side gives none for stream-K kernels (nullptr: None through ctypes)
        self.prepared, self.launched, self.released = [], [], []
        self.prepare = {key: (lambda *a, key=key: self.prepared.append((key, a))
                              or (None if key[0].stream_k else 4096 + len(self.prepared))) for key in keys}
        self.run_prepared = {key: (lambda *a: self.launched.append(a) or 0) for key in keys}
        self.quantized, self.quant_rc = [], 0
        self.quant_run_prepared = {key: (lambda *a: self.quantized.append(a) or self.quant_rc) for key in keys}
        self.quant_run_prepared_pdl = {key: (lambda *a: self.quantized.append(("pdl", *a)) or self.quant_rc)
                                       for key in keys}
        self.pdl = {key: not key[0].stream_k for key in keys}  # a build with the cooperative header's wait
        self.release = {key: self.released.append for key in keys}


def test_cutlass_call_checks_its_inputs(monkeypatch):
    """CutlassCall refuses what its C entry point cannot take with a clear error, and asks the
    workspace of the built kernel a split-K config runs on, with its parts."""
    fake = _FakeEntryPoints()
    monkeypatch.setattr(cutlass_gemm, "_library", lambda: fake)
    monkeypatch.setattr(cutlass_gemm, "sm_count", lambda device: 132)
    w = torch.zeros(256, 512, dtype=torch.uint8).view(FP8)
    w_s = torch.ones(2, 4)
    cfg = CutlassConfig(128, stream_k=True, splits=3)
    with pytest.raises(ValueError, match="CUDA e4m3fn weights"):  # the CPU: no CUDA weight
        cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    call = cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg)
    assert fake.asked == [((cfg.kernel, False, "block"), (8, 256, 512, 0, 132, 3))]
    assert call.args[1][-1] == 3 and call.workspace_bytes == 0
    with pytest.raises(TypeError, match="takes a CutlassConfig"):
        cutlass_gemm.CutlassCall(w, w_s, None, 8, "k3")
    for m in (0, 8.0, -1):
        with pytest.raises(ValueError, match="row count M >= 1"):
            cutlass_gemm.CutlassCall(w, w_s, None, m, cfg)
    with pytest.raises(ValueError, match="fp32 weight scale"):
        cutlass_gemm.CutlassCall(w, torch.ones(2, 3), None, 8, cfg)
    with pytest.raises(ValueError, match="w_s contiguous"):
        cutlass_gemm.CutlassCall(w, torch.ones(4, 2).t(), None, 8, cfg)
    with pytest.raises(ValueError, match="2-D weight"):
        cutlass_gemm.CutlassCall(w[None], w_s, None, 8, cfg)
    # 1x128 weights: their own kernels (no stream-K), a (N, K/128) scale read N-major
    with pytest.raises(ValueError, match="no CUTLASS kernel s128x128 is built for 'row' weights"):
        cutlass_gemm.CutlassCall(w, torch.ones(256, 4), None, 8, CutlassConfig(128, stream_k=True), "row")
    with pytest.raises(ValueError, match=r"\(256, 4\) fp32 weight scale for row weight"):
        cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(128), "row")
    n_major = torch.rand(4, 256).t()  # (N, K/128), stride (1, N): read as is
    row = cutlass_gemm.CutlassCall(w, n_major, None, 8, CutlassConfig(64), "row")
    assert fake.asked[-1][0] == (CutlassConfig(64), False, "row") and row.args[0][1] == n_major.data_ptr()
    from fp8linear.ops import cublas_gemm  # the fake CUDA tensors are CPU ones: no stream, no capture

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cublas_gemm, "_made_outside_pools", lambda make, device: make())
    k_major = n_major.contiguous()  # the checkpoint layout: an N-major copy, made once and kept on it
    row = cutlass_gemm.CutlassCall(w, k_major, None, 8, CutlassConfig(64), "row")
    again = cutlass_gemm.CutlassCall(w, k_major, None, 8, CutlassConfig(128), "row")
    assert row.args[0][1] == again.args[0][1] != k_major.data_ptr()
    held = row.held[1]
    assert held.shape == (4, 256) and held.is_contiguous() and torch.equal(held.t(), k_major)


@pytest.fixture
def fake_gpu(monkeypatch):
    """(fake entry points, a 256x512 e4m3fn weight, its scales): CPU tensors that say they are on
    GPU 0 of one, 132 SMs, current stream 77."""
    fake = _FakeEntryPoints()
    monkeypatch.setattr(cutlass_gemm, "_library", lambda: fake)
    monkeypatch.setattr(cutlass_gemm, "sm_count", lambda device: 132)
    monkeypatch.setattr(cutlass_gemm, "_several_gpus", lambda: False)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    from fp8linear.ops import cublas_gemm  # scales kept on the weight's scale: no stream, no capture here

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cublas_gemm, "_made_outside_pools", lambda make, device: make())
    return fake, torch.zeros(256, 512, dtype=torch.uint8).view(FP8), torch.ones(2, 4)


@pytest.mark.parametrize("n", [64, 128, 300, 576, 640])
def test_narrow_block_scale_repeats_each_block_per_64_rows(n):
    """The 64-wide tiles' weight scale: row j holds the 128x128 grid's row j // 2, ceil(N/64) rows,
    contiguous fp32 (a 300-row weight: 5 rows from a 3-row grid)."""
    k_groups = 3
    grid = torch.arange(-(-n // 128) * k_groups, dtype=torch.float32).view(-1, k_groups) + 0.5
    narrow = cutlass_gemm.narrow_block_scale(grid.t().contiguous().t(), n, 64)  # a strided grid too
    assert narrow.shape == (-(-n // 64), k_groups) and narrow.is_contiguous() and narrow.dtype == torch.float32
    for j in range(narrow.shape[0]):
        assert torch.equal(narrow[j], grid[j // 2])
    with pytest.raises(ValueError, match=r"takes the \(ceil\(N/128\), K/128\) grid of an N=300 weight"):
        cutlass_gemm.narrow_block_scale(torch.ones(2, 3), 300, 64)
    with pytest.raises(ValueError, match=r"tile_n must be 32 or 64 \(dividing 128, narrower\), got 128"):
        cutlass_gemm.narrow_block_scale(grid, n, 128)


def test_cutlass_call_prepares_data_parallel_kernels(fake_gpu):
    """A data-parallel config's parameters are prepared once, with the weight's addresses, and a call
    passes only the activations', scales' and output's addresses to the prepared launch; stream-K
    configs (no prepared GEMM from the C side) run the per-call entry point. Released with the call."""
    fake, w, w_s = fake_gpu
    call = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(128))
    assert fake.prepared == [((CutlassConfig(128), False, "block"),
                              (w.data_ptr(), w_s.data_ptr(), None, 8, 256, 512, 0, 132))]
    assert call.prepared == 4097
    call(11, 22, 33, None)
    assert fake.launched == [(4097, 11, 22, 33, 0, 77)]
    del call
    assert fake.released == [4097]
    streamk = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(128, stream_k=True))
    assert streamk.prepared is None
    ran = []
    streamk.run = lambda *a: ran.append(a) or 0
    streamk(11, 22, 33, None)
    assert fake.launched == [(4097, 11, 22, 33, 0, 77)] and ran[0][:2] == (11, 22) and ran[0][-1] == 77
    del streamk
    assert fake.released == [4097]
    once = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(128), prepare=False)  # the functional path's
    assert once.prepared is None and len(fake.prepared) == 2  # the stream-K call asked, this one did not


def test_the_64_wide_kernel_is_prepared_on_the_narrow_scale(fake_gpu, monkeypatch):
    """A p64x64 call gives the library the weight scale per 64 rows (narrow_block_scale of the
    grid), held by the call and kept on the grid: made once per scale (outside CUDA-graph pools),
    again after an in-place change, and not kept when made during a capture; the 1x128 kernels have
    no 64-wide variant."""
    from fp8linear.ops import cublas_gemm

    fake, w, w_s = fake_gpu
    made = []
    monkeypatch.setattr(cublas_gemm, "_made_outside_pools", lambda make, device: made.append(device) or make())
    w_s = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    cfg = CutlassConfig(64, tile_n=64)
    call = cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg)
    (key, args), = fake.prepared
    narrow = call.held[1]
    assert key == (cfg, False, "block") and args[1] == narrow.data_ptr() != w_s.data_ptr()
    assert torch.equal(narrow, cutlass_gemm.narrow_block_scale(w_s, 256, 64)) and narrow.shape == (4, 4)
    assert made == [torch.device("cuda", 0)]
    again = cutlass_gemm.CutlassCall(w, w_s, None, 16, cfg)
    assert again.held[1] is narrow and len(made) == 1  # kept on w_s
    w_s.mul_(2)  # changed in place: made again
    assert torch.equal(cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg).held[1], narrow * 2) and len(made) == 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    w_s.add_(1)
    captured = cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg).held[1]
    assert torch.equal(captured, narrow * 2 + 1) and len(made) == 2  # made in the capture, not kept
    assert cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg).held[1] is not captured
    with pytest.raises(ValueError, match="no CUTLASS kernel p64x64 is built for 'row' weights"):
        cutlass_gemm.CutlassCall(w, torch.ones(256, 4), None, 8, cfg, "row")


def test_a_prepared_call_quantizes_its_input_in_the_same_host_call(fake_gpu):
    """with_quantization gives a prepared GEMM's one-call form: the prepared parameters, x's address
    and row length (K), the quantized buffers, the output, M, K, the device and the current stream go
    to the C entry point, with `pdl` the one launching the GEMM with PDL (the kernels the library says
    are built for it: pdl_supported); none for unprepared calls; a failed status is an error naming
    the GEMM."""
    fake, w, w_s = fake_gpu
    call = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64))
    fused = call.with_quantization()
    del call  # the fused call keeps the prepared parameters alive
    assert fake.released == []
    fused(10, 11, 12, 13)
    assert fake.quantized == [(4097, 10, 512, 11, 12, 13, 8, 512, 0, 77)] and fake.launched == []
    with_pdl = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64), pdl=True).with_quantization()
    with_pdl(10, 11, 12, 13)
    assert fake.quantized[-1] == ("pdl", 4098, 10, 512, 11, 12, 13, 8, 512, 0, 77)
    del with_pdl
    wide = CutlassConfig(128, tile_n=64)
    assert all(cutlass_gemm.pdl_supported(c) for c in (CutlassConfig(64), CutlassConfig(128), wide))
    for cfg in (CutlassConfig(128), wide):  # a build that did not recognise CUTLASS's cooperative header
        fake.pdl[(cfg, False, "block")] = False
    assert not cutlass_gemm.pdl_supported(CutlassConfig(128))
    assert cutlass_gemm.pdl_supported(CutlassConfig(128), True)
    for cfg in (CutlassConfig(128), wide, CutlassConfig(128, stream_k=True),
                CutlassConfig(128, stream_k=True, splits=2)):
        assert not cutlass_gemm.pdl_supported(cfg)
        with pytest.raises(ValueError, match=rf"{cfg.name} kernel without bias is not built to wait.*without bias: "
                                             r"\['p64x128', 'p64x64'\]"):
            cutlass_gemm.CutlassCall(w, w_s, None, 8, cfg, pdl=True)
    with pytest.raises(TypeError, match="takes a CutlassConfig, got str"):
        cutlass_gemm.pdl_supported("c128x128")
    with pytest.raises(TypeError, match="bias as a bool.*got Tensor"):
        cutlass_gemm.pdl_supported(CutlassConfig(64), torch.zeros(256))
    with pytest.raises(ValueError, match="'block' or 'row'.*'tensor'"):
        cutlass_gemm.pdl_supported(CutlassConfig(64), False, "tensor")
    with_pdl = cutlass_gemm.CutlassCall(w, w_s, torch.zeros(256, dtype=BF16), 8, CutlassConfig(128), pdl=True)
    assert with_pdl.quant_run_prepared is fake.quant_run_prepared_pdl[(CutlassConfig(128), True, "block")]
    del with_pdl
    fake.quantized = fake.quantized[:1]
    fake.released.clear()
    fake.quant_rc = 3001
    with pytest.raises(RuntimeError, match=r"p64x128 GEMM 8x256x512 with its input quantization failed with status 3001"):
        fused(10, 11, 12, 13)
    del fused
    assert fake.released == [4097]
    assert cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(128, stream_k=True)).with_quantization() is None
    assert cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64), prepare=False).with_quantization() is None


@pytest.fixture(scope="module")
def plan_call_cache(tmp_path_factory):
    """A cache folder holding the plan-call module, compiled here for the installed torch (about 10 s);
    skipped where no C++ compiler or no Python headers are found."""
    import sysconfig
    from pathlib import Path

    from fp8linear.tools import cutlass_build

    try:
        cxx = cutlass_build.find_cxx()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers (Python.h) to build an extension module against")
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FP8LINEAR_CACHE_DIR", str(root))
        cutlass_build.build_plan_call(cxx, log=lambda line: None)
    return root


# blockwise_gemm.cu's _quant_run_prepared, for a Python stand-in the C++ call can call
_QUANT_RUN_PREPARED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                                       *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3, ctypes.c_void_p)


def test_an_allocating_call_allocates_and_quantizes_in_one_cpp_call(fake_gpu, plan_call_cache, monkeypatch):
    """allocating_call (the plan-call module, compiled and run on CPU tensors here) returns a new
    output of the plan's shape in x's dtype, after calling the library's entry point once with the
    prepared parameters, x's address and row length, the scratch it allocated (x_q at its start, x_s
    at the offset), the output, M, K, the device and the stream; with `keep` it returns the scratch
    too; a failed status is an error naming the GEMM; it keeps the prepared parameters alive; with
    several GPUs visible it runs the same call under a device guard (x's device: a no-op for these
    CPU tensors); None where nothing is prepared or the module is missing."""
    fake, w, w_s = fake_gpu
    monkeypatch.setenv("FP8LINEAR_CACHE_DIR", str(plan_call_cache))
    monkeypatch.setattr(cutlass_gemm, "_plan_call", cutlass_gemm._plan_call.__wrapped__)  # no cached module
    seen, status = [], [0]

    def entry(*args):
        seen.append(args)
        return status[0]

    c_entry = _QUANT_RUN_PREPARED(entry)
    fake.quant_run_prepared = {key: c_entry for key in fake.quant_run_prepared}
    call = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64))
    run = call.allocating_call((2, 4, 256), 8192, 4096)
    del call
    assert fake.released == []  # held by the call
    x = torch.randn(8, 512, dtype=BF16)
    y = run(x)
    assert y.shape == (2, 4, 256) and y.dtype == BF16 and y.is_contiguous()
    (prepared, x_ptr, stride, q, s, y_ptr, m, k, device, stream), = seen
    assert (prepared, x_ptr, stride, s - q, y_ptr, m, k, device, stream) == (
        4097, x.data_ptr(), 512, 4096, y.data_ptr(), 8, 512, 0, 77)
    y2, scratch = run(x, True)
    assert scratch.dtype == torch.uint8 and scratch.numel() == 8192 and seen[-1][3] == scratch.data_ptr()
    assert seen[-1][5] == y2.data_ptr() != y.data_ptr() and len(seen) == 2
    status[0] = 3002
    with pytest.raises(RuntimeError, match=r"p64x128 GEMM 8x256x512 with its input quantization failed with status 3002"):
        run(x)
    del run
    assert fake.released == [4097]
    with pytest.raises(ValueError, match="16-byte aligned inside the 8192-byte scratch, got 4100"):
        cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64)).allocating_call((8, 256), 8192, 4100)
    assert cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(128, stream_k=True)).allocating_call(
        (8, 256), 8192, 4096) is None
    assert cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64), prepare=False).allocating_call(
        (8, 256), 8192, 4096) is None
    monkeypatch.setattr(cutlass_gemm, "_several_gpus", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    status[0] = 0
    guarded = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64)).allocating_call((8, 256), 8192, 4096)
    y3 = guarded(x)
    assert y3.shape == (8, 256) and seen[-1][5] == y3.data_ptr() and seen[-1][1] == x.data_ptr()
    assert cutlass_gemm.one_call_available()  # several GPUs visible, the module built
    del guarded
    monkeypatch.setattr(cutlass_gemm, "_several_gpus", lambda: False)
    monkeypatch.setenv("FP8LINEAR_CACHE_DIR", str(plan_call_cache / "empty"))  # not built there
    assert cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64)).allocating_call((8, 256), 8192, 4096) is None


@pytest.mark.parametrize("several", [False, True])
def test_an_allocating_call_asks_for_the_device_guard_where_several_gpus_are_visible(fake_gpu, monkeypatch, several):
    """The plan-call module gets `guard` set exactly where several GPUs are visible (it then makes
    x's GPU current for its allocations and launches), with the weight's device index and stream."""
    fake, w, w_s = fake_gpu
    seen = []

    class PreparedRun:
        def __init__(self, *args):
            seen.append(args)

        def __call__(self, *args):
            seen.append(args)
            return "y"

        kept = __call__

    c_entry = _QUANT_RUN_PREPARED(lambda *args: 0)
    fake.quant_run_prepared = {key: c_entry for key in fake.quant_run_prepared}
    monkeypatch.setattr(cutlass_gemm, "_plan_call", lambda: types.SimpleNamespace(PreparedRun=PreparedRun))
    monkeypatch.setattr(cutlass_gemm, "_several_gpus", lambda: several)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    run = cutlass_gemm.CutlassCall(w, w_s, None, 8, CutlassConfig(64)).allocating_call((8, 256), 8192, 4096)
    x = torch.randn(8, 512, dtype=BF16)
    assert run(x) == "y"
    (shape, entry, prepared, nbytes, offset, m, k, device, guard, what), (x_arg, stream) = seen
    assert entry == ctypes.cast(c_entry, ctypes.c_void_p).value and x_arg is x and shape == [8, 256]
    assert (nbytes, offset, m, k, device, stream) == (8192, 4096, 8, 512, 0, 77)
    assert guard is several and prepared == 4097 and "p64x128 GEMM 8x256x512" in what


@pytest.mark.parametrize("capability,env,hip,probe_rc,ok", [
    ((9, 0), None, None, 0, True),
    ((10, 0), None, None, 0, False),  # sm_90a code does not run on Blackwell
    ((8, 0), None, None, 0, False),
    ((9, 0), "0", None, 0, False),  # turned off
    ((9, 0), None, "6.4", 0, False),  # ROCm
    ((9, 0), None, None, 35, False),  # built, but its code does not load (e.g. an nvcc newer than the driver)
])
def test_device_check(monkeypatch, capability, env, hip, probe_rc, ok):
    """CUTLASS runs on an sm_90 GPU where the library's kernels load, unless FP8LINEAR_CUTLASS=0."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.version, "hip", hip)
    if env is None:
        monkeypatch.delenv(cutlass_gemm.CUTLASS_ENV, raising=False)
    else:
        monkeypatch.setenv(cutlass_gemm.CUTLASS_ENV, env)
    monkeypatch.setattr(cutlass_gemm, "_library", lambda: _FakeLibrary(probe_rc))
    cutlass_gemm._device_ok.cache_clear()
    try:
        assert cutlass_gemm._device_ok(0) is ok
    finally:
        cutlass_gemm._device_ok.cache_clear()


def test_unreadable_source_means_no_library(tmp_path, monkeypatch):
    monkeypatch.setattr(cutlass_gemm, "SOURCE", tmp_path / "missing.cu")
    cutlass_gemm._library.cache_clear()
    try:
        assert cutlass_gemm._library() is None
    finally:
        cutlass_gemm._library.cache_clear()


def test_a_broken_library_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8LINEAR_CACHE_DIR", str(tmp_path))
    path = cutlass_gemm.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")
    cutlass_gemm._library.cache_clear()
    try:
        assert cutlass_gemm._library() is None
    finally:
        cutlass_gemm._library.cache_clear()


# ----------------------------------------------------------------------------- GPU
BUILT = HAS_CUDA and cutlass_gemm.cutlass_available(torch.device("cuda"))
needs_cutlass = pytest.mark.skipif(not BUILT, reason="needs an sm_90 GPU and `fp8linear build-cutlass`")


def _operands(m, n, k, bias, gen):
    from fp8linear import quantize_activation, quantize_weight

    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(BF16)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    w_q, w_s = quantize_weight(w, "block", FP8)
    x_q, x_s = quantize_activation(x, fp8_dtype=FP8, backend="triton")
    b = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(BF16) if bias else None
    return x_q, x_s.contiguous(), w_q, w_s.contiguous(), b


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("cfg", cutlass_gemm.CUTLASS_CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 3, 77, 130, 333, 1000])
@pytest.mark.parametrize("n,k", [(576, 2112), (2112, 576), (7168, 2048), (256, 7168), (304, 2304)])
@pytest.mark.parametrize("bias", [False, True])
def test_cutlass_matches_the_float64_reference(cfg, m, n, k, bias):
    """Every config, ragged N and K (K/128 not whole: 576, 2112), M on both sides of 4- and 64-row
    boundaries, with and without the fused bias: within the bf16 output bound of the float64
    product, and the same bits on a second call."""
    from fp8linear.reference import dequantize_activation_ref, dequantize_weight_ref

    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n + k)
    x_q, x_s, w_q, w_s, b = _operands(m, n, k, bias, gen)
    y = cutlass_gemm.cutlass_fp8_gemm(x_q, x_s, w_q, w_s, b, cfg)
    ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().t()
    if b is not None:
        ref = ref + b.double()
    assert y.shape == (m, n) and y.dtype == BF16
    assert rel_err(y, ref) < GEMM_TOL[BF16], rel_err(y, ref)
    assert same_bits(cutlass_gemm.cutlass_fp8_gemm(x_q, x_s, w_q, w_s, b, cfg), y)


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("cfg", cutlass_gemm.CUTLASS_ROW_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 3, 77, 130, 333, 1000])
@pytest.mark.parametrize("n,k", [(576, 2112), (2112, 576), (7168, 2048), (304, 2304)])
@pytest.mark.parametrize("bias", [False, True])
def test_cutlass_row_weights_match_the_float64_reference(cfg, m, n, k, bias):
    """The 1x128-weight kernels: within the bf16 output bound of the float64 product, the same bits
    from an N-major scale and from the checkpoint's layout (an N-major copy made once), and on a
    second call."""
    from fp8linear import quantize_activation, quantize_weight
    from fp8linear.reference import dequantize_activation_ref, dequantize_weight_ref

    gen = torch.Generator(device="cuda").manual_seed(m * 17 + n + k)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(BF16)
    w_q, w_s = quantize_weight(w, "row", FP8)
    x_q, x_s = quantize_activation(torch.randn(m, k, generator=gen, device="cuda").to(BF16), fp8_dtype=FP8,
                                   backend="triton")
    x_s = x_s.contiguous()
    b = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(BF16) if bias else None
    n_major = w_s.t().contiguous().t()
    y = cutlass_gemm.cutlass_fp8_gemm(x_q, x_s, w_q, n_major, b, cfg, "row")
    ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().t()
    if b is not None:
        ref = ref + b.double()
    assert y.shape == (m, n) and y.dtype == BF16
    assert rel_err(y, ref) < GEMM_TOL[BF16], rel_err(y, ref)
    assert same_bits(cutlass_gemm.cutlass_fp8_gemm(x_q, x_s, w_q, w_s, b, cfg, "row"), y)
    assert same_bits(cutlass_gemm.cutlass_fp8_gemm(x_q, x_s, w_q, n_major, b, cfg, "row"), y)


@pytest.mark.gpu
@needs_cutlass
def test_cutlass_row_weights_through_the_layer(monkeypatch):
    """A row-wise routes-table entry on CUTLASS runs Fp8BlockLinear's plans (the N-major copy the
    layer keeps) and the compiled layer with the direct call's bits."""
    from fp8linear import Fp8BlockLinear, quantize_activation
    from fp8linear.ops import route_table, router

    m, n, k = 333, 2112, 7168
    cfg = CutlassConfig(128)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=BF16)
    layer = Fp8BlockLinear.from_linear(lin, "row")
    entry = route_table.RouteEntry("cutlass", cfg, route_table.RouteEntry("cublas"))
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(router, "EAGER_CUTLASS_MIN_MNK", 0)
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    xq, xs = quantize_activation(x, fp8_dtype=FP8, backend="triton")
    expected = cutlass_gemm.cutlass_fp8_gemm(xq, xs.contiguous(), layer.weight, layer.weight_scale_inv, None, cfg, "row")
    for _ in range(3):  # first call routed, then planned
        assert same_bits(layer(x), expected)
    plan = next(iter(layer._plans.values()))
    assert plan.route.kernel == "cutlass" and plan.calls
    assert same_bits(torch.compile(layer, fullgraph=True)(x), expected)


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("cfg", cutlass_gemm.CUTLASS_CANDIDATES, ids=lambda c: c.name)
def test_cutlass_in_a_cuda_graph(cfg):
    """A captured CUTLASS GEMM (stream-K's workspace included) replays the eager bits on new inputs
    copied into its operands."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    m, n, k = 333, 7168, 2048
    x_q, x_s, w_q, w_s, b = _operands(m, n, k, True, gen)
    graph, out = capture_graph(lambda a, sa: cutlass_gemm.cutlass_fp8_gemm(a, sa, w_q, w_s, b, cfg), x_q, x_s)
    x2_q, x2_s, *_ = _operands(m, n, k, False, gen)
    x_q.copy_(x2_q)
    x_s.copy_(x2_s)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, cutlass_gemm.cutlass_fp8_gemm(x2_q, x2_s, w_q, w_s, b, cfg))


@pytest.mark.gpu
@needs_cutlass
def test_cutlass_through_the_router(monkeypatch):
    """A routes table entry sends block_fp8_matmul and Fp8BlockLinear (routed, then planned) to
    CUTLASS, with the direct call's bits; backend "triton" never goes there."""
    from fp8linear import Fp8BlockLinear, block_fp8_matmul, quantize_activation
    from fp8linear.ops import route_table, router

    gen = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 333, 2112, 7168
    x_q, x_s, w_q, w_s, _ = _operands(m, n, k, False, gen)
    cfg = CutlassConfig(64)
    direct = cutlass_gemm.cutlass_fp8_gemm(x_q, x_s, w_q, w_s, None, cfg)

    entry = route_table.RouteEntry("cutlass", cfg, route_table.RouteEntry("cublas"))
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    assert router.route_gemm(x_q.device, m, n, k, "block", FP8, BF16, None, True, True, True).kernel == "cutlass"
    assert same_bits(block_fp8_matmul(x_q, x_s, w_q, w_s, BF16), direct)
    assert router.route_gemm(x_q.device, m, n, k, "block", FP8, BF16, None, False, True, True).kernel != "cutlass"
    w_s_strided = w_s.t().contiguous().t()  # same values, column-major: the fallback runs, same numbers
    assert not w_s_strided.is_contiguous()
    fallback = block_fp8_matmul(x_q, x_s, w_q, w_s_strided, BF16)
    assert rel_err(fallback, direct.float()) < GEMM_TOL[BF16]

    monkeypatch.setattr(router, "EAGER_CUTLASS_MIN_MNK", 0)  # eager calls of this size take CUTLASS
    layer = Fp8BlockLinear(k, n, bias=False, device="cuda")
    layer.weight.data.copy_(w_q)
    layer.weight_scale_inv.data.copy_(w_s)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    xq, xs = quantize_activation(x, fp8_dtype=FP8, backend="triton")
    expected = cutlass_gemm.cutlass_fp8_gemm(xq, xs.contiguous(), w_q, w_s, None, cfg)
    for _ in range(3):  # first call routed, then planned
        assert same_bits(layer(x), expected)
    plan = next(iter(layer._plans.values()))
    assert plan.route.kernel == "cutlass" and plan.calls  # a prepared plan, not the unprepared route


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("m,k,planted", [(40, 2048, True), (77, 576, True), (33, 2112, False), (1, 7168, False),
                                         (1000, 7168, False)])
def test_library_quantization_gives_act_quant_bytes(m, k, planted):
    """The library's quantization (CutlassCall.with_quantization) writes act_quant's FP8 bytes and
    scales bit for bit: on values over a wide range of magnitudes, on bf16 bit patterns drawn from
    all 65536 (NaN, Inf, subnormals: `planted`; 40x2048 holds every one), in groups cut short by K
    (576, 2112); and the GEMM after it gives the bits of the GEMM on act_quant's output."""
    from fp8linear.ops.quant import act_quant

    gen = torch.Generator(device="cuda").manual_seed(m * 31 + k)
    n = 256
    _, _, w_q, w_s, _ = _operands(1, n, k, False, gen)
    x = torch.randn(m, k, generator=gen, device="cuda") * torch.exp2(
        torch.randint(-30, 30, (m, 1), generator=gen, device="cuda").float())
    x = x.to(BF16)
    if planted:
        patterns = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(BF16)
        flat = x.view(-1)
        count = min(flat.numel(), patterns.numel())
        flat[:count] = patterns[torch.randperm(patterns.numel(), generator=gen, device="cuda")[:count]]
        assert x.isnan().any() and x.isinf().any()
    groups = -(-k // 128)
    for cfg in (CutlassConfig(64), CutlassConfig(128)):
        fused = cutlass_gemm.CutlassCall(w_q, w_s, None, m, cfg).with_quantization()
        q = torch.empty(m, k, dtype=FP8, device="cuda")
        s = torch.empty(m, groups, dtype=torch.float32, device="cuda")
        y = torch.empty(m, n, dtype=BF16, device="cuda")
        fused(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr())
        ref_q, ref_s = act_quant(x, FP8)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(s.view(torch.int32), ref_s.contiguous().view(torch.int32))
        expected = cutlass_gemm.cutlass_fp8_gemm(ref_q, ref_s.contiguous(), w_q, w_s, None, cfg)
        assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
@needs_cutlass
def test_library_quantization_matches_act_quant_on_every_bf16_value_under_many_scales():
    """Every finite bf16 value, quantized in groups whose amax sets 160 scales from 2**-130 to 2**127
    (random mantissas and signs): the library's quantization gives act_quant's bytes and scales."""
    from fp8linear.ops.quant import act_quant

    gen = torch.Generator(device="cuda").manual_seed(5)
    values = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(BF16).float()
    values = values[values.isfinite()]
    exponents = torch.linspace(-130, 126, 160, device="cuda")
    amaxes = (torch.exp2(exponents) * (1 + torch.rand(160, generator=gen, device="cuda"))).to(BF16).float()
    groups = []
    for amax in amaxes.tolist():
        fit = values[values.abs() <= amax]
        fit = torch.cat([fit, fit.new_zeros(-fit.numel() % 127)]).view(-1, 127)
        lead = torch.full((fit.shape[0], 1), amax, device="cuda")
        lead = lead * (torch.randint(0, 2, lead.shape, generator=gen, device="cuda") * 2 - 1)
        groups.append(torch.cat([lead, fit], 1))
    x = torch.cat(groups)
    x = torch.cat([x, x.new_zeros(-x.shape[0] % 16, 128)]).view(-1, 2048).to(BF16)
    m, k = x.shape
    _, _, w_q, w_s, _ = _operands(1, 128, k, False, gen)
    fused = cutlass_gemm.CutlassCall(w_q, w_s, None, m, CutlassConfig(128)).with_quantization()
    q = torch.empty(m, k, dtype=FP8, device="cuda")
    s = torch.empty(m, k // 128, dtype=torch.float32, device="cuda")
    y = torch.empty(m, 128, dtype=BF16, device="cuda")
    fused(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr())
    ref_q, ref_s = act_quant(x, FP8)
    assert torch.equal(s.view(torch.int32), ref_s.contiguous().view(torch.int32))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.gpu
@needs_cutlass
def test_eager_cutlass_plans_quantize_in_the_library_call_up_to_the_cut(monkeypatch):
    """An eager CUTLASS plan on a bf16 input of at most LIB_QUANT_MAX_ELEMENTS quantizes it in the
    library's call (one per forward; with the output and scratch allocated in the same C++ call where
    the plan-call module is built), a larger one and every CUDA-graph capture through act_quant;
    the bits are run_linear_route's either way."""
    from fp8linear.ops import router
    from fp8linear.ops.linear import LinearPlan, run_linear_route
    from fp8linear.ops.router import Route

    calls, allocating = [], []

    def record(method, args):
        calls.append(args)
        if method == "allocating_call":
            allocating.append(args)

    spy_cutlass_library_calls(monkeypatch, record)
    built = cutlass_gemm._plan_call() is not None
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, k = 576, 2112
    route = Route("cutlass", CutlassConfig(64))
    _, _, w_q, w_s, _ = _operands(1, n, k, False, gen)
    cut = router.LIB_QUANT_MAX_ELEMENTS // k
    for m, in_library in ((100, True), (cut, True), (cut + 1, False)):
        x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
        plan = LinearPlan(route, x, w_q, w_s, "block", None, None)
        calls.clear()
        allocating.clear()
        y = plan(x)
        assert len(calls) == in_library and len(allocating) == (in_library and built)
        assert same_bits(y, run_linear_route(route, x, w_q, w_s, "block", None))
        graph, out = capture_graph(plan, x)  # a warm-up call, then the capture
        assert len(calls) == 2 * in_library
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(out, y)


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("capture_route", ["cublas", "tiled", "cutlass"])
def test_an_eager_cutlass_plan_checks_for_capture_once_a_call(monkeypatch, capture_route):
    """An eager one-call CUTLASS plan whose capture route differs (cuBLAS, our tiled kernel, another
    CUTLASS tile) asks whether the stream is capturing once a call (host time), runs the library
    eagerly and the capture route inside a CUDA-graph capture, each with its own route's bits."""
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.linear import LinearPlan, run_linear_route
    from fp8linear.ops.router import Route

    real, asked = torch.cuda.is_current_stream_capturing, []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or real())
    calls = []
    spy_cutlass_library_calls(monkeypatch, lambda method, args: calls.append(method))
    gen = torch.Generator(device="cuda").manual_seed(5)
    m, n, k = 96, 576, 2048
    _, _, w_q, w_s, _ = _operands(m, n, k, False, gen)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    route = Route("cutlass", CutlassConfig(64, tile_n=64), pdl=True)
    other = {"cublas": Route("cublas"), "tiled": Route("tiled", GemmConfig(64, 64, 128, 8, 4, 4)),
             "cutlass": Route("cutlass", CutlassConfig(128))}[capture_route]
    plan = LinearPlan(route, x, w_q, w_s, "block", None, None, capture_route=other)
    asked.clear()
    calls.clear()
    y = plan(x)
    assert len(asked) == 1 and len(calls) == 1  # one capture check, one library call (quantize and GEMM)
    assert same_bits(y, run_linear_route(Route("cutlass", CutlassConfig(64, tile_n=64)), x, w_q, w_s, "block", None))
    ran = []  # the CUTLASS GEMMs launched by a plan's act_quant + GEMM path (the one under capture)
    real_call = cutlass_gemm.CutlassCall.__call__
    monkeypatch.setattr(cutlass_gemm.CutlassCall, "__call__",
                        lambda self, *a: ran.append(self.config) or real_call(self, *a))
    graph, out = capture_graph(plan, x)  # an eager warm-up call (the library's), then the capture
    assert len(calls) == 2 and ran == ([CutlassConfig(128)] if capture_route == "cutlass" else [])
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, run_linear_route(other, x, w_q, w_s, "block", None))


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("m,n,k", [(2, 576, 2112), (16, 7168, 2048), (96, 2112, 7168), (333, 24576, 1536),
                                   (512, 1536, 7168)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tile_m,tile_n", [(64, 128), (64, 64), (128, 128), (128, 64)])
def test_pdl_one_call_plans_give_the_plain_bits(m, n, k, bias, tile_m, tile_n):
    """Each data-parallel kernel's GEMM launched with PDL after the library's quantization (Route.pdl)
    gives the bits of the plain launch and of run_linear_route, on 30 inputs each written by the
    kernel launched just before (the GEMM must wait for the quantization, which waits for that
    kernel; the cooperative kernel's scale-loading warp waits only in the build's copy of its header)."""
    from fp8linear.ops.linear import LinearPlan, run_linear_route
    from fp8linear.ops.router import Route

    cfg = CutlassConfig(tile_m, tile_n=tile_n)
    assert cutlass_gemm.pdl_supported(cfg, bias)
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    _, _, w_q, w_s, b = _operands(m, n, k, bias, gen)
    base = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    pdl, plain = (LinearPlan(Route("cutlass", cfg, pdl=flag), base, w_q, w_s, "block", b, None)
                  for flag in (True, False))
    outs = []
    for i in range(30):
        x = base * (1.0 + i / 8)  # written on the stream just before the plan's kernels
        outs.append((x, pdl(x), plain(x)))
    for x, y_pdl, y_plain in outs:
        assert same_bits(y_pdl, y_plain)
    x, y_pdl, _ = outs[-1]
    assert same_bits(y_pdl, run_linear_route(Route("cutlass", cfg), x, w_q, w_s, "block", b))


@pytest.mark.gpu
@needs_cutlass
def test_a_plan_made_during_capture_reads_the_narrow_scale_kept_by_the_eager_call_before():
    """An eager call on the 64x64 tiles keeps their scale per 64 rows on the weight's scale; a plan
    then made inside a CUDA-graph capture (the layer's second call) reads that copy, not one made in
    the capture (which holds values only after a replay): eager calls right after the capture, before
    any replay, give the bits of the 64x64 kernel."""
    from fp8linear import Fp8BlockLinear
    from fp8linear.ops.cublas_gemm import _HELD_ATTR
    from fp8linear.reference import dequantize_activation_ref, dequantize_weight_ref

    if not cutlass_gemm.one_call_available():
        pytest.skip("the plan-call module is not built: eager calls of this size do not run CUTLASS")
    lin = torch.nn.Linear(2112, 576, bias=False, device="cuda", dtype=BF16)
    layer = Fp8BlockLinear.from_linear(lin, "block")
    x = torch.randn(96, 2112, device="cuda", dtype=BF16)
    with torch.no_grad():
        graph, out = capture_graph(layer, x)  # an eager call (routed), then the plan made while capturing
        y = layer(x)  # the plan, eagerly, before any replay
        plan = next(iter(layer._plans.values()))
        assert plan.route.config == CutlassConfig(64, tile_n=64)
        assert ("narrow", 64, 576) in getattr(layer.weight_scale_inv, _HELD_ATTR)
        expected = cutlass_gemm.cutlass_fp8_gemm(*_quantized(x), layer.weight, layer.weight_scale_inv,
                                                 None, CutlassConfig(64, tile_n=64))
        assert same_bits(y, expected)
        graph.replay()  # the capture route (another kernel may run there): the same product
        torch.cuda.synchronize()
        x_q, x_s = _quantized(x)
        ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(
            layer.weight, layer.weight_scale_inv).double().t()
        assert rel_err(out, ref) < GEMM_TOL[BF16] and rel_err(y, ref) < GEMM_TOL[BF16]


def _quantized(x):
    from fp8linear import quantize_activation

    x_q, x_s = quantize_activation(x, fp8_dtype=FP8, backend="triton")
    return x_q, x_s.contiguous()


def test_library_quantization_rule():
    from fp8linear.ops import router

    cut = router.LIB_QUANT_MAX_ELEMENTS
    assert router.use_library_quantization(cut // 7168, 7168, BF16)
    assert not router.use_library_quantization(cut // 7168 + 1, 7168, BF16)
    assert not router.use_library_quantization(1, 7168, torch.float16)  # the library reads bf16 only


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize("cfg", cutlass_gemm.CUTLASS_CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 77, 130, 1000])
@pytest.mark.parametrize("n,k", [(2112, 576), (576, 2112), (7168, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_cutlass_plan_matches_the_route(cfg, m, n, k, bias):
    """A LinearPlan on a CUTLASS route (eagerly, the library's quantization and GEMM in one call for
    the data-parallel kernels on inputs up to LIB_QUANT_MAX_ELEMENTS; else, and under CUDA-graph
    capture, act_quant, then the call, stream-K's workspace in the scratch buffer) gives
    run_linear_route's bits on new inputs, with leading dimensions, and within the bf16 bound of the
    float64 product; the same under CUDA-graph capture."""
    from fp8linear.ops.linear import LinearPlan, run_linear_route
    from fp8linear.ops.router import Route
    from fp8linear.reference import dequantize_activation_ref, dequantize_weight_ref, quantize_activation_ref

    gen = torch.Generator(device="cuda").manual_seed(m + n * 7 + k)
    _, _, w_q, w_s, b = _operands(m, n, k, bias, gen)
    route = Route("cutlass", cfg)
    xs = [torch.randn(2, m, k, generator=gen, device="cuda").to(BF16) for _ in range(3)]
    plan = LinearPlan(route, xs[0], w_q, w_s, "block", b, None)
    assert plan.calls
    for x in xs:
        y = plan(x)
        assert y.shape == (2, m, n) and y.dtype == BF16
        assert same_bits(y, run_linear_route(route, x.view(-1, k), w_q, w_s, "block", b).view(2, m, n))
    x_q, x_s = quantize_activation_ref(xs[-1].view(-1, k), FP8)
    ref = dequantize_activation_ref(x_q, x_s).double() @ dequantize_weight_ref(w_q, w_s).double().t()
    if b is not None:
        ref = ref + b.double()
    assert rel_err(y.view(-1, n), ref) < GEMM_TOL[BF16]
    graph, out = capture_graph(plan, xs[0])
    xs[0].copy_(xs[1])
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, plan(xs[1]))
