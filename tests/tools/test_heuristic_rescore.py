"""benchmarks/heuristic_rescore.py: the router's no-table choice scored on a saved route sweep, on a CPU."""

from __future__ import annotations

import gzip
import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "heuristic_rescore.py"


def test_choice_is_the_routers_heuristic_and_scores_against_the_fastest(tmp_path, capsys, monkeypatch):
    mod = runpy.run_path(str(SCRIPT))
    choice = mod["choice"]
    # row-wise weights above 64 rows: the router's ROW_MID_CONFIG tile (no table, our kernels)
    assert choice(333, 18432, 7168, "row", False, 132) == "tiled:64x128x128w4s3g8"
    # a short-K decode GEMM on few tiles: split-K
    assert choice(16, 576, 7168, "block", False, 132).startswith("splitk:")
    rows = [{"granularity": "row", "n": 18432, "k": 7168, "m": 333,
             "us": {"bf16": 100.0, "tiled:64x128x128w4s3g8": 60.0, "tiled:128x128x128w8s4g8": 140.0, "splitk:x": 50.0}},
            {"granularity": "row", "n": 18432, "k": 7168, "m": 2048,
             "us": {"bf16": 500.0, "tiled:64x128x128w4s3g8": 300.0, "cublas": 240.0}}]
    sweep = tmp_path / "route_sweep.json"
    sweep.write_text(json.dumps({"rows": rows}))
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(sweep)])
    mod["main"]()
    out = capsys.readouterr().out
    # ours only: 60/50 at M=333, 300/300 at M=2048
    assert "our kernels row   M 257-1024: choice / fastest geomean 1.200, max 1.20, within 1.2x in 1 of 1" in out
    assert "our kernels row   M >1024   : choice / fastest geomean 1.000" in out
    assert "with cuBLAS row   M >1024   : choice / fastest geomean 1.000" in out  # cuBLAS is the heuristic's choice


def test_ws_width_rule_scored_against_the_fastest_width(tmp_path, capsys, monkeypatch):
    """On 132 SMs the rule takes 128x192 tiles at 576x7168 M=4096 (one wave against two) and 128x256
    at 18432x7168 M=2048 (9 waves x 1.76 against 18 of 128 columns), or 128 there at a cost of inf."""
    mod = runpy.run_path(str(SCRIPT))
    us = {"ws:128s4g8pt4": 50.0, "ws:192s4g8pt4": 40.0, "ws:256s4g8pt4": 60.0}
    rows = [{"granularity": "block", "n": 576, "k": 7168, "m": 4096, "us": dict(us)},
            {"granularity": "block", "n": 18432, "k": 7168, "m": 2048,
             "us": {"ws:128s4g8pt4": 500.0, "ws:192s4g8pt4": 530.0, "ws:256s4g8pt4": 550.0}},
            {"granularity": "row", "n": 576, "k": 7168, "m": 4096, "us": dict(us)},  # not block: not scored
            {"granularity": "block", "n": 576, "k": 7168, "m": 2048, "us": {"ws:128s4g8pt4": 9.0}}]  # one width
    lines = mod["ws_width_scores"](rows, 132, [float("inf")])
    assert lines[0] == ("ws widths, WS_WIDE_TILE_COST 1.76: rule / fastest width geomean 1.049, max 1.10, "
                        "within 1.1x in 2 of 2; picked 192:1 256:1")
    assert lines[1] == ("ws widths, WS_WIDE_TILE_COST inf: rule / fastest width geomean 1.000, max 1.00, "
                        "within 1.1x in 2 of 2; picked 128:1 192:1")
    assert mod["ws_width_scores"](rows[2:], 132, []) == [
        "ws widths: no row timed all three widths (tune-routes --challengers ws)"]
    sweep = tmp_path / "route_sweep.json.gz"  # a sweep kept gzipped, as docs/results/routes holds them
    sweep.write_bytes(gzip.compress(json.dumps({"rows": rows}).encode()))
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(sweep), "--wide-costs", "inf"])
    mod["main"]()
    assert lines[1] in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
