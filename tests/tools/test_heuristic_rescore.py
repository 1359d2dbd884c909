"""benchmarks/heuristic_rescore.py: the router's no-table choice scored on a saved route sweep, on a CPU."""

from __future__ import annotations

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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
