"""Eager A/B on Hopper: Fp8BlockLinear plans whose route is the warp-specialized Gluon kernel
(fp8linear/ops/ws_gemm.py) against the same layer with that kernel turned off (the tiled kernel's
prepared launch), CUTLASS off in both (what a machine without ``fp8linear build-cutlass`` runs),
with BF16 ``nn.Linear`` in the same interleaved bursts: wall and host us per call, to place the
eager rule for the warp-specialized kernel.

    python benchmarks/eager_ws_ab.py [--m 200 333 512 1024 2048 4096]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from fp8linear import Fp8BlockLinear
from fp8linear.ops import router
from fp8linear.tools.bench_eager import _burst_times

SHAPES = ((2112, 7168), (1536, 7168), (7168, 18432), (18432, 7168), (4096, 14336))


def _layer(lin: nn.Linear, x: torch.Tensor, ws: bool) -> tuple[Fp8BlockLinear, str]:
    """An Fp8BlockLinear whose plan for x's shape was made without CUTLASS, with or without the
    warp-specialized kernel; and the route that plan runs."""
    layer = Fp8BlockLinear.from_linear(lin, "block")
    real = (router.cutlass_available, router.ws_device_ok)
    router.cutlass_available = lambda device: False
    if not ws:
        router.ws_device_ok = lambda device: False
    try:
        layer(x)
        layer(x)  # a shape's second call makes its plan
        route = router.route_linear(x.device, x.shape[0], lin.out_features, lin.in_features, "block",
                                    torch.float8_e4m3fn, x.dtype, None, True, True, eager=True,
                                    weight_contiguous=True)
    finally:
        router.cutlass_available, router.ws_device_ok = real
    return layer, route.kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[200, 333, 512, 1024, 2048, 4096])
    a = p.parse_args()
    dev = torch.device("cuda")
    for n, k in SHAPES:
        lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=dev)
        for m in a.m:
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device=dev) for _ in range(4)]
            with_ws, kind = _layer(lin, xs[0], True)
            without, kind_off = _layer(lin, xs[0], False)
            t = _burst_times({"bf16": lin, "ws": with_ws, "off": without}, xs, dev)
            print(f"{n:6}x{k:<6} M={m:5} routes {kind}/{kind_off}: " + " ".join(
                f"{name} wall {w:.1f} host {h:.1f}" for name, (w, h) in t.items())
                + f"  ws/off wall {t['ws'][0] / t['off'][0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
