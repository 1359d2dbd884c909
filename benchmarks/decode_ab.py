"""A/B of the decode FP8 linear: one launch (activation quantization inside the split-K GEMM,
:mod:`fp8linear.ops.fused_decode`) against two (act_quant, then the GEMM), under CUDA graphs
(GPU time) and eagerly (Fp8BlockLinear's planned forward, wall time per call of back-to-back calls,
the two layers' and a BF16 nn.Linear's bursts interleaved), on the DeepSeek-V3 shapes. Above 64 rows
"two" is the route the router picks eagerly without the one-launch kernel (CUTLASS where built).

    python benchmarks/decode_ab.py [--m 2 8 16 32 64] [--shapes 2112x7168 ...]
    python benchmarks/decode_ab.py --gemv   # M=1: the fused GEMV ("one") against the decode kernel ("two")
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fp8linear import Fp8BlockLinear, quantize_weight
from fp8linear.tools.shapes import DSV3_SHAPES, parse_shape
from fp8linear.tools.timing import rotation_sets, time_graph
from fp8linear.tools.bench_eager import interleaved_wall_us
from fp8linear.ops import router
from fp8linear.ops.linear import run_linear_route
from fp8linear.ops.splitk_gemm import splitk_counters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[2, 8, 16, 32, 64])
    p.add_argument("--shapes", nargs="+", help="NxK weight shapes (default: the DeepSeek-V3 ones)")
    p.add_argument("--gemv", action="store_true",
                   help="M=1 only: 'one' is the fused GEMV, 'two' the one-launch decode kernel")
    args = p.parse_args()
    dev = torch.device("cuda")
    router.ONE_LAUNCH_MAX_WEIGHT = 1 << 62  # A/B every shape, also those the router keeps on two launches
    router.ONE_LAUNCH_MAX_MNK = 1 << 62  # and every M asked for
    real_ok = router._one_launch_decode_ok
    if args.gemv:
        args.m = [1]
        router.FUSED_GEMV_MAX_WEIGHT = 0  # the router's eager rule alone decides

    def set_rule(one: bool) -> None:
        """Make route_linear(eager=True) pick the method `one` (True) or `two` (False)."""
        if args.gemv:
            router.EAGER_GEMV_MAX_WEIGHT = 1 << 62 if one else 0
        else:
            router._one_launch_decode_ok = real_ok if one else (lambda device: False)

    names = ("fused GEMV", "fused decode kernel") if args.gemv else ("fused decode kernel", "act_quant + GEMM")
    print(f"{torch.cuda.get_device_name()}; us per call; one = {names[0]}, two = {names[1]}")
    print(f"{'shape':>12s} {'M':>4s} {'graph one':>9s} {'graph two':>9s} {'ratio':>6s} {'eager one':>9s} {'eager two':>9s} "
          f"{'ratio':>6s} {'eager BF16':>10s}")
    ratios_g, ratios_e = [], []
    shapes = [(s.n, s.k) for s in map(parse_shape, args.shapes)] if args.shapes else [(n, k) for n, k, _ in DSV3_SHAPES]
    for n, k in shapes:
        w_q, w_s = quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "block")
        ws = splitk_counters(n, dev)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            sets = rotation_sets((x, w_q, w_s), w_q.numel() + x.numel() * 2, dev)
            res, layers = {}, {}
            xs = [s[0] for s in sets]
            for name, one in (("one", True), ("two", False)):
                set_rule(one)
                route = router.route_linear(dev, m, n, k, "block", w_q.dtype, x.dtype, None, True, True,
                                            eager=one or args.gemv)
                fn = lambda x, w_q, w_s, r=route: run_linear_route(r, x, w_q, w_s, "block", None, ws)  # noqa: E731
                res[name] = [time_graph(fn, sets)]  # GPU time of this route, whatever graphs would pick
                layers[name] = Fp8BlockLinear.from_quantized(w_q, w_s)
                layers[name](x)
                layers[name](x)  # a shape's second call makes its plan: its eager route, under this rule
                print(f"  {name}: {route.kernel} {route.config}")
            set_rule(True)
            bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            eager = interleaved_wall_us({**layers, "bf16": bf16}, xs)
            for name in res:
                res[name].append(eager[name])
            g, e = res["one"][0] / res["two"][0], res["one"][1] / res["two"][1]
            ratios_g.append(g)
            ratios_e.append(e)
            print(f"{n:>5d}x{k:<6d} {m:4d} {res['one'][0]:9.1f} {res['two'][0]:9.1f} {g:6.3f} {res['one'][1]:9.1f}"
                  f" {res['two'][1]:9.1f} {e:6.3f} {eager['bf16']:10.1f}")
    gm = lambda v: statistics.geometric_mean(v)  # noqa: E731
    print(f"geomean one/two: graph {gm(ratios_g):.3f} (max {max(ratios_g):.3f}), eager {gm(ratios_e):.3f}")


if __name__ == "__main__":
    main()
