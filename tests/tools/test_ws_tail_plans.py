"""benchmarks/ws_tail_plans.py: its forced plans and sum widths are parsed and checked, on a CPU."""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ws_tail_plans.py"


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(SCRIPT))


def test_plans_parse(script):
    assert script["_plan"]("0,4,8") == (0, 4, 8)
    for bad in ("0,4", "a,b,c", "0,0,8", "-1,2,8"):
        with pytest.raises(argparse.ArgumentTypeError, match="plan"):
            script["_plan"](bad)


@pytest.mark.parametrize("text,width", [("1", 1), ("2", 2), ("4", 4), ("16", 16)])
def test_sum_widths_parse(script, text, width):
    assert script["_width"](text) == width


@pytest.mark.parametrize("bad", ["3", "0", "32", "x"])
def test_bad_sum_widths_are_refused(script, bad):
    with pytest.raises(argparse.ArgumentTypeError, match="sum width"):
        script["_width"](bad)
