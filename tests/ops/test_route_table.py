"""The router's measured tables (ops/route_table.py) and its heuristic's rules, on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from fp8linear.ops import route_table, router
from fp8linear.ops.configs import GemmConfig
from fp8linear.ops.cublas_gemm import CublasConfig
from fp8linear.ops.configs import SplitKConfig
from fp8linear.ops.cutlass_gemm import CutlassConfig
from fp8linear.ops.ws_gemm import WsConfig


@pytest.fixture(autouse=True)
def _no_pdl_build(monkeypatch):
    """Routes as where no CUTLASS kernel is built for PDL (no library: CI), whatever this machine has
    built; tests about PDL say which kernels are."""
    monkeypatch.setattr(router, "pdl_supported", lambda cfg, bias=False, granularity="block": False)


def _doc(routes):
    return {"format": route_table.ROUTES_FORMAT, "version": route_table.ROUTES_VERSION, "device": "X", "meta": {},
            "routes": routes}


def test_shipped_tables_parse_and_cover_every_bucket():
    files = sorted(route_table.routes_dir().glob("*.json"))
    assert files, "no routes table is shipped"
    for path in files:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for gran in route_table.ROUTE_SECTIONS:
            table = route_table.parse_routes(doc, str(path), gran)
            assert table, (path, gran)
            for (n, k), per_m in table.items():
                ms = sorted(per_m)
                # every M from 1 to the largest measured one has an entry within MAX_M_RATIO
                assert ms[0] == 1
                assert all(b <= a * route_table.MAX_M_RATIO ** 2 for a, b in zip(ms, ms[1:])), (gran, n, k, ms)


@pytest.mark.parametrize("bad,match", [
    ({"format": "other"}, "not a"),
    ({**_doc({}), "version": 99}, "version"),
    (_doc({"12": {}}), "'N,K'"),
    (_doc({"128,256": {"x": {"kernel": "cublas"}}}), "positive integer"),
    (_doc({"128,256": {"4": {"kernel": "magic"}}}), "kernel in"),
    (_doc({"128,256": {"4": {"kernel": "splitk", "block_m": 16}}}), "needs field"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "workspace_mib": 0}}}), "workspace_mib"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "workspace_mib": None}}}), r"routes\['128,256'\]\['4'\].*workspace_mib"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "workspace_mib": 1.9}}}), "workspace_mib must be an integer"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "workspace_mib": True}}}), "workspace_mib must be an integer"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "row_scales": "yes"}}}), "row_scales must be true or false"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "algo_m": "384"}}}), "algo_m must be an integer"),
    (_doc({"128,256": {"4": {"kernel": "cublas", "algo_m": -4}}}), "algo_m must be an int >= 0"),
    (_doc({"128,256": {"4": {"kernel": "splitk", "block_m": 16, "block_n": 64, "split_k": 0,
                             "num_warps": 4, "num_stages": 4}}}), "split_k"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 64}}}), "needs field 'fallback'"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 96, "fallback": {"kernel": "cublas"}}}}), "tile_m"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 64,
                             "fallback": {"kernel": "cutlass", "tile_m": 128}}}}), "fallback is an entry of a kernel not in"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 128, "stream_k": 1, "fallback": {"kernel": "cublas"}}}}),
     "stream_k must be true or false"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 128, "stream_k": True, "splits": "2",
                             "fallback": {"kernel": "cublas"}}}}), "splits must be an integer"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 128, "splits": 2, "fallback": {"kernel": "cublas"}}}}),
     "stream_k must be True"),
    (_doc({"128,256": {"4": {"kernel": "cutlass", "tile_m": 64, "fallback": {"kernel": "tiled"}}}}),
     r"\.fallback: a tiled entry needs field"),
    (_doc({"128,256": {"4": {"kernel": "ws", "stages": 4, "tail_split": "4", "fallback": {"kernel": "cublas"}}}}),
     "tail_split must be an integer"),
    (_doc({"128,256": {"4": {"kernel": "ws", "stages": 4, "tail_split": 0, "fallback": {"kernel": "cublas"}}}}),
     "tail_split must be an int from 1 to 16"),
    (_doc({"128,256": {"4": {"kernel": "ws", "stages": 4, "tail_split": 17, "fallback": {"kernel": "cublas"}}}}),
     "tail_split must be an int from 1 to 16, got 17"),
    (_doc({"128,256": {"4": {"kernel": "ws", "block_n": 160, "stages": 4, "tail_split": 2,
                             "fallback": {"kernel": "cublas"}}}}), "block_n must be 128, 192 or 256, got 160"),
])
def test_bad_tables_are_refused_with_a_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        route_table.parse_routes(bad)


def test_entries_round_trip():
    from fp8linear.ops.cublas_gemm import CublasConfig

    entries = [route_table.RouteEntry("cublas"), route_table.RouteEntry("cublas", CublasConfig(workspace_mib=1)),
               route_table.RouteEntry("cublas", CublasConfig(workspace_mib=32, row_scales=True)),
               route_table.RouteEntry("cublas", CublasConfig(row_scales=True)),
               route_table.RouteEntry("cublas", CublasConfig(workspace_mib=32, row_scales=True, algo_m=384)),
               route_table.RouteEntry("cublas", CublasConfig(algo_m=768)),
               route_table.RouteEntry("tiled", GemmConfig(64, 64, 128, num_warps=4, num_stages=4)),
               route_table.RouteEntry("splitk", SplitKConfig(64, 64, 5, num_warps=4, num_stages=4)),
               route_table.RouteEntry("cutlass", CutlassConfig(64), route_table.RouteEntry("cublas")),
               route_table.RouteEntry("cutlass", CutlassConfig(128),
                                      route_table.RouteEntry("tiled", GemmConfig(128, 128, 128, num_warps=8))),
               route_table.RouteEntry("cutlass", CutlassConfig(128, stream_k=True),
                                      route_table.RouteEntry("cublas", CublasConfig(workspace_mib=32))),
               route_table.RouteEntry("cutlass", CutlassConfig(128, stream_k=True, splits=3),
                                      route_table.RouteEntry("cublas")),
               route_table.RouteEntry("ws", WsConfig(128, 4, persistent=True, tail_split=4),
                                      route_table.RouteEntry("cublas")),
               route_table.RouteEntry("ws", WsConfig(256, 3), route_table.RouteEntry("cublas"))]
    doc = _doc({"576,7168": {str(i + 1): route_table.entry_to_json(e) for i, e in enumerate(entries)}})
    parsed = route_table.parse_routes(json.loads(json.dumps(doc)))
    assert [parsed[(576, 7168)][i + 1] for i in range(len(entries))] == entries


@pytest.mark.parametrize("m,expected", [(64, 64), (65, 96), (77, 96), (96, 96), (100, 96), (143, 96), (145, None),
                                        (1, 1), (4096, 4096), (6000, 4096), (6200, None)])
def test_lookup_takes_the_entry_at_or_above_m(monkeypatch, m, expected):
    table = {(576, 7168): {mm: route_table.RouteEntry("tiled", GemmConfig(16, 64, 128, num_stages=mm % 7 + 1))
                           for mm in (1, 64, 96, 4096)}}
    monkeypatch.setattr(route_table, "_table", lambda name, gran: table if gran == "block" else {})
    monkeypatch.setattr(route_table, "_device_name", lambda index: "X")
    route_table._lookup.cache_clear()  # answers cached for another table
    monkeypatch.setattr(torch.version, "hip", None)
    got = route_table.lookup_route(torch.device("cuda", 0), m, 576, 7168, "block")
    route_table._lookup.cache_clear()
    assert got == (None if expected is None else table[(576, 7168)][expected])
    assert route_table.lookup_route(torch.device("cuda", 0), m, 576, 7168, "row") is None  # not in the row section
    assert route_table.lookup_route(torch.device("cuda", 0), m, 576, 7168, "tensor") is None  # no section
    assert route_table.lookup_route(torch.device("cpu"), m, 576, 7168, "block") is None


def test_row_section_is_read_apart_and_optional():
    """Row-wise weights have their own section; a table without one gives no row entries."""
    block = {"576,7168": {"1": {"kernel": "cublas"}}}
    row = {"576,7168": {"1": route_table.entry_to_json(route_table.RouteEntry("tiled", GemmConfig(16, 32, 128)))}}
    doc = {**_doc(block), "row_routes": row}
    assert route_table.parse_routes(doc)[(576, 7168)][1].kernel == "cublas"
    assert route_table.parse_routes(doc, granularity="row")[(576, 7168)][1] == route_table.RouteEntry(
        "tiled", GemmConfig(16, 32, 128))
    assert route_table.parse_routes(_doc(block), granularity="row") == {}
    with pytest.raises(ValueError, match="'row_routes' must be an object"):
        route_table.parse_routes({**_doc(block), "row_routes": []}, granularity="row")
    with pytest.raises(ValueError, match="granularities"):
        route_table.parse_routes(doc, granularity="tensor")
    # the row-wise section names only the CUTLASS kernels built for 1x128 weights (no stream-K)
    stream_k = {"1": {"kernel": "cutlass", "tile_m": 128, "stream_k": True, "fallback": {"kernel": "cublas"}}}
    with pytest.raises(ValueError, match="not built for row weights"):
        route_table.parse_routes({**_doc(block), "row_routes": {"576,7168": stream_k}}, granularity="row")
    assert route_table.parse_routes({**_doc(block), "routes": {"576,7168": stream_k}})[(576, 7168)][1].kernel == "cutlass"


CPU = torch.device("cpu")  # sm_count: 4 SMs


ROW_FORM = CublasConfig(row_scales=True)


@pytest.mark.parametrize("m,n,k,cublas_ok,kernel,config", [
    (8, 64, 8192, True, "splitk", None),  # decode, a narrow weight: one 16x64 tile on 4 SMs splits
    (128, 512, 8192, True, "cublas", None),  # 4 tiles of 128x128 >= 0.25 and >= 0.5 per SM: the 128x128 grid
    (100, 64, 8192, True, "cublas", ROW_FORM),  # 1 tile of 128x128 < 0.5 x 4 SMs: as 1x128 weights
    (256, 128, 8192, True, "cublas", None),  # 2 tiles = 0.5 x 4 SMs: the 128x128 grid
    (128, 512, 8192, False, "tiled", None),  # 16 tiles of 64x64 fill the 4 SMs: no split
    (100, 64, 8192, False, "splitk", None),  # 2 tiles of 64x64 on 4 SMs: split K
    (70, 256, 256, False, "tiled", router.MID_M_CONFIG),  # 2 K groups: no split; 128x128 tiles leave SMs idle
])
def test_heuristic_rules(m, n, k, cublas_ok, kernel, config):
    route = router._heuristic(CPU, m, n, k, "block", cublas_ok, False, False)
    assert route.kernel == kernel
    if config is not None or kernel == "cublas":
        assert route.config == config
    if kernel == "cublas":  # row-wise weights are 1x128 already: never the 1x128 form
        assert router._heuristic(CPU, m, n, k, "row", cublas_ok, False, False).config is None


@pytest.mark.parametrize("granularity,kernel,config", [
    ("block", "cublas", ROW_FORM), ("row", "cublas", None)])
def test_few_tiles_above_decode_sizes_go_to_cublas_with_1x128_scales(granularity, kernel, config, monkeypatch):
    """1 tile of 128x128 on 132 SMs (an H100), 100 rows: 128x128 weights as 1x128 weights and row-wise
    weights (1x128 already) on cuBLAS, not on our split-K."""
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    route = router._heuristic(CPU, 100, 64, 8192, granularity, True, False, False)
    assert route.kernel == kernel and route.config == config


@pytest.mark.parametrize("m", [1, 16, 23, 24, 64])
@pytest.mark.parametrize("n,k,square,long_k_block,long_k_row", [
    (3072, 3072, True, True, True), (7168, 2048, True, True, True), (2048, 1408, True, True, True),
    (8192, 8192, True, True, True), (1408, 2048, True, True, True),
    (2112, 7168, False, True, True), (1024, 8192, False, True, True), (5120, 13824, False, True, True),
    (4096, 12288, False, True, True), (8192, 28672, False, True, True),
    (8193, 28672, False, False, True), (14336, 16384, False, False, True),
    (18944, 3584, False, False, True), (13824, 5120, False, False, True), (24576, 2048, False, False, True),
    (24576, 1536, False, False, False), (576, 7168, False, False, False), (576, 576, False, False, False),
    (1024, 768, False, False, False)])
def test_decode_goes_to_cublas_on_mid_width_weights(m, n, k, square, long_k_block, long_k_row, monkeypatch):
    """Up to 64 rows, shapes in no table run cuBLAS with 1x128 scales where N is 1024-8192 and K is
    1024 to 1.5 N (measured 0.64-0.94x our split-K's time there); from 24 rows also on long K there
    and, for row-wise weights, on wider weights from K=2048; our kernels elsewhere; not without
    cuBLAS."""
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    long_rows = m >= router.DECODE_CUBLAS_LONG_K_MIN_M
    for granularity, config, long_k in (("block", ROW_FORM, long_k_block), ("row", None, long_k_row)):
        on_cublas = square or (long_rows and long_k)
        assert router.decode_cublas(m, n, k, granularity) is on_cublas
        route = router._heuristic(CPU, m, n, k, granularity, True, False, False)
        assert (route.kernel == "cublas") is on_cublas, (granularity, route)
        if on_cublas:
            assert route.config == config
        assert router._heuristic(CPU, m, n, k, granularity, False, False, False).kernel != "cublas"
    assert not router.decode_cublas(m, n, k, "tensor")  # per-tensor weights: never by this rule


def test_mid_splitk_config():
    cfg = router.mid_splitk_config(100, 64, 8192, CPU)
    assert cfg is not None and (cfg.block_m, cfg.block_n) == router.MID_SPLIT_TILE
    assert 2 <= cfg.split_k <= 8192 // 128 // 2
    assert router.mid_splitk_config(100, 64, 256, CPU) is None  # 2 K groups: nothing to split
    assert router.mid_splitk_config(512, 4096, 8192, CPU) is None  # tiles fill the SMs


@pytest.mark.parametrize("k,splits", [(576, False), (2048, False), (128 * (router.MID_SPLIT_MIN_GROUPS - 1), False),
                                      (128 * router.MID_SPLIT_MIN_GROUPS, True), (7168, True)])
def test_mid_m_split_k_only_on_long_k(k, splits, monkeypatch):
    """Above SMALL_M_MAX rows split-K runs only from MID_SPLIT_MIN_GROUPS K groups (shorter K: the
    tiled kernel, whatever the idle SMs), on a GPU of 132 SMs, with our kernels only."""
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    assert (router.mid_splitk_config(333, 576, k, CPU) is not None) is splits
    route = router._ours(CPU, 333, 576, k, "block", False, False)
    assert route.kernel == ("splitk" if splits else "tiled"), route


def test_table_entry_wins_over_the_heuristic(monkeypatch):
    split = SplitKConfig(64, 128, 3, num_warps=4, num_stages=4)
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("splitk", split))
    assert router._choose(CPU, 300, 576, 7168, "block", True, False, False) == router.Route("splitk", split)
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("cublas"))
    assert router._choose(CPU, 300, 576, 7168, "block", True, False, False) == router.Route("cublas")
    from fp8linear.ops.cublas_gemm import CublasConfig

    small = CublasConfig(workspace_mib=1)
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("cublas", small))
    assert router._choose(CPU, 300, 576, 7168, "block", True, False, False) == router.Route("cublas", small)
    # cuBLAS measured fastest but not allowed here (backend "triton", an eager cut, a bias dtype): ours
    assert router._choose(CPU, 300, 576, 7168, "block", False, False, False).kernel in ("splitk", "tiled")


def test_cutlass_entry_runs_where_built_else_its_fallback(monkeypatch):
    """A CUTLASS entry routes to CUTLASS where the library is usable for the call (cutlass_ok), else
    to the kernel measured next (its fallback), and from there as any entry: a cuBLAS fallback where
    cuBLAS is not allowed either goes to our kernels."""
    split = SplitKConfig(64, 128, 3, num_warps=4, num_stages=4)
    entry = route_table.RouteEntry("cutlass", CutlassConfig(64), route_table.RouteEntry("splitk", split))
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    assert router._choose(CPU, 300, 576, 7168, "block", True, False, False, True) == router.Route("cutlass",
                                                                                                  CutlassConfig(64))
    assert router._choose(CPU, 300, 576, 7168, "block", True, False, False, False) == router.Route("splitk", split)
    on_cublas = route_table.RouteEntry("cutlass", CutlassConfig(128), route_table.RouteEntry("cublas"))
    monkeypatch.setattr(router, "lookup_route", lambda *a: on_cublas)
    assert router._choose(CPU, 300, 576, 7168, "block", True, False, False, False) == router.Route("cublas")
    assert router._choose(CPU, 300, 576, 7168, "block", False, False, False, False).kernel in ("splitk", "tiled")


@pytest.mark.parametrize("allow,bias_dtype,k,dense,cutlass", [
    (True, None, 7168, True, True),
    (True, torch.bfloat16, 7168, True, True),  # a fused bf16 bias
    (False, None, 7168, True, False),  # backend "triton": never CUTLASS
    (True, torch.float16, 7168, True, False),  # a bias CUTLASS does not fuse
    (True, None, 7160, True, False),  # K not a multiple of 16: TMA cannot address the rows
    (True, None, 7168, False, False),  # a strided weight or scale view: the kernels read dense operands
])
def test_routes_ask_for_cutlass_only_where_it_runs(monkeypatch, allow, bias_dtype, k, dense, cutlass):
    """route_gemm and route_linear take a CUTLASS entry only where the built kernels compute the
    call; eager calls below EAGER_CUBLAS_MIN_MNK never (a library call's host cost); where the
    library is not built the fallback runs."""
    split = SplitKConfig(64, 128, 3, num_warps=4, num_stages=4)
    entry = route_table.RouteEntry("cutlass", CutlassConfig(64), route_table.RouteEntry("splitk", split))
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    n, fp8, bf16 = 576, torch.float8_e4m3fn, torch.bfloat16
    bias = None if bias_dtype is None else torch.zeros(n, dtype=bias_dtype)
    expected = "cutlass" if cutlass else "splitk"
    assert router.route_gemm(CPU, 4096, n, k, "block", fp8, bf16, bias, allow, True, dense).kernel == expected
    assert router.route_gemm(CPU, 4096, n, k, "block", fp8, bf16, bias, allow, True).kernel == "splitk"  # not said
    assert router.route_linear(CPU, 4096, n, k, "block", fp8, bf16, bias, allow, True,
                               weight_contiguous=dense).kernel == expected
    assert router.route_linear(CPU, 4096, n, k, "block", fp8, bf16, bias, allow, True, eager=True,
                               weight_contiguous=dense).kernel == expected
    assert 100 * n * k < router.EAGER_CUBLAS_MIN_MNK
    assert router.route_linear(CPU, 100, n, k, "block", fp8, bf16, bias, allow, True, eager=True,
                               weight_contiguous=dense).kernel != "cutlass"
    # 1x128 weights have their own CUTLASS kernels (unbiased here)
    assert router.route_gemm(CPU, 4096, n, k, "row", fp8, bf16, None, allow, True, dense).kernel == (
        "cutlass" if allow and k % 16 == 0 and dense else "splitk")
    # eagerly only where a table names CUTLASS: the tiled kernel is not replaced for 1x128 weights
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("tiled", router.MID_M_CONFIG))
    monkeypatch.setattr(router, "EAGER_CUTLASS_MIN_MNK", 0)
    assert router.route_linear(CPU, 4096, n, k, "row", fp8, bf16, None, allow, True, eager=True,
                               weight_contiguous=dense).kernel != "cutlass"
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(router, "cutlass_available", lambda device: False)  # not built: the fallback
    assert router.route_gemm(CPU, 4096, n, k, "block", fp8, bf16, bias, allow, True, dense).kernel == "splitk"


@pytest.mark.parametrize("m,n,expected", [
    (512, 576, CutlassConfig(64, tile_n=64)),  # 8 x 9 tiles of 64x64 fit one wave of 132 SMs
    (256, 2112, CutlassConfig(64, tile_n=64)),  # 4 x 33 = 132: still one wave
    (16, 7168, CutlassConfig(64, tile_n=64)),  # 112
    (333, 1536, CutlassConfig(64)),  # 6 x 24 = 144 do not; 6 x 12 64x128 tiles do (128x64 too: the 64-row first)
    (64, 24576, CutlassConfig(64)),  # 384 64x64 tiles; up to 64 rows the 64x128 tiles at any N
    (96, 7168, CutlassConfig(64)),  # 2 x 112 64x64 tiles, 2 x 56 64x128 ones
    (512, 2112, CutlassConfig(128, tile_n=64)),  # 8 x 17 = 136 64x128 tiles do not; 4 x 33 128x64 ones do
    (1024, 2112, CutlassConfig(128)),  # 264 128x64 tiles do not either: cooperative 128x128
    (1, 576, CutlassConfig(64, tile_n=64)),
])
def test_eager_cutlass_config_runs_64x64_tiles_where_they_fit_one_wave(monkeypatch, m, n, expected):
    """64x64 tiles where they fit in one wave of the SMs (a long K loop then runs on twice the SMs),
    else 64x128 tiles where those do or up to 64 rows, else 128x64 tiles where those do, else
    128x128 tiles."""
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    assert router.eager_cutlass_config(CPU, m, n) == expected


@pytest.mark.parametrize("m,n,expected", [
    (448, 2112, CutlassConfig(64)),  # 7 x 17 64-row tiles fit one wave of 132 SMs: ping-pong
    (512, 2112, CutlassConfig(128, tile_n=64)),  # 8 x 17 = 136 do not; 4 x 33 128x64 tiles do
    (640, 2112, CutlassConfig(128)),  # 5 x 33 = 165 128x64 tiles do not either: cooperative 128x128
    (1024, 1536, CutlassConfig(128)),
    (1500, 576, CutlassConfig(64)),
])
def test_eager_calls_run_cutlass_in_place_of_our_tiled_kernel(monkeypatch, m, n, expected):
    """Above SMALL_M_MAX rows an eager call whose route is our tiled kernel (its table's cuBLAS entry
    refused eagerly, or no entry) runs CUTLASS where it runs (its host cost is below the GPU time it
    saves there), on eager_cutlass_config's tile; graph/compiled calls, backend "triton", a library
    not built, a strided weight, a table entry naming the tiled kernel, other kernels and decode
    sizes keep the route."""
    tiled = router.Route("tiled", GemmConfig(128, 128, 128, num_warps=8, num_stages=3))
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("cublas"))
    monkeypatch.setattr(router, "_ours", lambda *a: tiled)  # cuBLAS not allowed: our kernel's route
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    k, fp8, bf16 = 7168, torch.float8_e4m3fn, torch.bfloat16

    def route(m=m, allow=True, eager=True, dense=True, bias=None):
        return router.route_linear(CPU, m, n, k, "block", fp8, bf16, bias, allow, True, eager=eager,
                                   weight_contiguous=dense)

    assert m * n * k >= router.EAGER_CUTLASS_MIN_MNK
    assert route() == router.Route("cutlass", expected)
    assert router.eager_cutlass_config(CPU, m, n) == expected
    assert route(bias=torch.zeros(n, dtype=bf16)).kernel == "cutlass"
    assert route(eager=False).kernel == "tiled"
    assert route(allow=False).kernel == "tiled"
    assert route(dense=False).kernel == "tiled"
    assert route(bias=torch.zeros(n, dtype=torch.float16)).kernel == "tiled"
    monkeypatch.setattr(router, "EAGER_CUTLASS_MIN_MNK", 0)
    monkeypatch.setattr(router, "_one_launch_decode_ok", lambda device: False)
    assert route(m=router.SMALL_M_MAX).kernel == "tiled"  # decode sizes keep our kernel at any cut
    assert route(m=router.SMALL_M_MAX + 1).kernel == "cutlass"
    monkeypatch.undo()
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("cublas"))
    monkeypatch.setattr(router, "_ours", lambda *a: tiled)
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    below = (router.EAGER_CUTLASS_MIN_MNK - 1) // (n * k)  # host-bound sizes keep our kernel
    assert below > router.SMALL_M_MAX and route(m=below).kernel != "cutlass"
    monkeypatch.setattr(router, "cutlass_available", lambda device: False)
    assert route().kernel == "tiled"
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    monkeypatch.setattr(router, "lookup_route", lambda *a: None)  # a shape in no table
    assert route() == router.Route("cutlass", expected)
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("tiled", tiled.config))
    assert route().kernel == "tiled"  # the table timed it against CUTLASS
    split = route_table.RouteEntry("splitk", SplitKConfig(64, 128, 3, num_warps=4, num_stages=4))
    monkeypatch.setattr(router, "lookup_route", lambda *a: split)
    assert route().kernel == "splitk"


@pytest.mark.parametrize("m,n,k", [
    (2, 2112, 7168), (16, 7168, 2048), (64, 576, 7168), (96, 24576, 1536), (333, 2112, 7168), (512, 1536, 7168),
])
def test_host_bound_eager_calls_run_cutlass_in_one_host_call(monkeypatch, m, n, k):
    """Below EAGER_CUTLASS_MIN_MNK, from EAGER_ONE_CALL_MIN_M rows, an eager call of a 128x128 weight
    runs eager_cutlass_config's kernel where the library quantizes its input and the plan-call module
    allocates (one host call), whatever the table or the one-launch decode kernel would run, under PDL
    where the kernel is built for it; one token, graph/compiled calls, 1x128 weights, fp16
    inputs, inputs above LIB_QUANT_MAX_ELEMENTS, GEMMs from the cut on, a strided weight and several
    GPUs or no plan-call module keep the route they had."""
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    one_call = [True]
    monkeypatch.setattr(router, "one_call_available", lambda: one_call[0])
    built_for_pdl = [True]
    monkeypatch.setattr(router, "pdl_supported", lambda cfg, bias=False: built_for_pdl[0])
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert m * n * k < router.EAGER_CUTLASS_MIN_MNK and m * k <= router.LIB_QUANT_MAX_ELEMENTS

    def route(m=m, k=k, eager=True, granularity="block", out=bf16, dense=True):
        return router.route_linear(CPU, m, n, k, granularity, fp8, out, None, True, True, eager=eager,
                                   weight_contiguous=dense)

    cfg = router.eager_cutlass_config(CPU, m, n)
    assert route() == router.Route("cutlass", cfg, pdl=True)
    built_for_pdl[0] = False  # a kernel the build did not make to wait in every warp: launched plain
    assert route() == router.Route("cutlass", cfg)
    built_for_pdl[0] = True
    with monkeypatch.context() as patch:
        patch.setattr(router, "EAGER_CUTLASS_PDL_MAX_WEIGHT", n * k)
        assert route() == router.Route("cutlass", cfg)
    for other in (route(eager=False), route(granularity="row"), route(out=torch.float16), route(dense=False)):
        assert other.kernel != "cutlass", other
    for name, value in (("EAGER_ONE_CALL_MIN_M", m + 1),  # fewer rows than the rule's
                        ("LIB_QUANT_MAX_ELEMENTS", m * k - 1),  # an input the library does not quantize
                        ("EAGER_ONE_CALL_MAX_WEIGHT", n * k)):  # large weights: the GPU sets the pace
        with monkeypatch.context() as patch:
            patch.setattr(router, name, value)
            assert route().kernel != "cutlass", name
    with monkeypatch.context() as patch:  # from the cut on: the other eager rules (CUTLASS where tiled ran)
        patch.setattr(router, "EAGER_CUTLASS_MIN_MNK", m * n * k)
        with_rule = route()
        patch.setattr(router, "EAGER_ONE_CALL_MIN_M", 1 << 62)
        assert route() == with_rule
    one_call[0] = False
    assert route().kernel != "cutlass"
    one_call[0] = True
    monkeypatch.setenv("FP8LINEAR_PDL", "0")  # no PDL: the same kernel launched plain
    assert route() == router.Route("cutlass", cfg)
    monkeypatch.setenv("FP8LINEAR_PDL", "2")
    with pytest.raises(ValueError, match="FP8LINEAR_PDL must be 0 or 1"):
        route()


def test_the_one_call_rule_launches_the_cooperative_kernel_with_pdl_where_it_is_built_for_it(monkeypatch):
    """Where eager_cutlass_config picks the cooperative kernel (its tiles overflow a wave), the one-call
    route launches it with PDL where the build made its scale-loading warp wait (pdl_supported, asked
    with the bias it runs), else plain."""
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    monkeypatch.setattr(router, "one_call_available", lambda: True)
    asked = []
    monkeypatch.setattr(router, "pdl_supported", lambda cfg, bias=False: asked.append((cfg, bias)) or cfg.tile_m == 64)
    m, n, k = 96, 24576, 1536  # 2 x 192 64-row tiles: more than a wave
    assert m * n * k < router.EAGER_CUTLASS_MIN_MNK
    bias = torch.zeros(n, dtype=torch.bfloat16)
    got = router.route_linear(CPU, m, n, k, "block", torch.float8_e4m3fn, torch.bfloat16, bias, True, True,
                              eager=True, weight_contiguous=True)
    assert got == router.Route("cutlass", CutlassConfig(128), pdl=False) and asked == [(CutlassConfig(128), True)]
    monkeypatch.setattr(router, "pdl_supported", lambda cfg, bias=False: True)
    got = router.route_linear(CPU, m, n, k, "block", torch.float8_e4m3fn, torch.bfloat16, None, True, True,
                              eager=True, weight_contiguous=True)
    assert got == router.Route("cutlass", CutlassConfig(128), pdl=True)
    # up to 64 rows both kernels make the same 192 tiles, the 64-row ones without empty rows
    assert router.eager_cutlass_config(CPU, 64, n) == CutlassConfig(64)
    assert router.eager_cutlass_config(CPU, 65, n) == CutlassConfig(128)


@pytest.mark.parametrize("m,n,k,replaced", [
    (512, 24576, 1536, True),  # 4 x 192 = 768 tiles of 128x128: 0.97 of 6 waves of 132 SMs
    (2048, 7168, 2048, True),  # 896 tiles: 0.97 of 7 waves
    (256, 7168, 18432, True),  # 112 tiles: 0.85 of one wave
    (2048, 1536, 7168, False),  # 192 tiles: 0.73 of 2 waves
    (2048, 2112, 7168, False),  # 272 tiles: 0.69 of 3 waves
    (1024, 2112, 7168, False),  # 136 tiles: 0.52 of 2 waves
    (512, 2112, 18432, False),  # 128x64 tiles (one wave) run there, not timed against cuBLAS
    (2048, 24576, 1536, False),  # above EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK: the GPU sets the pace
    (512, 7168, 18432, False),
    (128, 4096, 24576, False),  # 64x64 tiles (128: one wave) run there; their 64x128 tiles fill 0.48 of one
])
def test_eager_calls_run_cutlass_in_place_of_cublas_where_its_tiles_fill_their_waves(monkeypatch, m, n, k, replaced):
    """An eager call routed to cuBLAS (128x128 weights, above SMALL_M_MAX rows, M*N*K at most
    EAGER_CUTLASS_OVER_CUBLAS_MAX_MNK) runs eager_cutlass_config's kernel where its tiles fill
    EAGER_CUTLASS_MIN_WAVE_FILL of their waves; graph/compiled calls, 1x128 weights and a library
    not built keep cuBLAS."""
    monkeypatch.setattr(router, "lookup_route", lambda *a: route_table.RouteEntry("cublas"))
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    monkeypatch.setattr(router, "cublas_device_ok", lambda device: True)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert m * n * k >= router.EAGER_CUBLAS_MIN_MNK

    def route(eager=True, granularity="block"):
        return router.route_linear(CPU, m, n, k, granularity, fp8, bf16, None, True, True, eager=eager,
                                   weight_contiguous=True)

    assert router.eager_cutlass_over_cublas(CPU, m, n, k) is replaced
    cfg = router.eager_cutlass_config(CPU, m, n)
    assert route() == (router.Route("cutlass", cfg) if replaced else router.Route("cublas"))  # none built for PDL
    monkeypatch.setattr(router, "pdl_supported", lambda cfg, bias=False: True)
    # the GEMM with PDL where the library quantizes the input (one call) and the weight is below the cut
    pdl = m * k <= router.LIB_QUANT_MAX_ELEMENTS and n * k < router.EAGER_CUTLASS_PDL_MAX_WEIGHT
    assert route() == (router.Route("cutlass", cfg, pdl=pdl) if replaced else router.Route("cublas"))
    with monkeypatch.context() as patch:
        patch.setattr(router, "EAGER_CUTLASS_PDL_MAX_WEIGHT", n * k)  # GPU-bound weights: launched plain
        assert route() == (router.Route("cutlass", cfg) if replaced else router.Route("cublas"))
    monkeypatch.setenv("FP8LINEAR_PDL", "0")
    assert route() == (router.Route("cutlass", cfg) if replaced else router.Route("cublas"))
    monkeypatch.delenv("FP8LINEAR_PDL")
    assert route(eager=False).kernel == "cublas"
    assert route(granularity="row").kernel == "cublas"
    monkeypatch.setattr(router, "cutlass_available", lambda device: False)
    assert route().kernel == "cublas"


def test_eager_cutlass_entries_start_at_the_eager_cut(monkeypatch):
    """A table's CUTLASS entry runs eagerly from EAGER_CUTLASS_MIN_MNK (below it the one-launch decode
    kernel or the fallback runs), and at any size under graphs."""
    assert router.EAGER_CUTLASS_MIN_MNK > router.ONE_LAUNCH_MAX_MNK  # the one-launch kernel's range stays its own
    split = SplitKConfig(64, 128, 3, num_warps=4, num_stages=4)
    entry = route_table.RouteEntry("cutlass", CutlassConfig(128, stream_k=True), route_table.RouteEntry("splitk", split))
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(router, "cutlass_available", lambda device: True)
    n, k, fp8, bf16 = 2112, 7168, torch.float8_e4m3fn, torch.bfloat16
    below = (router.EAGER_CUTLASS_MIN_MNK - 1) // (n * k)
    for m, eager, kernels in ((below, True, ("splitk", "decode")), (below + 1, True, ("cutlass",)),
                              (below, False, ("cutlass",))):
        got = router.route_linear(CPU, m, n, k, "block", fp8, bf16, None, True, True, eager=eager,
                                  weight_contiguous=True)
        assert got.kernel in kernels, (m, eager, got)


def test_rocm_keeps_its_tiles_above_decode_sizes(monkeypatch):
    """The mid-M split-K and 64x64 rules were measured on NVIDIA only: on ROCm, M > 64 takes the
    tables' or AMD heuristic's tiled config as before."""
    monkeypatch.setattr(torch.version, "hip", "test")
    monkeypatch.setattr(router, "select_config", lambda device, m, n, k, gran="block": GemmConfig(32, 32, 128))
    for m, n, k in ((100, 64, 8192), (70, 256, 256)):
        route = router._heuristic(CPU, m, n, k, "block", False, False, False)
        assert route == router.Route("tiled", GemmConfig(32, 32, 128)), (m, n, k)
    assert router._heuristic(CPU, 8, 64, 8192, "block", False, False, False).kernel == "splitk"  # decode rules stay
