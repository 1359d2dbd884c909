"""Kernel-development A/B: programmatic dependent launch (fp8linear/ops/pdl.py) at decode sizes.

For each shape and M <= 64, captures one CUDA graph per variant of the FP8 forward
(`fp8linear.fp8_linear`: act_quant + GEMM + bias) and of the GEMM alone, then replays them in
interleaved rounds (the benchmark's timer: operands rotated past the L2, median of rounds), so
clock drift reaches every variant alike. Variants:

    off     plain launches (the default)
    wait    the GEMM launched with PDL, act_quant never releases it early
    always  act_quant releases every GEMM early
    rule    what ships: the router's Route (early release except ahead of split-K GEMMs of K > 8192)

Needs a Hopper GPU. Prints a table and geometric means; writes pdl_ab.csv to $OUT or here.

    python benchmarks/pdl_ab.py [--m 1 2 4 8 16 32 64]
"""
import argparse
import contextlib
import csv
import dataclasses
import math
import os
import statistics

import torch

from fp8linear import block_fp8_matmul, fp8_linear, quantize_activation, quantize_weight
from fp8linear.tools.shapes import default_shapes
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds
from fp8linear.ops import gemm, linear, router
from fp8linear.ops.splitk_gemm import splitk_counters

VARIANTS = ("off", "wait", "always", "rule")


@contextlib.contextmanager
def variant(name: str):
    """Patch the router's PDL decisions for one variant while its graph is warmed up and captured:
    'off' no PDL, 'wait' PDL without early release, 'always' PDL with early release, 'rule' the router's."""
    saved = (linear.route_linear, gemm.route_gemm)

    def patched(route_fn):
        def route(*args, **kwargs):
            r = route_fn(*args, **kwargs)
            if name == "off":
                return dataclasses.replace(r, pdl=False, release_early=False)
            if name == "wait":
                return dataclasses.replace(r, release_early=False)
            if name == "always":
                return dataclasses.replace(r, release_early=r.pdl)
            return r
        return route

    linear.route_linear, gemm.route_gemm = patched(saved[0]), patched(saved[1])
    try:
        yield
    finally:
        linear.route_linear, gemm.route_gemm = saved


def main() -> None:
    os.environ["FP8LINEAR_PDL"] = "1"  # opt-in; the "off" variant patches it back out
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for shape in default_shapes():
        n, k = shape.n, shape.k
        w_q, w_s = quantize_weight(torch.randn(n, k, device=dev, generator=gen) * 0.02, "block")
        bias = torch.randn(n, device=dev, generator=gen, dtype=torch.bfloat16)
        ws = splitk_counters(n, dev)
        for m in args.m:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            x_q, x_s = quantize_activation(x)
            fwd_sets = rotation_sets((x, w_q, w_s, bias), n * k, dev)
            gemm_sets = rotation_sets((x_q, x_s, w_q, w_s), n * k, dev)
            rounds = {}
            for v in VARIANTS:
                with variant(v):
                    rounds[f"fwd_{v}"], _ = prepare_cuda(
                        lambda a, b, c, d: fp8_linear(a, b, c, d, counters=ws), fwd_sets, 3, True)
                    if v in ("off", "wait"):
                        rounds[f"gemm_{v}"], _ = prepare_cuda(
                            lambda a, b, c, d: block_fp8_matmul(a, b, c, d, counters=ws), gemm_sets, 3, True)
            t = time_rounds(rounds, 9)
            row = {"n": n, "k": k, "m": m, "split_k": router.splitk_config(m, n, k, dev) is not None, **t}
            rows.append(row)
            print(f"{n:6}x{k:<6} M={m:3} " + " ".join(f"{kk}={vv:6.2f}" for kk, vv in t.items()), flush=True)
    names = [k for k in rows[0] if k.startswith(("fwd_", "gemm_"))]

    def gm(vals):
        return math.exp(statistics.fmean(map(math.log, vals)))

    for subset, sel in (("all", lambda r: True), ("split-K", lambda r: r["split_k"]),
                        ("tiled/fused", lambda r: not r["split_k"])):
        rs = [r for r in rows if sel(r)]
        if not rs:
            continue
        print(f"{subset} ({len(rs)} cases), geomean vs off: "
              + " ".join(f"fwd_{v} {gm([r[f'fwd_{v}'] / r['fwd_off'] for r in rs]):.3f}" for v in VARIANTS[1:])
              + f" gemm_wait {gm([r['gemm_wait'] / r['gemm_off'] for r in rs]):.3f}"
              + "; fwd-gemm us mean/max " + " ".join(
                  f"{v} {statistics.fmean(r[f'fwd_{v}'] - r['gemm_off'] for r in rs):.2f}/"
                  f"{max(r[f'fwd_{v}'] - r['gemm_off'] for r in rs):.2f}" for v in VARIANTS))
    with open(os.path.join(os.environ.get("OUT", "."), "pdl_ab.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["n", "k", "m", "split_k"] + names)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
