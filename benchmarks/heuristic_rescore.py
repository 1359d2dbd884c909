"""The router's choice for shapes in no table, scored offline on a route sweep (no GPU needed).

`fp8linear tune-routes` writes ``route_sweep.json``: per (granularity, N, K, M) the time of every
candidate kernel it timed. This script asks the current router what it would run there without a
routes table (its heuristic, with the warp-specialized kernel's rule, as in CUDA graphs), with
cuBLAS allowed where the sweep timed cuBLAS's default form ("cublas") and without it (our kernels,
``backend="triton"``), and prints that choice's time over the fastest candidate's, per granularity
and M bucket. So a heuristic can be refitted on a CPU from a sweep made once on the GPU.

    python benchmarks/heuristic_rescore.py route_sweep.json[.gz] [--sms 132] [--wide-costs 1.6 2.0 inf]

The device-dependent inputs are fixed: `--sms` streaming multiprocessors (H100 and H200: 132), a
Hopper GPU (warp-specialized kernel available), no persistent TMA kernel, no tables. A choice the
sweep did not time is counted apart.

It also scores the warp-specialized kernel's tile-width rule (`router.ws_config`) alone, on the
rows where the sweep timed all three of its persistent configs (`tune-routes --challengers ws`):
the rule's width against the fastest of the three, at the shipped `WS_WIDE_TILE_COST` and at each
of `--wide-costs` (``inf``: never 128x256 tiles).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections import defaultdict
from unittest import mock

import torch

from fp8linear.ops import router
from fp8linear.ops.route_table import route_label

_OURS = ("tiled", "splitk", "ws")
_BUCKETS = ((1, 64, "1-64"), (65, 256, "65-256"), (257, 1024, "257-1024"), (1025, 1 << 62, ">1024"))


def choice(m: int, n: int, k: int, granularity: str, cublas: bool, sms: int) -> str:
    """The label (route_tune's) of what the router runs for this GEMM without a table."""
    dev = torch.device("cuda", 0)
    with mock.patch.object(router, "sm_count", lambda d: sms), \
            mock.patch.object(router, "ws_device_ok", lambda d: True), \
            mock.patch.object(router, "select_config",
                              lambda d, m_, n_, k_, g="block": router.heuristic_config(m_, n_, k_, g)), \
            mock.patch.object(router, "use_persistent", lambda *a: False), \
            mock.patch.object(router, "lookup_route", lambda *a: None):
        route = router._heuristic(dev, m, n, k, granularity, cublas, True, False)
        route = router._ws_in_place_of_tiled(route, dev, m, n, k, granularity, True)
    return route_label(route.kernel, route.config)


def ws_width_scores(rows: list[dict], sms: int, wide_costs: list[float]) -> list[str]:
    """One line per 128x256 tile cost (the shipped one first): the rule's width's time over the
    fastest width's, on the block rows that timed every config of router.WS_CONFIGS_BY_WIDTH."""
    labels = {width: route_label("ws", cfg) for width, cfg in router.WS_CONFIGS_BY_WIDTH.items()}
    timed = [r for r in rows if r.get("granularity", "block") == "block" and all(v in r["us"] for v in labels.values())]
    if not timed:
        return ["ws widths: no row timed all three widths (tune-routes --challengers ws)"]
    lines = []
    for cost in [router.WS_WIDE_TILE_COST] + wide_costs:
        ratios, picked = [], defaultdict(int)
        with mock.patch.object(router, "sm_count", lambda d: sms), \
                mock.patch.object(router, "WS_WIDE_TILE_COST", cost):
            for r in timed:
                width = router.ws_config(torch.device("cuda", 0), r["m"], r["n"], r["k"]).block_n
                picked[width] += 1
                ratios.append(r["us"][labels[width]] / min(r["us"][v] for v in labels.values()))
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(f"ws widths, WS_WIDE_TILE_COST {cost:g}: rule / fastest width geomean {gm:.3f}, "
                     f"max {max(ratios):.2f}, within 1.1x in {sum(x <= 1.1 for x in ratios)} of {len(ratios)}; "
                     "picked " + " ".join(f"{w}:{picked[w]}" for w in sorted(picked)))
    return lines


def _bucket(m: int) -> str:
    return next(label for lo, hi, label in _BUCKETS if lo <= m <= hi)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sweep")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--wide-costs", nargs="*", type=float, default=[],
                   help="also score the tile-width rule at these 128x256 tile costs (inf: never)")
    a = p.parse_args()
    with (gzip.open if a.sweep.endswith(".gz") else open)(a.sweep, "rt") as f:
        rows = json.load(f)["rows"]
    for cublas in (True, False):
        for gran in dict.fromkeys(r.get("granularity", "block") for r in rows):
            ratios: dict[str, list[float]] = defaultdict(list)
            untimed: dict[str, int] = defaultdict(int)
            for r in rows:
                if r.get("granularity", "block") != gran or (cublas and "cublas" not in r["us"]):
                    continue
                label = choice(r["m"], r["n"], r["k"], gran, cublas, a.sms)
                pool = {lab: us for lab, us in r["us"].items() if lab != "bf16" and (cublas or lab.startswith(_OURS))}
                if label not in pool:
                    untimed[label] += 1
                    continue
                ratio = pool[label] / min(pool.values())
                ratios[_bucket(r["m"])].append(ratio)
                ratios["all"].append(ratio)
            what = "with cuBLAS" if cublas else "our kernels"
            for b in [lab for _, _, lab in _BUCKETS] + ["all"]:
                v = ratios.get(b)
                if v:
                    gm = math.exp(sum(map(math.log, v)) / len(v))
                    print(f"{what:11} {gran:5} M {b:8}: choice / fastest geomean {gm:.3f}, max {max(v):.2f}, "
                          f"within 1.2x in {sum(x <= 1.2 for x in v)} of {len(v)}")
            if untimed:
                print(f"{what:11} {gran:5} choices the sweep did not time: {dict(untimed)}")
    for line in ws_width_scores(rows, a.sms, a.wide_costs):
        print(line)


if __name__ == "__main__":
    main()
