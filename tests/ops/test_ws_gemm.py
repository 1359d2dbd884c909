"""The warp-specialized Gluon GEMM for Hopper (fp8linear/ops/ws_gemm.py): its rules on CPU, its
numbers on a Hopper GPU with a Gluon that has warp specialization (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from fp8linear.ops import ws_gemm
from fp8linear.ops.ws_gemm import WsConfig

from _utils import KERNEL_GEMM_TOL, capture_graph, rel_err, same_bits
from conftest import HAS_CUDA

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def test_config_validation():
    assert WsConfig() == WsConfig(128, 3, 8) and hash(WsConfig(256, 3, 4)) == hash(WsConfig(256, 3, 4))
    assert WsConfig(128, 3) != WsConfig(128, 4) and WsConfig(256) != WsConfig(128)
    for bad in (64, 160, 512):
        with pytest.raises(ValueError, match=f"block_n must be 128, 192 or 256, got {bad}"):
            WsConfig(bad)
    assert WsConfig(192) != WsConfig(256) and "block_n=192" in repr(WsConfig(192, tail_split=4))
    with pytest.raises(ValueError, match="stages must be >= 2"):
        WsConfig(128, 1)
    with pytest.raises(ValueError, match="group_m must be >= 1"):
        WsConfig(128, 4, 0)
    assert WsConfig(persistent=True) != WsConfig() and "persistent=True" in repr(WsConfig(persistent=True))
    with pytest.raises(TypeError, match="persistent must be a bool"):
        WsConfig(128, 3, 8, 1)
    assert WsConfig(tail_split=4) != WsConfig() and "tail_split=4" in repr(WsConfig(tail_split=4))
    for bad in (0, -2, 2.0, True, ws_gemm.TAIL_MAX_SPLIT + 1):
        with pytest.raises(ValueError, match=rf"tail_split must be an int from 1 to {ws_gemm.TAIL_MAX_SPLIT}"):
            WsConfig(tail_split=bad)
    assert WsConfig(tail_split=ws_gemm.TAIL_MAX_SPLIT).tail_split == ws_gemm.TAIL_MAX_SPLIT
    assert WsConfig(256, tail_split=2).tail_split == 2  # 256-column tiles split too


@pytest.mark.parametrize("tiles,programs,k_groups,max_split", [
    (160, 132, 56, 8), (272, 132, 56, 16), (132, 132, 56, 8), (80, 132, 56, 8), (160, 132, 5, 8),
    (136, 132, 56, 64), (289, 132, 33, 8), (51, 132, 32, 8), (160, 132, 31, 8), (1, 1, 32, 8), (7, 4, 90, 3),
    (2304, 132, 56, 8), (1188, 132, 56, 8), (1189, 132, 56, 8), (6, 132, 56, 8)])
def test_tail_plan(tiles, programs, k_groups, max_split):
    """Whole tiles fill whole waves; the tail's K splits cover every K group once, none shorter than
    TAIL_MIN_GROUPS (but the last) nor empty, and run in one wave with the whole tiles' last."""
    whole, split, per_split = ws_gemm.tail_plan(tiles, programs, k_groups, max_split)
    tail = tiles - whole
    if split == 1:
        assert (whole, per_split) == (tiles, k_groups)
        assert (tiles % programs == 0 or k_groups < ws_gemm.TAIL_MIN_K_GROUPS
                or tiles // programs > ws_gemm.TAIL_MAX_WAVES
                or min(programs // (tiles % programs), k_groups // ws_gemm.TAIL_MIN_GROUPS, max_split) < 2)
        return
    assert whole % programs == 0 and 0 < tail < programs and 2 <= split <= max_split
    assert k_groups >= ws_gemm.TAIL_MIN_K_GROUPS and whole // programs <= ws_gemm.TAIL_MAX_WAVES
    assert tail * split <= programs  # one tail unit per program at most
    assert per_split >= ws_gemm.TAIL_MIN_GROUPS and (split - 1) * per_split < k_groups <= split * per_split


def test_tail_plan_examples():
    # 576x7168 at M=4096 on 132 SMs: 160 tiles, 28 left for a second wave, 4 splits of 14 groups
    assert ws_gemm.tail_plan(160, 132, 56, 8) == (132, 4, 14)
    assert ws_gemm.tail_plan(160, 132, 56, 1) == (160, 1, 56)  # no split asked for
    assert ws_gemm.tail_plan(264, 132, 56, 8) == (264, 1, 56)  # whole waves
    assert ws_gemm.tail_plan(100, 132, 56, 8) == (100, 1, 56)  # 100 tiles on 132 SMs: 1 split each
    assert ws_gemm.tail_plan(160, 132, 18, 8) == (160, 1, 18)  # K = 2304: the split costs more than it saves
    assert ws_gemm.tail_plan(2304, 132, 56, 8) == (2304, 1, 56)  # 17 whole waves
    assert ws_gemm.tail_plan(40, 132, 56, 4) == (0, 3, 19)  # one partial wave: every tile split
    # a launch's plan: 4096x576 (K = 7168) in 32 x 5 tiles of 128x128, 28 left over 132 SMs
    assert ws_gemm.ws_plan(4096, 576, 7168, WsConfig(128, 4, persistent=True, tail_split=4), 132) == (160, 132, 4, 14)
    assert ws_gemm.ws_plan(4096, 576, 7168, WsConfig(192, 4, persistent=True, tail_split=4), 132) == (96, 96, 1, 56)


@pytest.mark.parametrize("split,width", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (11, 16), (16, 16)])
def test_sum_width(split, width):
    """The split sum unrolls to the plan's own split rounded up to a power of two, whatever the
    config's bound: a 2-piece plan of a tail_split=4 config sums 2 wide."""
    assert ws_gemm.sum_width(split) == width
    assert width <= ws_gemm.TAIL_MAX_SPLIT


def test_device_rule(monkeypatch):
    """Only a Hopper GPU under CUDA, outside the CPU interpreter, with Gluon's warp specialization."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(ws_gemm, "HAS_GLUON_WS", True)
    monkeypatch.setattr(ws_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, ok in (((9, 0), True), ((10, 0), False), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        ws_gemm._device_ok.cache_clear()
        assert ws_gemm.ws_device_ok(cuda) is ok
    ws_gemm._device_ok.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert not ws_gemm.ws_device_ok(torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not ws_gemm.ws_device_ok(cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(ws_gemm, "interpreting", lambda: True)
    assert not ws_gemm.ws_device_ok(cuda)
    monkeypatch.setattr(ws_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(ws_gemm, "HAS_GLUON_WS", False)
    assert not ws_gemm.ws_device_ok(cuda)
    ws_gemm._device_ok.cache_clear()


def test_cpu_operands_are_not_accepted():
    x = torch.zeros(256, 256, dtype=torch.uint8).view(FP8)
    assert not ws_gemm.ws_accepts(x, x, BF16)


@pytest.mark.parametrize("m,n,k,gran,operands_ok,ws", [
    (4096, 7168, 7168, "block", True, True),
    (1000, 18432, 3584, "block", True, True),
    (4096, 7168, 7168, "row", True, False),  # 1x128 weights: only where a routes table names it
    (200, 7168, 18432, "block", True, True),  # 112 tiles: in place of the heuristic's 64x64 tiles
    (4096, 7168, 2048, "block", True, True),  # in place of the persistent TMA kernel
    (2048, 32768, 512, "block", True, True),  # K = WS_MIN_K
    (2048, 32768, 384, "block", True, False),  # below WS_MIN_K
    (96, 24576, 1536, "block", True, True),  # WS_MIN_M, 192 tiles
    (95, 24576, 1536, "block", True, False),  # below WS_MIN_M
    (160, 24576, 1536, "block", True, False),  # 160 rows fill 62% of two rows of tiles
    (192, 24576, 1536, "block", True, True),  # 75%: WS_MIN_ROW_FILL
    (4096, 7168, 7168, "tensor", True, False),  # not measured for per-tensor weights
    (4096, 7168, 7168, "block", False, False),  # not contiguous / not TMA-addressable
    (256, 4096, 14336, "block", True, False),  # 64 tiles of 128x128 on 132 SMs: below half a wave
    (384, 4096, 14336, "block", True, True),  # 96 tiles
])
def test_router_rule(monkeypatch, m, n, k, gran, operands_ok, ws):
    """Where our tiled or persistent kernel would run on Hopper, the rule sends the GEMM to the
    warp-specialized kernel, for GEMMs on quantized activations and for whole linears alike, but not
    eager plans."""
    from fp8linear.ops import router

    monkeypatch.setattr(router, "ws_device_ok", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    monkeypatch.setattr(router, "lookup_route", lambda *a: None)
    dev = torch.device("cpu")
    gemm = router.route_gemm(dev, m, n, k, gran, FP8, BF16, None, False, operands_ok, operands_ok)
    whole = router.route_linear(dev, m, n, k, gran, FP8, BF16, None, False, operands_ok, weight_contiguous=operands_ok)
    for route in (gemm, whole):
        assert (route.kernel == "ws") is ws, route
        if ws:
            assert route.config == router.ws_config(dev, m, n, k)
    # eager plans keep the tiled kernel's prepared launch (router: WS_MIN_M's comment)
    eager = router.route_linear(dev, m, n, k, gran, FP8, BF16, None, False, operands_ok, eager=True,
                                weight_contiguous=operands_ok)
    assert eager.kernel != "ws", eager
    monkeypatch.setattr(router, "ws_device_ok", lambda device: False)  # not a Hopper GPU
    assert router.route_gemm(dev, m, n, k, gran, FP8, BF16, None, False, operands_ok, operands_ok).kernel != "ws"


@pytest.mark.parametrize("m,n,k,width", [
    (8192, 8192, 28672, 256),  # 4096 tiles of 128x128: 32 waves against 16 of 128x256 tiles (21 of 128x192)
    (1024, 8192, 28672, 256),  # 512 tiles: 4 waves against 2 (3 x 1.6 > 2 x 1.76)
    (333, 18432, 7168, 256),  # 432 tiles: 4 waves against 2
    (8192, 1536, 7168, 256),  # 768 tiles: 6 waves against 3 (4 of 128x192: 6.4)
    (4096, 7168, 7168, 256),
    (4096, 7168, 4096, 256),  # K = WS_WIDE_MIN_K
    (4096, 7168, 3968, 128),  # below WS_WIDE_MIN_K; 10 waves of 128x192 x 1.6 > 14
    (4096, 24576, 1536, 128),  # short K; 32 waves of 128x192 x 1.6 > 47
    (256, 8192, 28672, 128),  # 64 tiles of 128x256: under a wave
    (4096, 1536, 7168, 128),  # 384 tiles: 3 waves against 2 of the wider tiles, 2 x 1.76 > 3, 2 x 1.6 > 3
    (2048, 7168, 16384, 128),  # 896 tiles: 7 waves against 4, 4 x 1.76 > 7 (5 x 1.6 > 7)
    (4096, 576, 7168, 192),  # 160 tiles: 2 waves against 1 of 96 128x192 tiles (576 columns in 3)
    (4096, 576, 576, 192),  # at any K from WS_MIN_K
    (8192, 576, 576, 128),  # 320 tiles: 3 waves against 2 x 1.6
    (2048, 1536, 576, 192),  # 192 tiles: 2 waves against 1
    (2048, 2048, 1408, 128),  # 256 tiles: 2 waves against 2 of 176 tiles
    (512, 18432, 7168, 192),  # 576 tiles: 5 waves against 3 x 1.6 (and 3 x 1.76 of 128x256)
])
def test_tile_width_rule(monkeypatch, m, n, k, width):
    """Where the warp-specialized kernel runs without a table entry, the tile width whose waves, each
    weighed by its tile cost (WS_MID_TILE_COST, WS_WIDE_TILE_COST), are fewest; 256 columns only at
    long K (router: WS_CONFIG, WS_MID_CONFIG, WS_WIDE_CONFIG)."""
    from fp8linear.ops import router

    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    cfg = router.ws_config(torch.device("cpu"), m, n, k)
    assert cfg == {128: router.WS_CONFIG, 192: router.WS_MID_CONFIG, 256: router.WS_WIDE_CONFIG}[width]
    assert router.WS_WIDE_CONFIG.block_n == 256 and router.WS_WIDE_CONFIG.persistent
    assert router.WS_MID_CONFIG.block_n == 192 and router.WS_MID_CONFIG.persistent
    monkeypatch.setattr(router, "ws_device_ok", lambda device: True)
    monkeypatch.setattr(router, "lookup_route", lambda *a: None)
    route = router.route_gemm(torch.device("cpu"), m, n, k, "block", FP8, BF16, None, False, True, True)
    assert route.kernel != "ws" or route.config == cfg, route


def test_rule_replaces_the_persistent_kernel_but_not_split_k_or_cublas(monkeypatch):
    from fp8linear.ops import router

    monkeypatch.setattr(router, "ws_device_ok", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    persistent = router.Route("persistent", router.PERSISTENT_CONFIG)
    assert router._ws_in_place_of_tiled(persistent, dev, 4096, 7168, 2048, "block", True) == router.Route(
        "ws", router.WS_CONFIG)
    for kept in (router.Route("cublas"), router.Route("splitk", router.SplitKConfig(64, 64, 4)),
                 router.Route("tiled", router.MID_M_CONFIG, pdl=True)):
        assert router._ws_in_place_of_tiled(kept, dev, 4096, 7168, 2048, "block", True) == kept


def test_table_entries_run_it_where_it_can(monkeypatch):
    """A routes-table entry naming the warp-specialized kernel runs it for graph / compiled / functional
    callers with TMA-addressable contiguous operands on Hopper (whatever the rule says: here M=64);
    eager plans, other operands and other GPUs get its fallback."""
    from fp8linear.ops import router
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.route_table import RouteEntry

    tiled = GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    entry = RouteEntry("ws", WsConfig(128, 3, persistent=True), RouteEntry("tiled", tiled))
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(router, "ws_device_ok", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    ws = router.Route("ws", entry.config)
    assert router.route_gemm(dev, 64, 24576, 1536, "block", FP8, BF16, None, True, True, True) == ws
    assert router.route_linear(dev, 64, 24576, 1536, "block", FP8, BF16, None, True, True,
                               weight_contiguous=True) == ws
    fallback = router.Route("tiled", tiled)
    assert router.route_gemm(dev, 64, 24576, 1536, "block", FP8, BF16, None, True, True, False) == fallback
    eager = router.route_linear(dev, 64, 24576, 1536, "block", FP8, BF16, None, True, True, eager=True,
                                weight_contiguous=True)
    assert eager.kernel in ("tiled", "decode"), eager  # the fallback's tile, or it as the one-launch decode's split
    monkeypatch.setattr(router, "ws_device_ok", lambda device: False)
    assert router.route_gemm(dev, 64, 24576, 1536, "block", FP8, BF16, None, True, True, True) == fallback


# ----------------------------------------------------------------------------- GPU
HOPPER = HAS_CUDA and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9
needs_ws = pytest.mark.skipif(not (HOPPER and ws_gemm.HAS_GLUON_WS),
                              reason="needs a Hopper GPU and a Triton whose Gluon has warp_specialize")


def _operands(m, n, k, gran, bias, gen):
    from fp8linear import quantize_activation, quantize_weight

    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(BF16)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    w_q, w_s = quantize_weight(w, gran, FP8)
    x_q, x_s = quantize_activation(x, fp8_dtype=FP8, backend="triton")
    b = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(BF16) if bias else None
    return x_q, x_s.contiguous(), w_q, (w_s.reshape(()) if gran == "tensor" else w_s), w_s, b


# Compiles the kernel for sm_90a and prints its PTX and the shared memory it takes as JSON. Run in a
# fresh interpreter: a Triton-interpreted kernel run earlier in the same process can leave
# triton.language patched for the interpreter (Triton 3.9 restores the patches of a whole launch, not
# those of a device function's call), and the compile then fails in `cdiv`.
_AOT_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from fp8linear.ops import ws_gemm

block_n, granularity, stages, max_split, release_every, tma_store = json.loads(sys.argv[1])
fp8 = gl.float8e4nv
x_layout = gl.NVMMASharedLayout.get_default_for([64, 128], fp8)
w_rows = 64 if block_n == 192 else block_n  # 128x192 tiles load w in 64-row boxes
w_layout = gl.NVMMASharedLayout.get_default_for([w_rows, 128], fp8)
y_cols = 128 if block_n == 128 else 64  # the output's TMA box: a consumer's 64 rows of one product
y_layout = gl.NVMMASharedLayout.get_default_for([64, y_cols], gl.bfloat16)
signature = {
    "x_desc": f"tensordesc<fp8e4nv[64, 128],{x_layout!r}>",
    "w_desc": f"tensordesc<fp8e4nv[{w_rows}, 128],{w_layout!r}>",
    "y_desc": (f"tensordesc<bf16[64, {y_cols}],{y_layout!r}>" if tma_store
               else f"tensordesc<fp8e4nv[64, 128],{x_layout!r}>"),
    "xs_ptr": "*fp32", "ws_ptr": "*fp32", "y_ptr": "*bf16", "bias_ptr": "*bf16", "part_ptr": "*fp32",
    "count_ptr": "*i32", **{name: "i32" for name in ("M", "N", "K", "whole_tiles", "tail_split", "groups_per_split",
                                                    "stride_xsm", "stride_wsn", "stride_wsk", "stride_ym")},
    **{name: "constexpr" for name in ("WS_GROUP_N", "W_SCALE_UNIFORM", "HAS_BIAS", "GROUP_M", "STAGES",
                                      "MAX_SPLIT", "RELEASE_EVERY", "BLOCK_N", "TMA_STORE")}}
constexprs = {"WS_GROUP_N": 128 if granularity == "block" else 1, "W_SCALE_UNIFORM": granularity == "block",
              "HAS_BIAS": True, "GROUP_M": 8, "STAGES": stages, "MAX_SPLIT": max_split,
              "RELEASE_EVERY": release_every, "BLOCK_N": block_n, "TMA_STORE": tma_store}
compiled = triton.compile(GluonASTSource(ws_gemm._ws_fp8_gemm_kernel, signature, constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": ws_gemm._MAXNREG})
print(json.dumps({"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared}))
"""


def _aot_compile_for_hopper(block_n: int, granularity: str, stages: int, max_split: int,
                            release_every: int = 2, tma_store: bool = False) -> dict:
    """The warp-specialized kernel compiled ahead of time for sm_90a by the installed Triton, on any
    machine (its bundled ptxas): what the Gluon API of the installed Triton accepts. -> {"ptx": the
    PTX, "shared": bytes of shared memory}."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(ws_gemm.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", _AOT_COMPILE,
                           json.dumps([block_n, granularity, stages, max_split, release_every, tma_store])],
                          capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise AssertionError(f"the sm_90a compile failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _can_compile_for_hopper() -> bool:
    if not ws_gemm.HAS_GLUON_WS:
        return False
    try:
        import importlib

        for module, name in (("triton.backends.compiler", "GPUTarget"),
                             ("triton.experimental.gluon._runtime", "GluonASTSource")):
            if not hasattr(importlib.import_module(module), name):
                return False
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            get_ptxas(90)  # the argument (the target's arch) is newer Triton's
        except TypeError:
            get_ptxas()
    except (ImportError, RuntimeError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _can_compile_for_hopper(), reason="needs a Triton with Gluon's warp_specialize and ptxas")
@pytest.mark.parametrize("block_n,granularity,stages,max_split,release_every,tma_store", [
    (128, "block", 4, 1, 2, False), (128, "block", 4, 4, 2, False), (128, "row", 3, 4, 2, False),
    (256, "block", 4, 4, 2, False), (128, "block", 4, 1, 1, False), (256, "block", 3, 1, 1, False),
    (128, "block", ws_gemm.SPLIT_MAX_STAGES, 4, 2, False), (128, "block", 4, ws_gemm.TAIL_MAX_SPLIT, 2, False),
    (256, "block", 4, ws_gemm.TAIL_MAX_SPLIT, 2, False), (192, "block", 4, 1, 2, False),
    (192, "block", 5, 4, 2, False), (192, "row", 3, 4, 2, False), (128, "block", 4, 2, 2, False),
    (192, "block", 4, 2, 2, False), (256, "block", 4, 2, 2, False),
    (128, "block", 4, 1, 2, True), (128, "block", 4, 4, 2, True), (128, "row", 3, 4, 2, True),
    (192, "block", 4, 1, 2, True), (192, "block", 4, 2, 2, True), (192, "row", 3, 4, 2, True),
    (256, "block", 3, 1, 2, True), (256, "block", 3, 4, 2, True), (128, "block", 6, 1, 2, True)])
def test_the_installed_triton_compiles_it_for_hopper(block_n, granularity, stages, max_split, release_every,
                                                     tma_store):
    """The kernel's Gluon calls exist in the installed Triton (names move between releases: its TMA
    load is `async_load` in newer ones, `async_copy_global_to_shared` in older) and it fits an H100's
    shared memory: checked on any machine, so a Triton upgrade that breaks it fails on CPU too. With
    the TMA store, the launcher's estimate of its shared memory is the compiler's, at most 8 bytes
    over, and the tiles leave by bulk tensor stores."""
    compiled = _aot_compile_for_hopper(block_n, granularity, stages, max_split, release_every, tma_store)
    ptx = compiled["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    ring = stages * (2 * 64 * 128 + block_n * 128)  # the ring's slots: two 64-row x boxes and block_n w rows
    assert ring <= compiled["shared"] <= ws_gemm.SHARED_LIMIT, compiled["shared"]
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == tma_store
    if tma_store:
        estimate = ws_gemm.ws_shared_bytes(ws_gemm.WsConfig(block_n, stages), max_split > 1)
        assert 0 <= estimate - compiled["shared"] <= 8, (estimate, compiled["shared"])


def test_a_128_column_split_tail_is_refused_more_ring_slots_than_fit():
    """Its partials' layout conversion takes shared memory: SPLIT_MAX_STAGES is the most that fits
    (test_the_installed_triton_compiles_it_for_hopper compiles that many)."""
    ws_gemm.WsConfig(128, ws_gemm.SPLIT_MAX_STAGES, tail_split=4)
    ws_gemm.WsConfig(128, ws_gemm.SPLIT_MAX_STAGES + 1)  # no split: no conversion
    with pytest.raises(ValueError, match=rf"at most {ws_gemm.SPLIT_MAX_STAGES} ring slots.*got stages=6"):
        ws_gemm.WsConfig(128, 6, persistent=True, tail_split=4)


@pytest.mark.parametrize("bad", [0, 3, 2.0, None])
def test_release_every_is_one_or_two(bad):
    x = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"release_every must be 1 or 2, got {bad!r}"):
        ws_gemm.ws_fp8_gemm(x, torch.ones(4, 1), x, torch.ones(1, 1), "block", BF16, release_every=bad)


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_tma_store_is_a_bool_or_none(bad):
    x = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="tma_store must be a bool or None"):
        ws_gemm.ws_fp8_gemm(x, torch.ones(4, 1), x, torch.ones(1, 1), "block", BF16, tma_store=bad)


def test_tma_store_refused_before_an_empty_launch():
    """Asking for the TMA store with an output it cannot stage (fp32) is an error even where nothing
    would be launched."""
    x = torch.zeros(0, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="tma_store=True needs a 16-bit output"):
        ws_gemm.ws_fp8_gemm(x, torch.ones(0, 1), w, torch.ones(2, 1), "block", torch.float32, tma_store=True)
    empty = ws_gemm.ws_fp8_gemm(x, torch.ones(0, 1), w, torch.ones(2, 1), "block", BF16, tma_store=True)
    assert empty.shape == (0, 256)


@pytest.mark.parametrize("cfg,units,programs,pays", [
    (WsConfig(128, 4, persistent=True), 384, 132, True),
    (WsConfig(128, 4, persistent=True, tail_split=4), 136, 132, True),
    (WsConfig(128, 4, persistent=True), 132, 132, False),  # one unit a program: nothing to overlap
    (WsConfig(128, 4, persistent=True), 40, 40, False),
    (WsConfig(128, 3), 384, 384, False),  # one program a tile
    (WsConfig(192, 4, persistent=True), 384, 132, False),  # measured even on 128x192 tiles
    (WsConfig(256, 3, persistent=True), 384, 132, False),
])
def test_tma_store_pays(cfg, units, programs, pays):
    assert ws_gemm.tma_store_pays(cfg, units, programs) is pays


@pytest.mark.parametrize("dtype,n,cfg,split,ok", [
    (BF16, 576, WsConfig(192, 4), 1, True),
    (torch.float16, 2112, WsConfig(128, 4), 4, True),  # 229,456 bytes with the partials' conversion
    (torch.float32, 576, WsConfig(128, 3), 1, False),  # fp32 boxes: not taken
    (BF16, 300, WsConfig(128, 3), 1, False),  # rows of 600 bytes: not TMA-addressable
    (BF16, 304, WsConfig(128, 3), 1, True),
    (BF16, 576, WsConfig(256, 4), 1, False),  # 4 slots of 48 KB and 64 KB of boxes: over 227 KB
    (BF16, 576, WsConfig(256, 3), 1, True),
    (BF16, 576, WsConfig(192, 5), 1, False),
    (BF16, 576, WsConfig(128, 5, tail_split=4), 2, False),  # the conversion takes the room
    (BF16, 576, WsConfig(128, 5, tail_split=4), 1, True),  # planned without a split: no conversion
])
def test_tma_store_rule(dtype, n, cfg, split, ok):
    """Where whole tiles leave through shared memory by TMA: a 16-bit output with rows of a multiple
    of 16 bytes, and the config's ring, boxes (and a 128-column split's conversion) within an H100's
    shared memory."""
    y = torch.empty(8, n, dtype=dtype)
    assert ws_gemm.tma_store_ok(y, cfg, split) is ok
    assert (ws_gemm.ws_shared_bytes(cfg, split > 1) <= ws_gemm.SHARED_LIMIT) is (ok or dtype is torch.float32
                                                                                  or n == 300)
    assert not ws_gemm.tma_store_ok(torch.empty(n, 8, dtype=dtype).t(), cfg, split)  # columns not contiguous


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("gran", ["block", "row", "tensor"])
@pytest.mark.parametrize("m,n,k", [(1, 576, 2112), (77, 2112, 576), (129, 304, 7168), (333, 576, 2112),
                                   (1000, 2112, 7168), (2049, 4096, 512), (64, 128, 128), (4099, 1536, 1536)])
def test_matches_reference_and_tiled_kernel(gran, m, n, k):
    """Against the float64 reference within the kernels' bound, and bit for bit against the tiled
    kernel on the same tile (same products, same promotion arithmetic)."""
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.reference import block_fp8_matmul_ref

    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    x_q, x_s, w_q, w_s, w_s_ref, _ = _operands(m, n, k, gran, False, gen)
    # persistent programs loop over several tiles wherever the tiles outnumber the SMs (4099x1536: 396
    # tiles); with 2 ring slots and short K the producer laps the ring within a tile and across tiles
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s_ref, torch.float64)
    tiled = block_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, None,
                           GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3))
    for cfg in (WsConfig(), WsConfig(128, 4), WsConfig(128, 2, 1), WsConfig(256, 3), WsConfig(persistent=True),
                WsConfig(128, 2, 1, persistent=True), WsConfig(256, 4, persistent=True),
                WsConfig(128, 4, persistent=True, tail_split=8), WsConfig(128, 2, 1, persistent=True, tail_split=3),
                WsConfig(128, 3, tail_split=8), WsConfig(256, 3, 2, persistent=True, tail_split=4),
                WsConfig(192, 3), WsConfig(192, 4, persistent=True), WsConfig(192, 2, 1, persistent=True),
                WsConfig(192, 4, persistent=True, tail_split=4)):
        y = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, None, cfg)
        assert rel_err(y, ref) < KERNEL_GEMM_TOL[BF16]
        # slots released after every K group instead of in pairs: the same products, the same bits
        # (split tails: the same order of partial sums)
        assert same_bits(ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, None, cfg, release_every=1), y)
        if gran == "row":  # 1x128 scales N-major (stride (1, N), the copy Fp8BlockLinear keeps): same bits
            w_s_n = w_s.t().contiguous().t()
            assert same_bits(ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s_n, gran, BF16, None, cfg), y)
        if _splits(m, n, k, cfg) == 1:
            assert same_bits(y, tiled)
        else:  # split tail tiles sum their partials in split order: the same bits every call
            assert same_bits(y, ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, None, cfg))
        # whole tiles stored through shared memory by TMA (where the config can) and from the
        # consumers' registers, whichever the default took: the same bits
        if ws_gemm.tma_store_ok(y, cfg, _splits(m, n, k, cfg)):
            assert same_bits(ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, None, cfg, tma_store=True), y)
        assert same_bits(ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, None, cfg, tma_store=False), y)


def _splits(m, n, k, cfg):
    from fp8linear.ops.configs import sm_count

    return ws_gemm.ws_plan(m, n, k, cfg, sm_count(torch.device("cuda")))[2]


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("gran", ["block", "tensor"])
@pytest.mark.parametrize("m,n,k,block_n", [(4096, 576, 7168, 128), (2049, 2112, 7168, 128), (333, 2112, 4096, 128),
                                           (1000, 2112, 4160, 128), (4093, 576, 4224, 128), (2049, 2112, 7168, 256),
                                           (333, 2112, 4096, 256), (4096, 1536, 7168, 256), (3001, 1600, 4160, 256),
                                           (2049, 2112, 7168, 192), (333, 1600, 4160, 192)])
@pytest.mark.parametrize("tail_split", [4, ws_gemm.TAIL_MAX_SPLIT])
def test_split_tail(gran, m, n, k, block_n, tail_split):
    """Shapes whose last wave is split along K (asserted on this GPU's SM count), at the shipped
    split bound and the widest (on 132 SMs, plans of 2 to 11 pieces; the sum unrolls to the split
    rounded up to a power of two, and its loads past the last piece, as at 3, 5, 6 and 11 pieces,
    repeat that piece's and are discarded): against the
    reference, deterministic, the whole tiles bit for bit the unsplit kernel's, the split tiles bit
    for bit their pieces' partials summed in split order, and the counters handed in left at zero."""
    from fp8linear.reference import block_fp8_matmul_ref

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x_q, x_s, w_q, w_s, w_s_ref, b = _operands(m, n, k, gran, True, gen)
    cfg = WsConfig(block_n, 4, persistent=True, tail_split=tail_split)
    assert _splits(m, n, k, cfg) > 1
    counters = torch.zeros(600, dtype=torch.int32, device="cuda")
    y = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, b, cfg, counters)
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s_ref, torch.float64, b)
    assert rel_err(y, ref) < KERNEL_GEMM_TOL[BF16]
    assert int(counters.abs().sum()) == 0
    assert same_bits(y, ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, b, cfg, counters))
    assert same_bits(y, ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, BF16, b, cfg))  # fresh counters
    # in fp32 output, where the split tiles' other order of summation shows (bf16 rounding mostly hides it)
    y32 = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.float32, b, cfg, counters)
    unsplit = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.float32, b, WsConfig(block_n, 4, persistent=True))
    tail = torch.zeros(m, n, dtype=torch.bool, device="cuda")
    for row0, col0 in _tail_tiles(m, n, k, cfg):
        tail[row0:row0 + 128, col0:col0 + block_n] = True
    assert tail.any()
    assert same_bits(y32[~tail], unsplit[~tail])  # whole tiles (none at 333 rows): the unsplit kernel's bits
    assert not same_bits(y32[tail], unsplit[tail])  # the split tiles, summed in another order
    # which is: each piece's fp32 partial (the unsplit kernel over that piece's K groups), added in
    # split order, then the bias
    assert same_bits(y32[tail], _split_order_sum(x_q, x_s, w_q, w_s, gran, b, m, n, k, cfg)[tail])


def _split_order_sum(x_q, x_s, w_q, w_s, gran, b, m, n, k, cfg):
    """fp32 y as a split tail tile computes it: the partials of K groups [first, end) of each piece
    (the unsplit kernel on that piece's K slice: this checks the split, the sum and the bias, not the
    K loop), summed in split order in fp32, plus the bias in fp32."""
    from fp8linear.ops.configs import sm_count

    k_groups = -(-k // 128)
    _, _, split, per_split = ws_gemm.ws_plan(m, n, k, cfg, sm_count(torch.device("cuda")))
    unsplit = WsConfig(cfg.block_n, 4, persistent=True)
    total = None
    for first in range(0, k_groups, per_split):
        end = min(first + per_split, k_groups)
        piece_w_s = w_s if gran == "tensor" else w_s[:, first:end]
        part = ws_gemm.ws_fp8_gemm(x_q[:, first * 128:end * 128].contiguous(), x_s[:, first:end].contiguous(),
                                   w_q[:, first * 128:end * 128].contiguous(), piece_w_s, gran, torch.float32, None,
                                   unsplit)
        total = part if total is None else total + part
    assert first // per_split + 1 == split
    return total + b.float()


def _tail_tiles(m, n, k, cfg):
    """(row, column) offsets of the tiles tail_plan splits, in the kernel's grouped tile order."""
    from fp8linear.ops.configs import sm_count

    num_m, num_n = -(-m // 128), -(-n // cfg.block_n)
    whole = ws_gemm.ws_plan(m, n, k, cfg, sm_count(torch.device("cuda")))[1]
    for tile in range(whole, num_m * num_n):
        per_group = cfg.group_m * num_n
        first_m = tile // per_group * cfg.group_m
        group_m = min(num_m - first_m, cfg.group_m)
        yield (first_m + tile % per_group % group_m) * 128, tile % per_group // group_m * cfg.block_n


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("out", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("gran", ["block", "row"])
def test_bias_and_output_dtypes(out, gran):
    from fp8linear.reference import block_fp8_matmul_ref

    gen = torch.Generator(device="cuda").manual_seed(3)
    x_q, x_s, w_q, w_s, w_s_ref, b = _operands(300, 2112, 4096, gran, True, gen)  # 51 tiles, 2 splits each
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s_ref, torch.float64, b)
    for cfg in (WsConfig(128), WsConfig(256), WsConfig(persistent=True), WsConfig(persistent=True, tail_split=8),
                WsConfig(256, persistent=True, tail_split=8), WsConfig(192),
                WsConfig(192, persistent=True, tail_split=8)):
        y = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, out, b, cfg)
        assert y.dtype == out
        assert rel_err(y, ref) < KERNEL_GEMM_TOL[out]


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("out,gran", [(BF16, "block"), (torch.float16, "block"), (BF16, "row")])
@pytest.mark.parametrize("m,n,k", [(77, 576, 576), (333, 2112, 4096), (4099, 1536, 1536), (8192, 576, 576),
                                   (1000, 4296, 4160), (130, 1000, 1024)])
def test_tma_store_same_bits_as_the_register_store(out, gran, m, n, k):
    """Whole tiles through shared memory by TMA (clipped to M and N: ragged M and N here) and from the
    consumers' registers: the same bits, with bias, every tile width, one program a tile or
    persistent, with and without a split tail (1000x4296: 272 tiles of 128x128, a split last wave),
    and the default's choice (tma_store_pays)."""
    from fp8linear.reference import block_fp8_matmul_ref

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x_q, x_s, w_q, w_s, w_s_ref, b = _operands(m, n, k, gran, True, gen)
    ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s_ref, torch.float64, b)
    y_like = torch.empty(m, n, dtype=out, device="cuda")
    for cfg in (WsConfig(128, 3), WsConfig(128, 4, persistent=True), WsConfig(128, 4, persistent=True, tail_split=4),
                WsConfig(192, 4), WsConfig(192, 4, persistent=True), WsConfig(192, 4, persistent=True, tail_split=4),
                WsConfig(256, 3, persistent=True), WsConfig(256, 3, persistent=True, tail_split=4),
                WsConfig(128, 6, persistent=True)):
        assert ws_gemm.tma_store_ok(y_like, cfg, _splits(m, n, k, cfg))
        y = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, out, b, cfg, tma_store=True)
        assert rel_err(y, ref) < KERNEL_GEMM_TOL[out]
        assert same_bits(ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, out, b, cfg), y)  # the default
        assert same_bits(ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, out, b, cfg, tma_store=False), y)


@pytest.mark.gpu
@needs_ws
def test_tma_store_refused_where_it_cannot_run():
    """Rows of 600 bytes (N = 300) or a config without room for the boxes: the default stores from
    registers, and asking for the TMA store is a clear error."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    for n, cfg in ((300, WsConfig(128, 3)), (576, WsConfig(256, 4, persistent=True))):
        x_q, x_s, w_q, w_s, _, _ = _operands(333, n, 1024, "block", False, gen)
        y = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, "block", BF16, None, cfg)
        assert same_bits(y, ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, "block", BF16, None, cfg, tma_store=False))
        with pytest.raises(ValueError, match="tma_store=True needs a 16-bit output"):
            ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, "block", BF16, None, cfg, tma_store=True)


@pytest.mark.gpu
@needs_ws
def test_graph_capture_and_empty_inputs():
    gen = torch.Generator(device="cuda").manual_seed(5)
    x_q, x_s, w_q, w_s, _, b = _operands(256, 576, 1024, "block", True, gen)
    eager = ws_gemm.ws_fp8_gemm(x_q, x_s, w_q, w_s, "block", BF16, b)
    graph, out = capture_graph(lambda a, s: ws_gemm.ws_fp8_gemm(a, s, w_q, w_s, "block", BF16, b), x_q, x_s)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, eager)
    persistent = WsConfig(persistent=True)
    graph, out = capture_graph(lambda a, s: ws_gemm.ws_fp8_gemm(a, s, w_q, w_s, "block", BF16, b, persistent),
                               x_q, x_s)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, eager)
    assert ws_gemm.ws_fp8_gemm(x_q[:0], x_s[:0], w_q, w_s, "block", BF16, b).shape == (0, 576)


@pytest.mark.gpu
@needs_ws
def test_accepts_on_gpu():
    x = torch.zeros(64, 2112, dtype=torch.uint8, device="cuda").view(FP8)
    assert ws_gemm.ws_accepts(x, x, BF16)
    assert not ws_gemm.ws_accepts(x[:, :2100], x[:, :2100], BF16)  # rows not contiguous
    y = torch.zeros(64, 300, dtype=torch.uint8, device="cuda").view(FP8)
    assert not ws_gemm.ws_accepts(y, y, BF16)  # K % 16
    assert not ws_gemm.ws_accepts(x, x, torch.float64)


@pytest.mark.gpu
@needs_ws
def test_routed_forward_runs_it():
    """backend="triton" sends a long-K prefill GEMM here on the functional path, with the tiled
    kernel's bits; the module's eager plans (the tiled kernel, prepared) give the same bits, and so
    does the module captured in a CUDA graph (this kernel)."""
    import fp8linear
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.router import route_gemm, tma_ok

    gen = torch.Generator(device="cuda").manual_seed(11)
    m, n, k = 1024, 2176, 3584  # 8 x 17 = 136 tiles of 128x128
    x_q, x_s, w_q, w_s, _, _ = _operands(m, n, k, "block", False, gen)
    route = route_gemm(x_q.device, m, n, k, "block", FP8, BF16, None, False, tma_ok(x_q) and tma_ok(w_q), True)
    assert route.kernel == "ws"
    y = fp8linear.block_fp8_matmul(x_q, x_s, w_q, w_s, BF16, backend="triton")
    tiled = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", BF16, None,
                           GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3))
    assert same_bits(y, tiled)
    layer = fp8linear.Fp8BlockLinear.from_linear(torch.nn.Linear(k, n, bias=True, dtype=BF16, device="cuda"),
                                                 backend="triton")
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    first, second, third = layer(x), layer(x), layer(x)  # the second call makes the plan, the third runs it
    functional = fp8linear.fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="triton")
    assert same_bits(first, functional) and same_bits(second, functional) and same_bits(third, functional)
    graph, captured = capture_graph(layer, x)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(captured, functional)


@pytest.mark.gpu
@needs_ws
def test_routed_split_tail_in_a_captured_layer():
    """A layer whose routed WS launch splits its last wave (1000x4300x4160: 272 tiles of 128x128 for
    3 waves, where 128x192 tiles' 2 waves cost more; 33 K groups):
    captured in a CUDA graph it counts in the layer's own counters (no memset in the graph), leaves
    them at zero, and gives the functional path's bits; its eager plans (the tiled kernel) agree with
    the float64 reference."""
    import fp8linear
    from fp8linear.reference import block_fp8_matmul_ref
    from fp8linear.ops import router

    gen = torch.Generator(device="cuda").manual_seed(13)
    m, n, k = 1000, 4300, 4160
    assert router.ws_config(torch.device("cuda"), m, n, k) == router.WS_CONFIG
    assert _splits(m, n, k, router.WS_CONFIG) > 1
    layer = fp8linear.Fp8BlockLinear.from_linear(torch.nn.Linear(k, n, bias=True, dtype=BF16, device="cuda"),
                                                 backend="triton")
    route = router.route_linear(torch.device("cuda"), m, n, k, "block", FP8, BF16, layer.bias, False, True,
                                weight_contiguous=True)
    assert route == router.Route("ws", router.WS_CONFIG)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    functional = fp8linear.fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, backend="triton")
    graph, captured = capture_graph(layer, x)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(captured, functional)
    assert int(layer._split_k_counters.abs().sum()) == 0
    x_q, x_s = fp8linear.quantize_activation(x, fp8_dtype=FP8, backend="triton")
    ref = block_fp8_matmul_ref(x_q, x_s, layer.weight, layer.weight_scale_inv, torch.float64, layer.bias)
    assert rel_err(functional, ref) < KERNEL_GEMM_TOL[BF16]
    eager = [layer(x) for _ in range(3)]  # unplanned, planning, planned: the tiled kernel
    assert all(rel_err(y, ref) < KERNEL_GEMM_TOL[BF16] for y in eager)

