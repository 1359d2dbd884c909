"""Eager A/B of the one-host-call CUTLASS plan (the library quantizes the input, the plan-call module
allocates, ``router.EAGER_ONE_CALL_MIN_M``) and of its programmatic dependent launch
(``cutlass_gemm.pdl_supported``): eager wall and host us per call, BF16 ``nn.Linear`` in the same
interleaved bursts. Columns: ``auto`` (the router), ``no-one-call`` (the router without the
one-call rule), ``graph-<kernel>`` (the route a CUDA-graph call of that shape runs, launched
eagerly: act_quant and our split-K, tiled or warp-specialized kernel, cuBLAS or CUTLASS),
``p64``/``p64x64``/``c128``/``c128x64`` (the CUTLASS kernels forced: 64x128 and 64x64 ping-pong,
128x128 and 128x64 cooperative; their GEMM launched plain) and ``p64-pdl`` ... ``c128x64-pdl``
(the same routes with ``Route.pdl``, the library's quantize-and-GEMM call launching both its kernels
with PDL, for the kernels the build made for it). Before timing, PDL and plain launches of each
kernel must give the same bits on 20 inputs each made by the kernel just before (else it stops).
Needs a Hopper GPU and ``fp8linear build-cutlass`` (the plan-call module included).

    python benchmarks/eager_one_call_ab.py [--m 16 64 96 256 333 512] [--shapes 2112x7168 7168x2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from fp8linear import Fp8BlockLinear
from fp8linear.ops import router
from fp8linear.ops.cutlass_gemm import CutlassConfig, cutlass_available, one_call_available, pdl_supported
from fp8linear.tools.bench_eager import _burst_times

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_cutlass_ab import _forced_layer  # noqa: E402

# the CUTLASS kernels forced: 64x128 ping-pong, 64x64 ping-pong, 128x128 and 128x64 cooperative
FORCED = {"p64": CutlassConfig(64), "p64x64": CutlassConfig(64, tile_n=64), "c128": CutlassConfig(128),
          "c128x64": CutlassConfig(128, tile_n=64)}
SHAPES = ("2112x7168", "7168x2048", "1536x7168", "24576x1536", "576x7168", "4096x4096", "7168x18432",
          "18432x7168")


def _route_layer(lin: nn.Linear, x: torch.Tensor, route: router.Route) -> nn.Module:
    """An Fp8BlockLinear whose plan for x's shape runs `route` (eagerly and under capture alike)."""
    layer = Fp8BlockLinear.from_linear(lin, "block")
    real = router.route_linear
    router.route_linear = lambda *a, **k: route
    try:
        layer(x)
        layer(x)  # a shape's second call makes its plan
    finally:
        router.route_linear = real
    return layer


def _layers(lin: nn.Linear, x: torch.Tensor) -> dict[str, nn.Module]:
    layers = {"auto": _forced_layer(lin, x, None)}
    real_min_m = router.EAGER_ONE_CALL_MIN_M
    router.EAGER_ONE_CALL_MIN_M = 1 << 62
    try:
        layers["no-one-call"] = _forced_layer(lin, x, None)
    finally:
        router.EAGER_ONE_CALL_MIN_M = real_min_m
    m, k = x.shape
    graph = router.route_linear(x.device, m, lin.out_features, k, "block", torch.float8_e4m3fn, torch.bfloat16,
                                None, True, True, eager=False, weight_contiguous=True)
    layers[f"graph-{graph.kernel}"] = _route_layer(lin, x, graph)  # what CUDA graphs run, launched eagerly
    for name, cfg in FORCED.items():
        layers[name] = _route_layer(lin, x, router.Route("cutlass", cfg))
        if pdl_supported(cfg):
            layers[f"{name}-pdl"] = _route_layer(lin, x, router.Route("cutlass", cfg, pdl=True))
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[16, 64, 96, 160, 256, 333, 512])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = p.parse_args()
    dev = torch.device("cuda")
    if not cutlass_available(dev) or not one_call_available():
        raise SystemExit("needs the CUTLASS kernels and the plan-call module (`fp8linear build-cutlass`)")
    print(f"{torch.cuda.get_device_name()}; per method: eager wall us / host us")
    auto_bf16, auto_old, pdl_plain = [], [], {}
    for text in args.shapes:
        n, k = (int(v) for v in text.split("x"))
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        for m in args.m:
            if m * k > router.LIB_QUANT_MAX_ELEMENTS:
                continue  # the library quantizes no input this large
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                  for _ in range(max(2, min(16, (100 << 20) // (m * k * 2))))]
            layers = _layers(lin, xs[0])
            with torch.inference_mode():
                for name in [nm for nm in layers if nm.endswith("-pdl")]:
                    plain = layers[name.removesuffix("-pdl")]
                    for i in range(20):
                        a = plain(xs[i % len(xs)] * 1.0)
                        b = layers[name](xs[i % len(xs)] * 1.0)
                        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                            raise SystemExit(f"{name} at {n}x{k} M={m}: bits differ from the plain launch "
                                             f"(call {i}): its kernels do not wait for what they read")
                times = _burst_times({"bf16": lin, **layers}, xs, dev)
            routes = [next(iter(layers[nm]._plans.values())).route.kernel for nm in ("auto", "no-one-call")]
            auto_bf16.append(times["auto"][0] / times["bf16"][0])
            auto_old.append(times["auto"][0] / times["no-one-call"][0])
            ratios = {nm: times[f"{nm}-pdl"][0] / times[nm][0] for nm in FORCED if f"{nm}-pdl" in times}
            for nm, r in ratios.items():
                pdl_plain.setdefault(nm, []).append(r)
            cells = " ".join(f"{nm}={w:6.1f}/{h:5.1f}" for nm, (w, h) in times.items())
            pdl_cells = " ".join(f"{nm} pdl/plain {r:.3f}" for nm, r in ratios.items())
            print(f"{n:>5d}x{k:<5d} M={m:<4d} {cells}  auto/bf16 {auto_bf16[-1]:.3f} "
                  f"auto/no-one-call {auto_old[-1]:.3f} {pdl_cells}  routes {','.join(routes)}", flush=True)
    pdl_cells = ", ".join(f"{nm} pdl/plain {statistics.geometric_mean(r):.3f}" for nm, r in pdl_plain.items())
    pdl_cells = pdl_cells or "no kernel built for PDL"
    print(f"geomean over {len(auto_bf16)} cases: auto/bf16 {statistics.geometric_mean(auto_bf16):.3f}, "
          f"auto/no-one-call {statistics.geometric_mean(auto_old):.3f}, {pdl_cells}; auto slower than BF16 in "
          f"{sum(r > 1 for r in auto_bf16)}")


if __name__ == "__main__":
    main()
