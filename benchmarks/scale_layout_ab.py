"""1x128 weight scales read N-major (stride (1, N), the copy Fp8BlockLinear keeps) against the
checkpoint's K-major (row-major) layout, by our kernels as the router sends row-wise GEMMs to them.

Per (N, K, M) and each distinct route (the CUDA-graph route and the eager one, cuBLAS not allowed):
the GPU time of one call under CUDA graphs, weight, scales and activations rotated past L2, both
layouts interleaved, after checking they give the same bits. Prints per-kernel geometric means.

    python benchmarks/scale_layout_ab.py [--m 1 4 16 64 128 256 512 2048] [--shapes 2112x7168 ...]
"""

from __future__ import annotations

import argparse
import collections
import math

import torch

from fp8linear import quantize_weight
from fp8linear.ops import router
from fp8linear.ops.linear import run_linear_route
from fp8linear.ops.splitk_gemm import splitk_counters
from fp8linear.tools.shapes import parse_shape
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

SHAPES = ["2112x7168", "7168x2048", "24576x1536", "576x7168", "18432x7168", "1536x7168", "4096x14336"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64, 128, 256, 512, 2048])
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    args = p.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "; us per call; ratio = N-major / K-major")
    ratios: dict[str, list[float]] = collections.defaultdict(list)
    for shape in map(parse_shape, args.shapes):
        n, k = shape.n, shape.k
        w_q, w_s = quantize_weight((torch.randn(n, k, device=dev) * 0.05).to(torch.bfloat16), "row")
        w_sn = w_s.t().contiguous().t()
        counters = splitk_counters(n, dev)
        for m in args.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            routes = {}
            for eager in (False, True):
                r = router.route_linear(dev, m, n, k, "row", w_q.dtype, x.dtype, None, False, router.tma_ok(w_q),
                                        eager=eager, weight_contiguous=True)
                routes.setdefault((r.kernel, repr(r.config)), r)
            for (kernel, cfg), route in routes.items():
                def fn(x, w, s, route=route):
                    return run_linear_route(route, x, w, s, "row", None, counters)

                if not torch.equal(fn(x, w_q, w_s).view(torch.int16), fn(x, w_q, w_sn).view(torch.int16)):
                    raise AssertionError(f"{n}x{k} M={m} {kernel}: the two layouts gave different bits")
                rounds = {}
                for name, s in (("k", w_s), ("n", w_sn)):
                    nbytes = x.numel() * 2 + w_q.numel() + s.numel() * 4
                    rounds[name], _ = prepare_cuda(fn, rotation_sets((x, w_q, s), nbytes, dev), 3, graph_timer=True)
                t = time_rounds(rounds, 5)
                ratios[kernel].append(t["n"] / t["k"])
                print(f"{n:>6}x{k:<6} M={m:5} {kernel:8s} K-major {t['k']:8.1f} N-major {t['n']:8.1f} "
                      f"ratio {t['n'] / t['k']:.3f}  {cfg[:60]}", flush=True)
    for kernel, v in ratios.items():
        gm = math.exp(sum(map(math.log, v)) / len(v))
        print(f"{kernel}: {len(v)} cases, N-major / K-major geomean {gm:.3f} (min {min(v):.3f}, max {max(v):.3f})")


if __name__ == "__main__":
    main()
