"""`fp8linear bench --grid` summaries and `fp8linear tune-routes` table building, without a GPU."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from fp8linear.tools.bench import BenchRow
from fp8linear.ops import route_table
from fp8linear.ops.configs import GemmConfig, SplitKConfig
from fp8linear.ops.cublas_gemm import CublasConfig
from fp8linear.ops.cutlass_gemm import CUTLASS_CANDIDATES
from fp8linear.ops.ws_gemm import WsConfig
from fp8linear.tools import grid, route_tune


def _row(n, k, m, method, us, err=0.03):
    return BenchRow(shape="s", n=n, k=k, m=m, method=method, status="ok", us=us, rel_err=err)


def test_grid_covers_the_targets_m_and_models():
    assert {77, 333, 1000, 1500, 3000, 8192} <= set(grid.GRID_MS)
    assert len(grid.GRID_MS) == 29
    shapes = {(s.n, s.k) for s in grid.grid_shapes()}
    assert len(shapes) == len(grid.grid_shapes())  # distinct
    for needed in (576, 1408, 2112, 18944, 28672):
        assert any(needed in nk for nk in shapes), needed
    assert all((s.n, s.k) in shapes for s in grid.quick_grid_shapes())


@pytest.mark.parametrize("m,label", [(1, "1-64"), (64, "1-64"), (65, "65-512"), (512, "65-512"), (513, "513-2048"),
                                     (2048, "513-2048"), (2049, ">2048"), (8192, ">2048")])
def test_bucket_of(m, label):
    assert grid.bucket_of(m) == label


def test_bucket_of_rejects_zero():
    with pytest.raises(ValueError, match="M must be >= 1"):
        grid.bucket_of(0)


def test_summary_geomeans_and_worst_case():
    rows = []
    # bucket 1-64: ours 1.2x and 0.5x BF16 time; per-tensor half of BF16
    for m, bf, ours in ((1, 10.0, 12.0), (16, 10.0, 5.0)):
        rows += [_row(576, 7168, m, "bf16", bf), _row(576, 7168, m, "cublas_tensor", bf / 2),
                 _row(576, 7168, m, "ours_block", ours), _row(576, 7168, m, "triton_block", ours)]
    rows.append(_row(576, 7168, 4096, "bf16", 100.0))
    rows.append(_row(576, 7168, 4096, "ours_block", 50.0))
    rows.append(_row(576, 7168, 4096, "triton_block", 80.0))
    rows.append(_row(576, 7168, 4096, "ours_row", 999.0, err=5.0))  # a wrong result does not count
    s = grid.summarize_grid(rows)
    b = s["buckets"]["1-64"]
    assert b["cases"] == 2
    assert math.isclose(b["geomean_us"]["ours_block"], math.sqrt(12 * 5))
    assert math.isclose(b["ours_block_over_per_tensor"], math.sqrt(12 / 5 * 5 / 5))
    w = s["worst_ours_vs_bf16"]
    assert math.isclose(w["ratio"], 1.2) and w["case"] == "M=1 N=576 K=7168"
    assert (w["slower"], w["slower_3pct"], w["cases"]) == (1, 1, 3)
    assert s["worst_row_vs_bf16"]["ratio"] is None
    assert math.isclose(s["triton_speedup_vs_bf16_m_ge_2048"], 100 / 80)
    text = grid.format_grid_summary(s)
    assert "worst ours/BF16: 1.20 at M=1 N=576 K=7168" in text and ">2048" in text


def test_forward_is_compared_with_a_bf16_linear_of_the_same_bias():
    """The whole forward (bias included) is measured against F.linear with that bias where the grid
    timed it, the GEMMs against the BF16 GEMM; without bf16_linear the forward falls back to bf16."""
    rows = [_row(576, 7168, 8, "bf16", 10.0), _row(576, 7168, 8, "bf16_linear", 12.0),
            _row(576, 7168, 8, "ours_block", 8.0), _row(576, 7168, 8, "ours_forward", 11.0)]
    s = grid.summarize_grid(rows)
    b = s["buckets"]["1-64"]
    assert math.isclose(b["ours_forward_speedup_vs_bf16"], 12 / 11) and math.isclose(b["ours_block_speedup_vs_bf16"], 10 / 8)
    assert s["worst_forward_vs_bf16"]["slower"] == 0 and math.isclose(s["worst_forward_vs_bf16"]["ratio"], 11 / 12)
    s = grid.summarize_grid([r for r in rows if r.method != "bf16_linear"])
    assert s["worst_forward_vs_bf16"]["slower"] == 1 and math.isclose(s["worst_forward_vs_bf16"]["ratio"], 1.1)
    assert "forward/BF16 nn.Linear: 1.10" in grid.format_grid_summary(s)


def test_bf16_linear_adds_the_bias_and_is_the_forwards_base(tmp_path):
    """On the CPU: bf16_linear's output is checked against the float64 product plus the bias, and the
    forward's row speedup is against it."""
    cfg = grid.grid_config(_args(shapes=["64,256"], m=[3], methods=["bf16", "bf16_linear", "ours_forward"],
                                 replays=1), "cpu", "wall")
    result, _ = grid.run_grid(cfg, tmp_path, log=lambda s: None)
    rows = {r.method: r for r in result.rows}
    assert all(r.status == "ok" for r in rows.values())
    assert rows["bf16_linear"].rel_err < 0.01  # BF16 rounding only: the bias is in the reference it is checked with
    assert math.isclose(rows["ours_forward"].speedup_vs_bf16, rows["bf16_linear"].us / rows["ours_forward"].us)


def _args(**kw):
    base = dict(shapes=None, m=None, quick=True, methods=list(grid.GRID_METHODS), replays=1, backend=None,
                no_bias=False, deadline_s=None, out="unused")
    base.update(kw)
    return argparse.Namespace(**base)


def test_grid_config_quick_and_narrowed():
    cfg = grid.grid_config(_args(), "cpu", "wall")
    assert cfg.ms == grid.QUICK_GRID_MS and len(cfg.shapes) == len(grid.quick_grid_shapes())
    assert cfg.deadline_s == 540.0
    cfg = grid.grid_config(_args(shapes=["64,256"], m=[3], methods=["bf16", "ours_block"]), "cpu", "wall")
    assert [(s.n, s.k) for s in cfg.shapes] == [(64, 256)] and cfg.ms == (3,) and cfg.methods == ("bf16", "ours_block")
    with pytest.raises(ValueError, match="N,K"):
        grid.grid_config(_args(shapes=["64"]), "cpu", "wall")


def test_grid_runs_on_cpu_and_writes_outputs(tmp_path):
    cfg = grid.grid_config(_args(shapes=["64,256"], m=[1, 5], methods=["bf16", "ours_block", "ours_forward"], replays=1),
                           "cpu", "wall")
    result, paths = grid.run_grid(cfg, tmp_path, log=lambda s: None)
    assert {r.method for r in result.rows} == {"bf16", "ours_block", "ours_forward"}
    assert all(r.status == "ok" and r.rel_err < 0.2 for r in result.rows)
    assert paths["csv"].is_file() and paths["json"].is_file()
    doc = json.loads(paths["json"].read_text())
    assert doc["summary"]["grid"]["buckets"]["1-64"]["cases"] == 2


def test_entry_labels_round_trip_through_the_table():
    rows = [{"n": 576, "k": 7168, "m": 1, "heuristic": "splitk:16x64x8w4s4",
             "us": {"bf16": 8.0, "cublas": 9.0, "splitk:16x64x8w4s4": 6.0, "tiled:16x64x128w4s4g8": 7.0}},
            {"n": 576, "k": 7168, "m": 96, "heuristic": "cublas",
             "us": {"bf16": 10.0, "cublas": 9.0, "tiled:64x64x128w4s4g8": 9.5}},
            {"n": 576, "k": 7168, "m": 128, "heuristic": "cublas",
             "us": {"bf16": 10.0, "cublas": 12.0, "tiled:64x128x128w4s3g4": 9.5}},
            {"n": 576, "k": 7168, "m": 256, "heuristic": "cublas",
             "us": {"bf16": 14.0, "cublas": 12.0, "cublas:ws32": 11.0}},
            {"n": 576, "k": 7168, "m": 512, "heuristic": "cublas",
             "us": {"bf16": 14.0, "cublas": 12.0, "cublas:ws1:row": 10.0, "cublas:ws32:row": 10.5}}]
    doc = route_tune.build_table(rows, "X", {"tool": "test"})
    table = route_table.parse_routes(json.loads(json.dumps(doc)))[(576, 7168)]
    assert table[1].kernel == "splitk" and (table[1].config.block_m, table[1].config.split_k) == (16, 8)
    assert table[96].kernel == "cublas"
    assert table[128].kernel == "tiled" and table[128].config.group_m == 4 and table[128].config.num_stages == 3
    assert table[256].kernel == "cublas" and table[256].config.workspace_mib == 32 and table[96].config is None
    assert not table[256].config.row_scales
    assert table[512].kernel == "cublas" and table[512].config.row_scales and table[512].config.workspace_mib == 1
    assert doc["routes"]["576,7168"]["1"]["us"] == 6.0 and doc["routes"]["576,7168"]["1"]["bf16_us"] == 8.0
    report = route_tune.heuristic_report(rows)
    # heuristic 1.0, 1.0, 12/9.5, 12/11, 12/10
    assert (f"geomean {(12 / 9.5 * 12 / 11 * 12 / 10) ** (1 / 5):.3f}, max 1.26" in report
            and "within 1.2x in 4 of 5" in report)


@pytest.mark.parametrize("cfg", CUTLASS_CANDIDATES, ids=lambda c: c.name)
def test_cutlass_labels_round_trip(cfg):
    """Every CUTLASS candidate's label reads back as its config (split-K parts and the tile width
    included), and so does the table entry written from it."""
    entry = route_tune._entry_from_label(route_table.route_label("cutlass", cfg))
    doc = {"kernel": "cutlass", **{k: v for k, v in entry.items() if k != "kernel"}, "fallback": {"kernel": "cublas"}}
    parsed = route_table._entry(doc, "test")
    assert parsed.config == cfg
    assert route_table.parse_entry(json.loads(json.dumps(route_table.entry_to_json(parsed)))).config == cfg


def test_cutlass_entries_need_a_margin_and_keep_a_fallback():
    """CUTLASS becomes the entry only where it beats the fastest other kernel by OPTIONAL_MIN_GAIN; its
    entry then names that kernel as the fallback, with its time."""
    rows = [{"n": 576, "k": 7168, "m": 96, "heuristic": "cublas",
             "us": {"bf16": 12.0, "cublas": 10.0, "tiled:64x64x128w4s4g8": 11.0, "cutlass:64": 9.0, "cutlass:128": 9.5}},
            {"n": 576, "k": 7168, "m": 128, "heuristic": "cublas",  # 2% faster: noise, not an entry
             "us": {"bf16": 12.0, "cublas": 10.0, "cutlass:64": 9.8}},
            {"n": 576, "k": 7168, "m": 192, "heuristic": "cublas",
             "us": {"bf16": 12.0, "splitk:64x64x4w4s4": 10.0, "cutlass:128": 8.0}},
            {"n": 576, "k": 7168, "m": 256, "heuristic": "cublas",
             "us": {"bf16": 12.0, "cublas:ws32": 10.0, "cutlass:128": 9.0, "cutlass:128sk": 7.0}}]
    from fp8linear.ops import cutlass_gemm

    doc = route_tune.build_table(rows, "X", {"tool": "test"})
    raw = doc["routes"]["576,7168"]
    assert raw["96"] == {"kernel": "cutlass", "tile_m": 64, "us": 9.0, "bf16_us": 12.0,
                         "fallback": {"kernel": "cublas", "us": 10.0},
                         "ours": {"kernel": "tiled", "block_m": 64, "block_n": 64, "block_k": 128, "group_m": 8,
                                  "num_warps": 4, "num_stages": 4, "us": 11.0}}
    assert raw["128"]["kernel"] == "cublas" and "fallback" not in raw["128"] and "ours" not in raw["128"]
    table = route_table.parse_routes(json.loads(json.dumps(doc)))[(576, 7168)]
    assert table[192].kernel == "cutlass" and table[192].config.tile_m == 128
    assert table[192].fallback.kernel == "splitk" and table[192].fallback.config.split_k == 4
    assert table[256].config == cutlass_gemm.CutlassConfig(128, stream_k=True)
    assert table[256].fallback.config.workspace_mib == 32
    with pytest.raises(ValueError, match="need a fallback"):  # CUTLASS alone timed: no entry can be made
        route_tune.build_table([{"n": 576, "k": 7168, "m": 1, "heuristic": "x",
                                 "us": {"bf16": 9.0, "cutlass:64": 5.0}}], "X", {})


def test_entries_on_cublas_name_the_fastest_of_ours(monkeypatch):
    """An entry that runs cuBLAS, itself or as an optional kernel's fallback, names the fastest of our
    tiled and split-K kernels (``ours``); the router runs it where cuBLAS may not run (backend
    "triton"); entries on our kernels need none; challengers runs re-time and keep it."""
    from fp8linear.ops import router

    rows = [{"n": 7168, "k": 2048, "m": 512, "heuristic": "cublas",
             "us": {"bf16": 22.0, "cublas": 16.0, "tiled:64x128x128w4s3g8": 24.0, "splitk:64x64x2w4s4": 26.0}},
            {"n": 7168, "k": 2048, "m": 768, "heuristic": "cublas",
             "us": {"bf16": 30.0, "cublas": 25.0, "tiled:64x128x128w4s3g8": 24.0, "splitk:64x64x2w4s4": 26.0}}]
    doc = route_tune.build_table(rows, "X", {})
    table = route_table.parse_routes(json.loads(json.dumps(doc)))[(7168, 2048)]
    assert table[512].kernel == "cublas" and table[512].ours.kernel == "tiled"
    assert table[512].ours.config.block_n == 128
    assert table[768].kernel == "tiled" and table[768].ours is None
    with pytest.raises(ValueError, match="ours is an entry of a kernel in"):
        route_table._entry({"kernel": "cublas", "ours": {"kernel": "cublas"}}, "t")
    dev = torch.device("cpu")
    monkeypatch.setattr(router, "lookup_route", lambda *a: table[512])
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: table[512])
    for allow, kernel in ((True, "cublas"), (False, "tiled")):
        got = router._choose(dev, 512, 7168, 2048, "block", allow, True, False)
        assert got.kernel == kernel, (allow, got)
    assert router._choose(dev, 512, 7168, 2048, "block", False, True, False).config == table[512].ours.config
    assert "tiled:64x128x128w4s3g8" in route_tune._shipped_candidates(512, 7168, 2048, dev, "block")


def test_ours_may_be_the_warp_specialized_kernel_with_a_fallback(monkeypatch):
    """Where the warp-specialized kernel beats our tiled and split-K kernels by the optional kernels'
    margin, ``ours`` names it with the faster of those as its fallback: the router runs it for
    backend "triton" where it can, else the fallback."""
    from fp8linear.ops import router, ws_gemm
    from fp8linear.ops.router import WS_CONFIG

    ws = route_table.route_label("ws", WS_CONFIG)
    rows = [{"n": 8192, "k": 29568, "m": 384, "heuristic": "cublas",
             "us": {"bf16": 263.0, "cublas": 250.0, "splitk:128x128x2w8s4": 354.0, "tiled:64x64x128w4s4g8": 380.0,
                    ws: 312.0}}]
    table = route_table.parse_routes(json.loads(json.dumps(route_tune.build_table(rows, "X", {}))))[(8192, 29568)]
    entry = table[384]
    assert entry.kernel == "cublas" and entry.ours.kernel == "ws" and entry.ours.fallback.kernel == "splitk"
    with pytest.raises(ValueError, match="its fallback is an entry of a kernel in"):
        route_table._entry({"kernel": "cublas", "ours": {"kernel": "ws", "stages": 4,
                                                          "fallback": {"kernel": "cublas"}}}, "t")
    monkeypatch.setattr(router, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(router, "ws_device_ok", lambda device: True)
    dev = torch.device("cpu")
    assert router._choose(dev, 384, 8192, 29568, "block", False, True, False, ws_ok=True) == router.Route("ws", WS_CONFIG)
    assert router._choose(dev, 384, 8192, 29568, "block", False, True, False, ws_ok=False).kernel == "splitk"
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(ws_gemm, "ws_device_ok", lambda device: True)
    assert {ws, "splitk:128x128x2w8s4", "cublas"} <= set(route_tune._shipped_candidates(384, 8192, 29568, dev, "block"))


def test_a_table_entry_stays_unless_beaten_by_the_margin():
    """Re-timing a case the base table has: its kernels stay where the fastest other candidate is
    within OPTIONAL_MIN_GAIN of them (timer spread), and change for a larger gain."""
    held = {"kernel": "cutlass", "tile_m": 64, "fallback": {"kernel": "cublas"}}
    base = route_tune.build_table([{"n": 576, "k": 7168, "m": mm, "heuristic": "cublas",
                                    "us": {"bf16": 12.0, "cublas": 10.0, "cutlass:64": 9.0}} for mm in (96, 128)],
                                  "X", {})
    assert base["routes"]["576,7168"]["96"]["kernel"] == "cutlass"
    rows = [  # CUTLASS now 2.5% faster than cuBLAS only, split-K 1% faster than cuBLAS: both kept
        {"n": 576, "k": 7168, "m": 96, "heuristic": "cublas",
         "us": {"bf16": 12.0, "cublas": 10.0, "splitk:64x64x2w4s4": 9.9, "cutlass:64": 9.75, "cutlass:128": 9.7}},
        # the fallback lost by 5%, and another CUTLASS kernel is 5% faster: both replaced
        {"n": 576, "k": 7168, "m": 128, "heuristic": "cublas",
         "us": {"bf16": 12.0, "cublas": 10.0, "splitk:64x64x2w4s4": 9.5, "cutlass:64": 9.0, "cutlass:128": 8.5}}]
    doc = route_tune.build_table(rows, "X", {}, base=base, merge_ms=True)
    table = route_table.parse_routes(doc)[(576, 7168)]
    kept = route_table.parse_entry(held)
    assert (table[96].kernel, table[96].config, table[96].fallback) == (kept.kernel, kept.config, kept.fallback)
    assert table[96].ours.kernel == "splitk"  # ours is the fastest of ours, measured now
    assert table[128].config.tile_m == 128 and table[128].fallback.kernel == "splitk"
    fresh = route_tune.build_table(rows, "X", {})["routes"]["576,7168"]["96"]  # without the base: the fastest
    assert fresh["kernel"] == "splitk"  # CUTLASS 2% faster than split-K: no entry; the table's stays above


def test_a_table_entrys_ours_stays_unless_beaten_by_the_margin():
    """An entry on cuBLAS keeps its ``ours`` (the warp-specialized kernel and its fallback) where
    re-timing puts another of our kernels within OPTIONAL_MIN_GAIN of it, and changes for a larger gain."""
    ws128, ws256 = "ws:128s4g8pt4", "ws:256s4g8p"
    base = route_tune.build_table([{"n": 7168, "k": 16384, "m": mm, "heuristic": "cublas",
                                    "us": {"bf16": 90.0, "cublas": 50.0, "tiled:64x64x128w4s4g8": 80.0, ws128: 70.0}}
                                   for mm in (160, 192)], "X", {})
    assert base["routes"]["7168,16384"]["160"]["ours"]["kernel"] == "ws"
    rows = [  # WS now 1.3% faster than tiled only, another WS config 0.6% faster than it: both kept
        {"n": 7168, "k": 16384, "m": 160, "heuristic": "cublas",
         "us": {"bf16": 90.0, "cublas": 50.0, "tiled:64x64x128w4s4g8": 79.0, ws128: 78.0, ws256: 77.5}},
        # another WS config 5% faster, a split-K 4% faster than the tiled fallback: both replaced
        {"n": 7168, "k": 16384, "m": 192, "heuristic": "cublas",
         "us": {"bf16": 90.0, "cublas": 50.0, "tiled:64x64x128w4s4g8": 80.0, "splitk:64x64x2w4s4": 76.8,
                ws128: 70.0, ws256: 66.5}}]
    routes = route_tune.build_table(rows, "X", {}, base=base, merge_ms=True)["routes"]["7168,16384"]
    assert routes["160"]["ours"] == {**route_tune._entry_from_label(ws128), "us": 78.0,
                                     "fallback": {**route_tune._entry_from_label("tiled:64x64x128w4s4g8"), "us": 79.0}}
    assert routes["192"]["ours"]["block_n"] == 256 and routes["192"]["ours"]["fallback"]["kernel"] == "splitk"
    fresh = route_tune.build_table(rows, "X", {})["routes"]["7168,16384"]["160"]  # without the base
    assert fresh["ours"]["kernel"] == "tiled"  # WS 1.9% faster than tiled: not by the margin


def test_challengers_merge_per_m():
    """--challengers re-times some Ms of a shape: its entries at the other Ms stay (merge_ms)."""
    base = route_tune.build_table([{"n": 576, "k": 7168, "m": mm, "heuristic": "cublas",
                                    "us": {"bf16": 9.0, "cublas": 8.0}} for mm in (1, 96, 4096)], "X", {})
    rows = [{"n": 576, "k": 7168, "m": 96, "heuristic": "cublas", "us": {"bf16": 9.0, "cublas": 8.0, "cutlass:64": 6.0}}]
    merged = route_tune.build_table(rows, "X", {}, base=base, merge_ms=True)["routes"]["576,7168"]
    assert sorted(merged, key=int) == ["1", "96", "4096"] and merged["96"]["kernel"] == "cutlass"
    replaced = route_tune.build_table(rows, "X", {}, base=base)["routes"]["576,7168"]
    assert list(replaced) == ["96"]


def test_cutlass_challengers_are_the_shipped_entry_and_cutlass(monkeypatch):
    """--challengers cutlass times the shipped entry (a CUTLASS entry's fallback too) against the CUTLASS
    kernels, nothing else."""
    from fp8linear.ops import cutlass_gemm
    from fp8linear.ops.configs import GemmConfig

    tiled = GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    entry = route_table.RouteEntry("cutlass", cutlass_gemm.CutlassConfig(64), route_table.RouteEntry("tiled", tiled))
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: entry)
    monkeypatch.setattr(cutlass_gemm, "cutlass_available", lambda device: True)
    got = route_tune.candidates(96, 576, 7168, torch.device("cpu"), "block", challengers=("cutlass",))
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: None)  # a shape in no table: the heuristic's route
    alone = route_tune.candidates(96, 576, 7168, torch.device("cpu"), "block", challengers=("cutlass",))
    assert len(alone) == 9 and sum(not label.startswith("cutlass") for label in alone) == 1
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: entry)
    assert got == {"tiled:64x64x128w4s4g8": ("tiled", tiled), "cutlass:64": ("cutlass", cutlass_gemm.CutlassConfig(64)),
                   "cutlass:64x64": ("cutlass", cutlass_gemm.CutlassConfig(64, tile_n=64)),
                   "cutlass:128": ("cutlass", cutlass_gemm.CutlassConfig(128)),
                   "cutlass:128x64": ("cutlass", cutlass_gemm.CutlassConfig(128, tile_n=64)),
                   "cutlass:128sk": ("cutlass", cutlass_gemm.CutlassConfig(128, stream_k=True)),
                   **{f"cutlass:128k{s}": ("cutlass", cutlass_gemm.CutlassConfig(128, stream_k=True, splits=s))
                      for s in (2, 3, 4)}}
    monkeypatch.setattr(cutlass_gemm, "cutlass_available", lambda device: False)
    full = route_tune.candidates(96, 576, 7168, torch.device("cpu"), "block")
    assert "tiled:64x64x128w4s4g8" in full and not any(label.startswith("cutlass") for label in full)


def test_ws_labels_round_trip_and_entries_need_a_margin():
    """The warp-specialized kernel's label reads back as its config; like CUTLASS it becomes the entry
    only by OPTIONAL_MIN_GAIN, with the fastest other kernel as its fallback, and the faster of two
    optional kernels wins."""
    from fp8linear.ops.router import WS_CONFIG
    from fp8linear.ops.ws_gemm import WsConfig

    for cfg in (WS_CONFIG, WsConfig(256, 3, 4)):
        entry = route_tune._entry_from_label(route_table.route_label("ws", cfg))
        assert route_table._entry({**entry, "fallback": {"kernel": "cublas"}}, "test").config == cfg
    ws = route_table.route_label("ws", WS_CONFIG)
    rows = [{"n": 7168, "k": 2048, "m": 2048, "heuristic": "cublas", "us": {"bf16": 80.0, "cublas": 60.0, ws: 55.0}},
            {"n": 7168, "k": 2048, "m": 4096, "heuristic": "cublas", "us": {"bf16": 160.0, "cublas": 110.0, ws: 108.0}},
            {"n": 7168, "k": 2048, "m": 8192, "heuristic": "cublas",
             "us": {"bf16": 320.0, "cublas": 230.0, ws: 210.0, "cutlass:128": 200.0}}]
    doc = route_tune.build_table(rows, "X", {"tool": "test"})
    table = route_table.parse_routes(json.loads(json.dumps(doc)))[(7168, 2048)]
    assert table[2048] == route_table.RouteEntry("ws", WS_CONFIG, route_table.RouteEntry("cublas"))
    assert table[4096] == route_table.RouteEntry("cublas")  # 2% faster: noise
    assert table[8192].kernel == "cutlass" and table[8192].fallback == route_table.RouteEntry("cublas")
    with pytest.raises(ValueError, match="not in"):  # an optional kernel is no fallback
        route_table._entry({"kernel": "ws", "stages": 4, "fallback": {"kernel": "cutlass", "tile_m": 64}}, "t")
    with pytest.raises(ValueError, match="persistent must be true or false"):
        route_table._entry({"kernel": "ws", "stages": 4, "persistent": 1, "fallback": {"kernel": "cublas"}}, "t")


def test_ws_challengers_and_candidates(monkeypatch):
    """--challengers ws times the shipped entry (a warp-specialized entry itself where it runs, and its
    fallback) against the warp-specialized kernel; a full sweep times it too, where it runs."""
    from fp8linear.ops import ws_gemm
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.router import WS_CONFIG, WS_MID_CONFIG, WS_WIDE_CONFIG

    ws, wide = route_table.route_label("ws", WS_CONFIG), route_table.route_label("ws", WS_WIDE_CONFIG)
    mid = route_table.route_label("ws", WS_MID_CONFIG)
    assert wide == "ws:256s4g8pt4" and mid == "ws:192s4g8pt4"
    tiled = GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: route_table.RouteEntry("tiled", tiled))
    monkeypatch.setattr(ws_gemm, "ws_device_ok", lambda device: True)
    dev = torch.device("cpu")
    assert route_tune.candidates(2048, 7168, 2048, dev, "block", challengers=("ws",)) == {
        "tiled:64x64x128w4s4g8": ("tiled", tiled), ws: ("ws", WS_CONFIG), mid: ("ws", WS_MID_CONFIG),
        wide: ("ws", WS_WIDE_CONFIG)}
    row = route_tune.candidates(2048, 7168, 2048, dev, "row")
    assert ws in row and wide not in row and mid not in row  # 1x128 weights' per-column scales spill there
    mid_entry = {**route_tune._entry_from_label(mid), "fallback": route_tune._entry_from_label("tiled:64x64x128w4s4g8")}
    assert route_table.parse_entry(mid_entry) == route_table.RouteEntry(
        "ws", WS_MID_CONFIG, route_table.RouteEntry("tiled", tiled))
    assert route_table.RouteEntry("ws", WS_WIDE_CONFIG, route_table.RouteEntry("tiled", tiled)) == route_table.parse_entry(
        {**route_tune._entry_from_label(wide), "fallback": route_tune._entry_from_label("tiled:64x64x128w4s4g8")})
    assert ws not in route_tune.candidates(2048, 7168, 2048, dev, "block", challengers=("cutlass",))
    entry = route_table.RouteEntry("ws", WS_CONFIG, route_table.RouteEntry("tiled", tiled))
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: entry)
    assert set(route_tune.candidates(2048, 7168, 2048, dev, "block", challengers=("ws",))) == {
        "tiled:64x64x128w4s4g8", ws, mid, wide}
    monkeypatch.setattr(ws_gemm, "ws_device_ok", lambda device: False)
    assert route_tune.candidates(2048, 7168, 2048, dev, "block", challengers=("ws",)) == {
        "tiled:64x64x128w4s4g8": ("tiled", tiled)}
    assert ws not in route_tune.candidates(2048, 7168, 2048, dev, "block")
    with pytest.raises(ValueError, match="challengers are optional kernels"):
        route_tune.candidates(2048, 7168, 2048, dev, "block", challengers=("cublass",))


def test_cublas_challengers_time_every_cublas_form(monkeypatch):
    """--challengers cublas times the shipped entry against cuBLAS in every form a full sweep times
    (both workspace limits; for 128x128 weights also as 1x128 weights), and nothing where cuBLAS
    refuses the shape or the GPU."""
    from fp8linear.ops import cublas_gemm
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.cublas_gemm import CublasConfig

    tiled = GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: route_table.RouteEntry("tiled", tiled))
    monkeypatch.setattr(cublas_gemm, "cublas_device_ok", lambda device: True)
    dev = torch.device("cpu")
    forms = {"cublas": ("cublas", None), "cublas:ws32": ("cublas", CublasConfig(32)),
             "cublas:ws1:row": ("cublas", CublasConfig(1, True)), "cublas:ws32:row": ("cublas", CublasConfig(32, True))}
    shipped = {"tiled:64x64x128w4s4g8": ("tiled", tiled)}
    assert route_tune.candidates(128, 576, 2048, dev, "block", challengers=("cublas",)) == {**shipped, **forms}
    assert route_tune.candidates(128, 576, 2048, dev, "row", challengers=("cublas",)) == {
        **shipped, "cublas": forms["cublas"], "cublas:ws32": forms["cublas:ws32"]}
    full = route_tune.candidates(128, 576, 2048, dev, "block")
    assert all(full[label] == cand for label, cand in forms.items())
    assert route_tune.candidates(128, 576, 2040, dev, "block", challengers=("cublas",)) == shipped  # K % 16
    monkeypatch.setattr(cublas_gemm, "cublas_device_ok", lambda device: False)
    assert route_tune.candidates(128, 576, 2048, dev, "block", challengers=("cublas",)) == shipped


@pytest.mark.parametrize("m", [16, 333])
def test_tiled_challengers_time_our_kernels_on_every_config(m, monkeypatch):
    """--challengers tiled times the shipped entry (and its ``ours``) against our tiled and split-K
    kernels on every config a full sweep times, and no cuBLAS or optional kernel."""
    from fp8linear.ops.configs import GemmConfig, SplitKConfig
    from fp8linear.ops.cublas_gemm import CublasConfig

    ours = route_table.RouteEntry("splitk", SplitKConfig(64, 64, 3))
    monkeypatch.setattr(route_table, "lookup_route",
                        lambda *a: route_table.RouteEntry("cublas", CublasConfig(32, True), ours=ours))
    dev = torch.device("cpu")
    got = route_tune.candidates(m, 1024, 4096, dev, "block", challengers=("tiled",))
    full = route_tune.candidates(m, 1024, 4096, dev, "block")
    mine = {lab: c for lab, c in full.items() if c[0] in ("tiled", "splitk")}
    assert mine and all(got[lab] == c for lab, c in mine.items())
    assert got["cublas:ws32:row"] == ("cublas", CublasConfig(32, True))  # the shipped entry
    assert got["splitk:64x64x3w4s4"] == ("splitk", SplitKConfig(64, 64, 3))  # its ours
    assert set(got) - set(mine) == {"cublas:ws32:row"}  # no other cuBLAS form, no optional kernel
    for stages in (3, 4):
        assert ("tiled", GemmConfig(64, 128, 128, num_warps=4, num_stages=stages)) in got.values()


@pytest.mark.parametrize("label", ["cublas:ws32:a384", "cublas:ws1:row:a768", "cublas:ws32:row"])
def test_cublas_algo_labels_round_trip(label):
    from fp8linear.ops.cublas_gemm import CublasConfig

    entry = route_table.parse_entry(route_tune._entry_from_label(label))
    assert isinstance(entry.config, CublasConfig) and route_table.route_label("cublas", entry.config) == label
    for bad in ("cublas:ws32:b384", "cublas:ws32:a384:row", "cublas:ws32:row:a", "cublas:ws32:a3:a4"):
        with pytest.raises(ValueError, match="a cuBLAS label is"):
            route_tune._entry_from_label(bad)


def test_algo_challengers_borrow_the_neighbouring_ms_algorithms(monkeypatch):
    """--challengers algo times the shipped entry against cuBLAS on the algorithms of the next
    ALGO_NEXT_MS larger Ms and the ALGO_PREV_MS smaller ones from ALGO_MIN_M, in the entry's cuBLAS
    form (its fallback's too), else the 32 MiB forms; none below ALGO_MIN_M or at an M that pads
    to the same rows; a full sweep takes the next M's and the previous M's; the fastest becomes the
    entry like any cuBLAS config."""
    from fp8linear.ops import cublas_gemm
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.cublas_gemm import CublasConfig

    monkeypatch.setattr(cublas_gemm, "cublas_device_ok", lambda device: True)
    dev = torch.device("cpu")
    held = CublasConfig(workspace_mib=32, row_scales=True)
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: route_table.RouteEntry("cublas", held))
    got = route_tune.candidates(320, 7168, 2048, dev, "block", challengers=("algo",), algo_ms=[384, 512, 768])
    assert got == {"cublas:ws32:row": ("cublas", held),
                   "cublas:ws32:row:a384": ("cublas", CublasConfig(32, True, 384)),
                   "cublas:ws32:row:a512": ("cublas", CublasConfig(32, True, 512))}
    tiled = GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    monkeypatch.setattr(route_table, "lookup_route", lambda *a: route_table.RouteEntry("tiled", tiled))
    got = route_tune.candidates(333, 7168, 2048, dev, "block", challengers=("algo",), algo_ms=[336, 384, 512])
    assert set(got) == {"tiled:64x64x128w4s4g8", "cublas:ws32", "cublas:ws32:row",  # 333 runs 336 rows
                        "cublas:ws32:a384", "cublas:ws32:row:a384", "cublas:ws32:a512", "cublas:ws32:row:a512"}
    assert set(route_tune.candidates(320, 7168, 2048, dev, "row", challengers=("algo",), algo_ms=[384])) == {
        "tiled:64x64x128w4s4g8", "cublas:ws32", "cublas:ws32:a384"}
    # row counts as cuBLAS runs them (a multiple of 4), each once
    assert set(route_tune.candidates(96, 7168, 2048, dev, "row", challengers=("algo",), algo_ms=[97, 98, 150])) == {
        "tiled:64x64x128w4s4g8", "cublas:ws32", "cublas:ws32:a100", "cublas:ws32:a152"}
    assert set(route_tune.candidates(64, 7168, 2048, dev, "block", challengers=("algo",), algo_ms=[96])) == {
        "tiled:64x64x128w4s4g8"}
    # the two smaller Ms from ALGO_MIN_M (64 is below it, 334 pads to 333's own 336 rows)
    assert set(route_tune.candidates(333, 7168, 2048, dev, "row", challengers=("algo",),
                                     algo_ms=[64, 96, 128, 256, 334, 384])) == {
        "tiled:64x64x128w4s4g8", "cublas:ws32", "cublas:ws32:a384", "cublas:ws32:a128", "cublas:ws32:a256"}
    assert set(route_tune.candidates(333, 7168, 2048, dev, "row", challengers=("algo",), algo_ms=[64, 96])) == {
        "tiled:64x64x128w4s4g8", "cublas:ws32", "cublas:ws32:a96"}
    full = route_tune.candidates(320, 7168, 2048, dev, "block", algo_ms=[64, 128, 256, 384, 512])
    forms = ("ws1", "ws32", "ws1:row", "ws32:row")
    assert {lab for lab in full if ":a" in lab} == {f"cublas:{form}:a{a}" for form in forms for a in (256, 384)}
    def entries(times):
        rows = [{"n": 7168, "k": 2048, "m": 320, "heuristic": "cublas", "us": {"bf16": 30.0, "tiled:64x64x128w4s4g8": 45.0,
                                                                               **times}}]
        return route_table.parse_routes(json.loads(json.dumps(route_tune.build_table(rows, "X", {}))))[(7168, 2048)][320]

    entry = entries({"cublas:ws32:row": 40.0, "cublas:ws32:row:a384": 30.0})
    assert entry.kernel == "cublas" and entry.config == CublasConfig(32, True, 384) and entry.ours.kernel == "tiled"
    # a borrowed algorithm within the margin of its form's own is not named (it may be the same one)
    assert entries({"cublas:ws32:row": 40.0, "cublas:ws32:row:a384": 39.5}).config == CublasConfig(32, True)
    assert entries({"cublas": 40.0, "cublas:ws1:a384": 39.5}).config is None  # the default form's label
    assert entries({"cublas": 40.0, "cublas:ws1:a384": 30.0}).config == CublasConfig(algo_m=384)
    # only the faster of two borrowed algorithms that beat their form counts
    assert entries({"cublas:ws32": 40.0, "cublas:ws32:a384": 38.5, "cublas:ws32:a512": 35.0}).config == CublasConfig(
        32, algo_m=512)


def test_row_rows_go_to_their_section_and_update_keeps_the_other():
    """Rows of row-wise weights fill the row section; a base table's shapes not measured now are kept
    (per granularity), those measured now are replaced; the heuristic report is per granularity."""
    block_rows = [{"n": 576, "k": 7168, "m": 1, "heuristic": "cublas", "us": {"bf16": 8.0, "cublas": 7.0}}]
    row_rows = [{"granularity": "row", "n": 576, "k": 7168, "m": 1, "heuristic": "tiled:16x32x128w4s4g8",
                 "us": {"bf16": 8.0, "cublas": 9.0, "tiled:16x32x128w4s4g8": 7.5}}]
    base = route_tune.build_table(block_rows, "X", {})
    assert "row_routes" not in base
    both = route_tune.build_table(row_rows, "X", {}, base=base)
    assert both["routes"] == base["routes"]
    assert route_table.parse_routes(both, granularity="row")[(576, 7168)][1].kernel == "tiled"
    new_block = [{**block_rows[0], "us": {"bf16": 8.0, "cublas": 9.0, "tiled:16x32x128w4s4g8": 6.0}}]
    again = route_tune.build_table(new_block, "X", {}, base=both)
    assert again["routes"]["576,7168"]["1"]["kernel"] == "tiled" and again["row_routes"] == both["row_routes"]
    other = [{**block_rows[0], "n": 1024, "k": 4096}]
    merged = route_tune.build_table(other, "X", {}, base=again)
    assert merged["routes"]["576,7168"] == again["routes"]["576,7168"] and "1024,4096" in merged["routes"]
    report = route_tune.heuristic_report(block_rows + row_rows)
    assert "(block)" in report and "(row)" in report


def test_write_table_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    route_tune.write_table({"a": 1}, path)
    assert json.loads(path.read_text()) == {"a": 1}

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", boom)
    with pytest.raises(OSError, match="disk full"):
        route_tune.write_table({"a": 2}, path)
    assert json.loads(path.read_text()) == {"a": 1}  # the old table stays whole
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary left


def test_merge_ms_needs_update(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(shapes=["576,7168"], m=[160], quick=False, deadline_s=1.0, out="x", update=False,
                              merge_ms=True, challengers=None, granularity=["block"])
    assert route_tune.run(args) == 2
    assert "give --update too" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_tune_routes_needs_a_gpu(capsys):
    assert route_tune.run(argparse.Namespace(shapes=None, m=None, quick=True, deadline_s=1.0, out="x")) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("n,k,gran,device_ok,expected", [
    (2112, 7168, "block", True, "cublas:ws1:row"), (2112, 7168, "row", True, "cublas"),
    (2112, 7168, "block", False, None), (2112, 300, "block", True, None), (300, 7168, "row", True, None)])
def test_the_sweeps_heuristic_may_take_cublas_wherever_cublas_takes_the_shape(monkeypatch, n, k, gran, device_ok,
                                                                             expected):
    """The heuristic's choice a sweep row records (heuristic_label) is the route of a shape in no
    table on this GPU: cuBLAS is open to it wherever cuBLAS takes the shape (cublas_runs), whatever
    the sweep timed (--challengers times the table's entries only); elsewhere our kernels."""
    from fp8linear.ops import cublas_gemm, router

    monkeypatch.setattr(cublas_gemm, "cublas_device_ok", lambda device: device_ok)
    monkeypatch.setattr(router, "sm_count", lambda device: 132)
    assert route_tune.cublas_runs(n, k, torch.device("cpu"), gran) is (expected is not None)
    label = route_tune.heuristic_label(torch.device("cpu"), 384, n, k, gran)
    if expected is None:
        assert not label.startswith("cublas")
    else:
        assert label == expected


def test_candidate_error_is_the_relative_error_of_the_first_rows():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert route_tune.candidate_error(ref.to(torch.bfloat16), ref) == 0.0
    assert route_tune.candidate_error(torch.tensor([[3.0, 4.0], [0.0, 0.5], [9.0, 9.0]]), ref) == pytest.approx(0.125)
    big = torch.ones(200, 200)
    one_off = big.clone()
    one_off[0, 0] = 0.0  # relative Frobenius error 0.005: the largest element error gives it away
    assert route_tune.candidate_error(one_off, big) == 1.0
    assert route_tune.candidate_error(torch.tensor([[3.0, float("nan")], [0.0, 0.0]]), ref) == math.inf
    assert route_tune.candidate_error(torch.tensor([[3.0, float("inf")], [0.0, 0.0]]), ref) == math.inf
    for bad in (torch.zeros(1, 2), torch.zeros(2, 3), torch.zeros(2)):
        with pytest.raises(ValueError, match=r"a candidate returned shape .* for a \(2, 2\) product"):
            route_tune.candidate_error(bad, ref)


@pytest.mark.parametrize("wrong", ["scaled", "nan", "zero_columns"])
def test_the_sweep_times_no_candidate_whose_product_is_off(monkeypatch, wrong):
    """A kernel that gives a wrong product (a misread scale, NaN, columns left unwritten) is logged
    and not timed, so it can become no table entry; the correct ones are timed. A case where every
    kernel is off gives no row."""
    from fp8linear.ops import gemm, router
    from fp8linear.ops import splitk_gemm
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.reference import block_fp8_matmul_ref

    good, bad = GemmConfig(64, 64, 128, num_warps=4, num_stages=3), GemmConfig(32, 32, 128, num_warps=4, num_stages=3)
    labels = {"tiled:good": ("tiled", good), "tiled:bad": ("tiled", bad)}

    spoil = {"scaled": lambda y: y * 1.05, "nan": lambda y: torch.full_like(y, float("nan")),
             "zero_columns": lambda y: torch.cat([y[:, :64], torch.zeros_like(y[:, 64:])], 1)}[wrong]

    def fake_gemm(x_q, x_s, w_q, w_s, gran, out_dtype, bias, config=None, counters=None):
        y = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, out_dtype)
        return spoil(y) if config is bad else y

    timed = []
    monkeypatch.setattr(route_tune, "candidates", lambda *a, **kw: dict(labels))
    monkeypatch.setattr(route_tune, "prepare_cuda", lambda fn, sets, *a: (timed.append(fn) or fn, None))
    monkeypatch.setattr(route_tune, "rotation_sets", lambda args, nbytes, device: [args])
    monkeypatch.setattr(route_tune, "time_rounds", lambda rounds, replays: {lab: 1.0 for lab in rounds})
    monkeypatch.setattr(route_tune, "heuristic_label", lambda *a: "tiled:good")
    monkeypatch.setattr(gemm, "block_fp8_gemm", fake_gemm)
    monkeypatch.setattr(splitk_gemm, "splitk_counters", lambda n, device: None)
    monkeypatch.setattr(router, "use_n_major_scales", lambda *a: False)
    log = []
    rows = route_tune.sweep([(256, 256)], [3, 16], torch.device("cpu"), 60.0, log.append)
    assert [r["m"] for r in rows] == [3, 16] and all(set(r["us"]) == {"bf16", "tiled:good"} for r in rows)
    dropped = [line for line in log if "tiled:bad" in line]
    assert len(dropped) == 2 and all("against the fp32 product (> 1e-02): not timed" in line for line in dropped)
    assert len(timed) == 4  # BF16 and the good kernel, at each M
    labels.pop("tiled:good")
    log.clear()
    assert route_tune.sweep([(256, 256)], [3], torch.device("cpu"), 60.0, log.append) == []
    assert any("no kernel but optional ones gave a usable product; no entry" in line for line in log)
    labels["cutlass:128"] = ("tiled", good)  # an optional kernel's label alone: no entry without a fallback
    log.clear()
    assert route_tune.sweep([(256, 256)], [3], torch.device("cpu"), 60.0, log.append) == []
    assert any("no kernel but optional ones gave a usable product; no entry" in line for line in log)


@pytest.mark.parametrize("kernel,config", [
    ("cublas", None), ("cublas", CublasConfig(workspace_mib=32, row_scales=True, algo_m=384)),
    ("cublas", CublasConfig(workspace_mib=1)),
    ("tiled", GemmConfig(64, 128, 128, group_m=4, num_warps=4, num_stages=3)),
    ("splitk", SplitKConfig(64, 32, 7, num_warps=8, num_stages=3)),
    ("ws", WsConfig(128, 4, persistent=True, tail_split=4)), ("ws", WsConfig(256, 3, group_m=4)),
], ids=lambda v: repr(v).replace(" ", ""))
def test_route_labels_read_back_as_the_entry_they_name(kernel, config):
    """tune-routes writes table entries from candidates' labels, and bench rows record routes by the
    same labels: each label must parse back to its kernel and config (CUTLASS's:
    test_cutlass_labels_round_trip)."""
    raw = route_tune._entry_from_label(route_table.route_label(kernel, config))
    fallback = None
    if kernel in route_table.OPTIONAL_KERNELS:  # their entries carry the kernel that runs where they cannot
        raw["fallback"], fallback = {"kernel": "cublas"}, route_table.RouteEntry("cublas")
    assert route_table.parse_entry(raw) == route_table.RouteEntry(kernel, config, fallback)


def test_route_labels_name_the_routes_no_table_holds():
    from fp8linear.ops.configs import GemvConfig
    from fp8linear.ops.router import PERSISTENT_CONFIG

    assert route_table.route_label("decode", SplitKConfig(16, 64, 4)) == "decode:16x64x4w4s4"
    assert route_table.route_label("gemv", GemvConfig(8, 2, num_warps=2)) == "gemv:8g2w2s3"
    assert route_table.route_label("persistent", PERSISTENT_CONFIG) == "persistent:128x128x128w8s4g8"
